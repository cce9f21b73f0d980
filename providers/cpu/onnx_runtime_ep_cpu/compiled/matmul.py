"""Float32 MatMul against constant weights through gemm.py's microkernel, with its epilogue fused.

A transformer's linear layers are (tokens x K) @ (K x N) products with constant weights. Through
numpy they are OpenBLAS calls, which pack both operands on every call and keep their own thread pool
spinning after each (one that fights the helper threads of workers.py for the cores, see threads.py).
Here the weights are packed once per constant array into column panels (N / NR, K * NR), and the
activations are read in place: a tile is 12 (or 8) rows of ``x`` x NR columns, its accumulators in
registers over the whole reduction, the bias and residual added as it is stored. A Gelu (FusedMatMul's
activation) runs over each row's columns as soon as a row tile's panels are done, while they are in
cache. Work splits by column panels, so each thread reads only its share of the weights; every
output's reduction runs k = 0 .. K-1 whichever thread computes it, so results do not depend on the
partition.
"""

from __future__ import annotations

import numpy as np

from . import gemm, jit
from .gemm import BIAS, IDENTITY, NR, RESIDUAL
from .transformer import gelu_float32_

_kernel_12, _kernel_8 = gemm.matmul_kernel(12), gemm.matmul_kernel(8)


def pack_columns(w: np.ndarray) -> np.ndarray:
    """(K, N) weights as (ceil(N / NR), K * NR) float32 panels: panel p holds columns p*NR .. p*NR + NR - 1
    row by row (zero columns past N), the rows the microkernel reads one k at a time."""
    return gemm.pack_weights(w.T, NR)  # the columns of w are the rows of w.T, NR to a panel


def pad_bias(bias, n: int) -> np.ndarray:
    """The bias (N,) padded with zeros to whole panels (the microkernel reads NR lanes of it)."""
    padded = np.zeros(-(-n // NR) * NR, dtype=np.float32)
    if bias is not None:
        padded[:n] = bias
    return padded


def scratch_size(depth: int) -> int:
    """Floats of scratch matmul_panels needs for a reduction of ``depth``: the last rows of x padded to
    a tile, and one tile of output."""
    return 12 * depth + 12 * NR


@jit
def tile(mr, a, lda, b, rows, c, depth, ldc, bias, residual, ldr, flags, bounds):
    """gemm.matmul_kernel's tile, ``mr`` (12 or 8) rows high."""
    if mr == 8:
        _kernel_8(a, lda, b, rows, c, depth, ldc, bias, residual, ldr, flags, bounds)
    else:
        _kernel_12(a, lda, b, rows, c, depth, ldc, bias, residual, ldr, flags, bounds)


@jit
def matmul_panels(x, lda, m, depth, packed, offsets, bias, y, n, residual, flags, coefficients, first, end, scratch):
    """Columns of panels first .. end of y (m x n, flat, row-major) = x @ W, x's m rows of ``depth`` at
    stride ``lda`` (flat), W packed by pack_columns (``offsets`` = gemm.packed_offsets(depth)).
    ``flags``: BIAS adds bias[j] (padded by pad_bias), RESIDUAL residual[i*n + j] (flat, as y). With a
    Gelu series in ``coefficients`` (transformer.gelu_float32_'s), y = Gelu(x @ W + bias) (+ residual)
    instead: the tiles store the bare product and each row's columns are finished by
    gelu_float32_ once its tile is done. ``scratch``: scratch_size(depth) floats."""
    gelu = coefficients.shape[0] > 0
    tile_flags = 0 if gelu else flags
    padded_rows = scratch[: 12 * depth]
    own = scratch[12 * depth: 12 * depth + 12 * NR]
    low, high = first * NR, min(n, end * NR)
    no_bias = bias[:0]
    no_residual = np.empty((0, 0), dtype=np.float32)
    t0 = 0
    while t0 < m:
        left = m - t0
        # 12-row tiles, but 13 to 16 rows left as 8 + the rest: 16 rows (a short sequence's) are two whole
        # 8-row tiles rather than 12 and 4 padded to 8.
        mr = 12 if left >= 12 and not 12 < left <= 16 else 8
        rows = min(mr, left)
        if left >= mr:
            a, ld = x[t0 * lda:], lda
        else:  # the last rows, padded with zero rows to a whole tile
            a, ld = padded_rows, depth
            padded_rows[: mr * depth] = 0
            for i in range(rows):
                padded_rows[i * depth: (i + 1) * depth] = x[(t0 + i) * lda: (t0 + i) * lda + depth]
        for p in range(first, end):
            column = p * NR
            at = t0 * n + column
            if left >= mr and column + NR <= n:
                tile(mr, a, ld, packed[p], offsets, y[at:], depth, n, bias[column:], residual[at:], n, tile_flags,
                      IDENTITY)
            else:  # a tile past y's last rows or columns: into ``own``, then its part in y
                tile(mr, a, ld, packed[p], offsets, own, depth, NR, bias[column:], own, NR, tile_flags & BIAS,
                      IDENTITY)
                width = min(NR, n - column)
                for i in range(rows):
                    if tile_flags & RESIDUAL:
                        for j in range(width):
                            y[at + i * n + j] = own[i * NR + j] + residual[at + i * n + j]
                    else:
                        for j in range(width):
                            y[at + i * n + j] = own[i * NR + j]
        if gelu:
            for i in range(rows):
                start = (t0 + i) * n
                line = y[start + low: start + high].reshape(1, high - low)
                skip = residual[start + low: start + high].reshape(1, high - low) if flags & RESIDUAL else no_residual
                gelu_float32_(line, bias[low:high] if flags & BIAS else no_bias, line, skip, coefficients)
        t0 += rows

