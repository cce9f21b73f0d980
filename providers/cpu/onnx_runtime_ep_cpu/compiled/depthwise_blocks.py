"""Depthwise 2-D float32 convolution of the plain layout computed in blocks of 16 channels, a pixel's 16 channels
across the vector lanes.

The plane loops (depthwise.py) and the flat planes and rows (depthwise_small.py, depthwise_rows.py) put a plane's
pixels across the lanes: a 7x7 or 14x14 plane fills a 16-lane vector badly, and a 5x5 window's 25 taps each pay
a pass over a plane-wide grid. onnxruntime's NCHWc depthwise puts 16 channels across the lanes instead, where every
tap is one vector multiply-add per output pixel whatever the plane's size. Here each block of 16 channels is copied
(transposed) into a zero-padded channel-blocked plane, computed by blocked_ops' tiles (the blocked layout's loop,
bias and activation applied as a tile is stored) into a blocked scratch plane, and copied back into the block's
planes of the output: two passes over the block's values beside its taps' arithmetic.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import jit, llvm
from .blocked_ops import depthwise_tile_of
from .directconv import CHANNELS

TILE_PIXELS = 8  # output pixels per tile: 8 accumulators hide the multiply-adds' latency over a window's taps
_tile = depthwise_tile_of(TILE_PIXELS)


def source_floats(rows: int, columns: int, sw: int) -> int:
    """The padded blocked plane's floats: every row and column a window reads (blocked_ops.padded_size's rows and
    columns) and a tile's reach past the last row's end."""
    return (rows * columns + TILE_PIXELS * sw) * CHANNELS


def out_floats(oh: int, ow: int) -> int:
    """The blocked output scratch's floats: a narrow row's tile writes TILE_PIXELS pixels (the next row's first ones,
    rewritten when that row is computed, or past the last row)."""
    return (oh * ow + TILE_PIXELS) * CHANNELS


def _interleaved(builder, rows: list) -> list:
    """The 16 rows of a 16 x 16 tile transposed: four rounds of interleaving row i with row i + 8 (lows into row
    2i, highs into row 2i + 1), each a two-source shuffle."""
    low = ir.Constant(llvm.LANE_INDEX, [k // 2 + (k % 2) * llvm.LANES for k in range(llvm.LANES)])
    high = ir.Constant(llvm.LANE_INDEX, [8 + k // 2 + (k % 2) * llvm.LANES for k in range(llvm.LANES)])
    for _ in range(4):
        rows = [each for i in range(8) for each in (builder.shuffle_vector(rows[i], rows[i + 8], low),
                                                    builder.shuffle_vector(rows[i], rows[i + 8], high))]
    return rows


@intrinsic
def _transpose_tile(typingctx, src, src_start, src_stride, rows, columns, dst, dst_base, dst_starts, dst_first):
    """dst[dst_base + dst_starts[dst_first + j] + i] = src[src_start + i * src_stride + j] for i < ``rows`` and
    j < ``columns`` (at most 16 each): masked loads and stores, so nothing past either is read or written."""
    signature = types.void(src, src_start, src_stride, rows, columns, dst, dst_base, dst_starts, dst_first)

    def codegen(context, builder, sig, args):
        def data(index):
            return context.make_array(sig.args[index])(context, builder, args[index]).data

        src_ptr, dst_ptr, starts_ptr = data(0), data(5), data(7)
        start, stride, count, width, base, first = args[1], args[2], args[3], args[4], args[6], args[8]
        load, store = llvm.masked_load(builder.module), llvm.masked_store(builder.module)
        lane_numbers = llvm.LANE_NUMBERS

        def lanes_below(limit):
            return builder.icmp_signed("<", lane_numbers, llvm.splat(builder, builder.trunc(limit, llvm.I32),
                                                                       llvm.LANE_INDEX))

        none = ir.Constant(llvm.I64, 0)
        read = lanes_below(width)
        loaded = []
        for i in range(llvm.LANES):
            index = ir.Constant(llvm.I64, i)
            present = builder.icmp_signed("<", index, count)
            at = builder.add(start, builder.mul(builder.select(present, index, none), stride))
            mask = builder.select(present, read, ir.Constant(llvm.MASK, [0] * llvm.LANES))
            pointer = builder.bitcast(builder.gep(src_ptr, [at]), llvm.VEC.as_pointer())
            loaded.append(builder.call(load, [pointer, llvm.ALIGN, mask, llvm.ZEROS]))
        write = lanes_below(count)
        last = builder.sub(width, ir.Constant(llvm.I64, 1))
        for j, column in enumerate(_interleaved(builder, loaded)):
            index = ir.Constant(llvm.I64, j)
            present = builder.icmp_signed("<", index, width)
            place = builder.load(builder.gep(starts_ptr, [builder.add(first, builder.select(present, index, last))]))
            mask = builder.select(present, write, ir.Constant(llvm.MASK, [0] * llvm.LANES))
            pointer = builder.bitcast(builder.gep(dst_ptr, [builder.add(base, place)]), llvm.VEC.as_pointer())
            builder.call(store, [column, pointer, llvm.ALIGN, mask])
        return context.get_dummy_value()

    return signature, codegen


def source_places(height: int, width: int, top: int, left: int, padded_width: int) -> np.ndarray:
    """Each input pixel's float offset in the padded blocked plane (row-major pixels)."""
    rows, columns = np.divmod(np.arange(height * width, dtype=np.int64), width)
    return ((rows + top) * padded_width + left + columns) * CHANNELS


