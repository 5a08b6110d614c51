#!/usr/bin/env python3
"""Training steps per second: Ember from PyTorch against TorchRec, same run.

A benchmark, not a test. The service_bench configuration (8 tables of
--rows x --dim, one feature each, batch --batch, pooling factor --pf, uniform
ids) under a dense model trained with BCE loss and torch SGD: with --model
mlp (default) a small MLP over the pooled embeddings; with --model dlrm
TorchRec's own torchrec.models.dlrm.DLRM (13 dense features, bottom MLP
512-256-dim, top MLP 512-256-1, dot interactions) built over each embedding
module unmodified, DMP's included (DistributedModelParallel over the whole
DLRM, as TorchRec's examples shard it). Trained three ways in one process
run:

  torchrec   a local torchrec.EmbeddingBagCollection with FBGEMM's fused
             row-wise Adagrad (fuse_embedding_optimizer), in this process;
  dmp        TorchRec's DistributedModelParallel over gloo in --workers
             processes (one torch thread each, as Ember's workers have), its
             own planner's CPU plan, FBGEMM's fused row-wise Adagrad, the
             dense model under DistributedDataParallel, each rank a 1/W
             share of the batch (the same global batch); off with --dmp 0;
  ember      ember.torch.EmbeddingBagCollection on a local cluster of
             --workers workers (`emberctl up`), row-wise Adagrad fused on the
             workers, one step at a time;
  pipelined  the same with ember.torch.TrainPipeline (the next batch's lookup
             overlaps the current step; one step of staleness).

Prints steps/s for each and the ratios to TorchRec (> 1: Ember faster), or
one JSON line with --format=json.

With --trainers N (> 1, or any N with --modes) it times many trainers
instead (the MLP model): N
trainer processes over gloo, each a 1/N share of the global batch --batch,
the dense part under DistributedDataParallel; TorchRec's DMP with N ranks
(FBGEMM's fused row-wise Adagrad) against Ember's tables on --workers
workers trained ASYNC, SYNC and BOUNDED(1) (pipelined: TrainPipeline). It
prints samples/s (global) for each and SYNC / DMP. On one machine the workers, the trainer and
TorchRec share the cores: see docs/lab-notes/2026-11-benchmarks.md for what limits the ratio.

    .venv/bin/python bench/train_bench.py [--steps 20] [--workers 2] [--format json]
"""

import argparse
import copy
import json
import sys
import time

import numpy as np
import torch

import ember
import ember.torch


def parse_args():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tables", type=int, default=8)
    p.add_argument("--rows", type=int, default=500000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--pf", type=int, default=20, help="pooling factor: ids per bag")
    p.add_argument("--steps", type=int, default=20, help="timed steps (after 3 warm-up)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--worker_threads", type=int, default=1)
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads in this process (0: torch's default)")
    p.add_argument("--coordinator", default="", help="a running cluster (default: start one)")
    p.add_argument("--dmp", type=int, default=1,
                   help="1: also time TorchRec DistributedModelParallel over gloo")
    p.add_argument("--dmp_port", type=int, default=29571, help="gloo's rendezvous port")
    p.add_argument("--format", default="table", choices=["table", "json"])
    p.add_argument("--model", default="mlp", choices=["mlp", "dlrm"],
                   help="the dense model: a small MLP, or TorchRec's DLRM")
    p.add_argument("--trainers", type=int, default=1,
                   help="> 1: time that many trainer processes (docs/training.md)")
    p.add_argument("--modes", action="store_true",
                   help="time --trainers processes in each training mode, 1 included")
    return p.parse_args()


DENSE_FEATURES = 13  # Criteo's, as TorchRec's DLRM examples use


def dlrm_over(ebc, args):
    """TorchRec's DLRM over the embedding module `ebc` (any of the three)."""
    from torchrec.models.dlrm import DLRM
    return DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE_FEATURES,
                dense_arch_layer_sizes=[512, 256, args.dim],
                over_arch_layer_sizes=[512, 256, 1])


def dlrm_step(model, opt):
    """One DLRM training step: BCE over model(dense, kjt), backward, step."""
    def step(b):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(b["dense"], b["kjt"]).squeeze(-1), b["label"])
        loss.backward()
        opt.step()
    return step


