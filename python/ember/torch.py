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

import itertools
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


def _table_dict(t):
    """A torchrec.EmbeddingBagConfig (or a dict of its fields) as a spec table."""
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
        specs = [_table_dict(t) for t in tables]
        for t in specs:
            if optimizer is not None and "optimizer" not in t:
                t["optimizer"] = dict(optimizer)
        if create:
            self._info = client.create_collection({"name": collection, "tables": specs},
                                                  sharding_type=sharding_type)
        else:
            self._info = client.collection(collection)
        self._tables = [t["name"] for t in self._info["spec"]["tables"]]
        self._step = 0
        self._run = uuid.uuid4().hex[:12]

    @property
    def collection(self):
        return self._collection

    def forward(self, kjt):
        kt = self._client.lookup(self._collection, kjt)
        values = torch.from_numpy(kt.values)
        if torch.is_grad_enabled() and self.training:
            anchor = torch.empty(0, requires_grad=True)  # makes autograd call backward
            values = _RemoteLookup.apply(anchor, self, ember._as_kjt(kjt), values)
        return KeyedTensor(kt.keys, kt.length_per_key, values)

    def _apply_gradients(self, kjt, grad):
        # The forward's layout: the KJT's features in the collection's order.
        keys = [f for t in self._info["spec"]["tables"] for f in t["feature_names"]]
        dims = {f: int(t["embedding_dim"]) for t in self._info["spec"]["tables"]
                for f in t["feature_names"]}
        present = [k for k in keys if k in kjt.keys]
        self._step += 1
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
