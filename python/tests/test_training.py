"""Many trainers on one collection (TrainingSpec, docs/training.md): N ranks
in SYNC, each sending its slice of the global batch, give exactly the
tables one trainer gets from the concatenated batch with its gradients
scaled by 1/N (MEAN) or not (SUM), for every optimizer, pooling, sharding
type and fp16 with stochastic rounding; the result does not depend on the
ranks' arrival order, bit for bit; BOUNDED lookups see exactly the steps
they should; a missing rank aborts its step, which can be sent again;
retries apply once; bad steps and ranks are refused."""

import threading
import time

import numpy as np
import pytest

import ember

ROWS = {"f_sum": 40, "f_mean": 30, "f_seq": 20}


def tables(optimizer, data_type="FP32"):
    return [
        {"name": "t_sum", "num_embeddings": 40, "embedding_dim": 8, "feature_names": ["f_sum"],
         "pooling": "SUM", "data_type": data_type, "optimizer": optimizer},
        {"name": "t_mean", "num_embeddings": 30, "embedding_dim": 4, "feature_names": ["f_mean"],
         "pooling": "MEAN", "data_type": data_type, "optimizer": optimizer},
    ]


def training(mode, trainers, **kw):
    return dict({"mode": mode, "trainers": trainers}, **kw)


@pytest.fixture(scope="module")
def client():
    with ember.LocalCluster(workers=2) as cluster:
        yield ember.Client(cluster.address, timeout_s=20)


def batch(rng, size, features=("f_sum", "f_mean")):
    """Per feature `size` bags of hot ids (rows repeat across ranks)."""
    bags = {f: [list(np.minimum(rng.zipf(1.6, size=int(rng.integers(0, 5))) - 1, ROWS[f] - 1))
                for _ in range(size)] for f in features}
    return bags


def kjt_of(bags, features=("f_sum", "f_mean")):
    lengths = [len(b) for f in features for b in bags[f]]
    values = [int(v) for f in features for b in bags[f] for v in b]
    return ember.KeyedJaggedTensor(list(features), np.array(lengths, np.int64),
                                   np.array(values, np.int64))


def concat(slices, features=("f_sum", "f_mean")):
    return {f: [b for s in slices for b in s[f]] for f in features}


def create(client, name, optimizer, mode, trainers, sharding, data_type="FP32", **kw):
    spec = {"name": name, "tables": tables(optimizer, data_type)}
    if mode is not None:
        spec["training"] = training(mode, trainers, **kw)
    return client.create_collection(spec, sharding_type=sharding)


def export(client, name):
    return {t: client.export_table(name, t) for t in ("t_sum", "t_mean")}


