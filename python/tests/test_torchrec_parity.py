"""Parity with TorchRec itself: a small DLRM-style model (dense MLP over the
pooled embeddings, BCE loss) trained the same N steps with a local
torchrec.EmbeddingBagCollection and with ember.torch.EmbeddingBagCollection
from the same initial weights gives the same losses and the same final
tables. References: torch.optim.SGD and torch.optim.Adagrad on the TorchRec
module's parameters, and FBGEMM's fused CPU row-wise Adagrad through
TorchRec's fuse_embedding_optimizer (TorchRec's unfused RowWiseAdagrad
where FBGEMM refuses the dim). Two workers, row-wise and table-wise
plans; tables of dims 8 and 4, and of dims 10 and 3 (TorchRec's CPU modules
take any dim, and so does Ember on CPU workers: row-wise Adagrad's mean is
over the table's own columns). Needs torchrec (the .venv that
scripts/setup.sh prepares); skipped without it."""

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
torchrec = pytest.importorskip("torchrec")

import ember  # noqa: E402
import ember.torch  # noqa: E402
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor  # noqa: E402
from torchrec.modules.fused_embedding_modules import fuse_embedding_optimizer  # noqa: E402
import torchrec.optim as trec_optim  # noqa: E402

def tables(dims=(8, 4)):
    return [
        EmbeddingBagConfig(name="t_user", embedding_dim=dims[0], num_embeddings=60,
                           feature_names=["user"]),
        # One table behind two features, as TorchRec allows.
        EmbeddingBagConfig(name="t_item", embedding_dim=dims[1], num_embeddings=40,
                           feature_names=["item", "item_last"]),
    ]


TABLES = tables()
FEATURES = ["user", "item", "item_last"]
DENSE = 3
STEPS = 6
LR = 0.2


@pytest.fixture(scope="module")
def client():
    with ember.LocalCluster(workers=2) as cluster:
        yield ember.Client(cluster.address, timeout_s=30)


class Dense(torch.nn.Module):
    """The dense part of the DLRM: bottom MLP over dense features, top
    layer over [bottom, pooled embeddings]."""

    def __init__(self, dims=(8, 4)):
        super().__init__()
        self.bottom = torch.nn.Linear(DENSE, 4)
        self.top = torch.nn.Linear(4 + dims[0] + 2 * dims[1], 1)

    def forward(self, dense, pooled):
        x = torch.cat([torch.relu(self.bottom(dense)), pooled], dim=1)
        return self.top(x).squeeze(1)


def batches(seed, n, batch=16):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        lengths, values = [], []
        for f, rows in (("user", 60), ("item", 40), ("item_last", 40)):
            for _ in range(batch):
                k = int(rng.integers(0, 4))
                lengths.append(k)
                # A few hot ids, so rows repeat within and across bags.
                values.extend(int(v) for v in np.minimum(rng.zipf(1.5, size=k) - 1, rows - 1))
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=FEATURES, values=torch.tensor(values, dtype=torch.int64),
            lengths=torch.tensor(lengths, dtype=torch.int64))
        dense = torch.from_numpy(rng.normal(size=(batch, DENSE)).astype(np.float32))
        labels = torch.from_numpy((rng.random(batch) < 0.3).astype(np.float32))
        out.append((kjt, dense, labels))
    return out


def bce(logit, labels):
    return torch.nn.functional.binary_cross_entropy_with_logits(logit, labels)


CASES = [(opt, sharding, (8, 4)) for opt in ("SGD", "ADAGRAD", "ROWWISE_ADAGRAD")
         for sharding in ("row_wise", "table_wise")]
CASES += [(opt, sharding, (10, 3)) for opt in ("SGD", "ADAGRAD", "ROWWISE_ADAGRAD")
          for sharding in ("row_wise", "column_wise")]


