"""Depthwise 2-D float32 convolution of large windows (7x7) over small planes, output columns across the lanes.

ConvNeXt's 7x7 depthwise layers run on 16x16 and 8x8 planes with 16 to 32 channels: the plane loops of
depthwise.py pass over a grid 6 columns wider than the output for each group of taps, and the flat planes of
depthwise_small.py pay a mask per tap and pixel. Here a channel is copied once into a zero-padded plane (split
into column phases for a column stride above 1, so that every tap reads contiguous columns), and a tile is
ROWS output rows of one vector of columns (16 or 8 lanes, the row's tail masked): ROWS accumulators in
registers, each tap one weight broadcast and ROWS vector loads and multiply-adds. The bias starts the sums;
the activation is applied as the tile is stored. The intrinsics are plain LLVM vectors (legal on every x86
host); the callers choose them on AVX-512 hosts, where they were measured.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import jit, llvm

ROWS = 8  # output rows per tile: 8 independent accumulators cover the multiply-add latency


def plane_layout(in_shape, kernel, strides, dilations, begin, out, lanes) -> tuple[np.ndarray, int, int]:
    """``(taps, phase_width, size)`` of the padded plane: column phase p (padded columns p, p + sw, ...) holds
    ``size`` floats, rows ``phase_width`` apart; taps[i * kw + j] is where tap (i, j) reads, relative to its
    output's tile start. The plane covers every input pixel and every read of the last tile's rows and lanes."""
    (h, w), (kh, kw), (sh, sw), (dh, dw), (bh, bw), (oh, ow) = in_shape, kernel, strides, dilations, begin, out
    chunks, blocks = -(-ow // lanes), -(-oh // ROWS)
    phase_width = max(chunks * lanes + (kw - 1) * dw // sw, -(-(bw + w) // sw))
    plane_rows = max((blocks * ROWS - 1) * sh + (kh - 1) * dh + 1, bh + h)
    size = plane_rows * phase_width
    taps = [(j * dw % sw) * size + i * dh * phase_width + j * dw // sw for i in range(kh) for j in range(kw)]
    return np.array(taps, dtype=np.int64), phase_width, size


def _vector_at(builder, pointer, offset, vector_type):
    return builder.bitcast(builder.gep(pointer, [offset]), vector_type.as_pointer())


def _splat(builder, scalar, lanes: int):
    """``scalar`` in every lane of a vector of ``lanes`` of its type."""
    return llvm.splat(builder, scalar, ir.VectorType(scalar.type, lanes))


def _lane_mask(builder, lanes: int, count):
    """Lanes 0 .. count - 1 on (count an i64)."""
    index = ir.VectorType(llvm.I64, lanes)
    numbers = ir.Constant(index, list(range(lanes)))
    return builder.icmp_signed("<", numbers, _splat(builder, count, lanes))


def _masked(module, lanes: int):
    vec = ir.VectorType(llvm.F32, lanes)
    mask = ir.VectorType(ir.IntType(1), lanes)
    load = llvm.declare(module, f"llvm.masked.load.v{lanes}f32.p0",
                        ir.FunctionType(vec, [vec.as_pointer(), llvm.I32, mask, vec]))
    store = llvm.declare(module, f"llvm.masked.store.v{lanes}f32.p0",
                         ir.FunctionType(ir.VoidType(), [vec, vec.as_pointer(), llvm.I32, mask]))
    return load, store


def shared_height(kernel, strides, dilations) -> int:
    """The window height whose tiles share their row loads (depthwise_rows' ``height``): 5 or 7 rows of stride
    and dilation 1, else 0 (each tap loads its own rows)."""
    return kernel[0] if kernel[0] in SHARED_HEIGHTS and strides[0] == dilations[0] == 1 else 0


SHARED_HEIGHTS = (5, 7)


def _tile_intrinsic(lanes: int, height: int):
    """The tile of ``lanes`` columns; ``height`` > 0: a window of that many rows of stride and dilation 1, whose
    ROWS + height - 1 input rows each tap column loads once for all the tile's rows (else one load per tap and
    row)."""
    vec = ir.VectorType(llvm.F32, lanes)

    @intrinsic
    def tile(typingctx, w, w_at, planes, start, taps, row_step, bias, channel, bounds, y, y_at, y_row, columns, rows):
        """y[y_at + r * y_row + l] = activation(bias[channel] + sum_t w[w_at + t]
        * planes[start + taps[t] + r * row_step + l]) for rows r < min(ROWS, rows) and lanes l < min(lanes, columns);
        ``bounds`` (low, high, slope) as epilogue.activation_bounds. Taps are added in order, each multiply-add
        rounded once."""
        signature = types.void(w, w_at, planes, start, taps, row_step, bias, channel, bounds, y, y_at, y_row, columns,
                               rows)

        def codegen(context, builder, sig, args):
            def data(index):
                return context.make_array(sig.args[index])(context, builder, args[index]).data

            w_ptr, planes_ptr, taps_ptr, bias_ptr, bounds_ptr, y_ptr = (data(i) for i in (0, 2, 4, 6, 8, 9))
            w_at, start, row_step, channel = args[1], args[3], args[5], args[7]
            y_at, y_row, columns, count = args[10:14]
            depth = builder.extract_value(context.make_array(sig.args[4])(context, builder, args[4]).shape, 0)
            fma = llvm.declare(builder.module, f"llvm.fma.v{lanes}f32", ir.FunctionType(vec, [vec, vec, vec]))
            _, store = _masked(builder.module, lanes)
            initial = _splat(builder, builder.load(builder.gep(bias_ptr, [channel])), lanes)

            def row_at(origin, r):
                return builder.load(_vector_at(builder, planes_ptr, builder.add(
                    origin, builder.mul(row_step, ir.Constant(llvm.I64, r))), vec), align=4)

            def step(k, sums):
                weight = _splat(builder, builder.load(builder.gep(w_ptr, [builder.add(w_at, k)])), lanes)
                origin = builder.add(start, builder.load(builder.gep(taps_ptr, [k])))
                return [builder.call(fma, [weight, row_at(origin, r), sums[r]]) for r in range(ROWS)]

            width = builder.sdiv(depth, ir.Constant(llvm.I64, max(1, height)))

            def column(j, sums):  # taps (i, j) for every window row i: taps[j] is column j's offset in row 0
                origin = builder.add(start, builder.load(builder.gep(taps_ptr, [j])))
                rows = [row_at(origin, u) for u in range(ROWS + height - 1)]
                new = list(sums)
                for i in range(height):
                    at = builder.add(w_at, builder.add(builder.mul(width, ir.Constant(llvm.I64, i)), j))
                    weight = _splat(builder, builder.load(builder.gep(w_ptr, [at])), lanes)
                    new = [builder.call(fma, [weight, rows[r + i], new[r]]) for r in range(ROWS)]
                return new

            if height:
                sums = llvm.counted_loop(builder, width, [initial] * ROWS, column, "depthwise_rows")
            else:
                sums = llvm.counted_loop(builder, depth, [initial] * ROWS, step, "depthwise_rows")
            low, high, slope = (_splat(builder, builder.load(builder.gep(bounds_ptr, [ir.Constant(llvm.I64, i)])),
                                       lanes) for i in range(3))
            zeros = ir.Constant(vec, [0.0] * lanes)
            columns_on = _lane_mask(builder, lanes, columns)
            none = ir.Constant(ir.VectorType(ir.IntType(1), lanes), [0] * lanes)
            for r, v in enumerate(sums):
                v = builder.select(builder.fcmp_ordered("<", v, zeros), builder.fmul(v, slope), v)
                v = builder.select(builder.fcmp_ordered("<", v, low), low, v)
                v = builder.select(builder.fcmp_ordered(">", v, high), high, v)
                row_on = builder.icmp_signed(">", count, ir.Constant(llvm.I64, r))
                mask = builder.select(row_on, columns_on, none)
                at = builder.add(y_at, builder.mul(y_row, ir.Constant(llvm.I64, r)))
                builder.call(store, [v, _vector_at(builder, y_ptr, at, vec), llvm.ALIGN, mask])
            return context.get_dummy_value()

        return signature, codegen

    return tile


_tile_16, _tile_8 = _tile_intrinsic(16, 0), _tile_intrinsic(8, 0)
_tile_16_h5, _tile_8_h5 = _tile_intrinsic(16, 5), _tile_intrinsic(8, 5)
_tile_16_h7, _tile_8_h7 = _tile_intrinsic(16, 7), _tile_intrinsic(8, 7)


@intrinsic
def _copy_row(typingctx, dst, dst_at, src, src_at, count):
    """dst[dst_at + v] = src[src_at + v] for v < count, 16 lanes at a time (the last vector masked)."""
    signature = types.void(dst, dst_at, src, src_at, count)

    def codegen(context, builder, sig, args):
        dst_ptr = context.make_array(sig.args[0])(context, builder, args[0]).data
        src_ptr = context.make_array(sig.args[2])(context, builder, args[2]).data
        dst_at, src_at, count = args[1], args[3], args[4]
        load, store = _masked(builder.module, 16)
        sixteen = ir.Constant(llvm.I64, 16)
        vectors = builder.sdiv(builder.add(count, ir.Constant(llvm.I64, 15)), sixteen)

        def step(k, carried):
            offset = builder.mul(k, sixteen)
            mask = _lane_mask(builder, 16, builder.sub(count, offset))
            value = builder.call(load, [_vector_at(builder, src_ptr, builder.add(src_at, offset), llvm.VEC),
                                        llvm.ALIGN, mask, llvm.ZEROS])
            builder.call(store, [value, _vector_at(builder, dst_ptr, builder.add(dst_at, offset), llvm.VEC),
                                 llvm.ALIGN, mask])
            return carried

        llvm.counted_loop(builder, vectors, [], step, "copy_row")
        return context.get_dummy_value()

    return signature, codegen


@jit
def depthwise_rows(x, weights, bias, bounds, y, planes, taps, in_h, in_w, top, left, sw, phase_width, size, oh, ow,  # noqa: C901
                   sh, lanes, height):
    """y (N, C, oh, ow) = activation(bias + the depthwise convolution of x (N, C, in_h, in_w)), one output per
    channel, all flat float32: ``weights`` (C, taps), ``bias`` (C,) (zeros for none), ``bounds``
    (epilogue.activation_bounds); ``planes`` (sw * size, zero, its pads never written) and ``taps``,
    ``phase_width``, ``size`` from plane_layout; the input at (``top``, ``left``) of the padded plane; ``lanes``
    16 or 8; ``height``: shared_height's (the tiles of a window of that height share their row loads)."""
    channels = bias.shape[0]
    depth = taps.shape[0]
    pixels, out_pixels = in_h * in_w, oh * ow
    row_step = sh * phase_width
    for n in range(x.shape[0] // (channels * pixels)):
        for c in range(channels):
            base = (n * channels + c) * pixels
            if sw == 1:
                for r in range(in_h):
                    _copy_row(planes, (r + top) * phase_width + left, x, base + r * in_w, in_w)
            else:
                for r in range(in_h):
                    at = (r + top) * phase_width
                    for v in range(in_w):
                        column = v + left
                        planes[np.uint64((column % sw) * size + at + column // sw)] = x[np.uint64(base + r * in_w + v)]
            target = (n * channels + c) * out_pixels
            for r0 in range(0, oh, ROWS):
                for q0 in range(0, ow, lanes):  # (the tile of ``lanes`` and ``height``: a helper measured slower)
                    at, out, columns, rows = r0 * row_step + q0, target + r0 * ow + q0, ow - q0, oh - r0
                    if lanes == 16:
                        if height == 7:
                            _tile_16_h7(weights, c * depth, planes, at, taps, row_step, bias, c, bounds, y, out, ow,
                                        columns, rows)
                        elif height == 5:
                            _tile_16_h5(weights, c * depth, planes, at, taps, row_step, bias, c, bounds, y, out, ow,
                                        columns, rows)
                        else:
                            _tile_16(weights, c * depth, planes, at, taps, row_step, bias, c, bounds, y, out, ow,
                                     columns, rows)
                    elif height == 7:
                        _tile_8_h7(weights, c * depth, planes, at, taps, row_step, bias, c, bounds, y, out, ow, columns,
                                   rows)
                    elif height == 5:
                        _tile_8_h5(weights, c * depth, planes, at, taps, row_step, bias, c, bounds, y, out, ow, columns,
                                   rows)
                    else:
                        _tile_8(weights, c * depth, planes, at, taps, row_step, bias, c, bounds, y, out, ow, columns,
                                rows)