def run_ranks(fns):
    """Runs one function per rank in threads; their exceptions, re-raised."""
    errors = [None] * len(fns)

    def wrap(i):
        try:
            fns[i]()
        except BaseException as e:  # noqa: BLE001  (re-raised below)
            errors[i] = e

    threads = [threading.Thread(target=wrap, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for e in errors:
        if e is not None:
            raise e


def train_sync(client, name, trainers, steps, seed, delays=None, mean=True):
    """`trainers` rank threads, `steps` SYNC steps each over its slice;
    gradients a fixed function of the lookup (so the dense state is the
    tables'). Returns the global batches (one list of slices per step)."""
    rng = np.random.default_rng(seed)
    plan = [[batch(rng, 3) for _ in range(trainers)] for _ in range(steps)]
    grad_rng = np.random.default_rng(seed + 1)
    grads = [[grad_rng.normal(size=(3, 12)).astype(np.float32) for _ in range(trainers)]
             for _ in range(steps)]

    def rank_fn(r):
        def fn():
            c = ember.Client(client.address, timeout_s=20)
            for s in range(steps):
                kjt = kjt_of(plan[s][r])
                kt = c.lookup(name, kjt, step=s)
                if delays is not None:
                    time.sleep(delays[s][r])
                g = grads[s][r] + 0.01 * kt.values  # depends on what it read
                c.apply_gradients(name, kjt, g, step=s, rank=r)
        return fn

    run_ranks([rank_fn(r) for r in range(trainers)])
    return plan, grads


def train_one(client, name, plan, grads, trainers, mean=True):
    """The reference: one trainer, the concatenated batch, the ranks'
    gradients concatenated (scaled by 1/trainers for MEAN)."""
    for s in range(len(plan)):
        kjt = kjt_of(concat(plan[s]))
        kt = client.lookup(name, kjt)
        rows = np.cumsum([0] + [3] * trainers)
        g = np.concatenate([grads[s][r] + 0.01 * kt.values[rows[r]:rows[r + 1]]
                            for r in range(trainers)])
        if mean:
            g = (g / np.float32(trainers)).astype(np.float32)
        client.apply_gradients(name, kjt, g)


OPTIMIZERS = [{"type": "SGD", "learning_rate": 0.5},
              {"type": "ADAGRAD", "learning_rate": 0.3},
              {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.3},
              {"type": "ADAM", "learning_rate": 0.05}]


@pytest.mark.parametrize("opt", OPTIMIZERS, ids=lambda o: o["type"])
@pytest.mark.parametrize("trainers,sharding", [(2, "row_wise"), (3, "table_wise"),
                                               (3, "row_wise"),
                                               (2, "column_wise"), (2, "table_row_wise"),
                                               (2, "data_parallel")])
def test_sync_ranks_equal_one_trainer_with_the_global_batch(client, opt, trainers, sharding):
    name = f"sync_{opt['type'].lower()}_{trainers}_{sharding}"
    ref = name + "_ref"
    create(client, name, opt, "SYNC", trainers, sharding)
    create(client, ref, opt, None, 1, sharding)
    try:
        client.import_table(ref, "t_sum", client.export_table(name, "t_sum"))
        client.import_table(ref, "t_mean", client.export_table(name, "t_mean"))
        plan, grads = train_sync(client, name, trainers, steps=4, seed=trainers)
        train_one(client, ref, plan, grads, trainers)
        got, want = export(client, name), export(client, ref)
        for t in got:
            np.testing.assert_array_equal(got[t], want[t], err_msg=t)
        assert not np.array_equal(got["t_sum"], client.export_table(name, "t_sum") * 0)
    finally:
        client.drop_collection(name)
        client.drop_collection(ref)


def test_sum_reduction_and_fp16_stochastic_rounding(client):
    opt = {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.3}
    name, ref = "sync_sum_fp16", "sync_sum_fp16_ref"
    create(client, name, opt, "SYNC", 2, "row_wise", data_type="FP16",
           gradient_reduction="SUM")
    create(client, ref, opt, None, 1, "row_wise", data_type="FP16")
    try:
        for t in ("t_sum", "t_mean"):
            client.import_table(ref, t, client.export_table(name, t))
        plan, grads = train_sync(client, name, 2, steps=3, seed=9)
        train_one(client, ref, plan, grads, 2, mean=False)
        got, want = export(client, name), export(client, ref)
        for t in got:
            np.testing.assert_array_equal(got[t], want[t], err_msg=t)
    finally:
        client.drop_collection(name)
        client.drop_collection(ref)


def test_arrival_order_does_not_change_a_bit(client):
    """The same steps with the ranks delayed differently: identical tables."""
    opt = {"type": "ADAM", "learning_rate": 0.05}
    results = []
    for run, delays in enumerate(([[0.0, 0.05, 0.1]] * 3, [[0.1, 0.0, 0.05]] * 3)):
        name = f"sync_order_{run}"
        create(client, name, opt, "SYNC", 3, "row_wise")
        try:
            if results:  # the same initial tables as the first run
                for t in ("t_sum", "t_mean"):
                    client.import_table(name, t, results[0][1][t])
            initial = export(client, name)
            train_sync(client, name, 3, steps=3, seed=5, delays=delays)
            results.append((export(client, name), initial))
        finally:
            client.drop_collection(name)
    for t in ("t_sum", "t_mean"):
        np.testing.assert_array_equal(results[0][0][t], results[1][0][t], err_msg=t)


def test_bounded_lookups_see_exactly_their_steps(client):
    """BOUNDED(1): rank 0 runs a step ahead of rank 1. Its lookup for step
    1 reads before step 0 is applied; for step 2 it waits until rank 1
    sends step 0, and then reads step 0's result."""
    opt = {"type": "SGD", "learning_rate": 1.0}
    name = "bounded"
    create(client, name, opt, "BOUNDED", 2, "row_wise", max_staleness=1)
    try:
        initial = export(client, name)
        rng = np.random.default_rng(2)
        b0, b1 = batch(rng, 2), batch(rng, 2)
        k0, k1 = kjt_of(b0), kjt_of(b1)
        ones = np.ones((2, 12), np.float32)
        probe = kjt_of({"f_sum": [[0, 1, 2, 3]], "f_mean": [[0, 1, 2]]})
        client.apply_gradients(name, k0, ones, step=0, rank=0)  # held: returns at once
        # Step 1 may read with step 0 held.
        def pooled(t):  # the probe's one bag of each feature, from tables `t`
            return np.concatenate([t["t_sum"][[0, 1, 2, 3]].sum(0), t["t_mean"][[0, 1, 2]].mean(0)])

        np.testing.assert_allclose(client.lookup(name, probe, step=1).values[0],
                                   pooled(initial), rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(export(client, name)["t_sum"], initial["t_sum"])
        got = {}
        reader = threading.Thread(target=lambda: got.setdefault(
            "kt", client.lookup(name, probe, step=2)))
        reader.start()
        time.sleep(0.3)
        assert reader.is_alive(), "a lookup for step 2 read before step 0 was applied"
        client.apply_gradients(name, k1, ones, step=0, rank=1)  # completes step 0
        reader.join(20)
        assert not reader.is_alive()
        after = export(client, name)
        assert not np.array_equal(after["t_sum"], initial["t_sum"])
        np.testing.assert_allclose(got["kt"].values[0], pooled(after), rtol=1e-6, atol=1e-6)
    finally:
        client.drop_collection(name)


def test_a_missing_rank_aborts_the_step_and_it_can_be_sent_again(client):
    opt = {"type": "SGD", "learning_rate": 1.0}
    name = "abort"
    create(client, name, opt, "SYNC", 2, "table_wise", step_timeout_s=1)
    try:
        initial = export(client, name)
        rng = np.random.default_rng(3)
        k0, k1 = kjt_of(batch(rng, 2)), kjt_of(batch(rng, 2))
        g = np.ones((2, 12), np.float32)
        start = time.monotonic()
        with pytest.raises(ember.Aborted, match=r"rank\(s\) 1 of 2 did not send it"):
            client.apply_gradients(name, k0, g, step=0, rank=0)
        assert 0.9 < time.monotonic() - start < 10
        for t, w in export(client, name).items():
            np.testing.assert_array_equal(w, initial[t], err_msg=t)  # nothing applied
        run_ranks([lambda: client.apply_gradients(name, k0, g, step=0, rank=0),
                   lambda: client.apply_gradients(name, k1, g, step=0, rank=1)])
        assert not np.array_equal(export(client, name)["t_sum"], initial["t_sum"])
    finally:
        client.drop_collection(name)


def test_retries_apply_once_and_bad_steps_and_ranks_are_refused(client):
    opt = {"type": "SGD", "learning_rate": 1.0}
    name, ref = "retries", "retries_ref"
    create(client, name, opt, "BOUNDED", 2, "row_wise", max_staleness=1)
    create(client, ref, opt, None, 1, "row_wise")
    try:
        for t in ("t_sum", "t_mean"):
            client.import_table(ref, t, client.export_table(name, t))
        rng = np.random.default_rng(4)
        s0, s1 = batch(rng, 2), batch(rng, 2)
        k0, k1 = kjt_of(s0), kjt_of(s1)
        g0 = rng.normal(size=(2, 12)).astype(np.float32)
        g1 = rng.normal(size=(2, 12)).astype(np.float32)
        client.apply_gradients(name, k0, g0, step=0, rank=0)
        client.apply_gradients(name, k0, g0, step=0, rank=0)  # a retry while held
        with pytest.raises(ember.InvalidArgument, match="two different contributions"):
            client.apply_gradients(name, k0, g0 * 2, step=0, rank=0)
        client.apply_gradients(name, k1, g1, step=0, rank=1)  # completes step 0
        client.apply_gradients(name, k1, g1, step=0, rank=1)  # a retry once applied
        client.apply_gradients(ref, kjt_of(concat([s0, s1])),
                               np.concatenate([g0, g1]) / np.float32(2))
        got, want = export(client, name), export(client, ref)
        for t in got:
            np.testing.assert_array_equal(got[t], want[t], err_msg=t)  # applied once
        with pytest.raises(ember.InvalidArgument, match="applied here already"):
            client.apply_gradients(name, k1, g0, step=0, rank=1)
        with pytest.raises(ember.InvalidArgument, match="at most 1 step"):
            client.apply_gradients(name, k0, g0, step=5, rank=0)
        with pytest.raises(ember.InvalidArgument, match="rank 2 is outside 0..1"):
            client.apply_gradients(name, k0, g0, step=1, rank=2)
        with pytest.raises(ember.InvalidArgument, match="carries its step and the trainer's rank"):
            client.apply_gradients(name, k0, g0)
        with pytest.raises(ember.InvalidArgument, match="a lookup carries the step"):
            client.lookup(name, k0)
        with pytest.raises(ember.InvalidArgument, match="step must be an int >= 0"):
            client.lookup(name, k0, step=-1)
        with pytest.raises(ember.InvalidArgument, match="rank must be an int >= 0"):
            client.apply_gradients(name, k0, g0, step=1, rank=-3)
        for t, w in export(client, name).items():
            np.testing.assert_array_equal(w, got[t], err_msg=t)  # nothing of the refused
    finally:
        client.drop_collection(name)
        client.drop_collection(ref)


@pytest.mark.parametrize("training,message", [
    ({"mode": "BOUNDED", "trainers": 2}, "max_staleness must be in [1, 1024] for BOUNDED"),
    ({"mode": "SYNC", "trainers": 2, "max_staleness": 1}, "max_staleness is for BOUNDED"),
    ({"mode": "SYNC", "trainers": -1}, "training.trainers must be in [1, 65536]"),
    ({"mode": "SYNC", "trainers": 2, "step_timeout_s": -1}, "step_timeout_s must be in"),
])
def test_bad_training_specs_are_refused(client, training, message):
    with pytest.raises(ember.InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        client.create_collection({"name": "bad_training", "tables": tables({"type": "SGD"}),
                                  "training": training})


def test_the_stored_spec_shows_the_defaults(client):
    info = create(client, "defaults_training", {"type": "SGD"}, "SYNC", 2, "row_wise")
    try:
        t = info["spec"]["training"]
        assert (t["mode"], t["trainers"], t["step_timeout_s"]) == ("SYNC", 2, 300)
    finally:
        client.drop_collection("defaults_training")


@pytest.mark.parametrize("mode,pipeline", [("SYNC", False), ("BOUNDED", True)])
def test_torch_modules_count_steps_and_ranks(client, mode, pipeline):
    """Two trainer threads, each an ember.torch.EmbeddingBagCollection with
    its rank (the module counts the steps; with TrainPipeline's prefetch
    too), equal one module trained on the concatenated batch with the loss
    divided by 2. The loss is linear in the embeddings, so a BOUNDED
    lookup's staleness changes nothing of the updates."""
    torch = pytest.importorskip("torch")
    import ember.torch as et
    opt = {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.2}
    cfgs = [{"name": t["name"], "num_embeddings": t["num_embeddings"],
             "embedding_dim": t["embedding_dim"], "feature_names": t["feature_names"],
             "pooling": t["pooling"]} for t in tables(opt)]
    name, ref = f"torch_{mode.lower()}", f"torch_{mode.lower()}_ref"
    kw = {"max_staleness": 1} if mode == "BOUNDED" else {}
    create(client, name, opt, mode, 2, "row_wise", **kw)
    refmod = et.EmbeddingBagCollection(cfgs, client, ref, optimizer=opt, sharding_type="row_wise")
    try:
        for t in ("t_sum", "t_mean"):
            client.import_table(ref, t, client.export_table(name, t))
        rng = np.random.default_rng(8)
        steps = 4
        slices = [[batch(rng, 3) for _ in range(2)] for _ in range(steps)]
        weights = [torch.from_numpy(rng.normal(size=(3, 12)).astype(np.float32)) for _ in range(2)]
        with pytest.raises(ValueError, match="give this trainer's rank"):
            et.EmbeddingBagCollection(cfgs, client, name, create=False)
        with pytest.raises(ValueError, match="rank 2 is outside 0..1"):
            et.EmbeddingBagCollection(cfgs, client, name, create=False, rank=2)

        def rank_fn(r):
            def fn():
                ebc = et.EmbeddingBagCollection(cfgs, ember.Client(client.address), name,
                                                create=False, rank=r)
                assert ebc.rank == r and ebc.train_step == 0
                model = lambda kjt: (ebc(kjt).values() * weights[r]).sum()  # noqa: E731
                if pipeline:
                    class Step(torch.nn.Module):
                        def forward(self, kjt):
                            return model(kjt)
                    p = et.TrainPipeline(Step(), torch.optim.SGD([torch.zeros(1)], lr=0.1),
                                         ebc, sparse=lambda b: b)
                    it = iter([kjt_of(slices[s][r]) for s in range(steps)])
                    for _ in range(steps):
                        p.progress(it)
                else:
                    for s in range(steps):
                        model(kjt_of(slices[s][r])).backward()
                assert ebc.train_step == steps
            return fn

        run_ranks([rank_fn(0), rank_fn(1)])
        for s in range(steps):
            kjt = kjt_of(concat(slices[s]))
            ((refmod(kjt).values() * torch.cat(weights)).sum() / 2).backward()
        for t in ("t_sum", "t_mean"):
            np.testing.assert_array_equal(client.export_table(name, t),
                                          client.export_table(ref, t), err_msg=t)
    finally:
        client.drop_collection(name)
        client.drop_collection(ref)


# No Adam: TorchRec refuses it on the CPU ("Optimizer adam is not supported in
# CPU mode", FBGEMM's TBE); Ember's Adam is checked against one trainer above.
@pytest.mark.parametrize("optimizer", ["ROWWISE_ADAGRAD", "SGD"])
def test_two_dmp_ranks_train_as_torchrecs_own(client, tmp_path, optimizer):
    """TorchRec's DLRM under DistributedModelParallel with 2 ranks over gloo:
    its tables sharded by TorchRec (FBGEMM's fused optimizer), then on Ember
    through EmberSharder (SYNC over the ranks), the same initial weights and
    global batches: every rank's loss at every step and the final tables
    agree (dmp_sync_ranks.py)."""
    pytest.importorskip("torchrec")
    pytest.importorskip("fbgemm_gpu")
    from rank_processes import run_rank_processes
    runs = {}
    for mode in ("torchrec", "ember"):
        extra = [f"--coordinator={client.address}"] if mode == "ember" else []
        run_rank_processes("dmp_sync_ranks.py",
                           lambda r, m=mode, e=extra: [f"--mode={m}", f"--optimizer={optimizer}",
                                                       f"--collection=dmp_{optimizer.lower()}",
                                                       f"--out={tmp_path / f'{m}{r}'}"] + e)
        runs[mode] = [np.load(tmp_path / f"{mode}{r}.npz") for r in range(2)]
    for r in range(2):
        np.testing.assert_allclose(runs["ember"][r]["losses"], runs["torchrec"][r]["losses"],
                                   rtol=1e-6, err_msg=f"rank {r}'s losses")
    theirs = {}
    for d in runs["torchrec"]:  # each rank's table-wise shards
        for k in d.files:
            if k.endswith("/values"):
                name = k.split("/")[0]
                assert tuple(d[k.replace("values", "offsets")]) == (0, 0)
                theirs[name] = d[k]
    assert sorted(theirs) == ["t_item", "t_user"]
    for name, want in theirs.items():
        got = runs["ember"][0][f"{name}/0/values"]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6, err_msg=name)
        assert not np.allclose(got, 0)


def test_the_trainer_count_changes_between_steps(client):
    """Three trainers for steps 0-1, two from step 2 on (set_trainers; a
    trainer lost as TorchElastic would see it): each step equals one trainer
    with that step's global batch, its gradients divided by that step's
    count. The past cannot change; a rank past the count is refused;
    emberctl set-trainers does the same (idempotently)."""
    import subprocess
    opt = {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.3}
    name, ref = "elastic", "elastic_ref"
    create(client, name, opt, "SYNC", 3, "row_wise")
    create(client, ref, opt, None, 1, "row_wise")
    try:
        for t in ("t_sum", "t_mean"):
            client.import_table(ref, t, client.export_table(name, t))
        rng = np.random.default_rng(12)
        plan = [[batch(rng, 2) for _ in range(3 if s < 2 else 2)] for s in range(4)]
        grads = [[rng.normal(size=(2, 12)).astype(np.float32) for _ in p] for p in plan]

        def run(steps):
            for s in steps:
                n = len(plan[s])
                run_ranks([lambda r=r, s=s: client.apply_gradients(
                    name, kjt_of(plan[s][r]), grads[s][r], step=s, rank=r) for r in range(n)])
                client.apply_gradients(ref, kjt_of(concat(plan[s])),
                                       np.concatenate(grads[s]) / np.float32(n))

        run([0, 1])
        with pytest.raises(ember.FailedPrecondition, match="step 1 is applied here already"):
            client.set_trainers(name, 2, 1)
        info = client.set_trainers(name, 2, 2)
        assert info["spec"]["training"]["trainers"] == 2
        assert client.collection(name)["spec"]["training"]["trainers"] == 2
        with pytest.raises(ember.InvalidArgument, match=r"rank 2 is outside 0\.\.1"):
            client.apply_gradients(name, kjt_of(plan[2][0]), grads[2][0], step=2, rank=2)
        out = subprocess.run([ember._find_emberctl(), "set-trainers",
                              f"--coordinator={client.address}", f"--collection={name}",
                              "--trainers=2", "--from_step=2"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "2 trainer(s) from step 2" in out.stdout, out
        run([2, 3])
        got, want = export(client, name), export(client, ref)
        for t in got:
            np.testing.assert_array_equal(got[t], want[t], err_msg=t)
        asynchronous = "elastic_async"
        create(client, asynchronous, opt, None, 1, "row_wise")
        with pytest.raises(ember.FailedPrecondition, match="trains ASYNC"):
            client.set_trainers(asynchronous, 2, 0)
        client.drop_collection(asynchronous)
        with pytest.raises(ember.InvalidArgument, match="trainers must be in"):
            client.set_trainers(name, 0, 5)
        with pytest.raises(ember.NotFound):
            client.set_trainers("no_such_collection", 2, 5)
    finally:
        client.drop_collection(name)
        client.drop_collection(ref)


def test_the_dlrm_example_with_two_trainers_reaches_one_trainers_auc(client):
    """examples/train_dlrm.py --trainers=2 (two processes, DDP over gloo for
    the dense part, the tables SYNC on Ember) against --trainers=1 on the
    same data: the same held-out AUC (to 0.01; the dense sums' order
    differs), well above chance."""
    import os
    import re
    import subprocess
    import sys
    pytest.importorskip("torch")
    # The checkout (the runfiles' test sources are symlinks into it).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    script = os.path.join(root, "examples", "train_dlrm.py")
    if not os.path.exists(script):
        pytest.skip("examples/train_dlrm.py is not beside the tests")
    aucs = {}
    for trainers in (1, 2):
        out = subprocess.run([sys.executable, script, "--steps=80", "--batch=128",
                              f"--trainers={trainers}", f"--coordinator={client.address}",
                              "--min_auc=0.6", "--log_every=40"],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        aucs[trainers] = float(re.search(r"AUC after training ([0-9.]+)", out.stdout).group(1))
        if trainers == 2:
            assert "2 trainers (SYNC)" in out.stdout, out.stdout
    assert abs(aucs[2] - aucs[1]) < 0.01, aucs


def test_sync_ranks_over_link_channels():
    """Two ranks whose modules send their torch tensors over link channels
    (socket links: a KJT of CPU tensors is what a CUDA one is to NCCL)
    train SYNC to the tables of one module on the host path with the
    global batch, the loss divided by 2."""
    torch = pytest.importorskip("torch")
    import ember.torch as et
    from torchrec import KeyedJaggedTensor as TorchKjt
    opt = {"type": "ADAGRAD", "learning_rate": 0.2, "eps": 1e-8}
    cfgs = [{"name": t["name"], "num_embeddings": t["num_embeddings"],
             "embedding_dim": t["embedding_dim"], "feature_names": t["feature_names"],
             "pooling": t["pooling"]} for t in tables(opt)]
    with ember.LocalCluster(workers=2, extra_flags=["--links=socket"]) as cluster:
        plain = ember.Client(cluster.address, timeout_s=20, shared_memory=False)
        name, ref = "linked_sync", "linked_sync_ref"
        et.EmbeddingBagCollection(cfgs, plain, name, optimizer=opt, sharding_type="table_wise",
                                  training={"mode": "SYNC", "trainers": 2}, rank=0)
        refmod = et.EmbeddingBagCollection(cfgs, plain, ref, optimizer=opt,
                                           sharding_type="table_wise")
        for t in ("t_sum", "t_mean"):
            plain.import_table(ref, t, plain.export_table(name, t))
        rng = np.random.default_rng(6)
        slices = [[batch(rng, 3) for _ in range(2)] for _ in range(3)]
        weights = [torch.from_numpy(rng.normal(size=(3, 12)).astype(np.float32))
                   for _ in range(2)]

        def torch_kjt(bags):
            k = kjt_of(bags)
            return TorchKjt.from_lengths_sync(keys=list(k.keys),
                                              values=torch.from_numpy(k.values),
                                              lengths=torch.from_numpy(k.lengths))

        def rank_fn(r):
            def fn():
                linked = ember.Client(cluster.address, timeout_s=20, link="socket")
                ebc = et.EmbeddingBagCollection(cfgs, linked, name, create=False, rank=r)
                for s in range(3):
                    (ebc(torch_kjt(slices[s][r])).values() * weights[r]).sum().backward()
            return fn

        run_ranks([rank_fn(0), rank_fn(1)])
        linked_lookups = sum(int(plain.worker_status(a).get("link_lookups", 0))
                             for a in plain.collection(name)["worker_addresses"])
        assert linked_lookups >= 6, linked_lookups  # 2 ranks x 3 steps went over the links
        for s in range(3):
            kjt = kjt_of(concat(slices[s]))
            ((refmod(kjt).values() * torch.cat(weights)).sum() / 2).backward()
        for t in ("t_sum", "t_mean"):
            np.testing.assert_array_equal(plain.export_table(name, t),
                                          plain.export_table(ref, t), err_msg=t)


def test_sync_sequence_features(client):
    """NONE-pooled (sequence) tables: two ranks' per-id gradients in SYNC
    equal one trainer's with the concatenated ids, halved (Adam)."""
    seq = [{"name": "t_seq", "num_embeddings": 20, "embedding_dim": 4,
            "feature_names": ["f_seq"], "pooling": "NONE",
            "optimizer": {"type": "ADAM", "learning_rate": 0.05}}]
    name, ref = "sync_seq", "sync_seq_ref"
    client.create_collection({"name": name, "tables": seq,
                              "training": {"mode": "SYNC", "trainers": 2}},
                             sharding_type="row_wise")
    client.create_collection({"name": ref, "tables": seq}, sharding_type="row_wise")
    try:
        client.import_table(ref, "t_seq", client.export_table(name, "t_seq"))
        rng = np.random.default_rng(13)
        for step in range(3):
            slices = [batch(rng, 3, features=("f_seq",)) for _ in range(2)]
            ids = [sum(len(b) for b in s["f_seq"]) for s in slices]
            grads = [rng.normal(size=(n, 4)).astype(np.float32) for n in ids]
            run_ranks([lambda r=r: client.apply_sequence_gradients(
                name, kjt_of(slices[r], features=("f_seq",)), {"f_seq": grads[r]},
                step=step, rank=r) for r in range(2)])
            client.apply_sequence_gradients(
                ref, kjt_of(concat(slices, features=("f_seq",)), features=("f_seq",)),
                {"f_seq": np.concatenate(grads) / np.float32(2)})
        np.testing.assert_array_equal(client.export_table(name, "t_seq"),
                                      client.export_table(ref, "t_seq"))
        got = client.lookup_sequence(name, kjt_of({"f_seq": [[1, 2]]}, features=("f_seq",)),
                                     step=3)
        np.testing.assert_array_equal(got["f_seq"], client.export_table(ref, "t_seq")[[1, 2]])
    finally:
        client.drop_collection(name)
        client.drop_collection(ref)


def test_a_step_held_during_a_drain_is_applied_once():
    """Rank 0's SYNC step is held on the workers when one of them is drained
    (its shards copied live to the others, the collection moved to a new
    epoch): the held step is dropped there, rank 0 resends it to the new
    plan, rank 1 sends its own, and the step is applied exactly once: the
    tables equal one trainer's with the global batch (halved)."""
    opt = {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.3}
    with ember.LocalCluster(workers=3) as cluster:
        c = ember.Client(cluster.address, timeout_s=30)
        name, ref = "drained", "drained_ref"
        create(c, name, opt, "SYNC", 2, "row_wise", step_timeout_s=60)
        create(c, ref, opt, None, 1, "row_wise")
        for t in ("t_sum", "t_mean"):
            c.import_table(ref, t, c.export_table(name, t))
        rng = np.random.default_rng(21)
        slices = [batch(rng, 3) for _ in range(2)]
        grads = [rng.normal(size=(3, 12)).astype(np.float32) for _ in range(2)]
        done = {}

        def send(r):
            mine = ember.Client(cluster.address, timeout_s=30)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:  # a trainer resending its step, same id
                try:
                    mine.apply_gradients(name, kjt_of(slices[r]), grads[r],
                                         request_id=f"rank{r}-step0", step=0, rank=r)
                    done[r] = True
                    return
                except (ember.Unavailable, ember.FailedPrecondition, ember.Aborted):
                    time.sleep(0.1)

        first = threading.Thread(target=send, args=(0,))
        first.start()
        time.sleep(0.5)  # held, waiting for rank 1
        assert 0 not in done
        info = c.collection(name)
        victim = next(w["worker_id"] for w in c.list_workers()
                      if w["info"]["address"] == info["worker_addresses"][1])
        assert name in c.drain(victim)
        assert c.collection(name)["plan"]["epoch"] > info["plan"]["epoch"]
        send(1)
        first.join(70)
        assert done == {0: True, 1: True}
        c.apply_gradients(ref, kjt_of(concat(slices)), np.concatenate(grads) / np.float32(2))
        for t in ("t_sum", "t_mean"):
            np.testing.assert_array_equal(c.export_table(name, t), c.export_table(ref, t),
                                          err_msg=t)


def test_bounded_steps_held_during_a_drain_are_applied():
    """BOUNDED(1), two ranks, rank 1 slower: rank 0's updates return once
    held, and a drain moves the collection while some are. The coordinator
    fences the steps first (the highest held anywhere) and lets them apply
    before moving; a rank's later step waits out the move. Every step ends
    applied exactly once: the tables equal one trainer's with the global
    batches (halved)."""
    opt = {"type": "ROWWISE_ADAGRAD", "learning_rate": 0.3}
    with ember.LocalCluster(workers=3) as cluster:
        c = ember.Client(cluster.address, timeout_s=60)
        name, ref = "bounded_drain", "bounded_drain_ref"
        create(c, name, opt, "BOUNDED", 2, "row_wise", max_staleness=1, step_timeout_s=60)
        create(c, ref, opt, None, 1, "row_wise")
        for t in ("t_sum", "t_mean"):
            c.import_table(ref, t, c.export_table(name, t))
        rng = np.random.default_rng(33)
        steps = 10
        plan = [[batch(rng, 3) for _ in range(2)] for _ in range(steps)]
        grads = [[rng.normal(size=(3, 12)).astype(np.float32) for _ in range(2)]
                 for _ in range(steps)]
        progress = [0, 0]

        def rank_fn(r):
            def fn():
                mine = ember.Client(cluster.address, timeout_s=60)
                for s in range(steps):
                    kjt = kjt_of(plan[s][r])
                    deadline = time.monotonic() + 60
                    while True:  # a trainer resending after a move, same id
                        try:
                            mine.lookup(name, kjt, step=s)
                            mine.apply_gradients(name, kjt, grads[s][r],
                                                 request_id=f"r{r}s{s}", step=s, rank=r)
                            break
                        except (ember.Unavailable, ember.FailedPrecondition):
                            assert time.monotonic() < deadline
                            time.sleep(0.05)
                    progress[r] = s + 1
                    if r == 1:
                        time.sleep(0.15)  # rank 0 runs ahead: its steps are held
            return fn

        def drain():
            while progress[0] < 4:
                time.sleep(0.01)
            info = c.collection(name)
            victim = next(w["worker_id"] for w in c.list_workers()
                          if w["info"]["address"] == info["worker_addresses"][1])
            assert name in c.drain(victim)

        run_ranks([rank_fn(0), rank_fn(1), drain])
        for s in range(steps):
            g = np.concatenate(grads[s]) / np.float32(2)
            c.apply_gradients(ref, kjt_of(concat(plan[s])), g.astype(np.float32))
        for t in ("t_sum", "t_mean"):
            np.testing.assert_array_equal(c.export_table(name, t), c.export_table(ref, t),
                                          err_msg=t)
