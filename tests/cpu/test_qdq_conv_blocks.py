"""A QDQ Conv group's 2-D convolution channel-major on VNNI's byte products (ops/qdq_linear.quantized_conv through
compiled/quantized_conv_blocks, the requantization in the tiles' registers): the same codes, bit for bit, as the exact
float convolution of the centred codes it replaces (strides, dilations, pads, positions past one block of 64, output
channels past a tile, both 8-bit types, per-tensor and per-channel weights with zero or non-zero zero points, float32
data quantized in the call or codes in, codes or dequantized values out, with and without a bias), the same bits
across threads; and large groups fused by default, within one code of onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import tuning
from onnx_runtime_ep_cpu.compiled import deferred, qgemm_quads, quantized_conv_blocks
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import qdq_linear
from test_qdq_conv_rows import _inputs

pytestmark = pytest.mark.skipif(not qgemm_quads.AVAILABLE, reason="the byte products need AVX-512 VNNI")

CASES = [  # (x shape, w shape, attributes)
    ((2, 5, 11, 13), (7, 5, 3, 3), {"pads": [1, 1, 1, 1]}),  # K = 45 (not whole quads), two images, 143 positions
    ((1, 8, 9, 9), (20, 8, 3, 3), {"pads": [1, 0, 1, 2], "strides": [2, 1]}),  # a channel tail past tiles of 4
    ((1, 12, 10, 10), (9, 12, 1, 1), {}),  # 1x1, no pads: the patches read the codes in place (uint8)
    ((1, 4, 12, 12), (6, 4, 3, 2), {"pads": [2, 1, 0, 1], "dilations": [2, 3]}),
    ((1, 3, 20, 20), (17, 3, 7, 7), {"pads": [3, 3, 3, 3], "strides": [2, 2]}),  # a stem
]


def _node(attrs, count, quantize_a, dequantize):
    return Node("QuantizedConv", [f"i{k}" for k in range(count)], ["y"], domain=FUSED_DOMAIN, opset=1,
                attrs={**attrs, "quantize_a": int(quantize_a), "dequantize": int(dequantize)})


@pytest.fixture(autouse=True)
def _compiled_now(monkeypatch):
    monkeypatch.setattr(deferred.state, "disabled", True)
    monkeypatch.setattr(deferred.state, "deferring", False)
    monkeypatch.setattr(qdq_linear, "_takes_grid", lambda *a: False)  # (test_qdq_conv_grid.py has the grid's)


def _float_path(monkeypatch, node, inputs):
    with monkeypatch.context() as patch:
        patch.setattr(qdq_linear, "patch_geometry", lambda *a: None)  # the float convolution of centred codes
        return qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("act", [np.uint8, np.int8])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("quantize_a", [False, True])
@pytest.mark.parametrize("dequantize", [False, True])
@pytest.mark.parametrize("zero_points", [False, True])
def test_blocks_give_the_float_paths_codes(monkeypatch, case, act, per_channel, quantize_a, dequantize, zero_points):
    x_shape, w_shape, attrs = CASES[case]
    rng = np.random.default_rng(case)
    inputs = _inputs(rng, x_shape, w_shape, act, per_channel, quantize_a, case % 2 == 0, zero_points)
    for v in inputs[1:]:
        v.flags.writeable = False  # constants, as a session's initializers are
    node = _node(attrs, len(inputs), quantize_a, dequantize)
    calls = []
    compiled = quantized_conv_blocks.quantized_conv_blocks
    monkeypatch.setattr(quantized_conv_blocks, "quantized_conv_blocks", lambda *a: calls.append(1) or compiled(*a))
    blocks = qdq_linear.quantized_conv(node, [], 1)
    with tuning.override(threads=1):
        got = [blocks(*inputs)[0] for _ in range(2)]  # the second call reuses the weight's rows
    assert len(calls) == 2
    want = _float_path(monkeypatch, node, inputs)
    assert len(calls) == 2
    assert got[0].dtype == want.dtype == (np.float32 if dequantize else act) and got[0].shape == want.shape
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_array_equal(got[1], want)


def test_a_nan_bias_gives_code_zero_as_the_float_path(monkeypatch):
    x_shape, w_shape, attrs = CASES[0]
    inputs = _inputs(np.random.default_rng(7), x_shape, w_shape, np.uint8, True, False, True, zero_points=False)
    inputs[-1][2] = np.nan
    for dequantize in (False, True):
        node = _node(attrs, len(inputs), False, dequantize)
        with tuning.override(threads=1):
            got = qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]
        want = _float_path(monkeypatch, node, inputs)
        np.testing.assert_array_equal(got, want)
        assert (got[:, 2] == (np.float32(-130 * 0.05) if dequantize else 0)).all()


@pytest.mark.parametrize("case", [0, 1, 4])
@pytest.mark.parametrize("quantize_a", [False, True])
def test_threads_share_the_call_with_the_same_bits(monkeypatch, case, quantize_a):
    # The phases (codes, patches, products) as tasks the calling thread and the helpers claim, split even where
    # small (split_macs 1), over more parts than threads: the one-thread call's bits.
    x_shape, w_shape, attrs = CASES[case]
    inputs = _inputs(np.random.default_rng(11), x_shape, w_shape, np.uint8, True, quantize_a, True)
    split_runs_match(monkeypatch, _node(attrs, len(inputs), quantize_a, False), inputs, "split_quantized_conv")


def split_runs_match(monkeypatch, node, inputs, split: str) -> None:
    """The call on 1, 2 and 3 threads with every phase split (split_macs 1, over more parts than threads): the split
    (dynamic_conv_jobs' ``split``) runs on 2 and 3, and all three give the float path's bits."""
    from onnx_runtime_ep_cpu.compiled import dynamic_conv_jobs

    splits = []
    real = getattr(dynamic_conv_jobs, split)
    monkeypatch.setattr(dynamic_conv_jobs, split, lambda *a: splits.append(1) or real(*a))
    outputs = {}
    for threads in (1, 2, 3):
        with tuning.override(split_macs=1, threads=threads):
            outputs[threads] = qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]
    assert len(splits) == 2
    np.testing.assert_array_equal(outputs[1], _float_path(monkeypatch, node, inputs))
    for threads in (2, 3):
        assert outputs[threads].tobytes() == outputs[1].tobytes()


def _large_model(rng, act):
    """x -> Q -> DQ -> Conv 3x3 (32 -> 32 channels at 48 x 48: 2^24 multiply-adds and more; DQ(W) per channel,
    DQ(int32 bias)) -> Q -> DQ -> y: onnxruntime's quantize_static spelling."""
    zero, y_zero = (np.array(0, act), np.array(-2, act)) if act == np.int8 else (np.array(128, act),
                                                                                 np.array(126, act))
    w = rng.integers(-63, 64, (32, 32, 3, 3)).astype(np.int8)  # 7-bit: onnxruntime's u8s8 pairs do not saturate
    w_scale = (rng.random(32) * 0.004 + 0.001).astype(np.float32)
    bias = rng.integers(-500, 500, 32).astype(np.int32)
    inits = [numpy_helper.from_array(v, n) for v, n in (
        (np.array(0.03, np.float32), "xs"), (zero, "xz"), (w, "w"), (w_scale, "ws"), (np.zeros(32, np.int8), "wz"),
        (bias, "b"), ((w_scale * np.float32(0.03)).astype(np.float32), "bs"), (np.zeros(32, np.int32), "bz"),
        (np.array(0.05, np.float32), "ys"), (y_zero, "yz"))]
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("DequantizeLinear", ["b", "bs", "bz"], ["bd"], axis=0),
             helper.make_node("Conv", ["xd", "wd", "bd"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["c", "ys", "yz"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 48, 48])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


@pytest.mark.parametrize("act", [np.uint8, np.int8])
def test_large_groups_fuse_by_default_within_one_code_of_onnxruntime(act):
    rng = np.random.default_rng(3)
    model = _large_model(rng, act).SerializeToString()
    sess = ort.InferenceSession(model, providers=["cpu"])
    assert [n.op_type for n in sess.placement()] == ["QuantizedConv"]
    x = (rng.standard_normal((1, 32, 48, 48)) * 2).astype(np.float32)
    oracle = onnxruntime.InferenceSession(model).run(None, {"x": x})[0]
    for _ in range(3):  # the first run may take the numpy path while numba loads
        got = sess.run(None, {"x": x})[0]
        codes = np.rint(got.astype(np.float64) / 0.05)
        want = np.rint(oracle.astype(np.float64) / 0.05)
        assert np.abs(codes - want).max() <= 1 and np.mean(codes == want) >= 0.99
