"""3x3 windows of stride 1 or 2 over one float32 plane, read in place: the kernel of depthwise
convolutions (depthwise.py) and of 3x3 max and average pools (``pool``), written as LLVM IR (AVX-512).

A call computes ROWS output rows of 16 columns: each input row the block needs is loaded once, with
masked vector loads whose lanes off the row (the pads, and past its end) are not read, and feeds
every output row whose window covers it; stride 2 loads 32 columns at a time and takes the even or
odd ones per tap column (one two-vector shuffle). The ROWS results stay in registers, independent
chains (one row's nine dependent steps alone would stall on their latency). A convolution's lanes
start from the bias and add weight x tap by fused multiply-adds, taps off the plane reading zero
(rows off it read a zero row); a max pool's start from -inf and keep the larger (NaN wins, as in
np.maximum), taps off the plane skipped (masked to -inf): separably (each input row's 3-column maxima,
shared by the output rows that read it) by vmaxps, which drops a NaN tap, while the sums of the rows
loaded show whether one was read; only then the call runs again per tap keeping NaN (a compare and a mask
per tap more, which the separable maxima save: measured in 39dedc0). An average pool's add the taps in
row-major order (those off the plane masked to zero) and multiply the sums by the reciprocal tap counts,
as pooling.py does.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import jit, llvm, pooling

# Output rows per call: CNN feature maps are 7 * 2^k high, so 7 leaves no partial block there (7 measured
# faster than 4 or 8 in d57ce75).
ROWS = 7
_LANES = llvm.LANES
_KERNEL = 3


CONVOLVE, MAX, AVERAGE = 0, 1, 2  # what a call computes


def _window_kernel(stride: int, mode: int):
    """The intrinsic of one call (see _emit): a depthwise convolution's (CONVOLVE), a max pool's (MAX) or
    an average pool's (AVERAGE), stride ``stride`` both ways."""

    @intrinsic
    def kernel(typingctx, x, rows, weights, w_at, col0, width, zero, y, y_at, ldy, nrows, count, bias, activation,
               activate):
        """y[y_at + o*ldy + q] = act(bias + sum_ij weights[w_at + 3i + j] * x[rows[o*stride + i] + col0 +
        stride*q + j]) for o < nrows, q < count (pooling: the max, or the sum, of those taps); taps outside 0 .. width-1
        columns, and rows marked -1, read as zero (``zero``: a zero row at least ``width`` long; pooling:
        skipped). ``activate`` = 0 skips ``activation``; pooling reads no bias, a max pool no weights, and an
        average pool multiplies output (o, q)'s sum by weights[w_at + o*ldy + q] (its reciprocal tap count)."""
        if not all(getattr(a, "dtype", None) == types.float32 for a in (x, weights, zero, y, activation)):
            return None  # float32 only
        signature = types.void(x, rows, weights, w_at, col0, width, zero, y, y_at, ldy, nrows, count, bias,
                               activation, activate)

        def codegen(context, builder, sig, args):
            def data(index):
                return context.make_array(sig.args[index])(context, builder, args[index]).data

            _emit(builder, stride, mode, (data(0), data(1), data(2), data(6), data(7), data(13)),
                  tuple(args[i] for i in (3, 4, 5, 8, 9, 10, 11, 12, 14)))
            return context.get_dummy_value()

        return signature, codegen

    return kernel


