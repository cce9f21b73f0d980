"""Cold start: what a convolution's first call builds from its attributes and shapes alone is built once per process.
A window's Geometry (pads, output size, border slabs) is shared by every convolution and pool of the same attributes
over the same shape, and by later sessions of the model (algorithms/window.Window._shared); a FusedConv's epilogue
constants (the activation's bounds, the empty bias and residual stand-ins) by every FusedConv of the same activation
(ops/conv._compiled_epilogue). Attributes that do not fit a shape still fail naming their own node."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from onnx import helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms import window
from onnx_runtime_ep_cpu.ops import conv as conv_ops


def _window(attrs: dict, name: str = "") -> window.Window:
    return window.Window(Node("Conv", [], [], name=name, attrs=attrs), [], needs_kernel=False)


def test_equal_attributes_over_one_shape_share_one_geometry(monkeypatch):
    monkeypatch.setattr(window, "_GEOMETRIES", {})
    first = _window({"pads": [1, 1, 1, 1]}).resolve((8, 8), (3, 3))
    again = _window({"pads": [1, 1, 1, 1]}).resolve((8, 8), (3, 3))
    assert again is first
    assert (first.begin, first.end, first.out) == ((1, 1), (1, 1), (8, 8))
    # another shape, pads, stride or kernel is another geometry, with its own values
    strided = _window({"pads": [1, 1, 1, 1], "strides": [2, 2]}).resolve((8, 8), (3, 3))
    unpadded = _window({}).resolve((8, 8), (3, 3))
    wider = _window({"pads": [1, 1, 1, 1]}).resolve((8, 10), (3, 3))
    assert len({id(g) for g in (first, strided, unpadded, wider)}) == 4
    assert (strided.out, unpadded.out, wider.out) == ((4, 4), (6, 6), (8, 10))
    assert unpadded.unpadded and not first.unpadded


def test_a_shape_the_window_does_not_fit_fails_naming_each_node(monkeypatch):
    monkeypatch.setattr(window, "_GEOMETRIES", {})
    for name in ("first_conv", "second_conv"):
        with pytest.raises(InvalidArgumentError, match=name):
            _window({}, name).resolve((2, 2), (3, 3))
    assert window._GEOMETRIES == {}  # noqa: SLF001  (a failure is never kept)


def test_fused_convolutions_of_one_activation_share_their_epilogue_constants(monkeypatch):
    monkeypatch.setattr(conv_ops, "_EPILOGUE_CONSTANTS", {})

    def prepare(activation, params=None):
        attrs = {"activation": activation} if activation else {}
        if params is not None:
            attrs["activation_params"] = params
        return conv_ops._compiled_epilogue(Node("FusedConv", [], [], attrs=attrs))  # noqa: SLF001

    relu, relu_again = prepare("Relu"), prepare("Relu")
    assert relu_again.float32_bounds is relu.float32_bounds
    six, one = prepare("Clip", [0.0, 6.0]), prepare("Clip", [0.0, 1.0])
    np.testing.assert_array_equal(relu.float32_bounds, [0.0, np.inf, 1.0])
    np.testing.assert_array_equal(six.float32_bounds, [0.0, 6.0, 1.0])
    np.testing.assert_array_equal(one.float32_bounds, [0.0, 1.0, 1.0])
    np.testing.assert_array_equal(prepare(None).float32_bounds, [-np.inf, np.inf, 1.0])
    for dtype in (np.float32, np.float64):  # the empty stand-ins, per dtype
        epilogue = relu(None, None, np.dtype(dtype))
        assert epilogue.bias.shape == (0,) and epilogue.residual.shape == (0, 0, 0)
        assert epilogue.bias.dtype == dtype and epilogue.bounds.dtype == dtype


def _model(path) -> tuple[np.ndarray, ...]:
    """Two Conv + Relu blocks of one geometry (3x3, pads 1) and a Conv + Clip, float32."""
    rng = np.random.default_rng(7)
    w1, w2, w3 = (rng.standard_normal((8, 8, 3, 3)).astype(np.float32) * 0.2 for _ in range(3))
    b1, b2, b3 = (rng.standard_normal(8).astype(np.float32) * 0.1 for _ in range(3))
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"]),
             helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1]),
             helper.make_node("Clip", ["c3", "low", "high"], ["y"])]
    inits = [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"), (b1, "b1"),
                                                        (b2, "b2"), (b3, "b3"))]
    inits += [numpy_helper.from_array(np.array(0.0, np.float32), "low"),
              numpy_helper.from_array(np.array(6.0, np.float32), "high")]
    graph = helper.make_graph(nodes, "shared_geometry", [helper.make_tensor_value_info("x", 1, [2, 8, 10, 10])],
                              [helper.make_tensor_value_info("y", 1, None)], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return w1, b1, w2, b2, w3, b3


def _conv3x3(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A 3x3, pads 1, stride 1 convolution in float64."""
    n, c, h, wd = x.shape
    xp = np.zeros((n, c, h + 2, wd + 2))
    xp[:, :, 1:-1, 1:-1] = x
    y = np.zeros((n, w.shape[0], h, wd))
    for i in range(3):
        for j in range(3):
            y += np.einsum("nchw,mc->nmhw", xp[:, :, i:i + h, j:j + wd], w[:, :, i, j].astype(np.float64))
    return y + b.astype(np.float64)[None, :, None, None]


def test_a_second_session_builds_no_geometry_and_computes_the_same(tmp_path, monkeypatch):
    monkeypatch.setattr(window, "_GEOMETRIES", {})
    built: list[tuple] = []
    real = window.Geometry

    class Counted(real):
        def __init__(self, in_shape, *rest):
            built.append(in_shape)
            super().__init__(in_shape, *rest)

    monkeypatch.setattr(window, "Geometry", Counted)
    w1, b1, w2, b2, w3, b3 = _model(tmp_path / "m.onnx")
    x = np.random.default_rng(3).standard_normal((2, 8, 10, 10)).astype(np.float32)
    reference = np.clip(_conv3x3(np.maximum(_conv3x3(np.maximum(_conv3x3(x, w1, b1), 0), w2, b2), 0), w3, b3), 0, 6)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    made = []
    for _ in range(2):
        sess = ort.InferenceSession(str(tmp_path / "m.onnx"), options, providers=["CPUExecutionProvider"])
        for _ in range(2):
            y = sess.run(None, {"x": x})[0]
            assert np.max(np.abs(y - reference)) <= 1e-4 * max(1.0, float(np.max(np.abs(reference))))
        made.append(len(built))
    assert made[0] == 1  # the three convolutions' one geometry
    assert made[1] == made[0]  # none for the second session
