"""A 1-D QDQ Conv group whose windows are read in place (ops/qdq_linear.quantized_conv through
compiled/dynamic_conv.quantized_conv_lines: channel-last centred codes, the register tiles reading each output's
kw * C values sw * C apart): the same codes, bit for bit, as the exact float convolution of the centred codes
and as the patch rows (strides 1-3, pads, batches, both 8-bit types, per-tensor and per-channel weights,
float32 data quantized in the call or codes, codes or dequantized values out, output channels past the 16-lane
tiles, rows past the 4-row tiles); geometries it does not take (odd channels, dilation, 2-D) keep the patch rows;
and whisper's stem convolutions through a session within one code of onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.compiled import dynamic_conv, qgemm_tiles
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
]
OTHERS = [  # geometries the patch rows keep
    ((2, 5, 17), (7, 5, 3), {"pads": [1, 1]}),  # odd channels
    ((3, 4, 11), (5, 4, 2), {"pads": [0, 2], "dilations": [2]}),
    ((2, 2, 6, 7), (4, 2, 3, 3), {"pads": [1, 0, 1, 2], "strides": [2, 1]}),
]


def _node(inputs, attrs, quantize_a, dequantize):
    for v in inputs[1:]:
        v.flags.writeable = False  # constants, as a session's initializers are
    return Node("QuantizedConv", [f"i{k}" for k in range(len(inputs))], ["y"], domain=FUSED_DOMAIN, opset=1,
                attrs={**attrs, "quantize_a": int(quantize_a), "dequantize": int(dequantize)})


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
    kernel = qdq_linear.quantized_conv(node, [], 1)
    got = [kernel(*inputs)[0] for _ in range(2)]  # the second call reuses the packed weight
    assert (len(lines), len(rows)) == (2, 0)
    monkeypatch.setattr(qdq_linear, "_takes_lines", lambda *a: False)
    by_rows = qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]
    assert (len(lines), len(rows)) == (2, 1)
    monkeypatch.setattr(qdq_linear, "patch_geometry", lambda *a: None)  # the float convolution of centred codes
    want = qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]
    assert got[0].dtype == want.dtype == (np.float32 if dequantize else act) and got[0].shape == want.shape
    for y in (*got, by_rows):
        np.testing.assert_array_equal(y, want)


@pytest.mark.parametrize("case", range(len(OTHERS)))
def test_other_geometries_keep_the_patch_rows(monkeypatch, case):
    x_shape, w_shape, attrs = OTHERS[case]
    inputs = _inputs(np.random.default_rng(case), x_shape, w_shape, np.uint8, True, True, bias=True)
    node = _node(inputs, attrs, True, False)
    lines, rows = _counted(monkeypatch, "quantized_conv_lines"), _counted(monkeypatch, "quantized_conv")
    got = qdq_linear.quantized_conv(node, [], 1)(*inputs)[0]
    assert (len(lines), len(rows)) == (0, 1)
    monkeypatch.setattr(qdq_linear, "patch_geometry", lambda *a: None)
    np.testing.assert_array_equal(got, qdq_linear.quantized_conv(node, [], 1)(*inputs)[0])


@pytest.mark.parametrize("act", [np.uint8, np.int8])
def test_a_session_runs_the_lines_within_one_code_of_onnxruntime(monkeypatch, act):
    rng = np.random.default_rng(5)
    model = _conv1d_model(rng, act, False)
    lines = _counted(monkeypatch, "quantized_conv_lines")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    x = (rng.standard_normal((2, 12, 30)) * 2).astype(np.float32)
    oracle = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    for _ in range(3):
        got = sess.run(None, {"x": x})[0]
        codes, want = np.rint(got.astype(np.float64) / 0.05), np.rint(oracle.astype(np.float64) / 0.05)
        assert np.abs(codes - want).max() <= 1 and np.mean(codes == want) >= 0.99
    assert lines
