"""One rank of test_training's comparison with TorchRec's own multi-rank
training (run as a process per rank): TorchRec's DLRM under
DistributedModelParallel over gloo on the CPU, its tables either sharded by
TorchRec (FBGEMM's fused row-wise Adagrad; `--mode=torchrec`) or put on
Ember by EmberSharder (SYNC over the ranks; `--mode=ember`); row-wise
Adagrad or SGD (`--optimizer`; TorchRec refuses Adam on the CPU: "Optimizer
adam is not supported in CPU mode"). The same
initial weights, the same global batches (each rank its slice). Writes the
rank's losses and the tables (TorchRec: this rank's shards with their
offsets; Ember: the whole tables, from rank 0) to `--out`.npz."""

import argparse
import gc
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torchrec
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.models import dlrm

TABLES = [("t_user", 60, ["user"]), ("t_item", 40, ["item", "item_prev"])]
FEATURES = ["user", "item", "item_prev"]
DIM, DENSE, BATCH, STEPS, LR = 8, 5, 4, 5, 0.1


def batches(world):
    """STEPS global batches of BATCH samples per rank: (kjt slices, dense, labels)."""
    rng = np.random.default_rng(31)
    rows = {"user": 60, "item": 40, "item_prev": 40}
    out = []
    for _ in range(STEPS):
        per_rank = []
        for _ in range(world):
            lengths, values = [], []
            for f in FEATURES:
                for _ in range(BATCH):
                    k = int(rng.integers(0, 4))
                    lengths.append(k)
                    values.extend(int(v) for v in np.minimum(rng.zipf(1.5, size=k) - 1,
                                                             rows[f] - 1))
            kjt = KeyedJaggedTensor.from_lengths_sync(
                keys=FEATURES, values=torch.tensor(values, dtype=torch.int64),
                lengths=torch.tensor(lengths, dtype=torch.int64))
            dense = torch.from_numpy(rng.normal(size=(BATCH, DENSE)).astype(np.float32))
            labels = torch.from_numpy((rng.random(BATCH) < 0.4).astype(np.float32))
            per_rank.append((kjt, dense, labels))
        out.append(per_rank)
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--mode", choices=["torchrec", "ember"], required=True)
    p.add_argument("--coordinator", default="")
    p.add_argument("--collection", default="dmp_sync")
    p.add_argument("--optimizer", choices=["ROWWISE_ADAGRAD", "SGD"], default="ROWWISE_ADAGRAD")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank,
                            world_size=a.world)
    configs = [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=f)
               for n, r, f in TABLES]
    torch.manual_seed(1)
    initial = {n: torch.empty(r, DIM).uniform_(-0.5, 0.5) for n, r, _ in TABLES}
    torch.manual_seed(2)
    model = dlrm.DLRM(embedding_bag_collection=torchrec.EmbeddingBagCollection(tables=configs),
                      dense_in_features=DENSE, dense_arch_layer_sizes=[16, DIM],
                      over_arch_layer_sizes=[16, 1])
    for n, _, _ in TABLES:
        model.sparse_arch.embedding_bag_collection.embedding_bags[n].weight.data.copy_(initial[n])
    if a.mode == "torchrec":
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        kind = (EmbOptimType.EXACT_ROWWISE_ADAGRAD if a.optimizer == "ROWWISE_ADAGRAD"
                else EmbOptimType.EXACT_SGD)
        sharder = EmbeddingBagCollectionSharder(fused_params={
            "optimizer": kind, "learning_rate": LR, "eps": 1e-8})
    else:
        import ember
        from ember.torchrec import EmberSharder
        client = ember.Client(a.coordinator, timeout_s=60)
        sharder = EmberSharder(client, optimizer={"type": a.optimizer, "learning_rate": LR,
                                                  "eps": 1e-8}, prefix=a.collection + "_")
    plan = None
    if a.mode == "torchrec":  # table-wise (row-wise is GPU-only), FBGEMM's fused kernel (TorchRec's planner
        # would keep tables this small data-parallel)
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.planner.types import ParameterConstraints
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=a.world, compute_device="cpu"),
            constraints={n: ParameterConstraints(sharding_types=["table_wise"],
                                                 compute_kernels=["fused"])
                         for n, _, _ in TABLES})
        plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), sharders=[sharder],
                                   plan=plan)
    if a.mode == "torchrec":  # DMP initialised the shards itself: the same tables
        for key, value in dmp.state_dict().items():
            name = key.split(".")[-2] if key.endswith(".weight") else None
            if name in initial and hasattr(value, "local_shards"):
                for shard in value.local_shards():
                    r0, c0 = shard.metadata.shard_offsets
                    rows, cols = shard.metadata.shard_sizes
                    shard.tensor.copy_(initial[name][r0:r0 + rows, c0:c0 + cols])
    dense_opt = torch.optim.SGD([p for n, p in dmp.named_parameters()
                                 if "embedding_bags" not in n], lr=LR)
    losses = []
    for step in batches(a.world):
        kjt, dense, labels = step[a.rank]
        dense_opt.zero_grad()
        logits = dmp(dense, kjt).squeeze(-1)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
        loss.backward()
        dense_opt.step()
        losses.append(float(loss.detach()))
    dist.barrier()
    out = {"losses": np.array(losses)}
    if a.mode == "torchrec":
        for key, value in dmp.state_dict().items():
            name = key.split(".")[-2] if key.endswith(".weight") else None
            if name in initial and hasattr(value, "local_shards"):
                for i, shard in enumerate(value.local_shards()):
                    out[f"{name}/{i}/offsets"] = np.array(shard.metadata.shard_offsets)
                    out[f"{name}/{i}/values"] = shard.tensor.detach().numpy().copy()
    elif a.rank == 0:
        coll = f"{a.collection}_sparse_arch_embedding_bag_collection"
        for n, _, _ in TABLES:
            out[f"{n}/0/offsets"] = np.array([0, 0])
            out[f"{n}/0/values"] = client.export_table(coll, n)
        client.drop_collection(coll)
    np.savez(a.out, **out)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {a.rank} ok", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # The model, its Ember client and the process group's last references go
    # here, while the interpreter is whole; then the process leaves without
    # the interpreter's teardown, in which torch's gloo threads can abort a
    # rank that has finished ("terminate called without an active
    # exception" after "rank 1 ok", seen once in CI; pytorch/pytorch#179291
    # describes the race).
    gc.collect()
    sys.stdout.flush()
    os._exit(code)