class Dense(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 256), torch.nn.ReLU(),
                                       torch.nn.Linear(256, 1))

    def forward(self, pooled):
        return self.mlp(pooled).squeeze(1)


def make_batches(args, torchrec, n=4, seed=1):
    rng = np.random.default_rng(seed)
    keys = [f"f{t}" for t in range(args.tables)]
    out = []
    for _ in range(n):
        values = torch.from_numpy(
            rng.integers(0, args.rows, size=args.tables * args.batch * args.pf, dtype=np.int64))
        lengths = torch.full((args.tables * args.batch,), args.pf, dtype=torch.int64)
        kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values,
                                                           lengths=lengths)
        labels = torch.from_numpy((rng.random(args.batch) < 0.3).astype(np.float32))
        dense = torch.from_numpy(rng.normal(size=(args.batch, DENSE_FEATURES)).astype(np.float32))
        out.append({"kjt": kjt, "label": labels, "dense": dense})
    return out


def on_cluster(args, fn):
    """fn(coordinator address): --coordinator's, or a local cluster's of
    --workers workers started for the call."""
    if args.coordinator:
        return fn(args.coordinator)
    with ember.LocalCluster(workers=args.workers,
                            extra_flags=[f"--threads={args.worker_threads}"]) as cluster:
        return fn(cluster.address)


def distinct_batches(batches, n):
    """An iterator over n steps of `batches`, cycled, each a dict and KJT
    of its own (TrainPipeline's prefetch matches KJT objects), same data."""
    return iter([dict(batches[i % len(batches)], kjt=copy.copy(batches[i % len(batches)]["kjt"]))
                 for i in range(n)])


def time_steps(step, batches, steps, sync=lambda: None):
    """Steps/s over `steps` steps after 3 warm-up ones; `sync` (a barrier
    across ranks) before and after the timed ones."""
    for i in range(3):
        step(batches[i % len(batches)])
    sync()
    start = time.perf_counter()
    for i in range(steps):
        step(batches[i % len(batches)])
    sync()
    return steps / (time.perf_counter() - start)


def sgd_step(embeddings, dense, opt):
    """One training step of `dense` over the pooled `embeddings` module (a
    KJT in, a KeyedTensor out): BCE loss, backward, optimizer step."""
    def step(b):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            dense(embeddings(b["kjt"]).values()), b["label"])
        loss.backward()
        opt.step()
    return step


def dmp_rank(rank, args, queue):
    """One rank of TorchRec's DistributedModelParallel over gloo: plans,
    shards, times --steps steps; rank 0 puts (steps/s, sharding types)."""
    import os
    import torch.distributed as dist
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.dmp_port)
    dist.init_process_group("gloo", rank=rank, world_size=args.workers)
    try:
        torch.set_num_threads(1)
        import torchrec
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        configs = [torchrec.EmbeddingBagConfig(name=f"t{t}", embedding_dim=args.dim,
                                               num_embeddings=args.rows, feature_names=[f"f{t}"])
                   for t in range(args.tables)]
        ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
        sharder = EmbeddingBagCollectionSharder(fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05, "eps": 1e-8})
        local = args.batch // args.workers
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=args.workers, local_world_size=args.workers,
                              compute_device="cpu"),
            batch_size=local)
        # Each rank its own share of the global batch, as make_batches draws it.
        shard = copy.copy(args)
        shard.batch = local
        batches = make_batches(shard, torchrec, seed=1 + rank)
        torch.manual_seed(0)
        if args.model == "dlrm":
            # The whole DLRM under DMP: it shards the EBC inside and wraps
            # the dense part in DDP, as TorchRec's DLRM examples do.
            plan = planner.collective_plan(dlrm_over(ebc, args), [sharder],
                                           dist.GroupMember.WORLD)
            model = DistributedModelParallel(dlrm_over(ebc, args), device=torch.device("cpu"),
                                             plan=plan, sharders=[sharder])
            opt = torch.optim.SGD([p for n, p in model.named_parameters()
                                   if "embedding_bags" not in n], lr=0.01)
            step = dlrm_step(model, opt)
        else:
            plan = planner.collective_plan(ebc, [sharder], dist.GroupMember.WORLD)
            model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=plan,
                                             sharders=[sharder])
            dense = torch.nn.parallel.DistributedDataParallel(Dense(args.tables * args.dim))
            opt = torch.optim.SGD(dense.parameters(), lr=0.01)
            step = sgd_step(model, dense, opt)

        rate = time_steps(step, batches, args.steps, sync=dist.barrier)
        if rank == 0:
            types = sorted({s.sharding_type for plans in plan.plan.values()
                            for s in plans.values()})
            queue.put((rate, types))
    finally:
        dist.destroy_process_group()


