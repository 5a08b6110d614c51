"""INT8 and INT4 tables (row-wise quantized, for serving) through the Python
SDK on CPU workers: imported rows are quantized as FBGEMM quantizes them
(its own torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf, and a
NumPy implementation of its algorithm); lookups are the sums of the rows
the table exports; updates are refused and change nothing; a checkpoint
restores every value; ember.torch serves such a collection; bad specs are
refused."""

import numpy as np
import pytest

import ember

ROWS, DIM = 300, 24


def numpy_quantize(x, bits):
    """FBGEMM's row-wise n-bit quantization, written out in NumPy: the
    dequantized rows and each row's (scale, bias)."""
    out = np.empty_like(x)
    scale_bias = np.empty((len(x), 2), np.float32)
    top = np.float32((1 << bits) - 1)
    for i, row in enumerate(x.astype(np.float32)):
        bias = np.float32(np.float16(row.min()))
        span = np.float32(row.max() - bias)
        scale = np.float32(np.float16(np.float32(1) if span == 0 else span / top))
        if scale == 0 or np.isinf(np.float32(1) / scale):
            scale = np.float32(1)
        q = np.clip(np.rint((row - bias) * (np.float32(1) / scale)), 0, top).astype(np.float32)
        out[i] = scale * q + bias
        scale_bias[i] = scale, bias
    return out, scale_bias


def fbgemm_dequantized(x, bits):
    """The rows as FBGEMM's own CPU ops quantize and dequantize them."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("fbgemm_gpu")
    q = torch.ops.fbgemm.FloatToFusedNBitRowwiseQuantizedSBHalf(torch.from_numpy(x), bits)
    return torch.ops.fbgemm.FusedNBitRowwiseQuantizedSBHalfToFloat(q, bits).numpy()


def spec(name, data_type, **table):
    t = {"name": "t", "num_embeddings": ROWS, "embedding_dim": DIM, "feature_names": ["f"],
         "data_type": data_type}
    t.update(table)
    return {"name": name, "tables": [t]}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    with ember.LocalCluster(workers=2, extra_flags=[f"--checkpoint_dir={root}"]) as cluster:
        yield ember.Client(cluster.address, timeout_s=30)


@pytest.mark.parametrize("data_type,bits", [("INT8", 8), ("INT4", 4)])
def test_rows_are_fbgemms_and_lookups_sum_them(client, data_type, bits):
    name = "q" + data_type.lower()
    client.create_collection(spec(name, data_type), sharding_type="row_wise")
    try:
        rng = np.random.default_rng(bits)
        x = (rng.standard_normal((ROWS, DIM)) * rng.uniform(0.01, 3, (ROWS, 1))
             + rng.uniform(-1, 1, (ROWS, 1))).astype(np.float32)
        client.import_table(name, "t", x)
        got = client.export_table(name, "t")
        want, scale_bias = numpy_quantize(x, bits)
        np.testing.assert_array_equal(got, want)
        # FBGEMM's own ops: the same rows (its dequantization may fuse the
        # multiply and add: within a rounding of the value).
        np.testing.assert_allclose(got, fbgemm_dequantized(x, bits), rtol=1e-6, atol=1e-7)
        # The format's error bound: half a step, plus what fp16's rounding of
        # the scale and bias moves the values by.
        step = scale_bias[:, :1]
        assert np.all(np.abs(got - x) <= step / 2 + (1 << bits) * step * 2.0**-11
                      + np.abs(scale_bias[:, 1:]) * 2.0**-11 + 1e-7)

        bags = [[int(i) for i in rng.integers(0, ROWS, 5)] for _ in range(16)] + [[]]
        kjt = ember.KeyedJaggedTensor.from_jagged({"f": bags})
        out = np.asarray(client.lookup(name, kjt).values).reshape(len(bags), DIM)
        sums = np.stack([got[b].astype(np.float64).sum(0) if b else np.zeros(DIM) for b in bags])
        np.testing.assert_allclose(out, sums, rtol=1e-5, atol=1e-5)

        with pytest.raises(ember.FailedPrecondition, match=f"the table is {data_type}"):
            client.apply_gradients(name, kjt, np.ones((len(bags), DIM), np.float32))
        np.testing.assert_array_equal(client.export_table(name, "t"), got)
    finally:
        client.drop_collection(name)


def test_a_checkpoint_restores_the_rows(client):
    client.create_collection(spec("qck", "INT8"), sharding_type="row_wise")
    try:
        rng = np.random.default_rng(5)
        x = rng.standard_normal((ROWS, DIM)).astype(np.float32)
        # A third of the rows spread by 1e-3 around 1: their scale is far
        # below the bias's fp16 step, which FBGEMM's re-quantization moves.
        x[:ROWS // 3] = 1 + 1e-3 * x[:ROWS // 3]
        client.import_table("qck", "t", x)
        before = client.export_table("qck", "t")
        ck = client.checkpoint("qck")
        client.restore(ck["path"], "qck2", sharding_type="table_wise")
        try:
            # Quantized again from fp32, each row's scale and bias are found
            # again: every value comes back (FBGEMM's quantization of them
            # would move some rows).
            np.testing.assert_array_equal(client.export_table("qck2", "t"), before)
            moved = np.any(numpy_quantize(before, 8)[0] != before, axis=1)
            assert moved.sum() > 0, "no row here that FBGEMM's re-quantization moves"
        finally:
            client.drop_collection("qck2")
    finally:
        client.drop_collection("qck")


@pytest.mark.parametrize("table,message", [
    ({"optimizer": {"type": "ADAGRAD"}}, "INT8 tables are for serving and take no updates"),
    ({"num_embeddings": 0, "dynamic": {"capacity": 100}}, "INT8 tables are fixed"),
])
def test_bad_quantized_specs_are_refused(client, table, message):
    with pytest.raises(ember.InvalidArgument, match=message):
        client.create_collection(spec("qbad", "INT8", **table))


def test_ember_torch_serves_a_quantized_collection(client):
    """ember.torch's EmbeddingBagCollection attached to an INT8 collection
    (create=False, as a serving process would) returns what the SDK's
    lookup returns; its backward is refused."""
    torch = pytest.importorskip("torch")
    import ember.torch as et
    client.create_collection(spec("qtorch", "INT8"))
    try:
        rng = np.random.default_rng(8)
        client.import_table("qtorch", "t", rng.standard_normal((ROWS, DIM)).astype(np.float32))
        ebc = et.EmbeddingBagCollection(
            [{"name": "t", "num_embeddings": ROWS, "embedding_dim": DIM, "feature_names": ["f"],
              "data_type": "INT8"}], client, "qtorch", create=False)
        bags = [[1, 2, 3], [299], [], [7, 7]]
        kjt = ember.KeyedJaggedTensor.from_jagged({"f": bags})
        want = np.asarray(client.lookup("qtorch", kjt).values).reshape(len(bags), DIM)
        with torch.no_grad():
            out = ebc(kjt)
        np.testing.assert_array_equal(out["f"].numpy(), want)
        out = ebc(kjt)
        with pytest.raises(ember.FailedPrecondition, match="the table is INT8"):
            out["f"].sum().backward()
    finally:
        client.drop_collection("qtorch")
