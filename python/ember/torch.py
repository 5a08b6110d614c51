"""ember.torch: a remote EmbeddingBagCollection for PyTorch trainers.

    from ember.torch import EmbeddingBagCollection
    ebc = EmbeddingBagCollection(tables, client, "ads", optimizer={"type": "SGD",
                                                                    "learning_rate": 0.1})
    kt = ebc(kjt)                      # KeyedTensor; kt.values() takes part in autograd
    loss = dense_model(kt.values()).sum()
    loss.backward()                    # gradients go to the workers: the tables'
                                       # optimizers run there, fused, exactly once

It behaves like TorchRec's EmbeddingBagCollection with a fused optimizer,
but the tables live on Ember workers: no embedding parameter is in the
trainer (parameters() yields none of them, so the dense optimizer never sees
them), `state_dict()` carries each table as "embedding_bags.<table>.weight"
(TorchRec's names) and `load_state_dict()` writes them to the workers; with
table_state="checkpoint" it carries TableCheckpoint entries instead, which
torch.distributed.checkpoint saves as an Ember checkpoint on the workers and
loads by restoring it (no table passes through the trainer). Under
torch.no_grad() or eval() a forward only looks up.
"""

import concurrent.futures
import itertools
import sys
import threading
import uuid
import warnings

import numpy as np
import torch

import ember


class KeyedTensor:
    """TorchRec's KeyedTensor shape: keys(), length_per_key(), values()
    ([B, sum dims] tensor), to_dict(), and kt[key]."""

    def __init__(self, keys, length_per_key, values):
        self._keys = list(keys)
        self._length_per_key = list(length_per_key)
        self._values = values

    def keys(self):
        return self._keys

    def length_per_key(self):
        return self._length_per_key

    def values(self):
        return self._values

    def offset_per_key(self):
        return [0] + list(itertools.accumulate(self._length_per_key))

    def __getitem__(self, key):
        off = self.offset_per_key()
        k = self._keys.index(key)
        return self._values[:, off[k]:off[k + 1]]

    def to_dict(self):
        return {k: self[k] for k in self._keys}


def _device_args(kjt):
    """A torch KJT's arrays as the device path takes them (contiguous int64
    lengths and values, float32 weights or None), on their device; the
    caller keeps them alive through the call."""
    lengths = kjt.lengths().to(torch.int64).contiguous()
    values = kjt.values().to(torch.int64).contiguous()
    w = kjt.weights_or_none() if hasattr(kjt, "weights_or_none") else None
    weights = None if w is None else w.to(torch.float32).contiguous()
    return lengths, values, weights


