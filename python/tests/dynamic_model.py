"""A NumPy model of a dynamic (hash-keyed) table (docs/dynamic-tables.md),
independent of the service: the routing of ids to shards, each shard's
admission counts, TTL, LRU/LFU eviction and write order, the initial rows
(the initializer's hash, worked in Python integers) and the four optimizers
in float32. test_dynamic.py drives it and the service with the same calls."""

import math

import numpy as np

M64 = (1 << 64) - 1


def mix(x):
    """SplitMix64's finaliser (server/common/dynamic_route.h: MixId)."""
    x &= M64
    x ^= x >> 30
    x = (x * 0xbf58476d1ce4e5b9) & M64
    x ^= x >> 27
    x = (x * 0x94d049bb133111eb) & M64
    return x ^ (x >> 31)


def route_row(id_, capacity):
    return mix(id_) % capacity


def _splitmix(x):
    return mix(x + 0x9e3779b97f4a7c15)


def initial_row(id_, dim, capacity, seed=0, col_offset=0):
    """The DEFAULT initializer's row of `id_`: uniform(-b, b), b =
    1/sqrt(capacity), from a hash of (seed, id, column)."""
    bound = math.sqrt(1.0 / capacity)
    out = np.zeros(dim, np.float32)
    for c in range(dim):
        column_hash = _splitmix(col_offset + c)
        h = _splitmix(seed ^ _splitmix(((id_ & M64) * 0x100000001b3 & M64) ^ column_hash))
        unit = ((h >> 40) + 0.5) / 16777216.0
        out[c] = np.float32(-bound + 2.0 * bound * unit)
    return out


class _Row:
    def __init__(self, w, state, step):
        self.w, self.state = w, state
        self.last, self.updates, self.seq = step, 1, 0


class _Shard:
    def __init__(self, capacity, spec):
        self.capacity, self.spec = capacity, spec
        self.rows, self.pending, self.step, self.seq = {}, {}, 0, 0
        self.evicted = {"ttl": 0, "lru": 0, "lfu": 0}

    def _key(self, item):
        id_, r = item
        return (r.updates, r.seq) if self.spec["eviction"] == "LFU" else (0, r.seq)

    def _fresh_state(self, dim):
        opt = self.spec["optimizer"]
        if opt == "ADAGRAD":
            return np.full(dim, self.spec["initial_accumulator_value"], np.float32)
        if opt == "ROWWISE_ADAGRAD":
            return np.full(1, self.spec["initial_accumulator_value"], np.float32)
        if opt == "ADAM":
            return np.zeros(2 * dim, np.float32)
        return np.zeros(0, np.float32)

    def _written(self, ids):
        for i in ids:
            if i in self.rows:
                self.seq += 1
                self.rows[i].seq = self.seq

    def begin_update(self, occurrences):
        """Steps the shard, evicts, admits; returns nothing (then
        apply())."""
        self.step += 1
        t = self.step
        ttl = self.spec["ttl_steps"]
        if ttl > 0:
            for i in [i for i, r in self.rows.items() if t - r.last > ttl]:
                del self.rows[i]
                self.evicted["ttl"] += 1
        counts = {}  # in the order of first occurrence (dicts keep it)
        for i in occurrences:
            counts[i] = counts.get(i, 0) + 1
        threshold = max(self.spec["admit_after"], 1)
        admit, written = [], []
        for i in counts:
            if i in self.rows:
                r = self.rows[i]
                r.last, r.updates = t, r.updates + 1
                written.append(i)
        self._written(written)  # the rows updated, then those created
        written = []
        for i in counts:
            if i not in self.rows:
                self.pending[i] = self.pending.get(i, 0) + counts[i]
                if self.pending[i] >= threshold:
                    admit.append(i)
        dim = self.spec["dim"]
        for i in admit:
            if len(self.rows) >= self.capacity:
                victims = [it for it in self.rows.items() if it[1].last != t]
                if not victims:
                    continue  # no room this step
                victim = min(victims, key=self._key)[0]
                del self.rows[victim]
                self.evicted["lfu" if self.spec["eviction"] == "LFU" else "lru"] += 1
            self.rows[i] = _Row(initial_row(i, dim, self.spec["capacity"], self.spec["seed"]),
                                self._fresh_state(dim), t)
            self.pending.pop(i, None)
            written.append(i)
        self._written(written)

    def apply(self, grads):
        """grads: id -> summed float32 gradient row (ids with rows only)."""
        s = self.spec
        lr, eps = np.float32(s["lr"]), np.float32(s["eps"])
        for i, g in grads.items():
            r = self.rows[i]
            if s["optimizer"] == "SGD":
                r.w = (r.w - lr * g).astype(np.float32)
            elif s["optimizer"] == "ADAGRAD":
                r.state = (r.state + g * g).astype(np.float32)
                r.w = (r.w - lr * g / (np.sqrt(r.state) + eps)).astype(np.float32)
            elif s["optimizer"] == "ROWWISE_ADAGRAD":
                r.state = (r.state + np.float32(np.mean(g * g))).astype(np.float32)
                r.w = (r.w - (lr / (np.sqrt(r.state[0]) + eps)) * g).astype(np.float32)
            else:  # ADAM, t = the shard's step
                b1, b2, d = np.float32(0.9), np.float32(0.999), s["dim"]
                m = b1 * r.state[:d] + (np.float32(1) - b1) * g
                v = b2 * r.state[d:] + (np.float32(1) - b2) * g * g
                r.state = np.concatenate([m, v]).astype(np.float32)
                t = self.step
                mh = m / np.float32(1.0 - 0.9 ** t)
                vh = v / np.float32(1.0 - 0.999 ** t)
                r.w = (r.w - lr * (mh / (np.sqrt(vh) + eps))).astype(np.float32)


