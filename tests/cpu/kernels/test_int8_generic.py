"""compiled/generic_int8.py: each numpy equivalent gives exactly what its compiled int8 loop gives (the same
codes, the same int32 sums, the same float32 bits), NaN, saturation and ties included, so a quantized model's
first runs served by numpy agree with every later run."""

from __future__ import annotations

import importlib

import numpy as np
import pytest
from onnx_runtime_ep_cpu.compiled import code_lookup, deferred
from onnx_runtime_ep_cpu.compiled.generic_int8 import GENERIC_INT8

RNG = np.random.default_rng(5)
F32 = np.float32


def _data(*shape):
    x = (RNG.standard_normal(shape) * 3).astype(F32)
    flat = x.reshape(-1)
    flat[:4] = [np.nan, 0.5 * 0.05, 1e9, -1e9][:flat.size]  # NaN, a tie at the scale below, saturation both ways
    return x


def _packed(n, k):
    return RNG.integers(-255, 256, (n, k)).astype(np.int16)


def _cases():
    scale1, zero1 = np.array([0.05], F32), np.array([3], np.int32)
    scales, zeros = np.array([0.05, 0.2, 1e-3], F32), np.array([0, 128, 255], np.int32)
    u8 = RNG.integers(0, 256, (2, 3, 5)).astype(np.uint8)
    a = RNG.integers(0, 256, (6, 33)).astype(np.uint8)
    b = RNG.integers(0, 256, (33, 20)).astype(np.uint8)
    b_scales, bias = RNG.uniform(1e-3, 1e-2, 20), RNG.standard_normal(20).astype(F32)
    no_pairs = np.zeros((0, 0, 2), np.int16)
    return [
        ("quantize.quantize", (_data(2, 3, 5), scales, zeros, 0, 255, np.empty((2, 3, 5), np.uint8))),
        ("quantize.quantize", (_data(1, 1, 40), scale1, np.array([-3], np.int32), -128, 127,
                               np.empty((1, 1, 40), np.int8))),
        ("quantize.dequantize", (u8, scales, zeros, np.empty((2, 3, 5), F32))),
        ("quantize.fake_quantize", (_data(2, 3, 5), scales, zeros, 0, 255, np.empty((2, 3, 5), F32))),
        ("quantize.grid_lookup", (_data(40).reshape(-1), 0.05, 3, 0, 255, RNG.standard_normal(256).astype(F32),
                                  np.empty(40, F32))),
        ("quantize.grid_lookup", (_data(40).reshape(-1), 0.05, -3, -128, 127, RNG.standard_normal(256).astype(F32),
                                  np.empty(40, F32))),
        ("quantize.channel_grid_lookup", (_data(2, 3, 13), 0.05, 3, 0, 255, RNG.standard_normal((3, 256)).astype(F32),
                                          np.empty((2, 3, 13), F32))),
        ("quantize.channel_grid_lookup", (_data(1, 4, 9), 0.05, -3, -128, 127,
                                          RNG.standard_normal((4, 256)).astype(F32), np.empty((1, 4, 9), F32))),
        ("quantize.dynamic_quantize", (_data(50), np.empty(50, np.uint8))),
        ("quantize.dynamic_quantize", (np.zeros(7, F32), np.empty(7, np.uint8))),
        ("qgemm.pack_columns", (b, np.arange(20, dtype=np.int32), np.empty((20, 33), np.int16))),
        ("qgemm.pack_columns", (b, zero1, np.empty((20, 33), np.int16))),
        ("qgemm_tiles.pack_pairs", (_packed(20, 33), np.empty((17, 32, 2), np.int16))),
        ("qgemm.product", (a, np.arange(6, dtype=np.int32), _packed(20, 33), no_pairs, np.empty((6, 20), np.int32))),
        ("qgemm.product", (a, zero1, _packed(20, 33), no_pairs, np.empty((6, 20), np.int32))),
        ("qgemm.scaled_product", (a, 7, _packed(20, 33), no_pairs, 0.02, b_scales, bias, np.empty((6, 20), F32))),
        ("qgemm.scaled_product", (a, 7, _packed(20, 33), no_pairs, 0.02, b_scales[:1], bias[:0],
                                  np.empty((6, 20), F32))),
        ("qgemm.dynamic_scaled_product", (_data(6, 33), _packed(20, 33), no_pairs, b_scales, bias,
                                          np.empty((6, 20), F32))),
        ("qgemm.dynamic_scaled_group", (_data(6, 33), _packed(20, 33), no_pairs, b_scales, bias,
                                        np.empty((2, 6, 10), F32))),
        ("qgemm.dynamic_scaled_group", (_data(5, 33), _packed(20, 33), no_pairs, b_scales, bias[:0],
                                        np.empty((4, 5, 5), F32))),
    ] + _requantizing_cases() + _rounded_norm_cases() + _rounded_rotary_cases()


