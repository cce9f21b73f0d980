"""A direct 2-D float32 convolution for small convolutions (the light CNNs' layers: tens of thousands to a
few million multiply-adds), in one compiled call with its bias, residual and activation, on any x86-64
host with AVX2 (the vectors are 8 floats; gemm.py's packed convolution needs AVX-512).

At these sizes the im2col buffer, a BLAS call and a separate epilogue pass each cost about as much as the
arithmetic. Here, as in onnxruntime's NCHWc kernels, output channels run across the lanes: a tile is
16 output channels (two vectors) x PIXELS output pixels of one output row, the accumulators held in registers
over the whole reduction. For each k = (input channel, tap) the tile loads its two weight vectors (the
weights packed once as (G, tiles, K, 16), pack_weights) and broadcasts each pixel's input value, read
from a zero-padded copy of the image at the tap's offset (pixel p at p * stride from the first, so
strided windows need no gather), 12 fused multiply-adds. The sums go to a small buffer, from which they
are finished (bias, residual, activation: the epilogue's order) as they are stored; pixels past the
row's end and channels past the group's are computed and dropped.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import host, jit, llvm
from .aligned import aligned_copy

LANES = 8  # float32 lanes of an AVX2 register
CHANNELS = 2 * LANES  # output channels per tile
# Output pixels per tile: 6 on AVX2 (12 accumulators, 2 weight vectors and a broadcast fill its 16 registers); 8
# where AVX-512's 32 registers hold 16 accumulators, so each channel's row of the 8 x 8 transpose is one whole
# store instead of a split one and no transposed row is padding.
PIXELS = 8 if host.AVX512 else 6
_VEC = ir.VectorType(llvm.F32, LANES)
_INDEX = ir.VectorType(llvm.I32, LANES)
_MASK = ir.VectorType(ir.IntType(1), LANES)
_NUMBERS = ir.Constant(_INDEX, list(range(LANES)))
_ALIGN = ir.Constant(llvm.I32, 4)
_ZEROS = ir.Constant(_VEC, [0.0] * LANES)
_ONES = ir.Constant(_VEC, [1.0] * LANES)
_SIXTH = ir.Constant(_VEC, [float(np.float32(1 / 6))] * LANES)
_HALF = ir.Constant(_VEC, [0.5] * LANES)
BIAS, RESIDUAL, HARD_SWISH = 1, 2, 4  # conv_direct's flags
# conv_tile's flag for a channel-blocked output (directconv_blocked.py): each pixel's 16 channels stored as they sit
# in the accumulators, untransposed
BLOCKED_OUT = 8


def pack_weights(w: np.ndarray, group: int) -> np.ndarray:
    """w (M, Cg, *kernel) as float32 (G, tiles, Cg*K, CHANNELS), zeros past each group's Mg channels:
    each k's 16 output channels of a tile contiguous, two vectors."""
    m = w.shape[0]
    mg = m // group
    flat = w.astype(np.float32, copy=False).reshape(group, mg, -1)
    tiles = -(-mg // CHANNELS)
    packed = np.zeros((group, tiles * CHANNELS, flat.shape[2]), dtype=np.float32)
    packed[:, :mg] = flat
    return aligned_copy(packed.reshape(group, tiles, CHANNELS, -1).transpose(0, 1, 3, 2))


def pack_bias(b, group: int, tiles: int) -> np.ndarray:
    """The bias (M,) or None as float32 (G, tiles * CHANNELS), zeros past each group's channels."""
    packed = np.zeros((group, tiles * CHANNELS), dtype=np.float32)
    if b is not None:
        mg = b.shape[0] // group
        packed[:, :mg] = b.reshape(group, mg)
    return packed


def tap_offsets(channels: int, kh: int, kw: int, dh: int, dw: int, padded_width: int, plane: int) -> np.ndarray:
    """Each k = (channel, tap)'s offset in the padded image from its window's first cell, weight order."""
    c, i, j = np.meshgrid(np.arange(channels), np.arange(kh), np.arange(kw), indexing="ij")
    return (c * plane + i * dh * padded_width + j * dw).reshape(-1).astype(np.int64)


def _transposed(builder, rows: list) -> list:
    """The 8 x 8 matrix whose 8 vectors are ``rows``, transposed: three rounds, each swapping the
    off-diagonal blocks of pairs of rows one bit apart (one two-vector shuffle per new row)."""
    for bit in range(3):
        b = 1 << bit
        swapped = list(rows)
        for r in range(LANES):
            if r & b:
                continue
            low = [c if not c & b else LANES + (c ^ b) for c in range(LANES)]
            high = [c ^ b if not c & b else LANES + c for c in range(LANES)]
            swapped[r] = builder.shuffle_vector(rows[r], rows[r | b], ir.Constant(_INDEX, low))
            swapped[r | b] = builder.shuffle_vector(rows[r], rows[r | b], ir.Constant(_INDEX, high))
        rows = swapped
    return rows


def activated_8(builder, v, bounds):
    """epilogue.activate on 8 lanes (as llvm.activated on 16): v*slope below zero, then max with low, then
    min with high; comparisons with NaN are false, so NaN passes through."""
    low, high, slope = bounds
    v = builder.select(builder.fcmp_ordered("<", v, _ZEROS), builder.fmul(v, slope), v)
    v = builder.select(builder.fcmp_ordered("<", v, low), low, v)
    return builder.select(builder.fcmp_ordered(">", v, high), high, v)


def int_const(value):
    return ir.Constant(llvm.I64, value)


def splat_8(builder, value, vector_type=_VEC):
    undef = ir.Constant(vector_type, ir.Undefined)
    first = builder.insert_element(undef, value, ir.Constant(llvm.I32, 0))
    return builder.shuffle_vector(first, undef, ir.Constant(_INDEX, [0] * LANES))


def vector_at(builder, pointer, offset, vector_type=_VEC):
    return builder.bitcast(builder.gep(pointer, [offset]), vector_type.as_pointer())


def channel_sums(builder, w_ptr, depth, pixel_values, name: str) -> list:
    """A tile's sums over k < ``depth`` of w[k*16 + c] * x_p(k) for its 16 channels c and PIXELS pixels p, where
    ``pixel_values(k)`` loads the PIXELS floats x_p(k): per pixel, two vectors of 8 channels (sums[2p],
    sums[2p + 1]). Where the host has AVX-512 each pixel's 16 channels are one vector (its two 512-bit fused
    multiply-adds a cycle do twice the 8-lane ones' work); each lane's fused multiply-adds are the same, in the
    same order, either way."""
    width = CHANNELS if host.AVX512 else LANES
    vector = ir.VectorType(llvm.F32, width)
    fma = llvm.declare(builder.module, f"llvm.fma.v{width}f32", ir.FunctionType(vector, [vector] * 3))
    halves = CHANNELS // width

    def step(k, sums):
        first = builder.mul(k, int_const(CHANNELS))
        weights = [builder.load(vector_at(builder, w_ptr, builder.add(first, int_const(h * width)), vector), align=4)
                   for h in range(halves)]
        updated = list(sums)
        for p, scalar in enumerate(pixel_values(k)):
            value = llvm.splat(builder, scalar, vector)
            for h in range(halves):
                updated[halves * p + h] = builder.call(fma, [weights[h], value, sums[halves * p + h]])
        return updated

    sums = llvm.counted_loop(builder, depth, [ir.Constant(vector, [0.0] * width)] * (halves * PIXELS), step, name)
    if halves == 2:
        return sums
    undef = ir.Constant(vector, ir.Undefined)
    return [builder.shuffle_vector(v, undef, ir.Constant(_INDEX, list(range(h * LANES, (h + 1) * LANES))))
            for v in sums for h in range(2)]


def _emit_sums(builder, w_ptr, x_ptr, taps_ptr, start, depth, stride) -> list:
    """The tile's sums over k (channel_sums), pixel p's input at p * ``stride`` from the tap's."""

    def pixel_values(k):
        origin = builder.add(start, builder.load(builder.gep(taps_ptr, [k])))
        return [builder.load(builder.gep(x_ptr, [builder.add(origin, builder.mul(stride, int_const(p)))]))
                for p in range(PIXELS)]

    return channel_sums(builder, w_ptr, depth, pixel_values, "direct")


def _row_io(builder, full: bool, lanes):
    """(load(pointer), store(value, pointer)) of a channel's row of pixels: PIXELS lanes by plain accesses
    (one vector for 8, 4 + 2 for 6) where the tile is full, else masked by ``lanes`` (AMD's masked stores are
    slow)."""
    if not full:
        module = builder.module
        masked_store = llvm.declare(module, "llvm.masked.store.v8f32.p0",
                                    ir.FunctionType(ir.VoidType(), [_VEC, _VEC.as_pointer(), llvm.I32, _MASK]))
        masked_load = llvm.declare(module, "llvm.masked.load.v8f32.p0",
                                   ir.FunctionType(_VEC, [_VEC.as_pointer(), llvm.I32, _MASK, _VEC]))
        return (lambda pointer: builder.call(masked_load, [vector_at(builder, pointer, int_const(0)), _ALIGN, lanes,
                                                           _ZEROS]),
                lambda v, pointer: builder.call(masked_store, [v, vector_at(builder, pointer, int_const(0)), _ALIGN,
                                                               lanes]))
    if PIXELS == LANES:
        return (lambda pointer: builder.load(vector_at(builder, pointer, int_const(0)), align=4),
                lambda v, pointer: builder.store(v, vector_at(builder, pointer, int_const(0)), align=4))
    quad, pair = ir.VectorType(llvm.F32, 4), ir.VectorType(llvm.F32, 2)

    def load(pointer):
        low = builder.load(vector_at(builder, pointer, int_const(0), quad), align=4)
        high = builder.load(vector_at(builder, pointer, int_const(4), pair), align=4)
        high = builder.shuffle_vector(high, ir.Constant(pair, ir.Undefined), ir.Constant(
            ir.VectorType(llvm.I32, 4), [0, 1, 0, 1]))
        return builder.shuffle_vector(low, high, ir.Constant(_INDEX, [0, 1, 2, 3, 4, 5, 4, 5]))

    def store(v, pointer):
        undef = ir.Constant(_VEC, ir.Undefined)
        low = builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(llvm.I32, 4), [0, 1, 2, 3]))
        high = builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(llvm.I32, 2), [4, 5]))
        builder.store(low, vector_at(builder, pointer, int_const(0), quad), align=4)
        builder.store(high, vector_at(builder, pointer, int_const(4), pair), align=4)

    return load, store


