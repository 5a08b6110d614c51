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
(TorchRec's names) and `load_state_dict()` writes them to the workers. Under
torch.no_grad() or eval() a forward only looks up.
"""

import concurrent.futures
import itertools
import sys
import threading
import uuid

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
    def forward(ctx, anchor, module, kjt, values):
        ctx.module = module
        ctx.kjt = kjt
        return values.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.module._apply_gradients(ctx.kjt, grad)
        return None, None, None, None


class EmbeddingBagCollection(torch.nn.Module):
    """A torch.nn.Module over an Ember collection (see the module doc).

    tables: torchrec.EmbeddingBagConfig objects or dicts of the same fields
      (name, num_embeddings, embedding_dim, feature_names, pooling, ...).
    optimizer: dict such as {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.05}
      for every table that names none (TorchRec's fused optimizer).
    create: False to attach to an existing collection of that name.
    """

    def __init__(self, tables, client, collection, optimizer=None, sharding_type=None,
                 create=True):
        super().__init__()
        self._client = client
        self._collection = collection
        specs = [ember.table_spec(t) for t in tables]
        for t in specs:
            if optimizer is not None and "optimizer" not in t:
                t["optimizer"] = dict(optimizer)
        if create:
            self._info = client.create_collection({"name": collection, "tables": specs},
                                                  sharding_type=sharding_type)
        else:
            self._info = client.collection(collection)
        self._tables = [t["name"] for t in self._info["spec"]["tables"]]
        self._dims = {f: int(t["embedding_dim"]) for t in self._info["spec"]["tables"]
                      for f in t["feature_names"]}
        self._step = 0
        self._run = uuid.uuid4().hex[:12]
        self._prefetched = {}  # id(kjt) -> (kjt, Future of the lookup)
        self._prefetch_lock = threading.Lock()
        self._executor = None

    @property
    def collection(self):
        return self._collection

    def prefetch(self, kjt):
        """Starts kjt's lookup in a background thread (the client releases the
        GIL); a later forward(kjt) of the same object uses its result. The
        lookup reads the tables as they are now, so it misses the updates of
        steps that finish before that forward (TrainPipeline's one step of
        staleness)."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="ember-prefetch")
        on_device = self._on_device(kjt)
        if on_device:  # over the link straight from its tensors' memory
            _ready(_device_of(kjt))  # the caller's stream made its tensors
            future = self._executor.submit(self._lookup_on_device, kjt)
        else:
            future = self._executor.submit(self._client.lookup, self._collection, kjt)
        with self._prefetch_lock:
            self._prefetched[id(kjt)] = (kjt, future, on_device)
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
            on_device = entry[2]
            result = entry[1].result()
        else:
            on_device = self._on_device(kjt)
            result = (self._lookup_on_device(kjt) if on_device
                      else self._client.lookup(self._collection, kjt))
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
            values = _RemoteLookup.apply(anchor, self, kjt if on_device else ember._as_kjt(kjt),
                                         values)
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

    def _lookup_on_device(self, kjt):
        """kjt's lookup on the device path: (keys, dims, values on its device)."""
        lengths, values, weights = _device_args(kjt)
        keys = list(kjt.keys())
        batch = lengths.numel() // len(keys) if keys else 0
        width = sum(self._dims.get(k, 0) for k in keys)
        out = torch.empty((batch, width), dtype=torch.float32, device=values.device)
        _ready(values.device)  # this thread's conversions of the arrays, done
        got_keys, dims = self._client._c.lookup_on_device(
            self._collection, keys, batch, lengths.data_ptr(), values.data_ptr(), values.numel(),
            0 if weights is None else weights.data_ptr(), out.data_ptr(), out.numel())
        return got_keys, dims, out

    def _apply_gradients(self, kjt, grad):
        self._step += 1
        if self._on_device(kjt):
            lengths, values, weights = _device_args(kjt)
            keys = list(kjt.keys())
            batch = lengths.numel() // len(keys) if keys else 0
            grad = grad.detach().to(device=values.device, dtype=torch.float32).contiguous()
            _ready(values.device)
            self._client._c.apply_gradients_on_device(
                self._collection, keys, batch, lengths.data_ptr(), values.data_ptr(),
                values.numel(), 0 if weights is None else weights.data_ptr(), grad.data_ptr(),
                grad.numel(), f"{self._run}-{self._step}")
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
            request_id=f"{self._run}-{self._step}")

    # State: the tables, by TorchRec's names.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        for t in self._tables:
            destination[f"{prefix}embedding_bags.{t}.weight"] = torch.from_numpy(
                self._client.export_table(self._collection, t))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        for t in self._tables:
            key = f"{prefix}embedding_bags.{t}.weight"
            if key in state_dict:
                self._client.import_table(self._collection, t, state_dict[key])
            elif strict:
                missing_keys.append(key)
        mine = {f"{prefix}embedding_bags.{t}.weight" for t in self._tables}
        for key in state_dict:
            if key.startswith(prefix) and key not in mine and strict:
                unexpected_keys.append(key)


class TrainPipeline:
    """Overlaps the next batch's embedding lookup with the current training
    step, as TorchRec's TrainPipelineSemiSync does: while the dense model runs
    forward and backward on batch k, batch k+1's lookup is already on its way
    to the workers, so their time hides behind the dense compute.

        pipeline = TrainPipeline(model, optimizer, ebc, sparse=lambda b: b["kjt"])
        for _ in range(steps):
            loss = pipeline.progress(batches)   # StopIteration when they run out

    model(batch) must call ebc(sparse(batch)) and return the loss (or a tuple
    whose first element is the loss); sparse(batch) must return the batch's
    own KJT object each time (the prefetched lookup is matched by identity;
    another object is looked up afresh, correct but not overlapped); progress() runs backward (which sends
    the tables' gradients to the workers) and optimizer.step().

    Semantics: batch k+1's lookup is issued before batch k's gradients are
    applied, so rows that both batches touch are read one update behind (one
    step of staleness, as with TorchRec's semi-synchronous pipeline). Use a
    plain loop where that matters.
    """

    def __init__(self, model, optimizer, ebc, sparse=None):
        self._model = model
        self._optimizer = optimizer
        self._ebc = ebc
        self._sparse = sparse or (lambda b: b.sparse_features)
        self._next = None  # (batch, its kjt) with its lookup in flight

    def _fetch(self, batches):
        try:
            batch = next(batches)
        except StopIteration:
            return None
        kjt = self._sparse(batch)
        self._ebc.prefetch(kjt)
        return batch

    def progress(self, batches):
        """One training step; raises StopIteration when `batches` (an
        iterator) is exhausted."""
        if self._next is None:
            self._next = self._fetch(batches)
            if self._next is None:
                raise StopIteration
        batch = self._next
        self._next = self._fetch(batches)  # k+1's lookup runs while k computes
        self._optimizer.zero_grad()
        out = self._model(batch)
        loss = out[0] if isinstance(out, tuple) else out
        loss.backward()
        self._optimizer.step()
        return loss.detach()
