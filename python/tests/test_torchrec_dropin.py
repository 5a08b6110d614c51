"""ember.torch.EmbeddingBagCollection as a drop-in for TorchRec's: TorchRec's
own model classes (DLRM, DLRM_DCN, DLRM_Projection, DLRM_Transformer,
SimpleDeepFMNN, and DLRMTrain around DLRM) take it unmodified and train to
the same losses and tables as with torchrec.EmbeddingBagCollection
(torch.optim.SGD on its parameters as the reference); TorchRec's semantics where a user could notice
them (weights on unweighted tables ignored, KeyError for a missing feature,
other features ignored, the output's key order); attaching with
create=False refuses other tables; the module pickles, deep-copies and
torch.saves as a reconnecting handle. Needs torchrec; skipped without it."""

import copy
import io
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchrec = pytest.importorskip("torchrec")

import ember  # noqa: E402
import ember.torch  # noqa: E402
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.datasets.utils import Batch  # noqa: E402
from torchrec.models import deepfm, dlrm  # noqa: E402
from torchrec.models.experimental import transformerdlrm  # noqa: E402

DIM = 8
DENSE = 5
LR = 0.3


def configs():
    return [
        EmbeddingBagConfig(name="t_user", embedding_dim=DIM, num_embeddings=50,
                           feature_names=["user"]),
        EmbeddingBagConfig(name="t_item", embedding_dim=DIM, num_embeddings=30,
                           feature_names=["item", "item_prev"]),
    ]


FEATURES = ["user", "item", "item_prev"]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("ember_checkpoints")
    with ember.LocalCluster(workers=2, extra_flags=[f"--checkpoint_dir={root}"]) as cluster:
        yield ember.Client(cluster.address, timeout_s=30)


def kjt_batch(rng, batch=8, keys=FEATURES, weights=False):
    rows = {"user": 50, "item": 30, "item_prev": 30, "other": 1000}
    lengths, values = [], []
    for f in keys:
        for _ in range(batch):
            k = int(rng.integers(0, 4))
            lengths.append(k)
            values.extend(int(v) for v in rng.integers(0, rows[f], size=k))
    w = torch.from_numpy(rng.uniform(0.2, 2.0, size=len(values)).astype(np.float32))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys), values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int64), weights=w if weights else None)


def pair(client, name, sharding="row_wise", **kwargs):
    """TorchRec's module and Ember's over the same initial tables."""
    torch.manual_seed(11)
    ref = torchrec.EmbeddingBagCollection(tables=configs(), device=torch.device("cpu"), **kwargs)
    ours = ember.torch.EmbeddingBagCollection(configs(), client, name,
                                              optimizer={"type": "SGD", "learning_rate": LR},
                                              sharding_type=sharding, **kwargs)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def train_side_by_side(ref, model, rng, steps):
    """`steps` SGD steps (lr LR) of the reference model and ours, each
    model(dense, kjt) under BCE, on the same batches: their losses must
    match within 1e-5 at every step."""
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(steps):
        kjt = kjt_batch(rng)
        dense = torch.from_numpy(rng.normal(size=(8, DENSE)).astype(np.float32))
        labels = torch.from_numpy((rng.random(8) < 0.4).astype(np.float32))
        losses = []
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                m(dense, kjt).squeeze(-1), labels)
            loss.backward()
            o.step()
            losses.append(float(loss.detach()))
        np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5, err_msg=f"step {step}")


