"""The com.microsoft blockwise weight operators (ops/contrib_weights.py): MatMulNBits and GatherBlockQuantized
against onnxruntime's CPU provider, the documented formulas where onnxruntime has no kernel for a case the spec
defines, and models made the way users get them (onnxruntime.quantization's MatMulNBitsQuantizer)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_runtime
import onnxruntime
import pytest
from contrib_reference import RNG, assert_floats, run_both, run_ours
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError, OnnxRuntimeError

F32, F16 = np.float32, np.float16

# -- MatMulNBits -----------------------------------------------------------------------------------


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Values of ``bits`` bits packed into bytes along the last axis, lowest bits first."""
    per_byte = 8 // bits
    values = values.astype(np.uint8).reshape(values.shape[:-1] + (-1, per_byte))
    packed = np.zeros(values.shape[:-1], np.uint8)
    for j in range(per_byte):
        packed |= values[..., j] << np.uint8(j * bits)
    return packed


def nbits_weight(n, k, bits, block, zero_kind, dtype=F32):
    """(B, scales, zero_points, the dequantized (N, K) weight in float64) in MatMulNBits' layout."""
    blocks = -(-k // block)
    q = RNG.integers(0, 1 << bits, size=(n, blocks * block))
    b = pack(q, bits).reshape(n, blocks, block * bits // 8)
    scales = RNG.uniform(0.01, 0.1, (n, blocks)).astype(dtype)
    if zero_kind == "packed":
        zq = RNG.integers(0, 1 << bits, size=(n, -(-blocks * bits // 8) * (8 // bits)))
        zero_points, zero_values = pack(zq, bits), zq[:, :blocks].astype(np.float64)
    elif zero_kind == "float":
        zero_points = RNG.uniform(0, (1 << bits) - 1, (n, blocks)).astype(dtype)
        zero_values = zero_points.astype(np.float64)
    else:
        zero_points, zero_values = None, np.full((n, blocks), float(1 << (bits - 1)))
    expand = np.arange(k) // block
    weight = (q[:, :k] - zero_values[:, expand]) * scales.astype(np.float64)[:, expand]
    return b, scales, zero_points, weight


def assert_float32_dot(y, a, weight, reference=None):
    """``y`` is ``a @ weight.T`` up to float32 rounding: each of the K products and partial sums may round, so
    the bound grows with K and with the sum of the products' magnitudes (not a fixed tolerance, which a
    K=100 dot product can exceed by accumulation order alone)."""
    a64 = a.astype(np.float64)
    bound = (a.shape[-1] + 4) * np.finfo(np.float32).eps * (np.abs(a64) @ np.abs(weight).T) + 1e-7
    expected = a64 @ weight.T if reference is None else reference.astype(np.float64)
    error = np.abs(np.asarray(y, np.float64) - expected)
    assert np.all(error <= (bound if reference is None else 2 * bound)), (error - bound).max()


def nbits_attrs(n, k, bits, block, **more):
    return {"K": k, "N": n, "bits": bits, "block_size": block} | more


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("zero_kind", ["none", "packed", "float"])
@pytest.mark.parametrize("k,block", [(64, 16), (40, 16), (96, 32), (100, 64)])
@pytest.mark.parametrize("constant", [True, False])
def test_matmul_nbits(bits, zero_kind, k, block, constant):
    n = 6
    b, scales, zero_points, weight = nbits_weight(n, k, bits, block, zero_kind)
    a = F32(RNG.standard_normal((3, k)))
    inputs, attrs = [a, b, scales, zero_points], nbits_attrs(n, k, bits, block)
    constants = (1, 2, 3) if constant else ()
    if bits == 8 and zero_kind == "float":  # onnxruntime has no such CPU kernel; the spec defines it
        (y,) = run_ours("MatMulNBits", inputs, attrs, constants=constants)
    else:
        ours, theirs = run_both("MatMulNBits", inputs, attrs, constants=constants)
        assert ours[0].dtype == theirs[0].dtype and ours[0].shape == theirs[0].shape
        assert_float32_dot(ours[0], a, weight, reference=theirs[0])
        y = ours[0]
    assert_float32_dot(y, a, weight)


@pytest.mark.parametrize("rows,bits,zero_kind", [(1, 4, "packed"), (3, 2, "float"), (1, 8, "float"),
                                                  (70, 4, "packed"), (70, 2, "float"), (64, 8, "none")])
def test_matmul_nbits_block_and_tiled_products(rows, bits, zero_kind, monkeypatch):
    # Under 64 rows of A the product runs on the packed weight (repacked along K); from 64 on, tiles of 256
    # weight columns are dequantized for BLAS (N = 300: a full tile and a partial one; K = 91: a partial
    # block, and for 4 bits a half-filled last byte). No weight counts as small here.
    from onnx_runtime_ep_cpu.ops import contrib_weights

    monkeypatch.setattr(contrib_weights, "SMALL_WEIGHT_BYTES", 0)
    n, k, block = 300, 91, 32
    b, scales, zero_points, weight = nbits_weight(n, k, bits, block, zero_kind)
    a = F32(RNG.standard_normal((rows, k)))
    (y,) = run_ours("MatMulNBits", [a, b, scales, zero_points], nbits_attrs(n, k, bits, block), constants=(1, 2, 3))
    assert y.shape == (rows, n) and y.dtype == F32
    assert_float32_dot(y, a, weight)


def test_matmul_nbits_keeps_no_float32_copy_of_the_weight():
    # What a run leaves allocated: the repacked 4-bit weight (K * N / 2 bytes) and float32 scales, not the
    # K * N * 4 bytes of a dequantized copy.
    import tracemalloc

    n, k, block = 1024, 1024, 32
    b, scales, zero_points, weight = nbits_weight(n, k, 4, block, "packed")
    a = F32(RNG.standard_normal((1, k)))
    from contrib_reference import node_model

    model, feeds = node_model("MatMulNBits", [a, b, scales, zero_points], nbits_attrs(n, k, 4, block),
                              constants=(1, 2, 3))
    onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"]).run(None, feeds)  # loads the loops
    session = onnx_runtime.InferenceSession(model.SerializeToString(), providers=["cpu"])
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        (y,) = session.run(None, feeds)
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert_float32_dot(y, a, weight)
    assert kept < k * n, f"{kept} bytes kept after the first run; a float32 copy is {4 * k * n}"


@pytest.mark.parametrize("a_shape", [(5, 48), (2, 3, 48), (48,)])
def test_matmul_nbits_bias_and_batch_dims(a_shape):
    n, k, block = 7, 48, 16
    b, scales, zero_points, _ = nbits_weight(n, k, 4, block, "packed")
    bias = F32(RNG.standard_normal(n))
    a = F32(RNG.standard_normal(a_shape))
    ours, theirs = run_both("MatMulNBits", [a, b, scales, zero_points, None, bias], nbits_attrs(n, k, 4, block),
                            constants=(1, 2, 3, 5))
    assert_floats(ours[0], theirs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("zero_kind", ["packed", "float", "none"])
def test_matmul_nbits_half(zero_kind):
    n, k, block = 8, 64, 32
    b, scales, zero_points, _ = nbits_weight(n, k, 4, block, zero_kind, F16)
    a = F16(RNG.standard_normal((3, k)))
    ours, theirs = run_both("MatMulNBits", [a, b, scales, zero_points], nbits_attrs(n, k, 4, block),
                            constants=(1, 2, 3))
    # float16 output: within a few units in the last place of the results (magnitude ~1).
    assert_floats(ours[0], theirs[0], atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("zero_kind", ["none", "float", "packed"])
def test_matmul_nbits_g_idx(padded, zero_kind):
    n, k, block = 5, 40, 16
    b, scales, zero_points, _ = nbits_weight(n, k, 4, block, zero_kind)
    g_idx = RNG.integers(0, 3, size=48 if padded else k).astype(np.int32)
    a = F32(RNG.standard_normal((2, k)))
    inputs = [a, b, scales, zero_points, g_idx]
    if zero_kind != "packed":
        ours, theirs = run_both("MatMulNBits", inputs, nbits_attrs(n, k, 4, block), constants=(1, 2, 3, 4))
        assert_floats(ours[0], theirs[0], atol=1e-5, rtol=1e-5)
        return
    # onnxruntime ignores packed zero points when g_idx is given (it takes 8); the spec applies each
    # element's block zero point, g_idx naming the block.
    (y,) = run_ours("MatMulNBits", inputs, nbits_attrs(n, k, 4, block), constants=(1, 2, 3, 4))
    group = g_idx[:k]
    q = np.stack([np.stack([b[i].reshape(-1) & 15, b[i].reshape(-1) >> 4], axis=-1).reshape(-1) for i in range(n)])
    zq = np.stack([zero_points & 15, zero_points >> 4], axis=-1).reshape(n, -1)
    weight = (q[:, :k] - zq[:, group].astype(np.float64)) * scales.astype(np.float64)[:, group]
    assert_float32_dot(y, a, weight)


@pytest.mark.parametrize("level", [0, 1, 2, 3, 4])
def test_matmul_nbits_accuracy_level(level):
    n, k, block = 8, 64, 32
    b, scales, zero_points, weight = nbits_weight(n, k, 4, block, "packed")
    a = F32(RNG.standard_normal((3, k)))
    attrs = nbits_attrs(n, k, 4, block, accuracy_level=level)
    ours, theirs = run_both("MatMulNBits", [a, b, scales, zero_points], attrs, constants=(1, 2, 3))
    # The level is a floor: this runtime keeps A in full precision at every level. onnxruntime quantizes A to
    # int8 per block at level 4, which moves each product by at most half of A's block step times |W|.
    step = np.abs(a.reshape(3, -1, block)).max(axis=-1) / 127
    bound = (step[:, :, None] / 2 * np.abs(weight.T).reshape(-1, block, n).sum(axis=1)[None]).sum(axis=1)
    np.testing.assert_array_less(np.abs(ours[0] - theirs[0].astype(np.float64)), bound + 1e-5)
    assert_float32_dot(ours[0], a, weight)


@pytest.mark.parametrize("dtype", [F32, ml_dtypes.bfloat16])
def test_matmul_nbits_follows_the_spec(dtype):
    # What onnxruntime's CPU provider has no kernel for: 8-bit weights with float zero points, bfloat16.
    n, k, block = 4, 48, 16
    b, scales, zero_points, weight = nbits_weight(n, k, 8, block, "float", dtype)
    a = RNG.standard_normal((3, k)).astype(dtype)
    (y,) = run_ours("MatMulNBits", [a, b, scales, zero_points], nbits_attrs(n, k, 8, block), constants=(1, 2, 3))
    assert y.dtype == np.dtype(dtype)
    expected = (a.astype(np.float64) @ weight.T).astype(dtype)
    np.testing.assert_allclose(y.astype(np.float64), expected.astype(np.float64), rtol=1e-2 if dtype != F32 else 1e-5)


# -- MatMulNBits as users get it: onnxruntime.quantization's MatMulNBitsQuantizer -------------------


def float_matmul_model(k=64, n=24, with_gather=False):
    weight = numpy_helper.from_array(F32(RNG.standard_normal((k, n)) * 0.2), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", k])]
    initializers = [weight]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", n])]
    if with_gather:
        table = numpy_helper.from_array(F32(RNG.standard_normal((50, k))), "table")
        nodes.append(helper.make_node("Gather", ["table", "ids"], ["emb"], name="gather"))
        inputs.append(helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", 3]))
        outputs.append(helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["batch", 3, k]))
        initializers.append(table)
    graph = helper.make_graph(nodes, "float_matmul", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model


def quantize_weights(model, **options):
    # onnxruntime's quantizer module imports onnx_ir (the onnx-ir package), which onnxruntime does not require.
    pytest.importorskip("onnx_ir", reason="MatMulNBitsQuantizer needs the onnx-ir package")
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(model, **options)
    quantizer.process()
    return quantizer.model.model


def both_runtimes(model, feeds):
    data = model.SerializeToString()
    theirs = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)
    ours = onnx_runtime.InferenceSession(data, providers=["cpu"]).run(None, feeds)
    return ours, theirs


@pytest.mark.parametrize("options", [
    {"bits": 4, "block_size": 32, "is_symmetric": False},
    {"bits": 4, "block_size": 16, "is_symmetric": True},
    {"bits": 8, "block_size": 32, "is_symmetric": False},
    {"bits": 4, "block_size": 32, "is_symmetric": False, "accuracy_level": 4},
], ids=["4bit-asym", "4bit-sym", "8bit", "4bit-level4"])
def test_matmul_nbits_quantizer_model(options):
    original = float_matmul_model()
    w = numpy_helper.to_array(original.graph.initializer[0])  # (the quantizer rewrites the model in place)
    model = quantize_weights(original, **options)
    assert [node.op_type for node in model.graph.node] == ["MatMulNBits"]
    x = F32(RNG.standard_normal((5, 64)))
    ours, theirs = both_runtimes(model, {"x": x})
    tolerance = 5e-2 if options.get("accuracy_level") == 4 else 1e-4  # level 4: onnxruntime's int8 A
    assert_floats(ours[0], theirs[0], atol=tolerance, rtol=tolerance)
    # And the quantized model approximates the float one within its weights' quantization error.
    assert np.abs(ours[0] - x @ w).max() < np.abs(x).sum(axis=1).max() * np.abs(w).max() / 2 ** (options["bits"] - 1)


def test_matmul_nbits_quantizer_gather_block_quantized():
    model = quantize_weights(float_matmul_model(with_gather=True), bits=4, block_size=32,
                             op_types_to_quantize=("MatMul", "Gather"), quant_axes=(("MatMul", 0), ("Gather", 1)))
    assert sorted(node.op_type for node in model.graph.node) == ["GatherBlockQuantized", "MatMulNBits"]
    feeds = {"x": F32(RNG.standard_normal((2, 64))), "ids": np.array([[0, 7, 49], [3, 3, -1]], np.int64)}
    ours, theirs = both_runtimes(model, feeds)
    assert_floats(ours[0], theirs[0], atol=1e-4, rtol=1e-4)
    assert_floats(ours[1], theirs[1], atol=0, rtol=0)


# -- GatherBlockQuantized --------------------------------------------------------------------------


def int4_table(shape, dtype):
    low, high = (-8, 7) if dtype == ml_dtypes.int4 else (0, 15)
    return RNG.integers(low, high + 1, size=shape).astype(dtype)


def block_scales(shape, axis, block, dtype=F32):
    shape = list(shape)
    shape[axis] = -(-shape[axis] // block)
    return RNG.uniform(0.1, 1.0, shape).astype(dtype), tuple(shape)


GATHERS = [  # (data shape, gather_axis, quantize_axis, block_size, indices)
    ((6, 32), 0, 1, 16, np.array([[0, 5], [-1, 3]], np.int64)),
    ((6, 48), 0, -1, 32, np.array([2, 2, 0], np.int32)),
    ((32, 5), 1, 0, 16, np.array([4, 0, -5], np.int32)),
    ((6, 32), 1, 1, 16, np.array([0, 17, 31, -1], np.int32)),
    ((3, 4, 32), 1, 2, 16, np.array([[0, 3]], np.int64)),
    ((32, 4, 3), 1, 0, 16, np.array([[0, 3], [1, 1]], np.int32)),
    ((5, 64), 0, 1, 64, np.array(3, np.int64)),
]


@pytest.mark.parametrize("dtype", [ml_dtypes.int4, ml_dtypes.uint4])
@pytest.mark.parametrize("with_zero", [False, True])
@pytest.mark.parametrize("shape,g,q,block,indices", GATHERS)
def test_gather_block_quantized_int4(dtype, with_zero, shape, g, q, block, indices):
    data = int4_table(shape, dtype)
    scales, scale_shape = block_scales(shape, q, block)
    zero = int4_table(scale_shape, dtype) if with_zero else None
    attrs = {"gather_axis": g, "quantize_axis": q, "block_size": block}
    ours, theirs = run_both("GatherBlockQuantized", [data, indices, scales, zero], attrs, constants=(0, 2, 3))
    assert_floats(ours[0], theirs[0], atol=0, rtol=0)  # one float32 product per element: exact


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("with_zero", [False, True])
@pytest.mark.parametrize("scale_type", [F32, F16])
def test_gather_block_quantized_uint8(bits, with_zero, scale_type):
    rows, logical, block = 7, 64, 16
    data = RNG.integers(0, 256, size=(rows, logical * bits // 8)).astype(np.uint8)
    scales = RNG.uniform(0.1, 1.0, (rows, logical // block)).astype(scale_type)
    zero = None
    if with_zero:
        zq = RNG.integers(0, 1 << bits, size=(rows, -(-scales.shape[1] * bits // 8) * (8 // bits)))
        zero = pack(zq, bits)
    indices = np.array([[6, 0, -2], [3, 9, -8]], np.int64)  # out of range: zeros
    attrs = {"gather_axis": 0, "quantize_axis": 1, "block_size": block, "bits": bits}
    ours, theirs = run_both("GatherBlockQuantized", [data, indices, scales, zero], attrs, constants=(0, 2, 3))
    assert_floats(ours[0], theirs[0], atol=0, rtol=0)
    assert not ours[0][1, 1].any() and not ours[0][1, 2].any()


@pytest.mark.parametrize("dtype", [ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2,
                                   ml_dtypes.float8_e5m2fnuz, ml_dtypes.float4_e2m1fn])
@pytest.mark.parametrize("block,scale_shape", [(16, (6, 2)), (0, (6, 1)), (16, (1, 2)), (0, (1, 1))])
def test_gather_block_quantized_float(dtype, block, scale_shape):
    data = RNG.standard_normal((6, 32)).astype(dtype)
    scales = RNG.uniform(0.1, 1.0, scale_shape).astype(F32)
    attrs = {"gather_axis": 0, "quantize_axis": 1, "block_size": block}
    ours, theirs = run_both("GatherBlockQuantized", [data, np.array([5, 0, -1, 6], np.int32), scales], attrs,
                            constants=(0, 2))
    assert_floats(ours[0], theirs[0], atol=0, rtol=0)


def test_gather_block_quantized_half_scales_int4():
    data = int4_table((4, 32), ml_dtypes.int4)
    scales, _ = block_scales((4, 32), 1, 16, F16)
    ours, theirs = run_both("GatherBlockQuantized", [data, np.array([1, 3], np.int32), scales], {"block_size": 16},
                            constants=(0, 2))
    assert_floats(ours[0], theirs[0], atol=0, rtol=0)


# -- bad inputs ------------------------------------------------------------------------------------


def test_matmul_nbits_bad_inputs_name_the_node():
    n, k, block = 4, 32, 16
    b, scales, zero_points, _ = nbits_weight(n, k, 4, block, "packed")
    a = F32(RNG.standard_normal((2, k)))
    cases = [
        ([a[:, :16], b, scales], "last dimension of K=32"),
        ([a, b[:, :1], scales], "input 'B' has shape"),
        ([a, b, scales[:, :1]], "input 'scales' has shape"),
        ([a, b, scales, zero_points[:, :0]], "input 'zero_points' has shape"),
        ([a, b, scales, None, np.array([0] * 31 + [2], np.int32)], "g_idx"),
        ([a, b, scales, None, None, F32([1, 2])], "input 'bias' has shape"),
        ([a.astype(F16), b, scales], "must share a float type"),
    ]
    for inputs, message in cases:
        with pytest.raises(InvalidArgumentError, match=message) as info:
            run_ours("MatMulNBits", inputs, nbits_attrs(n, k, 4, block))
        assert "'n' (MatMulNBits)" in str(info.value)


@pytest.mark.parametrize("attrs,message", [
    ({"bits": 3}, "'bits' is 3"), ({"block_size": 24}, "'block_size' is 24"), ({"accuracy_level": 7}, "accuracy_level"),
])
def test_matmul_nbits_bad_attributes(attrs, message):
    b, scales, _, _ = nbits_weight(4, 32, 4, 16, "none")
    with pytest.raises(OnnxRuntimeError, match=message):
        run_ours("MatMulNBits", [F32(np.ones((1, 32))), b, scales], nbits_attrs(4, 32, 4, 16) | attrs)


@pytest.mark.parametrize("case", ["zero_points on float data", "scales shape", "uint8 gather axis", "indices type"])
def test_gather_block_quantized_bad_inputs(case):
    data, scales = int4_table((4, 32), ml_dtypes.int4), F32(np.ones((4, 2)))
    indices, attrs, zero = np.array([0], np.int64), {"block_size": 16}, None
    message = {"zero_points on float data": "symmetric", "scales shape": "input 'scales' has shape",
               "uint8 gather axis": "gathers on axis 0", "indices type": "expected int32 or int64"}[case]
    if case == "zero_points on float data":
        data, zero = data.astype(F32).astype(ml_dtypes.float8_e4m3fn), np.ones((4, 2), ml_dtypes.float8_e4m3fn)
    elif case == "scales shape":
        scales = F32(np.ones((4, 3)))
    elif case == "uint8 gather axis":
        data, attrs = np.ones((4, 16), np.uint8), {"block_size": 16, "gather_axis": 1, "quantize_axis": 0}
    else:
        indices = np.array([0.0], F32)
    with pytest.raises(InvalidArgumentError, match=message) as info:
        run_ours("GatherBlockQuantized", [data, indices, scales, zero], attrs)
    assert "'n' (GatherBlockQuantized)" in str(info.value)