def _rounded_norm_cases():
    # RMS normalizations with their roundings (compiled/rounded_norm.py): a mean's, a table's and a product's grid
    norm = np.array([0.02, 0, 0, 255, 0.004, 0, 0, 255, 0.05, 3, 0, 255], F32)
    signed = np.array([0.02, -128, -128, 127, 0.004, -128, -128, 127, 0.05, -3, -128, 127], F32)
    table, weight = RNG.uniform(0.1, 4, 256).astype(F32), RNG.standard_normal(64).astype(F32)
    means = np.array([0.3, np.nan, 1e9, 0.0], F32)
    return [
        ("rounded_norm.rounded_rms_norm", (_data(5, 64), weight, norm, table, np.empty((5, 64), F32))),
        ("rounded_norm.rounded_rms_norm", (_data(3, 7), weight[:0], signed, table, np.empty((3, 7), F32))),
        ("rounded_norm.rounded_rms_rows", (_data(4, 64), means, weight, signed, table, np.empty((4, 64), F32))),
    ]



def _rounded_rotary_cases():
    # rotate-half rotations with their roundings (compiled/rounded_rotary.py): five grids, the sum's used or not
    grids = np.array([0.023, 130, 0, 255, 0.031, 126, 0, 255, 0.033, 128, 0, 255, 0.021, 125, 0, 255,
                      0.037, 129, 0, 255], F32)
    signed = grids.copy()
    signed[1::4] -= 128
    signed[2::4], signed[3::4] = -128, 127
    tables = RNG.uniform(-1, 1, (2, 2, 16)).astype(F32)
    rows = np.array([0, 1, 0, 1, 0, 1], np.int64)
    return [
        ("rounded_rotary.rounded_rotary", (_data(6, 16), tables[0], tables[1], rows, 8, grids, True,
                                           np.empty((6, 16), F32))),
        ("rounded_rotary.rounded_rotary", (_data(6, 10), tables[0, :, :10], tables[1, :, :10], rows, 4, signed, False,
                                           np.empty((6, 10), F32))),
    ]

def _consts(a_quantize: bool, dequantize: bool, b_quantize: bool = False, out_signed: bool = False) -> np.ndarray:
    consts = np.zeros(15)
    consts[:5] = [F32(0.04), 7, 0, 255, a_quantize]  # A: scale, zero, range, whether float data is quantized
    consts[5:10] = [-3 if out_signed else 120, -128 if out_signed else 0, 127 if out_signed else 255,
                    F32(0.1), dequantize]  # output: zero, range, scale, whether dequantized
    consts[10:15] = [F32(0.03), 128, 0, 255, b_quantize]
    return consts


def u8_flat(n):
    return RNG.integers(0, 256, n).astype(np.uint8)