@pytest.mark.parametrize("opt,sharding,dims", CASES)
def test_dlrm_trains_like_torchrec(client, opt, sharding, dims):
    torch.manual_seed(7)
    configs = tables(dims)
    ref_ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    initial = {k: v.detach().clone() for k, v in ref_ebc.state_dict().items()}
    name = f"parity_{opt.lower()}_{sharding}_{dims[0]}_{dims[1]}"
    optimizer = {"type": opt, "learning_rate": LR}
    if opt != "SGD":
        optimizer["eps"] = 1e-8
    ebc = ember.torch.EmbeddingBagCollection(configs, client, name, optimizer=optimizer,
                                             sharding_type=sharding)
    try:
        ebc.load_state_dict(initial)  # the same initial tables
        if opt == "SGD":
            sparse_opt = torch.optim.SGD(ref_ebc.parameters(), lr=LR)
        elif opt == "ADAGRAD":
            sparse_opt = torch.optim.Adagrad(ref_ebc.parameters(), lr=LR, eps=1e-8)
        elif any(d % 4 for d in dims):
            # FBGEMM's TBE asserts embedding_dim % 4 == 0 (CPU too); TorchRec's
            # unfused RowWiseAdagrad is the same formula on any dim.
            sparse_opt = trec_optim.RowWiseAdagrad(ref_ebc.parameters(), lr=LR, eps=1e-8)
        else:  # FBGEMM's fused CPU kernel through TorchRec
            ref_ebc = fuse_embedding_optimizer(
                ref_ebc, optimizer_type=trec_optim.RowWiseAdagrad,
                optimizer_kwargs={"lr": LR, "eps": 1e-8}, device=torch.device("cpu"))
            ref_ebc.load_state_dict(initial)
            sparse_opt = None
        dense_ref = Dense(dims)
        dense_ember = copy.deepcopy(dense_ref)
        opt_ref = torch.optim.SGD(dense_ref.parameters(), lr=0.1)
        opt_ember = torch.optim.SGD(dense_ember.parameters(), lr=0.1)
        for step, (kjt, dense, labels) in enumerate(batches(3, STEPS)):
            opt_ref.zero_grad()
            if sparse_opt is not None:
                sparse_opt.zero_grad()
            loss_ref = bce(dense_ref(dense, ref_ebc(kjt).values()), labels)
            loss_ref.backward()
            opt_ref.step()
            if sparse_opt is not None:
                sparse_opt.step()

            opt_ember.zero_grad()
            kt = ebc(kjt)  # the torchrec KJT as it is
            assert isinstance(kt, torchrec.KeyedTensor)  # torchrec's own type back
            assert kt.keys() == FEATURES
            loss_ember = bce(dense_ember(dense, kt.values()), labels)
            loss_ember.backward()
            opt_ember.step()
            np.testing.assert_allclose(float(loss_ember.detach()), float(loss_ref.detach()), rtol=1e-5,
                                       err_msg=f"step {step}")
        ours = ebc.state_dict()
        theirs = ref_ebc.state_dict()
        for t in configs:
            key = f"embedding_bags.{t.name}.weight"
            np.testing.assert_allclose(ours[key].numpy(), theirs[key].detach().numpy(),
                                       rtol=1e-4, atol=1e-6, err_msg=key)
            # The tables moved: the comparison is not between untouched copies.
            assert not np.allclose(ours[key].numpy(), initial[key].numpy())
    finally:
        client.drop_collection(name)


def test_create_collection_from_embedding_bag_configs(client):
    info = client.create_collection({"name": "from_configs", "tables": TABLES},
                                    sharding_type="table_wise")
    try:
        tables = {t["name"]: t for t in info["spec"]["tables"]}
        assert tables["t_item"]["feature_names"] == ["item", "item_last"]
        assert int(tables["t_user"]["num_embeddings"]) == 60
        assert client.export_table("from_configs", "t_item").shape == (40, 4)
    finally:
        client.drop_collection("from_configs")


def test_torchrec_kjt_reaches_the_client_without_a_copy():
    """A torchrec KJT's ids, lengths and weights are handed on as views of the
    tensors' memory (the extension reads them in place when they are
    C-contiguous int64 / float32)."""
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["user", "item"], values=torch.arange(6, dtype=torch.int64),
        lengths=torch.tensor([1, 2, 2, 1]), weights=torch.ones(6))
    e = ember._as_kjt(kjt)
    assert np.shares_memory(e.values, kjt.values().numpy())
    assert np.shares_memory(e.lengths, kjt.lengths().numpy())
    assert np.shares_memory(e.weights, kjt.weights().numpy())
