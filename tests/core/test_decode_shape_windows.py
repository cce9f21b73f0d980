"""A shape program's windows (a first generation instantiates them at every step) give what the general
materialization gives: the sliced axes, broadcast axes of base length 1, fresh writable arrays."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime.session.shape_program import Program, _materialize
from onnx_runtime.session.shape_symbols import Window


def _form(constant: int, per_symbol: int = 0) -> np.ndarray:
    return np.array([constant, per_symbol], np.int64)


CASES = [
    # base, lows, extents (affine in one symbol s: constant + per_symbol * s)
    (np.arange(530).reshape(1, 1, 1, 530) % 3 == 0, [_form(0)] * 3 + [_form(256, -1)],
     [_form(1)] * 3 + [_form(1, 1)]),
    (np.arange(1060, dtype=np.int64).reshape(1, 1, 1, 530, 2), [_form(0)] * 3 + [_form(200, -1), _form(0)],
     [_form(1)] * 3 + [_form(3, 1), _form(2)]),
    (np.arange(40, dtype=np.float32).reshape(1, 40), [_form(0), _form(5)], [_form(4), _form(0, 1)]),  # broadcast
    (np.arange(120, dtype=np.int32).reshape(3, 40), [_form(1), _form(0, 1)], [_form(2), _form(2)]),
]


@pytest.mark.parametrize(("base", "lows", "extents"), CASES)
@pytest.mark.parametrize("symbol", [0, 1, 7, 30])
def test_window_matches_the_general_materialization(base, lows, extents, symbol):
    window = Window(base, tuple(lows), tuple(extents))
    program = Program({3: window}, (3,), [], 1)
    point = np.array([1, symbol], np.int64)
    env: list = [None] * 4
    assert program.instantiate(env, point)
    numbers = (program.forms @ point).tolist()
    expected = _materialize(window, numbers, program.recipes[0][2])
    assert env[3].shape == expected.shape == tuple(numbers[base.ndim:2 * base.ndim])
    assert env[3].dtype == base.dtype
    np.testing.assert_array_equal(env[3], expected)
    assert env[3].flags.writeable and env[3].flags.c_contiguous and not np.shares_memory(env[3], base)
