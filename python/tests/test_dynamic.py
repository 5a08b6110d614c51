"""Dynamic (hash-keyed) tables (docs/dynamic-tables.md) through the service
and the SDK, against a NumPy model of the rules (dynamic_model.py): any
int64 id, rows created on admission (thresholds 1 and 3), TTL, LRU and LFU
eviction per shard, every optimizer, SUM/MEAN with per-id weights and NONE,
table_wise and row_wise over 2 and 3 workers; lookups never change
anything; export/import by id; exactly-once retries that cross an
admission; a drain; memory within capacity under 10x as many distinct ids;
bad specs refused with the table and field named."""

import collections
import os

import numpy as np
import pytest

import ember
from dynamic_model import DynamicTableModel, initial_row, route_row

DIM = {"f_sum": 8, "f_mean": 4}
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


@pytest.fixture(scope="module")
def cluster():
    with ember.LocalCluster(workers=2) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    return ember.Client(cluster.address, timeout_s=30)


def dynamic_table(name, feature, pooling, dim, opt, capacity, admit_after=1, ttl=0,
                  eviction="LRU", seed=0):
    return {"name": name, "num_embeddings": 0, "embedding_dim": dim,
            "feature_names": [feature], "pooling": pooling,
            "optimizer": opt, "initializer": {"seed": seed},
            "dynamic": {"capacity": capacity, "admit_after": admit_after, "ttl_steps": ttl,
                        "eviction": eviction}}


def model_spec(opt, capacity, admit_after, ttl, eviction, dim, seed=0):
    return {"optimizer": opt["type"], "lr": opt.get("learning_rate", 0.01),
            "eps": opt.get("eps", 1e-8),
            "initial_accumulator_value": opt.get("initial_accumulator_value", 0.0),
            "capacity": capacity, "admit_after": admit_after, "ttl_steps": ttl,
            "eviction": eviction, "dim": dim, "seed": seed}


def ranges_of(client, name, table):
    ts = next(t for t in client.plan(name)["tables"] if t["table"] == table)
    return sorted((int(s.get("row_offset", 0)), int(s["rows"])) for s in ts["shards"])


def universe(rng, n):
    """Hashed ids: int64 anywhere, negative and extreme included."""
    ids = [int(x) for x in rng.integers(INT64_MIN, INT64_MAX, size=n - 3, dtype=np.int64)]
    return ids + [INT64_MIN, INT64_MAX, -1]


def draw(rng, ids, batch):
    """`batch` bags of 0..4 ids, skewed to a hot few."""
    bags = []
    for _ in range(batch):
        k = int(rng.integers(0, 5))
        bags.append([ids[min(int(rng.zipf(1.5)) - 1, len(ids) - 1)] for _ in range(k)])
    return bags


CASES = [
    ({"type": "SGD", "learning_rate": 0.5}, "table_wise", 1, 0, "LRU"),
    ({"type": "ADAGRAD", "learning_rate": 0.2, "initial_accumulator_value": 0.1}, "row_wise", 3,
     0, "LFU"),
    ({"type": "ROWWISE_ADAGRAD", "learning_rate": 0.3}, "row_wise", 1, 4, "LRU"),
    ({"type": "ADAM", "learning_rate": 0.05}, "table_wise", 2, 3, "LFU"),
]