def _emit_stores(builder, rows: list, residual: bool, bounds, hard, row_io, y_ptr, res_ptr, at, plane,
                 channels) -> None:
    """Store the 16 channel rows ``rows`` (pixels along the lanes) from y[at], ``plane`` apart: channels
    below ``channels`` only, with the residual added and the activation (then HardSwish where ``hard``)
    applied where ``residual``."""
    load, store = row_io
    for c, v in enumerate(rows):
        with builder.if_then(builder.icmp_signed("<", int_const(c), channels)):
            row = builder.add(at, builder.mul(int_const(c), plane))
            if residual:
                v = hard_swished_8(builder, activated_8(builder, builder.fadd(v, load(builder.gep(res_ptr, [row]))),
                                                      bounds), hard)
            store(v, builder.gep(y_ptr, [row]))


def hard_swished_8(builder, v, on):
    """v * min(max(v * (1/6) + 1/2, 0), 1) where ``on`` (an i1), else v: the HardSwish kernel's float32
    operations in its order (separate multiply and add: no fused rounding)."""
    gate = builder.fadd(builder.fmul(v, _SIXTH), _HALF)
    gate = builder.select(builder.fcmp_ordered("<", gate, _ZEROS), _ZEROS, gate)
    gate = builder.select(builder.fcmp_ordered(">", gate, _ONES), _ONES, gate)
    return builder.select(on, builder.fmul(v, gate), v)


