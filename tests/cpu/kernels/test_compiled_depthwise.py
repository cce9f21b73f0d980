"""The compiled depthwise convolution (compiled/depthwise.py) against a direct float64 convolution
over the attribute space, and the dtypes it leaves to the numpy path."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms import conv_blas, conv_depthwise, window
from onnx_runtime_ep_cpu.compiled import depthwise, gemm
from onnx_runtime_ep_cpu.ops import conv as conv_ops

RNG = np.random.default_rng(11)


def _conv(attrs, shapes):
    node = Node("Conv", ["x", "w", "b"][: len(shapes)], ["y"], name="dw", attrs=dict(attrs), opset=17)
    return conv_ops.conv(node, list(shapes), 17)


def _pads(attrs, spatial, kernel):
    """Pads before and after each spatial dim, auto_pad resolved as the ONNX spec says."""
    rank = len(spatial)
    strides = attrs.get("strides", [1] * rank)
    dilations = attrs.get("dilations", [1] * rank)
    auto = attrs.get("auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        totals = [max(0, (math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n)
                  for n, s, k, d in zip(spatial, strides, kernel, dilations)]
        begin = [t // 2 if auto == "SAME_UPPER" else t - t // 2 for t in totals]
        return begin, [t - b for t, b in zip(totals, begin)]
    pads = attrs.get("pads", [0] * (2 * rank)) if auto == "NOTSET" else [0] * (2 * rank)
    return pads[:rank], pads[rank:]


def _reference(x, w, b, attrs):
    """Depthwise convolution in float64: one weighted strided view of the padded input per kernel tap."""
    rank = x.ndim - 2
    kernel = w.shape[2:]
    strides = attrs.get("strides", [1] * rank)
    dilations = attrs.get("dilations", [1] * rank)
    begin, end = _pads(attrs, x.shape[2:], kernel)
    xp = np.pad(x.astype(np.float64), [(0, 0), (0, 0), *zip(begin, end)])
    out = [(n - (k - 1) * d - 1) // s + 1 for n, k, d, s in zip(xp.shape[2:], kernel, dilations, strides)]
    multiplier = w.shape[0] // x.shape[1]
    y = np.zeros((x.shape[0], w.shape[0], *out))
    for tap in itertools.product(*(range(k) for k in kernel)):
        view = xp[(Ellipsis, *(slice(t * d, t * d + (o - 1) * s + 1, s)
                               for t, d, o, s in zip(tap, dilations, out, strides)))]
        weight = w[(slice(None), 0, *tap)].astype(np.float64).reshape(-1, *(1,) * rank)
        y += weight * np.repeat(view, multiplier, axis=1)
    if b is not None:
        y += b.astype(np.float64).reshape(-1, *(1,) * rank)
    return y


def _run(x, w, b, attrs):
    inputs = [x, w] + ([] if b is None else [b])
    return _conv({**attrs, "group": x.shape[1]}, [a.shape for a in inputs])(*inputs)[0]


def _constant(a):
    a.flags.writeable = False
    return a


@pytest.fixture(params=["rows", "maps"])
def copies(request, monkeypatch):
    """Copies in and out of the planes by row loops, or (for images up to 64 rows wide) by index maps."""
    monkeypatch.setattr(depthwise, "_SHORT_ROW", 0 if request.param == "rows" else 64)
    return request.param


@pytest.fixture
def numpy_path_forbidden(monkeypatch):
    """Fails a test whose float32/float64 depthwise convolution would run the numpy kernel."""
    def fail(*args, **kwargs):
        raise AssertionError("the numpy depthwise path ran")

    monkeypatch.setattr(conv_depthwise, "conv_depthwise", fail)


CASES = [
    # (input shape, kernel, attrs)
    ((2, 5, 9, 11), (3, 3), {"pads": [1, 1, 1, 1]}),
    ((1, 7, 12, 10), (3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((1, 4, 13, 9), (3, 3), {"strides": [2, 2], "pads": [0, 1, 1, 0]}),
    ((1, 3, 15, 16), (5, 5), {"pads": [2, 2, 2, 2]}),
    ((2, 3, 14, 13), (5, 3), {"strides": [3, 2], "pads": [2, 0, 1, 2]}),
    ((1, 4, 11, 12), (3, 3), {"dilations": [2, 3], "pads": [2, 3, 2, 3]}),
    ((1, 4, 11, 12), (3, 2), {"strides": [2, 3], "dilations": [2, 2], "pads": [1, 0, 0, 1]}),
    ((1, 3, 8, 8), (1, 1), {"strides": [2, 2]}),
    ((1, 3, 9, 10), (2, 4), {}),  # no pads
    ((1, 3, 6, 7), (4, 4), {"pads": [3, 3, 3, 3]}),  # pads as wide as the kernel: all-pad windows
    ((1, 5, 10, 9), (3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    ((1, 5, 10, 9), (4, 4), {"auto_pad": "SAME_LOWER"}),
    ((1, 5, 10, 9), (3, 3), {"auto_pad": "VALID", "strides": [1, 2]}),
    ((1, 6, 3, 3), (3, 3), {"pads": [1, 1, 1, 1]}),  # a tiny image
    ((1, 3, 20, 37), (3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),  # odd width, stride 2
    ((1, 2, 19, 34), (3, 3), {"strides": [2, 2], "pads": [0, 1, 1, 0]}),  # odd begin pad, stride 2
    ((1, 2, 21, 40), (3, 5), {"strides": [2, 3], "pads": [1, 2, 0, 1]}),  # stride 3 columns
    ((1, 2, 12, 30), (2, 2), {"strides": [1, 2], "pads": [0, 3, 0, 0]}),  # wide begin pad: a pair on it
    ((1, 3, 40, 70), (3, 3), {"pads": [1, 1, 1, 1]}),  # several row blocks per channel
    ((2, 4, 17), (3,), {"pads": [1, 1]}),  # 1-D
    ((1, 4, 20), (5,), {"strides": [2], "dilations": [2], "pads": [3, 1]}),  # 1-D
]


@pytest.mark.usefixtures("numpy_path_forbidden", "copies")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("multiplier", [1, 3])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("shape,kernel,attrs", CASES)
def test_compiled_depthwise_matches_direct_convolution(shape, kernel, attrs, with_bias, multiplier, dtype):
    c = shape[1]
    x = RNG.standard_normal(shape).astype(dtype)
    w = _constant(RNG.standard_normal((c * multiplier, 1, *kernel)).astype(dtype))
    b = _constant(RNG.standard_normal(c * multiplier).astype(dtype)) if with_bias else None
    y = _run(x, w, b, attrs)
    expected = _reference(x, w, b, attrs)
    assert y.dtype == dtype and y.shape == expected.shape
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(y, expected, rtol=tol, atol=tol)


@pytest.mark.usefixtures("numpy_path_forbidden", "copies")
def test_compiled_depthwise_keeps_nan_and_inf_where_the_windows_reach():
    # Pads are zeros, never NaN: only the outputs whose window covers the NaN/inf become NaN/inf.
    x = RNG.standard_normal((1, 2, 8, 9)).astype(np.float32)
    x[0, 0, 0, 0] = np.nan
    x[0, 1, 7, 8] = np.inf
    x[0, 1, 3, 4] = -np.inf
    w = _constant(np.abs(RNG.standard_normal((2, 1, 3, 3))).astype(np.float32) + 0.1)
    attrs = {"pads": [1, 1, 1, 1]}
    y = _run(x, w, None, attrs)
    expected = _reference(x, w, None, attrs)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(expected))
    np.testing.assert_array_equal(np.isinf(y), np.isinf(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(y[finite], expected[finite], rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("numpy_path_forbidden")
def test_compiled_depthwise_takes_strided_input_and_follows_new_weights():
    base = RNG.standard_normal((1, 10, 12, 6)).astype(np.float32)
    x = base.transpose(0, 3, 1, 2)  # (1, 6, 10, 12), not contiguous
    attrs = {"pads": [1, 1, 1, 1], "group": 6}
    w, b = _constant(RNG.standard_normal((6, 1, 3, 3)).astype(np.float32)), _constant(np.ones(6, np.float32))
    run = _conv(attrs, [x.shape, w.shape, b.shape])
    np.testing.assert_allclose(run(x, w, b)[0], _reference(x, w, b, attrs), rtol=1e-5, atol=1e-5)
    w2 = _constant(2 * w)  # prepared weights are rebuilt for a new constant
    np.testing.assert_allclose(run(x, w2, b)[0], _reference(x, w2, b, attrs), rtol=1e-5, atol=1e-5)
    fed = w.copy()  # a fed (writeable) weight changed in place between runs
    run(x, fed, b)
    fed *= -1
    np.testing.assert_allclose(run(x, fed, b)[0], _reference(x, fed, b, attrs), rtol=1e-5, atol=1e-5)


def test_compiled_depthwise_matches_the_numpy_path():
    # The two paths sum the same products in a different order: equal to float32 rounding.
    x = RNG.standard_normal((2, 8, 14, 15)).astype(np.float32)
    w = _constant(RNG.standard_normal((16, 1, 3, 3)).astype(np.float32))
    b = _constant(RNG.standard_normal(16).astype(np.float32))
    attrs = {"strides": [2, 1], "pads": [1, 1, 1, 1]}
    attributes = window.Window(Node("Conv", ["x", "w"], ["y"], attrs=dict(attrs), opset=17), None, needs_kernel=False)
    geo = attributes.resolve(x.shape[2:], w.shape[2:])
    numpy_y = conv_depthwise.conv_depthwise(x, conv_blas.grouped_weights(w, b, 8, np.float32), geo, True)
    np.testing.assert_allclose(_run(x, w, b, attrs), numpy_y, rtol=1e-5, atol=1e-5)


def test_other_dtypes_and_ranks_keep_the_numpy_path(monkeypatch):
    # float16 (computed in float32 by the numpy kernel) and 3-D windows never reach the compiled loop.
    def fail(*args, **kwargs):
        raise AssertionError("the compiled depthwise loop ran")

    monkeypatch.setattr(conv_depthwise, "compiled_depthwise", fail)
    x = RNG.standard_normal((1, 4, 7, 8)).astype(np.float16)
    w = _constant(RNG.standard_normal((4, 1, 3, 3)).astype(np.float16))
    y = _run(x, w, None, {"pads": [1, 1, 1, 1]})
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, _reference(x, w, None, {"pads": [1, 1, 1, 1]}), rtol=1e-2, atol=1e-2)
    x3 = RNG.standard_normal((1, 3, 4, 5, 6)).astype(np.float32)
    w3 = _constant(RNG.standard_normal((3, 1, 2, 2, 2)).astype(np.float32))
    np.testing.assert_allclose(_run(x3, w3, None, {}), _reference(x3, w3, None, {}), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,kernel,attrs", [CASES[0], CASES[2], CASES[5], CASES[11], CASES[-2],
                                                ((1, 3, 4, 5, 6), (2, 3, 2), {"pads": [1, 0, 1, 0, 1, 1]})])
def test_numpy_path_still_matches_direct_convolution(monkeypatch, shape, kernel, attrs, knobs):
    # The fallback for other dtypes and ranks, forced for float32 and split into small channel blocks.
    monkeypatch.setattr(conv_depthwise, "depthwise_compiles", lambda geo, x: False)
    knobs(depthwise_block_bytes=2 * 4 * 10 * 30)
    c = shape[1]
    x = RNG.standard_normal(shape).astype(np.float32)
    w = _constant(RNG.standard_normal((2 * c, 1, *kernel)).astype(np.float32))
    b = _constant(RNG.standard_normal(2 * c).astype(np.float32))
    np.testing.assert_allclose(_run(x, w, b, attrs), _reference(x, w, b, attrs), rtol=1e-5, atol=1e-5)


needs_avx512 = pytest.mark.skipif(not gemm.AVAILABLE, reason="the direct kernel needs an AVX-512 host")


def _plan(shape, strides, pads, kernel=(3, 3), dilations=(1, 1)):
    """A DepthwisePlan for an (H, W) image, pads (top, left, bottom, right)."""
    (h, w), (sh, sw), (dh, dw) = shape, strides, dilations
    out = tuple((n + p0 + p1 - (k - 1) * d - 1) // s + 1
                for n, p0, p1, k, d, s in zip((h, w), pads[:2], pads[2:], kernel, (dh, dw), (sh, sw)))
    return depthwise.DepthwisePlan((h, w), kernel, strides, dilations, tuple(pads[:2]), out)


@needs_avx512
def test_direct_kernel_takes_3x3_windows_of_stride_1_and_2():
    assert _plan((7, 7), (1, 1), (1, 1, 1, 1)).direct
    assert _plan((14, 15), (2, 2), (0, 1, 1, 0)).direct
    assert not _plan((14, 15), (1, 2), (1, 1, 1, 1)).direct  # mixed strides: the planes
    assert not _plan((14, 15), (3, 3), (1, 1, 1, 1)).direct
    assert not _plan((14, 15), (1, 1), (2, 2, 2, 2), dilations=(2, 2)).direct
    assert not _plan((14, 15), (1, 1), (2, 2, 2, 2), kernel=(5, 5)).direct


ACTIVATIONS = {
    "none": (-np.inf, np.inf, 1.0),
    "relu": (0.0, np.inf, 1.0),
    "clip": (-0.5, 0.75, 1.0),
    "leaky": (-np.inf, np.inf, 0.125),
}


@needs_avx512
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("shape,pads", [
    ((7, 7), (1, 1, 1, 1)), ((1, 1), (1, 1, 1, 1)), ((15, 17), (1, 1, 1, 1)), ((8, 33), (0, 1, 1, 0)),
    ((16, 16), (0, 0, 0, 0)), ((9, 40), (1, 0, 0, 1)), ((22, 5), (1, 1, 0, 0)), ((3, 64), (0, 1, 0, 1)),
])
def test_direct_kernel_is_the_plane_loop_bit_for_bit(shape, pads, stride, activation):
    # Both start from the bias and add the taps in row-major order as fused multiply-adds, pads as zeros:
    # the same bits, over row blocks with a partial last one (heights 1-22), 16-column chunks with a tail
    # (widths 1-64), asymmetric pads, two outputs per channel, a channel shuffle, every activation.
    plan = _plan(shape, (stride, stride), pads)
    assert plan.direct
    x = RNG.standard_normal((1, 6, *shape)).astype(np.float32)
    w = RNG.standard_normal((12, 9)).astype(np.float32)
    b = RNG.standard_normal(12).astype(np.float32)
    source = np.array([5, 3, 1, 0, 2, 4], dtype=np.uint64)
    bounds = np.array(ACTIVATIONS[activation], dtype=np.float32)
    direct = plan(x, w, b, bounds, source)
    plan.direct = 0
    planes = plan(x, w, b, bounds, source)
    np.testing.assert_array_equal(direct, planes)
    expected = _reference(x[:, source.astype(np.int64)], w.reshape(12, 1, 3, 3), b,
                          {"strides": [stride] * 2, "pads": list(pads)})
    low, high, slope = bounds.astype(np.float64)
    expected = np.minimum(np.maximum(np.where(expected < 0, expected * slope, expected), low), high)
    np.testing.assert_allclose(direct, expected, rtol=1e-5, atol=1e-5)


@needs_avx512
def test_direct_kernel_splits_channels_across_threads(monkeypatch, kernel_threads, knobs):
    # One image's channels in parts (jobs.split_depthwise), each part by the direct kernel: the same bits.
    knobs(split_depthwise_macs=1)
    x = RNG.standard_normal((1, 10, 14, 14)).astype(np.float32)
    w = _constant(RNG.standard_normal((10, 1, 3, 3)).astype(np.float32))
    b = _constant(RNG.standard_normal(10).astype(np.float32))
    attrs = {"pads": [1, 1, 1, 1], "strides": [2, 2]}
    split = _run(x, w, b, attrs)
    knobs(split_depthwise_macs=1 << 40)
    np.testing.assert_array_equal(split, _run(x, w, b, attrs))
    np.testing.assert_allclose(split, _reference(x, w, b, attrs), rtol=1e-5, atol=1e-5)
