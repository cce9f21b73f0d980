"""The RMS normalization of a QDQ decoder (LLaMA-style, both torch exporters) with its activations rounded to their
quantization grids between the operators (qdq_norms.fuse_rounded_rms_norm): Pow(x, 2) -> ReduceMean(last axis) ->
round1 -> GridTable (Add eps, Sqrt, Reciprocal or Div, with their roundings, as a table per code) -> Mul(x) ->
round2 [-> Mul(weight)], in one pass per row.

Each step is the float32 operation its node performs: the square x * x (the Pow kernel's for an exponent of 2), the
mean by pooling.plane_means (the ReduceMean kernel's loop, so the same summation order and division), each rounding
QuantizeLinear -> DequantizeLinear's (quantize.on_grid), the table entry picked by the code QuantizeLinear gives
(quantize.grid_lookup's), then x times it, rounded, times the weight: bit for bit the unfused nodes' values.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .pooling import PLANE_SUM_LIMIT, plane_means
from .quantize import on_grid

# The layout of ``params`` (float32): per grid (the mean's rounding, the table's lookup, the product's rounding)
# its scale, zero point and code range.
MEAN, TABLE, PRODUCT = 0, 4, 8
PARAMS = 12
LIMIT = PLANE_SUM_LIMIT  # the longest rows rounded_rms_norm takes (the ReduceMean kernel's loop's)


@jit
def rounded_rms_norm(x, weight, params, table, out):
    """out[r] = round2(x[r] * table[code(round1(mean(x[r] * x[r])))]) (* weight when it has a value per column) for
    (rows, D) float32 ``x`` and ``out``; ``params`` and ``table`` (the GridTable's entries from the lowest code up)
    as laid out above. The mean is pooling.plane_means', which the ReduceMean kernel takes for rows of up to
    PLANE_SUM_LIMIT values (beyond it, the caller sums as numpy does and calls rounded_rms_rows)."""
    rows, depth = x.shape
    squares = np.empty((rows, depth), np.float32)
    for r in range(rows):
        for i in range(depth):
            squares[r, i] = x[r, i] * x[r, i]
    means = np.empty(rows, np.float32)
    plane_means(squares, means, depth)
    rounded_rms_rows(x, means, weight, params, table, out)


@jit
def rounded_rms_rows(x, means, weight, params, table, out):
    """rounded_rms_norm's steps after the mean, for each row's float32 mean of squares ``means[r]``."""
    depth = x.shape[1]
    s1, z1, lo1, hi1 = params[MEAN], params[MEAN + 1], params[MEAN + 2], params[MEAN + 3]
    st, zt, lot, hit = params[TABLE], params[TABLE + 1], params[TABLE + 2], params[TABLE + 3]
    s2, z2, lo2, hi2 = params[PRODUCT], params[PRODUCT + 1], params[PRODUCT + 2], params[PRODUCT + 3]
    scaled = weight.shape[0] == depth
    for r in range(x.shape[0]):
        m = on_grid(means[r], s1, z1, lo1, hi1)
        v = np.rint(m / st) + zt
        v = lot if v < lot else v
        v = hit if v > hit else v
        factor = table[np.int64(v - lot)] if v == v else table[np.int64(zt - lot)]
        row, line = x[r], out[r]
        if scaled:
            for i in range(depth):
                line[i] = on_grid(row[i] * factor, s2, z2, lo2, hi2) * weight[i]
        else:
            for i in range(depth):
                line[i] = on_grid(row[i] * factor, s2, z2, lo2, hi2)
