#!/usr/bin/env python3
"""Trains a small DLRM-style click model whose embedding tables live on Ember.

The data is synthetic but learnable: a hidden ground-truth model (a score per
id of every sparse feature, plus a linear term over the dense features)
decides each sample's click probability, so a model that learns the tables
reaches an AUC well above 0.5. The model: a bottom MLP over the dense
features, Ember's EmbeddingBagCollection for the sparse ones (row-wise
Adagrad, fused on the workers), a top MLP over both, BCE loss; the dense
parameters train with torch's Adam in this process.

    examples/train_dlrm.py [--steps 300] [--batch 256] [--workers 2] [--pipeline]
        [--coordinator HOST:PORT]

Without --coordinator it starts a local cluster (`emberctl up`) and stops it
at the end. Prints a progress line every --log_every steps and the held-out
AUC before and after training; exits non-zero if the final AUC is below
--min_auc.
"""

import argparse
import sys
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
    p.add_argument("--pipeline", action="store_true",
                   help="overlap each batch's lookup with the previous step (one step stale)")
    p.add_argument("--log_every", type=int, default=50)
    p.add_argument("--min_auc", type=float, default=0.65)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class ClickData:
    """Samples from a hidden model: logit = sum of per-id scores (zipf-ish
    ids, 1-3 per feature) + w . dense - bias."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.scores = [self.rng.normal(0, 1.0, size=n) for n in ROWS]
        self.w = self.rng.normal(0, 0.5, size=DENSE)

    def batch(self, size):
        jagged, logit = {}, np.zeros(size)
        for f, n, score in zip(FEATURES, ROWS, self.scores):
            bags = []
            for b in range(size):
                k = self.rng.integers(1, 4)
                ids = np.minimum(self.rng.zipf(1.3, size=k) - 1, n - 1)
                bags.append(ids.tolist())
                logit[b] += score[ids].mean()
            jagged[f] = bags
        dense = self.rng.normal(0, 1, size=(size, DENSE)).astype(np.float32)
        logit += dense @ self.w - 0.5
        clicks = (self.rng.random(size) < 1 / (1 + np.exp(-logit))).astype(np.float32)
        return {"kjt": ember.KeyedJaggedTensor.from_jagged(jagged),
                "dense": torch.from_numpy(dense), "label": torch.from_numpy(clicks)}


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


def train(address, args):
    client = ember.Client(address, timeout_s=60)
    tables = [{"name": f"t_{f}", "num_embeddings": n, "embedding_dim": DIM,
               "feature_names": [f], "pooling": "MEAN"} for f, n in zip(FEATURES, ROWS)]
    name = f"dlrm_example_{int(time.time())}"
    ebc = EmbeddingBagCollection(tables, client, name, sharding_type=args.sharding_type,
                                 optimizer={"type": "ROWWISE_ADAGRAD", "learning_rate": 0.1})
    try:
        torch.manual_seed(args.seed)
        model = DLRM(ebc)
        optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
        data = ClickData(args.seed)
        held_out = [data.batch(args.batch) for _ in range(8)]
        print(f"train_dlrm: {len(FEATURES)} tables on {client.collection(name)['worker_addresses'].__len__()} "
              f"worker(s) ({args.sharding_type}), batch {args.batch}, {args.steps} steps"
              f"{', pipelined' if args.pipeline else ''}", flush=True)
        print(f"train_dlrm: held-out AUC before training {evaluate(model, held_out):.3f}", flush=True)
        batches = (data.batch(args.batch) for _ in range(args.steps))
        pipeline = TrainPipeline(model, optimizer, ebc, sparse=lambda b: b["kjt"])
        start, recent = time.monotonic(), []
        for step in range(1, args.steps + 1):
            if args.pipeline:
                loss = pipeline.progress(batches)
            else:
                batch = next(batches)
                optimizer.zero_grad()
                loss, _ = model(batch)
                loss.backward()
                optimizer.step()
            recent.append(float(loss.detach()))
            if step % args.log_every == 0 or step == args.steps:
                rate = step / (time.monotonic() - start)
                print(f"train_dlrm: step {step}/{args.steps}  loss {np.mean(recent):.4f}  "
                      f"{rate:.1f} steps/s", flush=True)
                recent = []
        final = evaluate(model, held_out)
        print(f"train_dlrm: held-out AUC after training {final:.3f}", flush=True)
        return final
    finally:
        client.drop_collection(name)


def main():
    args = parse_args()
    if args.coordinator:
        final = train(args.coordinator, args)
    else:
        with ember.LocalCluster(workers=args.workers) as cluster:
            final = train(cluster.address, args)
    if final < args.min_auc:
        print(f"train_dlrm: AUC {final:.3f} is below --min_auc {args.min_auc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