def _ready(device):
    """Work queued on the device's current stream (what made the tensors)
    done before the link's own stream reads them."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _device_of(kjt):
    """The device of a torch-based KJT's values (torchrec's), else None."""
    values = getattr(kjt, "values", None)
    values = values() if callable(values) else values
    return values.device if isinstance(values, torch.Tensor) else None


class _RemoteLookup(torch.autograd.Function):
    """values = lookup(kjt); backward sends d(loss)/d(values) to the workers."""

    @staticmethod
    def forward(ctx, anchor, module, kjt, step, values):
        ctx.module = module
        ctx.kjt = kjt
        ctx.step = step
        return values.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.module._apply_gradients(ctx.kjt, grad, ctx.step)
        return None, None, None, None, None


def _check_stored(collection, specs, stored):
    """FailedPrecondition unless the stored collection's tables are `specs`
    (create=False): same names, and the same value of every field a config
    fixes, the optimizer too where one is given."""
    have = {t["name"]: t for t in stored}
    want_names = [t["name"] for t in specs]
    if sorted(have) != sorted(want_names):
        raise ember.FailedPrecondition(
            9, f"collection '{collection}' holds tables {sorted(have)}, not {sorted(want_names)}")
    for t in specs:
        h = have[t["name"]]
        for field in _CONFIG_FIELDS + ("optimizer",):
            if field not in t:
                continue
            want, got = t[field], h.get(field)
            if field in ("num_embeddings", "embedding_dim"):
                want, got = int(want), int(got or 0)
                if field == "num_embeddings" and want == 0 and t.get("dynamic"):
                    want = int(t["dynamic"].get("capacity", 0))  # the rows stored
            elif field in ("pooling", "data_type"):
                want, got = str(want).upper(), str(got or ("SUM" if field == "pooling" else "FP32"))
            elif field == "optimizer":
                got = dict(got or {})
                mismatch = [k for k, v in want.items() if not _same(v, got.get(k))]
                if mismatch:
                    k = mismatch[0]
                    raise ember.FailedPrecondition(
                        9, f"collection '{collection}' table '{t['name']}': optimizer.{k} is "
                           f"{got.get(k)!r} there, {want[k]!r} here (create=False attaches to "
                           "the tables as they are)")
                continue
            if want != got:
                raise ember.FailedPrecondition(
                    9, f"collection '{collection}' table '{t['name']}': {field} is {got!r} "
                       f"there, {want!r} here (create=False attaches to the tables as they are)")


def _same(a, b):
    """Whether a spec value given here matches the stored one (numbers by
    value: the stored spec's are JSON's)."""
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        try:
            return abs(float(a) - float(b)) <= 1e-12 * max(1.0, abs(float(a)))
        except (TypeError, ValueError):
            return False
    return str(a).upper() == str(b).upper() if isinstance(a, str) else a == b


def _table_specs(tables, optimizer, pooling=None):
    """The spec tables of `tables` (configs or dicts), each with `optimizer`
    where it names none, and `pooling` forced when given."""
    specs = []
    for t in tables:
        spec = ember.table_spec(t)
        if pooling is not None:
            spec["pooling"] = pooling
        if optimizer is not None and "optimizer" not in spec:
            spec["optimizer"] = dict(optimizer)
        specs.append(spec)
    return specs


def _open_collection(client, collection, specs, create, sharding_type, training=None,
                     constraints=None):
    """The collection's info: created from `specs` (and `training`, its
    TrainingSpec, and `constraints`, the planner's per-table constraints,
    when given), or (create=False) the existing one, refused unless its
    tables are `specs` (_check_stored) and its training has the values
    `training` gives."""
    if create:
        spec = {"name": collection, "tables": specs}
        if training is not None:
            spec["training"] = dict(training)
        if constraints:
            spec["constraints"] = {t: dict(c) for t, c in constraints.items()}
        return client.create_collection(spec, sharding_type=sharding_type)
    info = client.collection(collection)
    _check_stored(collection, specs, info["spec"]["tables"])
    stored = info["spec"].get("training", {})
    for key, value in (training or {}).items():
        have = stored.get(key, {"mode": "ASYNC", "gradient_reduction": "MEAN"}.get(key, 0))
        if have != value:
            raise ember.FailedPrecondition(
                9, f"collection '{collection}' exists with training.{key} {have!r}, not "
                   f"{value!r}")
    return info


class EmbeddingBagConfig:
    """A table's configuration with the fields and defaults of
    torchrec.EmbeddingBagConfig, for a program without TorchRec (tables given
    as dicts are turned into these; with TorchRec installed, into TorchRec's
    own)."""

    def __init__(self, name, num_embeddings, embedding_dim, feature_names=None,
                 pooling="SUM", data_type="FP32", init_fn=None, weight_init_min=None,
                 weight_init_max=None):
        self.name = name
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self.feature_names = list(feature_names or [name])
        self.pooling = pooling
        self.data_type = data_type
        self.init_fn = init_fn
        self.weight_init_min = weight_init_min
        self.weight_init_max = weight_init_max

    def __repr__(self):
        return (f"EmbeddingBagConfig(name={self.name!r}, num_embeddings={self.num_embeddings}, "
                f"embedding_dim={self.embedding_dim}, feature_names={self.feature_names!r}, "
                f"pooling={self.pooling!r})")


# The spec fields a TorchRec-style config fixes, compared when a module
# attaches to an existing collection (create=False).
_CONFIG_FIELDS = ("num_embeddings", "embedding_dim", "feature_names", "pooling", "data_type")


def _config_of(t):
    """A table given as a dict as an EmbeddingBagConfig (TorchRec's when it is
    installed); a config object as it is."""
    if not isinstance(t, dict):
        return t
    fields = {k: t[k] for k in ("name", "num_embeddings", "embedding_dim", "feature_names")
              if k in t}
    if t.get("dynamic") and not fields.get("num_embeddings"):
        # A dynamic table's rows are its capacity (the collection's spec says so too).
        fields["num_embeddings"] = int(t["dynamic"].get("capacity", 0))
    try:
        from torchrec import EmbeddingBagConfig as TorchRecConfig
        from torchrec.modules.embedding_configs import PoolingType
        pooling = str(t.get("pooling", "SUM")).upper()
        return TorchRecConfig(**fields, pooling=PoolingType[pooling])
    except ImportError:
        return EmbeddingBagConfig(**fields, pooling=t.get("pooling", "SUM"),
                                  data_type=t.get("data_type", "FP32"))


def _default_init(config, weight):
    """TorchRec's default initialisation: uniform in +-sqrt(1 / rows), or
    the config's weight_init_min/max."""
    lo = getattr(config, "weight_init_min", None)
    hi = getattr(config, "weight_init_max", None)
    bound = (1.0 / max(1, config.num_embeddings)) ** 0.5
    torch.nn.init.uniform_(weight, -bound if lo is None else lo, bound if hi is None else hi)


class _RemoteEmbeddingBag(torch.nn.Module):
    """One table of the collection, where TorchRec's module has its
    nn.EmbeddingBag (ebc.embedding_bags[name]): its shape and pooling, and its
    weight in the state dict (read from and written to the workers). It holds
    no parameter: the table lives on the workers."""

    def __init__(self, owner, config):
        super().__init__()
        self._owner = [owner]  # a list: not a submodule (no cycle in modules())
        self.name = config.name
        self.num_embeddings = int(config.num_embeddings)
        self.embedding_dim = int(config.embedding_dim)
        pooling = getattr(config, "pooling", "SUM")
        self.mode = getattr(pooling, "name", str(pooling)).lower()
        stored = {t["name"]: t for t in owner._info["spec"]["tables"]}
        self.dynamic = "dynamic" in stored.get(self.name, {})

    @property
    def weight(self):
        """A copy of the table as it is on the workers ([rows, dim] float32);
        writing into it changes nothing there (load_state_dict does). A
        dynamic (hash-keyed) table: the rows it holds, in the order of
        `ids`."""
        ebc = self._owner[0]
        if self.dynamic:
            return torch.from_numpy(ebc._client.export_table(ebc._collection, self.name)[1])
        return torch.from_numpy(ebc._client.export_table(ebc._collection, self.name))

    @property
    def ids(self):
        """A dynamic table's ids held, ascending (int64 [n]; `weight`'s rows)."""
        ebc = self._owner[0]
        if not self.dynamic:
            raise AttributeError(f"table '{self.name}' is not dynamic: it has no ids")
        return torch.from_numpy(ebc._client.export_table(ebc._collection, self.name)[0])

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        ebc = self._owner[0]
        if ebc._table_state == "checkpoint":
            destination[prefix + "weight"] = TableCheckpoint(
                ebc._collection, self.name, self.num_embeddings, self.embedding_dim,
                _snapshot=ebc._saving)
        elif self.dynamic:  # its ids beside the rows they hold
            ids, rows = ebc._client.export_table(ebc._collection, self.name)
            destination[prefix + "ids"] = torch.from_numpy(ids)
            destination[prefix + "weight"] = torch.from_numpy(rows)
        else:
            destination[prefix + "weight"] = self.weight

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        ids_key = prefix + "ids"
        ours = {key, ids_key} if self.dynamic else {key}
        if key in state_dict:
            ebc = self._owner[0]
            # A TableCheckpoint was restored by the owner (_RemoteTables).
            if isinstance(state_dict[key], TableCheckpoint):
                pass
            elif self.dynamic:
                if ids_key not in state_dict:
                    missing_keys.append(ids_key)
                else:
                    ebc._client.import_table(ebc._collection, self.name,
                                             (state_dict[ids_key], state_dict[key]))
            else:
                ebc._client.import_table(ebc._collection, self.name, state_dict[key])
        elif strict:
            missing_keys.append(key)
        for k in state_dict:
            if strict and k.startswith(prefix) and k not in ours:
                unexpected_keys.append(k)


