"""The Python SDK against a real local cluster (ember.LocalCluster), checked
against NumPy references computed from the exported tables."""

import json
import threading

import numpy as np
import pytest

import ember

SPEC = {
    "name": "py",
    "tables": [
        {"name": "t_sum", "num_embeddings": 101, "embedding_dim": 8, "feature_names": ["f_sum"],
         "pooling": "SUM", "optimizer": {"type": "SGD", "learning_rate": 0.5}},
        {"name": "t_mean", "num_embeddings": 57, "embedding_dim": 4, "feature_names": ["f_mean"],
         "pooling": "MEAN", "optimizer": {"type": "ADAGRAD", "learning_rate": 0.1}},
        {"name": "t_seq", "num_embeddings": 30, "embedding_dim": 4, "feature_names": ["f_seq"],
         "pooling": "NONE"},
    ],
}
TYPES = ["table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    # Checkpoints lie under the servers' root: each test's tmp_path is in it.
    root = tmp_path_factory.getbasetemp()
    with ember.LocalCluster(workers=2, extra_flags=[f"--checkpoint_dir={root}"]) as cluster:
        yield ember.Client(cluster.address, timeout_s=20)


def spec(name):
    return dict(SPEC, name=name)


def random_bags(rng, rows, batch):
    return [list(rng.integers(0, rows, size=rng.integers(0, 5))) for _ in range(batch)]


def pooled_reference(table, bags, weights=None, mean=False):
    out = np.zeros((len(bags), table.shape[1]), dtype=np.float64)
    for b, bag in enumerate(bags):
        for i, row in enumerate(bag):
            out[b] += table[row] * (1.0 if weights is None else weights[b][i])
        if mean and bag:
            out[b] /= len(bag)
    return out


@pytest.mark.parametrize("sharding_type", TYPES)
def test_lookups_and_an_sgd_step_match_numpy(client, sharding_type):
    name = "py_" + sharding_type
    info = client.create_collection(spec(name), sharding_type=sharding_type)
    assert {t["sharding_type"] for t in info["plan"]["tables"]} == {sharding_type}
    rng = np.random.default_rng(7)
    try:
        before = {t: client.export_table(name, t) for t in ("t_sum", "t_mean", "t_seq")}
        sum_bags, mean_bags = random_bags(rng, 101, 6), random_bags(rng, 57, 6)
        weights = [list(rng.uniform(0.5, 1.5, size=len(b))) for b in sum_bags]
        # Keys in another order than the collection's: the output follows the collection.
        kjt = ember.KeyedJaggedTensor.from_jagged({"f_mean": mean_bags, "f_sum": sum_bags},
                                                  {"f_mean": [[1.0] * len(b) for b in mean_bags],
                                                   "f_sum": weights})
        kt = client.lookup(name, kjt)
        assert kt.keys == ["f_sum", "f_mean"] and kt.length_per_key == [8, 4]
        np.testing.assert_allclose(kt["f_sum"], pooled_reference(before["t_sum"], sum_bags, weights),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(kt["f_mean"],
                                   pooled_reference(before["t_mean"], mean_bags, mean=True),
                                   rtol=1e-5, atol=1e-6)
        seq_bags = random_bags(rng, 30, 3)
        seq = client.lookup_sequence(name, ember.KeyedJaggedTensor.from_jagged({"f_seq": seq_bags}))
        ids = [i for bag in seq_bags for i in bag]
        np.testing.assert_allclose(seq["f_seq"], before["t_seq"][ids].reshape(-1, 4), rtol=1e-6)
        # A sequence gradient step (t_seq names no optimizer: SGD at the default lr 0.01):
        # each id's row moves by its own gradient row, duplicates summed.
        seq_kjt = ember.KeyedJaggedTensor.from_jagged({"f_seq": seq_bags})
        seq_grad = rng.uniform(-1, 1, size=(len(ids), 4)).astype(np.float32)
        assert client.apply_sequence_gradients(name, seq_kjt, {"f_seq": seq_grad})
        want_seq = before["t_seq"].astype(np.float64).copy()
        for i, row in enumerate(ids):
            want_seq[row] -= 0.01 * seq_grad[i]
        np.testing.assert_allclose(client.export_table(name, "t_seq"), want_seq, rtol=1e-5,
                                   atol=1e-6)
        with pytest.raises(ember.InvalidArgument):  # wrong block shape: nothing applied
            client.apply_sequence_gradients(name, seq_kjt, {"f_seq": seq_grad[:, :2].copy()})
        np.testing.assert_allclose(client.export_table(name, "t_seq"), want_seq, rtol=1e-5,
                                   atol=1e-6)

        # One SGD step on t_sum (lr 0.5): w[row] -= 0.5 * sum(weight * grad of its bag).
        grads = ember.KeyedTensor(kt.keys, kt.length_per_key,
                                  rng.uniform(-1, 1, size=kt.values.shape).astype(np.float32))
        request_id = client.apply_gradients(name, kjt, grads)
        assert request_id
        want = before["t_sum"].astype(np.float64).copy()
        for b, bag in enumerate(sum_bags):
            for i, row in enumerate(bag):
                want[row] -= 0.5 * weights[b][i] * grads["f_sum"][b]
        np.testing.assert_allclose(client.export_table(name, "t_sum"), want, rtol=1e-5, atol=1e-6)
        # Applied once under its id, however often it is retried.
        assert client.apply_gradients(name, kjt, grads, request_id=request_id) == request_id
        np.testing.assert_allclose(client.export_table(name, "t_sum"), want, rtol=1e-5, atol=1e-6)
    finally:
        client.drop_collection(name)


def test_bad_input_raises_the_right_error_and_changes_nothing(client):
    client.create_collection(spec("bad"), sharding_type="row_wise")
    try:
        table = client.export_table("bad", "t_sum")
        good = ember.KeyedJaggedTensor(["f_sum"], [2], [1, 2])
        kt = client.lookup("bad", good)
        cases = [
            (ember.NotFound, lambda: client.lookup("nope", good)),
            (ember.NotFound, lambda: client.export_table("bad", "t_nope")),
            (ember.InvalidArgument,  # lengths sum to 3, two ids
             lambda: client.lookup("bad", ember.KeyedJaggedTensor(["f_sum"], [3], [1, 2]))),
            (ember.InvalidArgument,  # id past the table
             lambda: client.lookup("bad", ember.KeyedJaggedTensor(["f_sum"], [1], [101]))),
            (ember.InvalidArgument,  # lengths overflowing int64 to the id count
             lambda: client.lookup("bad", ember.KeyedJaggedTensor(
                 ["f_sum"], [2**63 - 1, 2**63 - 1, 4], [1, 2]))),
            (ember.InvalidArgument, lambda: client.apply_gradients(
                "bad", good, ember.KeyedTensor(kt.keys, kt.length_per_key,
                                               np.full(kt.values.shape, np.nan, np.float32)))),
            (ember.InvalidArgument, lambda: client.apply_gradients(  # wrong width
                "bad", good, ember.KeyedTensor(kt.keys, [4], np.ones((1, 4), np.float32)))),
            (ember.AlreadyExists, lambda: client.create_collection(spec("bad"))),
            (ember.InvalidArgument, lambda: client.create_collection({"name": "x", "tables": []})),
            (ember.InvalidArgument, lambda: client.create_collection({"name": "x", "nope": 1})),
            (ember.InvalidArgument, lambda: client.create_collection(spec("a/b"))),
        ]
        for error, call in cases:
            with pytest.raises(error) as raised:
                call()
            assert isinstance(raised.value, ember.EmberError)
            assert raised.value.code == {ember.NotFound: 5, ember.InvalidArgument: 3,
                                         ember.AlreadyExists: 6}[error]
        np.testing.assert_array_equal(client.export_table("bad", "t_sum"), table)
    finally:
        client.drop_collection("bad")
    with pytest.raises(ember.NotFound):
        client.collection("bad")


def test_ids_must_be_integers_and_fit_int64():
    """Float ids were truncated (5.7 -> 5) and applied; uint64 ids past 2^63 - 1
    wrapped to negative ones."""
    for values in ([5.7], np.array([1.0, 2.0]), [True], ["3"],
                   np.array([2**63], dtype=np.uint64), [2**70]):
        with pytest.raises(ember.InvalidArgument):
            ember.KeyedJaggedTensor(["f_sum"], [len(np.atleast_1d(values))], values)
    with pytest.raises(ember.InvalidArgument):
        ember.KeyedJaggedTensor(["f_sum"], [1.5], [1])
    ok = ember.KeyedJaggedTensor(["f_sum"], np.array([2], np.uint32),
                                 np.array([3, 2**63 - 1], np.uint64))
    assert ok.values.dtype == np.int64 and ok.values.tolist() == [3, 2**63 - 1]
    assert ember.KeyedJaggedTensor(["f_sum"], [0], []).values.dtype == np.int64


def test_gradients_as_arrays_and_request_ids_name_one_update(client):
    """A [B, sum dims] array (NumPy or torch) is lookup's layout; a request id
    reused for another update is refused with nothing applied (it returned
    success and applied nothing); an unchanged retry is still a duplicate."""
    client.create_collection(spec("grads"), sharding_type="row_wise")
    try:
        kjt = ember.KeyedJaggedTensor(["f_sum", "f_mean"], [2, 1, 1, 1], [1, 2, 3, 4, 5])
        kt = client.lookup("grads", kjt)
        before = client.export_table("grads", "t_sum")
        g = np.full(kt.values.shape, 0.25, np.float32)
        client.apply_gradients("grads", kjt, g, request_id="step-1")
        after = client.export_table("grads", "t_sum")
        want = before.astype(np.float64).copy()
        for row, bag in ((1, 0), (2, 0), (3, 1)):  # lr 0.5, f_sum's columns [0, 8)
            want[row] -= 0.5 * g[bag, :8]
        np.testing.assert_allclose(after, want, rtol=1e-6, atol=1e-7)
        # The same id and content: a duplicate, applied once.
        client.apply_gradients("grads", kjt, g.copy(), request_id="step-1")
        np.testing.assert_array_equal(client.export_table("grads", "t_sum"), after)
        # The same id, other gradients: refused, nothing applied.
        with pytest.raises(ember.InvalidArgument, match="step-1"):
            client.apply_gradients("grads", kjt, g * 2, request_id="step-1")
        with pytest.raises(ember.InvalidArgument):
            client.apply_gradients("grads", ember.KeyedJaggedTensor(
                ["f_sum", "f_mean"], [2, 1, 1, 1], [1, 9, 3, 4, 5]), g, request_id="step-1")
        np.testing.assert_array_equal(client.export_table("grads", "t_sum"), after)
        torch = pytest.importorskip("torch")
        client.apply_gradients("grads", kjt, torch.from_numpy(g.copy()), request_id="step-2")
        assert not np.array_equal(client.export_table("grads", "t_sum"), after)
        for bad in (g[0], "grads", np.zeros((2, 3), np.float32), np.array([["a"] * 12] * 2)):
            with pytest.raises(ember.InvalidArgument):
                client.apply_gradients("grads", kjt, bad)
    finally:
        client.drop_collection("grads")


def test_first_calls_from_many_threads_at_once(tmp_path):
    """Two threads making their first calls at once once hung the process
    (pybind11's one-time NumPy API lookup raced); a fresh interpreter runs
    eight at once, bounded in time."""
    script = tmp_path / "threads.py"
    script.write_text(
        "import sys, threading\n"
        "import numpy as np\n"
        "import ember\n"
        "with ember.LocalCluster(workers=1) as cluster:\n"
        "    c = ember.Client(cluster.address, timeout_s=20)\n"
        "    c.create_collection(dict(SPEC, name='t'))\n"
        "    errors = []\n"
        "    def work():\n"
        "        try:\n"
        "            kjt = ember.KeyedJaggedTensor(['f_sum'], [1], [1])\n"
        "            c.lookup('t', kjt)\n"
        "        except Exception as e:\n"
        "            errors.append(e)\n"
        "    ts = [threading.Thread(target=work) for _ in range(8)]\n"
        "    [t.start() for t in ts]\n"
        "    [t.join() for t in ts]\n"
        "    sys.exit(1 if errors else 0)\n".replace("SPEC", repr(SPEC)))
    import subprocess
    import sys
    done = subprocess.run([sys.executable, str(script)], timeout=120)
    assert done.returncode == 0


def test_torchrec_style_kjt_is_accepted(client):
    class FakeTorchrecKjt:  # the methods ember reads from a torchrec.KeyedJaggedTensor
        def keys(self):
            return ["f_sum"]

        def lengths(self):
            return np.array([1, 2])

        def values(self):
            return np.array([5, 6, 7])

        def weights_or_none(self):
            return None

    client.create_collection(spec("tr"), sharding_type="table_wise")
    try:
        kt = client.lookup("tr", FakeTorchrecKjt())
        table = client.export_table("tr", "t_sum")
        np.testing.assert_allclose(kt["f_sum"], [table[5], table[6] + table[7]], rtol=1e-6)
        with pytest.raises(TypeError):
            client.lookup("tr", [1, 2, 3])
    finally:
        client.drop_collection("tr")


def test_calls_from_threads_run_side_by_side(client):
    client.create_collection(spec("th"), sharding_type="row_wise")
    try:
        kjt = ember.KeyedJaggedTensor(["f_sum"], [3] * 64, np.arange(192) % 101)
        want = client.lookup("th", kjt).values
        errors = []

        def work():
            try:
                for _ in range(20):
                    np.testing.assert_array_equal(client.lookup("th", kjt).values, want)
            except Exception as e:  # noqa: BLE001  (reported below)
                errors.append(e)

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
    finally:
        client.drop_collection("th")


def test_checkpoint_and_restore(client, tmp_path):
    client.create_collection(spec("ck"), sharding_type="row_wise")
    try:
        ck = client.checkpoint("ck", str(tmp_path))
        assert ck["path"].startswith(str(tmp_path)) and int(ck["bytes"]) > 0
        restored = client.restore(str(tmp_path), "ck2", sharding_type="column_wise")
        assert restored["collection"]["spec"]["name"] == "ck2"
        for t in ("t_sum", "t_mean", "t_seq"):
            np.testing.assert_array_equal(client.export_table("ck2", t), client.export_table("ck", t))
        client.drop_collection("ck2")
        with pytest.raises(ember.NotFound):
            client.restore(str(tmp_path / "nothing-here"))
        seen = []
        ck2 = client.checkpoint("ck", str(tmp_path), progress=lambda d, t: seen.append((d, t)),
                                poll_s=0.01)
        assert seen and seen[-1] == (int(ck2["bytes"]), int(ck2["bytes"]))
        assert all(d <= t for d, t in seen[:-1] if t)
        assert [d for d, _ in seen] == sorted(d for d, _ in seen)
        listed = client.list_checkpoints("ck")
        assert [c["path"] for c in listed][-1] == ck2["path"]
        assert all(c["collection"] == "ck" for c in listed)
        assert ck["path"] in [c["path"] for c in client.list_checkpoints()]
        assert client.list_checkpoints("no_such_collection") == []
        assert client.list_restores() == []  # none under way
    finally:
        client.drop_collection("ck")


def test_restore_reports_progress(client, tmp_path, capsys):
    """A restore large enough to watch (100 MB): the coordinator shows it
    under way (bytes verified, then loading), the callable hears it in that
    order, and progress=True writes it to stderr."""
    big = {"name": "ckbig", "tables": [{"name": "wide", "num_embeddings": 400_000,
                                        "embedding_dim": 64, "feature_names": ["w"]}]}
    client.create_collection(big)
    try:
        ck = client.checkpoint("ckbig", str(tmp_path))
        seen = []
        restored = client.restore(ck["path"], "ckbig2",
                                  progress=lambda d, t, phase: seen.append((d, t, phase)),
                                  poll_s=0.005)
        total = int(restored["checkpoint"]["bytes"])
        assert total == int(ck["bytes"]) > 100e6 * 0.9
        assert seen[-1] == (total, total, "done")
        assert len(seen) > 1, "no progress was reported while the restore ran"
        order = {"verifying": 0, "loading": 1, "done": 2}
        assert [order[p] for _, _, p in seen] == sorted(order[p] for _, _, p in seen)
        assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)
        assert all(t in (0, total) and d <= total for d, t, _ in seen)
        np.testing.assert_array_equal(client.export_table("ckbig2", "wide")[::997],
                                      client.export_table("ckbig", "wide")[::997])
        client.drop_collection("ckbig2")
        capsys.readouterr()
        client.restore(ck["path"], "ckbig2", progress=True, poll_s=0.005)
        err = capsys.readouterr().err
        assert "restore ckbig2: " in err and "MiB verified" in err, err
        assert err.strip().splitlines()[-1].startswith("restore ckbig2: restored ("), err
        assert client.list_restores() == []
    finally:
        for name in ("ckbig", "ckbig2"):
            try:
                client.drop_collection(name)
            except ember.NotFound:
                pass


def test_optimizer_values_given_are_kept_and_defaults_shown(client):
    tables = [
        {"name": "frozen", "num_embeddings": 10, "embedding_dim": 4, "feature_names": ["a"],
         "optimizer": {"type": "SGD", "learning_rate": 0}},
        {"name": "defaults", "num_embeddings": 10, "embedding_dim": 4, "feature_names": ["b"],
         "optimizer": {"type": "ADAGRAD"}},
    ]
    info = client.create_collection({"name": "opt_defaults", "tables": tables})
    try:
        opts = {t["name"]: t["optimizer"] for t in info["spec"]["tables"]}
        assert opts["frozen"]["learning_rate"] == 0  # given: kept, shown
        assert (opts["defaults"]["learning_rate"], opts["defaults"]["eps"],
                opts["defaults"]["beta1"], opts["defaults"]["beta2"]) == (0.01, 1e-8, 0.9, 0.999)
        assert client.collection("opt_defaults")["spec"] == info["spec"]
        before = {t: client.export_table("opt_defaults", t) for t in ("frozen", "defaults")}
        kjt = ember.KeyedJaggedTensor(["a", "b"], [2, 1], [1, 2, 3])
        client.apply_gradients("opt_defaults", kjt, np.ones((1, 8), np.float32))
        np.testing.assert_array_equal(client.export_table("opt_defaults", "frozen"),
                                      before["frozen"])  # learning rate 0: frozen
        after = client.export_table("opt_defaults", "defaults")
        # Adagrad's first step at lr 0.01: every touched element moves by
        # lr * g / (sqrt(g^2) + eps) = 0.01 (to float32 precision).
        np.testing.assert_allclose(before["defaults"][3] - after[3], 0.01, rtol=1e-5)
        with pytest.raises(ember.InvalidArgument, match="optimizer.eps must be > 0"):
            client.create_collection({"name": "eps0", "tables": [
                dict(tables[1], optimizer={"type": "ADAGRAD", "eps": 0})]})
    finally:
        client.drop_collection("opt_defaults")


def test_drain_moves_a_workers_shards(tmp_path):
    with ember.LocalCluster(workers=3) as cluster:
        c = ember.Client(cluster.address, timeout_s=30)
        c.create_collection(spec("dr"), sharding_type="row_wise")
        before = {t: c.export_table("dr", t) for t in ("t_sum", "t_mean", "t_seq")}
        worker = c.list_workers()[0]
        victim, address = worker["worker_id"], worker["info"]["address"]
        def holders(info):  # the addresses of the workers holding a shard
            return {info["worker_addresses"][int(s.get("rank", 0))]
                    for t in info["plan"]["tables"] for s in t["shards"]}
        assert address in holders(c.collection("dr"))
        assert c.drain(victim) == ["dr"]
        assert address not in holders(c.collection("dr"))
        for t, rows in before.items():
            np.testing.assert_array_equal(c.export_table("dr", t), rows)
        with pytest.raises(ember.NotFound):
            c.drain("w999")


def test_scale_recuts_and_keeps_every_row(tmp_path):
    with ember.LocalCluster(workers=3) as cluster:
        c = ember.Client(cluster.address, timeout_s=30)
        c.create_collection(spec("sc"), sharding_type="row_wise")
        before = {t: c.export_table("sc", t) for t in ("t_sum", "t_mean", "t_seq")}
        out = c.scale("sc", 2)
        assert out["shards_moved"] > 0
        assert 0 < int(out["bytes_between_workers"]) < int(out["bytes_copied"])
        info = c.collection("sc")
        assert info["state"] == "SERVING"
        assert len({info["worker_addresses"][int(s.get("rank", 0))]
                    for t in info["plan"]["tables"] for s in t["shards"]}) == 2
        for t, rows in before.items():
            np.testing.assert_array_equal(c.export_table("sc", t), rows)
        assert c.scale("sc", 3)["collection"]["plan"]["epoch"] > info["plan"]["epoch"]
        for t, rows in before.items():
            np.testing.assert_array_equal(c.export_table("sc", t), rows)
        assert c.scale("sc", 3)["shards_moved"] == 0  # served from 3 already
        with pytest.raises(ember.FailedPrecondition, match="live worker"):
            c.scale("sc", 4)
        with pytest.raises(ValueError):
            c.scale("sc", 0)
        with pytest.raises(ember.NotFound):
            c.scale("nope", 2)


def test_a_replicated_collection_keeps_two_equal_copies():
    with ember.LocalCluster(workers=2) as cluster:
        c = ember.Client(cluster.address, timeout_s=30)
        with pytest.raises(ember.FailedPrecondition, match="replicas 3 needs at least 3"):
            c.create_collection(dict(spec("rp"), replicas=3), sharding_type="table_wise")
        info = c.create_collection(dict(spec("rp"), replicas=2), sharding_type="table_wise")
        assert info["spec"]["replicas"] == 2
        for t in info["plan"]["tables"]:
            for s in t["shards"]:
                assert [int(b) for b in s["backups"]] == [1 - int(s.get("rank", 0))]
        # An import reaches both copies; lookups, spread over them, agree.
        rng = np.random.default_rng(9)
        new = rng.uniform(-1, 1, size=(101, 8)).astype(np.float32)
        c.import_table("rp", "t_sum", new)
        kjt = ember.KeyedJaggedTensor(["f_sum"], [2, 1], [4, 100, 50])
        for _ in range(4):
            np.testing.assert_allclose(c.lookup("rp", kjt)["f_sum"],
                                       [new[4] + new[100], new[50]], rtol=1e-6)
        # Updates go through the primary to both: still equal everywhere.
        c.apply_gradients("rp", kjt, np.ones((2, 8), np.float32))
        outs = [c.lookup("rp", kjt)["f_sum"] for _ in range(4)]
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])
        assert not np.allclose(outs[0], [new[4] + new[100], new[50]])


