"""A 1-D QDQ Conv group whose windows are read in place (ops/qdq_linear.quantized_conv through
compiled/dynamic_conv.quantized_conv_lines: channel-last centred codes, the register tiles reading each output's
kw * C values sw * C apart; or, on VNNI with channels in whole quads, quantized_conv_quads: unsigned codes by
the weight's signed bytes, the zero points' terms added after): the same codes, bit for bit, as the exact float
convolution of the centred codes and as the patch rows (strides 1-3, pads, batches, both 8-bit types, per-tensor
and per-channel weights with zero points, int8 and uint8 weights, float32 data quantized in the call or codes,
codes or dequantized values out, output channels past the 16-lane tiles, rows past the 4-row tiles); geometries
it does not take (odd channels, dilation, 2-D) keep the patch rows; and whisper's stem convolutions through a
session within one code of onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.compiled import dynamic_conv, qgemm_quads, qgemm_tiles
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import qdq_linear
from test_qdq_conv_rows import _conv1d_model, _inputs

pytestmark = pytest.mark.skipif(not qgemm_tiles.AVAILABLE, reason="the lines run on the AVX-512 register tiles")

LINES = [  # (x shape, w shape, attributes): geometries the lines take
    ((1, 80, 100), (64, 80, 3), {"pads": [1, 1]}),  # whisper's first convolution
    ((1, 64, 100), (64, 64, 3), {"pads": [1, 1], "strides": [2]}),  # and its second
    ((3, 6, 23), (21, 6, 3), {"pads": [2, 1], "strides": [3]}),  # a partial 16-column tile, rows past 4
    ((2, 2, 9), (70, 2, 5), {"pads": [0, 4]}),  # 4 full 16-column tiles and a partial one
    ((2, 4, 1, 13), (5, 4, 1, 2), {"pads": [0, 1, 0, 0], "strides": [1, 2]}),  # 2-D of height 1
    ((2, 8, 19), (37, 8, 3), {"pads": [1, 2], "strides": [2]}),  # quads: a partial tile, rows past 4, batches
]
OTHERS = [  # geometries the patch rows keep (a 2-D one where VNNI's channel-major blocks do not run it)
    ((2, 5, 17), (7, 5, 3), {"pads": [1, 1]}),  # odd channels
    ((3, 4, 11), (5, 4, 2), {"pads": [0, 2], "dilations": [2]}),
    ((2, 2, 6, 7), (4, 2, 3, 3), {"pads": [1, 0, 1, 2], "strides": [2, 1]}),
]


def _node(inputs, attrs, quantize_a, dequantize):
    for v in inputs[1:]:
        v.flags.writeable = False  # constants, as a session's initializers are
    return Node("QuantizedConv", [f"i{k}" for k in range(len(inputs))], ["y"], domain=FUSED_DOMAIN, opset=1,
                attrs={**attrs, "quantize_a": int(quantize_a), "dequantize": int(dequantize)})


def _quads(x_shape):
    """Whether the byte products take this geometry (VNNI, channels in whole quads)."""
    return qgemm_quads.AVAILABLE and x_shape[1] % 4 == 0


def _counted(monkeypatch, name):
    calls = []
    compiled = getattr(dynamic_conv, name)
    monkeypatch.setattr(dynamic_conv, name, lambda *a: calls.append(1) or compiled(*a))
    return calls


@pytest.mark.parametrize("case", range(len(LINES)))
@pytest.mark.parametrize("act", [np.uint8, np.int8])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("quantize_a", [False, True])
@pytest.mark.parametrize("dequantize", [False, True])
def test_lines_give_the_float_paths_codes(monkeypatch, case, act, per_channel, quantize_a, dequantize):
    x_shape, w_shape, attrs = LINES[case]
    inputs = _inputs(np.random.default_rng(case), x_shape, w_shape, act, per_channel, quantize_a,
                     bias=case % 2 == 0)
    node = _node(inputs, attrs, quantize_a, dequantize)
    lines, rows = _counted(monkeypatch, "quantized_conv_lines"), _counted(monkeypatch, "quantized_conv")
    quads = _counted(monkeypatch, "quantized_conv_quads")
    kernel = qdq_linear.quantized_conv(node, [], 1)
    got = [kernel(*inputs)[0] for _ in range(2)]  # the second call reuses the packed weight
    assert (len(quads), len(lines), len(rows)) == ((2, 0, 0) if _quads(x_shape) else (0, 2, 0))
    monkeypatch.setattr(qdq_linear, "_takes_quads", lambda *a: False)
    by_lines = qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]
    assert len(lines) == (1 if _quads(x_shape) else 3)
    monkeypatch.setattr(qdq_linear, "_takes_lines", lambda *a: False)
    by_rows = qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]
    assert len(rows) == 1
    monkeypatch.setattr(qdq_linear, "patch_geometry", lambda *a: None)  # the float convolution of centred codes
    want = qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]
    assert got[0].dtype == want.dtype == (np.float32 if dequantize else act) and got[0].shape == want.shape
    for y in (*got, by_lines, by_rows):
        np.testing.assert_array_equal(y, want)


@pytest.mark.skipif(not qgemm_quads.AVAILABLE, reason="the byte products run on AVX-512 VNNI")
@pytest.mark.parametrize("case", [0, 1, 5])
@pytest.mark.parametrize("act", [np.uint8, np.int8])
@pytest.mark.parametrize("weight_zero", [0, 5])
def test_quads_take_uint8_weights_and_zero_points(monkeypatch, case, act, weight_zero):
    """uint8 weights (signed by 128 for the byte products) with a zero point at their middle or off it, and
    int8 weights at zero point 0 (no window sums): the float path's codes."""
    x_shape, w_shape, attrs = LINES[case]
    inputs = _inputs(np.random.default_rng(case + 7), x_shape, w_shape, act, True, True, bias=True)
    inputs[3] = (inputs[3].astype(np.int16) + 128).astype(np.uint8)  # the same real weights as uint8 codes
    inputs[5] = np.full(inputs[5].shape, 128 + weight_zero, np.uint8)
    int8_weights = [*inputs[:3], (inputs[3].astype(np.int16) - 128).astype(np.int8), inputs[4],
                    np.zeros(inputs[5].shape, np.int8), *inputs[6:]]
    for given in (inputs, int8_weights):
        node = _node(given, attrs, True, True)
        quads = _counted(monkeypatch, "quantized_conv_quads")
        got = qdq_linear.quantized_conv(node, [], 1)(*given)[0]
        assert len(quads) == 1
        with monkeypatch.context() as patched:
            patched.setattr(qdq_linear, "patch_geometry", lambda *a: None)
            want = qdq_linear.quantized_conv(node, [], 1)(*given)[0]
        np.testing.assert_array_equal(got, want)