def _checked_table_state(table_state):
    """`table_state` if it is one the modules take; ValueError otherwise."""
    if table_state not in ("tensors", "checkpoint"):
        raise ValueError(f"table_state must be 'tensors' or 'checkpoint', got {table_state!r}")
    return table_state


class TableCheckpoint:
    """A table's entry in the state dict of a module whose table_state is
    "checkpoint": where the table is saved on the workers, not its values.

    state_dict() takes nothing. The first time one of a state dict's entries
    is serialized (torch.distributed.checkpoint writing it, pickle,
    torch.save) or take() is called, the module's collection is checkpointed
    on the workers (Client.checkpoint, one checkpoint for all its tables) and
    every entry of that state dict records its path. load_state_dict() given
    such entries restores the collection from that checkpoint. Fields:
    collection, table, num_embeddings, embedding_dim, path (None until
    taken)."""

    def __init__(self, collection, table, num_embeddings, embedding_dim, path=None,
                 _snapshot=None):
        self.collection = collection
        self.table = table
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        self._path = path
        self._snapshot = _snapshot

    @property
    def path(self):
        if self._path is None and self._snapshot is not None:
            return self._snapshot.path
        return self._path

    def take(self):
        """Checkpoints the collection now unless this state dict's entries
        already did; returns the checkpoint's path."""
        if self._path is None:
            if self._snapshot is None:
                raise ValueError(f"TableCheckpoint of '{self.collection}.{self.table}' "
                                 "has no path and no module to checkpoint")
            self._path = self._snapshot.take()
        return self._path

    def __reduce__(self):
        return (TableCheckpoint, (self.collection, self.table, self.num_embeddings,
                                  self.embedding_dim, self.take()))

    def __deepcopy__(self, memo):
        # A copy of the state dict shares its snapshot: nothing is taken.
        return TableCheckpoint(self.collection, self.table, self.num_embeddings,
                               self.embedding_dim, self._path, self._snapshot)

    def __repr__(self):
        return (f"TableCheckpoint(collection={self.collection!r}, table={self.table!r}, "
                f"shape=[{self.num_embeddings}, {self.embedding_dim}], path={self.path!r})")


def take_table_checkpoints(state_dict):
    """Takes the checkpoints of every TableCheckpoint in `state_dict`
    (nested dicts too) now, before an asynchronous save serializes them later
    (torch.distributed.checkpoint.async_save): the tables are then saved at
    the same step as the dense state. Returns the paths taken."""
    paths = []
    for v in state_dict.values():
        if isinstance(v, TableCheckpoint):
            paths.append(v.take())
        elif isinstance(v, dict):
            paths.extend(take_table_checkpoints(v))
    return sorted(set(paths))


class _Snapshot:
    """One state_dict() call's checkpoint of a module's collection, taken
    once, when the first of its entries asks (TableCheckpoint.take)."""

    def __init__(self, client, collection, directory):
        self._client = client
        self._collection = collection
        self._dir = directory
        self._lock = threading.Lock()
        self.path = None

    def take(self):
        with self._lock:
            if self.path is None:
                info = self._client.checkpoint(self._collection, dir=self._dir, progress=True)
                self.path = info["path"]
        return self.path


class _ClientRef:
    """What a pickled module keeps of its client: how to connect again.
    A token given as a string is not written (it is a secret); a token file's
    path is, and is read again on load."""

    def __init__(self, client):
        self.kwargs = dict(getattr(client, "_connect_kwargs", {"address": client.address}))
        self.kwargs.pop("auth_token", None)

    def connect(self):
        return ember.Client(**self.kwargs)


def _select_features(kjt, names, keep_weights):
    """kjt as a lookup takes it: features `names` only, in that order
    (KeyError for one that is missing, as TorchRec's modules raise), without
    weights unless keep_weights. The KJT itself when it already is that."""
    keys = list(kjt.keys() if callable(kjt.keys) else kjt.keys)
    for f in names:
        if f not in keys:
            raise KeyError(f)
    weights = (kjt.weights_or_none() if hasattr(kjt, "weights_or_none")
               else getattr(kjt, "weights", None))
    if keys == names and (weights is None or keep_weights):
        return kjt
    k = ember._as_kjt(kjt)
    batch = k.batch_size()
    offsets = np.concatenate([[0], np.cumsum(k.lengths)])
    lengths, values, w = [], [], []
    for f in names:
        i = keys.index(f)
        lengths.append(k.lengths[i * batch:(i + 1) * batch])
        lo, hi = offsets[i * batch], offsets[(i + 1) * batch]
        values.append(k.values[lo:hi])
        if keep_weights and k.weights is not None:
            w.append(k.weights[lo:hi])
    return ember.KeyedJaggedTensor(
        names, np.concatenate(lengths) if lengths else np.zeros(0, np.int64),
        np.concatenate(values) if values else np.zeros(0, np.int64),
        np.concatenate(w) if w else None)


