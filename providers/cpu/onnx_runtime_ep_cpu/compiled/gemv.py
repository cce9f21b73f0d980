"""Matrix-vector products (a few rows of ``a`` times a weight matrix) for float32/float64, split
across the packed convolution's helper threads (workers.py) by output columns.

A CNN's classifier is such a product. Through numpy's multi-threaded BLAS it would leave BLAS's
worker thread spinning for ~0.1 s after the call, on a CPU the convolution helpers need: the next
inference's convolutions then run at a fraction of their speed. These loops keep the whole model on
one set of threads. Reductions over k run in vector chains, so sums may round differently from
BLAS's, as BLAS's own blockings do. float32 only (the helpers' jobs are float32).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import compiler, llvm

_vectorized = compiler(fastmath={"reassoc", "contract"})

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
        entry = builder.block
        loop = builder.append_basic_block("dot.loop")
        done = builder.append_basic_block("dot.done")
        builder.cbranch(builder.icmp_signed(">", blocks, ir.Constant(llvm.I64, 0)), loop, done)
        builder.position_at_end(loop)
        block = builder.phi(llvm.I64)
        block.add_incoming(ir.Constant(llvm.I64, 0), entry)
        chains = [builder.phi(llvm.VEC) for _ in range(_ROWS * _CHAINS)]
        for chain in chains:
            chain.add_incoming(zero, entry)
        base = builder.mul(block, ir.Constant(llvm.I64, _BLOCK))
        summed = []
        for c in range(_CHAINS):
            at = builder.add(base, ir.Constant(llvm.I64, c * llvm.LANES))
            xv = builder.load(builder.bitcast(builder.gep(x_ptr, [at]), vec_ptr), align=4)
            for j in range(_ROWS):
                row_at = builder.add(at, builder.mul(stride, ir.Constant(llvm.I64, j)))
                wv = builder.load(builder.bitcast(builder.gep(w_ptr, [row_at]), vec_ptr), align=4)
                summed.append((j * _CHAINS + c, builder.call(fma, [xv, wv, chains[j * _CHAINS + c]])))
        summed = [value for _, value in sorted(summed, key=lambda item: item[0])]
        following = builder.add(block, ir.Constant(llvm.I64, 1))
        block.add_incoming(following, loop)
        for chain, value in zip(chains, summed):
            chain.add_incoming(value, loop)
        builder.cbranch(builder.icmp_signed("<", following, blocks), loop, done)
        builder.position_at_end(done)
        totals = []
        for i in range(_ROWS * _CHAINS):
            phi = builder.phi(llvm.VEC)
            phi.add_incoming(zero, entry)
            phi.add_incoming(summed[i], loop)
            totals.append(phi)
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


@_vectorized
def rows_times(a, w, y, first, end):
    """y[r, n] = sum_k a[r, k] * w[k, n] for n in first .. end (w is K x N), as axpy passes over w's rows."""
    rows, depth = a.shape
    for r in range(rows):
        out = y[r, first:end]
        out[:] = 0
        for k in range(depth):
            factor = a[r, k]
            line = w[k, first:end]
            for n in range(end - first):
                out[n] += factor * line[n]