@pytest.mark.parametrize("sharding_type", ["row_wise", "column_wise", "data_parallel"])
def test_import_table_replaces_the_weights_everywhere(client, sharding_type):
    name = "imp_" + sharding_type
    client.create_collection(spec(name), sharding_type=sharding_type)
    try:
        rng = np.random.default_rng(3)
        new = rng.uniform(-1, 1, size=(101, 8)).astype(np.float32)
        client.import_table(name, "t_sum", new)
        np.testing.assert_array_equal(client.export_table(name, "t_sum"), new)
        kjt = ember.KeyedJaggedTensor(["f_sum"], [2, 1], [4, 100, 50])
        for _ in range(3):  # every data-parallel replica answers with the new rows
            np.testing.assert_allclose(client.lookup(name, kjt)["f_sum"],
                                       [new[4] + new[100], new[50]], rtol=1e-6)
        with pytest.raises(ember.InvalidArgument):
            client.import_table(name, "t_sum", np.zeros((100, 8), np.float32))
        bad = new.copy()
        bad[7, 3] = np.inf
        with pytest.raises(ember.InvalidArgument):
            client.import_table(name, "t_sum", bad)
        with pytest.raises(ember.NotFound):
            client.import_table(name, "t_nope", new)
        np.testing.assert_array_equal(client.export_table(name, "t_sum"), new)
    finally:
        client.drop_collection(name)