def _no_dropout(model):
    """The model with its dropout off, so that two copies trained side by
    side draw no random masks (the transformer's)."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        if isinstance(m, torch.nn.MultiheadAttention):
            m.dropout = 0.0
    return model


MODELS = {
    "DLRM": lambda ebc: dlrm.DLRM(embedding_bag_collection=ebc, dense_in_features=DENSE,
                                  dense_arch_layer_sizes=[16, DIM],
                                  over_arch_layer_sizes=[16, 1]),
    "DLRM_DCN": lambda ebc: dlrm.DLRM_DCN(embedding_bag_collection=ebc,
                                          dense_in_features=DENSE,
                                          dense_arch_layer_sizes=[16, DIM],
                                          over_arch_layer_sizes=[16, 1], dcn_num_layers=2,
                                          dcn_low_rank_dim=4),
    "DLRM_Projection": lambda ebc: dlrm.DLRM_Projection(
        embedding_bag_collection=ebc, dense_in_features=DENSE,
        dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1],
        interaction_branch1_layer_sizes=[12, 2 * DIM],
        interaction_branch2_layer_sizes=[12, 2 * DIM]),
    "DLRM_Transformer": lambda ebc: _no_dropout(transformerdlrm.DLRM_Transformer(
        embedding_bag_collection=ebc, dense_in_features=DENSE,
        dense_arch_layer_sizes=[16, DIM], over_arch_layer_sizes=[16, 1], nhead=2,
        ntransformer_layers=1)),
    "SimpleDeepFMNN": lambda ebc: deepfm.SimpleDeepFMNN(
        num_dense_features=DENSE, embedding_bag_collection=ebc, hidden_layer_size=16,
        deep_fm_dimension=6),
}


@pytest.mark.parametrize("model_name", list(MODELS))
def test_torchrec_models_train_with_embers_module(client, model_name):
    name = f"dropin_{model_name.lower()}"
    ref_ebc, ebc = pair(client, name)
    try:
        torch.manual_seed(5)
        ref_model = MODELS[model_name](ref_ebc)
        torch.manual_seed(5)
        model = MODELS[model_name](ebc)  # TorchRec's class, Ember's module, no shim
        # Same dense weights: the models were built from the same seed.
        for (k, a), (_, b) in zip(
                [(k, v) for k, v in ref_model.state_dict().items() if "embedding_bags" not in k],
                [(k, v) for k, v in model.state_dict().items() if "embedding_bags" not in k]):
            assert torch.equal(a, b), k
        # Ember's module holds no parameter: the model's are the dense ones.
        assert not any("embedding_bags" in n for n, _ in model.named_parameters())
        train_side_by_side(ref_model, model, np.random.default_rng(3), steps=4)
        ours, theirs = model.state_dict(), ref_model.state_dict()
        assert set(ours) == set(theirs)
        for key in theirs:
            np.testing.assert_allclose(ours[key].detach().numpy(), theirs[key].detach().numpy(),
                                       rtol=1e-4, atol=1e-6, err_msg=key)
        # The tables moved: not a comparison of untouched copies.
        key = "sparse_arch.embedding_bag_collection.embedding_bags.t_user.weight"
        if key in theirs:
            assert not torch.allclose(ours[key], torch.from_numpy(
                ebc._client.export_table(name, "t_user")) * 0)
    finally:
        client.drop_collection(name)


def test_dlrm_train_and_eval(client):
    """DLRMTrain over DLRM (its loss), then eval mode (forward only)."""
    ref_ebc, ebc = pair(client, "dropin_dlrmtrain")
    try:
        torch.manual_seed(2)
        ref = dlrm.DLRMTrain(MODELS["DLRM"](ref_ebc))
        torch.manual_seed(2)
        ours = dlrm.DLRMTrain(MODELS["DLRM"](ebc))
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        opt = torch.optim.SGD(ours.parameters(), lr=LR)
        rng = np.random.default_rng(9)
        for _ in range(3):
            batch = Batch(dense_features=torch.randn(8, DENSE), sparse_features=kjt_batch(rng),
                          labels=torch.randint(0, 2, (8,)))
            for m, o in ((ref, ref_opt), (ours, opt)):
                o.zero_grad()
                loss, _ = m(batch)
                loss.backward()
                o.step()
            with torch.no_grad():
                np.testing.assert_allclose(float(ours(batch)[0]), float(ref(batch)[0]),
                                           rtol=1e-5)
        ours.eval()
        ref.eval()
        before = ebc._client.export_table("dropin_dlrmtrain", "t_item")
        with torch.no_grad():
            batch = Batch(dense_features=torch.randn(8, DENSE), sparse_features=kjt_batch(rng),
                          labels=torch.randint(0, 2, (8,)))
            np.testing.assert_allclose(ours(batch)[1][1].numpy(), ref(batch)[1][1].numpy(),
                                       rtol=1e-5, atol=1e-6)
        assert np.array_equal(before, ebc._client.export_table("dropin_dlrmtrain", "t_item"))
    finally:
        client.drop_collection("dropin_dlrmtrain")


def test_torchrec_interface(client):
    ebc = ember.torch.EmbeddingBagCollection(configs(), client, "dropin_iface",
                                             sharding_type="table_wise",
                                             optimizer={"type": "SGD", "learning_rate": LR})
    try:
        cfgs = ebc.embedding_bag_configs()
        assert [c.name for c in cfgs] == ["t_user", "t_item"]
        assert cfgs[1].feature_names == ["item", "item_prev"]
        assert ebc.is_weighted() is False and ebc._is_weighted is False
        assert ebc.device == torch.device("cpu") and ebc._device == torch.device("cpu")
        assert ebc._embedding_names == FEATURES
        assert ebc._feature_names == [["user"], ["item", "item_prev"]]
        assert ebc._lengths_per_embedding == [DIM, DIM, DIM]
        assert list(ebc.embedding_bags) == ["t_user", "t_item"]
        bag = ebc.embedding_bags["t_item"]
        assert (bag.num_embeddings, bag.embedding_dim, bag.mode) == (30, DIM, "sum")
        assert tuple(bag.weight.shape) == (30, DIM)
        assert list(ebc.parameters()) == []
        # reset_parameters draws new tables (TorchRec's default init:
        # uniform in +-sqrt(1/rows)) and writes them to the workers.
        before = bag.weight.clone()
        torch.manual_seed(0)
        ebc.reset_parameters()
        after = bag.weight
        assert not torch.equal(before, after)
        bound = (1.0 / 30) ** 0.5
        assert float(after.abs().max()) <= bound + 1e-7
        expected = torch.empty(50, DIM)
        torch.manual_seed(0)
        torch.nn.init.uniform_(expected, -(1.0 / 50) ** 0.5, (1.0 / 50) ** 0.5)
        assert torch.equal(ebc.embedding_bags["t_user"].weight, expected)
        # Dict tables become config objects with the same fields.
        d = ember.torch.EmbeddingBagCollection(
            [{"name": "d", "num_embeddings": 7, "embedding_dim": 4, "feature_names": ["x"],
              "pooling": "MEAN"}], client, "dropin_iface_dict")
        try:
            c = d.embedding_bag_configs()[0]
            assert (c.name, c.num_embeddings, c.embedding_dim, c.feature_names) == \
                ("d", 7, 4, ["x"])
            assert d.embedding_bags["d"].mode == "mean"
        finally:
            client.drop_collection("dropin_iface_dict")
    finally:
        client.drop_collection("dropin_iface")


def test_torchrec_semantics(client):
    ref, ours = pair(client, "dropin_semantics")
    ref_w, ours_w = pair(client, "dropin_semantics_w", is_weighted=True)
    try:
        ours.eval()
        ours_w.eval()
        rng = np.random.default_rng(4)
        # Weights on unweighted tables are ignored; applied when weighted.
        kjt = kjt_batch(rng, weights=True)
        with torch.no_grad():
            got, want = ours(kjt), ref(kjt)
            assert got.keys() == want.keys() == FEATURES
            np.testing.assert_allclose(got.values().numpy(), want.values().numpy(), rtol=1e-6,
                                       atol=1e-6)
            got_w, want_w = ours_w(kjt), ref_w(kjt)
            np.testing.assert_allclose(got_w.values().numpy(), want_w.values().numpy(),
                                       rtol=1e-5, atol=1e-6)
            assert not np.allclose(got_w.values().numpy(), got.values().numpy())
        # A KJT in another order, with a feature of no table: the output is
        # in table order, the other feature ignored.
        shuffled = kjt_batch(rng, keys=["other", "item_prev", "user", "item"])
        with torch.no_grad():
            got, want = ours(shuffled), ref(shuffled)
        assert got.keys() == want.keys() == FEATURES
        np.testing.assert_allclose(got.values().numpy(), want.values().numpy(), rtol=1e-6,
                                   atol=1e-6)
        # A missing feature: KeyError naming it, as TorchRec's.
        missing = kjt_batch(rng, keys=["user", "item"])
        with pytest.raises(KeyError) as theirs:
            ref(missing)
        with pytest.raises(KeyError) as mine:
            ours(missing)
        assert str(mine.value) == str(theirs.value) == "'item_prev'"
        # Training through a KJT with an extra feature and weights updates
        # only this module's features, unweighted.
        ours.train()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        kjt = kjt_batch(rng, keys=["item", "other", "user", "item_prev"], weights=True)
        ref_opt.zero_grad()
        ref(kjt).values().sum().backward()
        ref_opt.step()
        ours(kjt).values().sum().backward()
        for t in ("t_user", "t_item"):
            np.testing.assert_allclose(ours.embedding_bags[t].weight.numpy(),
                                       ref.embedding_bags[t].weight.detach().numpy(),
                                       rtol=1e-5, atol=1e-6, err_msg=t)
    finally:
        client.drop_collection("dropin_semantics")
        client.drop_collection("dropin_semantics_w")


def test_create_false_attaches_only_to_the_same_tables(client):
    ebc = ember.torch.EmbeddingBagCollection(configs(), client, "dropin_attach",
                                             optimizer={"type": "SGD", "learning_rate": LR})
    try:
        again = ember.torch.EmbeddingBagCollection(configs(), client, "dropin_attach",
                                                   create=False)
        assert again.embedding_bag_configs()[0].name == "t_user"
        ember.torch.EmbeddingBagCollection(configs(), client, "dropin_attach", create=False,
                                           optimizer={"type": "SGD", "learning_rate": LR})
        other = configs()
        other[1] = EmbeddingBagConfig(name="t_item", embedding_dim=DIM, num_embeddings=31,
                                      feature_names=["item", "item_prev"])
        with pytest.raises(ember.FailedPrecondition, match="'t_item': num_embeddings is 30"):
            ember.torch.EmbeddingBagCollection(other, client, "dropin_attach", create=False)
        other = configs()
        other[0] = EmbeddingBagConfig(name="t_user", embedding_dim=DIM, num_embeddings=50,
                                      feature_names=["user_id"])
        with pytest.raises(ember.FailedPrecondition, match="'t_user': feature_names"):
            ember.torch.EmbeddingBagCollection(other, client, "dropin_attach", create=False)
        with pytest.raises(ember.FailedPrecondition, match="optimizer.learning_rate"):
            ember.torch.EmbeddingBagCollection(configs(), client, "dropin_attach", create=False,
                                               optimizer={"type": "SGD", "learning_rate": 0.5})
        with pytest.raises(ember.FailedPrecondition, match="holds tables"):
            ember.torch.EmbeddingBagCollection(configs()[:1], client, "dropin_attach",
                                               create=False)
    finally:
        client.drop_collection("dropin_attach")


def test_module_pickles_as_a_reconnecting_handle(client):
    ref, ours = pair(client, "dropin_pickle")
    try:
        ours.eval()
        kjt = kjt_batch(np.random.default_rng(6))
        with torch.no_grad():
            want = ours(kjt).values().numpy()
        buf = io.BytesIO()
        torch.save(ours, buf)
        buf.seek(0)
        for loaded in (pickle.loads(pickle.dumps(ours)), copy.deepcopy(ours),
                       torch.load(buf, weights_only=False)):
            assert loaded is not ours and loaded._client is not ours._client
            assert loaded.collection == "dropin_pickle" and not loaded.training
            assert [c.name for c in loaded.embedding_bag_configs()] == ["t_user", "t_item"]
            with torch.no_grad():
                np.testing.assert_array_equal(loaded(kjt).values().numpy(), want)
        # A copy shares the tables: its update is seen by the original.
        twin = copy.deepcopy(ours)
        twin.train()
        twin(kjt).values().sum().backward()
        with torch.no_grad():
            assert not np.allclose(ours(kjt).values().numpy(), want)
        # The connection itself is not what is pickled.
        assert b"auth_token'" not in pickle.dumps(ours)
    finally:
        client.drop_collection("dropin_pickle")


def test_local_cluster_says_why_it_did_not_come_up():
    with pytest.raises(ember.Unavailable, match="no_such_flag"):
        with ember.LocalCluster(workers=1, extra_flags=["--no_such_flag=1"], timeout_s=30):
            pass


def test_embedding_collection_matches_torchrec(client):
    """Sequence features: ember.torch.EmbeddingCollection against
    torchrec.EmbeddingCollection (SGD on its parameters), forward and three
    training steps; a missing feature raises KeyError."""
    from torchrec import EmbeddingCollection, EmbeddingConfig
    cfgs = lambda: [EmbeddingConfig(name="s_user", embedding_dim=DIM, num_embeddings=50,  # noqa: E731
                                    feature_names=["user"]),
                    EmbeddingConfig(name="s_item", embedding_dim=DIM, num_embeddings=30,
                                    feature_names=["item", "item_prev"])]
    torch.manual_seed(4)
    ref = EmbeddingCollection(tables=cfgs(), device=torch.device("cpu"), need_indices=True)
    ours = ember.torch.EmbeddingCollection(cfgs(), client, "dropin_seq", need_indices=True,
                                           optimizer={"type": "SGD", "learning_rate": LR})
    try:
        for c in cfgs():
            ours.embeddings[c.name].load_state_dict(
                {"weight": ref.embeddings[c.name].weight.detach()})
        assert ours.embedding_dim() == DIM and ours.need_indices()
        assert ours.embedding_names_by_table() == [["user"], ["item", "item_prev"]]
        ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
        rng = np.random.default_rng(8)
        head = torch.linspace(-1, 1, DIM)
        for step in range(3):
            kjt = kjt_batch(rng, keys=["item_prev", "other", "user", "item"], weights=True)
            got, want = ours(kjt), ref(kjt)
            assert list(got) == list(want) == FEATURES
            for f in FEATURES:
                np.testing.assert_allclose(got[f].values().detach().numpy(),
                                           want[f].values().detach().numpy(), rtol=1e-6,
                                           atol=1e-6, err_msg=f"step {step} {f}")
                assert torch.equal(got[f].lengths(), want[f].lengths())
                assert torch.equal(got[f].weights(), want[f].weights())  # the ids
            ref_opt.zero_grad()
            sum(((want[f].values() * head) ** 2).sum() for f in FEATURES).backward()
            ref_opt.step()
            sum(((got[f].values() * head) ** 2).sum() for f in FEATURES).backward()
        for c in cfgs():
            np.testing.assert_allclose(ours.embeddings[c.name].weight.numpy(),
                                       ref.embeddings[c.name].weight.detach().numpy(),
                                       rtol=1e-5, atol=1e-6, err_msg=c.name)
        with pytest.raises(KeyError):
            ours(kjt_batch(rng, keys=["user", "item"]))
        copy_ = pickle.loads(pickle.dumps(ours))
        assert copy_.collection == "dropin_seq"
    finally:
        client.drop_collection("dropin_seq")


def test_dmp_with_ember_sharder_trains_like_torchrec(client, tmp_path):
    """TorchRec's DistributedModelParallel over an unmodified DLRM with
    EmberSharder: the EBC is replaced by Ember's module over a collection
    holding the model's own initial tables, the dense part is DMP's (DDP),
    and training gives the losses of the same DLRM trained locally with
    TorchRec's module (one rank over gloo)."""
    import socket
    import torch.distributed as dist
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from ember.torchrec import EmberSharder
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                            world_size=1)
    sharder = EmberSharder(client, optimizer={"type": "SGD", "learning_rate": LR},
                           prefix="dropin_dmp_")
    name = sharder.collection_name("sparse_arch.embedding_bag_collection")
    try:
        torch.manual_seed(1)
        ref_ebc = torchrec.EmbeddingBagCollection(tables=configs(), device=torch.device("cpu"))
        ebc = torchrec.EmbeddingBagCollection(tables=configs(), device=torch.device("cpu"))
        ebc.load_state_dict(ref_ebc.state_dict())
        torch.manual_seed(5)
        ref = MODELS["DLRM"](ref_ebc)
        torch.manual_seed(5)
        model = DistributedModelParallel(MODELS["DLRM"](ebc), device=torch.device("cpu"),
                                         sharders=[sharder])
        inner = model.module.sparse_arch.embedding_bag_collection
        assert isinstance(inner, ember.torch.EmbeddingBagCollection)
        assert inner.collection == name == "dropin_dmp_sparse_arch_embedding_bag_collection"
        np.testing.assert_array_equal(inner.embedding_bags["t_user"].weight.numpy(),
                                      ref_ebc.embedding_bags["t_user"].weight.detach().numpy())
        train_side_by_side(ref, model, np.random.default_rng(12), steps=3)
        np.testing.assert_allclose(inner.embedding_bags["t_item"].weight.numpy(),
                                   ref_ebc.embedding_bags["t_item"].weight.detach().numpy(),
                                   rtol=1e-4, atol=1e-6)
        # DCP over DMP's state dict: the tables as an Ember checkpoint (no
        # copy in the trainer), restored by loading; the dense part as DCP's.
        import torch.distributed.checkpoint as dcp
        assert inner.table_state == "checkpoint"
        sd = model.state_dict()
        table_keys = [k for k, v in sd.items() if isinstance(v, ember.torch.TableCheckpoint)]
        assert sorted(k.split(".")[-2] for k in table_keys) == ["t_item", "t_user"]
        saved = _tables(client, name)
        dense = {k: v.detach().clone() for k, v in sd.items() if torch.is_tensor(v)}
        dcp.save(model.state_dict(), checkpoint_id=str(tmp_path / "dmp"))
        _one_step(model, np.random.default_rng(4))
        assert not np.allclose(_tables(client, name)["t_item"], saved["t_item"])
        state = model.state_dict()
        dcp.load(state, checkpoint_id=str(tmp_path / "dmp"))
        model.load_state_dict(state)
        for t, w in _tables(client, name).items():
            np.testing.assert_array_equal(w, saved[t], err_msg=t)
        for k, v in model.state_dict().items():
            if torch.is_tensor(v):
                assert torch.equal(v, dense[k]), k
    finally:
        dist.destroy_process_group()
        try:
            client.drop_collection(name)
        except ember.NotFound:
            pass


