"""Where QLinearAdd's and QLinearMul's compiled loop (compiled/quantize.requantize_binary) reads its operands: an
output shape viewed as (R, C) rows, and each operand as the whole tensor, a repeated trailing row, one value per
row or a scalar.
"""

from __future__ import annotations

import math

import numpy as np


def _steps(x: np.ndarray, shape: tuple[int, ...], cols: int) -> tuple[int, int] | None:
    """How compiled/quantize.requantize_binary walks operand ``x`` of an output ``shape`` viewed as (R, cols):
    the whole tensor, a repeated trailing row of ``cols``, one value per row (a per-channel operand such as
    (1, C, 1, 1) against (1, C, H, W)), or a scalar; None for other broadcasts."""
    if x.size == 1:
        return 0, 0
    if x.shape == shape:
        return cols, 1
    padded = (1,) * (len(shape) - x.ndim) + x.shape
    trailing = x.shape[next((i for i, d in enumerate(x.shape) if d != 1), x.ndim):]  # leading 1s dropped
    if x.size == cols and shape[len(shape) - len(trailing):] == trailing:
        return 0, 1
    split = max(i + 1 for i, d in enumerate(padded) if d != 1)
    if padded[:split] == shape[:split] and math.prod(shape[split:]) == cols:
        return 1, 0
    return None


def _columns(x: np.ndarray, shape: tuple[int, ...]) -> int | None:
    """The row length a broadcast operand implies: its size for a trailing row, the elements each of its values
    covers for a per-row one."""
    if x.size == 1 or x.shape == shape:
        return None
    padded = (1,) * (len(shape) - x.ndim) + x.shape
    split = max(i + 1 for i, d in enumerate(padded) if d != 1)
    if padded[:split] == shape[:split]:
        return math.prod(shape[split:])
    return x.size


def binary_layout(a_shape, b_shape, shape) -> tuple | None:
    """(cols, A's steps, B's steps) for compiled/quantize.requantize_binary over ``shape`` viewed as (R, cols),
    when each operand is whole, a trailing row, one value per row or a scalar; None otherwise."""
    if not math.prod(shape):
        return None
    a, b = np.broadcast_to(np.uint8(0), a_shape), np.broadcast_to(np.uint8(0), b_shape)  # shapes only, no memory
    implied = [c for c in (_columns(a, shape), _columns(b, shape)) if c is not None]
    cols = implied[0] if implied else math.prod(shape)
    steps = [_steps(x, shape, cols) for x in (a, b)]
    if None in steps:
        return None
    return cols, np.array(steps[0], np.int64), np.array(steps[1], np.int64)
