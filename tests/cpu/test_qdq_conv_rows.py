"""A QDQ Conv group's patch rows on the integer product (ops/qdq_linear.quantized_conv through
compiled/dynamic_conv.quantized_conv): the same codes, bit for bit, as the exact float convolution of the centred
codes it replaces (1-D and 2-D, strides, dilations, pads, both 8-bit types, per-tensor and per-channel weights,
float32 data quantized in the call or codes, codes or dequantized values out, with and without a bias); and
1-D groups (whisper's Conv1d stem, both exporters' spellings) fused by default, within one code of onnxruntime,
where small 2-D groups stay on the float path (large ones: test_qdq_conv_blocks.py)."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.compiled import dynamic_conv
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import qdq_linear

CASES = [  # (x shape, w shape, attributes)
    ((2, 5, 17), (7, 5, 3), {"pads": [1, 1]}),
    ((1, 6, 20), (9, 6, 3), {"pads": [1, 1], "strides": [2]}),
    ((3, 4, 11), (5, 4, 2), {"pads": [0, 2], "dilations": [2]}),
    ((2, 3, 6, 7), (4, 3, 3, 3), {"pads": [1, 0, 1, 2], "strides": [2, 1]}),
    ((1, 2, 5, 5), (3, 2, 1, 1), {}),
]


def _inputs(rng, x_shape, w_shape, act, per_channel, quantize_a, bias, zero_points=True):
    zero = np.array(3 if act == np.int8 else 121, act)
    x = rng.standard_normal(x_shape).astype(np.float32) * 2 if quantize_a \
        else rng.integers(np.iinfo(act).min, np.iinfo(act).max + 1, x_shape).astype(act)
    if quantize_a:
        x.reshape(-1)[:3] = [1e4, -1e4, np.float32(0.03) * 2.5]  # saturation and a tie
    w = rng.integers(-127, 128, w_shape).astype(np.int8)
    channels = w_shape[0]
    w_scale = (rng.random(channels) * 0.01 + 0.002).astype(np.float32) if per_channel else np.array(0.006, np.float32)
    w_zero = rng.integers(-4, 5, w_scale.shape).astype(np.int8)
    w_zero *= np.int8(zero_points)  # (in place: a per-tensor zero point stays a 0-d array)
    b = (rng.standard_normal(channels) * 0.5).astype(np.float32) if bias else None
    return [x, np.array(0.03, np.float32), zero, w, w_scale, w_zero, np.array(0.05, np.float32),
            np.array(-5 if act == np.int8 else 130, act)] + ([b] if bias else [])


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("act", [np.uint8, np.int8])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("quantize_a", [False, True])
@pytest.mark.parametrize("dequantize", [False, True])
def test_patch_rows_give_the_float_paths_codes(monkeypatch, case, act, per_channel, quantize_a, dequantize):
    x_shape, w_shape, attrs = CASES[case]
    rng = np.random.default_rng(case)
    inputs = _inputs(rng, x_shape, w_shape, act, per_channel, quantize_a, bias=case % 2 == 0)
    for v in inputs[1:]:
        if v is not None:
            v.flags.writeable = False  # constants, as a session's initializers are
    node = Node("QuantizedConv", [f"i{k}" for k in range(len(inputs))], ["y"], domain=FUSED_DOMAIN, opset=1,
                attrs={**attrs, "quantize_a": int(quantize_a), "dequantize": int(dequantize)})
    calls = []
    compiled = dynamic_conv.quantized_conv
    monkeypatch.setattr(dynamic_conv, "quantized_conv", lambda *a: calls.append(1) or compiled(*a))
    monkeypatch.setattr(qdq_linear, "_takes_lines", lambda *a: False)  # (test_qdq_conv_lines.py has those)
    monkeypatch.setattr(qdq_linear, "_takes_blocks", lambda *a: False)  # (test_qdq_conv_blocks.py has those)
    rows = qdq_linear.quantized_conv(node, [], 1)
    got = [rows(*inputs)[0] for _ in range(2)]  # the second call reuses the packed weight
    assert len(calls) == 2
    monkeypatch.setattr(qdq_linear, "patch_geometry", lambda *a: None)  # the float convolution of centred codes
    want = qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]
    assert len(calls) == 2
    assert got[0].dtype == want.dtype == (np.float32 if dequantize else act) and got[0].shape == want.shape
    np.testing.assert_array_equal(got[0], want)
    np.testing.assert_array_equal(got[1], want)


def _conv1d_model(rng, act, spelled_auto_pad):
    """x -> Q -> DQ -> Conv1d(DQ(W), float bias, stride 2) -> Q -> DQ -> y, as torch's exporters write whisper's
    second convolution (dynamo spells auto_pad="NOTSET", torchscript leaves it out)."""
    zero, y_zero = (np.array(0, act), np.array(-2, act)) if act == np.int8 else (np.array(128, act),
                                                                                 np.array(126, act))
    w = rng.integers(-63, 64, (16, 12, 3)).astype(np.int8)  # 7-bit: onnxruntime's u8s8 pairs do not saturate
    inits = [numpy_helper.from_array(v, n) for v, n in (
        (np.array(0.03, np.float32), "xs"), (zero, "xz"), (w, "w"),
        ((rng.random(16) * 0.01 + 0.002).astype(np.float32), "ws"), (np.zeros(16, np.int8), "wz"),
        ((rng.standard_normal(16) * 0.3).astype(np.float32), "b"), (np.array(0.05, np.float32), "ys"),
        (y_zero, "yz"))]
    extra = {"auto_pad": "NOTSET"} if spelled_auto_pad else {}
    nodes = [helper.make_node("QuantizeLinear", ["x", "xs", "xz"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "xs", "xz"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"], axis=0),
             helper.make_node("Conv", ["xd", "wd", "b"], ["m"], pads=[1, 1], strides=[2], kernel_shape=[3],
                              **extra),
             helper.make_node("QuantizeLinear", ["m", "ys", "yz"], ["yq"]),
             helper.make_node("DequantizeLinear", ["yq", "ys", "yz"], ["y"])]
    return make_model(nodes, [tensor_info("x", shape=[2, 12, 30])], [tensor_info("y", shape=[2, 16, 15])], inits,
                      opset=19)


@pytest.mark.parametrize("act", [np.uint8, np.int8])
@pytest.mark.parametrize("spelled_auto_pad", [False, True])
def test_conv1d_groups_fuse_by_default_within_one_code_of_onnxruntime(act, spelled_auto_pad):
    rng = np.random.default_rng(3)
    model = _conv1d_model(rng, act, spelled_auto_pad)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert [n.op_type for n in sess.placement()] == ["QuantizedConv"]
    x = (rng.standard_normal((2, 12, 30)) * 2).astype(np.float32)
    oracle = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    for _ in range(3):  # the first run may take the numpy path while numba loads; the later ones the rows
        got = sess.run(None, {"x": x})[0]
        codes = np.rint(got.astype(np.float64) / 0.05)
        want = np.rint(oracle.astype(np.float64) / 0.05)
        assert np.abs(codes - want).max() <= 1 and np.mean(codes == want) >= 0.99


def test_small_conv2d_groups_stay_on_the_float_path_by_default():
    rng = np.random.default_rng(4)
    model = _conv1d_model(rng, np.uint8, False)
    conv = model.graph.node[3]
    model.graph.initializer[2].CopyFrom(numpy_helper.from_array(
        rng.integers(-63, 64, (16, 12, 3, 1)).astype(np.int8), "w"))
    del conv.attribute[:]
    conv.attribute.extend([helper.make_attribute("pads", [1, 0, 1, 0]), helper.make_attribute("strides", [2, 1])])
    model.graph.input[0].type.tensor_type.shape.dim.add().dim_value = 1
    model.graph.output[0].type.tensor_type.shape.dim.add().dim_value = 1
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert "QuantizedConv" not in [n.op_type for n in sess.placement()]
    x = rng.standard_normal((2, 12, 30, 1)).astype(np.float32)
    oracle = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], oracle, atol=0.05 + 1e-6)