def run_dmp(args, world=None):
    """(steps/s, sharding types) of TorchRec's DMP over gloo, `world` ranks
    (--workers)."""
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    if world is not None:
        args = copy.copy(args)
        args.workers = world
    procs = [ctx.Process(target=dmp_rank, args=(r, args, queue)) for r in range(args.workers)]
    for p in procs:
        p.start()
    try:
        result = queue.get(timeout=900)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return result


def ember_trainer(rank, args, address, name, training, port, queue):
    """One of --trainers trainer processes on Ember: its share of the global
    batch, the dense MLP under DDP over gloo, the tables trained `training`
    (BOUNDED: through TrainPipeline); rank 0 puts steps/s."""
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.trainers)
    try:
        torch.set_num_threads(1)
        import torchrec
        configs = [{"name": f"t{t}", "num_embeddings": args.rows, "embedding_dim": args.dim,
                    "feature_names": [f"f{t}"]} for t in range(args.tables)]
        client = ember.Client(address, timeout_s=600)
        kw = dict(optimizer={"type": "ROWWISE_ADAGRAD", "learning_rate": 0.05, "eps": 1e-8},
                  training=training)
        if rank == 0:
            ebc = ember.torch.EmbeddingBagCollection(configs, client, name, **kw)
        dist.barrier()
        if rank != 0:
            ebc = ember.torch.EmbeddingBagCollection(configs, client, name, create=False, **kw)
        shard = copy.copy(args)
        shard.batch = args.batch // args.trainers
        batches = make_batches(shard, torchrec, seed=1 + rank)
        torch.manual_seed(0)
        dense = torch.nn.parallel.DistributedDataParallel(Dense(args.tables * args.dim))
        opt = torch.optim.SGD(dense.parameters(), lr=0.01)
        if training["mode"] == "BOUNDED":
            def model(b):
                return torch.nn.functional.binary_cross_entropy_with_logits(
                    dense(ebc(b["kjt"]).values()), b["label"])
            pipeline = ember.torch.TrainPipeline(model, opt, ebc, sparse=lambda b: b["kjt"])
            seq = distinct_batches(batches, args.steps + 3)
            rate = time_steps(lambda _: pipeline.progress(seq), batches, args.steps,
                              sync=dist.barrier)
        else:
            rate = time_steps(sgd_step(ebc, dense, opt), batches, args.steps, sync=dist.barrier)
        dist.barrier()
        if rank == 0:
            client.drop_collection(name)
            queue.put(rate)
    finally:
        dist.destroy_process_group()