@pytest.mark.parametrize("opt,sharding,admit,ttl,eviction", CASES)
def test_pooled_tables_match_the_model(client, opt, sharding, admit, ttl, eviction):
    name = f"dyn_{opt['type'].lower()}_{sharding}"
    cap = {"f_sum": 12, "f_mean": 10}
    spec = {"name": name, "tables": [
        dynamic_table("t_sum", "f_sum", "SUM", 8, opt, cap["f_sum"], admit, ttl, eviction, 5),
        dynamic_table("t_mean", "f_mean", "MEAN", 4, opt, cap["f_mean"], admit, ttl, eviction,
                      6)]}
    client.create_collection(spec, sharding_type=sharding)
    # Adam's step divides by sqrt(v): a gradient summed in another order
    # moves a row by a few ulps more where v is small.
    tol = dict(rtol=1e-4, atol=2e-5) if opt["type"] == "ADAM" else dict(rtol=2e-5, atol=2e-6)
    try:
        models = {f: DynamicTableModel(model_spec(opt, cap[f], admit, ttl, eviction, DIM[f],
                                                  seed=5 if f == "f_sum" else 6),
                                       ranges_of(client, name, t))
                  for f, t in (("f_sum", "t_sum"), ("f_mean", "t_mean"))}
        rng = np.random.default_rng(len(name))
        ids = universe(rng, 30)
        for step in range(24):
            bags = {f: draw(rng, ids, 4) for f in DIM}
            weighted = step % 3 == 1
            weights = ({f: [[float(rng.integers(1, 4)) / 2 for _ in b] for b in bags[f]]
                        for f in DIM} if weighted else None)
            kjt = ember.KeyedJaggedTensor.from_jagged(bags, weights)
            got = client.lookup(name, kjt)
            for f in DIM:
                want = models[f].lookup(bags[f], None if weights is None else weights[f],
                                        "SUM" if f == "f_sum" else "MEAN")
                np.testing.assert_allclose(got[f], want, **tol,
                                           err_msg=f"{f} lookup at step {step}")
            grad = rng.normal(size=(4, 12)).astype(np.float32)
            client.apply_gradients(name, kjt, grad)
            models["f_sum"].update(bags["f_sum"], grad[:, :8], None if weights is None
                                   else weights["f_sum"], "SUM")
            models["f_mean"].update(bags["f_mean"], grad[:, 8:], None if weights is None
                                    else weights["f_mean"], "MEAN")
        for f, t in (("f_sum", "t_sum"), ("f_mean", "t_mean")):
            got_ids, got_rows = client.export_table(name, t)
            want_ids, want_rows = models[f].held()
            np.testing.assert_array_equal(got_ids, want_ids, err_msg=f"{t}: the ids held")
            np.testing.assert_allclose(got_rows, want_rows, **tol, err_msg=t)
            assert len(got_ids) <= cap[f]
    finally:
        client.drop_collection(name)


def test_sequence_table_and_lookups_that_change_nothing(client):
    opt = {"type": "ADAGRAD", "learning_rate": 0.1}
    name = "dyn_seq"
    client.create_collection({"name": name, "tables": [
        dynamic_table("t_seq", "f_seq", "NONE", 4, opt, 6, admit_after=2)]},
        sharding_type="row_wise")
    try:
        model = DynamicTableModel(model_spec(opt, 6, 2, 0, "LRU", 4), ranges_of(client, name,
                                                                                 "t_seq"))
        rng = np.random.default_rng(3)
        ids = universe(rng, 12)
        for step in range(15):
            bags = {"f_seq": draw(rng, ids, 3)}
            kjt = ember.KeyedJaggedTensor.from_jagged(bags)
            for _ in range(2):  # a lookup again reads the same: nothing changed
                got = client.lookup_sequence(name, kjt)["f_seq"]
                np.testing.assert_allclose(got, model.lookup(bags["f_seq"], pooling="NONE"),
                                           rtol=2e-5, atol=2e-6, err_msg=f"step {step}")
            n = sum(len(b) for b in bags["f_seq"])
            grad = rng.normal(size=(n, 4)).astype(np.float32)
            client.apply_sequence_gradients(name, kjt, {"f_seq": grad})
            model.update(bags["f_seq"], grad, pooling="NONE")
        got_ids, got_rows = client.export_table(name, "t_seq")
        want_ids, want_rows = model.held()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_allclose(got_rows, want_rows, rtol=2e-5, atol=2e-6)
    finally:
        client.drop_collection(name)


def test_initial_rows_depend_on_the_id_alone(client):
    """An admitted id's first row is its initializer's hash of (seed, id,
    column) on every sharding: the same from table_wise and row_wise, and
    the model's (worked in Python)."""
    opt = {"type": "SGD", "learning_rate": 0.0}
    ids = [7, -7, INT64_MIN, INT64_MAX, 1 << 40]
    rows = {}
    for sharding in ("table_wise", "row_wise"):
        name = f"dyn_init_{sharding}"
        client.create_collection({"name": name, "tables": [
            dynamic_table("t", "f", "SUM", 8, opt, 16, seed=11)]}, sharding_type=sharding)
        try:
            kjt = ember.KeyedJaggedTensor.from_jagged({"f": [[i] for i in ids]})
            client.apply_gradients(name, kjt, np.zeros((len(ids), 8), np.float32))
            got_ids, got_rows = client.export_table(name, "t")
            assert list(got_ids) == sorted(ids)
            rows[sharding] = got_rows
        finally:
            client.drop_collection(name)
    np.testing.assert_array_equal(rows["table_wise"], rows["row_wise"])
    want = np.array([initial_row(i, 8, 16, seed=11) for i in sorted(ids)])
    np.testing.assert_array_equal(rows["table_wise"], want)


