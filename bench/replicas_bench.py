#!/usr/bin/env python3
"""Replicated shards: what a second copy costs, and how fast a lost worker is replaced.

A benchmark, not a test. On a local cluster of 3 CPU workers (`emberctl up
--lease_ms=L`), two collections of --mib MiB each (4 tables of dim --dim,
row-wise Adagrad, row_wise sharding) are created, one with replicas 1 and
one with replicas 2. A trainer then applies the same batches (--batch ids
per table) to each in turn, --rounds times: the update latency (p50, p99)
and updates/s of each, from the same run, and their ratio (the cost of the
second copy: every update is forwarded by the primary to its backup and
applied there first). Then, while a trainer applies updates to the
replicated collection without pause, the worker holding its rank 0 is
killed with SIGKILL: the failover (from the kill until the collection
serves at the take-over's epoch, its backups promoted), the longest gap
between two acknowledged updates, and the time until every shard has two
copies again (copied live onto the workers left), with the bytes those new
copies hold and the rate per GiB. With --format=json, one JSON line.

With --training sync both collections train SYNC with two trainer ranks
(two threads, each its own client): every round is a step, each rank looking
up its batch for the step, then sending its gradients; a step ends when
both ranks have it acknowledged (the primaries merge the ranks' parts and,
with replicas 2, forward the merged step to the backups first). The
figures are then steps/s and step latency, and the kill phase runs the two
ranks stepping without pause. --training bounded is the same with BOUNDED(2)
steps: an update is answered once its primaries hold it (with replicas 2,
once every backup keeps it too), a lookup for step s waits for step s - 3.

Usage: .venv/bin/python bench/replicas_bench.py [--mib 256] [--dim 64]
       [--batch 1024] [--rounds 200] [--lease_ms 1500] [--training async|sync|bounded]
       [--format text|json]
"""
import argparse
import json
import os
import signal
import sys
import threading
import time

import numpy as np

import ember


RANKS = 2  # trainer ranks of a SYNC run


def spec_of(name, rows, dim, replicas, training):
    spec = {"name": name, "replicas": replicas, "tables": [
        {"name": f"t{t}", "num_embeddings": rows, "embedding_dim": dim,
         "feature_names": [f"f{t}"], "pooling": "SUM",
         "optimizer": {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.01}}
        for t in range(4)]}
    if training == "sync":
        spec["training"] = {"mode": "SYNC", "trainers": RANKS, "step_timeout_s": 120}
    elif training == "bounded":
        spec["training"] = {"mode": "BOUNDED", "trainers": RANKS, "max_staleness": 2,
                            "step_timeout_s": 120}
    return spec