def _emit(builder, stride: int, mode: int, pointers: tuple, values: tuple) -> None:
    """The IR of one call: ROWS results of 16 lanes carried in registers."""
    x_ptr, rows_ptr, w_ptr, zero_ptr, y_ptr, act_ptr = pointers
    w_at, col0, width, y_at, ldy, nrows, count, bias, activate = values
    module = builder.module
    load, store, fma = llvm.masked_load(module), llvm.masked_store(module), llvm.fma(module)
    vec_ptr, align, zero, lane = llvm.VEC.as_pointer(), llvm.ALIGN, llvm.ZEROS, llvm.LANE_NUMBERS
    lowest = ir.Constant(llvm.VEC, [-np.inf] * _LANES)
    pooling = mode != CONVOLVE
    off = lowest if mode == MAX else zero  # what a tap off the plane reads

    def const(value):
        return ir.Constant(llvm.I64, value)

    # The columns a load at col0 + offset covers lie in the row (the others are masked off): one mask per
    # offset. Stride 1 loads at each tap column; stride 2 loads 32 columns from col0 and col0 + 2 (two
    # vectors each) and takes the even or odd ones per tap.
    offsets = list(range(_KERNEL)) if stride == 1 else [t + half for t in (0, 2) for half in (0, _LANES)]
    first = builder.trunc(col0, llvm.I32)
    limit = llvm.splat(builder, builder.trunc(width, llvm.I32), llvm.LANE_INDEX)
    masks = {}
    for offset in offsets:
        column = builder.add(llvm.splat(builder, builder.add(first, ir.Constant(llvm.I32, offset)), llvm.LANE_INDEX),
                             lane)
        masks[offset] = builder.and_(builder.icmp_signed(">=", column, ir.Constant(llvm.LANE_INDEX, [0] * _LANES)),
                                     builder.icmp_signed("<", column, limit))
    if not pooling:
        taps = [llvm.splat(builder, builder.load(builder.gep(w_ptr, [builder.add(w_at, const(k))])))
                for k in range(_KERNEL * _KERNEL)]

    def larger(v, w):  # one vmaxps: w where either is NaN
        return builder.select(builder.fcmp_ordered(">", v, w), v, w)

    def windows(exact: bool):
        """The ROWS results of the call's rows and columns; a max pool's ``exact`` ones keep a NaN tap (as
        np.maximum), the others ignore NaN taps and also return the sum of every column they read."""
        results = [off] * ROWS if pooling else [llvm.splat(builder, bias)] * ROWS
        checks = [zero] * 3
        for u in range((ROWS - 1) * stride + _KERNEL):  # input rows, each loaded once
            at = builder.load(builder.gep(rows_ptr, [const(u)]))
            inside = builder.icmp_signed(">=", at, const(0))
            if pooling:  # a row off the plane: every lane masked off
                row = builder.gep(x_ptr, [builder.select(inside, at, const(0))])
                row_mask = llvm.splat(builder, inside, llvm.MASK)
            else:  # a row off the plane: the zero row
                row, row_mask = builder.select(inside, builder.gep(x_ptr, [at]), zero_ptr), None
            loaded = {}
            for offset in offsets:
                mask = masks[offset] if row_mask is None else builder.and_(masks[offset], row_mask)
                pointer = builder.bitcast(builder.gep(row, [builder.add(col0, const(offset))]), vec_ptr)
                loaded[offset] = builder.call(load, [pointer, align, mask, off])
            if stride == 1:
                columns = [loaded[j] for j in range(_KERNEL)]
            else:
                columns = [builder.shuffle_vector(loaded[j - j % 2], loaded[j - j % 2 + _LANES],
                                                  ir.Constant(llvm.LANE_INDEX, [2 * q + j % 2 for q in range(_LANES)]))
                           for j in range(_KERNEL)]
            if mode == MAX and not exact:
                # The sum of the loads that cover every column read (short dependency chains), and the row's
                # 3-column maxima, shared by the output rows that read it (separable).
                row_sum = builder.fadd(loaded[0], loaded[2]) if stride == 1 else \
                    builder.fadd(builder.fadd(loaded[0], loaded[_LANES]), loaded[2 + _LANES])
                checks[u % 3] = builder.fadd(checks[u % 3], row_sum)
                columns = [larger(larger(columns[0], columns[1]), columns[2])]
            for o in range(ROWS):  # the output rows that read this input row, as their kernel row i
                i = u - o * stride
                if 0 <= i < _KERNEL:
                    for j, v in enumerate(columns):
                        if mode == MAX and not exact:
                            results[o] = larger(v, results[o])
                        elif mode == MAX:  # the larger, or v where it is NaN
                            keep = builder.or_(builder.fcmp_ordered(">", v, results[o]),
                                               builder.fcmp_unordered("uno", v, v))
                            results[o] = builder.select(keep, v, results[o])
                        elif mode == AVERAGE:
                            results[o] = builder.fadd(results[o], v)
                        else:
                            results[o] = builder.call(fma, [taps[i * _KERNEL + j], v, results[o]])
        return results, builder.fadd(builder.fadd(checks[0], checks[1]), checks[2])

    results, check = windows(exact=mode != MAX)
    if mode == MAX:
        # A NaN tap makes the sum of the columns NaN (so may an inf and a -inf: exact either way): only then
        # the call runs again keeping NaN taps, which costs a compare and a mask or per tap.
        fast = builder.block
        exact_block = builder.append_basic_block("windows.exact")
        joined = builder.append_basic_block("windows.joined")
        found = builder.bitcast(builder.fcmp_unordered("uno", check, check), ir.IntType(_LANES))
        builder.cbranch(builder.icmp_unsigned("!=", found, ir.Constant(ir.IntType(_LANES), 0)), exact_block, joined)
        builder.position_at_end(exact_block)
        exact, _ = windows(exact=True)
        exact_end = builder.block
        builder.branch(joined)
        builder.position_at_end(joined)
        results = llvm.merged(builder, (results, fast), (exact, exact_end))
    columns_left = builder.icmp_signed("<", lane, llvm.splat(builder, builder.trunc(count, llvm.I32), llvm.LANE_INDEX))
    row_inside = [llvm.splat(builder, builder.icmp_signed("<", const(o), nrows), llvm.MASK) for o in range(ROWS)]
    if mode == AVERAGE:  # each sum times its output's reciprocal tap count
        for o in range(ROWS):
            at = builder.bitcast(builder.gep(w_ptr, [builder.add(w_at, builder.mul(const(o), ldy))]), vec_ptr)
            scale = builder.call(load, [at, align, builder.and_(columns_left, row_inside[o]), zero])
            results[o] = builder.fmul(results[o], scale)
    # The activation (v*slope below zero, then max with low, min with high: epilogue.activate), if any.
    plain = builder.block
    activated_block = builder.append_basic_block("windows.activate")
    stores = builder.append_basic_block("windows.store")
    builder.cbranch(builder.icmp_signed("!=", activate, const(0)), activated_block, stores)
    builder.position_at_end(activated_block)
    bounds = [llvm.splat(builder, builder.load(builder.gep(act_ptr, [const(k)]))) for k in range(3)]
    activated = [llvm.activated(builder, v, bounds) for v in results]
    builder.branch(stores)
    builder.position_at_end(stores)
    finished = llvm.merged(builder, (results, plain), (activated, activated_block))
    for o in range(ROWS):
        target = builder.bitcast(builder.gep(y_ptr, [builder.add(y_at, builder.mul(const(o), ldy))]), vec_ptr)
        builder.call(store, [finished[o], target, align, builder.and_(columns_left, row_inside[o])])


