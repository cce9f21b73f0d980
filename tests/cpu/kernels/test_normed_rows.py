"""A normalization in front of a few-row product as one compiled call (PackedProduct.bound with ``norm``,
compiled/normed_rows.py): LayerNormalization (with and without a shift) or RMS normalization of the rows, then the
product with its bias and Gelu epilogue. Its results are the two kernels' (the normalization loop, then the bound
product) bit for bit, and within float32's bound of a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.algorithms import products
from onnx_runtime_ep_cpu.algorithms.activations import gelu_series
from onnx_runtime_ep_cpu.algorithms.products import PackedProduct
from onnx_runtime_ep_cpu.compiled import decoder, gemm, transformer

pytestmark = pytest.mark.skipif(not gemm.AVAILABLE, reason="the few-row tiles run on AVX-512 hosts only")

EPSILON = 1e-5


def _constant(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False  # an initializer: the same read-only array on every run
    return array


def _normalized64(x: np.ndarray, scale: np.ndarray, shift: np.ndarray | None, rms: bool) -> np.ndarray:
    x = x.astype(np.float64)
    if rms:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + EPSILON) * scale
    centred = x - x.mean(axis=-1, keepdims=True)
    y = centred / np.sqrt(np.mean(centred * centred, axis=-1, keepdims=True) + EPSILON) * scale
    return y if shift is None else y + shift


def _gelu64(u: np.ndarray) -> np.ndarray:
    from math import erf

    return u * 0.5 * (1.0 + np.vectorize(erf)(u / np.sqrt(2.0)))


def _normalized32(x: np.ndarray, scale: np.ndarray, shift: np.ndarray | None, rms: bool) -> np.ndarray:
    """The normalization kernels' loops (what the LayerNormalization / RMSNormalization nodes run)."""
    out = np.empty_like(x)
    if rms:
        decoder.rms_norm(x, scale, EPSILON, out)
    else:
        stats = np.empty(x.shape[0], np.float32)
        transformer.layer_norm_rows(x, scale, np.empty(0, np.float32) if shift is None else shift, EPSILON, out,
                                    stats, stats)
    return out


@pytest.mark.parametrize("rows", [1, 3, 8, 16])
@pytest.mark.parametrize("norm", ["layer", "layer_no_shift", "rms"])
@pytest.mark.parametrize("epilogue", ["none", "bias", "gelu"])
@pytest.mark.parametrize("depth,columns", [(64, 192), (48, 37)])
def test_a_normalization_and_its_product_in_one_call(knobs, rows, norm, epilogue, depth, columns):
    knobs(threads=1, few_rows_packed_macs=1, packed_macs=1)
    rng = np.random.default_rng(rows * 1000 + depth + len(norm) + len(epilogue))
    x = (rng.standard_normal((rows, depth)) * 3 + 0.5).astype(np.float32)
    scale = _constant(rng.standard_normal(depth).astype(np.float32))
    shift = _constant(rng.standard_normal(depth).astype(np.float32)) if norm == "layer" else None
    rms = norm == "rms"
    w = _constant(rng.standard_normal((depth, columns)).astype(np.float32) / np.float32(np.sqrt(depth)))
    bias = _constant(rng.standard_normal(columns).astype(np.float32)) if epilogue != "none" else None
    coefficients = gelu_series("none", np.float32) if epilogue == "gelu" else None
    packed = PackedProduct()
    a = _normalized32(x, scale, shift, rms)
    for _ in range(2):  # (the first call may be the deferred trial)
        apart = packed(a, w, bias, None, coefficients)
    run = packed.bound(a, w, bias, coefficients, norm=(scale, shift, EPSILON, rms))
    assert run is not None
    for factor in (1.0, -0.25):  # new values of the same shape: the bound call normalizes them
        source = x * np.float32(factor)
        y = run(source)
        expected_apart = packed(_normalized32(source, scale, shift, rms), w, bias, None, coefficients)
        assert y.shape == (rows, columns) and y.dtype == np.float32
        assert np.array_equal(y, expected_apart)
        reference = _normalized64(source, scale, shift, rms) @ w.astype(np.float64)
        if bias is not None:
            reference += bias
        if coefficients is not None:
            reference = _gelu64(reference)
        bound = 1e-5 * np.sqrt(depth) * float(np.abs(_normalized64(source, scale, shift, rms)).max()) \
            * float(np.abs(w).max()) + 1e-5
        assert np.abs(y - reference).max() <= bound
    assert np.array_equal(run(x), apart)


def test_a_normalization_is_not_bound_with_a_residual_or_a_mismatched_scale(knobs):
    knobs(threads=1, few_rows_packed_macs=1, packed_macs=1)
    rng = np.random.default_rng(7)
    depth, columns = 32, 64
    a = rng.standard_normal((2, depth)).astype(np.float32)
    w = _constant(rng.standard_normal((depth, columns)).astype(np.float32))
    skip = rng.standard_normal((2, columns)).astype(np.float32)
    scale = _constant(np.ones(depth, np.float32))
    packed = PackedProduct()
    for _ in range(2):
        packed(a, w, None, skip)
    assert packed.bound(a, w, residual=True, norm=(scale, None, EPSILON, True)) is None
    for _ in range(2):
        packed(a, w)
    assert packed.bound(a, w, norm=(scale[:-1], None, EPSILON, True)) is None  # K - 1 scales for K columns
    assert packed.bound(a, w, norm=(scale.astype(np.float64), None, EPSILON, True)) is None
    assert packed.bound(a, w, norm=(scale, None, EPSILON, True)) is not None


def test_a_normalized_product_takes_the_tiles_below_the_size_rule_only_while_small(knobs):
    knobs(threads=1, few_rows_packed_macs=1 << 40, one_row_tile_weights=1 << 40, gemv_split_weights=1 << 40)
    small, wide = 64 * 256, 64 * 1000  # a decoder's feed-forward product; a head (BLAS's is faster there)
    assert small <= products.NORMED_TILE_WEIGHTS < wide
    assert PackedProduct.few_sized(1, small, False, 1, 64, normalized=True)
    assert not PackedProduct.few_sized(1, small, False, 1, 64)
    assert not PackedProduct.few_sized(1, wide, False, 1, 64, normalized=True)
