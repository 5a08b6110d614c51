#!/usr/bin/env python3
"""Checks the layers of docs/design.md against the code, twice over.

1. Includes: every non-test source file includes project headers only from
   the packages its layer may see (INCLUDES below). Bazel 4 has no layering
   check, so a header reached through a transitive dependency would compile.
2. Build graph: `bazel query` finds no forbidden dependency path between
   library targets (QUERIES below). Visibility already refuses a new direct
   edge to a private target; these catch an edge made legal by widening a
   visibility list.

Prints one line per rule, "layers RULE: ok" or "layers RULE: FAILED" with
the offending files or paths, and exits non-zero if any rule failed.
scripts/test.sh runs it and counts each rule as one test.

  python3 scripts/check_layers.py [--no-query]
"""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Project directories whose headers are checked (everything else, such as
# absl/ or gtest/, is a third-party include and not ruled on here).
PROJECT = ("bench/", "cli/", "client/", "cuda/", "examples/", "link/", "math/",
           "planner/", "proto/", "python/", "server/", "tests/")

# Layer name -> (directory of its files, prefixes of the headers they may
# include). A file matches the longest directory; per-file exceptions follow.
INCLUDES = {
    "math": ("math/", ["math/"]),
    "cuda": ("cuda/", ["cuda/", "math/"]),
    "link": ("link/", ["link/", "cuda/cuda_status.h"]),
    # The planner sizes tables by what the backends hold (math/): the
    # optimizers' state layout and a dynamic table's index; and prices a
    # cache by the hit-rate curve its shards learn (math/hit_rate_curve.h).
    "planner": ("planner/", ["planner/", "proto/", "math/embedding_math.h", "math/key_index.h",
                             "math/rowwise_quant.h", "math/hit_rate_curve.h"]),
    "common": ("server/common/", ["server/common/", "proto/"]),
    "backend": ("server/backend/", ["server/backend/embedding_backend.h",
                                    "server/backend/overflow_guard.h",
                                    "server/backend/shard_registry.h",
                                    "server/backend/backend_factory.h",
                                    "server/backend/table_spec.h",
                                    "server/common/", "math/", "proto/"]),
    "backend/cpu": ("server/backend/cpu/", ["server/backend/cpu/",
                                            "server/backend/embedding_backend.h",
                                            "server/backend/overflow_guard.h",
                                            "server/backend/shard_registry.h",
                                            "server/common/", "math/"]),
    "backend/cuda": ("server/backend/cuda/", ["server/backend/cuda/",
                                              "server/backend/embedding_backend.h",
                                              "server/backend/overflow_guard.h",
                                              "server/backend/shard_registry.h",
                                              "server/common/", "cuda/", "math/"]),
    # Hash-keyed shards over any backend's fixed ones (the overflow guard:
    # its refusals name a slot, renamed to the id).
    "backend/dynamic": ("server/backend/dynamic/", ["server/backend/dynamic/",
                                                    "server/backend/embedding_backend.h",
                                                    "server/backend/forwarding_backend.h",
                                                    "server/backend/overflow_guard.h",
                                                    "server/common/", "math/"]),
    # Rows on local SSD under a cache in memory, over any backend's shards
    # (the overflow guard: its refusals name a cache slot, renamed to the row).
    "backend/key_value": ("server/backend/key_value/", ["server/backend/key_value/",
                                                        "server/backend/embedding_backend.h",
                                                        "server/backend/forwarding_backend.h",
                                                        "server/backend/overflow_guard.h",
                                                        "server/common/", "math/"]),
    # Which rows changed, over any backend's shards.
    "backend/changes": ("server/backend/changes/", ["server/backend/changes/",
                                                    "server/backend/embedding_backend.h",
                                                    "server/backend/forwarding_backend.h",
                                                    "server/common/", "math/"]),
    "checkpoint": ("server/checkpoint/", ["server/checkpoint/", "server/common/", "proto/",
                                          "server/backend/embedding_backend.h"]),
    "worker": ("server/worker/", ["server/worker/", "server/checkpoint/", "server/common/",
                                  "link/", "proto/",
                                  "server/backend/embedding_backend.h",
                                  "server/backend/overflow_guard.h",
                                  "server/backend/backend_factory.h",
                                  "server/backend/table_spec.h"]),
    "coordinator": ("server/coordinator/", ["server/coordinator/", "server/checkpoint/",
                                            "server/common/", "planner/", "proto/",
                                            "server/backend/embedding_backend.h",
                                            "server/backend/table_spec.h"]),
    # The client reads plans through the one plan view (the replica rule).
    "client": ("client/", ["client/", "server/common/", "link/", "proto/",
                           "planner/plan_view.h"]),
}

# Files allowed more than their layer: the factory picks a backend, and the
# client's in-process collection is the one client -> backend edge.
EXTRA = {
    "server/backend/backend_factory.cc": ["server/backend/cpu/", "server/backend/cuda/",
                                          "server/backend/dynamic/dynamic_backend.h",
                                          "server/backend/changes/change_tracking.h",
                                          "server/backend/key_value/key_value_backend.h",
                                          "cuda/device_query.h"],
    "client/inprocess.h": ["server/backend/embedding_backend.h",
                           "server/backend/cpu/cpu_backend.h"],
    "client/inprocess.cc": ["server/backend/embedding_backend.h",
                            "server/backend/table_spec.h",
                            "server/backend/cpu/cpu_backend.h",
                            "server/backend/dynamic/dynamic_backend.h",
                            "planner/spec_validation.h"],
}

# Public headers that must not name what lies behind them: the client's
# header is a pimpl (Client::Impl in client.cc) over its transports.
HIDDEN = {
    "client/client.h": ["client/shm_channel.h", "client/transport.h", "link/"],
}

INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def is_test(path):
    base = os.path.basename(path)
    return (base.endswith("_test.cc") or base.startswith("fake_") or
            base in ("forwarding_backend.h", "concurrency_checks.h"))


def layer_of(path):
    best = None
    for name, (directory, _) in INCLUDES.items():
        if path.startswith(directory) and (best is None or
                                           len(directory) > len(INCLUDES[best][0])):
            best = name
    return best


def include_violations(path, text):
    """The project headers `path` includes that its layer may not see."""
    layer = layer_of(path)
    if layer is None or is_test(path):
        return []
    allowed = INCLUDES[layer][1] + EXTRA.get(path, [])
    bad = []
    for header in INCLUDE_RE.findall(text):
        if any(header.startswith(h) for h in HIDDEN.get(path, [])):
            bad.append("%s includes %s, which it hides" % (path, header))
        elif header.startswith(PROJECT) and not any(
                header == a or (a.endswith("/") and header.startswith(a)) for a in allowed):
            bad.append("%s includes %s" % (path, header))
    return bad


def check_includes():
    files = subprocess.check_output(["git", "ls-files", "--cached", "--others",
                                     "--exclude-standard"], cwd=ROOT, text=True).split()
    by_layer = {name: [] for name in INCLUDES}
    for path in files:
        if not path.endswith((".h", ".cc", ".cu")) or not os.path.exists(os.path.join(ROOT, path)):
            continue
        layer = layer_of(path)
        if layer is None:
            continue
        with open(os.path.join(ROOT, path), encoding="utf-8", errors="replace") as f:
            by_layer[layer] += include_violations(path, f.read())
    return [("includes " + name, bad) for name, bad in by_layer.items()]


def self_check():
    """The include rule refuses what it should (a check that cannot fail is
    no check): a planner file reaching into the server, a worker file naming
    a concrete backend, a kernel including the backend interface."""
    cases = [
        ("planner/planner.cc", '#include "server/common/wire.h"\n'),
        ("planner/cost_model.cc", '#include "math/half.h"\n'),
        ("server/worker/worker_service.cc", '#include "server/backend/cpu/cpu_backend.h"\n'),
        ("cuda/tbe_kernels.cu", '#include "server/backend/embedding_backend.h"\n'),
        ("link/peer_link.cc", '#include "cuda/tbe_kernels.h"\n'),
        ("client/client.cc", '#include "server/backend/embedding_backend.h"\n'),
        ("client/client.cc", '#include "planner/planner.h"\n'),
        ("client/client.h", '#include "client/shm_channel.h"\n'),
    ]
    missed = [p for p, text in cases if not include_violations(p, text)]
    allowed = [("client/inprocess.cc", '#include "server/backend/cpu/cpu_backend.h"\n'),
               ("client/client.cc", '#include "planner/plan_view.h"\n'),
               ("cuda/kernel_bodies.h", '#include "math/half.h"\n#include "absl/types/span.h"\n')]
    wrongly = [p for p, text in allowed if include_violations(p, text)]
    return ("self-check", ["not refused: " + p for p in missed] +
            ["wrongly refused: " + p for p in wrongly])


# The two shapes of a rule, as queries that must come back empty.
def libs(package):
    """A package's libraries, tests' helpers left out."""
    return 'kind("cc_library", {0}) except attr(testonly, 1, {0})'.format(package)


def only_within(targets, allowed):
    """`targets` depend on nothing in the repository outside `allowed`."""
    return "deps(%s) intersect //... except (%s)" % (targets, " + ".join(allowed))


def never_reach(targets, forbidden, direct=False, exempt=None):
    """`targets` reach none of `forbidden` (`direct`: as direct deps only)."""
    query = "deps(%s%s) intersect (%s)" % (targets, ", 1" if direct else "",
                                           " + ".join(forbidden))
    return query + (" except " + exempt if exempt else "")


# Rule name -> its query.
QUERIES = {
    "math depends on nothing": only_within(libs("//math:all"), ["//math/..."]),
    "kernels know no backend, worker or proto": only_within(
        libs("//cuda:all"), ["//cuda/...", "//math/...", "//third_party/..."]),
    "link sees only the CUDA runtime seam": only_within(
        libs("//link:all"), ["//link/...", "//cuda:cuda_status", "//third_party/..."]),
    "planner depends only on the protos (and the arithmetic's sizes)": only_within(
        libs("//planner:all"), ["//planner/...", "//proto/...", "//math/...", "//third_party/..."]),
    "backend interface below every backend": only_within(
        "//server/backend:embedding_backend + //server/backend:overflow_guard",
        ["//server/backend:all", "//math/...", "//server/common:id_range", "//third_party/..."]),
    "server/common depends on no server layer": never_reach(
        libs("//server/common:all"), ["//server/backend/...", "//server/worker/...",
                                      "//server/coordinator/...", "//server/checkpoint/...",
                                      "//planner/..."]),
    "worker sees the backend interface and factory only": never_reach(
        libs("//server/worker:all"),
        ["//server/backend/cpu/...", "//server/backend/cuda/...", "//cuda/..."], direct=True),
    "worker knows no coordinator, planner or client": never_reach(
        libs("//server/worker:all"), ["//server/coordinator/...", "//planner/...", "//client/..."]),
    "coordinator knows no worker, backend or device": never_reach(
        libs("//server/coordinator:all"),
        ["//server/worker/...", "//server/backend/cpu/...", "//server/backend/cuda/...",
         "//cuda/...", "//link/...", "//client/..."]),
    "client reaches servers over RPC only (inprocess aside)": never_reach(
        libs("//client:all") + " except //client:inprocess",
        ["//server/backend/...", "//server/worker/...", "//server/coordinator/...",
         "//planner/..."], exempt="//planner:plan_view"),
}


def check_queries():
    results = []
    for name, query in QUERIES.items():
        proc = subprocess.run(["bazel", "query", "--noshow_progress", query], cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            results.append((name, ["bazel query failed: " + proc.stderr.strip()[-400:]]))
            continue
        found = [line for line in proc.stdout.split("\n") if line.strip()]
        results.append((name, ["reaches " + t for t in found]))
    return results


def main():
    results = [self_check()] + check_includes()
    if "--no-query" not in sys.argv[1:]:
        results += check_queries()
    failed = 0
    for name, bad in results:
        if bad:
            failed += 1
            print("layers %s: FAILED" % name)
            for line in bad:
                print("    " + line)
        else:
            print("layers %s: ok" % name)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