_convolve_1, _convolve_2 = _window_kernel(1, CONVOLVE), _window_kernel(2, CONVOLVE)
_max_1, _max_2 = _window_kernel(1, MAX), _window_kernel(2, MAX)
_average_1, _average_2 = _window_kernel(1, AVERAGE), _window_kernel(2, AVERAGE)


@jit
def window(stride, x, rows, weights, w_at, col0, width, zero, y, y_at, ldy, nrows, count, bias, activation, activate):
    """A depthwise convolution's call for this stride (1 or 2): see _window_kernel."""
    if stride == 1:
        _convolve_1(x, rows, weights, w_at, col0, width, zero, y, y_at, ldy, nrows, count, bias, activation, activate)
    else:
        _convolve_2(x, rows, weights, w_at, col0, width, zero, y, y_at, ldy, nrows, count, bias, activation, activate)


@jit
def takes_pool(kh, kw, sh, sw, dh, dw):
    """Whether ``pool`` computes this pool window: 3x3, strides (1, 1) or (2, 2), no dilation."""
    return kh == 3 and kw == 3 and sh == sw and 1 <= sh <= 2 and dh == 1 and dw == 1


@jit
def pool_planes(planes, rows, kh, kw, sh, sw, dh, dw, ph, pw, is_max, lo_h, hi_h, lo_w, hi_w):
    """pooling.pool_2d's pool of ``planes`` into ``rows`` (its arguments), by ``pool`` where it takes the window."""
    if takes_pool(kh, kw, sh, sw, dh, dw):
        pool(planes, rows, sh, ph, pw, is_max, lo_h, hi_h, lo_w, hi_w)
    else:
        pooling.pool_2d(planes, rows, kh, kw, sh, sw, dh, dw, ph, pw, is_max, lo_h, hi_h, lo_w, hi_w)