class DynamicTableModel:
    """One dynamic table over its shards' row ranges (from the plan)."""

    def __init__(self, spec, shard_ranges):
        self.spec = spec
        self.ranges = shard_ranges  # [(row_offset, rows)]
        self.shards = [_Shard(rows, spec) for _, rows in shard_ranges]

    def shard_of(self, id_):
        row = route_row(id_, self.spec["capacity"])
        for k, (off, rows) in enumerate(self.ranges):
            if off <= row < off + rows:
                return self.shards[k]
        raise AssertionError("no shard holds the routing row")

    def row(self, id_):
        r = self.shard_of(id_).rows.get(id_)
        return None if r is None else r.w

    def lookup(self, bags, weights=None, pooling="SUM"):
        dim = self.spec["dim"]
        if pooling == "NONE":
            out = []
            for bag in bags:
                for i in bag:
                    w = self.row(i)
                    out.append(np.zeros(dim, np.float32) if w is None else w)
            return np.array(out, np.float32).reshape(-1, dim)
        out = np.zeros((len(bags), dim), np.float32)
        for b, bag in enumerate(bags):
            for k, i in enumerate(bag):
                w = self.row(i)
                if w is None:
                    continue
                scale = 1.0 if weights is None else weights[b][k]
                if pooling == "MEAN":
                    scale /= len(bag)
                out[b] += np.float32(scale) * w
        return out

    def update(self, bags, grad, weights=None, pooling="SUM"):
        occ = {}
        for bag in bags:
            for i in bag:
                occ.setdefault(id(self.shard_of(i)), []).append(i)
        for shard in self.shards:  # every shard steps: the client names them all
            shard.begin_update(occ.get(id(shard), []))
        sums = {}
        n = 0
        for b, bag in enumerate(bags):
            for k, i in enumerate(bag):
                shard = self.shard_of(i)
                if i in shard.rows:
                    if pooling == "NONE":
                        g = grad[n]
                    else:
                        scale = 1.0 if weights is None else weights[b][k]
                        if pooling == "MEAN":
                            scale /= len(bag)
                        g = np.float32(scale) * grad[b]
                    sums[i] = sums.get(i, np.zeros(self.spec["dim"], np.float32)) + g
                n += 1
        for shard in self.shards:
            shard.apply({i: g for i, g in sums.items() if i in shard.rows})

    def held(self):
        ids = sorted(i for s in self.shards for i in s.rows)
        rows = np.array([self.row(i) for i in ids], np.float32).reshape(len(ids),
                                                                        self.spec["dim"])
        return np.array(ids, np.int64), rows
