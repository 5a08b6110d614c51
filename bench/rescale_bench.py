#!/usr/bin/env python3
"""Live moves while training: a collection scaled from 2 workers to 3, or drained.

A benchmark, not a test. On a local cluster of 3 CPU workers (`emberctl
up`), a collection of --gib GiB of fp32 tables (4 tables of dim --dim,
row-wise Adagrad, row_wise sharding) is created and scaled to 2 workers
(setup); then a trainer thread applies updates (batches of --batch ids per
table) without pause while the collection is scaled from 2 workers to 3
(`Client.scale`, as `emberctl scale`). Prints the move's time, its fence
(updates refused), the bytes it copied, those that went from one worker to
another, and the least the new plan needs (the rows that change worker:
for an even re-cut of N rows from 2 blocks to 3, N/2); and the trainer's
steps/s before the move, during it and after it. With --move=drain the
collection starts on 2 of the 3 workers the same way and one of its two is
drained instead (`Client.drain`): its half of the rows moves whole to the
third worker. With --format=json, one JSON line.

Usage: .venv/bin/python bench/rescale_bench.py [--gib 2] [--dim 128]
       [--batch 4096] [--move scale|drain] [--format text|json]
"""
import argparse
import json
import sys
import threading
import time

import numpy as np

import ember


def spec_of(rows, dim):
    return {"name": "rs", "tables": [
        {"name": f"t{t}", "num_embeddings": rows, "embedding_dim": dim,
         "feature_names": [f"f{t}"], "pooling": "SUM",
         "optimizer": {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.01}}
        for t in range(4)]}


class Trainer(threading.Thread):
    """Applies updates back to back; remembers when each was acknowledged."""

    def __init__(self, address, rows, dim, batch):
        super().__init__(daemon=True)
        self.client = ember.Client(address, timeout_s=600)
        self.rows, self.dim, self.batch = rows, dim, batch
        self.done = []  # acknowledgement times
        self.stop = threading.Event()
        self.error = None

    def run(self):
        rng = np.random.default_rng(7)
        try:
            while not self.stop.is_set():
                ids = rng.integers(0, self.rows, size=4 * self.batch, dtype=np.int64)
                kjt = ember.KeyedJaggedTensor([f"f{t}" for t in range(4)],
                                              np.ones(4 * self.batch, dtype=np.int64), ids)
                grads = rng.standard_normal((self.batch, 4 * self.dim)).astype(np.float32)
                self.client.apply_gradients("rs", kjt, grads)
                self.done.append(time.perf_counter())
        except Exception as e:  # reported by main
            self.error = e

    def rate(self, start, end):
        n = sum(1 for t in self.done if start <= t < end)
        return n / max(end - start, 1e-9)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=2.0)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--window_s", type=float, default=5.0, help="steps/s measured before and after")
    p.add_argument("--move", choices=["scale", "drain"], default="scale")
    p.add_argument("--format", choices=["text", "json"], default="text")
    args = p.parse_args()
    rows = int(args.gib * (1 << 30) / 4 / (args.dim * 4 + 4))  # weights + one Adagrad float
    table_bytes = 4 * rows * (args.dim * 4 + 4)
    with ember.LocalCluster(workers=3, timeout_s=120) as cl:
        c = ember.Client(cl.address, timeout_s=1800)
        c.create_collection(spec_of(rows, args.dim), sharding_type="row_wise")
        c.scale("rs", 2)  # the starting point: two workers
        if args.format == "text":
            what = "2 -> 3 CPU workers" if args.move == "scale" else "one of 2 CPU workers drained"
            print(f"== {args.gib:g} GiB: 4 tables of [{rows}, {args.dim}] fp32 + row-wise "
                  f"Adagrad, row_wise, {what}, a trainer applying batches of "
                  f"{args.batch} ids per table")
        info = c.collection("rs")
        holders = {info["worker_addresses"][int(s.get("rank", 0))]
                   for t in info["plan"]["tables"] for s in t["shards"]}
        victim = next(w["worker_id"] for w in c.list_workers()
                      if w["info"]["address"] in holders)
        trainer = Trainer(cl.address, rows, args.dim, args.batch)
        trainer.start()
        time.sleep(args.window_s)
        start = time.perf_counter()
        if args.move == "scale":
            out = c.scale("rs", 3)
        else:
            c.drain(victim)
            fence_ms = 0.0  # the drain's fence, from the collection's note
            note = c.collection("rs").get("note", "")
            if "fenced " in note:
                fence_ms = float(note.rsplit("fenced ", 1)[1].split(" ms")[0])
            # A drain's bytes are not in its answer: its shards move whole.
            out = {"fence_ms": fence_ms, "bytes_copied": 0, "bytes_between_workers": 0}
        end = time.perf_counter()
        time.sleep(args.window_s)
        trainer.stop.set()
        trainer.join()
        if trainer.error is not None:
            print(f"trainer failed: {trainer.error}", file=sys.stderr)
            return 1
        row = {
            "gib": args.gib, "table_bytes": table_bytes,
            "seconds": end - start, "fence_ms": out["fence_ms"],
            "bytes_copied": int(out["bytes_copied"]),
            "bytes_between_workers": int(out["bytes_between_workers"]),
            "move": args.move, "bytes_minimum": table_bytes // 2,  # a drain: what it moves
            "steps_per_s_before": trainer.rate(start - args.window_s, start),
            "steps_per_s_during": trainer.rate(start, end),
            "steps_per_s_after": trainer.rate(end, end + args.window_s),
        }
        if args.format == "json":
            print(json.dumps(row))
            return 0
        mib = 1 << 20
        print(f"{'scale 2 -> 3' if args.move == 'scale' else 'drain'}: {row['seconds']:.2f} s, "
              f"updates fenced {row['fence_ms']:.0f} ms")
        if args.move == "scale":
            print(f"  copied {row['bytes_copied'] / mib:.0f} MiB, of which "
                  f"{row['bytes_between_workers'] / mib:.0f} MiB between workers; the new "
                  f"plan needs {row['bytes_minimum'] / mib:.0f} MiB to change worker "
                  f"(ratio {row['bytes_between_workers'] / row['bytes_minimum']:.2f})")
        else:
            print(f"  the drained worker's {row['bytes_minimum'] / mib:.0f} MiB of shards moved "
                  f"whole to the third worker")
        print(f"  trainer steps/s: before {row['steps_per_s_before']:.1f}, during "
              f"{row['steps_per_s_during']:.1f} "
              f"({row['steps_per_s_during'] / row['steps_per_s_before']:.2f}x), after "
              f"{row['steps_per_s_after']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