class _RemoteTables(torch.nn.Module):
    """What ember.torch's two modules share: their tables' configs, the
    collection on the workers and the client that reaches it, TorchRec's
    `device` and reset_parameters(), and pickling as a reconnecting handle.
    A subclass's _setup(client, collection, configs, flag, device, info)
    calls _setup_tables; `flag` is its constructor's flag that a pickle
    keeps (_flag())."""

    def _setup_tables(self, client, collection, configs, device, info):
        self._client = client
        self._collection = collection
        self._info = info
        self._configs = configs
        self._device = torch.device(device) if device is not None else torch.device("cpu")
        self._feature_names = [list(c.feature_names) for c in configs]
        self._embedding_names = [f for names in self._feature_names for f in names]
        self._step = 0
        self._run = uuid.uuid4().hex[:12]
        self._saving = None
        self._executor = None  # the background thread of prefetch() and fill_caches()
        self._dist_group = None  # set by ember.torchrec.EmberSharder: restores on rank 0
        self._set_table_state("tensors", "", None)
        # _set_rank (the constructors, unpickling) sets these for real.
        self._stepped, self._rank, self._rank_given, self._next_step = False, None, None, 0

    def _set_rank(self, rank):
        """The trainer's rank and the step counter, for a collection that
        trains SYNC or BOUNDED (its TrainingSpec): `rank` given, else
        torch.distributed's when initialised, else 0 with one trainer."""
        training = self._info["spec"].get("training", {})
        self._stepped = training.get("mode", "ASYNC") in ("SYNC", "BOUNDED")
        trainers = int(training.get("trainers", 1) or 1)
        self._rank_given = rank
        if rank is None and torch.distributed.is_available() and \
                torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        if rank is None and trainers == 1:
            rank = 0
        if self._stepped:
            if rank is None:
                raise ValueError(f"collection '{self._collection}' trains "
                                 f"{training.get('mode')} with {trainers} trainers: give this "
                                 "trainer's rank (rank=...) or initialise torch.distributed")
            if not 0 <= int(rank) < trainers:
                raise ValueError(f"rank {rank} is outside 0..{trainers - 1} (collection "
                                 f"'{self._collection}' has {trainers} trainers)")
        self._rank = None if rank is None else int(rank)
        self._next_step = 0
        self._steps_ahead = 0  # prefetched lookups not yet consumed

    @property
    def rank(self):
        """This trainer's rank among the collection's trainers (SYNC and
        BOUNDED collections), or None."""
        return self._rank

    @property
    def train_step(self):
        """The step the next training forward belongs to (counted from 0 by
        the module: each training forward is one step, its backward sends
        that step's update). Set it to resume a job at its step."""
        return self._next_step

    @train_step.setter
    def train_step(self, step):
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"train_step must be an int >= 0, got {step!r}")
        self._next_step = step

    def _step_of_forward(self):
        """The step of a forward now: a training forward takes the next step
        (and moves the counter on); an evaluation reads for the next step
        (it sees every step applied before it)."""
        step = self._next_step
        if torch.is_grad_enabled() and self.training:
            self._next_step += 1
        return step if self._stepped else None

    def _request_id(self, step):
        self._step += 1
        return f"{self._run}-{self._step}" if step is None else f"{self._run}-s{step}"

    def _set_table_state(self, table_state, checkpoint_dir, sharding_type):
        self._table_state = _checked_table_state(table_state)
        self._checkpoint_dir = checkpoint_dir or ""
        self._sharding_type = sharding_type

    @property
    def table_state(self):
        """What state_dict() holds for each table: "tensors" (a copy read from
        the workers, as TorchRec's unsharded module) or "checkpoint" (a
        TableCheckpoint: the tables are checkpointed on the workers when the
        state dict is saved, and restored from there when loaded)."""
        return self._table_state

    def _tables_attr(self):
        return "embedding_bags"

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # Called before the tables' own: one snapshot for this state dict.
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._table_state == "checkpoint":
            self._saving = _Snapshot(self._client, self._collection, self._checkpoint_dir)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        keys = {c.name: f"{prefix}{self._tables_attr()}.{c.name}.weight" for c in self._configs}
        saved = {t: state_dict[k] for t, k in keys.items()
                 if isinstance(state_dict.get(k), TableCheckpoint)}
        if saved:
            self._restore(saved)

    def _restore(self, saved):
        """Replaces the collection's tables (and optimizer state) with the
        checkpoint the entries name: checked first, so that a mismatch
        changes nothing; then the collection is dropped and restored from it
        under its name (planned afresh). Under EmberSharder, rank 0 restores
        and the other ranks wait for it."""
        paths = {e.path for e in saved.values()}
        missing = [c.name for c in self._configs if c.name not in saved]
        if missing:
            raise ValueError(f"collection '{self._collection}': the state dict restores tables "
                             f"{sorted(saved)} from a checkpoint but has no checkpoint entry for "
                             f"{missing}; a checkpoint restores every table of a collection")
        if len(paths) != 1 or None in paths:
            raise ValueError(f"collection '{self._collection}': its tables' entries name "
                             f"checkpoints {sorted(map(str, paths))}; one checkpoint is needed")
        for c in self._configs:
            e = saved[c.name]
            if (e.num_embeddings, e.embedding_dim) != (int(c.num_embeddings),
                                                       int(c.embedding_dim)):
                raise ValueError(
                    f"table '{c.name}': the checkpoint's table is [{e.num_embeddings}, "
                    f"{e.embedding_dim}], this module's [{c.num_embeddings}, {c.embedding_dim}]")
        path = paths.pop()
        group = self._dist_group
        distributed = group is not None and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank(group) if distributed else 0
        error = None
        if rank == 0:
            try:
                self._client.drop_collection(self._collection)
                try:
                    self._client.restore(path, self._collection, self._sharding_type)
                except Exception as e:
                    raise RuntimeError(
                        f"collection '{self._collection}' was dropped to be restored from "
                        f"{path}, and the restore failed: {e}. Restore it with "
                        f"client.restore({path!r}, {self._collection!r}) once the checkpoint "
                        f"reads") from e
            except Exception as e:  # said to every rank below, then raised
                error = e
        if distributed:
            failed = [error is not None]
            torch.distributed.broadcast_object_list(failed, src=0, group=group)
            if failed[0] and error is None:
                raise RuntimeError(f"collection '{self._collection}': rank 0 could not restore "
                                   f"it from {path}")
        if error is not None:
            raise error
        self._info = self._client.collection(self._collection)

    @property
    def device(self):
        """TorchRec's compute device (cpu unless given); outputs are on the
        KJT's device."""
        return self._device

    @property
    def collection(self):
        return self._collection

    def reset_parameters(self):
        """Re-initialises every table on the workers, as TorchRec's does:
        each config's init_fn (TorchRec's default: uniform in
        +-sqrt(1 / rows)) over a [rows, dim] tensor, written to the workers.
        Optimizer state is kept."""
        for c in self._configs:
            if self.embedding_bags[c.name].dynamic:
                # Rows are initialised as ids are admitted; the held ones anew.
                ids, _ = self._client.export_table(self._collection, c.name)
                weight = torch.empty(len(ids), c.embedding_dim, dtype=torch.float32)
                _default_init(c, weight)
                self._client.import_table(self._collection, c.name, (ids, weight))
                continue
            weight = torch.empty(c.num_embeddings, c.embedding_dim, dtype=torch.float32)
            init = getattr(c, "init_fn", None)
            if init is not None:
                init(weight)
            else:
                _default_init(c, weight)
            self._client.import_table(self._collection, c.name, weight)

    def fill_caches(self, kjt):
        """Starts bringing kjt's rows (this module's features) into the caches
        of its tables that keep one (key_value, fused_uvm_caching) in a
        background thread, so that a later forward(kjt) and its update find
        them there: TorchRec's prefetch pipeline (TrainPipeline(mode=
        "prefetch") calls it a batch ahead). Nothing is read back and nothing
        goes stale: the rows stay the workers' own. Returns a Future of the
        rows brought in."""
        sel = _select_features(kjt, self._embedding_names, False)
        return self._background(self._client.prefetch, self._collection, sel)

    def _background(self, fn, *args):
        """fn(*args) on the module's background thread (made on first use);
        its Future. One thread: calls run in the order they were given."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="ember-prefetch")
        return self._executor.submit(fn, *args)

    # Pickling: the client's address and options, not the connection.
    def __getstate__(self):
        return {"client": _ClientRef(self._client), "collection": self._collection,
                "configs": self._configs, "flag": self._flag(), "device": str(self._device),
                "info": self._info, "training": self.training,
                "table_state": (self._table_state, self._checkpoint_dir, self._sharding_type),
                "rank": self._rank_given}

    def __setstate__(self, state):
        torch.nn.Module.__init__(self)
        self._setup(state["client"].connect(), state["collection"], state["configs"],
                    state["flag"], state["device"], state["info"])
        self._set_table_state(*state.get("table_state", ("tensors", "", None)))
        self._set_rank(state.get("rank"))
        self.train(state["training"])


class EmbeddingBagCollection(_RemoteTables):
    """A torch.nn.Module over an Ember collection (see the module doc), in
    place of torchrec.EmbeddingBagCollection: TorchRec's models take it as
    they take theirs (DLRM, DLRM_DCN, DLRM_Projection, SimpleDeepFMNN, ...).

    tables: torchrec.EmbeddingBagConfig objects or dicts of the same fields
      (name, num_embeddings, embedding_dim, feature_names, pooling, ...).
    optimizer: dict such as {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.05}
      for every table that names none (TorchRec's fused optimizer).
    create: False to attach to an existing collection of that name; its
      tables must then be the ones given (FailedPrecondition naming the
      table and field otherwise).
    is_weighted: as TorchRec's: per-id weights of the KJT are applied only
      when True, and ignored otherwise.
    device: the module's `device` (TorchRec's compute device); outputs are
      on the KJT's device.
    training: the collection's TrainingSpec as a dict, e.g. {"mode": "SYNC",
      "trainers": 4} (docs/training.md); None: ASYNC (create=False: the
      stored one, checked against the values given).
    constraints: the planner's constraints by table name, as the JSON spec's
      (TorchRec's ParameterConstraints), e.g. {"t_user": {"compute_kernels":
      ["key_value"], "cache_load_factor": 0.2}} for a table below memory
      (docs/key-value.md); used when the collection is created.
    rank: this trainer's rank in a SYNC or BOUNDED collection (None:
      torch.distributed's when initialised, 0 with one trainer). The module
      counts the steps (train_step).
    table_state: what state_dict() holds for each table: "tensors" (a copy
      read from the workers, as TorchRec's unsharded module) or "checkpoint"
      (a TableCheckpoint: saving the state dict, with
      torch.distributed.checkpoint or torch.save, checkpoints the tables on
      the workers under `checkpoint_dir` (empty: the coordinator's
      --checkpoint_dir) and records where; loading it restores them).

    As TorchRec's module does, a forward reads the features of its tables
    from the KJT, ignores any other, and raises KeyError for a missing one;
    the output's keys are its tables' features in table order.

    The module pickles (pickle, copy.deepcopy, torch.save) as its client's
    address and options, its collection and its configs: loading it
    connects again to the same tables (a copy shares them).
    """

    def __init__(self, tables, client, collection, optimizer=None, sharding_type=None,
                 create=True, is_weighted=False, device=None, table_state="tensors",
                 checkpoint_dir="", rank=None, training=None, constraints=None):
        super().__init__()
        configs = [_config_of(t) for t in tables]
        names = [c.name for c in configs]
        if len(set(names)) != len(names):
            raise ValueError(f"Duplicate table name in {names}")
        for c in configs:
            if not c.feature_names:
                c.feature_names = [c.name]
        info = _open_collection(client, collection, _table_specs(tables, optimizer), create,
                                sharding_type, training, constraints)
        self._setup(client, collection, configs, bool(is_weighted), device, info)
        self._set_table_state(table_state, checkpoint_dir, sharding_type)
        self._set_rank(rank)

    def _setup(self, client, collection, configs, is_weighted, device, info):
        self._setup_tables(client, collection, configs, device, info)
        # TorchRec's attributes, which its models and tools read.
        self._is_weighted = is_weighted
        self._lengths_per_embedding = [int(c.embedding_dim) for c in configs
                                       for _ in c.feature_names]
        self.embedding_bags = torch.nn.ModuleDict(
            {c.name: _RemoteEmbeddingBag(self, c) for c in configs})
        self._tables = [t["name"] for t in info["spec"]["tables"]]
        self._dims = {f: int(t["embedding_dim"]) for t in info["spec"]["tables"]
                      for f in t["feature_names"]}
        self._prefetched = {}  # id(kjt) -> (kjt, Future of the lookup)
        self._prefetch_lock = threading.Lock()

    # TorchRec's interface.
    @property
    def _embedding_bag_configs(self):
        return self._configs

    def embedding_bag_configs(self):
        """The tables' configs, as given (dicts become config objects)."""
        return self._configs

    def is_weighted(self):
        """Whether per-id weights of the KJT are applied."""
        return self._is_weighted

    def _flag(self):
        return self._is_weighted

    def _select(self, kjt):
        return _select_features(kjt, self._embedding_names, self._is_weighted)

    def prefetch(self, kjt):
        """Starts kjt's lookup in a background thread (the client releases the
        GIL); a later forward(kjt) of the same object uses its result. The
        lookup reads the tables as they are now, so it misses the updates of
        steps that finish before that forward (TrainPipeline's one step of
        staleness)."""
        sel = self._select(kjt)
        on_device = self._on_device(sel)
        # The step of the training forward that will take it: the next one
        # after those already prefetched.
        with self._prefetch_lock:
            step = self._next_step + len(self._prefetched) if self._stepped else None
        if on_device:  # over the link straight from its tensors' memory
            _ready(_device_of(sel))  # the caller's stream made its tensors
            future = self._background(self._lookup_on_device, sel, step)
        else:
            future = self._background(self._client.lookup, self._collection, sel, step)
        with self._prefetch_lock:
            self._prefetched[id(kjt)] = (kjt, future, on_device, sel, step)
            while len(self._prefetched) > 8:  # never consumed: forget the oldest
                self._prefetched.pop(next(iter(self._prefetched)))
        return future

    def forward(self, kjt):
        """The pooled embeddings as a KeyedTensor: torchrec's
        (torchrec.sparse.jagged_tensor.KeyedTensor) when the program has
        imported torchrec, else ember.torch.KeyedTensor (the same methods)."""
        with self._prefetch_lock:
            entry = self._prefetched.pop(id(kjt), None)
        if entry is not None and entry[0] is kjt:  # prefetched
            on_device, sel, step = entry[2], entry[3], entry[4]
            result = entry[1].result()
            if step is not None and torch.is_grad_enabled() and self.training:
                self._next_step = step + 1
        else:
            sel = self._select(kjt)
            on_device = self._on_device(sel)
            step = self._step_of_forward()
            result = (self._lookup_on_device(sel, step) if on_device
                      else self._client.lookup(self._collection, sel, step))
        if on_device:  # straight between its tensors' memory and the link
            keys, dims, values = result
            kt = ember.KeyedTensor(keys, dims, np.zeros((0, 0), np.float32))
        else:
            kt = result
            values = torch.from_numpy(kt.values)
            # A KJT of CUDA tensors (a GPU trainer's) without NCCL links gets
            # its embeddings on its device, staged through host memory both
            # ways (its ids were copied to the host for the lookup, its
            # gradients are in backward).
            device = _device_of(kjt)
            if device is not None and device.type != "cpu":
                values = values.to(device)
        if torch.is_grad_enabled() and self.training:
            anchor = torch.empty(0, requires_grad=True)  # makes autograd call backward
            values = _RemoteLookup.apply(anchor, self, sel if on_device else ember._as_kjt(sel),
                                         step, values)
        if "torchrec" in sys.modules:  # a TorchRec program gets TorchRec's type
            from torchrec.sparse.jagged_tensor import KeyedTensor as TorchRecKeyedTensor
            return TorchRecKeyedTensor(keys=list(kt.keys), length_per_key=list(kt.length_per_key),
                                       values=values)
        return KeyedTensor(kt.keys, kt.length_per_key, values)

    def _on_device(self, kjt):
        """Whether kjt goes over the client's link channels straight from
        its tensors' memory: NCCL links for CUDA tensors, socket links for
        CPU ones (host memory: what runs without a GPU)."""
        link = getattr(self._client, "link", None)
        device = _device_of(kjt)
        if link is None or device is None:
            return False
        return (link == "nccl" and device.type == "cuda") or (link == "socket" and
                                                                device.type == "cpu")

    def _lookup_on_device(self, kjt, step=None):
        """kjt's lookup on the device path: (keys, dims, values on its device)."""
        lengths, values, weights = _device_args(kjt)
        keys = list(kjt.keys())
        batch = lengths.numel() // len(keys) if keys else 0
        width = sum(self._dims.get(k, 0) for k in keys)
        out = torch.empty((batch, width), dtype=torch.float32, device=values.device)
        _ready(values.device)  # this thread's conversions of the arrays, done
        got_keys, dims = self._client._c.lookup_on_device(
            self._collection, keys, batch, lengths.data_ptr(), values.data_ptr(), values.numel(),
            0 if weights is None else weights.data_ptr(), out.data_ptr(), out.numel(),
            -1 if step is None else step)
        return got_keys, dims, out

    def _apply_gradients(self, kjt, grad, step=None):
        request_id = self._request_id(step)
        if self._on_device(kjt):
            lengths, values, weights = _device_args(kjt)
            keys = list(kjt.keys())
            batch = lengths.numel() // len(keys) if keys else 0
            grad = grad.detach().to(device=values.device, dtype=torch.float32).contiguous()
            _ready(values.device)
            self._client._c.apply_gradients_on_device(
                self._collection, keys, batch, lengths.data_ptr(), values.data_ptr(),
                values.numel(), 0 if weights is None else weights.data_ptr(), grad.data_ptr(),
                grad.numel(), request_id, -1 if step is None else step,
                -1 if step is None or self._rank is None else self._rank)
            return
        # The forward's layout: the KJT's features in the collection's order.
        keys = [f for t in self._info["spec"]["tables"] for f in t["feature_names"]]
        dims = {f: int(t["embedding_dim"]) for t in self._info["spec"]["tables"]
                for f in t["feature_names"]}
        present = [k for k in keys if k in kjt.keys]
        self._client.apply_gradients(
            self._collection, kjt,
            ember.KeyedTensor(present, [dims[k] for k in present],
                              grad.detach().cpu().numpy().astype(np.float32, copy=False)),
            request_id=request_id, step=step, rank=self._rank if step is not None else None)


class _RemoteSequenceLookup(torch.autograd.Function):
    """(values of feature 1, ...) = lookup_sequence(kjt); backward sends each
    feature's d(loss)/d(values) to the workers."""

    @staticmethod
    def forward(ctx, anchor, module, kjt, step, *values):
        ctx.module = module
        ctx.kjt = kjt
        ctx.step = step
        return tuple(v.clone() for v in values)

    @staticmethod
    def backward(ctx, *grads):
        ctx.module._apply_gradients(ctx.kjt, grads, ctx.step)
        return (None, None, None, None) + (None,) * len(grads)


class EmbeddingCollection(_RemoteTables):
    """TorchRec's EmbeddingCollection (sequence features: one embedding per
    id, no pooling) over an Ember collection whose tables are NONE-pooled.
    forward(kjt) returns {feature: torchrec JaggedTensor} whose values are
    [ids, dim] and take part in autograd; backward sends the gradients to the
    workers, whose optimizer runs there, exactly once.

    tables: torchrec.EmbeddingConfig objects or dicts of the same fields.
    optimizer, create, device, table_state, checkpoint_dir, training, rank,
    constraints: as EmbeddingBagCollection's. need_indices:
    as TorchRec's (each JaggedTensor's weights are its ids).
    As TorchRec's module, every table must have the same embedding_dim, a
    missing feature raises KeyError, and other features are ignored. Needs
    torchrec (its JaggedTensor)."""

    def __init__(self, tables, client, collection, optimizer=None, sharding_type=None,
                 create=True, need_indices=False, device=None, table_state="tensors",
                 checkpoint_dir="", rank=None, training=None, constraints=None):
        super().__init__()
        configs = [_config_of(t) for t in tables]
        dims = {int(c.embedding_dim) for c in configs}
        if len(dims) > 1:
            raise ValueError(f"All tables in an EmbeddingCollection need the same "
                             f"embedding_dim, got {sorted(dims)}")
        for c in configs:
            if not c.feature_names:
                c.feature_names = [c.name]
        info = _open_collection(client, collection,
                                _table_specs(tables, optimizer, pooling="NONE"), create,
                                sharding_type, training, constraints)
        self._setup(client, collection, configs, bool(need_indices), device, info)
        self._set_table_state(table_state, checkpoint_dir, sharding_type)
        self._set_rank(rank)

    def _setup(self, client, collection, configs, need_indices, device, info):
        self._setup_tables(client, collection, configs, device, info)
        self._need_indices = need_indices
        self._embedding_dim = int(configs[0].embedding_dim) if configs else -1
        self._embedding_names_by_table = [list(c.feature_names) for c in configs]
        self.embeddings = torch.nn.ModuleDict(
            {c.name: _RemoteEmbeddingBag(self, c) for c in configs})

    @property
    def _embedding_configs(self):
        return self._configs

    def _tables_attr(self):
        return "embeddings"

    def embedding_configs(self):
        return self._configs

    def _flag(self):
        return self._need_indices

    def embedding_dim(self):
        return self._embedding_dim

    def embedding_names_by_table(self):
        return self._embedding_names_by_table

    def need_indices(self):
        return self._need_indices

    def forward(self, kjt):
        from torchrec.sparse.jagged_tensor import JaggedTensor
        # Sequence features take no weights.
        k = ember._as_kjt(_select_features(kjt, self._embedding_names, keep_weights=False))
        step = self._step_of_forward()
        got = self._client.lookup_sequence(self._collection, k, step)
        device = _device_of(kjt) or torch.device("cpu")
        values = [torch.from_numpy(got[f]).to(device) for f in self._embedding_names]
        if torch.is_grad_enabled() and self.training and values:
            anchor = torch.empty(0, requires_grad=True)
            values = list(_RemoteSequenceLookup.apply(anchor, self, k, step, *values))
        batch = k.batch_size()
        out = {}
        for i, f in enumerate(self._embedding_names):
            lengths = torch.from_numpy(k.lengths[i * batch:(i + 1) * batch].copy()).to(device)
            ids = None
            if self._need_indices:
                lo = int(k.lengths[:i * batch].sum())
                ids = torch.from_numpy(k.values[lo:lo + int(lengths.sum())].copy()).to(device)
            out[f] = JaggedTensor(values=values[i], lengths=lengths, weights=ids)
        return out

    def _apply_gradients(self, kjt, grads, step=None):
        request_id = self._request_id(step)
        items = {}
        batch = kjt.batch_size()
        for i, (f, g) in enumerate(zip(self._embedding_names, grads)):
            n = int(kjt.lengths[i * batch:(i + 1) * batch].sum())
            items[f] = (np.zeros((n, self._embedding_dim), np.float32) if g is None
                        else g.detach().cpu().numpy().astype(np.float32, copy=False))
        self._client.apply_sequence_gradients(
            self._collection, kjt, items, request_id=request_id, step=step,
            rank=self._rank if step is not None else None)


class TrainPipeline:
    """Overlaps the embedding work of the next batch with the current
    training step, in one of TorchRec's two ways (`mode`):

    - "semi_sync" (the default; TorchRec's TrainPipelineSemiSync): while the
      dense model runs forward and backward on batch k, batch k+1's whole
      lookup is already on its way to the workers, so their time hides
      behind the dense compute. Rows that both batches touch are read one
      update behind (one step of staleness).
    - "prefetch" (TorchRec's PrefetchTrainPipelineSparseDist): after batch
      k's forward, batch k+1's rows are brought into the caches of the
      tables that keep one (key_value, fused_uvm_caching;
      Client.prefetch) while batch k's backward and update run; batch
      k+1's lookup then runs in its own forward, after batch k's update,
      and finds its rows cached. No staleness: every step equals a plain
      loop's, bit for bit. Tables held whole in memory gain nothing.

        pipeline = TrainPipeline(model, optimizer, ebc, sparse=lambda b: b["kjt"])
        for _ in range(steps):
            loss = pipeline.progress(batches)   # StopIteration when they run out

    `ebc`: an EmbeddingBagCollection (either mode) or an EmbeddingCollection
    (mode "prefetch"). model(batch) must call ebc(sparse(batch)) and return the loss (or a tuple
    whose first element is the loss); sparse(batch) must return the batch's
    own KJT object each time (the prefetched lookup is matched by identity;
    another object is looked up afresh, correct but not overlapped); progress() runs backward (which sends
    the tables' gradients to the workers) and optimizer.step().
    """

    MODES = ("semi_sync", "prefetch")

    def __init__(self, model, optimizer, ebc, sparse=None, mode="semi_sync"):
        if mode not in self.MODES:
            raise ValueError(f"TrainPipeline mode must be one of {self.MODES}, got {mode!r}")
        if mode == "semi_sync" and not hasattr(ebc, "prefetch"):
            raise TypeError(f"TrainPipeline mode 'semi_sync' looks up ahead through an "
                            f"EmbeddingBagCollection; {type(ebc).__name__} has no prefetch(): "
                            f"use mode='prefetch'")
        self._model = model
        self._optimizer = optimizer
        self._ebc = ebc
        self._sparse = sparse or (lambda b: b.sparse_features)
        self._mode = mode
        self._next = None  # the next batch (semi_sync: with its lookup in flight)
        self._filling = None  # prefetch: the Future of the next batch's cache fill
        self._fill_failures = 0

    @property
    def mode(self):
        return self._mode

    def _fetch(self, batches):
        try:
            batch = next(batches)
        except StopIteration:
            return None
        if self._mode == "semi_sync":
            self._ebc.prefetch(self._sparse(batch))
        return batch

    def _wait_fill(self):
        """The next batch's cache fill, done before its lookup. A failed fill
        costs only time (the lookup brings in what is missing): it is
        counted and warned about once, not raised."""
        filling, self._filling = self._filling, None
        if filling is None:
            return
        try:
            filling.result()
        except Exception as e:  # noqa: BLE001 - any failure: the lookup still reads right
            self._fill_failures += 1
            if self._fill_failures == 1:
                warnings.warn(f"ember TrainPipeline: a cache prefetch failed ({e}); "
                              "the lookups bring their rows in themselves", RuntimeWarning)

    @property
    def fill_failures(self):
        """Prefetches (mode "prefetch") that failed so far."""
        return self._fill_failures

    def progress(self, batches):
        """One training step; raises StopIteration when `batches` (an
        iterator) is exhausted."""
        if self._next is None:
            self._next = self._fetch(batches)
            if self._next is None:
                raise StopIteration
            if self._mode == "prefetch":  # the first batch's rows, before its lookup
                self._filling = self._ebc.fill_caches(self._sparse(self._next))
        batch = self._next
        self._next = self._fetch(batches)  # semi_sync: k+1's lookup runs while k computes
        self._wait_fill()
        self._optimizer.zero_grad()
        out = self._model(batch)
        if self._mode == "prefetch" and self._next is not None:
            # k+1's rows come into the caches while k's backward and update run.
            self._filling = self._ebc.fill_caches(self._sparse(self._next))
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        self._optimizer.step()
        return loss.detach()