@pytest.mark.skipif(not qgemm_quads.AVAILABLE, reason="the byte products run on AVX-512 VNNI")
def test_a_repeated_call_of_the_byte_products_takes_the_kept_loop(monkeypatch):
    """A call with the same X shape and constant arrays runs the kept loop without the checks and weight look-ups
    (they would raise here); a new X shape takes them again."""
    x_shape, w_shape, attrs = LINES[0]
    inputs = _inputs(np.random.default_rng(3), x_shape, w_shape, np.int8, False, True, bias=True)
    node = _node(inputs, attrs, True, True)
    kernel = qdq_linear.quantized_conv(node, [], 1)
    first = kernel(*inputs)[0]
    with monkeypatch.context() as patched:
        patched.setattr(qdq_linear, "_quad_weight", None)
        patched.setattr(qdq_linear, "_operand", None)
        again = kernel(inputs[0] * 0.5, *inputs[1:])[0]
    np.testing.assert_array_equal(first, kernel(*inputs)[0])
    monkeypatch.setattr(qdq_linear, "patch_geometry", lambda *a: None)
    want = qdq_linear.quantized_conv(node, [], 1)(inputs[0] * 0.5, *inputs[1:])[0]
    np.testing.assert_array_equal(again, want)
    longer = [inputs[0][:, :, :50], *inputs[1:]]
    np.testing.assert_array_equal(kernel(*longer)[0], qdq_linear.quantized_conv(node, [], 1)(*longer)[0])


@pytest.mark.parametrize("case", range(len(OTHERS)))
def test_other_geometries_keep_the_patch_rows(monkeypatch, case):
    x_shape, w_shape, attrs = OTHERS[case]
    inputs = _inputs(np.random.default_rng(case), x_shape, w_shape, np.uint8, True, True, bias=True)
    node = _node(inputs, attrs, True, False)
    lines, rows = _counted(monkeypatch, "quantized_conv_lines"), _counted(monkeypatch, "quantized_conv")
    monkeypatch.setattr(qdq_linear, "_takes_blocks", lambda *a: False)  # (test_qdq_conv_blocks.py has those)
    got = qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]
    assert (len(lines), len(rows)) == (0, 1)
    monkeypatch.setattr(qdq_linear, "patch_geometry", lambda *a: None)
    np.testing.assert_array_equal(got, qdq_linear.quantized_conv(node, [], 1)(*inputs)[0])


@pytest.mark.parametrize("act", [np.uint8, np.int8])
def test_a_session_runs_the_lines_within_one_code_of_onnxruntime(monkeypatch, act):
    rng = np.random.default_rng(5)
    model = _conv1d_model(rng, act, False)
    lines = _counted(monkeypatch, "quantized_conv_quads" if _quads((2, 12, 30)) else "quantized_conv_lines")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    x = (rng.standard_normal((2, 12, 30)) * 2).astype(np.float32)
    oracle = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    for _ in range(3):
        got = sess.run(None, {"x": x})[0]
        codes, want = np.rint(got.astype(np.float64) / 0.05), np.rint(oracle.astype(np.float64) / 0.05)
        assert np.abs(codes - want).max() <= 1 and np.mean(codes == want) >= 0.99
    assert lines


def test_the_portable_byte_product_gives_the_tiles_integers():
    """portable_quads (hosts without VNNI) and the tiles where they run: overlapping windows of unsigned bytes
    by signed quads, a partial 16-column tile and rows past 4, equal to int64 sums."""
    rng = np.random.default_rng(11)
    flat = rng.integers(0, 256, 4 * 60).astype(np.uint8)
    weight = rng.integers(-128, 128, (24, 37)).astype(np.int8)
    quads = qgemm_quads.quads_of(weight)
    rows, stride = 9, 20
    want = np.stack([flat[r * stride + 8:][:24].astype(np.int64) @ weight.astype(np.int64) for r in range(rows)])
    for product in (qgemm_quads.portable_quads, qgemm_quads.strided_quads):
        out = np.empty((rows, 37), np.int32)
        product(flat, 8, stride, rows, quads, out)
        np.testing.assert_array_equal(out, want)
