"""Depthwise 2-D float32 convolution of a channels-last map, stride 1, undilated, 16 channels across the lanes
(AVX-512), written as LLVM IR: NhwcConv's kernel for maps larger than depthwise_small's pair sums serve
(ConvNeXt's 7x7 convolutions of its first stages).

A call computes COLUMNS output pixels of one output row (NARROW on rows of at most NARROW pixels) for 16
channels, their sums in registers over the window's rows: each input pixel the block reads from a row is loaded
once, in place (masked loads: pixels off the row's ends and channels past the last read zero and are not
touched), and feeds every output pixel whose window covers it, times the tap column's weights (loaded once per
row). The caller skips the window's rows
off the map. An output's taps add in row-major order to the bias, each by one fused multiply-add, as
depthwise_small's pair sums do. Where the pair sums lose on such maps is indexing: their inner loop over a
pixel's few channels is all they vectorize.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import jit, llvm

COLUMNS = 8  # output pixels per call: their sums, the tap columns' weights and an input pixel fit the registers
NARROW = 4  # output pixels per call on rows this narrow (a wider call's work past the row is thrown away)
KERNEL_WIDTHS = (3, 5, 7)  # the window widths a call is built for (compile-time: the taps are unrolled)
_LANES = llvm.LANES


def _row_kernel(kw: int, columns: int):
    """The intrinsic of one call for windows ``kw`` wide computing ``columns`` outputs (see _emit)."""

    @intrinsic
    def kernel(typingctx, x, weights, bias, y, x_at, w_at, rows, ldx, ldw, col0, width, channels, c0, y_at, count):
        """y[y_at + r*channels + l] = bias[c0 + l] + sum over k < rows, j < kw of weights[w_at + k*ldw +
        j*channels + l] * x[x_at + k*ldx + (col0 + r + j)*channels + l], for r < count, c0 + l < channels; input
        columns outside 0 .. width-1 read zero."""
        if not all(getattr(a, "dtype", None) == types.float32 for a in (x, weights, bias, y)) \
                or not all(a == types.int64 for a in (x_at, w_at, rows, ldx, ldw, col0, width, channels, c0, y_at,
                                                      count)):
            return None  # float32 arrays, 64-bit indices
        signature = types.void(x, weights, bias, y, x_at, w_at, rows, ldx, ldw, col0, width, channels, c0, y_at,
                               count)

        def codegen(context, builder, sig, args):
            def data(index):
                return context.make_array(sig.args[index])(context, builder, args[index]).data

            _emit(builder, kw, columns, tuple(data(i) for i in range(4)), tuple(args[4:]))
            return context.get_dummy_value()

        return signature, codegen

    return kernel


def _emit(builder, kw: int, columns: int, pointers: tuple, values: tuple) -> None:
    """The IR of one call: ``columns`` sums of 16 lanes carried in registers over the window's rows."""
    x_ptr, w_ptr, b_ptr, y_ptr = pointers
    x_at, w_at, rows, ldx, ldw, col0, width, channels, c0, y_at, count = values
    module = builder.module
    load, store, fma = llvm.masked_load(module), llvm.masked_store(module), llvm.fma(module)
    vec_ptr, align, zero = llvm.VEC.as_pointer(), llvm.ALIGN, llvm.ZEROS

    def const(value):
        return ir.Constant(llvm.I64, value)

    def at(pointer, index):
        return builder.bitcast(builder.gep(pointer, [index]), vec_ptr)

    lanes = builder.icmp_signed("<", builder.add(llvm.splat(builder, builder.trunc(c0, llvm.I32), llvm.LANE_INDEX),
                                                 llvm.LANE_NUMBERS),
                                llvm.splat(builder, builder.trunc(channels, llvm.I32), llvm.LANE_INDEX))
    # one mask per input column the block reads: its channels where the column lies in the row, else none
    reach = columns + kw - 1
    masks, offsets = [], []
    for t in range(reach):
        column = builder.add(col0, const(t))
        inside = builder.and_(builder.icmp_signed(">=", column, const(0)), builder.icmp_signed("<", column, width))
        masks.append(builder.and_(lanes, llvm.splat(builder, inside, llvm.MASK)))
        offsets.append(builder.mul(column, channels))
    first = builder.call(load, [at(b_ptr, c0), align, lanes, zero])

    def row(k, sums):
        x_row = builder.add(x_at, builder.mul(k, ldx))
        w_row = builder.add(w_at, builder.mul(k, ldw))
        taps = [builder.call(load, [at(w_ptr, builder.add(w_row, builder.mul(const(j), channels))), align, lanes,
                                    zero]) for j in range(kw)]
        sums = list(sums)
        for t in range(reach):
            v = builder.call(load, [at(x_ptr, builder.add(x_row, offsets[t])), align, masks[t], zero])
            for r in range(max(0, t - kw + 1), min(columns, t + 1)):  # the outputs whose window column t - r is
                sums[r] = builder.call(fma, [taps[t - r], v, sums[r]])
        return sums

    sums = llvm.counted_loop(builder, rows, [first] * columns, row, "depthwise_nhwc")
    for r in range(columns):
        keep = builder.and_(lanes, llvm.splat(builder, builder.icmp_signed("<", const(r), count), llvm.MASK))
        builder.call(store, [sums[r], at(y_ptr, builder.add(y_at, builder.mul(const(r), channels))), align, keep])


