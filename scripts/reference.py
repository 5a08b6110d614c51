"""Generates the references a user reads, and checks the docs' links.

    python3 scripts/reference.py            # writes docs/reference/*.md
    python3 scripts/reference.py --check    # each check as "docs CHECK: ok|FAILED"

- docs/reference/protos.md: every message, enum and field of proto/*.proto
  (the spec, plan and service contract; JSON uses the field names shown),
  with the comments written beside them in the .proto files.
- docs/reference/python.md: the public API of `ember`, `ember.torch` and
  `ember.torchrec`
  (classes, methods, functions, their signatures and docstrings), imported
  from the package as built (needs _ember.so: run after a build, with the
  .venv's python for ember.torch).

--check regenerates both in memory and fails when a checked-in file differs
(a docstring or .proto changed without `scripts/reference.py`), and checks
that every relative link in README.md and docs/**/*.md names a file that
exists (and, with #anchor, a heading in it).
"""

import argparse
import inspect
import os
import re
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
OUT = os.path.join(ROOT, "docs", "reference")


# ---------------------------------------------------------------- protos

def parse_proto(path):
    """[(kind, qualified name, comment, [(field, type, number, comment)])]
    in file order: messages (nested ones qualified) and enums."""
    items, stack, pending = [], [], []
    with open(path) as f:
        lines = f.read().splitlines()
    for line in lines:
        s = line.strip()
        if s.startswith("//"):
            pending.append(s[2:].strip())
            continue
        if not s:
            pending = []
            continue
        m = re.match(r"(message|enum|service)\s+(\w+)\s*\{", s)
        if m:
            name = ".".join([x[1] for x in stack] + [m.group(2)])
            entry = (m.group(1), name, " ".join(pending), [])
            items.append(entry)
            stack.append((entry, m.group(2)))
            pending = []
            continue
        if s.startswith("}"):
            if stack:
                stack.pop()
            pending = []
            continue
        if not stack:
            pending = []
            continue
        body = s.split("//", 1)
        trailing = body[1].strip() if len(body) > 1 else ""
        decl = body[0].strip().rstrip(";")
        comment = " ".join(pending + ([trailing] if trailing else []))
        pending = []
        kind = stack[-1][0][0]
        if kind == "enum":
            m = re.match(r"(\w+)\s*=\s*(-?\d+)", decl)
            if m:
                stack[-1][0][3].append((m.group(1), "", m.group(2), comment))
        elif kind == "service":
            m = re.match(r"rpc\s+(\w+)\s*\((\w+)\)\s*returns\s*\((\w+)\)", decl)
            if m:
                stack[-1][0][3].append((m.group(1), f"{m.group(2)} → {m.group(3)}", "", comment))
        else:
            m = re.match(r"((?:optional|repeated)\s+)?(map<[^>]+>|[\w.]+)\s+(\w+)\s*=\s*(\d+)",
                         decl)
            if m:
                label = (m.group(1) or "").strip()
                typ = f"{label} {m.group(2)}".strip()
                stack[-1][0][3].append((m.group(3), typ, m.group(4), comment))
    return items


def cell(text):
    return text.replace("|", "\\|")


def protos_md():
    out = ["# Spec, plan and service reference (generated)", "",
           "Generated from `proto/*.proto` by `scripts/reference.py`; do not edit. JSON "
           "(specs, plans, the Python SDK's dicts) uses these field names (lowerCamel is "
           "accepted too) and enum values by name. A field marked `optional` tells \"unset\" "
           "from 0.", ""]
    for name in ("collection.proto", "plan.proto", "service.proto"):
        out += [f"## {name}", ""]
        for kind, qname, comment, fields in parse_proto(os.path.join(ROOT, "proto", name)):
            out += [f"### {kind} `{qname}`", ""]
            if comment:
                out += [comment, ""]
            if not fields:
                continue
            if kind == "enum":
                out += ["| value | number | meaning |", "|---|---|---|"]
                out += [f"| `{f}` | {n} | {cell(c)} |" for f, _, n, c in fields]
            elif kind == "service":
                out += ["| rpc | request → response | meaning |", "|---|---|---|"]
                out += [f"| `{f}` | {cell(t)} | {cell(c)} |" for f, t, _, c in fields]
            else:
                out += ["| field | type | number | meaning |", "|---|---|---|---|"]
                out += [f"| `{f}` | `{cell(t)}` | {n} | {cell(c)} |" for f, t, n, c in fields]
            out.append("")
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------- python

def doc_of(obj):
    d = inspect.getdoc(obj)
    return d.strip() if d else "(no docstring)"


def signature(obj):
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"