def test_export_import_round_trip_and_refusals(client):
    opt = {"type": "ADAGRAD", "learning_rate": 0.1}
    src, dst = "dyn_src", "dyn_dst"
    for name in (src, dst):
        client.create_collection({"name": name, "tables": [
            dynamic_table("t", "f", "SUM", 4, opt, 20)]}, sharding_type="row_wise")
    try:
        rng = np.random.default_rng(9)
        ids = universe(rng, 15)
        for _ in range(5):
            bags = {"f": draw(rng, ids, 4)}
            client.apply_gradients(src, ember.KeyedJaggedTensor.from_jagged(bags),
                                   rng.normal(size=(4, 4)).astype(np.float32))
        held_ids, held_rows = client.export_table(src, "t")
        assert len(held_ids) > 0 and list(held_ids) == sorted(held_ids)
        client.import_table(dst, "t", (held_ids, held_rows))
        got_ids, got_rows = client.export_table(dst, "t")
        np.testing.assert_array_equal(got_ids, held_ids)
        np.testing.assert_array_equal(got_rows, held_rows)
        # Lookups read them.
        kjt = ember.KeyedJaggedTensor.from_jagged({"f": [[int(i)] for i in held_ids]})
        np.testing.assert_array_equal(client.lookup(dst, kjt)["f"], held_rows)
        # Refused, nothing written: a repeated id, NaN, the wrong width, a
        # dense array, more ids than a shard holds.
        before = client.export_table(dst, "t")
        with pytest.raises(ember.InvalidArgument, match="given twice"):
            client.import_table(dst, "t", ([5, 5], np.zeros((2, 4), np.float32)))
        with pytest.raises(ember.InvalidArgument, match="NaN/Inf"):
            client.import_table(dst, "t", ([5], np.full((1, 4), np.nan, np.float32)))
        with pytest.raises(ember.InvalidArgument, match="takes rows of 4"):
            client.import_table(dst, "t", ([5], np.zeros((1, 3), np.float32)))
        with pytest.raises(ember.InvalidArgument, match="takes \\(ids, rows\\)"):
            client.import_table(dst, "t", np.zeros((3, 4), np.float32))
        many = np.arange(1000, dtype=np.int64)
        with pytest.raises(ember.ResourceExhausted, match="which holds"):
            client.import_table(dst, "t", (many, np.zeros((1000, 4), np.float32)))
        after = client.export_table(dst, "t")
        np.testing.assert_array_equal(after[0], before[0])
        np.testing.assert_array_equal(after[1], before[1])
    finally:
        client.drop_collection(src)
        client.drop_collection(dst)


def test_a_retried_update_counts_toward_admission_once(client):
    opt = {"type": "SGD", "learning_rate": 1.0}
    name = "dyn_retry"
    client.create_collection({"name": name, "tables": [
        dynamic_table("t", "f", "SUM", 4, opt, 8, admit_after=2)]}, sharding_type="row_wise")
    try:
        kjt = ember.KeyedJaggedTensor.from_jagged({"f": [[42]]})
        grad = np.ones((1, 4), np.float32)
        client.apply_gradients(name, kjt, grad, request_id="u1")
        client.apply_gradients(name, kjt, grad, request_id="u1")  # a retry: applied once
        assert len(client.export_table(name, "t")[0]) == 0  # 42 counted once: not admitted
        client.apply_gradients(name, kjt, grad, request_id="u2")  # the second: admitted
        ids, rows = client.export_table(name, "t")
        assert list(ids) == [42]
        spec = model_spec(opt, 8, 2, 0, "LRU", 4)
        np.testing.assert_allclose(rows[0], initial_row(42, 4, 8) - 1.0, rtol=1e-6)
        client.apply_gradients(name, kjt, grad, request_id="u2")  # a retry again
        np.testing.assert_array_equal(client.export_table(name, "t")[1], rows)
        assert spec["capacity"] == 8
    finally:
        client.drop_collection(name)


