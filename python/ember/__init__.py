"""Ember's Python SDK.

    import ember
    with ember.LocalCluster(workers=2) as cluster:
        client = ember.Client(cluster.address)
        client.create_collection({"name": "c", "tables": [...]}, sharding_type="row_wise")
        kt = client.lookup("c", ember.KeyedJaggedTensor(keys, lengths, values))
        client.apply_gradients("c", kjt, grads)

Calls go through the C++ client (`_ember`, the same routing as the C++ SDK)
with the GIL released. Specs, plans and statuses are dicts in the proto3
JSON mapping (proto field names), as `emberctl plan --format=json` prints
them. Errors are `ember.EmberError` subclasses (`ember.NotFound`,
`ember.InvalidArgument`, `ember.Unavailable`, ...) with `.code` and the
server's message.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from ember._errors import (  # noqa: F401  (re-exported)
    Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded, EmberError,
    FailedPrecondition, Internal, InvalidArgument, NotFound, OutOfRange,
    PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable,
    Unimplemented, Unknown, error_class)



def _load_built_extension():
    """The extension from this checkout's Bazel output (bazel-bin), for a
    package imported from the source tree (the venv's .pth points there)."""
    import importlib.util
    import sys
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.normpath(os.path.join(here, "..", "..", "bazel-bin", "python", "ember",
                                         "_ember.so"))
    if not os.path.exists(path):
        raise ImportError("ember's extension is not built: run "
                          "`bazel build //python/ember:_ember.so //cli:emberctl` "
                          "(scripts/test.sh and scripts/demo.sh do)")
    spec = importlib.util.spec_from_file_location("ember._ember", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["ember._ember"] = module
    return module


try:
    from ember import _ember
except ImportError:
    _ember = _load_built_extension()

__version__ = "0.1.0"  # pyproject.toml's; make_wheel.py checks they agree

__all__ = [
    "Client", "KeyedJaggedTensor", "KeyedTensor", "LocalCluster", "EmberError",
    "InvalidArgument", "NotFound", "AlreadyExists", "FailedPrecondition",
    "ResourceExhausted", "Unavailable", "DataLoss",
]


class KeyedJaggedTensor:
    """TorchRec's sparse input layout, NumPy-backed.

    keys [K]; lengths [K * B] key-major (all of key 0's bags, then key 1's);
    values [sum(lengths)] int64 ids in that order; weights None or float32
    [sum(lengths)].
    """

    def __init__(self, keys, lengths, values, weights=None):
        self.keys = [str(k) for k in keys]
        self.lengths = _int64_array("lengths", lengths)
        self.values = _int64_array("values (ids)", values)
        self.weights = (None if weights is None else
                        np.ascontiguousarray(_numpy(weights), dtype=np.float32).reshape(-1))

    @classmethod
    def from_jagged(cls, jagged, weights=None):
        """From {key: [[ids of sample 0], [ids of sample 1], ...]} (and, if
        given, weights in the same shape)."""
        keys = list(jagged)
        lengths = [len(bag) for k in keys for bag in jagged[k]]
        values = [i for k in keys for bag in jagged[k] for i in bag]
        w = None
        if weights is not None:
            w = [x for k in keys for bag in weights[k] for x in bag]
        return cls(keys, lengths, values, w)

    def batch_size(self):
        """Samples per key: len(lengths) / len(keys)."""
        return len(self.lengths) // len(self.keys) if self.keys else 0


def _numpy(a):
    """A NumPy view of an array-like or a torch tensor (copied to the CPU)."""
    if hasattr(a, "detach"):
        return a.detach().cpu().numpy()
    return np.asarray(a)


def _int64_array(what, a):
    """`a` as a flat contiguous int64 array; InvalidArgument unless it holds
    integers that fit (floats, bools, strings and uint64 past 2^63 - 1 were
    cast, truncating or wrapping, before)."""
    try:
        arr = _numpy(a)
    except (OverflowError, ValueError, TypeError) as e:
        raise InvalidArgument(3, f"{what} must be int64 integers: {e}") from None
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidArgument(3, f"{what} must be integers, got {arr.dtype} "
                                 f"(e.g. {arr.reshape(-1)[0]!r})")
    if arr.dtype.kind == "u" and arr.dtype.itemsize == 8 and \
            int(arr.max()) > np.iinfo(np.int64).max:
        raise InvalidArgument(3, f"{what} must fit int64; {int(arr.max())} does not "
                                 "(hash ids into [0, 2^63), or reinterpret them as int64: a.view(np.int64))")
    return np.ascontiguousarray(arr, dtype=np.int64).reshape(-1)


def _as_kjt(kjt):
    """An ember.KeyedJaggedTensor from one, or from a torchrec.KeyedJaggedTensor
    (anything with keys(), lengths(), values() and weights_or_none())."""
    if isinstance(kjt, KeyedJaggedTensor):
        return kjt
    if callable(getattr(kjt, "keys", None)) and callable(getattr(kjt, "lengths", None)):
        weights = kjt.weights_or_none() if hasattr(kjt, "weights_or_none") else None
        return KeyedJaggedTensor(kjt.keys(), _numpy(kjt.lengths()), _numpy(kjt.values()),
                                 None if weights is None else _numpy(weights))
    raise TypeError(f"expected a KeyedJaggedTensor, got {type(kjt).__name__}")


class KeyedTensor:
    """TorchRec's pooled output layout: keys [F], length_per_key [F] (each
    feature's dim), values float32 [B, sum(length_per_key)], feature f at
    columns offset_per_key()[f] .. + length_per_key[f]."""

    def __init__(self, keys, length_per_key, values):
        self.keys = list(keys)
        self.length_per_key = [int(d) for d in length_per_key]
        self.values = np.asarray(values, dtype=np.float32)

    def offset_per_key(self):
        return [int(x) for x in np.concatenate([[0], np.cumsum(self.length_per_key)])]

    def __getitem__(self, key):
        """Feature `key`'s [B, dim] block (a view)."""
        off = self.offset_per_key()
        k = self.keys.index(key)
        return self.values[:, off[k]:off[k + 1]]

    def to_dict(self):
        return {k: self[k] for k in self.keys}


def table_spec(t):
    """A torchrec.EmbeddingBagConfig (or a dict of the same fields) as a spec
    table: name, num_embeddings, embedding_dim, feature_names, pooling and,
    when set, data_type."""
    if isinstance(t, dict):
        return dict(t)
    pooling = getattr(t, "pooling", "SUM")
    pooling = getattr(pooling, "name", str(pooling)).upper()
    out = {"name": t.name, "num_embeddings": int(t.num_embeddings),
           "embedding_dim": int(t.embedding_dim), "feature_names": list(t.feature_names),
           "pooling": pooling}
    dtype = getattr(t, "data_type", None)
    if dtype is not None:
        out["data_type"] = getattr(dtype, "name", str(dtype)).upper()
    return out


def _parameter_sharding(ps):
    """A torchrec ParameterSharding (or a dict of its fields) as a dict."""
    if isinstance(ps, dict):
        return ps
    spec = getattr(ps, "sharding_spec", None)
    shards = None
    if spec is not None:
        shards = [{"shard_offsets": list(s.shard_offsets), "shard_sizes": list(s.shard_sizes),
                   "placement": str(s.placement)} for s in spec.shards]
    return {"sharding_type": ps.sharding_type, "compute_kernel": ps.compute_kernel,
            "ranks": list(ps.ranks) if ps.ranks is not None else None,
            "sharding_spec": {"shards": shards} if shards is not None else None}


def _plan_json(plan):
    if isinstance(plan, (str, bytes)):
        return plan if isinstance(plan, str) else plan.decode()
    if isinstance(plan, dict) and "plan" in plan and isinstance(plan["plan"], list):
        return json.dumps(plan)  # emberctl plan --format=json's form
    return json.dumps({name: _parameter_sharding(ps) for name, ps in dict(plan).items()})


def _spec_json(spec):
    """A spec as JSON: a string as it is, a dict whose tables may be
    torchrec.EmbeddingBagConfig objects."""
    if isinstance(spec, str):
        return spec
    spec = dict(spec)
    if "tables" in spec:
        spec["tables"] = [table_spec(t) for t in spec["tables"]]
    return json.dumps(spec)


class Client:
    """A trainer's handle on an Ember deployment (see client/client.h).

    Thread-safe: any number of threads may share one Client; every call
    releases the GIL while it waits on the network.

    auth_token / auth_token_file: the token sent on every call where the
    servers run with --auth_token_file (a file holding just the token, as
    `emberctl --auth_token_file` takes). tls_ca / tls_cert / tls_key: PEM
    files, as emberctl's --tls_* flags (TLS is on when tls_ca is given).

    shared_memory: bulk arrays go through shared-memory channels to workers
    on this host (loopback addresses) that offer them (default on).
    shm_dir: a directory on tmpfs shared with the workers of this host, at
    their --shm_dir (e.g. a volume the trainer's and the worker's pods both
    mount): channels are files in it and every worker is tried; one on
    another host refuses and its calls go inline.
    link: "nccl" or "socket": bulk arrays go through link channels to every
    worker that offers that kind (its --links) instead of shared memory:
    NCCL from CUDA device `link_device` of this process to the worker's GPU,
    or a Unix-domain socket on one host (the NCCL channel's protocol without
    a GPU; loopback workers only). ember.torch passes a KJT's CUDA tensors
    (on cuda:link_device; socket links: CPU tensors) to the device path,
    straight between their memory and the link (TrainPipeline's prefetches
    too); numpy KJTs are staged through host memory as ever. Workers that offer none get inline calls.
    keep_freed_heap_mib: this process's allocator keeps up to this much
    freed heap and takes allocations under 32 MiB from the heap (glibc
    mallopt, process-wide), so each call's buffers are not faulted in
    afresh (default 256; 0 leaves the allocator alone).
    """

    def __init__(self, address, timeout_s=30.0, auth_token=None, auth_token_file=None,
                 tls_ca=None, tls_cert=None, tls_key=None, shared_memory=True, shm_dir=None,
                 keep_freed_heap_mib=256, link=None, link_device=0):
        # How to connect again (a pickled ember.torch module keeps these;
        # the token itself only by its file).
        self._connect_kwargs = {
            "address": address, "timeout_s": timeout_s, "auth_token_file": auth_token_file,
            "tls_ca": tls_ca, "tls_cert": tls_cert, "tls_key": tls_key,
            "shared_memory": shared_memory, "shm_dir": shm_dir,
            "keep_freed_heap_mib": keep_freed_heap_mib, "link": link, "link_device": link_device}
        if auth_token_file is not None:
            with open(auth_token_file) as f:
                words = f.read().split()
            if len(words) != 1:
                raise InvalidArgument(3, f"{auth_token_file}: expected exactly one token")
            auth_token = words[0]
        self._c = _ember.Client(address, float(timeout_s), auth_token or "", tls_ca or "",
                                tls_cert or "", tls_key or "", bool(shared_memory),
                                str(shm_dir or ""), int(keep_freed_heap_mib), str(link or ""),
                                int(link_device))
        self.address = address
        self.link = link or None

    # Control plane.
    def create_collection(self, spec, sharding_type=None, plan=None):
        """Plans and creates a collection; `spec` is a dict (or JSON) in the
        shape of `emberctl create --spec`, whose tables may also be
        torchrec.EmbeddingBagConfig objects. Returns the collection info.

        `plan` replaces planning with a plan made elsewhere: a dict (or
        JSON) in `emberctl plan --format=json`'s form or TorchRec's (table
        name -> ParameterSharding, as dicts or as torchrec's own
        ParameterSharding objects). It is checked against the live workers
        as strictly as the planner's own output."""
        if plan is not None:
            if sharding_type:
                raise InvalidArgument(3, "give a plan or a sharding type, not both")
            return json.loads(self._c.create_collection_with_plan(_spec_json(spec),
                                                                  _plan_json(plan)))
        return json.loads(self._c.create_collection(_spec_json(spec), sharding_type or ""))

    def collection(self, name):
        """Collection `name`'s info as a dict: its spec (with every optimizer
        default filled in), plan (with its epoch), worker_addresses (one per
        rank) and state. NotFound when there is none."""
        return json.loads(self._c.get_collection(name))

    def plan(self, name):
        """Collection `name`'s sharding plan as a dict."""
        return self.collection(name)["plan"]

    def list_collections(self):
        """Every collection's info, as collection() gives each."""
        return [json.loads(c) for c in self._c.list_collections()]

    def preview_plan(self, spec, world_size, local_world_size=0, sharding_type=None,
                     compute_device="CPU"):
        """The plan the coordinator's planner would make for `spec` on
        `world_size` workers of `compute_device` (CPU or CUDA), without
        creating anything."""
        topology = {"world_size": world_size, "local_world_size": local_world_size,
                    "compute_device": compute_device}
        return json.loads(self._c.preview_plan(_spec_json(spec), json.dumps(topology),
                                               sharding_type or ""))

    def list_workers(self):
        """The registered workers: dicts of worker_id, info (address, host,
        device, capacities), live and ms_since_heartbeat."""
        return json.loads(self._c.list_workers()).get("workers", [])

    def worker_status(self, address):
        """One worker's Worker.ShardStatus as a dict (proto field names): its
        backend, shards, memory, traffic counters (lookups, lookup_ids,
        updates, placed_lookups: lookups written straight into this
        process's KeyedTensors, id_buffer_lookups: lookups that read their
        ids straight from a C++ trainer's KeyedJaggedTensor; Python's are
        copied), open shm_channels, ..."""
        return json.loads(self._c.worker_status(address))

    def drop_collection(self, name):
        """Drops collection `name` and frees its shards on the workers."""
        self._c.drop_collection(name)

    # Data plane.
    def lookup(self, name, kjt, step=None):
        """Pooled features: a KeyedTensor in the collection's feature order.
        step: the training step it reads for, needed when the collection
        trains SYNC or BOUNDED (it then waits for the steps it must see;
        docs/training.md); ignored in ASYNC."""
        k = _as_kjt(kjt)
        keys, dims, values = self._c.lookup(name, k.keys, k.lengths, k.values, k.weights,
                                            _step_arg(step, "step"))
        return KeyedTensor(keys, dims, values)

    def prefetch(self, name, kjt):
        """Brings the rows kjt names (pooled and sequence features alike)
        into the caches of the tables that keep one (key_value,
        fused_uvm_caching), so that this batch's lookup and update find them
        there: TorchRec's prefetch pipeline (ember.torch.TrainPipeline with
        mode="prefetch" calls it a batch ahead). Reads nothing back and
        changes no value; tables held whole in memory are skipped. Returns
        the rows brought in (rows already cached are not counted)."""
        k = _as_kjt(kjt)
        return self._c.prefetch(name, k.keys, k.lengths, k.values)

    def apply_gradients(self, name, kjt, grads, request_id=None, step=None, rank=None):
        """Gradients of lookup()'s output (a KeyedTensor, or a [B, sum dims]
        array in that layout); the tables' optimizers run on the workers.
        Returns the request id used: retrying with it applies each shard's
        part exactly once (an error's message names it too).

        step, rank: the training step and this trainer's rank, needed when
        the collection trains SYNC or BOUNDED: the update is applied once
        every rank sent its own for the step (SYNC: this call returns then;
        BOUNDED: once held). Ignored in ASYNC."""
        k = _as_kjt(kjt)
        if isinstance(grads, KeyedTensor):
            gkeys, gdims, gvalues = grads.keys, grads.length_per_key, grads.values
        else:  # an array (NumPy, torch, nested lists) in lookup's layout
            gkeys, gdims = [], []
            try:
                gvalues = _numpy(grads)
            except (ValueError, TypeError) as e:
                raise InvalidArgument(3, f"grads: {e}") from None
            if gvalues.dtype.kind not in "fiu" or gvalues.ndim != 2:
                raise InvalidArgument(
                    3, f"grads must be an ember.KeyedTensor or a [batch, sum of dims] float "
                       f"array in lookup's layout, got {type(grads).__name__} of "
                       f"{gvalues.dtype} {gvalues.shape}")
        return self._c.apply_gradients(name, k.keys, k.lengths, k.values, k.weights, gkeys,
                                       gdims, np.ascontiguousarray(gvalues, dtype=np.float32),
                                       request_id or "", _step_arg(step, "step"),
                                       _step_arg(rank, "rank"))

    def lookup_sequence(self, name, kjt, step=None):
        """Sequence (NONE) features: {key: [num_ids, dim] array}. step: as
        lookup()'s."""
        k = _as_kjt(kjt)
        return dict(self._c.lookup_sequence(name, k.keys, k.lengths, k.values,
                                            _step_arg(step, "step")))

    def apply_sequence_gradients(self, name, kjt, grads, request_id=None, step=None, rank=None):
        """Gradients of lookup_sequence()'s output, {key: [num_ids, dim]};
        the tables' optimizers run on the workers, exactly once per
        request id (returned, as apply_gradients does). step, rank: as
        apply_gradients()'."""
        k = _as_kjt(kjt)
        items = [(key, np.ascontiguousarray(g, dtype=np.float32)) for key, g in grads.items()]
        return self._c.apply_sequence_gradients(name, k.keys, k.lengths, k.values, items,
                                                request_id or "", _step_arg(step, "step"),
                                                _step_arg(rank, "rank"))

    def _is_dynamic(self, name, table):
        for t in self.collection(name)["spec"]["tables"]:
            if t["name"] == table:
                return "dynamic" in t
        return False  # (the call names the missing table)

    def export_table(self, name, table):
        """The whole table as float32 [rows, dim]. A dynamic (hash-keyed)
        table: `(ids, rows)`, ids int64 [n] ascending (the ids it holds),
        rows float32 [n, dim]."""
        if self._is_dynamic(name, table):
            return self._c.export_dynamic_table(name, table)
        return self._c.export_table(name, table)

    def import_table(self, name, table, array):
        """Replaces a table's weights with `array` ([rows, dim], e.g. a
        TorchRec state dict's "embedding_bags.<table>.weight"); optimizer
        state is kept. A dynamic table takes `(ids, rows)` (ids distinct,
        rows [n, dim]): an id held keeps its optimizer state, a new one gets
        a row with fresh state, its shard evicting by the table's policy to
        make room."""
        if self._is_dynamic(name, table):
            if not (isinstance(array, (tuple, list)) and len(array) == 2):
                raise InvalidArgument(
                    3, f"table '{table}' is dynamic: import_table takes (ids, rows)")
            ids, rows = _numpy(array[0]), _numpy(array[1])
            self._c.import_dynamic_table(name, table,
                                         np.ascontiguousarray(ids, dtype=np.int64),
                                         np.ascontiguousarray(rows, dtype=np.float32))
            return
        array = _numpy(array)
        self._c.import_table(name, table, np.ascontiguousarray(array, dtype=np.float32))

    def checkpoint(self, name, dir="", progress=None, poll_s=0.5, incremental=False):
        """Writes a checkpoint of collection `name` under `dir` (a root the
        servers' --checkpoint_dir allows; empty: the coordinator's own);
        returns its CheckpointInfo (path, bytes, ...) as a dict.

        incremental: only the rows changed since the latest checkpoint under
        the same root (its "base", named in the result with "delta_shards",
        "changed_rows" and "chain_length"); shards that cannot be (moved or
        recovered since) and a first checkpoint are written whole.

        progress: None; True, a line on stderr every `poll_s` seconds while
        it runs ("checkpoint NAME: X of Y MiB written"); or a callable
        progress(bytes_written, total_bytes), called as the coordinator
        reports the shard files growing and once more at the end with the
        checkpoint's bytes."""
        if progress is True:
            progress = _stderr_progress(f"checkpoint {name}", "written")

        def poll():
            for c in self.list_checkpoints(name):
                if c.get("in_progress"):
                    progress(int(c.get("bytes", 0)), int(c.get("total_bytes", 0)))

        info = json.loads(_polled(lambda: self._c.checkpoint(name, dir, incremental),
                                  poll if progress else None, poll_s, "ember-checkpoint"))
        if progress:
            progress(int(info.get("bytes", 0)), int(info.get("bytes", 0)))
        return info

    def restore(self, path, name="", sharding_type=None, progress=None, poll_s=0.5):
        """Creates a collection (named `name`, or the checkpoint's name) from
        checkpoint `path` (a checkpoint directory or a root: its latest), on
        the live workers, planned afresh; DataLoss naming the file when a
        checkpoint is damaged (nothing is created). Returns a dict of
        "collection" (CollectionInfo) and "checkpoint" (CheckpointInfo).

        progress: None; True, a line on stderr every `poll_s` seconds while
        it runs ("restore NAME: X of Y MiB verified", then "loading on N
        workers"); or a callable progress(bytes_verified, total_bytes,
        phase), phase "verifying" then "loading", called as the coordinator
        reports and once more at the end (phase "done")."""
        if progress is True:
            progress = _stderr_restore_progress(f"restore {name or path}")

        def poll():
            # With a name the coordinator shows only this collection's;
            # without, any restore under way (the likeliest is this one).
            for r in self.list_restores(name)[:1]:
                progress(int(r.get("bytes_verified", 0)), int(r.get("total_bytes", 0)),
                         r.get("phase", "verifying"))

        out = json.loads(_polled(lambda: self._c.restore(path, name, sharding_type or ""),
                                 poll if progress else None, poll_s, "ember-restore"))
        if progress:
            total = int(out.get("checkpoint", {}).get("bytes", 0))
            progress(total, total, "done")
        return out

    def list_restores(self, name=""):
        """The restores under way on the coordinator (of collection `name`, or
        all), as dicts (RestoreProgress's fields: from, collection, phase,
        bytes_verified, total_bytes, workers)."""
        return [json.loads(r) for r in self._c.list_restores(name)]

    def list_checkpoints(self, name=""):
        """The coordinator's catalogue of checkpoints (of collection `name`,
        or all), oldest first, as dicts (CheckpointInfo's fields)."""
        return [json.loads(c) for c in self._c.list_checkpoints(name)]

    def set_trainers(self, name, trainers, from_step):
        """Sets SYNC or BOUNDED collection `name`'s trainer count from step
        `from_step` on (a trainer lost or added between steps; the steps
        before keep theirs), on the coordinator and every worker; returns
        the collection as stored. Idempotent: after a failure, the same
        call again finishes it. FailedPrecondition when that step is
        applied already or the collection trains ASYNC."""
        return json.loads(self._c.set_trainers(name, int(trainers), int(from_step)))

    def drain(self, worker_id, timeout_s=1800.0):
        """Moves every shard off worker `worker_id` (copied live, no update
        lost) and keeps it out of new plans, as `emberctl drain`; returns
        the names of the collections moved."""
        return list(self._c.drain_worker(worker_id, float(timeout_s)))

    def scale(self, name, workers, timeout_s=1800.0):
        """Serves collection `name` from `workers` workers while it trains,
        as `emberctl scale`: its holders in rank order, less the last ones or
        plus live workers holding none of it; row-wise tables are re-cut, the
        shards that move are copied live, and updates are refused only for
        a short fence. Returns a dict: `collection` (as it serves now),
        `shards_moved`, `bytes_copied`, `bytes_between_workers`, `seconds`,
        `fence_ms`. FailedPrecondition when too few live workers can take
        shards; a failed move leaves the old placement serving."""
        if int(workers) < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        return json.loads(self._c.scale_collection(name, int(workers), float(timeout_s)))


def _step_arg(value, what):
    """A step or rank for the extension: -1 for None, else an int >= 0
    (InvalidArgument otherwise, before anything is sent)."""
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise InvalidArgument(3, f"{what} must be an int >= 0 (or None), got {value!r}")
    limit = (1 << 63) - 1 if what == "step" else (1 << 31) - 1
    if value > limit:
        raise InvalidArgument(3, f"{what} {value} is too large")
    return int(value)


def _polled(call, poll, poll_s, thread_name):
    """call() in a thread of its own, poll() every poll_s seconds while it
    runs (none: call() here); call()'s result, or its exception raised
    here."""
    if poll is None:
        return call()
    result = {}

    def run():
        try:
            result["value"] = call()
        except BaseException as e:  # raised in the caller's thread below
            result["error"] = e

    worker = threading.Thread(target=run, name=thread_name, daemon=True)
    worker.start()
    while True:
        worker.join(poll_s)
        if not worker.is_alive():
            break
        try:
            poll()
        except EmberError:
            pass  # progress is best effort; the call's own status is what counts
    if "error" in result:
        raise result["error"]
    return result["value"]


def _stderr_progress(what, verb):
    """A progress(bytes, total) that writes a line to stderr."""
    def report(done, total):
        mib = 1 << 20
        total_text = f" of {total / mib:.1f}" if total else ""
        print(f"{what}: {done / mib:.1f}{total_text} MiB {verb}", file=sys.stderr, flush=True)
    return report


def _stderr_restore_progress(what):
    """A restore's progress(bytes, total, phase) that writes a line to
    stderr."""
    verified = _stderr_progress(what, "verified")

    def report(done, total, phase):
        if phase == "loading":
            print(f"{what}: verified; loading on the workers", file=sys.stderr, flush=True)
        elif phase == "done":
            print(f"{what}: restored ({total / (1 << 20):.1f} MiB)", file=sys.stderr, flush=True)
        else:
            verified(done, total)
    return report


def _find_emberctl():
    """$EMBER_EMBERCTL, else the emberctl an installed wheel carries
    (ember/bin/emberctl), else bazel-bin/cli/emberctl of the checkout this
    package lives in."""
    env = os.environ.get("EMBER_EMBERCTL")
    if env:
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    packaged = os.path.join(here, "bin", "emberctl")
    if os.access(packaged, os.X_OK):
        return packaged
    for up in (os.path.join(here, "..", ".."), os.path.join(here, "..", "..", "..")):
        candidate = os.path.normpath(os.path.join(up, "bazel-bin", "cli", "emberctl"))
        if os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError("emberctl not found: build //:emberctl or set EMBER_EMBERCTL")


class LocalCluster:
    """`emberctl up` as a context manager: a coordinator and `workers` local
    workers on 127.0.0.1; `.address` is the coordinator's. Every process it
    started is stopped on exit, also when the block raises."""

    def __init__(self, workers=2, device="cpu", emberctl=None, extra_flags=(), timeout_s=60):
        self.workers = workers
        self.device = device
        self.emberctl = emberctl or _find_emberctl()
        self.extra_flags = list(extra_flags)
        self.timeout_s = timeout_s
        self.address = None
        # {"coordinator": url, worker id: url} with --metrics_port, else {}.
        self.metrics_urls = {}
        self._proc = None

    def __enter__(self):
        args = [self.emberctl, "up", f"--workers={self.workers}", f"--device={self.device}"]
        # Its stderr goes to a file: read back when it does not come up (the
        # CLI's own message, e.g. an unknown flag), never a pipe that could
        # fill while nobody reads it.
        self._stderr = tempfile.TemporaryFile(mode="w+t")
        self._proc = subprocess.Popen(args + self.extra_flags, stdout=subprocess.PIPE,
                                      stderr=self._stderr, text=True)
        deadline = time.monotonic() + self.timeout_s
        for line in self._proc.stdout:
            if line.startswith("coordinator: "):
                self.address = line.split()[1]
            # With --metrics_port: where each process serves /metrics.
            words = line.split()
            if line.startswith("metrics: coordinator "):
                self.metrics_urls["coordinator"] = words[2]
            if line.startswith("worker ") and "metrics" in words:
                self.metrics_urls[words[1]] = words[words.index("metrics") + 1]
            if line.startswith("ready:"):
                break
            if time.monotonic() > deadline:
                break
        if self.address is None or self._proc.poll() is not None:
            stderr = self._stderr
            self._stderr = None  # read below, after __exit__ stopped what was started
            self.__exit__(None, None, None)
            stderr.seek(0)
            tail = stderr.read()[-2000:].strip()
            stderr.close()
            raise Unavailable(14, "emberctl up did not come up" +
                              (f": {tail}" if tail else " (it printed nothing on stderr)"))
        return self

    def __exit__(self, *exc):
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        if self._proc is not None and self._proc.stdout is not None:
            self._proc.stdout.close()
        if getattr(self, "_stderr", None) is not None and not self._stderr.closed:
            self._stderr.close()
        return False