def public(module):
    names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
    out = []
    for n in names:
        obj = getattr(module, n, None)
        if obj is None or inspect.ismodule(obj):
            continue
        if getattr(obj, "__module__", None) not in (module.__name__, "ember._errors"):
            continue
        if inspect.isclass(obj) or inspect.isfunction(obj):
            out.append((n, obj))
    return out


def python_md():
    sys.path.insert(0, os.path.join(ROOT, "python"))
    import ember
    modules = [ember]
    try:
        import ember.torch
        import ember.torchrec
        modules += [ember.torch, ember.torchrec]
    except ImportError as e:  # no torch: say so rather than drop it silently
        raise SystemExit(f"reference: ember.torch / ember.torchrec do not import ({e}); run "
                         "with the .venv's python")
    out = ["# Python API reference (generated)", "",
           "Generated from the docstrings of `ember`, `ember.torch` and `ember.torchrec` by "
           "`scripts/reference.py`; do not edit.", ""]
    for module in modules:
        out += [f"## `{module.__name__}`", "", doc_of(module), ""]
        errors = []
        for name, obj in public(module):
            if inspect.isclass(obj) and issubclass(obj, Exception):
                errors.append(name)
                continue
            if inspect.isclass(obj):
                out += [f"### class `{module.__name__}.{name}{signature(obj)}`", "", doc_of(obj), ""]
                # Its own members and those it inherits from ember's classes
                # (not torch.nn.Module's).
                members = {}
                for cls in reversed(obj.__mro__):
                    if cls.__module__.startswith("ember"):
                        members.update(vars(cls))
                for mname, m in sorted(members.items()):
                    if mname.startswith("_") and mname != "__init__":
                        continue
                    if mname == "__init__" or not (inspect.isfunction(m) or
                                                   isinstance(m, (property, classmethod,
                                                                  staticmethod))):
                        continue
                    target = m.fget if isinstance(m, property) else getattr(m, "__func__", m)
                    sig = "" if isinstance(m, property) else signature(target)
                    label = "property" if isinstance(m, property) else "method"
                    out += [f"#### {label} `{name}.{mname}{sig}`", "", doc_of(target), ""]
            else:
                out += [f"### function `{module.__name__}.{name}{signature(obj)}`", "",
                        doc_of(obj), ""]
        if errors:
            out += ["### errors", "",
                    "Each is an `ember.EmberError` with `.code` (the gRPC status code) and "
                    "the server's message: " + ", ".join(f"`{e}`" for e in errors) + ".", ""]
    return "\n".join(out).rstrip() + "\n"


# ---------------------------------------------------------------- links

def anchors(path):
    """GitHub's anchors for a Markdown file's headings."""
    out = set()
    with open(path) as f:
        for line in f:
            m = re.match(r"#+\s+(.*)", line)
            if m:
                a = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
                out.add(a)
    return out


def broken_links():
    files = [os.path.join(ROOT, "README.md")]
    for d, _, names in os.walk(os.path.join(ROOT, "docs")):
        files += [os.path.join(d, n) for n in names if n.endswith(".md")]
    bad = []
    for path in sorted(files):
        with open(path) as f:
            text = f.read()
        text = re.sub(r"```.*?```", "", text, flags=re.S)  # code blocks hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # a URL
                continue
            file_part, _, anchor = target.partition("#")
            dest = path if not file_part else os.path.normpath(
                os.path.join(os.path.dirname(path), file_part))
            rel = os.path.relpath(path, ROOT)
            if not os.path.exists(dest):
                bad.append(f"{rel}: {target} (no such file)")
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                bad.append(f"{rel}: {target} (no such heading)")
    return bad


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true")
    args = p.parse_args()
    generated = {"protos.md": protos_md(), "python.md": python_md()}
    if not args.check:
        os.makedirs(OUT, exist_ok=True)
        for name, text in generated.items():
            with open(os.path.join(OUT, name), "w") as f:
                f.write(text)
            print(f"reference: wrote docs/reference/{name}")
        return 0
    failed = 0
    for name, text in generated.items():
        path = os.path.join(OUT, name)
        current = open(path).read() if os.path.exists(path) else None
        ok = current == text
        print(f"docs reference {name}: {'ok' if ok else 'FAILED'}")
        if not ok:
            print(f"    docs/reference/{name} is not what the sources give: run "
                  "scripts/reference.py")
            failed += 1
    bad = broken_links()
    print(f"docs links: {'ok' if not bad else 'FAILED'}")
    for b in bad:
        print(f"    {b}")
    return 1 if failed or bad else 0


if __name__ == "__main__":
    sys.exit(main())
