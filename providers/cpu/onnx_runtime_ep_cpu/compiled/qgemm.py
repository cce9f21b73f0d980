"""Integer matrix products of 8-bit operands with 32-bit accumulation: MatMulInteger, QLinearMatMul, QGemm,
MatMulIntegerToFloat and DynamicQuantizeMatMul, (A - a_zero) @ (B - b_zero) exactly, wrapping as an int32
accumulator does.

B (the weight, usually constant) is packed once per set of constant inputs as int16 (N, K): each column
with its zero point already subtracted (-255 .. 255 fits). Each row of A is centred into an int16 row
buffer, and every output is a dot product of two contiguous int16 rows summed in int32: the pattern LLVM
turns into vpmaddwd on AVX2 (16 products, pairwise added into 8 int32 lanes per instruction; numba
compiles for the host CPU, so wider or VNNI instructions are LLVM's choice where present), the same
integers either way. Integer addition is
associative modulo 2**32, so the result equals the exact int64 sum wrapped to int32 whatever the order.
"""

from __future__ import annotations

import numpy as np

from . import jit

_BLOCK = 32  # columns of packed B per pass over A: 32 rows of K int16 stay in the L1/L2 cache


@jit
def pack_columns(b, zero, out):
    """out[n, k] = b[k, n] - zero[n] (or zero[0] for a single zero point) as int16; b is (K, N)."""
    depth, columns = b.shape
    single = zero.shape[0] == 1
    for n in range(columns):
        z = np.int16(zero[0] if single else zero[n])
        for k in range(depth):
            out[n, k] = np.int16(b[k, n]) - z


@jit
def product(a, zero, packed, out):
    """out[m, n] = sum_k (a[m, k] - zero[m or 0]) * packed[n, k] in int32; a is (M, K) 8-bit, packed (N, K)
    int16, out (M, N) int32. Blocks of columns of B take turns, each against every row of A."""
    rows, depth = a.shape
    columns = packed.shape[0]
    single = zero.shape[0] == 1
    centred = np.empty((rows, depth), np.int16)
    for m in range(rows):
        z = np.int16(zero[0] if single else zero[m])
        for k in range(depth):
            centred[m, k] = np.int16(a[m, k]) - z
    for first in range(0, columns, _BLOCK):
        end = min(first + _BLOCK, columns)
        for m in range(rows):
            row = centred[m]
            for n in range(first, end):
                column = packed[n]
                acc = np.int32(0)
                for k in range(depth):
                    acc += np.int32(row[k]) * np.int32(column[k])
                out[m, n] = acc


@jit
def batched_product(a, a_zero, b, b_zero, out):
    """out[i] = (a[i] - a_zero) @ (b[i] - b_zero) in int32 for (L, M, K) ``a`` and (L, K, N) ``b`` (both
    operands varying: attention's products), each b[i] packed on the fly like a weight."""
    count, rows, depth = a.shape
    columns = b.shape[2]
    packed = np.empty((columns, depth), np.int16)
    zero = np.full(1, a_zero, np.int32)
    b_zeros = np.full(1, b_zero, np.int32)
    for i in range(count):
        pack_columns(b[i], b_zeros, packed)
        product(a[i], zero, packed, out[i])