def test_memory_stays_within_capacity_under_ten_times_as_many_ids(client):
    opt = {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.1}
    name = "dyn_flood"
    client.create_collection({"name": name, "tables": [
        dynamic_table("t", "f", "SUM", 4, opt, 200, ttl=0, eviction="LFU")]},
        sharding_type="row_wise")
    try:
        rng = np.random.default_rng(1)
        stream = rng.integers(INT64_MIN, INT64_MAX, size=2000, dtype=np.int64)
        for b in range(0, 2000, 100):
            bags = {"f": [[int(i)] for i in stream[b:b + 100]]}
            client.apply_gradients(name, ember.KeyedJaggedTensor.from_jagged(bags),
                                   np.ones((100, 4), np.float32))
            ids, _ = client.export_table(name, "t")
            assert len(ids) <= 200
        ranges = ranges_of(client, name, "t")
        # Each shard full (ids spread by the routing hash, evicting the rest).
        per_shard = [sum(1 for i in ids if off <= route_row(int(i), 200) < off + n)
                     for off, n in ranges]
        assert per_shard == [n for _, n in ranges]
        status = client.worker_status(client.collection(name)["worker_addresses"][0])
        assert status is not None
    finally:
        client.drop_collection(name)


@pytest.mark.parametrize("change,words", [
    ({"capacity": 0}, "dynamic.capacity must be in [1"),
    ({"admit_after": -1}, "dynamic.admit_after must be >= 0"),
    ({"ttl_steps": -5}, "dynamic.ttl_steps must be >= 0"),
])
def test_bad_dynamic_specs_are_refused_naming_the_field(client, change, words):
    t = dynamic_table("t_bad", "f", "SUM", 4, {"type": "SGD"}, 8)
    t["dynamic"].update(change)
    with pytest.raises(ember.InvalidArgument, match=words.replace("[", "\\[")) as e:
        client.create_collection({"name": "bad", "tables": [t]})
    assert "t_bad" in str(e.value)


def test_other_refusals(client):
    t = dynamic_table("t_bad", "f", "SUM", 4, {"type": "SGD"}, 8)
    t["num_embeddings"] = 5
    with pytest.raises(ember.InvalidArgument, match="num_embeddings is unused"):
        client.create_collection({"name": "bad", "tables": [t]})
    t["num_embeddings"] = 8  # the capacity: accepted
    for sharding in ("column_wise", "data_parallel", "table_row_wise"):
        with pytest.raises(ember.InvalidArgument, match="dynamic table takes table_wise or row_wise"):
            client.create_collection({"name": "bad", "tables": [t]}, sharding_type=sharding)
    client.create_collection({"name": "ok_dyn", "tables": [t]})
    try:
        with pytest.raises(ember.InvalidArgument, match="is dynamic"):
            client._c.export_table("ok_dyn", "t_bad")
        # A huge uint64 hash is refused with the way to pass it.
        with pytest.raises(ember.InvalidArgument, match="view"):
            ember.KeyedJaggedTensor(["f"], [1], np.array([1 << 63], np.uint64))
    finally:
        client.drop_collection("ok_dyn")


