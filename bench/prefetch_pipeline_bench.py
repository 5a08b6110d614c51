#!/usr/bin/env python3
"""Training steps per second on key_value tables, three ways, same run.

A benchmark, not a test. --tables tables of --rows x --dim on the key_value
kernel (rows in files under --ssd_dir, --cache of them in memory), row-wise
over --workers local workers (`emberctl up`), one feature each, batch
--batch, --pf ids a bag drawn zipf(--zipf) over the rows (uniform with
--zipf 0), SGD, SUM pooling; a dense MLP (--hidden wide, two layers) over
the pooled embeddings trained with BCE loss. Trained from the same rows
and batches three ways:

  plain      forward, backward, optimizer step: each lookup and update
             waits for its rows to come in from the file;
  semi_sync  ember.torch.TrainPipeline(mode="semi_sync"): the next batch's
             lookup runs during the current step (one step stale);
  prefetch   ember.torch.TrainPipeline(mode="prefetch"): the next batch's
             rows come into the caches (Client.prefetch) while the current
             step's backward and update run; its lookup then hits (no
             staleness).

Each mode runs --rounds times (every other round in reverse order: the VM's
disk and cores drift within a run). Prints the mean steps/s of each and
each run's, the ratio to plain, the cache hit rate of the
lookups and updates (hits / (hits + fills), from the workers' metrics) and
the rows prefetched a step; or one JSON line with --format=json. No peer
runs here: TorchRec's prefetch pipeline needs a GPU (its UVM cache).

    .venv/bin/python bench/prefetch_pipeline_bench.py [--steps 30] [--format json]
"""

import argparse
import json
import os
import socket
import tempfile
import time
import urllib.request

import numpy as np
import torch

import ember
import ember.torch


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=2)
    p.add_argument("--rows", type=int, default=1000000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--pf", type=int, default=10, help="pooling factor: ids per bag")
    p.add_argument("--zipf", type=float, default=1.05, help="id skew; 0: uniform")
    p.add_argument("--cache", type=float, default=0.05, help="cache_load_factor")
    p.add_argument("--hidden", type=int, default=1024, help="the dense MLP's width")
    p.add_argument("--steps", type=int, default=30, help="timed steps (after 5 warm-up)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--torch_threads", type=int, default=1,
                   help="the trainer's torch threads (the rest of the cores are the workers')")
    p.add_argument("--modes", default="plain,semi_sync,prefetch")
    p.add_argument("--rounds", type=int, default=2,
                   help="the modes run this many times, every other round in reverse order")
    p.add_argument("--ssd_dir", default="", help="default: a fresh directory under /var/tmp")
    p.add_argument("--format", default="table", choices=["table", "json"])
    return p.parse_args()


def free_port_base(n):
    for base in range(23000, 60000, 97):
        try:
            socks = []
            for port in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", port))
                socks.append(s)
            for s in socks:
                s.close()
            return base
        except OSError:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def metric(urls, name, collection):
    total = 0.0
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + "{") and f'collection="{collection}"' in line:
                    total += float(line.rsplit(" ", 1)[1])
    return total


def make_batches(args, n, rng):
    """n batches: one KJT of --tables features, --pf ids a bag, and labels."""
    out = []
    for _ in range(n):
        feats = {}
        for t in range(args.tables):
            if args.zipf > 0:
                ids = (rng.zipf(1.0 + args.zipf, args.batch * args.pf) - 1) % args.rows
                ids = (ids * 2654435761) % args.rows  # hot rows spread over the shards
            else:
                ids = rng.integers(0, args.rows, args.batch * args.pf)
            feats[f"f{t}"] = (np.full(args.batch, args.pf, np.int64), ids.astype(np.int64))
        keys = list(feats)
        kjt = ember.KeyedJaggedTensor(keys, np.concatenate([feats[k][0] for k in keys]),
                                      np.concatenate([feats[k][1] for k in keys]))
        out.append({"kjt": kjt,
                    "label": torch.from_numpy(rng.integers(0, 2, (args.batch, 1)).astype(np.float32))})
    return out


