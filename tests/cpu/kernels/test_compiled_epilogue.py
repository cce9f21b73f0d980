"""The compiled one-pass epilogues (bias + residual + activation after a convolution, affine +
activation for batch normalization) against the same math written with numpy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms import conv_path
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import conv as conv_ops
from onnx_runtime_ep_cpu.ops import normalization

ACTIVATIONS = [
    (None, []),
    ("Relu", []),
    ("LeakyRelu", [0.1]),
    ("Clip", [-0.5, 0.75]),
    ("Clip", [0.5, -0.5]),  # low > high: max-then-min, so every value becomes `high`
    ("Clip", [-np.inf, 0.25]),
]


def _activate(y: np.ndarray, kind, params) -> np.ndarray:
    if kind == "Relu":
        return np.maximum(y, y.dtype.type(0))
    if kind == "LeakyRelu":
        return np.where(y < 0, y * y.dtype.type(params[0]), y)
    if kind == "Clip":
        return np.minimum(np.maximum(y, y.dtype.type(params[0])), y.dtype.type(params[1]))
    return y


def _fused_conv(kind, params, **attrs):
    node_attrs = dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], **attrs)
    if kind is not None:
        node_attrs.update(activation=kind, activation_params=params)
    node = Node("FusedConv", ["x", "w", "b", "z"], ["y"], domain=FUSED_DOMAIN, attrs=node_attrs, opset=1)
    plain = Node("Conv", ["x", "w", "b"], ["y"], attrs=dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], **attrs), opset=13)
    return conv_ops.fused_conv(node, None, 1), conv_ops.conv(plain, None, 13)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind,params", ACTIVATIONS)
@pytest.mark.parametrize("with_bias,with_residual", [(True, True), (True, False), (False, True), (False, False)])
def test_fused_conv_epilogue_matches_numpy(dtype, kind, params, with_bias, with_residual):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 9, 7)).astype(dtype)
    w = rng.standard_normal((6, 5, 3, 3)).astype(dtype)
    b = rng.standard_normal(6).astype(dtype) if with_bias else None
    z = rng.standard_normal((2, 6, 9, 7)).astype(dtype) if with_residual else None
    fused, conv = _fused_conv(kind, params)
    (expected,) = conv(x, w, b)
    if z is not None:
        expected = expected + z
    expected = _activate(expected, kind, params)
    (got,) = fused(x, w, b, z)
    assert got.dtype == dtype and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5 if dtype == np.float32 else 1e-12, atol=1e-5)


def test_fused_conv_epilogue_keeps_nan_and_handles_broadcast_residual():
    x = np.ones((1, 2, 4, 4), np.float32)
    x[0, 0, 1, 1] = np.nan
    w = np.ones((3, 2, 3, 3), np.float32)
    b = np.array([1, 2, 3], np.float32)
    for kind, params in ACTIVATIONS[1:]:
        fused, _ = _fused_conv(kind, params)
        (y,) = fused(x, w, b, None)
        assert np.isnan(y[0, :, 1, 1]).all(), kind  # NaN goes through every activation, as with np.maximum
    # A residual that broadcasts over the output takes the numpy passes, bias included.
    fused, conv = _fused_conv("Relu", [])
    x = np.random.default_rng(1).standard_normal((1, 2, 4, 4)).astype(np.float32)
    z = np.full((1, 3, 1, 1), -2.0, np.float32)
    (y,) = fused(x, w, b, z)
    np.testing.assert_allclose(y, np.maximum(conv(x, w, b)[0] + z, 0), rtol=1e-6)


def test_fused_conv_float16_takes_numpy_path():
    fused, conv = _fused_conv("Clip", [-1.0, 1.0])
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((1, 2, 5, 5)).astype(np.float16), rng.standard_normal((2, 2, 3, 3)).astype(np.float16)
    b, z = np.ones(2, np.float16), rng.standard_normal((1, 2, 5, 5)).astype(np.float16)
    (y,) = fused(x, w, b, z)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y, np.clip(conv(x, w, b)[0] + z, -1, 1), rtol=1e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("kind,params", ACTIVATIONS)
def test_fused_batch_normalization_matches_numpy(dtype, kind, params):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 4, 3, 5)).astype(dtype)
    scale, bias, mean = (rng.standard_normal(4).astype(dtype) for _ in range(3))
    var = rng.random(4).astype(dtype) + dtype(0.5)
    attrs = {"epsilon": 1e-3}
    if kind is not None:
        attrs.update(activation=kind, activation_params=params)
    node = Node("FusedBatchNormalization", ["x", "s", "b", "m", "v"], ["y"], domain=FUSED_DOMAIN, attrs=attrs, opset=1)
    (y,) = normalization.fused_batch_normalization(node, None, 1)(x, scale, bias, mean, var)
    wide = [p.astype(np.float64).reshape(1, 4, 1, 1) for p in (scale, bias, mean, var)]
    expected = (x.astype(np.float64) - wide[2]) / np.sqrt(wide[3] + 1e-3) * wide[0] + wide[1]
    expected = _activate(expected, kind, params)
    assert y.dtype == dtype
    tolerance = 1e-2 if dtype == np.float16 else 1e-5
    np.testing.assert_allclose(y.astype(np.float64), expected, rtol=tolerance, atol=tolerance)


def test_batch_normalization_compiled_on_non_contiguous_input():
    node = Node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], attrs={}, opset=15)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 6, 8)).astype(np.float32)[:, :, ::2, 1:]  # strided view
    params = [np.ones(3, np.float32), np.zeros(3, np.float32), np.full(3, 0.5, np.float32), np.full(3, 4.0, np.float32)]
    (y,) = normalization.batch_normalization_14(node, None, 15)(x, *params)[:1]
    np.testing.assert_allclose(y, (x - 0.5) / np.sqrt(4.0 + 1e-5), rtol=1e-5, atol=1e-6)


def test_fused_conv_empty_batch():
    fused, _ = _fused_conv("Relu", [])
    x, w = np.zeros((0, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32)
    (y,) = fused(x, w, np.ones(3, np.float32), np.zeros((0, 3, 5, 5), np.float32))
    assert y.shape == (0, 3, 5, 5) and y.dtype == np.float32


def test_loops_compile_without_a_writable_cache(monkeypatch):
    # numba refuses cache=True where no directory can hold the compiled code; loops then compile
    # per process instead of failing.
    import numba
    from onnx_runtime_ep_cpu.compiled import compiler

    real_njit = numba.njit

    def njit(*args, **options):
        if options.get("cache"):
            raise RuntimeError("cannot cache function 'double': no locator available for file")
        return real_njit(*args, **options)

    monkeypatch.setattr(numba, "njit", njit)

    @compiler()
    def double(x):
        return x * 2

    assert double(np.float32(1.5)) == 3.0


# Shapes (x, w) and Conv attributes that send a FusedConv down each path; the im2col, tight-row and
# taps paths finish each block of rows as they write it (small column budgets force several blocks),
# the others finish the whole output after the convolution.
PATHS = {
    "tight rows": ("conv_tight_rows", (2, 5, 9, 7), (6, 5, 3, 3), dict(pads=[1, 1, 1, 1])),
    "tight rows, dilated": ("conv_tight_rows", (1, 3, 8, 9), (4, 3, 3, 3), dict(pads=[2, 2, 2, 2], dilations=[2, 2])),
    "im2col": ("conv_im2col", (2, 4, 9, 8), (5, 4, 3, 3), dict(pads=[1, 0, 2, 1], strides=[2, 2])),
    "im2col, groups": ("conv_im2col", (2, 4, 9, 8), (6, 2, 3, 3), dict(pads=[1, 1, 1, 1], strides=[2, 1], group=2)),
    "taps": ("conv_by_taps", (2, 16, 6, 7), (3, 16, 3, 3), dict(pads=[1, 1, 1, 1])),
    "taps, cropped": ("conv_by_taps", (1, 12, 6, 5), (2, 12, 3, 2), dict(pads=[0, 2, 1, 0])),
    "pointwise": ("conv_pointwise", (2, 6, 4, 5), (7, 6, 1, 1), {}),
    "winograd": ("conv_winograd", (1, 192, 6, 12), (192, 192, 3, 3), dict(pads=[1, 1, 1, 1])),
    "depthwise": (None, (2, 4, 6, 6), (4, 1, 3, 3), dict(pads=[1, 1, 1, 1], group=4)),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind,params", ACTIVATIONS)
@pytest.mark.parametrize("with_bias,with_residual", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_fused_conv_finishes_every_path_as_conv_then_epilogue(monkeypatch, path, dtype, kind, params, with_bias,
                                                              with_residual, knobs):
    knobs(im2col_block_bytes=256)
    monkeypatch.setattr(conv_path, "use_winograd", lambda geo, group, c, m: c >= 192)
    # The BLAS paths, which float64 takes, and float32 where the packed convolution does not run
    # (hosts without AVX-512); test_packed_conv.py covers that one, test_direct_conv.py AVX2's tiles.
    monkeypatch.setattr(conv_path, "packed_conv_applies", lambda geo, group, x: False)
    monkeypatch.setattr(conv_path, "direct_tiles_apply", lambda geo, group, x, w: False)
    function, x_shape, w_shape, attrs = PATHS[path]
    taken = []
    if function is not None:
        real = getattr(conv_path, function)
        monkeypatch.setattr(conv_path, function, lambda *args: taken.append(function) or real(*args))
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal(x_shape).astype(dtype), rng.standard_normal(w_shape).astype(dtype)
    w.flags.writeable = False  # an initializer, as Winograd's weight transform wants
    b = rng.standard_normal(w_shape[0]).astype(dtype) if with_bias else None
    attrs = dict(kernel_shape=list(w_shape[2:]), **attrs)
    conv = conv_ops.conv(Node("Conv", ["x", "w"], ["y"], attrs=attrs, opset=13), None, 13)
    (expected,) = conv(x, w)  # without its bias: the fused node adds it in the epilogue, in the same order
    z = rng.standard_normal(expected.shape).astype(dtype) if with_residual else None
    # The depthwise loop starts its sums from the bias and applies the activation as it stores; with a
    # residual, the bias is added after the sums, as for the other paths.
    bias_first = path == "depthwise" and z is None
    got, expected = fused_and_unfused(x, w, b, z, attrs, kind, params, expected, bias_first)
    assert got.dtype == dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
    assert function is None or set(taken) == {function}  # the path the shapes are meant to take


def fused_and_unfused(x, w, b, z, attrs, kind, params, conv_out, bias_first=False):
    """(FusedConv's output for these inputs, what the unfused nodes give: ``conv_out`` (the Conv
    without its bias) plus the bias, plus the residual, then the activation, in that order; without a
    residual or an activation, or with ``bias_first``, the Conv itself, bias included, then the rest)."""
    expected = conv_out
    if (bias_first or (kind is None and z is None)) and b is not None:
        (expected,) = conv_ops.conv(Node("Conv", ["x", "w", "b"], ["y"], attrs=attrs, opset=13), None, 13)(x, w, b)
    elif b is not None:
        expected = expected + b.reshape(-1, 1, 1)
    if z is not None:
        expected = expected + z
    expected = _activate(expected, kind, params)
    if kind is not None:
        attrs = dict(attrs, activation=kind, activation_params=params)
    node = Node("FusedConv", ["x", "w", "b", "z"], ["y"], domain=FUSED_DOMAIN, attrs=attrs, opset=1)
    (got,) = conv_ops.fused_conv(node, None, 1)(x, w, b, z)
    return got, expected


def test_crop_epilogue_loop_against_numpy():
    from onnx_runtime_ep_cpu.compiled import epilogue

    rng = np.random.default_rng(6)
    rows = rng.standard_normal((2, 3, 4 * 7)).astype(np.float32)  # 4 padded rows of 7, 5 of them kept
    bias, residual = rng.standard_normal(3).astype(np.float32), rng.standard_normal((2, 3, 20)).astype(np.float32)
    cropped = rows.reshape(2, 3, 4, 7)[..., :5].reshape(2, 3, 20)
    y = np.empty((2, 3, 20), np.float32)
    leaky = epilogue.activation_bounds(epilogue.LEAKY_RELU, [0.25, 0], np.float32)
    epilogue.crop_bias_residual_activation(rows, y, 5, bias, residual, leaky)
    expected = cropped + bias.reshape(3, 1) + residual
    np.testing.assert_array_equal(y, np.where(expected < 0, expected * np.float32(0.25), expected))
    none = epilogue.absent(np.float32, 1)
    identity = epilogue.activation_bounds(epilogue.NONE, [], np.float32)
    epilogue.crop_bias_residual_activation(rows, y, 5, none, epilogue.absent(np.float32, 3), identity)
    np.testing.assert_array_equal(y, cropped)


def test_row_range_epilogue_leaves_other_pixels():
    from onnx_runtime_ep_cpu.compiled import epilogue

    y = -np.ones((2, 3, 10), np.float64)
    relu = epilogue.activation_bounds(epilogue.RELU, [], y.dtype)
    epilogue.bias_residual_activation(y, epilogue.absent(y.dtype, 1), epilogue.absent(y.dtype, 3), relu, 4, 7)
    assert (y[..., 4:7] == 0).all() and (y[..., :4] == -1).all() and (y[..., 7:] == -1).all()
    # Without a bias nothing is added: -0.0 stays -0.0 (adding a zero bias would make it +0.0).
    y = np.full((1, 1, 3), -0.0)
    identity = epilogue.activation_bounds(epilogue.NONE, [], y.dtype)
    epilogue.bias_residual_activation(y, epilogue.absent(y.dtype, 1), epilogue.absent(y.dtype, 3), identity, 0, 3)
    assert np.signbit(y).all()