@pytest.mark.parametrize("kernel", ["fused", "key_value"])
def test_a_drain_moves_dynamic_shards_with_their_ids_and_order(tmp_path, kernel):
    """3 workers, row_wise: a drain copies each shard's slots, ids, eviction
    order and admission counts live (admission on the second update: ids
    seen once before the drain are admitted by their next update after it);
    training then goes on exactly as the model's. key_value: each shard's
    rows in a file under the worker's SSD directory, 2 of them cached."""
    opt = {"type": "ADAM", "learning_rate": 0.05}
    flags, constraints = [], {}
    if kernel == "key_value":
        flags = [f"--ssd_dir={tmp_path}", "--key_value_min_cache_rows=1"]
        constraints = {"t": {"compute_kernels": ["key_value"], "cache_load_factor": 0.5}}
    with ember.LocalCluster(workers=3, extra_flags=flags) as cluster:
        c = ember.Client(cluster.address, timeout_s=30)
        name = "dyn_drain"
        info = c.create_collection({"name": name, "constraints": constraints, "tables": [
            dynamic_table("t", "f", "SUM", 4, opt, 9, admit_after=2, ttl=6, eviction="LRU")]},
            sharding_type="row_wise")
        assert info["plan"]["tables"][0]["compute_kernel"] == kernel
        model = DynamicTableModel(model_spec(opt, 9, 2, 6, "LRU", 4), ranges_of(c, name, "t"))
        rng = np.random.default_rng(5)
        ids = universe(rng, 25)

        def steps(n):
            for _ in range(n):
                bags = {"f": draw(rng, ids, 4)}
                grad = rng.normal(size=(4, 4)).astype(np.float32)
                c.apply_gradients(name, ember.KeyedJaggedTensor.from_jagged(bags), grad)
                model.update(bags["f"], grad)

        def once(bags):
            grad = rng.normal(size=(4, 4)).astype(np.float32)
            c.apply_gradients(name, ember.KeyedJaggedTensor.from_jagged(bags), grad)
            model.update(bags["f"], grad)

        # A fresh id for every shard, counted once before the drain: its
        # second update after the drain admits it only if the count moved.
        fresh = {}
        for n in range(1, 100000):
            cand = n * 7919 + (1 << 50)
            row = route_row(cand, 9)
            k = next(k for k, (off, rows) in enumerate(model.ranges) if off <= row < off + rows)
            fresh.setdefault(k, cand)
            if len(fresh) == len(model.ranges):
                break
        fresh_bags = {"f": [[i] for i in fresh.values()] + [[]] * (4 - len(fresh))}
        steps(10)
        once(fresh_bags)
        info = c.collection(name)
        victim = next(w["worker_id"] for w in c.list_workers()
                      if w["info"]["address"] == info["worker_addresses"][1])
        assert name in c.drain(victim)
        # The moved shards keep their rows, their place in the plan and
        # their kernel.
        assert ranges_of(c, name, "t") == model.ranges
        assert c.plan(name)["tables"][0]["compute_kernel"] == kernel
        once(fresh_bags)
        assert all(model.row(i) is not None for i in fresh.values())
        steps(10)
        got_ids, got_rows = c.export_table(name, "t")
        want_ids, want_rows = model.held()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_allclose(got_rows, want_rows, rtol=1e-4, atol=2e-5)  # Adam: as above


@pytest.mark.parametrize("workers_after,incremental", [(3, False), (1, False), (3, True)])
def test_checkpoint_restores_onto_another_worker_count_bit_for_bit(tmp_path, workers_after,
                                                                  incremental):
    """A row_wise dynamic table checkpointed on 2 workers restores onto 3 (or
    1): every row re-hashed to the shard that owns its id now, with its
    optimizer state, update step and count, and every id's admission count
    (admission on the third update) to the shard that owns the id; lookups,
    exports and further training equal the original's bit for bit.
    Incremental: the checkpoint restored is a delta over one taken halfway
    (rows admitted and updated between them); the same holds."""
    opt = {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.2}
    flags = [f"--checkpoint_dir={tmp_path}"]
    name = "dyn_ck"
    rng = np.random.default_rng(17)
    ids = universe(rng, 18)  # fewer than any shard holds: nothing evicted
    batches = [({"f": draw(rng, ids, 4)}, rng.normal(size=(4, 4)).astype(np.float32))
               for _ in range(16)]
    # Ids counted once or twice by the checkpoint that come again after it:
    # their admission depends on the counts restored.
    seen = collections.Counter(int(i) for bags, _ in batches[:8] for bag in bags["f"] for i in bag)
    later = {int(i) for bags, _ in batches[8:] for bag in bags["f"] for i in bag}
    assert any(0 < n < 3 and i in later for i, n in seen.items())

    def train(c, coll, part):
        for bags, grad in part:
            c.apply_gradients(coll, ember.KeyedJaggedTensor.from_jagged(bags), grad)

    with ember.LocalCluster(workers=2, extra_flags=flags) as a:
        ca = ember.Client(a.address, timeout_s=30)
        ca.create_collection({"name": name, "tables": [
            dynamic_table("t", "f", "SUM", 4, opt, 60, admit_after=3, ttl=0)]},
            sharding_type="row_wise")
        if incremental:
            train(ca, name, batches[:4])
            first = ca.checkpoint(name, str(tmp_path), incremental=True)
            assert first["chain_length"] == 1
            train(ca, name, batches[4:8])
        else:
            train(ca, name, batches[:8])
        ck = ca.checkpoint(name, str(tmp_path), incremental=incremental)
        if incremental:
            assert ck["base"] == os.path.basename(first["path"])
            assert ck["delta_shards"] == 2 and ck["chain_length"] == 2
        before = ca.export_table(name, "t")
        train(ca, name, batches[8:])
        after = ca.export_table(name, "t")
    with ember.LocalCluster(workers=workers_after, extra_flags=flags) as b:
        cb = ember.Client(b.address, timeout_s=30)
        restored = cb.restore(ck["path"], name, sharding_type="row_wise")
        assert len(restored["collection"]["worker_addresses"]) == workers_after
        got = cb.export_table(name, "t")
        np.testing.assert_array_equal(got[0], before[0])
        np.testing.assert_array_equal(got[1], before[1])
        probe = ember.KeyedJaggedTensor.from_jagged({"f": [[int(i)] for i in ids]})
        train(cb, name, batches[8:])
        got = cb.export_table(name, "t")
        np.testing.assert_array_equal(got[0], after[0])
        np.testing.assert_array_equal(got[1], after[1])
        assert cb.lookup(name, probe)["f"].shape == (len(ids), 4)


