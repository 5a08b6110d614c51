"""The CUDA workers' host-memory kernels through the Python SDK, on CUDA
workers emulated on the CPU (`emberctl up --device=cuda_emulated`): a table
on `fused_uvm` (every row in host memory the GPU maps) and one on
`fused_uvm_caching` (5% of them cached in GPU memory over those) are
planned as named, train exactly as a NumPy model of the tables (SGD, SUM
pooling), come back whole from a checkpoint, and the workers' metrics show
the mapped memory taken and the cache's rows leaving and coming back. CPU
workers, which do not serve the kernels, hold such tables fused."""

import numpy as np
import pytest

import ember
from test_metrics import free_ports, get

ROWS, DIM, LR = 2000, 16, 0.1


def metric(urls, name, collection="uvm"):
    return sum(float(line.rsplit(" ", 1)[1]) for url in urls for line in get(url).splitlines()
               if line.startswith(name + "{") and f'collection="{collection}"' in line)


def worker_metric(urls, name):
    return sum(float(line.rsplit(" ", 1)[1]) for url in urls for line in get(url).splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def spec(name="uvm"):
    tables = [{"name": t, "num_embeddings": ROWS, "embedding_dim": DIM, "feature_names": [f],
               "optimizer": {"type": "SGD", "learning_rate": LR},
               "initializer": {"type": "UNIFORM", "low": -1, "high": 1, "seed": 3}}
              for t, f in (("mapped", "fm"), ("cached", "fc"))]
    return {"name": name, "tables": tables,
            "constraints": {"mapped": {"compute_kernels": ["fused_uvm"]},
                            "cached": {"compute_kernels": ["fused_uvm_caching"],
                                       "cache_load_factor": 0.05}}}


def test_host_memory_kernels_train_as_numpy(tmp_path):
    base = free_ports(3)
    flags = [f"--metrics_port={base}", "--key_value_min_cache_rows=1", "--uvm_memory_gib=1",
             f"--checkpoint_dir={tmp_path}"]
    with ember.LocalCluster(workers=2, device="cuda_emulated", extra_flags=flags) as cluster:
        client = ember.Client(cluster.address, timeout_s=30)
        workers = [u for k, u in cluster.metrics_urls.items() if k != "coordinator"]
        free_before = worker_metric(workers, "ember_worker_available_mapped_bytes")
        assert free_before == 2 * (1 << 30)
        info = client.create_collection(spec(), sharding_type="row_wise")
        kernels = {t["table"]: t["compute_kernel"] for t in info["plan"]["tables"]}
        assert kernels == {"mapped": "fused_uvm", "cached": "fused_uvm_caching"}
        cached_plan = [t for t in info["plan"]["tables"] if t["table"] == "cached"][0]
        assert cached_plan["cache_load_factor"] == pytest.approx(0.05)
        # Both tables' rows (2000 x 16 fp32 each) are in mapped host memory.
        taken = free_before - worker_metric(workers, "ember_worker_available_mapped_bytes")
        assert taken == 2 * ROWS * DIM * 4

        tables = {t: client.export_table("uvm", t).copy() for t in ("mapped", "cached")}
        rng = np.random.default_rng(7)
        for step in range(30):
            # Skewed ids (8 bags of 3 a feature; at most 24 distinct rows a
            # call, under each cached shard's 50 rows).
            bags = {f: [list((ROWS * rng.random(3) ** 3).astype(np.int64)) for _ in range(8)]
                    for f in ("fm", "fc")}
            kjt = ember.KeyedJaggedTensor.from_jagged(bags)
            out = np.asarray(client.lookup("uvm", kjt).values).reshape(8, 2 * DIM)
            for k, (f, t) in enumerate((("fm", "mapped"), ("fc", "cached"))):
                want = np.stack([tables[t][b].sum(axis=0) for b in bags[f]])
                np.testing.assert_allclose(out[:, k * DIM:(k + 1) * DIM], want,
                                           rtol=1e-5, atol=1e-6)
            grads = rng.standard_normal((8, 2 * DIM)).astype(np.float32)
            client.apply_gradients("uvm", kjt, grads)
            for k, (f, t) in enumerate((("fm", "mapped"), ("fc", "cached"))):
                for b, g in zip(bags[f], grads[:, k * DIM:(k + 1) * DIM]):
                    for row in b:
                        tables[t][row] -= LR * g
        for t in ("mapped", "cached"):
            np.testing.assert_allclose(client.export_table("uvm", t), tables[t],
                                       rtol=1e-5, atol=1e-5)

        # The cache: 5% of each 1,000-row shard, rows written back to host
        # memory and read again from it; no SSD file.
        assert metric(workers, "ember_worker_key_value_cache_rows") == 100
        assert metric(workers, "ember_worker_key_value_write_backs_total") > 0
        assert metric(workers, "ember_worker_key_value_disk_reads_total") > 0
        assert metric(workers, "ember_worker_key_value_file_bytes") == 0

        # A checkpoint reads every row through the cache; a restore under
        # another name plans the same kernels and gives every row back.
        path = client.checkpoint("uvm")["path"]
        client.restore(path, name="uvm2", sharding_type="table_wise")
        info2 = client.collection("uvm2")
        assert {t["table"]: t["compute_kernel"] for t in info2["plan"]["tables"]} == kernels
        for t in ("mapped", "cached"):
            np.testing.assert_array_equal(client.export_table("uvm2", t),
                                          client.export_table("uvm", t))
        client.drop_collection("uvm2")
        client.drop_collection("uvm")
        assert worker_metric(workers, "ember_worker_available_mapped_bytes") == free_before


def test_cpu_workers_hold_such_tables_fused():
    # On CPU workers (host memory is all they have) the constraints plan
    # as fused, as a CPU plan of the planner maps every GPU kernel.
    with ember.LocalCluster(workers=1) as cluster:
        client = ember.Client(cluster.address, timeout_s=20)
        info = client.create_collection(spec(), sharding_type="row_wise")
        assert {t["compute_kernel"] for t in info["plan"]["tables"]} == {"fused"}
        assert "fused_uvm" not in info["plan"]["topology"]["compute_kernels"]