def _emit_tile(builder, pointers: tuple, values: tuple) -> None:
    """The IR of one tile (see conv_tile): its 12 sums over k, then per channel vector the bias and, without a
    residual, the activation; transposed (8 x 8: pixels along a channel's lanes) and stored to each
    channel's row of the output, where a residual is added and the activation applied."""
    w_ptr, x_ptr, taps_ptr, y_ptr, bias_ptr, res_ptr, bounds_ptr = pointers
    start, depth, stride, at, plane, pixels, channels, flags = values
    sums = _emit_sums(builder, w_ptr, x_ptr, taps_ptr, start, depth, stride)
    with_bias = builder.icmp_signed("!=", builder.and_(flags, int_const(BIAS)), int_const(0))
    with_residual = builder.icmp_signed("!=", builder.and_(flags, int_const(RESIDUAL)), int_const(0))
    hard = builder.icmp_signed("!=", builder.and_(flags, int_const(HARD_SWISH)), int_const(0))
    bounds = [splat_8(builder, builder.load(builder.gep(bounds_ptr, [int_const(i)]))) for i in range(3)]
    lanes = builder.icmp_signed("<", _NUMBERS, splat_8(builder, builder.trunc(pixels, llvm.I32), _INDEX))
    biased = []  # per half, per pixel: its 8 channels' sums, bias added (adding zero turns -0.0 into +0.0)
    for h in range(2):
        bias = builder.load(vector_at(builder, bias_ptr, int_const(h * LANES)), align=4)
        biased.append([builder.select(with_bias, builder.fadd(sums[2 * p + h], bias), sums[2 * p + h])
                       for p in range(PIXELS)])
    blocked = builder.icmp_signed("!=", builder.and_(flags, int_const(BLOCKED_OUT)), int_const(0))
    with builder.if_else(blocked) as (block, plain):
        with block:
            _emit_blocked_stores(builder, biased, with_residual, bounds, hard, y_ptr, res_ptr, at, pixels)
        with plain:
            _emit_plain_stores(builder, biased, with_residual, bounds, hard, y_ptr, res_ptr, at, plane, pixels,
                               channels, lanes)