@pytest.mark.parametrize("move", ["drain", "restore"])
def test_sketched_admission_counts_move_with_their_shards(tmp_path, move):
    """Workers that count only 2 pending ids a shard exactly
    (--dynamic_exact_pending_ids=2) count the rest in the count-min sketch.
    40 ids updated twice before a drain (or a checkpoint restored from 2
    workers onto 3) are all admitted by their third update after it
    (admit_after 3): the sketch moved with the exact counts. Without it the
    sketched ids would start over and stay pending."""
    flags = ["--dynamic_exact_pending_ids=2", f"--checkpoint_dir={tmp_path}"]
    ids = [(n * 1000003 + 17) * (1 if n % 2 else -1) for n in range(1, 41)]
    kjt = ember.KeyedJaggedTensor.from_jagged({"f": [ids[k::4] for k in range(4)]})
    grad = np.full((4, 4), 0.5, dtype=np.float32)
    name = f"dyn_sketch_{move}"
    opt = {"type": "SGD", "learning_rate": 0.1}
    with ember.LocalCluster(workers=3 if move == "drain" else 2, extra_flags=flags) as a:
        ca = ember.Client(a.address, timeout_s=30)
        ca.create_collection({"name": name, "tables": [
            dynamic_table("t", "f", "SUM", 4, opt, 200, admit_after=3, ttl=0)]},
            sharding_type="row_wise")
        for _ in range(2):
            ca.apply_gradients(name, kjt, grad)
        assert len(ca.export_table(name, "t")[0]) == 0  # every id still pending
        if move == "drain":
            info = ca.collection(name)
            victim = next(w["worker_id"] for w in ca.list_workers()
                          if w["info"]["address"] == info["worker_addresses"][1])
            assert name in ca.drain(victim)
            ca.apply_gradients(name, kjt, grad)
            got = ca.export_table(name, "t")[0]
        else:
            ck = ca.checkpoint(name, str(tmp_path))
    if move == "restore":
        with ember.LocalCluster(workers=3, extra_flags=flags) as b:
            cb = ember.Client(b.address, timeout_s=30)
            cb.restore(ck["path"], name, sharding_type="row_wise")
            cb.apply_gradients(name, kjt, grad)
            got = cb.export_table(name, "t")[0]
    np.testing.assert_array_equal(got, np.sort(np.array(ids, dtype=np.int64)))


