#!/usr/bin/env python3
"""Trains a small DLRM-style click model whose embedding tables live on Ember.

The data is synthetic but learnable: a hidden ground-truth model (a score per
id of every sparse feature, plus a linear term over the dense features)
decides each sample's click probability, so a model that learns the tables
reaches an AUC well above 0.5. The model: a bottom MLP over the dense
features, Ember's EmbeddingBagCollection for the sparse ones (row-wise
Adagrad, fused on the workers), a top MLP over both, BCE loss; the dense
parameters train with torch's Adam in this process.

    examples/train_dlrm.py [--steps 300] [--batch 256] [--workers 2]
        [--pipeline [semi_sync|prefetch]] [--trainers N] [--hashed_ids]
        [--key_value_cache F] [--coordinator HOST:PORT]

Without --coordinator it starts a local cluster (`emberctl up`) and stops it
at the end. Prints a progress line every --log_every steps and the held-out
AUC before and after training; exits non-zero if the final AUC is below
--min_auc.

With --trainers N it runs N trainer processes, each with its slice of every
global batch of --batch samples: the dense part under torch's
DistributedDataParallel over gloo, the tables on one Ember collection that
trains SYNC over the N ranks (BOUNDED(1) with --pipeline semi_sync), so it reaches
the AUC of one trainer (docs/training.md).

With --key_value_cache F the tables live on the key_value kernel: their rows
in files on the workers' SSD, F of each shard's rows cached in memory
(docs/key-value.md); --pipeline prefetch then brings each batch's rows in
during the previous step's backward, and the run trains exactly as the
tables held in memory would.

With --hashed_ids every id is a 64-bit hash (any int64, negative included,
as hashed user and item ids arrive) and the tables are dynamic: rows created
as ids first train and evicted LRU when full (docs/dynamic-tables.md).
"""

import argparse
import sys
import tempfile
import time

import numpy as np
import torch

import ember
from ember.torch import EmbeddingBagCollection, TrainPipeline

FEATURES = ["user", "item", "category", "site"]
ROWS = [2000, 5000, 100, 300]
DIM = 16
DENSE = 8


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--coordinator", default="")
    p.add_argument("--sharding_type", default="row_wise")
    p.add_argument("--pipeline", nargs="?", const="semi_sync", default="",
                   choices=["", "semi_sync", "prefetch"],
                   help="ember.torch.TrainPipeline: semi_sync (the default when given: each "
                        "batch's lookup overlaps the previous step, one step stale) or "
                        "prefetch (its rows come into the tables' caches during the previous "
                        "backward, never stale; for --key_value_cache)")
    p.add_argument("--key_value_cache", type=float, default=0.0,
                   help="> 0: the tables on the key_value kernel, rows on the workers' SSD "
                        "under a cache of this fraction of each shard (docs/key-value.md)")
    p.add_argument("--ssd_dir", default="",
                   help="the local cluster's SSD directory for --key_value_cache (default: a "
                        "temporary one)")
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--min_auc", type=float, default=0.65)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hashed_ids", action="store_true",
                   help="64-bit hashed ids on dynamic tables (docs/dynamic-tables.md)")
    p.add_argument("--trainers", type=int, default=1,
                   help="trainer processes (each a slice of every global batch)")
    return p.parse_args()


def hashed_ids(feature, ids):
    """`ids` as 64-bit hashes (SplitMix64 of the feature's salt and the
    id), reinterpreted as int64: what a pipeline hashing raw ids sends."""
    x = (np.asarray(ids, dtype=np.uint64) + np.uint64(FEATURES.index(feature) + 1) *
         np.uint64(0x9e3779b97f4a7c15))
    x ^= x >> np.uint64(30)
    x *= np.uint64(0xbf58476d1ce4e5b9)
    x ^= x >> np.uint64(27)
    x *= np.uint64(0x94d049bb133111eb)
    x ^= x >> np.uint64(31)
    return x.view(np.int64)