def _requantizing_cases():
    a8 = RNG.integers(0, 256, (6, 33)).astype(np.uint8)
    af = _data(6, 33)
    packed = _packed(20, 33)
    no_pairs = np.zeros((0, 0, 2), np.int16)
    per_column, per_column_offset = RNG.uniform(1e-4, 1e-3, 20), RNG.uniform(-2, 2, 20)
    one, zero_offset = np.array([4e-4]), np.array([0.5])
    row, after = RNG.standard_normal(20).astype(F32), np.array([F32(0.07), 5, 0, 255], np.float64)
    members = np.array([[0, 12, 120, 0, 255, F32(0.1)], [12, 8, 3, 0, 255, F32(0.07)]])  # first, width, grid
    return [
        ("qgemm.requantized_product", (a8, packed, no_pairs, per_column, per_column_offset, _consts(False, False),
                                       np.empty((6, 20), np.uint8))),
        ("qgemm.requantized_product", (a8, packed, no_pairs, one, zero_offset, _consts(False, False, out_signed=True),
                                       np.empty((6, 20), np.int8))),
        ("qgemm.requantized_product", (af, packed, no_pairs, one, zero_offset, _consts(True, True),
                                       np.empty((6, 20), F32))),
        ("qgemm.requantized_product_rounded", (af, packed, no_pairs, per_column, per_column_offset,
                                               _consts(True, True), row, after, np.empty((6, 20), F32))),
        # products of one A side by side, each member's columns requantized to its own grid into its own block
        ("qgemm.requantized_group", (af, packed, no_pairs, per_column, per_column_offset, _consts(True, True), members,
                                     np.empty(6 * 20, F32))),
        ("qgemm.requantized_group", (a8, packed, no_pairs, per_column, per_column_offset, _consts(False, False),
                                     members, np.empty(6 * 20, np.uint8))),
        # the same with each member's rounded add (an encoder's q/k/v: bias row, second rounding); the second none
        ("qgemm.requantized_group_rounded", (af, packed, no_pairs, per_column, per_column_offset, _consts(True, True),
                                             members, row, np.array([[F32(0.07), 5, 0, 255, 1], [0, 0, 0, 0, 0]]),
                                             np.empty(6 * 20, F32))),
        ("qgemm.requantized_batched_product", (_data(3, 5, 16), _data(3, 16, 7), one, zero_offset,
                                               _consts(True, True, b_quantize=True), np.empty((3, 5, 7), F32))),
        # a QDQ Conv's patch rows: 8-bit codes padded with their zero point, float32 data padded with 0.0
        ("dynamic_conv.quantized_conv", (RNG.integers(0, 256, (2, 3, 4, 9)).astype(np.uint8), np.uint8(7), 2, 3, 1,
                                         2, 1, 1, 1, 0, 1, 1, 4, 5, _packed(5, 18), no_pairs, per_column[:5],
                                         per_column_offset[:5], _consts(False, False), np.empty((2, 5, 20), np.uint8))),
        ("dynamic_conv.quantized_conv", (_data(1, 4, 1, 11), F32(0), 1, 3, 1, 2, 1, 2, 0, 0, 1, 2, 1, 5, packed[:, :12],
                                         no_pairs, one, zero_offset, _consts(True, True), np.empty((1, 20, 5), F32))),
        ("qgemm.qgemm", (a8, 7, packed, no_pairs, RNG.integers(-5000, 5000, 20).astype(np.int32), per_column, 120,
                         0, 255, True, np.empty((6, 20), np.uint8))),
        ("qgemm.qgemm", (a8, 7, packed, no_pairs, np.zeros(0, np.int32), one, 0, 0, 0, False,
                         np.empty((6, 20), F32))),
        ("qgemm.requantized_product_add", (a8, packed, no_pairs, per_column, per_column_offset,
                                           _consts(False, False), RNG.integers(0, 256, 20).astype(np.uint8),
                                           np.array([120, 0.1, 128, 0.02, 100, 0.15, 0, 255], np.float64),
                                           np.empty((6, 20), np.uint8))),
        ("quantize.requantize_binary", (u8_flat(60), np.array([20, 1]), u8_flat(20), np.array([0, 1]),
                                        np.array([128, 100, 90]), np.array([0.02, 0.05, 0.04]), 0, 255, False,
                                        np.empty((3, 20), np.uint8))),
        ("quantize.requantize_binary", (u8_flat(30), np.array([10, 1]), u8_flat(3), np.array([1, 0]),
                                        np.array([128, 100, 90]), np.array([0.02, 0.05, 0.04]), 0, 255, True,
                                        np.empty((3, 10), np.uint8))),
        ("quantize.requantize", (RNG.integers(-40000, 40000, (2, 3, 5)).astype(np.int32), np.array([10.0, -20, 0]),
                                 np.array([1e-3, 2e-3, 5e-4]), 120, 0, 255, np.empty((2, 3, 5), np.uint8))),
        ("quantize.requantize", (RNG.integers(-40000, 40000, (1, 1, 9)).astype(np.int32), np.array([3.0]),
                                 np.array([1e-3]), -5, -128, 127, np.empty((1, 1, 9), np.int8))),
        ("quantize.softmax_codes", (RNG.integers(0, 256, (4, 12)).astype(np.uint8),
                                    np.exp(-np.arange(256) * 0.05), 1 / 256, 0, 0, 255, np.empty((4, 12), np.uint8))),
        # Add/Sub/Mul/Div then a rounding: equal sizes, one value either side, a repeated trailing block
        ("quantize.rounded_binary", (_data(24), _data(24), 0, 0.05, 3, 0, 255, np.empty(24, F32))),
        ("quantize.rounded_binary", (_data(24), _data(1), 1, 0.05, 3, 0, 255, np.empty(24, F32))),
        ("quantize.rounded_binary", (_data(1), _data(24), 1, 0.05, -3, -128, 127, np.empty(24, F32))),
        ("quantize.rounded_binary", (_data(24), _data(6), 2, 0.05, 3, 0, 255, np.empty(24, F32))),
        ("quantize.rounded_binary", (_data(6), _data(24), 3, 0.05, 3, 0, 255, np.empty(24, F32))),
        ("quantize.rounded_concat", (_data(4, 12), _data(4, 3), 0.05, 3, 0, 255, np.empty((4, 15), F32))),
        ("qgemm.requantized_batched_product", (RNG.integers(0, 256, (2, 4, 9)).astype(np.uint8),
                                               RNG.integers(0, 256, (2, 9, 6)).astype(np.uint8), one, zero_offset,
                                               _consts(False, False), np.empty((2, 4, 6), np.uint8))),
        ("code_lookup.code_lookup_rows", (RNG.integers(0, 256, 256).astype(np.uint8),
                                          RNG.integers(0, 256, (2, 70)).astype(np.uint8), np.zeros((2, 90), np.uint8),
                                          13)),
    ] + ([("code_lookup.code_lookup_lanes", (RNG.integers(0, 256, 256).astype(np.uint8),
                                              RNG.integers(0, 256, (2, 130)).astype(np.uint8),
                                              np.zeros((2, 150), np.uint8), 7))] if code_lookup.VBMI else [])


