"""ember.torch.EmbeddingBagCollection against PyTorch itself: the forward
against torch.nn.EmbeddingBag, a training step against torch autograd with
torch.optim.SGD / Adagrad on a local copy of the same tables."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import ember  # noqa: E402
from ember.torch import EmbeddingBagCollection  # noqa: E402

TABLES = [
    {"name": "t_sum", "num_embeddings": 60, "embedding_dim": 8, "feature_names": ["f_sum"],
     "pooling": "SUM"},
    {"name": "t_mean", "num_embeddings": 40, "embedding_dim": 4, "feature_names": ["f_mean"],
     "pooling": "MEAN"},
]


@pytest.fixture(scope="module")
def client():
    with ember.LocalCluster(workers=2) as cluster:
        yield ember.Client(cluster.address, timeout_s=20)


def batch(rng, weighted):
    jagged = {"f_sum": [list(rng.integers(0, 60, size=rng.integers(0, 4))) for _ in range(5)],
              "f_mean": [list(rng.integers(0, 40, size=rng.integers(1, 4))) for _ in range(5)]}
    weights = None
    if weighted:
        weights = {k: [list(rng.uniform(0.5, 1.5, size=len(b))) for b in v]
                   for k, v in jagged.items()}
        weights["f_mean"] = [[1.0] * len(b) for b in jagged["f_mean"]]
    return jagged, weights


def local_bags(tables):
    """torch.nn.EmbeddingBag copies of the collection's tables."""
    return {t["name"]: torch.nn.EmbeddingBag.from_pretrained(
        torch.tensor(tables[t["name"]]), freeze=False, mode=t["pooling"].lower())
        for t in TABLES}


def local_forward(bags, jagged, weights):
    outs = []
    for t, f in (("t_sum", "f_sum"), ("t_mean", "f_mean")):
        ids = torch.tensor([i for b in jagged[f] for i in b], dtype=torch.long)
        offsets = torch.tensor(np.cumsum([0] + [len(b) for b in jagged[f]])[:-1], dtype=torch.long)
        psw = None
        if weights is not None and f == "f_sum":
            psw = torch.tensor([w for b in weights[f] for w in b], dtype=torch.float32)
        outs.append(bags[t](ids, offsets, per_sample_weights=psw))
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize("optimizer,sharding_type", [
    ({"type": "SGD", "learning_rate": 0.3}, "row_wise"),
    ({"type": "SGD", "learning_rate": 0.3}, "table_wise"),
    ({"type": "ADAGRAD", "learning_rate": 0.1, "eps": 1e-8}, "row_wise"),
    ({"type": "ADAGRAD", "learning_rate": 0.1, "eps": 1e-8}, "column_wise"),
])
def test_training_matches_torch(client, optimizer, sharding_type):
    name = f"tt_{optimizer['type'].lower()}_{sharding_type}"
    # Weighted (TorchRec's is_weighted): the odd steps' per-id weights apply.
    ebc = EmbeddingBagCollection(TABLES, client, name, optimizer=optimizer,
                                 sharding_type=sharding_type, is_weighted=True)
    try:
        assert list(ebc.parameters()) == []
        tables = {t["name"]: client.export_table(name, t["name"]) for t in TABLES}
        bags = local_bags(tables)
        params = [b.weight for b in bags.values()]
        if optimizer["type"] == "SGD":
            local_opt = torch.optim.SGD(params, lr=optimizer["learning_rate"])
        else:
            local_opt = torch.optim.Adagrad(params, lr=optimizer["learning_rate"], eps=1e-8)
        head = torch.linspace(-1, 1, 12)
        rng = np.random.default_rng(5)
        for step in range(3):
            jagged, weights = batch(rng, weighted=step % 2 == 1)
            kjt = ember.KeyedJaggedTensor.from_jagged(jagged, weights)
            kt = ebc(kjt)
            assert kt.keys() == ["f_sum", "f_mean"] and kt.length_per_key() == [8, 4]
            want = local_forward(bags, jagged, weights)
            np.testing.assert_allclose(kt.values().detach().numpy(), want.detach().numpy(),
                                       rtol=1e-5, atol=1e-6)
            loss = ((kt.values() * head) ** 2).sum()
            loss.backward()
            local_opt.zero_grad()
            ((want * head) ** 2).sum().backward()
            local_opt.step()
        state = ebc.state_dict()
        for t in TABLES:
            np.testing.assert_allclose(state[f"embedding_bags.{t['name']}.weight"].numpy(),
                                       bags[t["name"]].weight.detach().numpy(), rtol=1e-4,
                                       atol=1e-6)
    finally:
        client.drop_collection(name)


def test_no_grad_and_eval_only_look_up(client):
    ebc = EmbeddingBagCollection(TABLES, client, "ng", optimizer={"type": "SGD",
                                                                  "learning_rate": 1.0})
    try:
        before = client.export_table("ng", "t_sum")
        kjt = ember.KeyedJaggedTensor.from_jagged({"f_sum": [[1, 2]], "f_mean": [[3]]})
        with torch.no_grad():
            assert not ebc(kjt).values().requires_grad
        ebc.eval()
        out = ebc(kjt).values()
        assert not out.requires_grad
        ebc.train()
        np.testing.assert_array_equal(client.export_table("ng", "t_sum"), before)
    finally:
        client.drop_collection("ng")


