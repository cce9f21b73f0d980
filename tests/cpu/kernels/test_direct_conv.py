"""The tiled direct float32 convolution of AVX2 hosts (compiled/directconv.py, algorithms/conv_direct.py)
against a float64 reference (onnx's evaluator on the inputs in float64), and its fused epilogue against
the unfused nodes bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import record_results
from onnx import helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms import conv_direct, conv_path
from onnx_runtime_ep_cpu.compiled import host
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import conv as conv_ops
from test_compiled_epilogue import ACTIVATIONS, fused_and_unfused
from test_packed_conv import GEOMETRIES

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the tiled direct convolution needs an AVX2 host")

# Beyond test_packed_conv's geometries: the light CNNs' shapes (a 7x7/2 stem, 1x1 strided shortcuts, 2x2
# and 4x4 maps narrower than a tile), a row exactly one tile wide, more channels than one tile with a
# partial last tile, groups of 8 outputs, a 1x1 window with pads, and a pointwise one on fewer pixels
# than a tile.
DIRECT_GEOMETRIES = dict(GEOMETRIES, **{
    "stem 7x7/2 on 64x64": ((1, 3, 64, 64), (16, 3, 7, 7), dict(pads=[3, 3, 3, 3], strides=[2, 2])),
    "1x1 stride 2 shortcut": ((1, 32, 8, 8), (64, 32, 1, 1), dict(strides=[2, 2])),
    "3x3/2 to 2x2": ((1, 32, 4, 4), (32, 32, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    "1x1 on 2x2": ((1, 32, 2, 2), (128, 32, 1, 1), {}),
    "row of one tile": ((2, 5, 6, 6), (17, 5, 1, 1), dict(pads=[0, 0, 0, 0])),
    "33 channels, 3x3": ((1, 7, 11, 13), (33, 7, 3, 3), dict(pads=[1, 1, 1, 1])),
    "groups of 8": ((1, 16, 9, 9), (16, 8, 3, 3), dict(pads=[1, 1, 1, 1], group=2)),
    "1x1 with pads": ((1, 4, 5, 7), (9, 4, 1, 1), dict(pads=[1, 2, 0, 1])),
    "pointwise, 4 pixels": ((3, 10, 2, 2), (20, 10, 1, 1), {}),
    "5x5/2 dilated, odd": ((1, 6, 23, 19), (19, 6, 5, 5), dict(pads=[3, 1, 2, 4], strides=[2, 2], dilations=[2, 1])),
})


def _inputs(geometry: str, seed: int, with_bias: bool):
    x_shape, w_shape, attrs = DIRECT_GEOMETRIES[geometry]
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(x_shape, dtype=np.float32)
    w = rng.standard_normal(w_shape, dtype=np.float32)
    w.flags.writeable = False
    b = rng.standard_normal(w_shape[0], dtype=np.float32) if with_bias else None
    return rng, x, w, b, dict(kernel_shape=list(w_shape[2:]), **attrs)


def _reference64(x, w, b, attrs):
    """The convolution of the float32 inputs, computed in float64."""
    inputs = ["x", "w"] + (["b"] if b is not None else [])
    node = helper.make_node("Conv", inputs, ["y"], **attrs)
    feeds = {"x": x.astype(np.float64), "w": w.astype(np.float64)}
    if b is not None:
        feeds["b"] = b.astype(np.float64)
    return ReferenceEvaluator(node).run(None, feeds)[0]


@pytest.fixture
def direct_everywhere(knobs, monkeypatch):
    """The direct tiles for every convolution the tests give (whatever its size), on AVX-512 hosts too."""
    knobs(direct_macs=1 << 40)
    monkeypatch.setattr(conv_path, "packed_conv_applies", lambda geo, group, x: False)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("geometry", sorted(DIRECT_GEOMETRIES))
def test_direct_conv_matches_a_float64_reference(monkeypatch, direct_everywhere, geometry, with_bias):
    rng, x, w, b, attrs = _inputs(geometry, 7, with_bias)
    taken = record_results(monkeypatch, conv_direct.DirectConv, "run")
    conv = conv_ops.conv(Node("Conv", ["x", "w"] + (["b"] if with_bias else []), ["y"], attrs=attrs, opset=13),
                         None, 13)
    (y,) = conv(x, w, b)
    (again,) = conv(x, w, b)  # weights packed once, reused
    expected = _reference64(x, w, b, attrs)
    applies = (w.shape[0] // attrs.get("group", 1) >= 8 or attrs.get("group", 1) == 1) and x.shape[0] * w.shape[0] > 0
    assert len(taken) == (2 if applies else 0)
    assert y.dtype == np.float32 and y.shape == expected.shape
    # float32 sums of K = C/group * kh * kw products: a bound that grows with K.
    depth = int(np.prod(w.shape[1:]))
    scale = np.abs(x).max() * np.abs(w).max() * depth
    np.testing.assert_allclose(y, expected, rtol=0, atol=4e-7 * scale)
    np.testing.assert_array_equal(again, y)


@pytest.mark.parametrize("kind,params", ACTIVATIONS)
@pytest.mark.parametrize("with_bias,with_residual", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("geometry", ["3x3 same", "3x3 stride 2", "1x1", "1x1 on 2x2", "stem 7x7/2 on 64x64",
                                      "groups of 8", "row chunks"])
def test_fused_direct_conv_is_conv_then_epilogue_exactly(monkeypatch, direct_everywhere, geometry, kind, params,
                                                          with_bias, with_residual):
    """The tile adds the bias, the residual and applies the activation as it stores its pixels, in the order
    of the unfused nodes: bit for bit what Conv (no bias) then those passes give."""
    rng, x, w, b, attrs = _inputs(geometry, 8, with_bias)
    taken = record_results(monkeypatch, conv_direct.DirectConv, "run")
    (conv_out,) = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=attrs, opset=13), None, 13)(x, w)
    z = rng.standard_normal(conv_out.shape, dtype=np.float32) if with_residual else None
    if z is not None:
        z[0, 0, 0, :2] = [np.nan, -np.inf]  # NaN and infinities pass through every activation as in numpy
    got, expected = fused_and_unfused(x, w, b, z, attrs, kind, params, conv_out)
    plain = kind is None and z is None and b is not None  # the expected output is then the Conv's own, one more run
    assert len(taken) == (3 if plain else 2)
    np.testing.assert_array_equal(got, expected)


def test_large_convolutions_keep_the_blas_paths(monkeypatch, knobs):
    knobs(direct_macs=1000)
    monkeypatch.setattr(conv_path, "packed_conv_applies", lambda geo, group, x: False)
    taken = record_results(monkeypatch, conv_direct.DirectConv, "run")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 8, 10, 10), dtype=np.float32)
    w = rng.standard_normal((8, 8, 3, 3), dtype=np.float32)
    attrs = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    (y,) = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=attrs, opset=13), None, 13)(x, w)
    assert not taken
    np.testing.assert_allclose(y, _reference64(x, w, None, attrs), rtol=1e-4, atol=1e-4)


def test_hosts_without_avx2_keep_the_other_paths(monkeypatch):
    monkeypatch.setattr(host, "AVX2", False)
    monkeypatch.setattr(conv_path, "packed_conv_applies", lambda geo, group, x: False)
    taken = record_results(monkeypatch, conv_direct.DirectConv, "run")
    x = np.ones((1, 3, 5, 5), np.float32)
    w = np.ones((4, 3, 3, 3), np.float32)
    (y,) = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=dict(kernel_shape=[3, 3]), opset=13), None, 13)(x, w)
    assert not taken
    np.testing.assert_array_equal(y, np.full((1, 4, 3, 3), 27, np.float32))


# Depthwise windows for compiled/depthwise_lanes.py: channels in blocks of 8 (a partial last block), rows
# narrower than a tile and a row of exactly one, strides 1 to 3, dilations, asymmetric pads, batches.
DEPTHWISE_GEOMETRIES = {
    "3x3 s1, 72 channels": ((1, 72, 8, 8), 3, dict(pads=[1, 1, 1, 1])),
    "3x3 s2, 16 channels": ((2, 16, 32, 32), 3, dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    "5x5 s2, 13 channels": ((1, 13, 9, 11), 5, dict(pads=[2, 2, 2, 2], strides=[2, 2])),
    "5x5 on 4x4": ((1, 120, 4, 4), 5, dict(pads=[2, 2, 2, 2])),
    "3x3 to 2x2": ((1, 9, 3, 3), 3, dict(pads=[1, 1, 1, 1], strides=[2, 2])),
    "dilated, asymmetric": ((1, 11, 10, 13), 3, dict(pads=[2, 0, 1, 3], dilations=[2, 2])),
    "stride 3, 4 wide": ((1, 5, 12, 12), 3, dict(strides=[3, 3])),
    "7x7 valid": ((1, 8, 9, 14), 7, {}),
}


def _depthwise_inputs(geometry: str, seed: int, with_bias: bool):
    x_shape, k, attrs = DEPTHWISE_GEOMETRIES[geometry]
    rng = np.random.default_rng(seed)
    c = x_shape[1]
    x = rng.standard_normal(x_shape, dtype=np.float32)
    w = rng.standard_normal((c, 1, k, k), dtype=np.float32)
    w.flags.writeable = False
    b = rng.standard_normal(c, dtype=np.float32) if with_bias else None
    return rng, x, w, b, dict(kernel_shape=[k, k], group=c, **attrs)


@pytest.fixture
def lanes_depthwise(monkeypatch):
    """The depthwise lanes wherever they apply, on AVX-512 hosts too."""
    monkeypatch.setattr(host, "AVX512", False)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("geometry", sorted(DEPTHWISE_GEOMETRIES))
def test_depthwise_lanes_match_a_float64_reference(monkeypatch, lanes_depthwise, geometry, with_bias):
    rng, x, w, b, attrs = _depthwise_inputs(geometry, 4, with_bias)
    from onnx_runtime_ep_cpu.compiled import depthwise_lanes

    calls = record_results(monkeypatch, type(depthwise_lanes.conv_depthwise), "__call__")
    conv = conv_ops.conv(Node("Conv", ["x", "w"] + (["b"] if with_bias else []), ["y"], attrs=attrs, opset=13),
                         None, 13)
    (y,) = conv(x, w, b)
    expected = _reference64(x, w, b, attrs)
    assert len(calls) == 1 and y.dtype == np.float32 and y.shape == expected.shape
    depth = int(np.prod(w.shape[1:]))
    np.testing.assert_allclose(y, expected, rtol=0, atol=4e-7 * np.abs(x).max() * np.abs(w).max() * depth)


@pytest.mark.parametrize("kind,params", ACTIVATIONS)
@pytest.mark.parametrize("with_bias,with_residual", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("geometry", ["3x3 s2, 16 channels", "5x5 s2, 13 channels", "3x3 to 2x2"])
def test_fused_depthwise_lanes_are_conv_then_epilogue_exactly(lanes_depthwise, geometry, kind, params, with_bias,
                                                               with_residual):
    """Bias and activation applied as each tile is stored, a residual after: bit for bit the unfused nodes
    (the bias added to the sums, as a Conv with its bias does, then the rest)."""
    rng, x, w, b, attrs = _depthwise_inputs(geometry, 5, with_bias)
    (conv_out,) = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=attrs, opset=13), None, 13)(x, w)
    z = rng.standard_normal(conv_out.shape, dtype=np.float32) if with_residual else None
    got, expected = fused_and_unfused(x, w, b, z, attrs, kind, params, conv_out, bias_first=z is None)
    np.testing.assert_array_equal(got, expected)


def _hard_swish_node(x):
    """The HardSwish operator's own kernel on x."""
    from onnx_runtime_ep_cpu.registry import lookup

    return lookup("HardSwish", "", 14)(Node("HardSwish", ["x"], ["y"], opset=14), None, 14)(x)[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("with_bias,with_residual", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("geometry", ["3x3 same", "stem 7x7/2 on 64x64", "1x1 on 2x2", "groups", "depthwise"])
def test_fused_hard_swish_is_conv_then_hard_swish_exactly(direct_everywhere, geometry, dtype, with_bias,
                                                          with_residual):
    """MobileNetV3's Conv -> HardSwish fused: the direct tiles apply it as they store, the other paths
    (depthwise, float64, few outputs per group) after the convolution; bit for bit the two nodes."""
    if geometry == "depthwise":
        rng, x, w, b, attrs = _depthwise_inputs("5x5 s2, 13 channels", 6, with_bias)
    else:
        rng, x, w, b, attrs = _inputs(geometry, 6, with_bias)
    x, w = x.astype(dtype), w.astype(dtype)
    b = None if b is None else b.astype(dtype)
    (conv_out,) = conv_ops.conv(Node("Conv", ["x", "w", "b"], ["y"], attrs=attrs, opset=13), None, 13)(x, w, b)
    z = rng.standard_normal(conv_out.shape).astype(dtype) if with_residual else None
    if z is not None:
        z.reshape(-1)[:3] = [np.nan, -np.inf, np.inf]
    expected = _hard_swish_node(conv_out if z is None else conv_out + z)
    node = Node("FusedConv", ["x", "w", "b", "z"], ["y"], domain=FUSED_DOMAIN,
                attrs=dict(attrs, activation="HardSwish", activation_params=[]), opset=1)
    (got,) = conv_ops.fused_conv(node, None, 1)(x, w, b, z)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got, expected)


def test_conv_then_hard_swish_fuses_and_matches_onnxruntime(monkeypatch):
    import onnx_runtime
    import onnxruntime
    from onnx import TensorProto, numpy_helper

    rng = np.random.default_rng(11)
    w = numpy_helper.from_array(rng.standard_normal((24, 8, 3, 3), dtype=np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(24, dtype=np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("HardSwish", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 15, 13])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    x = rng.standard_normal((1, 8, 15, 13), dtype=np.float32)
    fused = []
    real = conv_direct.DirectConv.run
    monkeypatch.setattr(conv_direct.DirectConv, "run", lambda self, *args: fused.append(args[5:6] == (True,))
                        or real(self, *args))
    monkeypatch.setattr(conv_path, "packed_conv_applies", lambda geo, group, x: False)
    session = onnx_runtime.InferenceSession(model, providers=["CPUExecutionProvider"])
    (got,) = session.run(None, {"x": x})
    assert fused == [True]  # one FusedConv, HardSwish applied by the tiles
    (expected,) = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