class ClickData:
    """Samples from a hidden model: logit = sum of per-id scores (zipf-ish
    ids, 1-3 per feature) + w . dense - bias."""

    def __init__(self, seed, hashed=False):
        self.rng = np.random.default_rng(seed)
        self.hashed = hashed
        self.scores = [self.rng.normal(0, 1.0, size=n) for n in ROWS]
        self.w = self.rng.normal(0, 0.5, size=DENSE)

    def batch(self, size, rank=0, world=1):
        """A global batch of `size` samples; rank `rank`'s slice of it."""
        jagged, logit = {}, np.zeros(size)
        for f, n, score in zip(FEATURES, ROWS, self.scores):
            bags = []
            for b in range(size):
                k = self.rng.integers(1, 4)
                ids = np.minimum(self.rng.zipf(1.3, size=k) - 1, n - 1)
                bags.append((hashed_ids(f, ids) if self.hashed else ids).tolist())
                logit[b] += score[ids].mean()
            jagged[f] = bags
        dense = self.rng.normal(0, 1, size=(size, DENSE)).astype(np.float32)
        logit += dense @ self.w - 0.5
        clicks = (self.rng.random(size) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        lo, hi = size * rank // world, size * (rank + 1) // world
        return {"kjt": ember.KeyedJaggedTensor.from_jagged(
                    {f: bags[lo:hi] for f, bags in jagged.items()}),
                "dense": torch.from_numpy(dense[lo:hi]), "label": torch.from_numpy(clicks[lo:hi])}


class DLRM(torch.nn.Module):
    def __init__(self, ebc):
        super().__init__()
        self.ebc = ebc
        self.bottom = torch.nn.Sequential(torch.nn.Linear(DENSE, 32), torch.nn.ReLU(),
                                          torch.nn.Linear(32, DIM), torch.nn.ReLU())
        self.top = torch.nn.Sequential(torch.nn.Linear(DIM * (len(FEATURES) + 1), 64),
                                       torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def forward(self, batch):
        pooled = self.ebc(batch["kjt"]).values()
        x = torch.cat([self.bottom(batch["dense"]), pooled], dim=1)
        logit = self.top(x).squeeze(1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, batch["label"])
        return loss, logit


def auc(labels, scores):
    """Area under the ROC curve (rank statistic; ties share their rank)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    s = scores[order]
    i = 0
    while i < len(s):
        j = i
        while j + 1 < len(s) and s[j + 1] == s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    pos = labels == 1
    n_pos, n_neg = pos.sum(), (~pos).sum()
    if n_pos == 0 or n_neg == 0:
        return 0.5
    return (ranks[pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg)


def evaluate(model, batches):
    model.eval()
    labels, scores = [], []
    with torch.no_grad():
        for b in batches:
            _, logit = model(b)
            labels.append(b["label"].numpy())
            scores.append(logit.numpy())
    model.train()
    return auc(np.concatenate(labels), np.concatenate(scores))


def train(address, args, rank=0, world=1, name=None, port=0):
    """Trains (rank `rank` of `world` trainers); returns the final held-out
    AUC (rank 0's; None on the others)."""
    import torch.distributed as dist
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    say = print if rank == 0 else (lambda *a, **k: None)
    client = ember.Client(address, timeout_s=60)
    tables = [{"name": f"t_{f}", "num_embeddings": n, "embedding_dim": DIM,
               "feature_names": [f], "pooling": "MEAN"} for f, n in zip(FEATURES, ROWS)]
    if args.hashed_ids:  # the same tables, keyed by any int64 (capacity: the rows)
        for t in tables:
            t["dynamic"] = {"capacity": t.pop("num_embeddings"), "eviction": "LRU"}
    name = name or f"dlrm_example_{int(time.time())}"
    training = None
    if world > 1:
        training = ({"mode": "BOUNDED", "trainers": world, "max_staleness": 1}
                    if args.pipeline == "semi_sync"
                    else {"mode": "SYNC", "trainers": world})
    constraints = None
    if args.key_value_cache > 0:  # rows on the workers' SSD, a cache of them in memory
        constraints = {t["name"]: {"compute_kernels": ["key_value"],
                                   "cache_load_factor": args.key_value_cache} for t in tables}
    kwargs = dict(sharding_type=args.sharding_type, training=training,
                  optimizer={"type": "ROWWISE_ADAGRAD", "learning_rate": 0.1},
                  constraints=constraints)
    if rank == 0:
        ebc = EmbeddingBagCollection(tables, client, name, **kwargs)
    if world > 1:
        dist.barrier()  # created
    if rank != 0:
        ebc = EmbeddingBagCollection(tables, client, name, create=False, **kwargs)
    try:
        torch.manual_seed(args.seed)
        model = DLRM(ebc)
        trained = model
        if world > 1:  # the dense part all-reduced, the tables stepped by Ember
            trained = torch.nn.parallel.DistributedDataParallel(model)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        data = ClickData(args.seed, args.hashed_ids)
        held_out = [data.batch(args.batch) for _ in range(8)]
        mode = f", {world} trainers ({training['mode']})" if world > 1 else ""
        say(f"train_dlrm: {len(FEATURES)} tables on {client.collection(name)['worker_addresses'].__len__()} "
            f"worker(s) ({args.sharding_type}), batch {args.batch}, {args.steps} steps"
            f"{f', pipelined ({args.pipeline})' if args.pipeline else ''}"
            f"{f', key_value (cache {args.key_value_cache:g})' if constraints else ''}{mode}",
            flush=True)
        if rank == 0:
            say(f"train_dlrm: held-out AUC before training {evaluate(model, held_out):.3f}",
                flush=True)
        batches = (data.batch(args.batch, rank, world) for _ in range(args.steps))
        pipeline = TrainPipeline(trained, optimizer, ebc, sparse=lambda b: b["kjt"],
                                 mode=args.pipeline or "semi_sync")
        start, recent = time.monotonic(), []
        for step in range(1, args.steps + 1):
            if args.pipeline:
                loss = pipeline.progress(batches)
            else:
                batch = next(batches)
                optimizer.zero_grad()
                loss, _ = trained(batch)
                loss.backward()
                optimizer.step()
            recent.append(float(loss.detach()))
            if step % args.log_every == 0 or step == args.steps:
                rate = step / (time.monotonic() - start)
                say(f"train_dlrm: step {step}/{args.steps}  loss {np.mean(recent):.4f}  "
                    f"{rate:.1f} steps/s ({rate * args.batch:.0f} samples/s)", flush=True)
                recent = []
        if world > 1:
            dist.barrier()  # every rank's last step is in
        if rank != 0:
            return None
        final = evaluate(model, held_out)
        say(f"train_dlrm: held-out AUC after training {final:.3f}", flush=True)
        return final
    finally:
        if world > 1:
            dist.barrier()
        if rank == 0:
            client.drop_collection(name)
        if world > 1:
            dist.destroy_process_group()


def _trainer(rank, address, args, name, port, results):
    """A trainer process of --trainers (torch.multiprocessing.spawn)."""
    final = train(address, args, rank, args.trainers, name, port)
    if rank == 0:
        results.put(final)


def run(address, args):
    """train() in this process, or in --trainers processes; the final AUC."""
    if args.trainers == 1:
        return train(address, args)
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_trainer, args=(address, args, f"dlrm_example_{int(time.time())}", port, results),
             nprocs=args.trainers)
    return results.get()


def main():
    args = parse_args()
    if args.trainers < 1:
        print("train_dlrm: --trainers must be >= 1", file=sys.stderr)
        return 2
    if args.batch % args.trainers:
        print(f"train_dlrm: --batch {args.batch} is not a multiple of --trainers {args.trainers}",
              file=sys.stderr)
        return 2
    if args.coordinator:
        final = run(args.coordinator, args)
    else:
        flags = []
        if args.key_value_cache > 0:  # an SSD tier, and the cache its fraction alone
            ssd = args.ssd_dir or tempfile.mkdtemp(prefix="ember-dlrm-ssd-")
            flags = [f"--ssd_dir={ssd}", "--ssd_gib=1", "--key_value_min_cache_rows=1"]
        with ember.LocalCluster(workers=args.workers, extra_flags=flags) as cluster:
            final = run(cluster.address, args)
    if final < args.min_auc:
        print(f"train_dlrm: AUC {final:.3f} is below --min_auc {args.min_auc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
