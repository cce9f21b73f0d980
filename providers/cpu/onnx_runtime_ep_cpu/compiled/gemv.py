"""Few-row products (a few rows of ``a`` times a weight matrix, float32): a decode step's MatMuls and a
CNN's classifier, split across the packed convolution's helper threads (workers.py).

Such a product reads every weight once, so it runs at the speed weights stream from memory or the L3
cache; two cores stream nearly twice as fast as one (measured in baa9e65), which numpy's BLAS does not
get at these sizes. ``a @ w`` (w K x N, MatMul's layout) runs in blocks of k,
each block one contiguous stretch of w, with the blocks' sums added in block order; ``a @ w.T`` (Gemm's
transB) in spans of w's rows, each a dot product. Either way an output's sum has the same order on
any number of threads. (Sums may round differently from BLAS's, as BLAS's own blockings do.)

A CNN's classifier also stays off numpy's multi-threaded BLAS for another reason: its worker thread
keeps spinning ~0.1 s after each call, on a CPU the convolution helpers need, so the next
inference's convolutions would run at a fraction of their speed.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import compiler, jit, llvm

_vectorized = compiler(fastmath={"reassoc", "contract"})
_axpy = compiler(fastmath={"contract"})  # sums stay in k order

_CHAINS, _ROWS = 2, 4
_BLOCK = llvm.LANES * _CHAINS  # elements of k per loop step


@intrinsic
def _dot_rows(typingctx, x, w, stride, blocks, out):
    """out[j] = sum of x[i] * w[j * stride + i] for i < blocks * _BLOCK and the _ROWS rows j (float32):
    the rows share each load of x, and each row sums in _CHAINS chains of 16-lane fused multiply-adds
    (LLVM leaves a strict float reduction scalar; these are summed in a fixed order)."""
    signature = types.void(x, w, stride, blocks, out)

    def codegen(context, builder, sig, args):
        x_ptr, w_ptr, out_ptr = (context.make_array(sig.args[i])(context, builder, args[i]).data for i in (0, 1, 4))
        stride, blocks = args[2], args[3]
        fma = llvm.fma(builder.module)
        vec_ptr = llvm.VEC.as_pointer()
        zero = ir.Constant(llvm.VEC, [0.0] * llvm.LANES)

        def block(index, chains):
            """One block of _BLOCK elements of k: every row's chains plus x times that row."""
            base = builder.mul(index, ir.Constant(llvm.I64, _BLOCK))
            summed = [None] * (_ROWS * _CHAINS)
            for c in range(_CHAINS):
                at = builder.add(base, ir.Constant(llvm.I64, c * llvm.LANES))
                xv = builder.load(builder.bitcast(builder.gep(x_ptr, [at]), vec_ptr), align=4)
                for j in range(_ROWS):
                    row_at = builder.add(at, builder.mul(stride, ir.Constant(llvm.I64, j)))
                    wv = builder.load(builder.bitcast(builder.gep(w_ptr, [row_at]), vec_ptr), align=4)
                    summed[j * _CHAINS + c] = builder.call(fma, [xv, wv, chains[j * _CHAINS + c]])
            return summed

        totals = llvm.counted_loop(builder, blocks, [zero] * (_ROWS * _CHAINS), block, "dot")
        for j in range(_ROWS):
            vector = totals[j * _CHAINS]
            for c in range(1, _CHAINS):
                vector = builder.fadd(vector, totals[j * _CHAINS + c])
            total = builder.extract_element(vector, ir.Constant(llvm.I32, 0))
            for lane in range(1, llvm.LANES):
                total = builder.fadd(total, builder.extract_element(vector, ir.Constant(llvm.I32, lane)))
            builder.store(total, builder.gep(out_ptr, [ir.Constant(llvm.I64, j)]))
        return context.get_dummy_value()

    return signature, codegen


@_vectorized
def rows_times_transposed(a, w, y, first, end):
    """y[r, n] = sum_k a[r, k] * w[n, k] for n in first .. end (w is N x K: Gemm with transB)."""
    rows, depth = a.shape
    blocks = depth // _BLOCK
    head = blocks * _BLOCK
    sums = np.empty(_ROWS, dtype=np.float32)
    single = np.empty(_ROWS, dtype=np.float32)
    flat = w.reshape(-1)
    for n in range(first, end, _ROWS):
        count = min(_ROWS, end - n)
        for r in range(rows):
            x = a[r]
            if count == _ROWS:
                _dot_rows(x, flat[n * depth:], depth, blocks, sums)
            else:  # the last rows one at a time (stride 0: a block of _ROWS would read past w)
                for j in range(count):
                    _dot_rows(x, flat[(n + j) * depth:], 0, blocks, single)
                    sums[j] = single[0]
            for j in range(count):
                total = sums[j]
                weights = w[n + j]
                for k in range(head, depth):
                    total += x[k] * weights[k]
                y[r, n + j] = total


# The reduction of ``a @ w`` (w K x N) runs in blocks of this many rows of w: a block is one contiguous
# stretch of memory (the hardware prefetcher's best case; a decode step streams every weight from the
# L3 cache or memory once), threads take whole blocks, and the blocks' sums are added in block order,
# so the result does not depend on how many threads computed it.
DEPTH_BLOCK = 128


def column_spans(blocks: int, n: int, threads: int) -> int:
    """Column spans of ``a @ w`` (N columns, ``blocks`` blocks of k) for ``threads`` threads: the work
    items are the (block, span) pairs. Columns are split only when there are fewer blocks than threads
    (which does not change any sum)."""
    return max(1, min(-(-threads // blocks), n // (4 * llvm.LANES)))


@_axpy
def _block_rows(a, w, out, first_k, end_k, first, end):
    """out[r, n] = sum of a[r, k] * w[k, n] for k in first_k .. end_k, in k order, for columns n in
    first .. end: four rows of w per pass over out (which stays in the L1 cache)."""
    for r in range(a.shape[0]):
        x = a[r]
        line = out[r, first:end]
        line[:] = 0
        k = first_k
        while k + 4 <= end_k:
            x0, x1, x2, x3 = x[k], x[k + 1], x[k + 2], x[k + 3]
            w0, w1, w2, w3 = w[k, first:end], w[k + 1, first:end], w[k + 2, first:end], w[k + 3, first:end]
            for n in range(end - first):
                line[n] = (((line[n] + x0 * w0[n]) + x1 * w1[n]) + x2 * w2[n]) + x3 * w3[n]
            k += 4
        while k < end_k:
            x0 = x[k]
            w0 = w[k, first:end]
            for n in range(end - first):
                line[n] = line[n] + x0 * w0[n]
            k += 1


@_axpy
def rows_times(a, w, sums, spans, first, end):
    """Work items first .. end of y = a @ w (w is K x N; item = block of k * spans + column span, see
    column_spans): block b's sums go to sums[b]; sum_blocks adds them once every item is done."""
    depth, n = w.shape
    for item in range(first, end):
        block, span = item // spans, item % spans
        low = (n * span // spans) // llvm.LANES * llvm.LANES
        high = n if span == spans - 1 else (n * (span + 1) // spans) // llvm.LANES * llvm.LANES
        _block_rows(a, w, sums[block], block * DEPTH_BLOCK, min(depth, (block + 1) * DEPTH_BLOCK), low, high)


@jit
def sum_blocks(sums):
    """sums[0] += sums[1] + sums[2] + ..., in that order (rows_times's block sums)."""
    y = sums[0]
    for block in range(1, sums.shape[0]):
        y += sums[block]
