"""The compiled one-pass epilogues (bias + residual + activation after a convolution, affine +
activation for batch normalization) against the same math written with numpy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import nn

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
    return nn.fused_conv(node, None, 1), nn.conv(plain, None, 13)


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
    (y,) = nn.fused_batch_normalization(node, None, 1)(x, scale, bias, mean, var)
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
    (y,) = nn.batch_normalization_14(node, None, 15)(x, *params)[:1]
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
