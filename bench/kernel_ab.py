#!/usr/bin/env python3
"""Two kernel_bench configurations timed in turn: the median ratio B / A.

A benchmark, not a test. Starts two `kernel_bench --serve` processes (each
sets its tables up once), then asks them in turn for fresh forward and
backward timings, --pairs times, and prints the median and range of the
pairs' ratios B / A (> 1: B is faster). Each side is a kernel_bench binary
and its flags, so one tool compares two builds on one configuration
(binaries before and after a change) or two configurations of one build
(fp16 against fp32 weights, two prefetch styles).

On a VM whose memory speed moves within seconds, separate runs minutes
apart cannot resolve differences of 10-30%; timings seconds apart, in
turn, can (docs/lab-notes/2026-11-benchmarks.md).

  bench/kernel_ab.py --a="bazel-bin/bench/kernel_bench --dtype=fp32" \\
      --b="bazel-bin/bench/kernel_bench --dtype=fp16" -- --dim=32 --id_sets=16

Flags after `--` go to both sides. The two processes hold their tables at
the same time (twice the memory of one).
"""

import argparse
import shlex
import statistics
import sys

from kernel_bench_server import KernelBenchServer


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="side A: a kernel_bench binary and its flags")
    p.add_argument("--b", required=True, help="side B: a kernel_bench binary and its flags")
    p.add_argument("--pairs", type=int, default=8, help="timings per side, taken in turn (A, B, A, ...)")
    p.add_argument("--pause", type=float, default=0.25,
                   help="seconds between timings (a side's threads may still spin after its call)")
    p.add_argument("common", nargs="*", help="flags for both sides (after --)")
    args = p.parse_args()
    if args.pairs < 1:
        p.error("--pairs must be >= 1")
    return args


def main():
    args = parse_args()
    a = KernelBenchServer(shlex.split(args.a) + args.common, "kernel_ab: side A")
    b = KernelBenchServer(shlex.split(args.b) + args.common, "kernel_ab: side B")
    sides = {"A": a, "B": b}
    rows = {"forward": ([], [], []), "backward": ([], [], [])}  # A rates, B rates, ratios
    try:
        for i in range(args.pairs):
            # Which side goes first alternates, so neither always follows the other.
            order = ("A", "B") if i % 2 == 0 else ("B", "A")
            got = {}
            for name in order:
                got[name] = sides[name].measure(args.pause)
            for what, key in (("forward", "lookups_per_s"), ("backward", "bwd_lookups_per_s")):
                ra, rb, ratio = rows[what]
                ra.append(got["A"][key])
                rb.append(got["B"][key])
                ratio.append(got["B"][key] / got["A"][key])
            print(f"  pair {i + 1}/{args.pairs}: forward B/A {rows['forward'][2][-1]:.3f}, "
                  f"backward B/A {rows['backward'][2][-1]:.3f}", file=sys.stderr, flush=True)
    finally:
        a.close()
        b.close()
    print(f"A: {args.a} {' '.join(args.common)}")
    print(f"B: {args.b} {' '.join(args.common)}")
    for what, (ra, rb, ratio) in rows.items():
        print(f"{what:8s}  A {statistics.median(ra):.4g}  B {statistics.median(rb):.4g} ids/s  "
              f"B/A {statistics.median(ratio):.3f} [{min(ratio):.2f}-{max(ratio):.2f}]  "
              f"({args.pairs} pairs)")


if __name__ == "__main__":
    main()