def run_trainers(args):
    """--trainers > 1: samples/s of DMP and of Ember in each mode."""
    import socket
    import torch.multiprocessing as mp
    import torchrec
    results = {"trainers": args.trainers, "batch": args.batch, "workers": args.workers}
    if args.dmp:
        rate, plan = run_dmp(args, world=args.trainers)
        results["dmp_samples_per_s"], results["dmp_plan"] = rate * args.batch, plan
    modes = {"async": {"mode": "ASYNC"},
             "sync": {"mode": "SYNC", "trainers": args.trainers},
             "bounded1": {"mode": "BOUNDED", "trainers": args.trainers, "max_staleness": 1}}

    def run(address):
        ctx = mp.get_context("spawn")
        for key, training in modes.items():
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            queue = ctx.Queue()
            name = f"train_bench_{key}_{int(time.time())}"
            procs = [ctx.Process(target=ember_trainer,
                                 args=(r, args, address, name, training, port, queue))
                     for r in range(args.trainers)]
            for p in procs:
                p.start()
            try:
                results[f"ember_{key}_samples_per_s"] = queue.get(timeout=900) * args.batch
            finally:
                for p in procs:
                    p.join(timeout=60)
                    if p.is_alive():
                        p.kill()

    on_cluster(args, run)
    if args.dmp:
        results["sync_vs_dmp"] = results["ember_sync_samples_per_s"] / results["dmp_samples_per_s"]
    results.update({"tables": args.tables, "rows": args.rows, "dim": args.dim,
                    "pooling_factor": args.pf, "steps": args.steps,
                    "torch": torch.__version__, "torchrec": torchrec.__version__})
    if args.format == "json":
        print(json.dumps(results), flush=True)
        return
    print(f"train_bench: {args.trainers} trainers, global batch {args.batch}; {args.tables} "
          f"tables of {args.rows} x {args.dim}, pooling factor {args.pf}, row-wise Adagrad; "
          f"{args.workers} Ember workers; torch {torch.__version__}, torchrec "
          f"{torchrec.__version__}")
    if args.dmp:
        print(f"  torchrec DMP, gloo, {args.trainers} ranks: {results['dmp_samples_per_s']:10.0f} "
              f"samples/s  ({', '.join(results['dmp_plan'])})")
    for key, label in (("async", "ASYNC"), ("sync", "SYNC"), ("bounded1", "BOUNDED(1), pipelined")):
        print(f"  ember {label:22s} {results[f'ember_{key}_samples_per_s']:10.0f} samples/s")
    if args.dmp:
        print(f"  ember SYNC / DMP: {results['sync_vs_dmp']:.2f}x")