def test_preview_plan_and_workers(client):
    plan = client.preview_plan(spec("pv"), world_size=4, sharding_type="row_wise")
    assert len(plan["tables"]) == 3
    assert len(client.list_workers()) == 2


def test_create_with_a_torchrec_style_plan(client):
    """A plan made elsewhere (TorchRec's ParameterSharding per table, as
    dicts, or torchrec's own objects where torchrec is installed) is checked
    and used: the collection's plan has its shards, lookups match NumPy on
    the exported tables, and a plan that does not tile a table is refused."""
    plan = {
        "t_sum": {"sharding_type": "row_wise", "compute_kernel": "fused", "ranks": [1, 0],
                  "sharding_spec": {"shards": [
                      {"shard_offsets": [0, 0], "shard_sizes": [60, 8], "placement": "rank:1/cpu"},
                      {"shard_offsets": [60, 0], "shard_sizes": [41, 8], "placement": "rank:0/cpu"}]}},
        "t_mean": {"sharding_type": "table_wise", "compute_kernel": "fused", "ranks": [1],
                   "sharding_spec": {"shards": [
                       {"shard_offsets": [0, 0], "shard_sizes": [57, 4], "placement": "rank:1/cpu"}]}},
        "t_seq": {"sharding_type": "data_parallel", "compute_kernel": "dense", "ranks": [0, 1],
                  "sharding_spec": None},
    }
    bad = json.loads(json.dumps(plan))
    bad["t_sum"]["sharding_spec"]["shards"][1]["shard_offsets"] = [59, 0]
    with pytest.raises(ember.InvalidArgument, match="covered by 2 shards"):
        client.create_collection(spec("tr_bad"), plan=bad)
    with pytest.raises(ember.InvalidArgument, match="not both"):
        client.create_collection(spec("tr_both"), sharding_type="row_wise", plan=plan)
    info = client.create_collection(spec("tr_plan"), plan=plan)
    t_sum = next(t for t in info["plan"]["tables"] if t["table"] == "t_sum")
    assert [s["rank"] for s in t_sum["shards"]] == [1, 0]
    rng = np.random.default_rng(5)
    bags = random_bags(rng, 101, 16)
    out = client.lookup("tr_plan", ember.KeyedJaggedTensor.from_jagged({"f_sum": bags}))
    table = client.export_table("tr_plan", "t_sum")
    np.testing.assert_allclose(out.to_dict()["f_sum"], pooled_reference(table, bags), rtol=1e-5,
                               atol=1e-6)
    client.drop_collection("tr_plan")

    try:
        from torch.distributed._shard.metadata import ShardMetadata
        from torch.distributed._shard.sharding_spec import EnumerableShardingSpec
        from torchrec.distributed.types import ParameterSharding
    except ImportError:
        return
    objects = {name: ParameterSharding(
        sharding_type=p["sharding_type"], compute_kernel=p["compute_kernel"], ranks=p["ranks"],
        sharding_spec=None if p["sharding_spec"] is None else EnumerableShardingSpec(
            [ShardMetadata(shard_offsets=s["shard_offsets"], shard_sizes=s["shard_sizes"],
                           placement=s["placement"]) for s in p["sharding_spec"]["shards"]]))
        for name, p in plan.items()}
    info = client.create_collection(spec("tr_objects"), plan=objects)
    t_mean = next(t for t in info["plan"]["tables"] if t["table"] == "t_mean")
    assert t_mean["shards"][0]["rank"] == 1
    client.drop_collection("tr_objects")