def test_state_dict_round_trip_uses_torchrec_names(client):
    ebc = EmbeddingBagCollection(TABLES, client, "sd", optimizer={"type": "SGD",
                                                                  "learning_rate": 0.1})
    try:
        state = ebc.state_dict()
        assert sorted(state) == ["embedding_bags.t_mean.weight", "embedding_bags.t_sum.weight"]
        new = {k: torch.rand_like(v) for k, v in state.items()}
        ebc.load_state_dict(new)
        for k, v in ebc.state_dict().items():
            np.testing.assert_array_equal(v.numpy(), new[k].numpy())
        with pytest.raises(RuntimeError):  # strict: a missing table is an error
            ebc.load_state_dict({"embedding_bags.t_sum.weight": new["embedding_bags.t_sum.weight"]})
        other = EmbeddingBagCollection(TABLES, client, "sd", create=False)  # attach
        np.testing.assert_array_equal(other.state_dict()["embedding_bags.t_sum.weight"].numpy(),
                                      new["embedding_bags.t_sum.weight"].numpy())
    finally:
        client.drop_collection("sd")


def train_plain_and_pipelined(client, prefix, make_batches, calls):
    """Trains `prefix`_plain with the plain loop and `prefix`_pipelined with
    TrainPipeline on make_batches() (tables from zero, the dense part fixed)
    and checks that they end with the same tables, each run looking every
    batch up once ("lookup" entries the caller's counting wrapper appends
    to `calls`) and progress() ending with StopIteration."""
    from ember.torch import TrainPipeline

    results = {}
    for mode in ("plain", "pipelined"):
        name = f"{prefix}_{mode}"
        ebc = EmbeddingBagCollection(TABLES, client, name,
                                     optimizer={"type": "SGD", "learning_rate": 0.5})
        try:
            ebc.load_state_dict({"embedding_bags.t_sum.weight": torch.zeros(60, 8),
                                 "embedding_bags.t_mean.weight": torch.zeros(40, 4)})
            head = torch.nn.Linear(12, 12)
            torch.nn.init.eye_(head.weight)
            torch.nn.init.zeros_(head.bias)
            opt = torch.optim.SGD(head.parameters(), lr=0.0)  # dense part fixed

            def model(batch):
                out = head(ebc(batch["kjt"]).values())
                return ((out - batch["target"]) ** 2).sum()

            batches = make_batches()
            calls.clear()
            if mode == "plain":
                for b in batches:
                    opt.zero_grad()
                    model(b).backward()
                    opt.step()
            else:
                pipeline = TrainPipeline(model, opt, ebc, sparse=lambda b: b["kjt"])
                it = iter(batches)
                for _ in range(len(batches)):
                    pipeline.progress(it)
                with pytest.raises(StopIteration):
                    pipeline.progress(it)
            assert calls.count("lookup") == len(batches)
            results[mode] = ebc.state_dict()
        finally:
            client.drop_collection(name)
    for k in results["plain"]:
        np.testing.assert_allclose(results["pipelined"][k].numpy(), results["plain"][k].numpy(),
                                   rtol=1e-6)
        assert np.abs(results["plain"][k].numpy()).sum() > 0


def test_train_pipeline_prefetches_and_matches_the_plain_loop(client):
    """Batches on disjoint rows: the pipelined run (lookup k+1 issued before
    step k's update) ends with the same tables as the plain loop, each batch
    is looked up once (the prefetch is used), and progress() stops with
    StopIteration."""
    def make_batches():
        return [{"kjt": ember.KeyedJaggedTensor.from_jagged(
                    {"f_sum": [[4 * i, 4 * i + 1], [4 * i + 2]], "f_mean": [[2 * i], [2 * i + 1]]}),
                 "target": torch.full((2, 12), 0.1 * i)} for i in range(4)]

    calls = []
    real_lookup = client.lookup

    def counting_lookup(*args, **kwargs):
        calls.append("lookup")
        return real_lookup(*args, **kwargs)

    client.lookup = counting_lookup
    try:
        train_plain_and_pipelined(client, "pipe", make_batches, calls)
    finally:
        client.lookup = real_lookup


def count_device_calls(client, calls):
    """Wraps client's bindings so that each device-path call appends "lookup"
    or "update" to `calls`."""
    inner = client._c

    class Counting:
        def __getattr__(self, name):
            return getattr(inner, name)

        def lookup_on_device(self, *args):
            calls.append("lookup")
            return inner.lookup_on_device(*args)

        def apply_gradients_on_device(self, *args):
            calls.append("update")
            return inner.apply_gradients_on_device(*args)

    client._c = Counting()


