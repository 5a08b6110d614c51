"""The key_value kernel through the Python SDK (`emberctl up --ssd_dir`): a
table planned on it keeps its rows in files under the workers' SSD
directory with 5% of them in memory, trains exactly as a NumPy model of the
table (SGD, SUM pooling), and its workers' metrics show rows leaving memory
and coming back from the files. An update naming more distinct rows of a
shard than its cache holds, and a lookup of as many, run in pieces."""

from collections import OrderedDict

import numpy as np
import pytest

import ember
from test_metrics import free_ports, get

ROWS, DIM, LR = 2000, 16, 0.1


def metric(urls, name, labels=""):
    return sum(float(line.rsplit(" ", 1)[1]) for url in urls for line in get(url).splitlines()
               if line.startswith(name + "{") and 'collection="kv"' in line and labels in line)


CURVE = [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0]


def lru_curve(seq, rows):
    """Hit rates of plain LRU caches of ceil(f * rows) rows, one per
    fraction f of CURVE, over one shard's access sequence."""
    rates = []
    for f in CURVE:
        cap, cache, hits = int(np.ceil(f * rows)), OrderedDict(), 0
        for r in seq:
            if r in cache:
                cache.move_to_end(r)
                hits += 1
            else:
                cache[r] = True
                if len(cache) > cap:
                    cache.popitem(last=False)
        rates.append(hits / len(seq))
    return rates


