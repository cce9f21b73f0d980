"""compiled/quantize.requantize_binary (QLinearAdd, QLinearMul) on every broadcast layout it walks (whole
tensor, a repeated trailing row, one value per row, a scalar), code for code against the documented float64
arithmetic written in numpy."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.compiled import quantize as compiled

RNG = np.random.default_rng(20)
SCALES = np.array([0.05, 0.031, 0.11])


def _reference(a, b, zeros, multiply, dtype):
    info = np.iinfo(dtype)
    x, y = a.astype(np.int64) - zeros[0], b.astype(np.int64) - zeros[1]
    sa, sb, sc = SCALES
    v = (x * y).astype(np.float64) * (sa * sb / sc) if multiply else (sa * x + sb * y) / sc
    return np.clip(np.rint(v) + zeros[2], info.min, info.max).astype(dtype)


# (A's shape, B's shape, output viewed as (rows, cols), A's steps, B's steps)
LAYOUTS = [
    ((4, 37), (4, 37), (1, 148), (148, 1), (148, 1)),  # whole tensors
    ((4, 37), (37,), (4, 37), (37, 1), (0, 1)),  # a repeated trailing row
    ((2, 3, 5), (2, 3, 1), (6, 5), (5, 1), (1, 0)),  # one value per row (per channel)
    ((1,), (3, 7), (1, 21), (0, 0), (21, 1)),  # a scalar
    ((8, 5), (8, 1), (8, 5), (5, 1), (1, 0)),  # short rows, one value per row: element by element
    ((40, 1), (40, 1), (40, 1), (1, 1), (1, 0)),  # rows of one
]


@pytest.mark.parametrize("multiply", [False, True])
@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_requantize_binary_matches_the_float64_formula(layout, dtype, multiply):
    a_shape, b_shape, view, a_step, b_step = layout
    info = np.iinfo(dtype)
    a = RNG.integers(info.min, info.max + 1, a_shape).astype(dtype)
    b = RNG.integers(info.min, info.max + 1, b_shape).astype(dtype)
    zeros = np.array([3, -2 if dtype == np.int8 else 120, 7], np.int64)
    shape = np.broadcast_shapes(a_shape, b_shape)
    out = np.empty(shape, dtype)
    compiled.requantize_binary(a.reshape(-1), np.array(a_step, np.int64), b.reshape(-1), np.array(b_step, np.int64),
                               zeros, SCALES, int(info.min), int(info.max), multiply, out.reshape(view))
    expected = _reference(np.broadcast_to(a, shape), np.broadcast_to(b, shape), zeros, multiply, dtype)
    np.testing.assert_array_equal(out, expected)