CASES = _cases()


def _loop(name: str):
    module, attribute = f"onnx_runtime_ep_cpu.compiled.{name}".rsplit(".", 1)
    return getattr(importlib.import_module(module), attribute)


def _copies(args):
    return tuple(a.copy() if isinstance(a, np.ndarray) else a for a in args)


@pytest.mark.parametrize("name,args", CASES, ids=[f"{name}-{i}" for i, (name, _) in enumerate(CASES)])
def test_generic_is_the_loop_exactly(name, args):
    loop = _loop(name)
    assert isinstance(loop, deferred.Loop)
    compiled_args, generic_args = _copies(args), _copies(args)
    expected = loop.dispatcher()(*compiled_args)
    with np.errstate(all="ignore"):
        got = GENERIC_INT8[f"onnx_runtime_ep_cpu.compiled.{name}"](*generic_args)
    if expected is not None:
        assert [F32(v) for v in got] == [F32(v) for v in expected]
    for want, have in zip(compiled_args, generic_args):
        if isinstance(want, np.ndarray):
            assert have.dtype == want.dtype
            np.testing.assert_array_equal(have.view(np.uint8), want.view(np.uint8))  # bit for bit


def _rounded_gelu_params(signed: bool) -> np.ndarray:
    from onnx_runtime_ep_cpu.algorithms.erf import scaled_coefficients
    from onnx_runtime_ep_cpu.compiled import rounded_gelu as loop

    params = np.zeros(loop.PARAMS, F32)
    params[loop.DIVISOR], params[loop.ONE], params[loop.HALF] = np.sqrt(2), 1, 0.5
    params[loop.SERIES:loop.SERIES + 7] = scaled_coefficients(1.0)
    low, high = (-128, 127) if signed else (0, 255)
    for i, (scale, zero) in enumerate([(0.0079, 0), (0.0083, -128 if signed else 0), (0.031, 5 if signed else 133)]):
        params[loop.ROUNDINGS + 4 * i: loop.ROUNDINGS + 4 * i + 4] = scale, zero, low, high
    return params


@pytest.mark.parametrize("signed", [False, True])
def test_rounded_gelu_generic_within_one_code_of_the_loop(signed):
    # The loop's tanh is its own vectorizable one, the twin's numpy's (the Erf kernel's): a few ulp apart, so a
    # rounded code may differ by one where a value lies that close to a half-integer of its grid.
    from onnx_runtime_ep_cpu.compiled import rounded_gelu as loop

    params = _rounded_gelu_params(signed)
    x = np.concatenate([RNG.standard_normal(4000).astype(F32) * 3, np.array([0, -0.0, 40, -40, np.nan], F32)])
    want, got = np.empty_like(x), np.empty_like(x)
    loop.rounded_gelu.dispatcher()(x, params, want)
    GENERIC_INT8["onnx_runtime_ep_cpu.compiled.rounded_gelu.rounded_gelu"](x, params, got)
    step = params[loop.ROUNDINGS + 8] * params[loop.HALF]  # one code of the last rounding, times the half
    assert np.isnan(got[-1]) == np.isnan(want[-1])
    assert np.abs(got[:-1] - want[:-1]).max() <= step * 1.001
    assert np.mean(got[:-1] == want[:-1]) > 0.99
    assert len(np.unique(got)) > 50  # the grids leave the chain many distinct results


def test_every_int8_loop_is_covered():
    covered = {f"onnx_runtime_ep_cpu.compiled.{name}" for name, _ in CASES}
    covered.add("onnx_runtime_ep_cpu.compiled.rounded_gelu.rounded_gelu")  # within one code (the test above)
    # within a code or two (numpy's exp in the Softmax): tests/cpu/test_qdq_rounded_attention.py
    covered.add("onnx_runtime_ep_cpu.compiled.rounded_attention.rounded_attention")
    # compiled only where VBMI is (elsewhere vpermi2b does not exist): tests/cpu/test_qdq_concat_requantized.py
    covered.add("onnx_runtime_ep_cpu.compiled.code_lookup.code_lookup_lanes")
    assert covered == set(GENERIC_INT8)