def _tables(client, name):
    return {t: client.export_table(name, t) for t in ("t_user", "t_item")}


def _one_step(model, rng):
    kjt = kjt_batch(rng)
    dense = torch.from_numpy(rng.normal(size=(8, DENSE)).astype(np.float32))
    model(dense, kjt).sum().backward()


def test_dcp_saves_an_ember_checkpoint_and_loads_by_restoring(client, tmp_path):
    """table_state="checkpoint": torch.distributed.checkpoint writes the
    dense weights and, for the tables, where an Ember checkpoint of them is
    (taken once, when DCP writes the entries); loading restores it, optimizer
    state included: the step after the load equals the step after the save."""
    import torch.distributed.checkpoint as dcp
    name = "dropin_dcp"
    ebc = ember.torch.EmbeddingBagCollection(
        configs(), client, name, optimizer={"type": "ROWWISE_ADAGRAD", "learning_rate": LR},
        table_state="checkpoint")
    try:
        torch.manual_seed(5)
        model = MODELS["DLRM"](ebc)
        rng = np.random.default_rng(21)
        for _ in range(2):
            _one_step(model, rng)
        # state_dict() copies no table and takes nothing yet.
        before = len(client.list_checkpoints(name))
        sd = model.state_dict()
        entry = sd["sparse_arch.embedding_bag_collection.embedding_bags.t_user.weight"]
        assert isinstance(entry, ember.torch.TableCheckpoint) and entry.path is None
        assert (entry.num_embeddings, entry.embedding_dim) == (50, DIM)
        assert len(client.list_checkpoints(name)) == before
        saved_tables = _tables(client, name)
        saved_dense = {k: v.detach().clone() for k, v in sd.items() if torch.is_tensor(v)}
        dcp.save({"model": model}, checkpoint_id=str(tmp_path / "dcp"))
        catalogue = client.list_checkpoints(name)
        assert len(catalogue) == before + 1  # one checkpoint for both tables
        # The step after the save, then back to the save and the same step.
        step_rng_state = np.random.default_rng(99)
        _one_step(model, step_rng_state)
        after_step = _tables(client, name)
        assert not np.allclose(after_step["t_item"], saved_tables["t_item"])
        dcp.load({"model": model}, checkpoint_id=str(tmp_path / "dcp"))
        assert len(client.list_checkpoints(name)) == before + 1  # loading takes none
        for t, w in _tables(client, name).items():
            np.testing.assert_array_equal(w, saved_tables[t], err_msg=t)
        for k, v in model.state_dict().items():
            if torch.is_tensor(v):
                assert torch.equal(v, saved_dense[k]), k
        _one_step(model, np.random.default_rng(99))
        for t, w in _tables(client, name).items():  # Adagrad's state came back too
            np.testing.assert_allclose(w, after_step[t], rtol=1e-6, atol=1e-7, err_msg=t)

        # torch.save / torch.load of the state dict: the same, through pickle.
        buf = io.BytesIO()
        torch.save(ebc.state_dict(), buf)
        assert len(client.list_checkpoints(name)) == before + 2
        at_save = _tables(client, name)
        _one_step(model, rng)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert {e.path for e in loaded.values()} == {client.list_checkpoints(name)[-1]["path"]}
        ebc.load_state_dict(loaded)
        for t, w in _tables(client, name).items():
            np.testing.assert_array_equal(w, at_save[t], err_msg=t)

        # Refused before anything changes: a checkpoint of other shapes, one
        # table missing, two checkpoints.
        current = _tables(client, name)
        bad = dict(loaded)
        k = "embedding_bags.t_user.weight"
        bad[k] = ember.torch.TableCheckpoint(name, "t_user", 51, DIM, loaded[k].path)
        with pytest.raises(ValueError, match=r"the checkpoint's table is \[51, 8\]"):
            ebc.load_state_dict(bad)
        bad = {"embedding_bags.t_item.weight": loaded["embedding_bags.t_item.weight"]}
        with pytest.raises(ValueError, match=r"no checkpoint entry for \['t_user'\]"):
            ebc.load_state_dict(bad, strict=False)
        bad = dict(loaded)
        bad[k] = ember.torch.TableCheckpoint(name, "t_user", 50, DIM, "/elsewhere")
        with pytest.raises(ValueError, match="one checkpoint is needed"):
            ebc.load_state_dict(bad)
        for t, w in _tables(client, name).items():
            np.testing.assert_array_equal(w, current[t], err_msg=t)
        with pytest.raises(ValueError, match="table_state must be"):
            ember.torch.EmbeddingBagCollection(configs(), client, name, create=False,
                                               table_state="lazy")
    finally:
        client.drop_collection(name)


def test_dcp_over_two_dmp_ranks_restores_once(client, tmp_path):
    """Two DMP ranks (processes) over gloo: one DCP save takes one Ember
    checkpoint; a load restores it on rank 0 while rank 1 waits; both then
    read the saved tables and dense weights and train on (dmp_ranks.py)."""
    from rank_processes import run_rank_processes
    run_rank_processes("dmp_ranks.py", lambda r: [f"--coordinator={client.address}",
                                                  f"--dir={tmp_path / 'dcp'}"], timeout=120)
