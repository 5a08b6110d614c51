#!/usr/bin/env python3
"""Incremental checkpoints against full ones: size and time, same run.

A benchmark, not a test. On a local cluster of --workers CPU workers
(`emberctl up`), a collection of --gib GiB of fp32 tables (4 tables of
dim --dim, row-wise Adagrad, row_wise sharding) is checkpointed whole;
then, for each fraction in --fractions, that share of every table's rows is
updated (one gradient per row, in batches) and the collection is
checkpointed incrementally (a delta over the previous checkpoint) and whole
(into another root), back to back, so both hold the same rows. Prints,
for each fraction: bytes written, the update pause (fence) and the whole
call's time of each kind, and their ratios; then the time to restore the
last incremental checkpoint (its chain) and the last full one. With
--format=json, one JSON line per fraction and one for the restores.

Usage: .venv/bin/python bench/incremental_checkpoint_bench.py [--gib 1]
       [--fractions 0.01,0.1] [--workers 2] [--format text|json]
"""
import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

import ember


def spec_of(rows, dim):
    return {"name": "inc", "tables": [
        {"name": f"t{t}", "num_embeddings": rows, "embedding_dim": dim,
         "feature_names": [f"f{t}"], "pooling": "SUM",
         "optimizer": {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.01}}
        for t in range(4)]}


def update_rows(client, rows, dim, fraction, rng, batch=65536):
    """One gradient on `fraction` of each table's rows (distinct rows)."""
    n = max(1, int(rows * fraction))
    picked = {t: rng.choice(rows, size=n, replace=False) for t in range(4)}
    for start in range(0, n, batch):
        ids = {t: picked[t][start:start + batch] for t in range(4)}
        b = len(ids[0])
        kjt = ember.KeyedJaggedTensor(
            [f"f{t}" for t in range(4)], np.ones(4 * b, dtype=np.int64),
            np.concatenate([ids[t] for t in range(4)]).astype(np.int64))
        grads = rng.standard_normal((b, 4 * dim)).astype(np.float32)
        client.apply_gradients("inc", kjt, grads)
    return n * 4


def timed_checkpoint(client, root, incremental):
    start = time.perf_counter()
    info = client.checkpoint("inc", root, incremental=incremental)
    return info, time.perf_counter() - start


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--fractions", default="0.01,0.1")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--format", choices=["text", "json"], default="text")
    args = p.parse_args()
    rows = int(args.gib * (1 << 30) / 4 / (args.dim * 4 + 4))  # weights + one Adagrad float
    fractions = [float(f) for f in args.fractions.split(",")]
    rng = np.random.default_rng(1)
    with tempfile.TemporaryDirectory(prefix="ember_inc_bench_") as root:
        flags = [f"--checkpoint_dir={root}", "--checkpoint_compact_after=0",
                 "--keep_checkpoints=100"]
        with ember.LocalCluster(workers=args.workers, extra_flags=flags, timeout_s=120) as cl:
            c = ember.Client(cl.address, timeout_s=600)
            c.create_collection(spec_of(rows, args.dim), sharding_type="row_wise")
            if args.format == "text":
                print(f"== {args.gib:g} GiB: 4 tables of [{rows}, {args.dim}] fp32 + row-wise "
                      f"Adagrad, row_wise on {args.workers} CPU workers; root {root}")
            inc_root, full_root = os.path.join(root, "inc"), os.path.join(root, "full")
            first, _ = timed_checkpoint(c, inc_root, incremental=True)  # the chain's base
            assert not first.get("base"), first
            for fraction in fractions:
                changed = update_rows(c, rows, args.dim, fraction, rng)
                inc, inc_s = timed_checkpoint(c, inc_root, incremental=True)
                full, full_s = timed_checkpoint(c, full_root, incremental=False)
                row = {
                    "fraction": fraction, "rows_changed": changed,
                    "changed_rows_written": int(inc.get("changed_rows", 0)),
                    "incremental_bytes": int(inc["bytes"]), "full_bytes": int(full["bytes"]),
                    "incremental_pause_ms": inc.get("max_pause_ms", 0.0),
                    "full_pause_ms": full.get("max_pause_ms", 0.0),
                    "incremental_s": inc_s, "full_s": full_s,
                    "chain_length": inc.get("chain_length", 1),
                    "size_ratio": int(inc["bytes"]) / int(full["bytes"]),
                    "time_ratio": inc_s / full_s,
                }
                if args.format == "json":
                    print(json.dumps(row))
                    continue
                print(f"{fraction:.0%} of rows changed ({changed} rows; the delta holds "
                      f"{row['changed_rows_written']}), chain of {row['chain_length']}:")
                print(f"  incremental {row['incremental_bytes'] / 2**20:9.1f} MiB  pause "
                      f"{row['incremental_pause_ms']:8.1f} ms  call {inc_s:7.2f} s")
                print(f"  full        {row['full_bytes'] / 2**20:9.1f} MiB  pause "
                      f"{row['full_pause_ms']:8.1f} ms  call {full_s:7.2f} s")
                print(f"  incremental/full: size {row['size_ratio']:.3f}, "
                      f"time {row['time_ratio']:.3f}")
            # Restores of the last two: the chain (full base + deltas) and
            # the full checkpoint of the same moment.
            times = {}
            for kind, path in (("incremental", inc["path"]), ("full", full["path"])):
                start = time.perf_counter()
                c.restore(path, f"restored_{kind}", sharding_type="row_wise")
                times[kind] = time.perf_counter() - start
                c.drop_collection(f"restored_{kind}")
            if args.format == "json":
                print(json.dumps({"restore_chain_s": times["incremental"],
                                  "restore_full_s": times["full"],
                                  "chain_length": inc.get("chain_length", 1)}))
            else:
                print(f"restore of the chain of {inc.get('chain_length', 1)}: "
                      f"{times['incremental']:.2f} s; of the full checkpoint: "
                      f"{times['full']:.2f} s (ratio {times['incremental'] / times['full']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