def lane_starts(out_plane: int) -> np.ndarray:
    """Each lane's (channel's) plane offset in a block of the plain output."""
    return np.arange(CHANNELS, dtype=np.int64) * out_plane


@jit
def depthwise_channel_blocks(x, weights, offsets, bias, bounds, y, images, channels, height, width, oh, ow, sh, sw,
                             padded_width, places, starts, source, out, first_block, end_block):
    """y = the depthwise convolution (one output per channel) of the plain flat ``x`` (images x channels x height x
    width) into the plain flat ``y`` (images x channels x oh x ow), for the channel blocks [first_block, end_block)
    of every image: each block's planes transposed into ``source`` (source_floats, at ``places``: source_places;
    its zero borders are never written), tiles of TILE_PIXELS pixels of 16 lanes into ``out`` (out_floats), finished
    with the bias and ``bounds``' activation (epilogue.activation_bounds), and transposed into the block's planes
    of ``y`` (``starts``: lane_starts). ``weights``/``bias``: blocked_ops.pack_depthwise; ``offsets``:
    blocked_ops.depthwise_taps of ``padded_width``. A last block of fewer than 16 channels leaves its other lanes
    as the block before left them: they are computed and never stored."""
    depth = offsets.shape[0]
    plane, out_plane = height * width, oh * ow
    step = sw * CHANNELS
    for n in range(images):
        for b in range(first_block, end_block):
            first = b * CHANNELS
            lanes = min(CHANNELS, channels - first)
            base = (n * channels + first) * plane
            for q in range(0, plane, CHANNELS):
                _transpose_tile(x, base + q, plane, lanes, min(CHANNELS, plane - q), source, 0, places, q)
            w = weights[b * depth * CHANNELS:]
            shift = bias[b * CHANNELS:]
            for oy in range(oh):
                for ox in range(0, ow, TILE_PIXELS):
                    if ow >= TILE_PIXELS:
                        ox = min(ox, ow - TILE_PIXELS)
                    _tile(w, source, (oy * sh * padded_width + ox * sw) * CHANNELS, offsets, depth, step,
                                   shift, bounds, 0, out, (oy * ow + ox) * CHANNELS)
            target = (n * channels + first) * out_plane
            for q in range(0, out_plane, CHANNELS):
                _transpose_tile(out, q * CHANNELS, CHANNELS, min(CHANNELS, out_plane - q), lanes, y, target + q,
                                starts, 0)