@jit
def row_starts(rows, start, first_row, height, width):
    """rows[u] = where row first_row + u of the (height, width) plane at ``start`` begins, or -1 for a row
    off the plane: the input rows of one call, as the kernel reads them."""
    for u in range(rows.shape[0]):
        r = first_row + u
        rows[u] = start + r * width if 0 <= r < height else -1


@jit
def pool(planes, out, stride, top, left, is_max, lo_h, hi_h, lo_w, hi_w):
    """out[p] = the 3x3 max (``is_max``) or average pool of planes[p] (P, H, W) with this stride (1 or 2),
    ``top``/``left`` pad rows and columns before (those after, and a ceil_mode overhang, come from ``out``'s
    size); a max skips the taps off the plane, an average divides by how many taps land on counted
    positions, padded rows [lo_h, hi_h) and columns [lo_w, hi_w) (pooling.pool_2d's arguments). float32."""
    h, w = planes.shape[1], planes.shape[2]
    oh, ow = out.shape[1], out.shape[2]
    x, y = planes.reshape(-1), out.reshape(-1)
    reach = (ROWS - 1) * stride + _KERNEL
    rows = np.empty(reach, dtype=np.int64)
    none = np.zeros(_LANES, dtype=np.float32)  # (no zero row, bias or activation)
    scale = none
    if not is_max:  # the reciprocal tap counts, one per output, (oh, ow) as the output's plane
        scale = pooling.reciprocals(pooling.tap_counts(oh, 3, stride, 1, lo_h, hi_h, out.dtype),
                                    pooling.tap_counts(ow, 3, stride, 1, lo_w, hi_w, out.dtype), False).reshape(-1)
    for p in range(planes.shape[0]):
        start = p * h * w
        for r0 in range(0, oh, ROWS):
            row_starts(rows, start, r0 * stride - top, h, w)
            target = p * oh * ow + r0 * ow
            for q0 in range(0, ow, _LANES):
                col0, count, at = (q0 if stride == 1 else 2 * q0) - left, min(_LANES, ow - q0), r0 * ow + q0
                if is_max:
                    if stride == 1:
                        _max_1(x, rows, none, 0, col0, w, none, y, target + q0, ow, oh - r0, count, np.float32(0),
                               none, 0)
                    else:
                        _max_2(x, rows, none, 0, col0, w, none, y, target + q0, ow, oh - r0, count, np.float32(0),
                               none, 0)
                elif stride == 1:
                    _average_1(x, rows, scale, at, col0, w, none, y, target + q0, ow, oh - r0, count, np.float32(0),
                               none, 0)
                else:
                    _average_2(x, rows, scale, at, col0, w, none, y, target + q0, ow, oh - r0, count, np.float32(0),
                               none, 0)