def test_local_cluster_stops_everything_when_the_block_raises():
    with pytest.raises(RuntimeError):
        with ember.LocalCluster(workers=1) as cluster:
            address, proc = cluster.address, cluster._proc
            raise RuntimeError("boom")
    assert proc.poll() is not None
    with pytest.raises(ember.Unavailable):
        ember.Client(address, timeout_s=2)


def test_tokens_and_roles(tmp_path):
    """A cluster with --auth_token_file: no token is Unauthenticated, a
    trainer token trains but cannot drop, the admin token does everything."""
    servers = tmp_path / "tokens"
    servers.write_text("worker w0 w0rker-token-py-0123456\ntrainer tr4iner-token-py-0123456\n"
                       "admin adm1n-token-py-0123456\n")
    trainer_file = tmp_path / "trainer"
    trainer_file.write_text("tr4iner-token-py-0123456\n")
    with ember.LocalCluster(workers=1, extra_flags=[f"--auth_token_file={servers}"]) as cluster:
        with pytest.raises(ember.Unauthenticated):
            ember.Client(cluster.address, timeout_s=10)
        admin = ember.Client(cluster.address, timeout_s=10, auth_token="adm1n-token-py-0123456")
        trainer = ember.Client(cluster.address, timeout_s=10, auth_token_file=str(trainer_file))
        with pytest.raises(ember.PermissionDenied):
            trainer.create_collection(spec("auth"), sharding_type="table_wise")
        admin.create_collection(spec("auth"), sharding_type="table_wise")
        kjt = ember.KeyedJaggedTensor.from_jagged({"f_sum": [[1, 2], [3]]})
        assert trainer.lookup("auth", kjt).values.shape == (2, 8)
        with pytest.raises(ember.PermissionDenied):
            trainer.drop_collection("auth")
        admin.drop_collection("auth")