def test_key_value_trains_as_numpy_and_reports_its_tier(tmp_path):
    base = free_ports(3)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    # A cache of 5% (no floor: the default caches at least 65,536 rows).
    flags = [f"--ssd_dir={ssd}", "--ssd_gib=0.5", f"--metrics_port={base}",
             "--key_value_min_cache_rows=1"]
    with ember.LocalCluster(workers=2, extra_flags=flags) as cluster:
        client = ember.Client(cluster.address, timeout_s=20)
        info = client.create_collection({
            "name": "kv",
            "tables": [{"name": "t", "num_embeddings": ROWS, "embedding_dim": DIM,
                        "feature_names": ["f"],
                        "optimizer": {"type": "SGD", "learning_rate": LR},
                        "initializer": {"type": "UNIFORM", "low": -1, "high": 1, "seed": 3}}],
            "constraints": {"t": {"compute_kernels": ["key_value"], "cache_load_factor": 0.05}},
        }, sharding_type="row_wise")
        plan = info["plan"]["tables"][0]
        assert plan["compute_kernel"] == "key_value"
        assert plan["cache_load_factor"] == pytest.approx(0.05)

        table = client.export_table("kv", "t").copy()  # the model starts from the same rows
        rng = np.random.default_rng(7)
        seen = [[], []]  # each row-wise shard's accesses: a call's distinct rows, in order
        for step in range(40):
            # Skewed ids: low rows far more often (8 bags of 3; at most 24
            # distinct rows a call, under each shard's 50 cached rows).
            bags = [list((ROWS * rng.random(3) ** 3).astype(np.int64)) for _ in range(8)]
            for _ in ("lookup", "update"):
                for shard in (0, 1):
                    mine = [int(r) for b in bags for r in b if r // (ROWS // 2) == shard]
                    seen[shard] += list(dict.fromkeys(mine))
            kjt = ember.KeyedJaggedTensor.from_jagged({"f": bags})
            out = client.lookup("kv", kjt)
            want = np.stack([table[b].sum(axis=0) for b in bags])
            np.testing.assert_allclose(np.asarray(out.values).reshape(8, DIM), want,
                                       rtol=1e-5, atol=1e-6)
            grads = rng.standard_normal((8, DIM)).astype(np.float32)
            client.apply_gradients("kv", kjt, grads)
            for b, g in zip(bags, grads):
                for row in b:
                    table[row] -= LR * g
        np.testing.assert_allclose(client.export_table("kv", "t"), table, rtol=1e-5, atol=1e-5)

        # Each row-wise shard of 1,000 rows caches 50 and keeps all 1,000
        # in its file (16 fp32 weights, no optimizer state: 64 bytes, padded to
        # a 512-byte sector for direct I/O), which has half again as many
        # records as rows (a log of row versions).
        workers = [u for k, u in cluster.metrics_urls.items() if k != "coordinator"]
        assert metric(workers, "ember_worker_key_value_cache_rows") == 100
        assert metric(workers, "ember_worker_key_value_file_bytes") == ROWS * 3 // 2 * 512
        assert metric(workers, "ember_worker_key_value_write_backs_total") > 0
        assert metric(workers, "ember_worker_key_value_disk_reads_total") > 0
        fills = metric(workers, "ember_worker_key_value_fills_total")
        assert fills > 100  # rows came in again after leaving
        # The hit-rate curve the workers learned (every row of a 1,000-row
        # shard sampled: exact) against LRU caches simulated here. Each
        # worker holds one shard and reports its rate; metric() sums them.
        want = np.add(lru_curve(seen[0], ROWS // 2), lru_curve(seen[1], ROWS // 2))
        got = [metric(workers, "ember_worker_key_value_lru_hit_rate",
                      f'cache_fraction="{f:g}"') for f in CURVE]
        np.testing.assert_allclose(got, want, rtol=1e-4)
        assert got[0] < got[-1]

        # 60 distinct rows of one shard in one update, in one bag: more than
        # its cache, so it runs in pieces of rows, as one step.
        wide = ember.KeyedJaggedTensor.from_jagged({"f": [list(range(60))]})
        g = rng.standard_normal((1, DIM)).astype(np.float32)
        client.apply_gradients("kv", wide, g)
        table[:60] -= LR * g[0]
        np.testing.assert_allclose(client.export_table("kv", "t"), table, rtol=1e-5, atol=1e-5)
        # A lookup of as many rows runs in pieces (bags of 3, 120 distinct
        # rows of each shard).
        bags = [list(range(i, i + 3)) for i in range(0, 720, 3)]
        out = client.lookup("kv", ember.KeyedJaggedTensor.from_jagged({"f": bags}))
        np.testing.assert_allclose(np.asarray(out.values).reshape(len(bags), DIM),
                                   np.stack([table[b].sum(axis=0) for b in bags]),
                                   rtol=1e-5, atol=1e-5)


def test_a_dynamic_table_on_key_value_trains_as_the_model_and_restores_rehashed(tmp_path):
    """A dynamic (hash-keyed) table on the key_value kernel: its ids, admission
    and eviction in memory, its rows in the workers' files under a cache of
    a quarter of each shard. It trains as the NumPy model of the dynamic
    rules (dynamic_model.py: admission on the second update, LRU eviction
    past capacity, Adagrad), and rows leave the cache and come back from
    the files. Its checkpoint restores onto 1 worker (the two shards' ids
    re-hashed into one shard of the whole capacity) holding the same ids
    and rows, and trains on there bit for bit as the same table held in
    memory (fused) restored the same way."""
    from dynamic_model import DynamicTableModel
    from test_dynamic import model_spec, ranges_of, universe

    base = free_ports(3)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    opt = {"type": "ADAGRAD", "learning_rate": 0.2, "initial_accumulator_value": 0.1}
    cap, dim = 40, 8
    flags = [f"--ssd_dir={ssd}", "--ssd_gib=0.5", f"--metrics_port={base}",
             "--key_value_min_cache_rows=1", f"--checkpoint_dir={tmp_path}"]
    table = {"name": "t", "num_embeddings": 0, "embedding_dim": dim, "feature_names": ["f"],
             "optimizer": opt, "initializer": {"seed": 9},
             "dynamic": {"capacity": cap, "admit_after": 2, "eviction": "LRU"}}
    kv_spec = {"name": "kv", "tables": [table],
               "constraints": {"t": {"compute_kernels": ["key_value"], "cache_load_factor": 0.25}}}
    ref_spec = {"name": "ref", "tables": [table]}  # held in memory
    rng = np.random.default_rng(5)
    ids = universe(rng, 120)  # three times the capacity: rows are evicted

    def bag():  # half the ids from a hot 8, half from all 120
        return [int(ids[rng.integers(8)] if rng.random() < 0.5 else ids[rng.integers(len(ids))])
                for _ in range(int(rng.integers(0, 5)))]

    batches = [([bag() for _ in range(6)], rng.normal(size=(6, dim)).astype(np.float32))
               for _ in range(40)]

    def train(client, part, model=None):
        for bags, grad in part:
            kjt = ember.KeyedJaggedTensor.from_jagged({"f": bags})
            got = client.lookup("kv", kjt)["f"]
            np.testing.assert_array_equal(got, client.lookup("ref", kjt)["f"])
            if model is not None:
                np.testing.assert_allclose(got, model.lookup(bags), rtol=2e-5, atol=2e-6)
                model.update(bags, grad)
            client.apply_gradients("kv", kjt, grad)
            client.apply_gradients("ref", kjt, grad)

    def same(client):
        kv, ref = client.export_table("kv", "t"), client.export_table("ref", "t")
        np.testing.assert_array_equal(kv[0], ref[0])
        np.testing.assert_array_equal(kv[1], ref[1])
        return kv

    with ember.LocalCluster(workers=2, extra_flags=flags) as a:
        ca = ember.Client(a.address, timeout_s=30)
        info = ca.create_collection(kv_spec, sharding_type="row_wise")
        assert info["plan"]["tables"][0]["compute_kernel"] == "key_value"
        info = ca.create_collection(ref_spec, sharding_type="row_wise")
        assert info["plan"]["tables"][0]["compute_kernel"] == "fused"
        model = DynamicTableModel(model_spec(opt, cap, 2, 0, "LRU", dim, seed=9),
                                  ranges_of(ca, "kv", "t"))
        train(ca, batches[:30], model)
        got_ids, got_rows = same(ca)
        want_ids, want_rows = model.held()
        np.testing.assert_array_equal(got_ids, want_ids)
        np.testing.assert_allclose(got_rows, want_rows, rtol=2e-5, atol=2e-6)
        assert sum(s.evicted["lru"] for s in model.shards) > 0  # shards filled, rows left

        # Each shard of 20 slots (and its zero slot) caches 5 rows; the rest
        # live in its file, and rows left the cache and came back.
        workers = [u for k, u in a.metrics_urls.items() if k != "coordinator"]
        assert metric(workers, "ember_worker_key_value_cache_rows") == 10
        assert metric(workers, "ember_worker_key_value_disk_reads_total") > 0
        assert metric(workers, "ember_worker_key_value_write_backs_total") > 0
        assert metric(workers, "ember_worker_dynamic_rows") == len(want_ids)
        assert metric(workers, "ember_worker_dynamic_evicted_total") > 0

        # A prefetch of held ids and never-seen ones, routed as a lookup is:
        # the held ids' rows come in (at most each shard's 5, all of them
        # when repeated), the unknown ids are skipped and not counted toward
        # admission, and no row changes; the lookup after it fills nothing.
        held = [int(i) for i in want_ids[:4]]
        unknown = [int(i) for i in ids if int(i) not in set(int(x) for x in want_ids)][:3]
        pending = metric(workers, "ember_worker_dynamic_pending_ids")
        kjt = ember.KeyedJaggedTensor.from_jagged({"f": [held + unknown, held]})
        assert 0 <= ca.prefetch("kv", kjt) <= len(held)
        assert ca.prefetch("kv", kjt) == 0  # all in now
        assert metric(workers, "ember_worker_dynamic_pending_ids") == pending
        fills = metric(workers, "ember_worker_key_value_fills_total")
        np.testing.assert_array_equal(ca.lookup("kv", kjt)["f"], ca.lookup("ref", kjt)["f"])
        assert metric(workers, "ember_worker_key_value_fills_total") == fills
        same(ca)
        checkpoints = {n: ca.checkpoint(n, str(tmp_path / n))["path"] for n in ("kv", "ref")}
    with ember.LocalCluster(workers=1, extra_flags=flags) as b:
        cb = ember.Client(b.address, timeout_s=30)
        for n, path in checkpoints.items():
            cb.restore(path, n, sharding_type="row_wise")
        assert cb.plan("kv")["tables"][0]["compute_kernel"] == "key_value"
        restored = same(cb)
        np.testing.assert_array_equal(restored[0], got_ids)
        np.testing.assert_array_equal(restored[1], got_rows)
        train(cb, batches[30:])
        same(cb)


def collection_metric(urls, name, collection):
    return sum(float(line.rsplit(" ", 1)[1]) for url in urls for line in get(url).splitlines()
               if line.startswith(name + "{") and f'collection="{collection}"' in line)


def test_prefetch_brings_a_batch_in_and_the_prefetch_pipeline_is_not_stale(tmp_path):
    """Client.prefetch brings a batch's rows into the key_value caches (the
    lookup after it hits every row and fills none; a second prefetch brings
    nothing; a table in memory is skipped; bad ids are refused). Then
    TrainPipeline(mode="prefetch") on batches whose rows overlap from step
    to step ends with the same tables as the plain loop, exactly, while
    the semi-synchronous pipeline (one step stale) does not."""
    torch = pytest.importorskip("torch")
    from ember.torch import EmbeddingBagCollection, TrainPipeline, _table_specs

    base = free_ports(3)
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    flags = [f"--ssd_dir={ssd}", "--ssd_gib=0.5", f"--metrics_port={base}",
             "--key_value_min_cache_rows=1"]
    tables = [{"name": "t", "num_embeddings": ROWS, "embedding_dim": DIM, "feature_names": ["f"],
               "pooling": "SUM"},
              {"name": "m", "num_embeddings": 50, "embedding_dim": 4, "feature_names": ["g"],
               "pooling": "SUM"}]
    optimizer = {"type": "SGD", "learning_rate": LR}
    with ember.LocalCluster(workers=2, extra_flags=flags) as cluster:
        client = ember.Client(cluster.address, timeout_s=20)
        workers = [u for k, u in cluster.metrics_urls.items() if k != "coordinator"]

        def create(name):
            specs = _table_specs(tables, optimizer)
            for s in specs:
                s["initializer"] = {"type": "UNIFORM", "low": -1, "high": 1, "seed": 3}
            info = client.create_collection({
                "name": name, "tables": specs,
                "constraints": {"t": {"compute_kernels": ["key_value"], "cache_load_factor": 0.05},
                                "m": {"compute_kernels": ["fused"]}},
            }, sharding_type="row_wise")
            assert [t["compute_kernel"] for t in info["plan"]["tables"]] == ["key_value", "fused"]
            return EmbeddingBagCollection(tables, client, name, optimizer=optimizer, create=False)

        # By hand: 6 distinct rows of t, 3 on each row-wise shard of 1,000.
        create("kv")
        kjt = ember.KeyedJaggedTensor.from_jagged(
            {"f": [[1, 2, 3], [1001, 1002], [3, 1500, 1]], "g": [[0], [1], [2]]})
        assert client.prefetch("kv", kjt) == 6
        assert client.prefetch("kv", kjt) == 0  # all cached now
        fills = metric(workers, "ember_worker_key_value_fills_total")
        hits = metric(workers, "ember_worker_key_value_hits_total")
        client.lookup("kv", kjt)
        assert metric(workers, "ember_worker_key_value_fills_total") == fills
        assert metric(workers, "ember_worker_key_value_hits_total") == hits + 6
        assert metric(workers, "ember_worker_key_value_prefetched_rows_total") == 6
        with pytest.raises(ember.InvalidArgument):
            client.prefetch("kv", ember.KeyedJaggedTensor.from_jagged({"f": [[ROWS]]}))
        with pytest.raises(ember.InvalidArgument):
            client.prefetch("kv", ember.KeyedJaggedTensor.from_jagged({"g": [[50]]}))
        with pytest.raises(ember.NotFound):
            client.prefetch("kv", ember.KeyedJaggedTensor.from_jagged({"nope": [[1]]}))
        assert metric(workers, "ember_worker_key_value_prefetched_rows_total") == 6

        # 12 batches of 8 bags of 3 ids over 150 hot rows (overlapping from
        # step to step), targets that pull the rows apart; the dense part
        # is fixed, so the tables alone tell the runs apart.
        rng = np.random.default_rng(11)
        batches = []
        for i in range(12):
            bags = [list(rng.integers(0, 150, 3) * 13 % ROWS) for _ in range(8)]
            batches.append({"kjt": ember.KeyedJaggedTensor.from_jagged(
                                {"f": bags, "g": [[int(b[0]) % 50] for b in bags]}),
                            "target": torch.from_numpy(
                                rng.standard_normal((8, DIM + 4)).astype(np.float32))})
        results = {}
        for mode in ("plain", "prefetch", "semi_sync"):
            name = f"kv_{mode}"
            ebc = create(name)
            head = torch.nn.Linear(DIM + 4, DIM + 4)
            torch.nn.init.eye_(head.weight)
            torch.nn.init.zeros_(head.bias)
            opt = torch.optim.SGD(head.parameters(), lr=0.0)

            def model(batch, ebc=ebc, head=head):
                out = head(ebc(batch["kjt"]).values())
                return ((out - batch["target"]) ** 2).sum()

            if mode == "plain":
                for b in batches:
                    opt.zero_grad()
                    model(b).backward()
                    opt.step()
            else:
                pipeline = TrainPipeline(model, opt, ebc, sparse=lambda b: b["kjt"], mode=mode)
                it = iter(batches)
                for _ in batches:
                    pipeline.progress(it)
                with pytest.raises(StopIteration):
                    pipeline.progress(it)
                assert pipeline.fill_failures == 0
            results[mode] = {t: client.export_table(name, t) for t in ("t", "m")}
            if mode == "prefetch":
                assert collection_metric(
                    workers, "ember_worker_key_value_prefetched_rows_total", name) > 0
        for t in ("t", "m"):
            np.testing.assert_array_equal(results["prefetch"][t], results["plain"][t])
        assert not np.array_equal(results["semi_sync"]["t"], results["plain"]["t"])
        with pytest.raises(ValueError):
            TrainPipeline(None, None, None, mode="async")

        # An EmbeddingCollection (sequence features) fills its caches too, and
        # takes the prefetch pipeline only (no lookup ahead).
        pytest.importorskip("torchrec")
        from ember.torch import EmbeddingCollection
        seq = [{"name": "s", "num_embeddings": ROWS, "embedding_dim": DIM,
                "feature_names": ["q"]}]
        specs = _table_specs(seq, optimizer, pooling="NONE")
        client.create_collection({"name": "kvseq", "tables": specs,
                                  "constraints": {"s": {"compute_kernels": ["key_value"],
                                                        "cache_load_factor": 0.05}}},
                                 sharding_type="row_wise")
        ec = EmbeddingCollection(seq, client, "kvseq", optimizer=optimizer, create=False)
        q = ember.KeyedJaggedTensor.from_jagged({"q": [[4, 5, 4], [1004]], "f": [[1], [2]]})
        assert ec.fill_caches(q).result() == 3  # its own feature only
        hits = collection_metric(workers, "ember_worker_key_value_hits_total", "kvseq")
        with torch.no_grad():
            ec(q)
        assert collection_metric(workers, "ember_worker_key_value_hits_total", "kvseq") == hits + 3
        with pytest.raises(TypeError):
            TrainPipeline(None, None, ec)
        TrainPipeline(None, None, ec, mode="prefetch")


def test_the_dlrm_example_on_key_value_with_the_prefetch_pipeline_trains_as_in_memory(tmp_path):
    """examples/train_dlrm.py --key_value_cache=0.1 --pipeline=prefetch (the
    tables' rows on the workers' SSD under a 10% cache, each batch's rows
    brought in during the previous backward) prints the same losses and AUC
    as the plain loop over tables held in memory; the semi-synchronous
    pipeline's losses differ (one step stale)."""
    import os
    import re
    import subprocess
    import sys
    pytest.importorskip("torch")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    script = os.path.join(root, "examples", "train_dlrm.py")
    if not os.path.exists(script):
        pytest.skip("examples/train_dlrm.py is not beside the tests")
    runs = {}
    for name, flags in (("memory", []),
                        ("prefetch", ["--key_value_cache=0.1", "--pipeline=prefetch"]),
                        ("semi_sync", ["--key_value_cache=0.1", "--pipeline=semi_sync"])):
        ssd = tmp_path / name
        ssd.mkdir()
        out = subprocess.run([sys.executable, script, "--steps=80", "--batch=128",
                              "--log_every=20", "--min_auc=0.6", f"--ssd_dir={ssd}"] + flags,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        if flags:
            assert "key_value (cache 0.1)" in out.stdout, out.stdout
        runs[name] = (re.findall(r"loss ([0-9.]+)", out.stdout),
                      re.search(r"AUC after training ([0-9.]+)", out.stdout).group(1))
    assert len(runs["memory"][0]) == 4
    assert runs["prefetch"] == runs["memory"]
    assert runs["semi_sync"][0] != runs["memory"][0]