class TorchKjt:
    """A torchrec.KeyedJaggedTensor's interface over torch tensors."""

    def __init__(self, keys, lengths, values, device):
        self._keys = keys
        self._lengths = torch.tensor(lengths, dtype=torch.long, device=device)
        self._values = torch.tensor(values, dtype=torch.long, device=device)

    def keys(self):
        return self._keys

    def lengths(self):
        return self._lengths

    def values(self):
        return self._values

    def weights_or_none(self):
        return None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_kjts_of_torch_tensors_get_embeddings_on_their_device(client, device):
    """A KJT of torch tensors (TorchRec's) is looked up wherever its tensors
    live (staged through host memory) and its embeddings come back on its
    device, gradients included; the same values as an ember KJT's."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from ember.torch import _device_of
    ebc = EmbeddingBagCollection(TABLES, client, f"dev_{device}",
                                 optimizer={"type": "SGD", "learning_rate": 1.0})
    try:
        kjt = TorchKjt(["f_sum", "f_mean"], [2, 0, 1, 1], [1, 2, 3, 4], device)
        assert _device_of(kjt) == torch.device(device)
        plain = ember.KeyedJaggedTensor.from_jagged({"f_sum": [[1, 2], []], "f_mean": [[3], [4]]})
        assert _device_of(plain) is None
        out = ebc(kjt).values()
        assert out.device.type == device
        with torch.no_grad():
            want = ebc(plain).values()
        np.testing.assert_array_equal(out.detach().cpu().numpy(), want.numpy())
        before = client.export_table(f"dev_{device}", "t_sum").copy()
        out.sum().backward()  # SGD at rate 1: rows 1 and 2 of t_sum each lose 1
        after = client.export_table(f"dev_{device}", "t_sum")
        np.testing.assert_allclose(after[1], before[1] - 1, rtol=1e-6)
        np.testing.assert_allclose(after[2], before[2] - 1, rtol=1e-6)
        np.testing.assert_array_equal(after[0], before[0])
    finally:
        client.drop_collection(f"dev_{device}")


def test_torch_kjts_go_straight_over_link_channels():
    """With link channels (here socket links, where a KJT of CPU tensors is
    what a CUDA one is to NCCL links), the module hands its tensors' memory
    to the client's device path: lookups and training steps equal the host
    path's on a twin collection, step for step."""
    with ember.LocalCluster(workers=2, extra_flags=["--links=socket"]) as cluster:
        linked = ember.Client(cluster.address, timeout_s=20, link="socket")
        plain = ember.Client(cluster.address, timeout_s=20, shared_memory=False)
        calls = []
        count_device_calls(linked, calls)
        opt = {"type": "ADAGRAD", "learning_rate": 0.1, "eps": 1e-8}
        for sharding in ("table_wise", "row_wise"):
            dev = EmbeddingBagCollection(TABLES, linked, f"link_{sharding}", optimizer=opt,
                                         sharding_type=sharding)
            host = EmbeddingBagCollection(TABLES, plain, f"host_{sharding}", optimizer=opt,
                                          sharding_type=sharding)
            try:
                rng = np.random.default_rng(7)
                for _ in range(3):
                    jagged, _ = batch(rng, weighted=False)
                    lengths = [len(b) for f in ("f_sum", "f_mean") for b in jagged[f]]
                    values = [i for f in ("f_sum", "f_mean") for b in jagged[f] for i in b]
                    kjt = TorchKjt(["f_sum", "f_mean"], lengths, values, "cpu")
                    out_dev = dev(kjt).values()
                    out_host = host(ember.KeyedJaggedTensor.from_jagged(jagged)).values()
                    np.testing.assert_allclose(out_dev.detach().numpy(), out_host.detach().numpy(),
                                               rtol=1e-6, atol=1e-7)
                    (out_dev * out_dev).sum().backward()
                    (out_host * out_host).sum().backward()
                for t in ("t_sum", "t_mean"):
                    np.testing.assert_allclose(linked.export_table(f"link_{sharding}", t),
                                               plain.export_table(f"host_{sharding}", t),
                                               rtol=1e-5, atol=1e-6)
            finally:
                linked.drop_collection(f"link_{sharding}")
                plain.drop_collection(f"host_{sharding}")
        assert (calls.count("lookup"), calls.count("update")) == (6, 6)


def test_train_pipeline_prefetches_on_the_device_path():
    """TrainPipeline over link channels (socket links, torch KJTs): the
    prefetched lookups take the device path too, each batch once, and the
    pipelined run ends with the plain loop's tables (disjoint rows)."""
    with ember.LocalCluster(workers=2, extra_flags=["--links=socket"]) as cluster:
        client = ember.Client(cluster.address, timeout_s=20, link="socket")
        calls = []
        count_device_calls(client, calls)

        def make_batches():
            return [{"kjt": TorchKjt(["f_sum", "f_mean"], [2, 1, 1, 1],
                                     [4 * i, 4 * i + 1, 4 * i + 2, 2 * i, 2 * i + 1], "cpu"),
                     "target": torch.full((2, 12), 0.1 * i)} for i in range(4)]

        train_plain_and_pipelined(client, "dpipe", make_batches, calls)