class Ranks:
    """RANKS trainer threads stepping a SYNC collection in lockstep: step s is
    each rank's lookup for s, then its update for s (retried until
    acknowledged, under its own request id)."""

    def __init__(self, address, rows, dim, batch, seed):
        self.clients = [ember.Client(address, timeout_s=600) for _ in range(RANKS)]
        self.rngs = [np.random.default_rng(seed + r) for r in range(RANKS)]
        self.rows, self.dim, self.batch = rows, dim, batch
        self.step = {}

    def run(self, name, steps, on_step=None, stop=None):
        """Runs `steps` steps (or until `stop` is set); on_step(seconds) for
        each step rank 0 finished."""
        first = self.step.get(name, 0)
        batches = [[batch_of(self.rngs[r], self.rows, self.dim, self.batch)
                    for _ in range(steps)] for r in range(RANKS)]
        errors = []

        def rank(r):
            c = self.clients[r]
            try:
                for i in range(steps):
                    if stop is not None and stop.is_set():
                        return
                    s = first + i
                    kjt, g = batches[r][i]
                    t0 = time.perf_counter()
                    c.lookup(name, kjt, step=s)
                    c.apply_gradients(name, kjt, g, request_id=f"{name}-r{r}-{s}", step=s, rank=r)
                    if r == 0 and on_step is not None:
                        on_step(time.perf_counter() - t0)
            except Exception as e:  # reported by the caller
                errors.append(e)
                if stop is not None:
                    stop.set()

        threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(RANKS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.step[name] = first + steps
        if errors:
            raise errors[0]


def batch_of(rng, rows, dim, batch):
    ids = rng.integers(0, rows, size=4 * batch, dtype=np.int64)
    kjt = ember.KeyedJaggedTensor([f"f{t}" for t in range(4)],
                                  np.ones(4 * batch, dtype=np.int64), ids)
    grads = rng.standard_normal((batch, 4 * dim)).astype(np.float32)
    return kjt, grads


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def copies_short(info):
    return sum(1 for t in info["plan"]["tables"] for s in t.get("shards", [])
               if int(s.get("rows", 0)) > 0 and len(s.get("backups", [])) != 1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=float, default=256.0, help="each collection's tables")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=200)
    p.add_argument("--lease_ms", type=int, default=1500)
    p.add_argument("--training", choices=["async", "sync", "bounded"], default="async")
    p.add_argument("--format", choices=["text", "json"], default="text")
    args = p.parse_args()
    sync = args.training != "async"  # stepped: two trainer ranks
    rows = int(args.mib * (1 << 20) / 4 / (args.dim * 4 + 4))  # weights + one Adagrad float
    row_bytes = args.dim * 4 + 4
    with ember.LocalCluster(workers=3, timeout_s=120,
                            extra_flags=[f"--lease_ms={args.lease_ms}"]) as cl:
        c = ember.Client(cl.address, timeout_s=600)
        c.create_collection(spec_of("one", rows, args.dim, 1, args.training), sharding_type="row_wise")
        c.create_collection(spec_of("two", rows, args.dim, 2, args.training), sharding_type="row_wise")
        if args.format == "text":
            print(f"== 3 CPU workers, 2 collections of {args.mib:g} MiB: 4 tables of "
                  f"[{rows}, {args.dim}] fp32 + row-wise Adagrad, row_wise; batches of "
                  f"{args.batch} ids per table" +
                  (f"; {args.training.upper()}, {RANKS} trainer ranks" if sync else ""))
        # 1. The same batches to each, alternately.
        rng = np.random.default_rng(3)
        lat = {"one": [], "two": []}
        if sync:
            ranks = Ranks(cl.address, rows, args.dim, args.batch, seed=3)
            for name in lat:
                ranks.run(name, 10)  # warm-up
            for _ in range(4):  # in turn, a quarter of the rounds at a time
                for name in lat:
                    ranks.run(name, max(1, args.rounds // 4), on_step=lat[name].append)
        else:
            for _ in range(10):  # warm-up
                kjt, g = batch_of(rng, rows, args.dim, args.batch)
                for name in lat:
                    c.apply_gradients(name, kjt, g)
            for _ in range(args.rounds):
                kjt, g = batch_of(rng, rows, args.dim, args.batch)
                for name in lat:
                    t0 = time.perf_counter()
                    c.apply_gradients(name, kjt, g)
                    lat[name].append(time.perf_counter() - t0)
        row = {"mib": args.mib, "batch": args.batch, "lease_ms": args.lease_ms,
               "training": args.training}
        for name in lat:
            row[f"{name}_p50_ms"] = pct(lat[name], 50) * 1e3
            row[f"{name}_p99_ms"] = pct(lat[name], 99) * 1e3
            row[f"{name}_updates_per_s"] = len(lat[name]) / sum(lat[name])
        c.drop_collection("one")

        # 2. kill -9 of the worker holding rank 0 while a trainer runs.
        info = c.collection("two")
        victim_addr = info["worker_addresses"][0]
        victim = next(w for w in c.list_workers() if w["info"]["address"] == victim_addr)
        lost_bytes = 0  # the rows of every copy the victim held
        for t in info["plan"]["tables"]:
            for s in t.get("shards", []):
                held = [int(s.get("rank", 0))] + [int(b) for b in s.get("backups", [])]
                if 0 in held:
                    lost_bytes += int(s.get("rows", 0)) * row_bytes
        acks, stop, errors = [], threading.Event(), []

        def train():
            if sync:
                try:
                    while not stop.is_set():
                        ranks.run("two", 20, on_step=lambda _: acks.append(time.perf_counter()),
                                  stop=stop)
                except Exception as e:  # reported below
                    errors.append(e)
                return
            tc = ember.Client(cl.address, timeout_s=600)
            r = np.random.default_rng(5)
            n = 0
            try:
                while not stop.is_set():
                    kjt, g = batch_of(r, rows, args.dim, args.batch)
                    tc.apply_gradients("two", kjt, g, request_id=f"b-{n}")
                    n += 1
                    acks.append(time.perf_counter())
            except Exception as e:  # reported below
                errors.append(e)

        th = threading.Thread(target=train, daemon=True)
        th.start()
        time.sleep(2.0)
        epoch = int(info["plan"]["epoch"])
        killed = time.perf_counter()
        os.kill(int(victim["info"]["pid"]), signal.SIGKILL)
        failover = rebuilt = None
        while time.perf_counter() - killed < 300:
            now = c.collection("two")
            t = time.perf_counter() - killed
            serving = now.get("state", "SERVING") == "SERVING"
            if failover is None and int(now["plan"]["epoch"]) > epoch and serving:
                failover = t
            if failover is not None and serving and copies_short(now) == 0:
                rebuilt = t
                note = now.get("note", "")
                break
            time.sleep(0.01)
        time.sleep(1.0)
        stop.set()
        th.join()
        if errors:
            print(f"trainer failed: {errors[0]}", file=sys.stderr)
            return 1
        around = [a for a in acks if killed - 1 <= a]
        gaps = [b - a for a, b in zip(around, around[1:])]
        row.update({
            "failover_ms": failover * 1e3 if failover is not None else None,
            "longest_gap_ms": max(gaps) * 1e3 if gaps else None,
            "copies_again_s": rebuilt, "copied_bytes": lost_bytes,
            "s_per_gib": rebuilt / (lost_bytes / (1 << 30)) if rebuilt else None,
        })
        if args.format == "json":
            print(json.dumps(row))
            return 0
        what = "steps (lookup + update, rank 0)" if sync else "updates"
        print(f"{what}, replicas 1: p50 {row['one_p50_ms']:.2f} ms, p99 "
              f"{row['one_p99_ms']:.2f} ms, {row['one_updates_per_s']:.1f}/s")
        print(f"{what}, replicas 2: p50 {row['two_p50_ms']:.2f} ms, p99 "
              f"{row['two_p99_ms']:.2f} ms, {row['two_updates_per_s']:.1f}/s "
              f"({row['two_updates_per_s'] / row['one_updates_per_s']:.2f}x replicas 1)")
        if failover is None or rebuilt is None:
            print("the take-over or the new copies did not complete within 300 s")
            return 1
        print(f"kill -9 of rank 0: serving at the take-over's epoch after {row['failover_ms']:.0f}"
              f" ms (lease {args.lease_ms} ms); longest gap between acknowledged updates "
              f"{row['longest_gap_ms']:.0f} ms")
        print(f"  two copies again after {rebuilt:.2f} s: {lost_bytes / (1 << 20):.0f} MiB of "
              f"copies made live ({row['s_per_gib']:.1f} s/GiB; {note})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