_k3, _k5, _k7 = (_row_kernel(kw, COLUMNS) for kw in KERNEL_WIDTHS)
_n3, _n5, _n7 = (_row_kernel(kw, NARROW) for kw in KERNEL_WIDTHS)


@jit
def depthwise_nhwc(x, weights, bias, y, height, width, kh, kw, top, left, out_w):
    """y (N, OH, OW, C) = bias + the depthwise convolution of x (N, height, width, C), stride 1, undilated, pads
    ``top`` and ``left`` before (OH from y's size), x and y C-contiguous of any rank (read flat): ``weights``
    (kh * kw * C) flat, ``bias`` (C,) (zeros for none); kw one of KERNEL_WIDTHS."""
    x, y = x.reshape(x.size), y.reshape(y.size)  # (views: the caller's arrays are C-contiguous)
    channels = bias.shape[0]
    images = x.shape[0] // (height * width * channels)
    out_h = y.shape[0] // (images * out_w * channels)
    ldx, ldw = width * channels, kw * channels
    narrow = out_w <= NARROW
    step = NARROW if narrow else COLUMNS
    for n in range(images):
        for oy in range(out_h):
            first = max(0, top - oy)
            rows = min(kh, height + top - oy) - first
            x_row = (n * height + oy - top + first) * ldx
            y_row = (n * out_h + oy) * out_w * channels
            for ox in range(0, out_w, step):
                count = min(step, out_w - ox)
                for c0 in range(0, channels, _LANES):
                    x_at, w_at, col0, y_at = x_row + c0, first * ldw + c0, ox - left, y_row + ox * channels + c0
                    if narrow:
                        if kw == 7:
                            _n7(x, weights, bias, y, x_at, w_at, rows, ldx, ldw, col0, width, channels, c0, y_at, count)
                        elif kw == 5:
                            _n5(x, weights, bias, y, x_at, w_at, rows, ldx, ldw, col0, width, channels, c0, y_at, count)
                        else:
                            _n3(x, weights, bias, y, x_at, w_at, rows, ldx, ldw, col0, width, channels, c0, y_at, count)
                    elif kw == 7:
                        _k7(x, weights, bias, y, x_at, w_at, rows, ldx, ldw, col0, width, channels, c0, y_at, count)
                    elif kw == 5:
                        _k5(x, weights, bias, y, x_at, w_at, rows, ldx, ldw, col0, width, channels, c0, y_at, count)
                    else:
                        _k3(x, weights, bias, y, x_at, w_at, rows, ldx, ldw, col0, width, channels, c0, y_at, count)
