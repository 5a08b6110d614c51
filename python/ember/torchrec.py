"""ember.torchrec: put a TorchRec model's EmbeddingBagCollections on Ember
through TorchRec's own DistributedModelParallel, without touching the model.

    from torchrec.distributed.model_parallel import DistributedModelParallel
    from ember.torchrec import EmberSharder

    sharder = EmberSharder(client, optimizer={"type": "ROWWISE_ADAGRAD",
                                              "learning_rate": 0.05})
    model = DistributedModelParallel(DLRM(...), device=torch.device("cpu"),
                                     sharders=[sharder])

DMP plans every torchrec.EmbeddingBagCollection of the model with this
sharder (data_parallel as far as TorchRec's planner is concerned: the
tables do not live in the trainers) and calls shard(), which replaces the
module with an ember.torch.EmbeddingBagCollection over a collection named
after the module's path (`prefix` + fqn, dots as underscores). Rank 0 of
DMP's process group creates the collection, with the module's weights when
they are materialised (not on the meta device), and the other ranks attach
to it once it exists. The dense rest of the model is DMP's, under DDP.

Semantics with several ranks: TorchRec's. The collection trains SYNC with
one trainer per rank of DMP's process group (the sharder's `training`, by
default {"mode": "SYNC", "trainers": world size}; docs/training.md): each
step's update is applied once every rank sent its own, merged, the
gradients averaged over the ranks as TorchRec's gradient division does.
Give {"mode": "BOUNDED", ...} or {"mode": "ASYNC"} for other semantics.

Checkpoints: the modules' table_state is "checkpoint" (the sharder's
`table_state`), so the model's state dict holds a TableCheckpoint per table,
never the tables themselves (as TorchRec's sharded modules hold only their
rank's shards). torch.distributed.checkpoint.save(model.state_dict() or
{"model": model}, ...) writes the dense state and, once for each
collection, an Ember checkpoint on the workers (under `checkpoint_dir`;
empty: the coordinator's --checkpoint_dir), recording its path;
torch.distributed.checkpoint.load restores it, rank 0 restoring while the
other ranks wait.
"""

import torch
import torch.distributed as dist

import ember
import ember.torch

from torchrec import EmbeddingBagCollection as _TorchRecEBC
from torchrec.distributed.types import ModuleSharder


class EmberSharder(ModuleSharder):
    """A TorchRec ModuleSharder that serves EmbeddingBagCollections from
    Ember (see the module doc). `optimizer` is the tables' fused optimizer
    (ember.torch's form); `sharding_type` Ember's plan for the collection
    (None: its planner's choice); `prefix` starts every collection's name;
    `table_state` and `checkpoint_dir` the modules' (ember.torch's: with
    "checkpoint", a state dict names an Ember checkpoint of the tables
    instead of copying them into the trainer); `training` the collection's
    TrainingSpec (None: SYNC over DMP's ranks, ASYNC with one rank)."""

    def __init__(self, client, optimizer=None, sharding_type=None, prefix="dmp_",
                 table_state="checkpoint", checkpoint_dir="", training=None):
        super().__init__()
        self._client = client
        self._optimizer = optimizer
        self._sharding_type = sharding_type
        self._prefix = prefix
        self._table_state = ember.torch._checked_table_state(table_state)
        self._checkpoint_dir = checkpoint_dir
        self._training = training

    @property
    def module_type(self):
        return _TorchRecEBC

    def shardable_parameters(self, module):
        return {name.split(".")[0]: p for name, p in module.embedding_bags.named_parameters()}

    def sharding_types(self, compute_device_type):
        return ["data_parallel"]

    def compute_kernels(self, sharding_type, compute_device_type):
        return ["dense"]

    def storage_usage(self, tensor, compute_device_type, compute_kernel):
        # The tables are the workers', not the trainers'.
        return {"hbm" if compute_device_type == "cuda" else "ddr": 0}

    def collection_name(self, module_fqn):
        return self._prefix + (module_fqn or "ebc").replace(".", "_")

    def shard(self, module, params, env, device=None, module_fqn=None):
        """The Ember module that replaces `module` (DMP calls this on every
        rank)."""
        name = self.collection_name(module_fqn)
        configs = module.embedding_bag_configs()
        pg = getattr(env, "process_group", None)
        distributed = pg is not None and dist.is_initialized()
        rank = dist.get_rank(pg) if distributed else 0
        world = dist.get_world_size(pg) if distributed else 1
        training = self._training
        if training is None and world > 1:
            training = {"mode": "SYNC", "trainers": world}  # TorchRec's step semantics
        error = None
        if rank == 0:
            try:
                ebc = ember.torch.EmbeddingBagCollection(
                    configs, self._client, name, optimizer=self._optimizer,
                    sharding_type=self._sharding_type, is_weighted=module.is_weighted(),
                    training=training, rank=rank)
                state = module.state_dict()
                if all(v.device.type != "meta" for v in state.values()):
                    ebc.load_state_dict(state)
            except Exception as e:  # said to every rank below, then raised
                error = e
        if pg is not None and dist.is_initialized():
            failed = [error is not None]
            dist.broadcast_object_list(failed, src=0, group=pg)
            if failed[0] and error is None:
                raise RuntimeError(f"EmberSharder: rank 0 could not create collection '{name}'")
        if error is not None:
            raise error
        if rank != 0:
            ebc = ember.torch.EmbeddingBagCollection(
                configs, self._client, name, optimizer=self._optimizer, create=False,
                is_weighted=module.is_weighted(), training=training, rank=rank)
        ebc._set_table_state(self._table_state, self._checkpoint_dir, self._sharding_type)
        ebc._dist_group = pg
        return ebc