def test_transports_give_the_same_answers(tmp_path):
    """Inline, POSIX shared memory, a shared directory (--shm_dir, as pods
    of one node sharing a volume) and socket link channels (--links=socket:
    the NCCL channel's protocol on the CPU) look up and train alike; the directory's
    channels are open on the workers and leave no file behind. A shm_dir
    that is not a directory is refused when connecting."""
    shm = tmp_path / "shm"
    shm.mkdir()
    with ember.LocalCluster(workers=2,
                            extra_flags=[f"--shm_dir={shm}", "--links=socket"]) as cluster:
        clients = {
            "inline": ember.Client(cluster.address, timeout_s=20, shared_memory=False),
            "shm": ember.Client(cluster.address, timeout_s=20),
            "dir": ember.Client(cluster.address, timeout_s=20, shm_dir=str(shm)),
            "link": ember.Client(cluster.address, timeout_s=20, link="socket"),
        }
        clients["inline"].create_collection(spec("transports"), sharding_type="row_wise")
        rng = np.random.default_rng(3)
        kjt = ember.KeyedJaggedTensor.from_jagged(
            {"f_sum": random_bags(rng, 101, 16), "f_mean": random_bags(rng, 57, 16)})
        outs = {k: c.lookup("transports", kjt).values for k, c in clients.items()}
        np.testing.assert_array_equal(outs["shm"], outs["inline"])
        np.testing.assert_array_equal(outs["dir"], outs["inline"])
        np.testing.assert_array_equal(outs["link"], outs["inline"])
        links = sum(int(clients["inline"].worker_status(w["info"]["address"]).get("link_lookups", 0))
                    for w in clients["inline"].list_workers())
        assert links >= 2  # through the link channels, not inline
        kt = clients["dir"].lookup("transports", kjt)
        grads = ember.KeyedTensor(kt.keys, kt.length_per_key, np.full_like(kt.values, 0.25))
        clients["dir"].apply_gradients("transports", kjt, grads)
        after = clients["inline"].lookup("transports", kjt).values
        assert not np.array_equal(after, outs["inline"])  # the update landed
        with open("/proc/self/maps") as maps:
            mapped = maps.read()
        assert f"{shm}/ember-" in mapped  # the directory's channels are in use here
        assert "memfd:ember-channel" in mapped  # and the same-host ones (memfds)
        assert "/dev/shm/ember-" not in mapped  # nothing named in /dev/shm
        assert list(shm.iterdir()) == []  # names unlinked once both sides mapped them
        with pytest.raises(ember.InvalidArgument):
            ember.Client(cluster.address, timeout_s=5, shm_dir=str(tmp_path / "missing"))
        with pytest.raises(ember.InvalidArgument):
            ember.Client(cluster.address, timeout_s=5, link="pigeon")
        # Outputs of 256 KiB and more come back written straight into the
        # KeyedTensor's buffer by the workers (same host), whole and right;
        # the inline client's are copied. (Table-wise: a row-wise table's
        # partial sums are always copied.)
        clients["inline"].create_collection(spec("placed"), sharding_type="table_wise")
        big = ember.KeyedJaggedTensor.from_jagged(
            {"f_sum": random_bags(rng, 101, 8192), "f_mean": random_bags(rng, 57, 8192)})
        addresses = [w["info"]["address"] for w in clients["inline"].list_workers()]

        def placed():
            return sum(int(clients["inline"].worker_status(a)["placed_lookups"])
                       for a in addresses)

        before = placed()
        want = clients["inline"].lookup("placed", big).values
        assert placed() == before
        got = clients["shm"].lookup("placed", big).values
        np.testing.assert_array_equal(got, want)
        assert want.nbytes >= 256 << 10
        assert placed() > before
