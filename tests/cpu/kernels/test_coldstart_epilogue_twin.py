"""The convolution epilogue's numpy twins (compiled/generic.py bias_residual_activation, generic_conv.py
crop_bias_residual_activation), which a fresh process's first runs call for every fused convolution while numba
loads, against the compiled loops, bit for bit: the twins write in place and skip the activation steps that are
the identity, which must change no value, signed zero, infinity or NaN included.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.compiled import epilogue, generic, generic_conv
from onnx_runtime_ep_cpu.compiled.epilogue import CLIP, LEAKY_RELU, NONE, RELU, activation_bounds

RNG = np.random.default_rng(24)
ACTIVATIONS = ((NONE, None), (RELU, None), (CLIP, (-0.5, 0.7)), (CLIP, (0.7, -0.5)), (LEAKY_RELU, (0.1, 0)),
               (LEAKY_RELU, (1.0, 0)), (CLIP, (-np.inf, 6.0)))
SPECIAL = (np.nan, np.inf, -np.inf, -0.0, 0.0, 1e30, -1e30)


def _values(shape, dtype):
    values = RNG.standard_normal(shape).astype(dtype)
    flat = values.reshape(-1)
    count = min(len(SPECIAL), flat.size)
    flat[:count] = SPECIAL[:count]
    return values


def _operands(with_bias, with_residual, images, channels, size, dtype):
    bias = _values(channels, dtype) if with_bias else epilogue.absent(dtype, 1)
    if with_bias:
        bias[0] = -0.0
    residual = _values((images, channels, size), dtype) if with_residual else epilogue.absent(dtype, 3)
    return bias, residual


def _same(have, want):
    assert have.dtype == want.dtype and have.shape == want.shape
    np.testing.assert_array_equal(have.view(f"u{have.itemsize}"), want.view(f"u{want.itemsize}"))


@pytest.mark.parametrize("dtype", (np.float32, np.float64))
@pytest.mark.parametrize("kind,params", ACTIVATIONS)
@pytest.mark.parametrize("with_bias,with_residual", ((True, True), (True, False), (False, True), (False, False)))
@pytest.mark.parametrize("first,end", ((0, 23), (5, 17)))
def test_bias_residual_activation_twin_is_the_loop(dtype, kind, params, with_bias, with_residual, first, end):
    bounds = activation_bounds(kind, params, dtype)
    bias, residual = _operands(with_bias, with_residual, 2, 3, 23, dtype)
    y = _values((2, 3, 23), dtype)
    y[1, 2, 6] = -np.inf  # times a LeakyRelu slope below zero: -inf; a ReLU's 0 bound: 0
    want, have = y.copy(), y.copy()
    epilogue.bias_residual_activation.dispatcher()(want, bias, residual, bounds, first, end)
    with np.errstate(all="ignore"):
        generic.bias_residual_activation(have, bias, residual, bounds, first, end)
    _same(have, want)


@pytest.mark.parametrize("dtype", (np.float32, np.float64))
@pytest.mark.parametrize("kind,params", ACTIVATIONS)
@pytest.mark.parametrize("with_bias,with_residual", ((True, True), (True, False), (False, True), (False, False)))
def test_crop_twin_is_the_loop_and_leaves_its_source(dtype, kind, params, with_bias, with_residual):
    bounds = activation_bounds(kind, params, dtype)
    width, padded, lines = 5, 7, 4
    bias, residual = _operands(with_bias, with_residual, 2, 3, lines * width + 2, dtype)
    rows = _values((2, 3, lines * padded), dtype)
    source = rows.copy()
    want = np.full((2, 3, lines * width + 2), 9.0, dtype)  # the two entries past the lines stay as they were
    have = want.copy()
    epilogue.crop_bias_residual_activation.dispatcher()(rows, want, width, bias, residual, bounds)
    with np.errstate(all="ignore"):
        generic_conv.crop_bias_residual_activation(rows, have, width, bias, residual, bounds)
    _same(have, want)
    _same(rows, source)


def test_activate_in_place_steps_only_what_the_bounds_ask():
    values = np.array([-2.0, -0.0, 0.0, 0.5, 3.0, np.nan, -np.inf, np.inf], np.float32)
    relu = values.copy()
    generic_conv.activate_in_place(relu, activation_bounds(RELU, None, np.float32))
    _same(relu, np.array([0.0, -0.0, 0.0, 0.5, 3.0, np.nan, 0.0, np.inf], np.float32))
    leaky = values.copy()
    generic_conv.activate_in_place(leaky, activation_bounds(LEAKY_RELU, (0.5, 0), np.float32))
    _same(leaky, np.array([-1.0, -0.0, 0.0, 0.5, 3.0, np.nan, -np.inf, np.inf], np.float32))
    clip = values.copy()
    generic_conv.activate_in_place(clip, activation_bounds(CLIP, (1.0, -1.0), np.float32))  # high wins
    _same(clip, np.full(8, -1.0, np.float32) + np.where(np.isnan(values), np.nan, 0).astype(np.float32))
