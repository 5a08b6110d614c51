"""Prometheus metrics end to end: a local cluster with --metrics_port serves
the text format (promtool accepts it), Debian's prometheus scrapes the
coordinator and both workers, and the values read back through its HTTP API
match the traffic this test made."""

import json
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request

import numpy as np
import pytest

import ember

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def free_ports(n):
    """A base port with n free consecutive ports after it."""
    for _ in range(200):
        base = random.randint(20000, 60000 - n)
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            for s in socks:
                s.close()
            return base
        except OSError:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def query(prom, expr):
    data = json.loads(get(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert data["status"] == "success", data
    return data["data"]["result"]


@pytest.mark.skipif(not os.access(PROMETHEUS, os.X_OK), reason="Debian's prometheus is missing")
def test_prometheus_scrapes_the_cluster(tmp_path):
    base = free_ports(4)  # coordinator, 2 workers, prometheus
    flags = [f"--metrics_port={base}", f"--checkpoint_dir={tmp_path / 'checkpoints'}"]
    with ember.LocalCluster(workers=2, extra_flags=flags) as cluster:
        client = ember.Client(cluster.address, timeout_s=20)
        client.create_collection({"name": "m", "tables": [
            {"name": "t", "num_embeddings": 100, "embedding_dim": 8, "feature_names": ["f"]}]},
            sharding_type="row_wise")
        kjt = ember.KeyedJaggedTensor.from_jagged({"f": [[1, 2, 3], [50, 99], [7]]})
        for _ in range(5):
            client.lookup("m", kjt)
        with pytest.raises(ember.NotFound):
            client.lookup("nope", kjt)
        started = time.time()
        client.checkpoint("m")
        client.apply_gradients("m", kjt, np.ones((3, 8), dtype=np.float32))
        inc = client.checkpoint("m", incremental=True)  # a delta of 6 of the 100 rows
        assert inc["base"]

        # emberctl up says where each process serves its metrics.
        urls = cluster.metrics_urls
        assert urls["coordinator"] == f"http://127.0.0.1:{base}/metrics"
        workers = {w["worker_id"] for w in client.list_workers()}
        assert set(urls) == workers | {"coordinator"}
        assert sorted(urls[w] for w in workers) == [
            f"http://127.0.0.1:{base + i}/metrics" for i in (1, 2)]
        for w in workers:
            assert "ember_worker_lookups_total" in get(urls[w])
        # Per table: the 6 ids of each of the 5 lookups, each served by the
        # one row-wise shard that holds it, summed over both workers.
        table_ids = 0.0
        for w in workers:
            for line in get(urls[w]).splitlines():
                if line.startswith("ember_worker_table_lookup_ids_total{") and \
                        'collection="m"' in line and 'table="t"' in line:
                    table_ids += float(line.rsplit(" ", 1)[1])
        assert table_ids == 30, table_ids

        # Training steps (a SYNC collection of one trainer): each worker
        # holding shards counts every step it applied.
        client.create_collection({"name": "ms", "tables": [
            {"name": "t", "num_embeddings": 100, "embedding_dim": 8, "feature_names": ["f"]}],
            "training": {"mode": "SYNC", "trainers": 1}}, sharding_type="row_wise")
        for step in range(2):
            client.apply_gradients("ms", kjt, np.ones((3, 8), np.float32), step=step, rank=0)

        def total(metric):
            return sum(float(line.rsplit(" ", 1)[1]) for w in workers
                       for line in get(urls[w]).splitlines()
                       if line.startswith(metric + " ") or line.startswith(metric + "{"))

        assert total("ember_worker_steps_applied_total") == 4  # 2 steps x 2 workers
        assert total("ember_worker_steps_aborted_total") == 0
        assert total("ember_worker_step_pending_bytes") == 0
        client.drop_collection("ms")  # the counts below are of collection "m"
        assert total("ember_worker_steps_applied_total") == 4  # a counter: kept

        # A dynamic table (capacity 2, admission at 2, LRU): [1] counts 1;
        # [1, 2, 3] admits 1 and counts 2 and 3; [2, 3] admits both, 3
        # evicting 1. Gradients of ids below admission: 1 + 2.
        client.create_collection({"name": "md", "tables": [
            {"name": "t", "embedding_dim": 4, "feature_names": ["f"],
             "dynamic": {"capacity": 2, "admit_after": 2}}]}, sharding_type="table_wise")
        for bag in ([1], [1, 2, 3], [2, 3]):
            client.apply_gradients("md", ember.KeyedJaggedTensor.from_jagged({"f": [bag]}),
                                   np.ones((1, 4), np.float32))

        def labelled(metric, **labels):
            want = [f'{k}="{v}"' for k, v in dict(collection="md", table="t", **labels).items()]
            return sum(float(line.rsplit(" ", 1)[1]) for w in workers
                       for line in get(urls[w]).splitlines()
                       if line.startswith(metric + "{") and all(x in line for x in want))

        assert labelled("ember_worker_dynamic_rows") == 2
        assert labelled("ember_worker_dynamic_capacity") == 2
        assert labelled("ember_worker_dynamic_admitted_total", reason="update") == 3
        assert labelled("ember_worker_dynamic_evicted_total", reason="lru") == 1
        assert labelled("ember_worker_dynamic_evicted_total", reason="ttl") == 0
        assert labelled("ember_worker_dynamic_dropped_gradient_ids_total") == 3
        assert labelled("ember_worker_dynamic_pending_ids") == 0
        assert 0 < labelled("ember_worker_dynamic_load_factor") <= 0.5

        # The exposition itself is valid Prometheus text.
        for i in (1, 2):
            text = get(f"http://127.0.0.1:{base + i}/metrics")
            check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, text=True,
                                   capture_output=True)
            assert check.returncode == 0, check.stdout + check.stderr
        client.drop_collection("md")

        # A live rescale, 2 -> 1 -> 2 workers: counted with its bytes.
        client.create_collection({"name": "mv", "tables": [
            {"name": "t", "num_embeddings": 100, "embedding_dim": 8, "feature_names": ["f"]}]},
            sharding_type="row_wise")
        moved = [client.scale("mv", n) for n in (1, 2)]
        text = get(urls["coordinator"])

        def sample(metric, *labels):  # the value of the line with these labels
            for line in text.splitlines():
                if line.startswith(metric + "{") and all(l in line for l in labels):
                    return float(line.rsplit(" ", 1)[1])
            raise AssertionError(f"no {metric} {labels} in {text}")

        assert sample("ember_coordinator_moves_total", 'kind="scale"', 'result="ok"') == 2
        assert sample("ember_coordinator_moves_total", 'kind="scale"', 'result="failed"') == 0
        assert sample("ember_coordinator_moves_total", 'kind="drain"', 'result="ok"') == 0
        between = sum(int(m["bytes_between_workers"]) for m in moved)
        local = sum(int(m["bytes_copied"]) - int(m["bytes_between_workers"]) for m in moved)
        assert between > 0 and local > 0
        assert sample("ember_coordinator_move_bytes_total", 'between="workers"') == between
        assert sample("ember_coordinator_move_bytes_total", 'between="local"') == local
        assert 0 < sample("ember_coordinator_last_move_fence_seconds") < 60
        check = subprocess.run([PROMTOOL, "check", "metrics"], input=text, text=True,
                               capture_output=True)
        assert check.returncode == 0, check.stdout + check.stderr
        client.drop_collection("mv")
        assert sample("ember_coordinator_moves_total", 'kind="copies"', 'result="ok"') == 0
        assert sample("ember_coordinator_replica_takeovers_total") == 0

        # A replicated table: each update forwarded once, by its primary.
        client.create_collection({"name": "rp", "replicas": 2, "tables": [
            {"name": "t", "num_embeddings": 100, "embedding_dim": 8, "feature_names": ["f"]}]},
            sharding_type="table_wise")
        for _ in range(5):
            client.apply_gradients("rp", ember.KeyedJaggedTensor.from_jagged({"f": [[1, 2]]}),
                                   np.ones((1, 8), np.float32))

        def total(metric):  # summed over the workers
            return sum(float(line.rsplit(" ", 1)[1]) for w in workers
                       for line in get(urls[w]).splitlines()
                       if line.startswith(metric + "{") or line.startswith(metric + " "))

        assert total("ember_worker_replica_forwards_total") == 5
        assert total("ember_worker_replica_forward_failures_total") == 0
        assert total("ember_worker_replica_forward_seconds_total") > 0
        client.drop_collection("rp")

        config = tmp_path / "prometheus.yml"
        targets = ", ".join(f"'127.0.0.1:{base + i}'" for i in range(3))
        config.write_text("global:\n  scrape_interval: 1s\nscrape_configs:\n"
                          f"  - job_name: ember\n    static_configs:\n      - targets: [{targets}]\n")
        web = f"127.0.0.1:{base + 3}"
        prom = f"http://{web}"
        proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address={web}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 60
            up = []
            while time.monotonic() < deadline:
                try:
                    active = json.loads(get(f"{prom}/api/v1/targets"))["data"]["activeTargets"]
                    up = [t for t in active if t["health"] == "up"]
                    if len(up) == 3 and query(prom, "sum(ember_worker_lookups_total)"):
                        break
                except OSError:
                    pass
                time.sleep(0.5)
            assert len(up) == 3, f"targets not all up: {up}"
            # 5 lookups of 6 ids, row-wise over 2 workers: every id is looked up once.
            ids = query(prom, "sum(ember_worker_lookup_ids_total)")
            assert float(ids[0]["value"][1]) == 30
            busy = query(prom, 'sum(ember_worker_backend_seconds_total{call="lookup"})')
            assert 0 < float(busy[0]["value"][1]) < 60, busy
            lookups = query(prom, 'sum(ember_rpc_total{method="Worker/Lookup",code="OK"})')
            assert float(lookups[0]["value"][1]) >= 5
            live = query(prom, 'ember_coordinator_workers{state="live"}')
            assert float(live[0]["value"][1]) == 2
            serving = query(prom, 'ember_coordinator_collections{state="SERVING"}')
            assert float(serving[0]["value"][1]) == 1
            refused = query(prom, 'ember_rpc_total{method="Coordinator/GetCollection",'
                                  'code="NOT_FOUND"}')
            assert refused and float(refused[0]["value"][1]) >= 1
            runs = query(prom, 'ember_coordinator_checkpoint_runs_total{result="ok"}')
            assert float(runs[0]["value"][1]) == 2
            failed = query(prom, 'ember_coordinator_checkpoint_runs_total{result="failed"}')
            assert float(failed[0]["value"][1]) == 0
            spent = float(query(prom, "ember_coordinator_checkpoint_seconds_total")[0]["value"][1])
            last = float(query(prom, "ember_coordinator_last_checkpoint_duration_seconds")
                         [0]["value"][1])
            assert 0 < last <= spent < time.time() - started
            when = float(query(prom, "ember_coordinator_last_checkpoint_success_timestamp_seconds")
                         [0]["value"][1])
            assert started <= when <= time.time()
            full = float(query(prom, 'ember_coordinator_checkpoint_bytes_total{kind="full"}')
                         [0]["value"][1])
            delta = float(query(prom, 'ember_coordinator_checkpoint_bytes_total'
                                      '{kind="incremental"}')[0]["value"][1])
            assert delta == int(inc["bytes"]) and 0 < delta < full
            compacted = query(prom, 'ember_coordinator_checkpoint_compactions_total{result="ok"}')
            assert float(compacted[0]["value"][1]) == 0
            hist = query(prom, 'ember_rpc_duration_seconds_count{method="Worker/Lookup"}')
            assert sum(float(r["value"][1]) for r in hist) >= 5
        finally:
            proc.terminate()
            proc.wait(timeout=15)
        client.drop_collection("m")