def _emit_blocked_stores(builder, biased, with_residual, bounds, hard, y_ptr, res_ptr, at, pixels) -> None:
    """Pixel p's 16 channels to y[at + 16 p ..], the residual read at the same place: the blocked layout's
    order is the accumulators' own (every lane stored: a blocked buffer holds whole tiles of channels)."""
    for residual in (False, True):
        with builder.if_then(builder.icmp_signed("==", with_residual, ir.Constant(ir.IntType(1), residual))):
            for p in range(PIXELS):
                with builder.if_then(builder.icmp_signed("<", int_const(p), pixels)):
                    for h in range(2):
                        place = builder.add(at, int_const(p * CHANNELS + h * LANES))
                        v = biased[h][p]
                        if residual:
                            v = builder.fadd(v, builder.load(vector_at(builder, res_ptr, place), align=4))
                        v = hard_swished_8(builder, activated_8(builder, v, bounds), hard)
                        builder.store(v, vector_at(builder, y_ptr, place), align=4)


def _emit_plain_stores(builder, biased, with_residual, bounds, hard, y_ptr, res_ptr, at, plane, pixels, channels,
                       lanes) -> None:
    """The tile's sums (bias added) to each channel's row of pixels, ``plane`` apart."""
    full = builder.icmp_signed("==", pixels, int_const(PIXELS))
    # Without a residual the activation goes before the transpose (6 vectors instead of 8); with one,
    # after it, once the residual (read at the output's own place) is added.
    for residual in (False, True):
        with builder.if_then(builder.icmp_signed("==", with_residual, ir.Constant(ir.IntType(1), residual))):
            rows = []
            for h in range(2):
                vectors = biased[h] if residual else [hard_swished_8(builder, activated_8(builder, v, bounds), hard)
                                                      for v in biased[h]]
                rows += _transposed(builder, vectors + [_ZEROS] * (LANES - PIXELS))
            with builder.if_else(full) as (whole, part):
                with whole:
                    _emit_stores(builder, rows, residual, bounds, hard, _row_io(builder, True, lanes), y_ptr,
                                 res_ptr, at, plane, channels)
                with part:
                    _emit_stores(builder, rows, residual, bounds, hard, _row_io(builder, False, lanes), y_ptr,
                                 res_ptr, at, plane, channels)


@intrinsic
def conv_tile(typingctx, w, x, start, taps, depth, stride, y, at, plane, pixels, channels, bias, residual, flags,
          bounds):
    """y[at + c*plane + p] = act(sum_k w[k*16 + c] * x[start + taps[k] + p*stride] + bias[c] (+ residual[same
    place])) for pixels p < ``pixels`` (at most PIXELS), channels c < ``channels`` (at most 16); ``flags``: BIAS
    adds the bias, RESIDUAL the residual; ``bounds`` = (low, high, slope). ``w`` and ``bias`` (16 floats)
    start at the tile's first channel; ``y`` and ``residual`` are flat."""
    signature = types.void(w, x, start, taps, depth, stride, y, at, plane, pixels, channels, bias, residual, flags,
                           bounds)

    def codegen(context, builder, sig, args):
        def data(index):
            return context.make_array(sig.args[index])(context, builder, args[index]).data

        _emit_tile(builder, tuple(data(i) for i in (0, 1, 3, 6, 11, 12, 14)),
                   tuple(args[i] for i in (2, 4, 5, 7, 8, 9, 10, 13)))
        return context.get_dummy_value()

    return signature, codegen


