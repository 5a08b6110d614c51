#!/usr/bin/env python3
"""Ember's dynamic tables against TorchRec's managed-collision modules, same
run, same ids: a forward and a training step of one hash-keyed table.

    .venv/bin/python bench/dynamic_vs_torchrec.py [--rows=100000] [--dim=64]
        [--batch=2048] [--pooling_factor=20] [--steps=20] [--workers=2]
        [--format=table|json]

Peer: `torchrec.modules.mc_embedding_modules.ManagedCollisionEmbeddingBagCollection`
over an `EmbeddingBagCollection` of `--rows` rows, its ids remapped by an
`MCHManagedCollisionModule` (TorchRec's sorted zero-collision hash, LRU
eviction every 100 steps), in this process on the CPU; a training step is
its forward, backward and torch's SGD over the table. Ember: a dynamic
table of capacity `--rows` (admission on the first update, LRU) on a
local cluster of `--workers` CPU workers (`emberctl up`), through
`ember.torch.EmbeddingBagCollection`; a training step is its forward and
backward, the workers running the fused SGD. Ids: 64-bit hashes (in
[0, 2^62)) of a zipf draw over 4x `--rows` keys, the same batches for
both. Figures: samples/s (bags per second), best of 3 rounds of --steps.
"""

import argparse
import json
import sys
import time

import numpy as np
import torch

import ember
from ember.torch import EmbeddingBagCollection as EmberEBC


def parse():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=100000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--pooling_factor", type=int, default=20)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--format", choices=["table", "json"], default="table")
    return p.parse_args()


def batches(args, n):
    rng = np.random.default_rng(0)
    keys = 4 * args.rows
    hashed = (np.arange(keys, dtype=np.uint64) * np.uint64(0x9e3779b97f4a7c15)) >> np.uint64(2)
    out = []
    for _ in range(n):
        ranks = np.minimum(rng.zipf(1.05, size=args.batch * args.pooling_factor) - 1, keys - 1)
        values = hashed[ranks].view(np.int64)
        lengths = np.full(args.batch, args.pooling_factor, dtype=np.int64)
        out.append((torch.from_numpy(lengths), torch.from_numpy(values.copy())))
    return out


def rate(args, fn, data):
    fn(data[0])  # warm
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        for i in range(args.steps):
            fn(data[i % len(data)])
        best = max(best, args.batch * args.steps / (time.perf_counter() - start))
    return best


def torchrec_side(args, data):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
    from torchrec.modules.mc_modules import (LRU_EvictionPolicy, ManagedCollisionCollection,
                                             MCHManagedCollisionModule)
    cfg = EmbeddingBagConfig(name="t", num_embeddings=args.rows, embedding_dim=args.dim,
                             feature_names=["f"])
    ebc = EmbeddingBagCollection(tables=[cfg], device=torch.device("cpu"))
    mcc = ManagedCollisionCollection(
        managed_collision_modules={"t": MCHManagedCollisionModule(
            zch_size=args.rows, device=torch.device("cpu"), eviction_policy=LRU_EvictionPolicy(),
            eviction_interval=100, input_hash_size=(1 << 62))},
        embedding_configs=[cfg])
    mc = ManagedCollisionEmbeddingBagCollection(ebc, mcc, allow_in_place_embed_weight_update=True)
    opt = torch.optim.SGD(mc.parameters(), lr=0.01)

    def kjt(d):
        return KeyedJaggedTensor(keys=["f"], values=d[1], lengths=d[0])

    def forward(d):
        with torch.no_grad():
            mc.eval()
            out = mc(kjt(d))
            kt = out[0] if isinstance(out, tuple) else out
            kt.values()

    def step(d):
        mc.train()
        out = mc(kjt(d))
        kt = out[0] if isinstance(out, tuple) else out
        opt.zero_grad()
        kt.values().sum().backward()
        opt.step()

    return rate(args, forward, data), rate(args, step, data)


def ember_side(args, data):
    with ember.LocalCluster(workers=args.workers) as cluster:
        client = ember.Client(cluster.address, timeout_s=120)
        table = {"name": "t", "embedding_dim": args.dim, "feature_names": ["f"],
                 "dynamic": {"capacity": args.rows, "eviction": "LRU"}}
        ebc = EmberEBC([table], client, "dyn_vs_torchrec", optimizer={"type": "SGD",
                                                                      "learning_rate": 0.01},
                       sharding_type="row_wise")

        def kjt(d):
            return ember.KeyedJaggedTensor(["f"], d[0].numpy(), d[1].numpy())

        def forward(d):
            with torch.no_grad():
                ebc.eval()
                ebc(kjt(d)).values()

        def step(d):
            ebc.train()
            ebc(kjt(d)).values().sum().backward()

        for d in data:  # the rows admitted first, as the peer's remap fills its slots
            step(d)
        return rate(args, forward, data), rate(args, step, data)


def main():
    args = parse()
    data = batches(args, 8)
    peer_fwd, peer_step = torchrec_side(args, data)
    fwd, step = ember_side(args, data)
    res = {"rows": args.rows, "dim": args.dim, "batch": args.batch,
           "pooling_factor": args.pooling_factor, "workers": args.workers,
           "torchrec_mc_forward": round(peer_fwd), "ember_forward": round(fwd),
           "forward_ratio": round(fwd / peer_fwd, 2),
           "torchrec_mc_step": round(peer_step), "ember_step": round(step),
           "step_ratio": round(step / peer_step, 2)}
    if args.format == "json":
        print(json.dumps(res))
        return 0
    print(f"dynamic table {args.rows} x {args.dim}, batch {args.batch} x {args.pooling_factor} "
          f"hashed ids; samples/s")
    print(f"  forward  TorchRec MC-EBC {peer_fwd:10.0f}   Ember {fwd:10.0f}   "
          f"ratio {fwd / peer_fwd:.2f}")
    print(f"  step     TorchRec MC-EBC {peer_step:10.0f}   Ember {step:10.0f}   "
          f"ratio {step / peer_step:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
