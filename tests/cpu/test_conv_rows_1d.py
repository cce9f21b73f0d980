"""1-D float32 convolutions run as 2-D ones over a single row (algorithms/conv_rows.py): results against a float64
reference over strides, pads, dilations, groups, batches above one, with and without bias, a fused residual and
activation; a 4-D input to a node with a 1-D window is still refused."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime_ep_cpu.algorithms import conv_rows
from onnx_runtime_ep_cpu.ops import conv


def _conv1d_reference(x, w, b, stride, pad, dilation, group):
    """float64 1-D convolution by its definition."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, c, length = x.shape
    m, cg, k = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad[0], pad[1])))
    out = (length + pad[0] + pad[1] - dilation * (k - 1) - 1) // stride + 1
    y = np.zeros((n, m, out))
    mg = m // group
    for o in range(m):
        g = o // mg
        for t in range(k):
            taps = xp[:, g * cg:(g + 1) * cg, t * dilation: t * dilation + (out - 1) * stride + 1: stride]
            y[:, o] += np.einsum("nct,c->nt", taps, w[o, :, t])
    if b is not None:
        y += b.astype(np.float64)[None, :, None]
    return y


def _session(model):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


CASES = [  # (batch, channels in, channels out, length, kernel, stride, pads, dilation, group, bias)
    (1, 80, 64, 100, 3, 1, (1, 1), 1, 1, True),  # Whisper's first layer
    (1, 64, 64, 100, 3, 2, (1, 1), 1, 1, True),  # and its second
    (2, 7, 5, 31, 3, 2, (1, 1), 1, 1, False),
    (3, 6, 9, 17, 5, 1, (2, 1), 2, 3, True),
    (1, 16, 33, 40, 10, 5, (0, 0), 1, 1, True),  # wav2vec's strided feature encoder
    (2, 8, 8, 9, 3, 3, (0, 2), 1, 8, True),  # depthwise
]


@pytest.mark.parametrize("case", CASES)
def test_conv1d_against_float64(case, monkeypatch):
    lifted = []
    monkeypatch.setattr(conv, "as_row", lambda x: lifted.append(x.shape) or conv_rows.as_row(x))
    batch, cin, cout, length, kernel, stride, pads, dilation, group, bias = case
    rng = np.random.default_rng(sum(case[:6]))
    w = (rng.standard_normal((cout, cin // group, kernel)) / np.sqrt(cin * kernel / group)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32) if bias else None
    initializers = [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(b, "b")] if bias else [])
    node = helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["y"], kernel_shape=[kernel],
                            strides=[stride], pads=list(pads), dilations=[dilation], group=group)
    model = make_model([node], [tensor_info("x", TensorProto.FLOAT, [batch, cin, length])],
                       [tensor_info("y", TensorProto.FLOAT, None)], initializers)
    session = _session(model)
    for seed in range(2):  # the second call reuses the path and the weight's row view
        x = np.random.default_rng(seed).standard_normal((batch, cin, length)).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        reference = _conv1d_reference(x, w, b, stride, pads, dilation, group)
        assert y.shape == reference.shape and y.dtype == np.float32
        scale = np.abs(reference).max() + 1
        assert np.abs(y - reference).max() <= 2e-5 * scale
    assert (batch, cin, length) in lifted  # the input ran as one row of a 2-D convolution


def test_fused_conv1d_residual_and_activation():
    """Conv -> Add(residual) -> Relu fuses into a FusedConv whose 1-D call runs over one row as well."""
    rng = np.random.default_rng(3)
    batch, cin, cout, length = 2, 12, 16, 23
    w = (rng.standard_normal((cout, cin, 3)) / 6).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3], pads=[1, 1]),
             helper.make_node("Add", ["c", "z"], ["s"]),
             helper.make_node("Relu", ["s"], ["y"])]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [batch, cin, length]),
                               tensor_info("z", TensorProto.FLOAT, [batch, cout, length])],
                       [tensor_info("y", TensorProto.FLOAT, None)],
                       [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    x = rng.standard_normal((batch, cin, length)).astype(np.float32)
    z = rng.standard_normal((batch, cout, length)).astype(np.float32)
    (y,) = _session(model).run(None, {"x": x, "z": z})
    reference = np.maximum(_conv1d_reference(x, w, b, 1, (1, 1), 1, 1) + z, 0)
    assert np.abs(y - reference).max() <= 2e-5 * (np.abs(reference).max() + 1)


def test_four_dimensional_input_to_a_one_dimensional_window_is_refused():
    """The row view is taken for 3-D inputs only: a 4-D feed to a node with a 1-D kernel stays an error."""
    w = np.ones((4, 3, 3), np.float32)
    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[3])
    model = make_model([node], [tensor_info("x", TensorProto.FLOAT, None)], [tensor_info("y", TensorProto.FLOAT, None)],
                       [numpy_helper.from_array(w, "w")])
    with pytest.raises(OnnxRuntimeError):
        _session(model).run(None, {"x": np.ones((1, 3, 1, 8), np.float32)})