def test_ember_torch_module_trains_a_dynamic_table_on_hashed_ids(client):
    """ember.torch.EmbeddingBagCollection over a dynamic table (a dict table
    with "dynamic"): a forward of 64-bit hashed ids (negative included)
    reads what the model says, backward trains it as the model does, and
    the state dict carries the ids beside the rows, loading into another
    module's table."""
    torch = pytest.importorskip("torch")
    from ember.torch import EmbeddingBagCollection
    opt = {"type": "ADAGRAD", "learning_rate": 0.1}
    tables = [dynamic_table("t_hash", "f_hash", "SUM", 8, opt, 32, admit_after=2, seed=3)]
    ebc = EmbeddingBagCollection(tables, client, "dyn_torch", sharding_type="row_wise")
    other = EmbeddingBagCollection(tables, client, "dyn_torch2", sharding_type="table_wise")
    try:
        model = DynamicTableModel(model_spec(opt, 32, 2, 0, "LRU", 8, seed=3),
                                  ranges_of(client, "dyn_torch", "t_hash"))
        rng = np.random.default_rng(12)
        ids = universe(rng, 20)
        head = torch.linspace(-1, 1, 8)
        for step in range(12):
            bags = {"f_hash": draw(rng, ids, 5)}
            kt = ebc(ember.KeyedJaggedTensor.from_jagged(bags))
            np.testing.assert_allclose(kt.values().detach().numpy(),
                                       model.lookup(bags["f_hash"]), rtol=2e-5, atol=2e-6)
            values = kt.values()
            ((values * head) ** 2).sum().backward()
            grad = (2 * values.detach() * head ** 2).numpy().astype(np.float32)
            model.update(bags["f_hash"], grad)
        state = ebc.state_dict()
        want_ids, want_rows = model.held()
        np.testing.assert_array_equal(state["embedding_bags.t_hash.ids"].numpy(), want_ids)
        np.testing.assert_allclose(state["embedding_bags.t_hash.weight"].numpy(), want_rows,
                                   rtol=2e-5, atol=2e-6)
        other.load_state_dict(state)
        got = client.export_table("dyn_torch2", "t_hash")
        np.testing.assert_array_equal(got[0], state["embedding_bags.t_hash.ids"].numpy())
        np.testing.assert_array_equal(got[1], state["embedding_bags.t_hash.weight"].numpy())
        with pytest.raises(RuntimeError, match="ids"):
            other.load_state_dict({"embedding_bags.t_hash.weight": state[
                "embedding_bags.t_hash.weight"]})
    finally:
        client.drop_collection("dyn_torch")
        client.drop_collection("dyn_torch2")


def test_the_dlrm_example_trains_on_hashed_ids(client):
    """examples/train_dlrm.py --hashed_ids (64-bit hashed ids, dynamic
    tables) reaches the AUC the fixed tables reach on the same data (the
    initial rows differ: by id hash instead of by row)."""
    import os
    import re
    import subprocess
    import sys
    pytest.importorskip("torch")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    script = os.path.join(root, "examples", "train_dlrm.py")
    if not os.path.exists(script):
        pytest.skip("examples/train_dlrm.py is not beside the tests")
    aucs = {}
    for flag in ("", "--hashed_ids"):
        out = subprocess.run([sys.executable, script, "--steps=120", "--batch=128",
                              f"--coordinator={client.address}", "--min_auc=0.6",
                              "--log_every=60"] + ([flag] if flag else []),
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        aucs[flag] = float(re.search(r"AUC after training ([0-9.]+)", out.stdout).group(1))
    assert aucs["--hashed_ids"] > 0.7 and abs(aucs["--hashed_ids"] - aucs[""]) < 0.03, aucs


def test_emberctl_export_writes_a_dynamic_tables_ids_beside_its_rows(client, tmp_path):
    import subprocess
    opt = {"type": "SGD", "learning_rate": 0.5}
    name = "dyn_cli"
    client.create_collection({"name": name, "tables": [
        dynamic_table("t", "f", "SUM", 4, opt, 16)]}, sharding_type="row_wise")
    try:
        kjt = ember.KeyedJaggedTensor.from_jagged({"f": [[INT64_MIN, 5], [-9, 1 << 50]]})
        client.apply_gradients(name, kjt, np.ones((2, 4), np.float32))
        out = tmp_path / "t.npy"
        run = subprocess.run([ember._find_emberctl(), "export", f"--coordinator={client.address}",
                              f"--collection={name}", "--table=t", f"--output={out}"],
                             capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "exported dynamic table t: 4 rows of 4" in run.stdout
        ids, rows = client.export_table(name, "t")
        np.testing.assert_array_equal(np.load(tmp_path / "t.ids.npy"), ids)
        np.testing.assert_array_equal(np.load(out), rows)
        assert list(ids) == sorted([INT64_MIN, 5, -9, 1 << 50])
        status = subprocess.run([ember._find_emberctl(), "status",
                                 f"--coordinator={client.address}"],
                                capture_output=True, text=True, timeout=60)
        assert "dynamic: capacity 16, admit after 1 update(s), LRU" in status.stdout, status.stdout
    finally:
        client.drop_collection(name)