@jit
def _fill(x, n, first, channels, source, top, left, padded_height, padded_width):
    """Copy x's channels first .. first + channels of image n into the padded planes of ``source``
    (its pads and margin stay zero): the part of the image that the windows reach."""
    height, width = x.shape[2], x.shape[3]
    rows, columns = min(height, padded_height - top), min(width, padded_width - left)
    plane = padded_height * padded_width
    image = x[n].reshape(-1)
    for c in range(channels):
        for r in range(rows):
            at = c * plane + (r + top) * padded_width + left
            start = ((first + c) * height + r) * width
            source[at:at + columns] = image[start:start + columns]


@jit
def conv_direct(x, weights, offsets, bias, residual, bounds, flags, y, sh, sw, top, left, padded_height,
                padded_width, in_place):
    """y (N, M, OH, OW) = the convolution of float32 x (N, C, H, W) by ``weights`` (pack_weights) over the
    padded image (``padded_height`` x ``padded_width``, x at ``top``/``left``, zeros elsewhere) with window
    cells at ``offsets`` (tap_offsets), then + ``bias`` (pack_bias) where ``flags`` has BIAS, + ``residual``
    (y's elements, flat) where it has RESIDUAL, and the activation ``bounds`` (epilogue.activation_bounds).

    ``in_place``: the windows read x itself (no pads, the padded shape x's, OW >= 6, x C-contiguous); else a
    padded copy with a margin for the pixels that a row's last tile computes past its end. A row's last
    tile is shifted back to end at the row's end where the row has PIXELS pixels (recomputing some before it)."""
    groups, channels = weights.shape[0], x.shape[1] // weights.shape[0]
    plane = padded_height * padded_width
    source = np.zeros(0 if in_place else channels * plane + PIXELS * sw, dtype=np.float32)
    units = y.shape[2] * -(-y.shape[3] // PIXELS)
    for n in range(x.shape[0]):
        for g in range(groups):
            if in_place:
                image = x[n].reshape(-1)[g * channels * plane:]
            else:
                _fill(x, n, g * channels, channels, source, top, left, padded_height, padded_width)
                image = source
            conv_direct_span(image, weights, offsets, bias, residual, bounds, flags, y, n, g, sh, sw, padded_width,
                             0, units)


@jit
def conv_direct_span(image, weights, offsets, bias, residual, bounds, flags, y, n, g, sh, sw, padded_width, first,
                     end):
    """conv_direct's outputs of image ``n`` and group ``g`` from the flat padded ``image`` (the group's input
    planes, as conv_direct reads them), for the row chunks ``first`` .. ``end`` (chunk u: output row u // chunks,
    its pixels from (u % chunks) * PIXELS, chunks = ceil(OW / PIXELS)), every channel tile: a range of one image's
    outputs that other threads' ranges leave apart (jobs.DIRECT_ROWS; a row's shifted-back last chunk recomputes
    pixels of the chunk before it, the same values)."""
    tiles, depth = weights.shape[1], weights.shape[2]
    outputs = y.shape[1] // weights.shape[0]
    oh, ow = y.shape[2], y.shape[3]
    chunks = -(-ow // PIXELS)
    flat_y = y.reshape(-1)
    pixels = min(PIXELS, ow)
    for t in range(tiles):
        w = weights[g, t].reshape(-1)
        channel = g * outputs + t * CHANNELS
        count = min(CHANNELS, outputs - t * CHANNELS)
        tile_bias = bias[g, t * CHANNELS:]
        for u in range(first, end):
            oy = u // chunks
            ox = min((u % chunks) * PIXELS, ow - pixels)
            at = ((n * y.shape[1] + channel) * oh + oy) * ow + ox
            conv_tile(w, image, oy * sh * padded_width + ox * sw, offsets, depth, sw, flat_y, at, oh * ow, pixels,
                      count, tile_bias, residual, flags, bounds)
