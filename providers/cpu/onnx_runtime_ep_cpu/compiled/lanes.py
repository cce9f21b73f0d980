"""Packed float32 convolution with the output channels across the vector lanes: the kernel of
onnxruntime's NCHWc convolutions, over NCHW tensors.

gemm.py's microkernel puts 32 output pixels across its lanes, read in place from the padded image:
the lanes then run over whole padded rows, and the columns past the output's width, and the last
panel's tail, are computed and dropped (a 13x13 map computes 224 lanes for its 169 pixels). Here a
tile is 32 output channels (two vectors) x 14 output pixels: for each k = (channel, tap) the tile's
two weight vectors are loaded (the weights packed once, 32 per k, in STREAMS runs: pack_weights) and each
pixel's input value is broadcast from the padded image at its tap offset (pixel p of a row chunk at
p * stride from the first: strided windows need no phase split or packing), 28 fused multiply-adds
on 28 accumulators held in registers. No lane is wasted on pixels; the sums are transposed (16 x 16,
four rounds of two-vector shuffles) into rows of pixels per channel as they are stored, bias and
activation applied before (per lane: one vector each), a residual after.

A tile covers 14 pixels of one output row, or two rows of 7 where the output is at most 7 wide. A
row's last chunk is shifted back to end at the row's end (it recomputes, and stores again, pixels of
the chunk before it: the same values), and so are the last two rows of an odd height, so the kernel
reads past the image only where a row (or the image) is narrower than the tile: those inputs get a
margin (``margin``). On one thread it runs 3x3 and 1x1 convolutions and shallow stems faster than
gemm.py's panels (measured in 14dd70b), but slower where few of a tile's 32 channels are used (16
output channels, ShuffleNet's groups of 34), which keep the panels (algorithms/conv_packed.lanes_apply
weighs the useful lanes of both).

Each k's input is a line of another channel's plane (a stride the hardware prefetchers do not follow),
and in a model the layer before has just written it, often from the other core: the tile prefetches
the input AHEAD k ahead, and its weights WEIGHTS_AHEAD k ahead. A tile's first pixel block reads its
weights from memory (in a model, the layers between two runs evict them): k's weights sit in run k %
STREAMS, so that block reads STREAMS sequential streams at a fraction of the rate each, which the hardware
prefetchers keep ahead of; one stream at the whole rate kept that block waiting on memory. Each group of
STREAMS k's reads one row of every run, so the loop runs over groups with each run's start computed once.

Reductions run k = 0 .. K-1 for every output as in gemm.py's microkernel, so the two kernels give the
same bits.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import gemm, jit, llvm
from .gemm import BIAS, RESIDUAL

CHANNELS = 32  # output channels per tile: two vectors
PIXELS = 14  # output pixels per tile
_LANES = llvm.LANES
# How many k ahead a tile prefetches its input (the first and last pixel of each row at tap k + AHEAD)
# and its weights (two lines per k; a tile's first pixel block streams them from L3 or memory, the later
# blocks find them in L2). Both distances measured best in the CNN runs: the input's among 8, 16 and 32
# (8827030), the weights' among 32 to 256 (c61b12b).
AHEAD = 16
WEIGHTS_AHEAD = 32


STREAMS = 2  # runs of a tile's weights (see above; the sums still run k = 0 .. K-1; 4 measured no faster, 8 slower)
_STREAM_SHIFT = STREAMS.bit_length() - 1  # (k // STREAMS as a shift: STREAMS is a power of two)
assert STREAMS == 1 << _STREAM_SHIFT


def packed_depth(depth: int) -> int:
    """Rows of 32 weights a tile with reduction ``depth`` packs: STREAMS runs of ceil(depth / STREAMS)."""
    return -(-depth // STREAMS) * STREAMS


def pack_weights(w: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """(M, K) weights as (ceil(M / 32), packed_depth(K) * 32) float32 tiles: gemm.pack_weights' tiles of 32 rows
    with the k's in run order, k's 32 weights at row k // STREAMS of run k % STREAMS (the rows past K zero); into
    ``out`` (zeros of that shape, C-contiguous) where given, else a new array that starts on a cache line."""
    m, depth = w.shape
    rows = packed_depth(depth) // STREAMS
    by_run = np.zeros((m, STREAMS * rows), np.float32)
    for stream in range(STREAMS):
        taken = w[:, stream::STREAMS]
        by_run[:, stream * rows:stream * rows + taken.shape[1]] = taken
    return gemm.pack_weights(by_run, CHANNELS, out)


def shape(out_width: int) -> tuple[int, int]:
    """(pixels per row chunk, rows) of a tile for outputs ``out_width`` wide."""
    return (PIXELS // 2, 2) if out_width <= PIXELS // 2 else (PIXELS, 1)


def margin(stride_rows: int, stride_columns: int, padded_width: int) -> int:
    """Floats a tile may read past the padded image when a row or the image is narrower than the tile."""
    return stride_rows * padded_width + PIXELS * stride_columns


def _transposed(builder, rows: list) -> list:
    """The 16 x 16 matrix whose 16 vectors are ``rows``, transposed: four rounds, each swapping the
    off-diagonal blocks of pairs of rows one bit apart (one two-vector shuffle per new row)."""
    for bit in range(4):
        b = 1 << bit
        swapped = list(rows)
        for r in range(_LANES):
            if r & b:
                continue
            low = [c if not c & b else _LANES + (c ^ b) for c in range(_LANES)]
            high = [c ^ b if not c & b else _LANES + c for c in range(_LANES)]
            swapped[r] = builder.shuffle_vector(rows[r], rows[r | b], ir.Constant(llvm.LANE_INDEX, low))
            swapped[r | b] = builder.shuffle_vector(rows[r], rows[r | b], ir.Constant(llvm.LANE_INDEX, high))
        rows = swapped
    return rows


def _emit_tile(builder, stride: int, columns: int, rows: int, pointers: tuple, values: tuple) -> None:
    """The IR of one tile (see _tile_kernel): ``rows`` x ``columns`` pixels, ``stride`` apart in a row."""
    w_ptr, x_ptr, taps_ptr, y_ptr, bias_ptr, res_ptr, bounds_ptr = pointers
    start, row_step, depth, ldy, y_row, count, nrows, channels, flags = values
    module = builder.module
    fma, store, load = llvm.fma(module), llvm.masked_store(module), llvm.masked_load(module)
    vec_ptr, align, zero, lane = llvm.VEC.as_pointer(), llvm.ALIGN, llvm.ZEROS, llvm.LANE_NUMBERS
    pixels = columns * rows

    def const(value):
        return ir.Constant(llvm.I64, value)

    def vector_at(pointer, offset):
        return builder.bitcast(builder.gep(pointer, [offset]), vec_ptr)

    row_offsets = [builder.mul(row_step, const(r)) for r in range(rows)]

    prefetch = llvm.declare(module, "llvm.prefetch.p0",
                            ir.FunctionType(ir.VoidType(), [llvm.BYTE_PTR, llvm.I32, llvm.I32, llvm.I32]))
    last = builder.sub(depth, const(1))
    keep = [ir.Constant(llvm.I32, v) for v in (0, 3, 1)]  # a prefetch's kind: read, keep in all levels, data
    # Groups of STREAMS k's (one row of every run), then a tail of depth % STREAMS k's.
    groups = builder.ashr(depth, const(_STREAM_SHIFT))
    grouped = builder.shl(groups, const(_STREAM_SHIFT))  # the tail's first k
    run = builder.mul(builder.ashr(builder.add(depth, const(STREAMS - 1)), const(_STREAM_SHIFT)),
                      const(CHANNELS))  # a run's weights: packed_depth(depth) / STREAMS rows of 32
    runs = [builder.mul(run, const(r)) for r in range(STREAMS)]

    def step(k, sums, run_start, row):
        """One k, whose weights are row ``row`` of the run at ``run_start``: two weight vectors times each
        pixel's input value."""
        origin = builder.gep(x_ptr, [builder.add(start, builder.load(builder.gep(taps_ptr, [k])))])
        bases = [origin] + [builder.gep(origin, [row_offsets[r]]) for r in range(1, rows)]
        later = builder.add(k, const(AHEAD))  # (the last k's input again near the end)
        later = builder.select(builder.icmp_signed("<", later, depth), later, last)
        ahead = builder.gep(x_ptr, [builder.add(start, builder.load(builder.gep(taps_ptr, [later])))])
        for r in range(rows):
            row_start = ahead if r == 0 else builder.gep(ahead, [row_offsets[r]])
            for q in (0, columns - 1):  # a row's pixels span one or two lines: prefetch both ends
                target = builder.bitcast(builder.gep(row_start, [const(q * stride)]), llvm.BYTE_PTR)
                builder.call(prefetch, [target, *keep])
        at = builder.add(run_start, builder.mul(row, const(CHANNELS)))
        weights = [builder.load(vector_at(w_ptr, builder.add(at, const(h * _LANES))), align=4) for h in range(2)]
        for h in range(2):  # (past a run's last row: the next run's first, or past the tile; a prefetch never faults)
            target = builder.gep(w_ptr, [builder.add(at, const(WEIGHTS_AHEAD // STREAMS * CHANNELS + h * _LANES))])
            builder.call(prefetch, [builder.bitcast(target, llvm.BYTE_PTR), *keep])
        updated = list(sums)
        for p in range(pixels):
            value = builder.load(builder.gep(bases[p // columns], [const(p % columns * stride)]))
            value = llvm.splat(builder, value)
            for h in range(2):
                updated[2 * p + h] = builder.call(fma, [weights[h], value, sums[2 * p + h]])
        return updated

    def group(g, sums):
        first = builder.shl(g, const(_STREAM_SHIFT))
        for r in range(STREAMS):
            sums = step(builder.add(first, const(r)), sums, runs[r], g)
        return sums

    def tail(t, sums):
        return step(builder.add(grouped, t), sums, builder.mul(run, t), groups)

    sums = llvm.counted_loop(builder, groups, [zero] * (2 * pixels), group, "lanes")
    sums = llvm.counted_loop(builder, builder.sub(depth, grouped), sums, tail, "lanes.tail")

    with_bias = builder.icmp_signed("!=", builder.and_(flags, const(BIAS)), const(0))
    with_residual = builder.icmp_signed("!=", builder.and_(flags, const(RESIDUAL)), const(0))
    bounds = [llvm.splat(builder, builder.load(builder.gep(bounds_ptr, [const(i)]))) for i in range(3)]
    columns_left = builder.icmp_signed("<", lane, llvm.splat(builder, builder.trunc(count, llvm.I32), llvm.LANE_INDEX))
    # The lanes of row r of the tile (transposed: pixels r * columns .. along a channel's vector), stored
    # from y_at + r * y_row: a pointer r * columns lanes back so lane r * columns lands there.
    row_lanes = [builder.and_(ir.Constant(llvm.MASK, [r * columns <= q < (r + 1) * columns for q in range(_LANES)]),
                              columns_left if rows == 1 else
                              builder.icmp_signed("<", lane, llvm.splat(builder, builder.trunc(
                                  builder.add(count, const(r * columns)), llvm.I32), llvm.LANE_INDEX)))
                 for r in range(rows)]
    row_shift = [builder.sub(builder.mul(y_row, const(r)), const(r * columns)) for r in range(rows)]
    biased = []  # per half, per pixel: its 16 channels' sums, bias added (adding zero turns -0.0 into +0.0)
    for h in range(2):
        bias = builder.load(vector_at(bias_ptr, const(h * _LANES)), align=4)
        biased.append([builder.select(with_bias, builder.fadd(sums[2 * p + h], bias), sums[2 * p + h])
                       for p in range(pixels)])

    def store_rows(h, by_channel, finish):
        """Store channel c's vector (pixels along its lanes) where its rows go, through ``finish(v, at,
        mask)``; channels past ``channels`` and rows past ``nrows`` are not stored."""
        for c in range(_LANES):
            channel = h * _LANES + c
            inside = builder.icmp_signed("<", const(channel), channels)
            for r in range(rows):
                mask = builder.and_(row_lanes[r], llvm.splat(builder, builder.and_(
                    inside, builder.icmp_signed("<", const(r), nrows)), llvm.MASK))
                at = builder.add(builder.mul(const(channel), ldy), row_shift[r])
                builder.call(store, [finish(by_channel[c], at, mask), vector_at(y_ptr, at), align, mask])

    # Without a residual the activation goes before the transpose (14 vectors instead of 16); with one,
    # after it, once the residual (read at the output's own place) is added.
    plain = builder.append_basic_block("lanes.plain")
    added = builder.append_basic_block("lanes.residual")
    done = builder.append_basic_block("lanes.done")
    builder.cbranch(with_residual, added, plain)
    builder.position_at_end(plain)
    for h in range(2):
        rows_out = [llvm.activated(builder, v, bounds) for v in biased[h]] + [zero] * (_LANES - pixels)
        store_rows(h, _transposed(builder, rows_out), lambda v, at, mask: v)
    builder.branch(done)
    builder.position_at_end(added)

    def with_residual_added(v, at, mask):
        return llvm.activated(builder, builder.fadd(v, builder.call(load, [vector_at(res_ptr, at), align, mask, zero])),
                          bounds)

    for h in range(2):
        store_rows(h, _transposed(builder, biased[h] + [zero] * (_LANES - pixels)), with_residual_added)
    builder.branch(done)
    builder.position_at_end(done)


def _tile_kernel(stride: int, columns: int, rows: int):
    """The intrinsic of one tile of ``rows`` x ``columns`` pixels ``stride`` apart in a row."""

    @intrinsic
    def tile(typingctx, w, x, start, row_step, taps, depth, y, ldy, y_row, count, nrows, channels, bias, residual,
             flags, bounds):
        """y[c*ldy + r*y_row + q] = act(sum_k w[k*32 + c] * x[start + taps[k] + r*row_step + q*stride] + bias[c]
        (+ residual[same place])) for channels c < ``channels``, rows r < ``nrows``, pixels q < ``count``;
        ``flags``: gemm.BIAS adds the bias, gemm.RESIDUAL the residual; ``bounds`` = (low, high, slope).
        ``y`` and ``residual`` start at the tile's first output; ``w``, ``bias`` at its first channel."""
        signature = types.void(w, x, start, row_step, taps, depth, y, ldy, y_row, count, nrows, channels, bias,
                               residual, flags, bounds)

        def codegen(context, builder, sig, args):
            def data(index):
                return context.make_array(sig.args[index])(context, builder, args[index]).data

            _emit_tile(builder, stride, columns, rows, tuple(data(i) for i in (0, 1, 4, 6, 12, 13, 15)),
                       tuple(args[i] for i in (2, 3, 5, 7, 8, 9, 10, 11, 14)))
            return context.get_dummy_value()

        return signature, codegen

    return tile


_row_1, _rows_1 = _tile_kernel(1, PIXELS, 1), _tile_kernel(1, PIXELS // 2, 2)
_row_2, _rows_2 = _tile_kernel(2, PIXELS, 1), _tile_kernel(2, PIXELS // 2, 2)


@jit
def _tile(stride, rows, w, x, start, row_step, taps, depth, y, ldy, y_row, count, nrows, channels, bias, residual,
          flags, bounds):
    """The kernel for this stride (1 or 2) and tile shape. numba calls an intrinsic only by its name, so each
    variant is named here (as gemm.py's _tile); one intrinsic switching between the four bodies in its IR ran
    slower (measured in cfdbe2d)."""
    if stride == 1:
        if rows == 1:
            _row_1(w, x, start, row_step, taps, depth, y, ldy, y_row, count, nrows, channels, bias, residual, flags,
                   bounds)
        else:
            _rows_1(w, x, start, row_step, taps, depth, y, ldy, y_row, count, nrows, channels, bias, residual, flags,
                    bounds)
    elif rows == 1:
        _row_2(w, x, start, row_step, taps, depth, y, ldy, y_row, count, nrows, channels, bias, residual, flags,
               bounds)
    else:
        _rows_2(w, x, start, row_step, taps, depth, y, ldy, y_row, count, nrows, channels, bias, residual, flags,
                bounds)


@jit
def lane_tasks(xp, weights, bias, y, residual, flags, bounds, m_rows, oh, ow, channels, sh, sw, wp, plane, taps,
               tasks):
    """gemm.conv_tasks' work by channel-lane tiles: for each task (image, group, first block, end block,
    first tile, end tile), pixel blocks first .. end (tiles of ``shape``'s pixels, row-major) x channel tiles (32
    output channels) of that image and group. xp: the padded input (N, G * channels * plane, plus a
    margin where ``margin`` says), weights (G, tiles, K * 32) (gemm.pack_weights for 32 rows), bias
    (G, tiles * 32), y and residual (N, M * oh * ow); ``taps`` as gemm.tap_offsets."""
    depth = taps.shape[0]
    group_in = channels * plane
    group_out = m_rows * oh * ow
    columns = PIXELS // 2 if ow <= PIXELS // 2 else PIXELS
    rows = PIXELS // columns
    chunks = -(-ow // columns)
    for t in range(tasks.shape[0]):
        n, g, first, end = tasks[t, 0], tasks[t, 1], tasks[t, 2], tasks[t, 3]
        tile_first, tile_end = tasks[t, 4], tasks[t, 5]
        image = xp[n, g * group_in:]
        out = y[n, g * group_out:(g + 1) * group_out]
        res = residual[n, g * group_out:(g + 1) * group_out] if flags & RESIDUAL else residual[0, :0]
        # Each tile's weights are read once for all the blocks (a tile's outputs: 32 streams of stores);
        # but where the input would not stay in the L2 cache from tile to tile and the task's weights
        # would, each pixel block reads its inputs once for all the tiles.
        blocks_outer = group_in * 4 > _INPUT_BYTES and (tile_end - tile_first) * depth * CHANNELS * 4 <= _WEIGHT_BYTES
        outer_end, inner_end = (end, tile_end) if blocks_outer else (tile_end, end)
        for i in range(first if blocks_outer else tile_first, outer_end):
            for j in range(tile_first if blocks_outer else first, inner_end):
                block, tile = (i, j) if blocks_outer else (j, i)
                c0 = tile * CHANNELS
                row_block, chunk = block // chunks, block % chunks
                # The last chunk of a row (and the last rows) shifted back to end at the output's edge.
                x0 = min(chunk * columns, max(0, ow - columns))
                r0 = min(row_block * rows, max(0, oh - rows))
                at = c0 * oh * ow + r0 * ow + x0
                _tile(sw, rows, weights[g, tile], image, r0 * sh * wp + x0 * sw, sh * wp, taps, depth, out[at:],
                      oh * ow, ow, min(columns, ow - x0), min(rows, oh - r0), min(CHANNELS, m_rows - c0),
                      bias[g, c0:], res[at:] if flags & RESIDUAL else res, flags, bounds)


# Inputs beyond which, and weights of a task's tiles up to which, its pixel blocks run outermost (see
# lane_tasks): half the L2 cache of this host's cores (2 MiB), so each block's inputs are read once for all
# tiles (measured in 1fbf085); tiles outermost stay best for smaller inputs.
_INPUT_BYTES = _WEIGHT_BYTES = 1 << 20
