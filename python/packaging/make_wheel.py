"""Writes Ember's wheel from built artifacts (scripts/wheel.sh calls it).

    make_wheel.py --extension=_ember.so --emberctl=emberctl --out=dist

The wheel holds:
  ember/               the package's .py files, _ember.so, bin/emberctl
  ember.libs/          every shared library those two load, but glibc's and
                       the C++ runtime's (the system's, as manylinux allows),
                       each with RUNPATH $ORIGIN; _ember.so and emberctl find
                       them through their own RUNPATH
  ember-V.dist-info/   METADATA from pyproject.toml's [project], WHEEL
                       (tagged for this interpreter and platform),
                       entry_points.txt (the emberctl console script), RECORD
"""

import argparse
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))

# Left to the system (glibc, the dynamic loader, the C++ runtime): what a
# manylinux wheel may link without carrying.
SYSTEM = re.compile(r"^(linux-vdso|ld-linux|libc|libm|libpthread|libdl|librt|libutil|"
                    r"libresolv|libstdc\+\+|libgcc_s)\b")


def shared_libs(binary):
    """The resolved paths of what `binary` loads (ldd), system ones left out."""
    out = subprocess.run(["ldd", binary], check=True, capture_output=True, text=True).stdout
    libs = {}
    for line in out.splitlines():
        m = re.match(r"\s*(\S+) => (\S+)", line)
        if not m:
            continue
        name, path = m.groups()
        if path == "not":
            sys.exit(f"make_wheel: {binary} needs {name}, which is not found")
        if not SYSTEM.match(name):
            libs[name] = path
    return libs


def patch(path, rpath):
    subprocess.run(["patchelf", "--set-rpath", rpath, path], check=True)


def record_line(root, rel):
    with open(os.path.join(root, rel), "rb") as f:
        data = f.read()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{rel},sha256={digest},{len(data)}"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--extension", required=True, help="the built _ember.so")
    p.add_argument("--emberctl", required=True, help="the built emberctl")
    p.add_argument("--out", default="dist", help="directory for the wheel")
    args = p.parse_args()

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    name, version = project["name"], project["version"]
    with open(os.path.join(ROOT, "python", "ember", "__init__.py")) as f:
        m = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M)
    if m is None or m.group(1) != version:
        sys.exit(f"make_wheel: ember.__version__ is {m and m.group(1)!r}, pyproject.toml's "
                 f"version {version!r}")
    py = f"cp{sys.version_info.major}{sys.version_info.minor}"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    tag = f"{py}-{py}-{platform}"

    stage = tempfile.mkdtemp(prefix="ember-wheel-")
    try:
        pkg = os.path.join(stage, "ember")
        libs_dir = os.path.join(stage, "ember.libs")
        os.makedirs(os.path.join(pkg, "bin"))
        os.makedirs(libs_dir)
        src = os.path.join(ROOT, "python", "ember")
        for f in sorted(os.listdir(src)):
            if f.endswith(".py"):
                shutil.copy(os.path.join(src, f), pkg)
        ext = os.path.join(pkg, "_ember.so")
        ctl = os.path.join(pkg, "bin", "emberctl")
        shutil.copy(args.extension, ext)
        shutil.copy(args.emberctl, ctl)
        os.chmod(ext, 0o755)
        os.chmod(ctl, 0o755)
        libs = {}
        for binary in (args.extension, args.emberctl):
            libs.update(shared_libs(binary))
        for soname, path in sorted(libs.items()):
            dst = os.path.join(libs_dir, soname)
            shutil.copy(path, dst)
            os.chmod(dst, 0o755)
            patch(dst, "$ORIGIN")
        patch(ext, "$ORIGIN/../ember.libs")
        patch(ctl, "$ORIGIN/../../ember.libs")

        info = os.path.join(stage, f"{name}-{version}.dist-info")
        os.makedirs(info)
        meta = [
            "Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}",
            f"Summary: {project['description']}",
            f"Requires-Python: {project['requires-python']}",
            f"License: {project.get('license', {}).get('text', '')}",
        ]
        meta += [f"Requires-Dist: {d}" for d in project.get("dependencies", [])]
        for extra, deps in project.get("optional-dependencies", {}).items():
            meta.append(f"Provides-Extra: {extra}")
            meta += [f"Requires-Dist: {d}; extra == \"{extra}\"" for d in deps]
        with open(os.path.join(ROOT, project.get("readme", "README.md"))) as f:
            readme = f.read()
        with open(os.path.join(info, "METADATA"), "w") as f:
            f.write("\n".join(meta) + "\nDescription-Content-Type: text/markdown\n\n" + readme)
        with open(os.path.join(info, "WHEEL"), "w") as f:
            f.write(f"Wheel-Version: 1.0\nGenerator: ember make_wheel\nRoot-Is-Purelib: false\n"
                    f"Tag: {tag}\n")
        with open(os.path.join(info, "entry_points.txt"), "w") as f:
            f.write("[console_scripts]\n")
            for script, target in project.get("scripts", {}).items():
                f.write(f"{script} = {target}\n")

        files = []
        for d, _, names in os.walk(stage):
            for n in names:
                files.append(os.path.relpath(os.path.join(d, n), stage))
        record = f"{name}-{version}.dist-info/RECORD"
        lines = [record_line(stage, rel) for rel in sorted(files)] + [f"{record},,"]
        with open(os.path.join(stage, record), "w") as f:
            f.write("\n".join(lines) + "\n")

        os.makedirs(args.out, exist_ok=True)
        wheel = os.path.join(args.out, f"{name}-{version}-{tag}.whl")
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as z:
            for rel in sorted(files) + [record]:
                # dist-info last, as pip expects; executables keep their mode.
                z.write(os.path.join(stage, rel), rel)
        size = os.path.getsize(wheel)
        print(f"make_wheel: {wheel} ({size / 2**20:.1f} MiB; {len(libs)} bundled libraries)")
    finally:
        shutil.rmtree(stage)


if __name__ == "__main__":
    main()