def main():
    args = parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    if args.trainers > 1 or args.modes:
        if args.trainers < 1 or args.batch % args.trainers:
            sys.exit(f"train_bench: --batch {args.batch} is not a multiple of --trainers")
        return run_trainers(args)
    try:
        import torchrec
        import torchrec.optim as trec_optim
        from torchrec.modules.fused_embedding_modules import fuse_embedding_optimizer
    except ImportError as e:
        sys.exit(f"train_bench: {e}: run with the .venv scripts/setup.sh prepares")
    configs = [torchrec.EmbeddingBagConfig(name=f"t{t}", embedding_dim=args.dim,
                                           num_embeddings=args.rows, feature_names=[f"f{t}"])
               for t in range(args.tables)]
    batches = make_batches(args, torchrec)
    lr = 0.05
    torch.manual_seed(0)
    dense0 = Dense(args.tables * args.dim)

    # TorchRec, local, FBGEMM's fused row-wise Adagrad.
    ref = fuse_embedding_optimizer(
        torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu")),
        optimizer_type=trec_optim.RowWiseAdagrad, optimizer_kwargs={"lr": lr, "eps": 1e-8},
        device=torch.device("cpu"))
    if args.model == "dlrm":
        torch.manual_seed(0)
        ref_model = dlrm_over(ref, args)
        opt = torch.optim.SGD([p for n, p in ref_model.named_parameters()
                               if "embedding_bags" not in n], lr=0.01)
        ref_step = dlrm_step(ref_model, opt)
    else:
        dense = copy.deepcopy(dense0)
        opt = torch.optim.SGD(dense.parameters(), lr=0.01)
        ref_step = sgd_step(ref, dense, opt)

    results = {"torchrec_steps_per_s": time_steps(ref_step, batches, args.steps)}
    del ref
    if args.dmp:
        results["dmp_steps_per_s"], results["dmp_plan"] = run_dmp(args)

    def run_ember(address):
        client = ember.Client(address, timeout_s=120)
        name = f"train_bench_{int(time.time())}"
        ebc = ember.torch.EmbeddingBagCollection(
            configs, client, name, optimizer={"type": "ROWWISE_ADAGRAD", "learning_rate": lr,
                                              "eps": 1e-8})
        try:
            if args.model == "dlrm":
                torch.manual_seed(0)
                dlrm = dlrm_over(ebc, args)  # TorchRec's class over Ember's module
                eopt = torch.optim.SGD(dlrm.parameters(), lr=0.01)  # dense only: Ember's
                # module holds no parameter

                def model(b):
                    return torch.nn.functional.binary_cross_entropy_with_logits(
                        dlrm(b["dense"], b["kjt"]).squeeze(-1), b["label"])

                ember_step = dlrm_step(dlrm, eopt)
            else:
                model_dense = copy.deepcopy(dense0)
                eopt = torch.optim.SGD(model_dense.parameters(), lr=0.01)

                def model(b):
                    return torch.nn.functional.binary_cross_entropy_with_logits(
                        model_dense(ebc(b["kjt"]).values()), b["label"])

                ember_step = sgd_step(ebc, model_dense, eopt)
            results["ember_steps_per_s"] = time_steps(ember_step, batches, args.steps)
            # Pipelined: a fresh iterator over the same batches, cycled.
            pipeline = ember.torch.TrainPipeline(model, eopt, ebc, sparse=lambda b: b["kjt"])
            total = args.steps + 3
            seq = distinct_batches(batches, total)
            for _ in range(3):
                pipeline.progress(seq)
            start = time.perf_counter()
            for _ in range(args.steps):
                pipeline.progress(seq)
            results["pipelined_steps_per_s"] = args.steps / (time.perf_counter() - start)
            results["plan"] = sorted({t["sharding_type"] for t in ebc._info["plan"]["tables"]})
        finally:
            client.drop_collection(name)

    on_cluster(args, run_ember)
    base = results["torchrec_steps_per_s"]
    results.update({
        "ember_ratio": results["ember_steps_per_s"] / base,
        "pipelined_ratio": results["pipelined_steps_per_s"] / base,
        "ember_vs_dmp": (results["ember_steps_per_s"] / results["dmp_steps_per_s"]
                         if args.dmp else None),
        "pipelined_vs_dmp": (results["pipelined_steps_per_s"] / results["dmp_steps_per_s"]
                             if args.dmp else None),
        "tables": args.tables, "rows": args.rows, "dim": args.dim, "batch": args.batch,
        "pooling_factor": args.pf, "steps": args.steps, "workers": args.workers,
        "torch": torch.__version__, "torchrec": torchrec.__version__, "model": args.model,
    })
    if args.format == "json":
        print(json.dumps(results), flush=True)
        return
    print(f"train_bench: {args.model}; {args.tables} tables of {args.rows} x {args.dim}, "
          f"batch {args.batch}, pooling factor {args.pf}, row-wise Adagrad; {args.workers} "
          f"Ember workers "
          f"({', '.join(results['plan'])}); torch {torch.__version__}, torchrec "
          f"{torchrec.__version__}")
    print(f"  torchrec (local, FBGEMM fused): {base:8.2f} steps/s")
    if args.dmp:
        print(f"  torchrec DMP, gloo, {args.workers} procs:  {results['dmp_steps_per_s']:8.2f} "
              f"steps/s  ({', '.join(results['dmp_plan'])})")
    print(f"  ember:                          {results['ember_steps_per_s']:8.2f} steps/s  "
          f"{results['ember_ratio']:.2f}x")
    print(f"  ember, pipelined:               {results['pipelined_steps_per_s']:8.2f} steps/s  "
          f"{results['pipelined_ratio']:.2f}x")
    if args.dmp:
        print(f"  ember / DMP: {results['ember_vs_dmp']:.2f}x, pipelined / DMP: "
              f"{results['pipelined_vs_dmp']:.2f}x")


if __name__ == "__main__":
    main()
