"""The numpy equivalents of compiled loops (compiled/generic.py) against the loops themselves.

A session's first calls may run the numpy equivalent while numba loads (compiled/deferred.py), so each must
have the loop's effects: the same arrays written (within float32 rounding: the loops sum in another order
and some compute exp by their own polynomial), the same return value. Each case runs both on copies of the
same random arguments, covering the loop's optional operands (empty bias or residual) and its refusals.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.algorithms.activations import gelu_series
from onnx_runtime_ep_cpu.compiled import deferred, generic
from onnx_runtime_ep_cpu.compiled.epilogue import CLIP, LEAKY_RELU, NONE, RELU, activation_bounds
from onnx_runtime_ep_cpu.compiled.generic_int8 import GENERIC_INT8
from onnx_runtime_ep_cpu.compiled.smallconv import gather_table

RNG = np.random.default_rng(7)
F32 = np.float32


def _r(*shape, scale=1.0, dtype=F32):
    return (RNG.standard_normal(shape) * scale).astype(dtype)


def _e(ndim, dtype=F32):
    return np.empty((0,) * ndim, dtype)


def _transformer_cases():
    t = "transformer."
    cases = []
    for bias, residual in ((_r(48), _r(5, 48)), (_e(1), _r(5, 48)), (_r(48), _e(2)), (_e(1), _e(2))):
        cases.append((t + "add_bias_residual_", (_r(5, 48), bias, residual)))
    erf_series = np.array([0.56418958, -0.18806319, 0.03761264, -0.00537323, 0.00059702, -5.4e-05, 4.1e-06], F32)
    tanh_series = np.array([0.7978846, 0.0356774], F32)
    for coefficients in (erf_series, tanh_series):
        for bias, residual in ((_r(96), _r(3, 96)), (_e(1), _e(2))):
            cases.append((t + "gelu_float32_", (_r(3, 96, scale=2.5), bias, np.empty((3, 96), F32), residual,
                                                coefficients)))
    for dtype in (F32, np.float64):
        for bias in (_r(80, dtype=dtype), _e(1, dtype)):
            cases.append((t + "layer_norm_rows", (_r(6, 80, scale=3, dtype=dtype) + 1, _r(80, dtype=dtype), bias,
                                                  1e-5, np.empty((6, 80), dtype), np.empty(6, dtype),
                                                  np.empty(6, dtype))))
    mask = _r(9, 12)
    hidden = mask.copy()
    hidden[4] = -np.inf  # a fully masked row: both refuse (False)
    for scores_mask, first in ((mask, 2), (_e(2), 0), (hidden, 3)):
        cases.append((t + "mask_and_shift_", (_r(2, 4, 10), F32(0.125), scores_mask, first)))
    odd = _r(4, 30, scale=20)
    odd[1, 3], odd[2] = np.nan, -np.inf  # NaN through the sum; a row without a finite maximum
    for x in (_r(3, 1000, scale=5), odd):
        cases.append((t + "softmax_rows_float32_", (x, np.empty(x.shape, F32))))
        cases.append(("log_softmax.log_softmax_rows_float32_", (x, np.empty(x.shape, F32))))
    cases.append((t + "divide_by_row_sums_", (np.abs(_r(4, 30)) + 0.1, _r(4, 16))))
    return cases


def _decoder_cases():
    d = "decoder."
    cases = []
    for dtype in (F32, np.float64):
        cases.append((d + "rms_norm", (_r(3, 64, dtype=dtype), _r(64, dtype=dtype), 1e-6, np.empty((3, 64), dtype))))
        cases.append((d + "skip_rms_norm", (_r(3, 64, dtype=dtype), _r(3, 64, dtype=dtype), _r(64, dtype=dtype), 1e-6,
                                            np.empty((3, 64), dtype), np.empty((3, 64), dtype))))
    hiding = np.where(RNG.random((1, 1, 3, 7)) < 0.3, -np.inf, 0).astype(F32)
    for bias in (_e(4), _r(1, 1, 1, 7), _r(2, 4, 3, 7), hiding):
        cases.append((d + "few_query_attention_float32", (_r(2, 4, 3, 16), _r(2, 2, 7, 16), _r(2, 2, 7, 16),
                                                          F32(0.25), bias, np.empty((2, 4, 3, 16), F32))))
    masked = np.zeros((1, 1, 3, 7), F32)
    masked[0, 0, 1] = -np.inf
    cases.append((d + "few_query_attention_float32", (_r(1, 2, 3, 8), _r(1, 2, 7, 8), _r(1, 2, 7, 8), F32(0.3),
                                                      masked, np.empty((1, 2, 3, 8), F32))))
    for bias in (_e(4), _r(1, 1, 1, 7)):  # a cache at capacity 12 with 7 valid rows: the rest (NaN) never read
        k, v = _r(2, 2, 12, 16), _r(2, 2, 12, 16)
        k[:, :, 7:], v[:, :, 7:] = np.nan, np.nan
        cases.append((d + "few_query_attention_prefix_float32", (_r(2, 4, 1, 16), k, v, 7, F32(0.25), bias,
                                                                 np.empty((2, 4, 1, 16), F32))))
        k, v = _r(2, 2, 12, 16), _r(2, 2, 12, 16)
        k[:, :, 8:], v[:, :, 8:] = np.nan, np.nan  # (row 7 is written by the call, the rows after it never read)
        cases.append((d + "append_attention_float32", (_r(2, 4, 1, 16), _r(2, 2, 1, 16), _r(2, 2, 1, 16), k, v, 7,
                                                       F32(0.25), bias if not bias.size else _r(1, 1, 1, 8),
                                                       np.empty((2, 4, 1, 16), F32))))
    for half in (8, 5):
        cases.append((d + "rotate_half", (_r(6, 16), _r(10, 16), _r(10, 16), RNG.integers(0, 10, 6), half,
                                          np.empty((6, 16), F32))))
    cases.append((d + "swish_mul_float32", (_r(200, scale=4), _r(200), 1.0, np.empty(200, F32))))
    for approximate in ("none", "tanh"):
        cases.append((d + "gelu_mul_float32", (_r(200, scale=4), _r(200), gelu_series(approximate, F32),
                                               np.empty(200, F32))))
    return cases


def _conv_cases():
    c = ""
    cases = []
    for images, groups, biased in ((1, 1, True), (2, 2, False)):
        size, channels = 12, 3
        table = gather_table((size,), (3,), (1,), (1,), (1,), (size,), channels)
        x = _r(images, groups, channels * size)
        b = _r(groups, 4) if biased else _e(2)
        cases.append((c + "smallconv.conv_gathered", (x, _r(groups, 4, channels * 3), b, table,
                                                       np.empty((images, groups, 4, size), F32))))
    # fill_columns: 3x3, stride 2 with padding, and a dilated window over a block of output rows
    for kh, kw, sh, sw, dh, dw, top, left, h, w in ((3, 3, 2, 2, 1, 1, 1, 1, 9, 11), (2, 3, 1, 1, 2, 2, 0, 2, 8, 7)):
        oh, ow = (h + 2 * top - ((kh - 1) * dh + 1)) // sh + 1, (w + 2 * left - ((kw - 1) * dw + 1)) // sw + 1
        cols = np.full((3 * kh * kw, oh * ow + 5), 7.0, F32)  # columns past the block stay as they were
        cases.append((c + "im2col.fill_columns", (_r(3, h, w), cols, kh, kw, sh, sw, dh, dw, top, left, 1, oh - 1, ow)))
    for kw, left in ((3, 1), (5, 2)):
        cols = np.full((2 * 3 * kw, 4 * 9 + 3), 7.0, F32)
        cases.append((c + "im2col.fill_tight_columns", (_r(2, 6, 9), cols, 3, kw, 1, 1, 1, left, 1, 4)))
    # fill_patches: windows that tile the input (2x2 onto 4x4; 3x2 onto 2x3 of 7x7, its last row and column unread)
    for kh, kw, h, w in ((2, 2, 8, 8), (3, 2, 7, 7)):
        cols = np.full((3 * kh * kw + 1, (h // kh) * (w // kw)), 7.0, F32)  # the bias row past the patches stays
        cases.append((c + "im2col.fill_patches", (_r(3, h, w), cols, kh, kw)))
    for kind, params in ((NONE, None), (RELU, None), (CLIP, (-0.5, 0.7)), (LEAKY_RELU, (0.1, 0))):
        bounds = activation_bounds(kind, params, F32)
        y = _r(2, 3, 20)
        y[0, 0, 3] = np.nan
        cases.append((c + "epilogue.bias_residual_activation", (y, _r(3), _r(2, 3, 20), bounds, 4, 17)))
    relu = activation_bounds(RELU, None, F32)
    cases.append((c + "epilogue.bias_residual_activation", (_r(2, 3, 20), _e(1), _e(3), relu, 0, 20)))
    for kind, params in ((NONE, (0, 0)), (RELU, (0, 0)), (CLIP, (-0.5, 0.7)), (LEAKY_RELU, (0.1, 0))):
        x = _r(2, 3, 20)
        x[1, 2, 5] = np.nan
        cases.append((c + "epilogue.channel_affine", (x, _r(3), _r(3), np.empty((2, 3, 20), F32), kind,
                                                      np.array(params, F32))))
    for size, before in ((5, 2), (4, 1)):
        cases.append((c + "lrn.lrn_base", (_r(2, 7, 10), np.empty((2, 7, 10), F32), size, before, F32(2e-5),
                                           F32(1.0))))
    cases.append((c + "pooling.plane_means", (_r(6, 49), np.empty(6, F32), F32(49))))
    for is_max in (True, False):
        # 3x3 stride 2 pad 1 (counted: the input alone); 2x2 stride 2; a global window
        for kh, sh, ph, h in ((3, 2, 1, 9), (2, 2, 0, 8), (7, 1, 0, 7)):
            oh = (h + 2 * ph - kh) // sh + 1
            cases.append((c + "pooling.pool_2d", (_r(4, h, h), np.empty((4, oh, oh), F32), kh, kh, sh, sh, 1, 1, ph, ph,
                                                  is_max, ph, ph + h, ph, ph + h)))
    return cases


def _crop_cases():
    cases = []
    for kind, params in ((NONE, None), (CLIP, (-0.5, 0.7))):  # padded rows (2, 3, 4 lines of 7) cropped to 5
        rows = _r(2, 3, 28)
        rows[1, 1, 8] = np.nan
        bounds = activation_bounds(kind, params, F32)
        for bias, residual in ((_r(3), _r(2, 3, 20)), (_e(1), _e(3))):
            cases.append(("epilogue.crop_bias_residual_activation",
                          (rows, np.empty((2, 3, 20), F32), 5, bias, residual, bounds)))
    for dtype in (F32, np.float64):
        x = _r(300, scale=30, dtype=dtype)
        x[:3] = [np.nan, np.inf, -np.inf]
        cases.append(("sigmoid.sigmoid_into", (x, np.empty(300, dtype))))
    for alpha in (1.0, 1.702):
        x = _r(301, scale=30)
        x[:3] = [np.nan, np.inf, -200.0]
        cases.append(("silu.silu_float32", (x, np.empty(301, F32), alpha)))
    return cases


def _cases():
    """(loop key, argument tuple) pairs; arrays are copied per side."""
    cases = _transformer_cases() + _decoder_cases() + _conv_cases() + _crop_cases()
    return [(f"onnx_runtime_ep_cpu.compiled.{key}", args) for key, args in cases]


def _loop(key: str):
    import importlib

    module, name = key.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def _copies(args):
    return tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)


CASES = _cases()


@pytest.mark.parametrize("key,args", CASES, ids=[f"{k.rsplit('.', 1)[1]}-{i}" for i, (k, _) in enumerate(CASES)])
def test_generic_matches_the_compiled_loop(key, args):
    loop = _loop(key)
    assert isinstance(loop, deferred.Loop)
    compiled_args, generic_args = _copies(args), _copies(args)
    expected = loop.dispatcher()(*compiled_args)
    with np.errstate(all="ignore"):  # as deferred.Loop calls them: the loops give inf/NaN without a warning
        got = generic.GENERIC[key](*generic_args)
    assert bool(got) == bool(expected) if expected is not None else got is None
    if expected is False:
        return  # the callers take their general path; the loop leaves its outputs partly written
    for want, have in zip(compiled_args, generic_args):
        if isinstance(want, np.ndarray) and want.size:
            tol = 4e-6 if want.dtype == F32 else 1e-12
            finite = np.abs(want[np.isfinite(want)])
            scale = max(1.0, float(finite.max())) if finite.size else 1.0
            np.testing.assert_allclose(have, want, rtol=tol * 4, atol=tol * scale, equal_nan=True)


def test_every_generic_names_a_compiled_loop():
    for key in generic.GENERIC:
        assert isinstance(_loop(key), deferred.Loop), key
    covered = {key for key, _ in CASES} | set(GENERIC_INT8)  # test_int8_generic.py holds those exactly
    assert covered == set(generic.GENERIC), set(generic.GENERIC) - covered


def test_gelu_refuses_other_series_as_the_loop_does():
    loop = _loop("onnx_runtime_ep_cpu.compiled.transformer.gelu_float32_")
    args = (_r(2, 8), _e(1), np.empty((2, 8), F32), _e(2), np.ones(3, F32))
    with pytest.raises(ValueError, match="degree 6"):
        loop.dispatcher()(*_copies(args))
    with pytest.raises(ValueError, match="degree 6"):
        generic.GENERIC[loop.key](*_copies(args))