def run_mode(args, client, mode, batches, urls):
    name = f"pp_{mode}"
    tables = [{"name": f"t{t}", "num_embeddings": args.rows, "embedding_dim": args.dim,
               "feature_names": [f"f{t}"], "pooling": "SUM"} for t in range(args.tables)]
    optimizer = {"type": "SGD", "learning_rate": 0.05}
    constraints = {t["name"]: {"compute_kernels": ["key_value"], "cache_load_factor": args.cache}
                   for t in tables}
    ebc = ember.torch.EmbeddingBagCollection(tables, client, name, optimizer=optimizer,
                                             sharding_type="row_wise", constraints=constraints)
    try:
        torch.manual_seed(0)
        width = args.tables * args.dim
        dense = torch.nn.Sequential(torch.nn.Linear(width, args.hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(args.hidden, 1))
        opt = torch.optim.SGD(dense.parameters(), lr=0.01)
        loss_fn = torch.nn.BCEWithLogitsLoss()

        def model(batch):
            return loss_fn(dense(ebc(batch["kjt"]).values()), batch["label"])

        warm = 5
        it = iter(batches)
        if mode == "plain":
            def step():
                b = next(it)
                opt.zero_grad()
                model(b).backward()
                opt.step()
        else:
            pipeline = ember.torch.TrainPipeline(model, opt, ebc, sparse=lambda b: b["kjt"],
                                                 mode=mode)

            def step():
                pipeline.progress(it)
        for _ in range(warm):
            step()
        before = {k: metric(urls, f"ember_worker_key_value_{k}", name)
                  for k in ("hits_total", "fills_total", "prefetched_rows_total")}
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        secs = time.perf_counter() - start
        after = {k: metric(urls, f"ember_worker_key_value_{k}", name) for k in before}
        d = {k: after[k] - before[k] for k in before}
        looked = d["hits_total"] + d["fills_total"]
        return {"mode": mode, "steps_per_s": args.steps / secs,
                "hit_rate": d["hits_total"] / looked if looked else 0.0,
                "prefetched_per_step": d["prefetched_rows_total"] / args.steps}
    finally:
        client.drop_collection(name)


def main():
    args = parse_args()
    torch.set_num_threads(args.torch_threads)
    modes = args.modes.split(",")
    ssd = args.ssd_dir or tempfile.mkdtemp(prefix="ember-prefetch-bench-", dir="/var/tmp")
    os.makedirs(ssd, exist_ok=True)
    rng = np.random.default_rng(3)
    batches = make_batches(args, args.steps + 6, rng)
    base = free_port_base(args.workers + 1)
    flags = [f"--ssd_dir={ssd}", "--ssd_gib=8", f"--metrics_port={base}",
             "--key_value_min_cache_rows=1"]
    runs = {m: [] for m in modes}
    with ember.LocalCluster(workers=args.workers, extra_flags=flags) as cluster:
        client = ember.Client(cluster.address, timeout_s=120)
        urls = [u for k, u in cluster.metrics_urls.items() if k != "coordinator"]
        for r in range(args.rounds):
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                print(f"[round {r + 1}, {mode}] training {args.steps} steps ...", flush=True)
                runs[mode].append(run_mode(args, client, mode, batches, urls))
    results = []
    for mode in modes:
        rates = [x["steps_per_s"] for x in runs[mode]]
        results.append({"mode": mode, "steps_per_s": float(np.mean(rates)),
                        "steps_per_s_runs": rates,
                        "hit_rate": float(np.mean([x["hit_rate"] for x in runs[mode]])),
                        "prefetched_per_step": float(np.mean(
                            [x["prefetched_per_step"] for x in runs[mode]]))})
    plain = next((r["steps_per_s"] for r in results if r["mode"] == "plain"), None)
    for r in results:
        r["vs_plain"] = r["steps_per_s"] / plain if plain else None
    config = {k: getattr(args, k) for k in ("tables", "rows", "dim", "batch", "pf", "zipf",
                                             "cache", "hidden", "steps", "workers",
                                             "torch_threads", "rounds")}
    if args.format == "json":
        print(json.dumps({"config": config, "results": results}))
        return
    print(f"config: {config}")
    print(f"{'mode':<10} {'steps/s':>8} {'runs':>16} {'vs plain':>9} {'hit rate':>9} "
          f"{'prefetched/step':>16}")
    for r in results:
        vs = f"{r['vs_plain']:.2f}x" if r["vs_plain"] is not None else "-"
        each = "/".join(f"{x:.1f}" for x in r["steps_per_s_runs"])
        print(f"{r['mode']:<10} {r['steps_per_s']:>8.2f} {each:>16} {vs:>9} "
              f"{r['hit_rate']:>9.3f} {r['prefetched_per_step']:>16.0f}")

if __name__ == "__main__":
    main()
