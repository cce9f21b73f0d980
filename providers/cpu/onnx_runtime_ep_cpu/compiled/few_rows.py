"""Few-row float32 products against constant weights (a decode step's projections, a small batch through a
classifier): every row of ``x`` against each weight as it streams past, from matmul.py's packed panels.

Such a product reads each weight once and multiplies it by only a few values, so it runs at the speed the
weights stream from the caches or memory. OpenBLAS's sgemm packs the whole weight matrix on every call
(twice the traffic, and for Gemm's transB a strided copy), and gemv.py's loops stream the weights once per
row. Here a tile holds ``mr`` rows (all the product's, up to eight) by one to four panels of NR columns in
registers over the whole reduction: per k, each row's value is broadcast once and multiplied into every
column vector of the panels' row k, each panel a contiguous stream. Rows past eight take further tiles over
the same panels while those are in the L1/L2 cache, so the weights come from memory once per call.

Each output sums k = 0 .. K-1 with one fused multiply-add per k, then adds the bias and the residual, as
gemm.py's tiles do: the same bits as matmul.matmul_panels, so results do not depend on the row count's
route or on how the panels are split across threads.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import jit, llvm
from .gemm import BIAS, NR, RESIDUAL
from .transformer import gelu_float32_

ROWS = 8  # rows per tile, at most: 16 accumulators at one panel, 19 registers with the loads and a broadcast
# Products of up to this many rows take these tiles rather than matmul.py's (PackedProduct, jobs.MATMUL): a 9-16 row
# product of 1-16 MB of weights streamed them 1.3-2.1x slower there (its 12-row tiles each pass over every panel),
# and no shape from 64x64 to 1024x4096 was faster there (measured in the commit that set it).
PANEL_ROWS = 16
HALVES = NR // llvm.LANES  # vectors per panel row


def width(mr: int) -> int:
    """Panels per tile for ``mr`` rows: up to sixteen accumulators, so four panels' streams for one or two
    rows (a single row's two chains per panel would wait on the multiply-add's latency)."""
    return max(1, min(4, 16 // (HALVES * mr)))


def _tile_kernel(mr: int, panels: int):
    """c[i*ldc + j] = sum_k x[xo + i*lda + k] * w[wo + (j // NR)*stride + k*NR + j % NR] for the ``mr`` x
    ``panels`` * NR tile (float32, flat arrays and offsets)."""

    @intrinsic
    def tile(typingctx, x, xo, lda, w, wo, stride, c, co, ldc, depth):
        signature = types.void(x, xo, lda, w, wo, stride, c, co, ldc, depth)

        def codegen(context, builder, sig, args):
            x_ptr, w_ptr, c_ptr = (context.make_array(sig.args[i])(context, builder, args[i]).data for i in (0, 3, 6))
            xo, lda, wo, stride, co, ldc, depth = args[1], args[2], args[4], args[5], args[7], args[8], args[9]
            fma = llvm.fma(builder.module)
            vec_ptr = llvm.VEC.as_pointer()

            def const(value):
                return ir.Constant(llvm.I64, value)

            rows = [builder.gep(x_ptr, [builder.add(xo, builder.mul(lda, const(i)))]) for i in range(mr)]
            streams = [builder.gep(w_ptr, [builder.add(wo, builder.mul(stride, const(p)))]) for p in range(panels)]

            def step(k, acc):
                at = builder.mul(k, const(NR))
                weights = [builder.load(builder.bitcast(builder.gep(stream, [builder.add(at, const(h * llvm.LANES))]),
                                                        vec_ptr), align=4)
                           for stream in streams for h in range(HALVES)]
                summed = []
                for i in range(mr):
                    value = llvm.splat(builder, builder.load(builder.gep(rows[i], [k])))
                    summed += [builder.call(fma, [value, v, acc[i * len(weights) + j]]) for j, v in enumerate(weights)]
                return summed

            vectors = panels * HALVES
            totals = llvm.counted_loop(builder, depth, [llvm.ZEROS] * (mr * vectors), step, "few")
            for i in range(mr):
                row = builder.add(co, builder.mul(ldc, const(i)))
                for j in range(vectors):
                    target = builder.gep(c_ptr, [builder.add(row, const(j * llvm.LANES))])
                    builder.store(totals[i * vectors + j], builder.bitcast(target, vec_ptr), align=4)
            return context.get_dummy_value()

        return signature, codegen

    return tile


# Each row count's wide tile (width(mr) panels) and, where that is wider than one, its one-panel tile.
_wide = {mr: _tile_kernel(mr, width(mr)) for mr in range(1, ROWS + 1)}
_one = {mr: _tile_kernel(mr, 1) for mr in range(1, 5)}
_w1, _w2, _w3, _w4, _w5, _w6, _w7, _w8 = (_wide[mr] for mr in range(1, ROWS + 1))
_n1, _n2, _n3, _n4 = (_one[mr] for mr in range(1, 5))
_WIDTHS = np.array([0] + [width(mr) for mr in range(1, ROWS + 1)], dtype=np.int64)  # (a constant in the loops)


@jit
def _tile(mr, wide, x, xo, lda, w, wo, stride, c, co, ldc, depth):
    """The tile of ``mr`` rows, width(mr) panels (``wide``) or one."""
    if wide or mr > 4:
        _wide_tile(mr, x, xo, lda, w, wo, stride, c, co, ldc, depth)
    elif mr == 1:
        _n1(x, xo, lda, w, wo, stride, c, co, ldc, depth)
    elif mr == 2:
        _n2(x, xo, lda, w, wo, stride, c, co, ldc, depth)
    elif mr == 3:
        _n3(x, xo, lda, w, wo, stride, c, co, ldc, depth)
    else:
        _n4(x, xo, lda, w, wo, stride, c, co, ldc, depth)


@jit
def _wide_tile(mr, x, xo, lda, w, wo, stride, c, co, ldc, depth):
    if mr == 1:
        _w1(x, xo, lda, w, wo, stride, c, co, ldc, depth)
    elif mr == 2:
        _w2(x, xo, lda, w, wo, stride, c, co, ldc, depth)
    elif mr == 3:
        _w3(x, xo, lda, w, wo, stride, c, co, ldc, depth)
    elif mr == 4:
        _w4(x, xo, lda, w, wo, stride, c, co, ldc, depth)
    elif mr == 5:
        _w5(x, xo, lda, w, wo, stride, c, co, ldc, depth)
    elif mr == 6:
        _w6(x, xo, lda, w, wo, stride, c, co, ldc, depth)
    elif mr == 7:
        _w7(x, xo, lda, w, wo, stride, c, co, ldc, depth)
    else:
        _w8(x, xo, lda, w, wo, stride, c, co, ldc, depth)


@jit
def few_row_panels(x, lda, m, depth, packed, offsets, bias, y, n, residual, flags, coefficients, first, end,
                   scratch):
    """matmul.matmul_panels's result (same arguments, ``scratch`` of matmul.scratch_size, of which one tile's
    output is used: the last panel's, past y's columns; ``offsets`` unused: panel rows are k * NR apart) for
    panels first .. end, computed panel group by panel group with every row's tiles over each group."""
    flat = packed.reshape(-1)
    stride = depth * NR
    full = min(end, n // NR)  # panels wholly inside y
    p = first
    while p < end:
        if p < full:
            # A group of whole panels: each row tile takes its widest tiles over it, then one-panel tiles.
            group = min(4, full - p)
            t0 = 0
            while t0 < m:
                mr = min(ROWS, m - t0)
                span = _WIDTHS[mr]
                q = p
                while q < p + group:
                    wide = q + span <= p + group
                    _tile(mr, wide, x, t0 * lda, lda, flat, q * stride, stride, y, t0 * n + q * NR, n, depth)
                    q += span if wide else 1
                t0 += mr
            _epilogue(y, bias, residual, flags, coefficients, m, n, p * NR, (p + group) * NR)
            p += group
        else:  # the last panel, past y's columns: into scratch, then its columns
            width_left = n - p * NR
            t0 = 0
            while t0 < m:
                mr = min(ROWS, m - t0)
                _tile(mr, False, x, t0 * lda, lda, flat, p * stride, stride, scratch, 0, NR, depth)
                for i in range(mr):
                    for j in range(width_left):
                        y[(t0 + i) * n + p * NR + j] = scratch[i * NR + j]
                t0 += mr
            _epilogue(y, bias, residual, flags, coefficients, m, n, p * NR, n)
            p += 1


@jit
def _epilogue(y, bias, residual, flags, coefficients, m, n, low, high):
    """Columns low .. high of y's m rows (flat, n wide): + bias, + residual, in that order, or with a Gelu
    series in ``coefficients`` Gelu(y + bias) + residual (transformer.gelu_float32_'s)."""
    if coefficients.shape[0] > 0:
        no_bias = bias[:0]
        no_residual = np.empty((0, 0), dtype=np.float32)
        for i in range(m):
            line = y[i * n + low: i * n + high].reshape(1, high - low)
            skip = residual[i * n + low: i * n + high].reshape(1, high - low) if flags & RESIDUAL else no_residual
            gelu_float32_(line, bias[low:high] if flags & BIAS else no_bias, line, skip, coefficients)
        return
    if flags & BIAS:
        for i in range(m):
            for j in range(low, high):
                y[i * n + j] += bias[j]
    if flags & RESIDUAL:
        for i in range(m):
            for j in range(low, high):
                y[i * n + j] += residual[i * n + j]
