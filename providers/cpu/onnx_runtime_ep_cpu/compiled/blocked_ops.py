"""The steps around direct convolutions over channel-blocked values (algorithms/segment_layout.py): depthwise
convolutions, squeeze-excitation blocks, plane means, max and average pools reading (N, ceil(C / 16), H, W, 16) as
directconv_blocked.py stores it, so a light CNN's block stays blocked from its expansion to its projection.

In the blocked layout a pixel's 16 channels are contiguous, so each loop's innermost loop runs over those 16
lanes: one vector, where the plain layout's depthwise and pooling loops walk planes channel by channel. Lanes
past C in the last block hold values nothing reads (directconv_blocked's taps cover the real channels); these
loops compute them too, from zero weights, and never let them into a real channel's value.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import jit, llvm
from .aligned import aligned_copy
from .directconv import CHANNELS
from .segment_loops import squeeze_products, squeeze_scale


def pack_depthwise(w: np.ndarray, b, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """A depthwise weight (C, 1, kh, kw) and bias (C,) or None as flat float32 (blocks, kh * kw, 16) and
    (blocks * 16,), zeros past C."""
    blocks = -(-channels // CHANNELS)
    taps = int(np.prod(w.shape[2:]))
    packed = np.zeros((blocks * CHANNELS, taps), np.float32)
    packed[:channels] = w.reshape(channels, taps)
    bias = np.zeros(blocks * CHANNELS, np.float32)
    if b is not None:
        bias[:channels] = b
    return aligned_copy(packed.reshape(blocks, CHANNELS, taps).transpose(0, 2, 1)).reshape(-1), bias


PIXELS = 4  # output pixels per depthwise tile: 4 accumulators of 16 lanes


def padded_size(height, width, oh, ow, sh, sw, top, left, kh, kw, dh, dw) -> tuple[int, int, int]:
    """(rows, columns, floats) of depthwise_blocked's zero-padded block: every row and column a window reads,
    and a tile's reach past a narrow row's end; no floats where the tiles read the value in place (no padding
    read, rows of a tile or more: the copy of a large unpadded map costs more than a pool's arithmetic)."""
    rows = max(top + height, (oh - 1) * sh + (kh - 1) * dh + 1)
    columns = max(left + width, (ow - 1) * sw + (kw - 1) * dw + 1)
    if top == left == 0 and (rows, columns) == (height, width) and ow >= PIXELS:
        return rows, columns, 0
    return rows, columns, (rows * columns + PIXELS * sw) * CHANNELS


def _vector(builder, pointer, offset):
    return builder.bitcast(builder.gep(pointer, [offset]), llvm.VEC.as_pointer())


def depthwise_tile_of(pixels: int):
    """The depthwise tile of ``pixels`` pixels (one accumulator each): ``depthwise_tile(w, x, start, taps, depth,
    stride, bias, bounds, hard_swish, y, at)``."""

    @intrinsic
    def depthwise_tile(typingctx, w, x, start, taps, depth, stride, bias, bounds, hard_swish, y, at):
        """y[at + p * 16 + l] = finish(sum_t w[t * 16 + l] * x[start + taps[t] + p * stride + l] + bias[l]) for
        the tile's pixels p and 16 lanes l: ``bounds``' activation, then HardSwish where ``hard_swish`` (the
        plain loops' float32 operations, each rounded)."""
        signature = types.void(w, x, start, taps, depth, stride, bias, bounds, hard_swish, y, at)

        def codegen(context, builder, sig, args):
            def data(index):
                return context.make_array(sig.args[index])(context, builder, args[index]).data

            w_ptr, x_ptr, taps_ptr, bias_ptr, bounds_ptr, y_ptr = (data(i) for i in (0, 1, 3, 6, 7, 9))
            begin, depth, step_x, flag, out = args[2], args[4], args[5], args[8], args[10]
            fma = llvm.fma(builder.module)

            def step(k, sums):
                origin = builder.add(begin, builder.load(builder.gep(taps_ptr, [k])))
                weights = builder.load(_vector(builder, w_ptr, builder.mul(k, ir.Constant(llvm.I64, CHANNELS))),
                                       align=4)
                return [builder.call(fma, [weights, builder.load(_vector(builder, x_ptr, builder.add(
                    origin, builder.mul(step_x, ir.Constant(llvm.I64, p)))), align=4), sums[p]])
                    for p in range(pixels)]

            sums = llvm.counted_loop(builder, depth, [llvm.ZEROS] * pixels, step, "depthwise_blocked")
            shift = builder.load(_vector(builder, bias_ptr, ir.Constant(llvm.I64, 0)), align=4)
            bounds = [llvm.splat(builder, builder.load(builder.gep(bounds_ptr, [ir.Constant(llvm.I64, i)])))
                      for i in range(3)]
            swish = builder.icmp_signed("!=", flag, ir.Constant(flag.type, 0))
            sixth, half = (llvm.splat(builder, ir.Constant(llvm.F32, float(v))) for v in (np.float32(1 / 6), 0.5))
            ones = llvm.splat(builder, ir.Constant(llvm.F32, 1.0))
            for p, total in enumerate(sums):
                v = llvm.activated(builder, builder.fadd(total, shift), bounds)
                gate = builder.fadd(builder.fmul(v, sixth), half)
                gate = builder.select(builder.fcmp_ordered("<", gate, llvm.ZEROS), llvm.ZEROS, gate)
                gate = builder.select(builder.fcmp_ordered(">", gate, ones), ones, gate)
                v = builder.select(swish, builder.fmul(v, gate), v)
                builder.store(v, _vector(builder, y_ptr, builder.add(out, ir.Constant(llvm.I64, p * CHANNELS))),
                              align=4)
            return context.get_dummy_value()

        return signature, codegen

    return depthwise_tile


depthwise_tile = depthwise_tile_of(PIXELS)


@jit
def _fill(x, base, height, row_floats, source, top, left, padded_width):
    """The block's rows from flat ``x`` at ``base`` into ``source`` at (``top``, ``left``) (an element loop:
    numba's slice assignment checks for overlap and copies through a temporary)."""
    for r in range(height):
        at = np.uint64(((r + top) * padded_width + left) * CHANNELS)
        start = np.uint64(base + r * row_floats)
        for k in range(np.uint64(row_floats)):
            source[at + k] = x[start + k]


@jit
def depthwise_blocked(x, weights, offsets, bias, bounds, hard_swish, y, images, blocks, height, width, oh, ow, sh,
                      sw, top, left, source, padded_height, padded_width, tile):
    """A depthwise convolution (one output per channel) over the blocked flat ``x`` (images x blocks x height x
    width x 16) into the blocked flat ``y`` (images x blocks x oh x ow x 16): each block copied into the zero
    borders of ``source`` (padded_size; its borders are never written), then tiles of PIXELS pixels of a row,
    each tap one vector load and multiply-add per pixel (taps in weight order, as the plain loops), finished
    with the bias, the activation (``bounds``: epilogue.activation_bounds) and HardSwish where ``hard_swish``
    (0 or 1). ``weights``/``bias``: pack_depthwise; ``offsets``: each tap's floats from its window's first
    pixel in ``source``; ``tile``: PIXELS * 16 scratch for rows narrower than a tile."""
    depth = offsets.shape[0]
    pixels = min(PIXELS, ow)
    row_floats = width * CHANNELS
    in_place = top == 0 and left == 0 and padded_height == height and padded_width == width and ow >= PIXELS
    for n in range(images):
        for b in range(blocks):
            base = (n * blocks + b) * height * row_floats
            if in_place:
                image, offset = x, base
            else:
                _fill(x, base, height, row_floats, source, top, left, padded_width)
                image, offset = source, 0
            w = weights[b * depth * CHANNELS:]
            shift = bias[b * CHANNELS:]
            target = (n * blocks + b) * oh * ow * CHANNELS
            for oy in range(oh):
                for ox in range(0, ow, PIXELS):
                    ox = min(ox, ow - pixels)
                    begin = offset + (oy * sh * padded_width + ox * sw) * CHANNELS
                    out = target + (oy * ow + ox) * CHANNELS
                    if pixels == PIXELS:
                        depthwise_tile(w, image, begin, offsets, depth, sw * CHANNELS, shift, bounds, hard_swish,
                                        y, out)
                    else:
                        depthwise_tile(w, image, begin, offsets, depth, sw * CHANNELS, shift, bounds, hard_swish,
                                        tile, 0)
                        y[out:out + pixels * CHANNELS] = tile[:pixels * CHANNELS]


def depthwise_taps(kh: int, kw: int, dh: int, dw: int, padded_width: int) -> np.ndarray:
    """Each tap's offset (floats) in depthwise_blocked's padded block from its window's first pixel."""
    i, j = np.meshgrid(np.arange(kh), np.arange(kw), indexing="ij")
    return ((i * dh * padded_width + j * dw) * CHANNELS).reshape(-1).astype(np.int64)


@intrinsic
def _block_sums(typingctx, x, start, pixels, sums, at):
    """sums[at + l] = the sum of x[start + p * 16 + l] over the pixels p, in order from 0, for the 16 lanes l in one
    vector (numba leaves the lane loop scalar: its SLP vectorizer is off)."""
    signature = types.void(x, start, pixels, sums, at)

    def codegen(context, builder, sig, args):
        x_ptr, sums_ptr = (context.make_array(sig.args[i])(context, builder, args[i]).data for i in (0, 3))
        begin, count, out = args[1], args[2], args[4]

        def step(p, values):
            offset = builder.add(begin, builder.mul(p, ir.Constant(llvm.I64, CHANNELS)))
            return [builder.fadd(values[0], builder.load(_vector(builder, x_ptr, offset), align=4))]

        (total,) = llvm.counted_loop(builder, count, [llvm.ZEROS], step, "block_sums")
        builder.store(total, _vector(builder, sums_ptr, out), align=4)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _block_scaled(typingctx, x, start, pixels, scale, at, y):
    """y[start + p * 16 + l] = x[start + p * 16 + l] * scale[at + l] over the pixels p, 16 lanes l a vector."""
    signature = types.void(x, start, pixels, scale, at, y)

    def codegen(context, builder, sig, args):
        x_ptr, scale_ptr, y_ptr = (context.make_array(sig.args[i])(context, builder, args[i]).data for i in (0, 3, 5))
        begin, count = args[1], args[2]
        factors = builder.load(_vector(builder, scale_ptr, args[4]), align=4)

        def step(p, values):
            offset = builder.add(begin, builder.mul(p, ir.Constant(llvm.I64, CHANNELS)))
            product = builder.fmul(builder.load(_vector(builder, x_ptr, offset), align=4), factors)
            builder.store(product, _vector(builder, y_ptr, offset), align=4)
            return []

        llvm.counted_loop(builder, count, [], step, "block_scaled")
        return context.get_dummy_value()

    return signature, codegen


@jit
def _lane_sums(x, n, blocks, pixels, sums):
    """sums[b * 16 + l] = the sum over the pixels of image ``n``'s block b, lane l, pixel by pixel."""
    for b in range(blocks):
        _block_sums(x, (n * blocks + b) * pixels * CHANNELS, pixels, sums, b * CHANNELS)


@jit
def _scaled(x, n, blocks, pixels, scale, y):
    """y = x * scale[channel] over image ``n``'s blocks."""
    for b in range(blocks):
        _block_scaled(x, (n * blocks + b) * pixels * CHANNELS, pixels, scale, b * CHANNELS, y)


@jit
def squeeze_excite_blocked(x, w1, b1, bounds1, swish, w2, b2, bounds2, gate, alpha, beta, y, images, channels,
                           pixels, pooled, hidden, scale):
    """segment_loops.squeeze_excite over the blocked flat ``x`` and ``y`` (images x blocks x pixels x 16): the
    plane means summed pixel by pixel over the block's 16 lanes at once (the plain loop's order for each
    channel), the two 1x1 convolutions and the gate on the ``channels`` real channels (one image by
    segment_loops.squeeze_scale, more all at once by squeeze_products), the product on all 16 lanes (``scale``
    zero past the channels). ``pooled`` and ``scale``: blocks * 16, ``hidden``: R."""
    blocks = (channels + CHANNELS - 1) // CHANNELS
    divisor = np.float32(pixels)
    for k in range(scale.size):
        scale[k] = 0
    if images == 1:
        _lane_sums(x, 0, blocks, pixels, pooled)
        for c in range(channels):
            pooled[c] = pooled[c] / divisor
        squeeze_scale(pooled, w1, b1, bounds1, swish, w2, b2, bounds2, gate, alpha, beta, hidden, scale)
        _scaled(x, 0, blocks, pixels, scale, y)
        return
    means = np.empty((channels, images), dtype=np.float32)
    for n in range(images):
        _lane_sums(x, n, blocks, pixels, pooled)
        for c in range(channels):
            means[c, n] = pooled[c] / divisor
    gates = np.empty((channels, images), dtype=np.float32)
    squeeze_products(means, w1, b1, bounds1, swish, w2, b2, bounds2, gate, alpha, beta, gates)
    for n in range(images):
        for c in range(channels):
            scale[c] = gates[c, n]
        _scaled(x, n, blocks, pixels, scale, y)


@jit
def plane_means_blocked(x, y, images, channels, pixels, sums):
    """y (images, channels) = the mean of each channel's plane of the blocked flat ``x`` (images x blocks x
    pixels x 16), in pooling.plane_means's order (eight running sums, paired, then the remainder) on 16 lanes
    at once; ``sums``: 8 * 16 scratch."""
    blocks = (channels + CHANNELS - 1) // CHANNELS
    whole = pixels // 8 * 8
    for n in range(images):
        for b in range(blocks):
            base = (n * blocks + b) * pixels * CHANNELS
            for k in range(sums.size):
                sums[k] = 0
            for p in range(whole):
                at = base + p * CHANNELS
                part = (p % 8) * CHANNELS
                for lane in range(CHANNELS):
                    sums[part + lane] += x[at + lane]
            for lane in range(min(CHANNELS, channels - b * CHANNELS)):
                s = sums[lane:]
                total = ((s[0] + s[CHANNELS]) + (s[2 * CHANNELS] + s[3 * CHANNELS])) \
                    + ((s[4 * CHANNELS] + s[5 * CHANNELS]) + (s[6 * CHANNELS] + s[7 * CHANNELS]))
                for p in range(whole, pixels):
                    total += x[base + p * CHANNELS + lane]
                y[n * channels + b * CHANNELS + lane] = total / pixels


@intrinsic
def _max_tile(typingctx, x, start, taps, depth, stride, y, at):
    """y[at + p * 16 + l] = the max over t of x[start + taps[t] + p * stride + l] for the tile's PIXELS pixels p
    and 16 lanes l, from -inf; a NaN taken is kept (np.maximum's)."""
    signature = types.void(x, start, taps, depth, stride, y, at)

    def codegen(context, builder, sig, args):
        def data(index):
            return context.make_array(sig.args[index])(context, builder, args[index]).data

        x_ptr, taps_ptr, y_ptr = (data(i) for i in (0, 2, 5))
        begin, depth, step_x, out = args[1], args[3], args[4], args[6]

        def step(k, best):
            origin = builder.add(begin, builder.load(builder.gep(taps_ptr, [k])))
            found = []
            for p in range(PIXELS):
                v = builder.load(_vector(builder, x_ptr, builder.add(origin, builder.mul(
                    step_x, ir.Constant(llvm.I64, p)))), align=4)
                kept = builder.fcmp_unordered("!=", best[p], best[p])  # a NaN already there
                larger = builder.fcmp_unordered(">", v, best[p])  # larger, or a NaN
                found.append(builder.select(builder.and_(larger, builder.not_(kept)), v, best[p]))
            return found

        lowest = llvm.splat(builder, ir.Constant(llvm.F32, float("-inf")))
        for p, v in enumerate(llvm.counted_loop(builder, depth, [lowest] * PIXELS, step, "max_blocked")):
            builder.store(v, _vector(builder, y_ptr, builder.add(out, ir.Constant(llvm.I64, p * CHANNELS))), align=4)
        return context.get_dummy_value()

    return signature, codegen


@jit
def max_pool_blocked(x, offsets, y, images, blocks, height, width, oh, ow, sh, sw, top, left, source, padded_height,
                     padded_width, tile):
    """A 2-D max pool over the blocked flat ``x`` into the blocked flat ``y``, depthwise_blocked's tiles over
    ``source`` whose borders hold -inf (padding never taken: a window wholly in it gives -inf)."""
    _pool_blocks(x, offsets, tile, y, images, blocks, height, width, oh, ow, sh, sw, top, left, source, padded_height,
                 padded_width, tile, False)


@jit
def _pool_blocks(x, offsets, scale, y, images, blocks, height, width, oh, ow, sh, sw, top, left, source,
                 padded_height, padded_width, tile, mean):
    """max_pool_blocked's and average_pool_blocked's loop: each block copied into ``source``'s borders (unless the
    windows read ``x`` in place), then tiles of PIXELS pixels of a row, by _mean_tile where ``mean`` (``scale``
    its factors) else _max_tile."""
    depth = offsets.shape[0]
    pixels = min(PIXELS, ow)
    row_floats = width * CHANNELS
    in_place = top == 0 and left == 0 and padded_height == height and padded_width == width and ow >= PIXELS
    for n in range(images):
        for b in range(blocks):
            base = (n * blocks + b) * height * row_floats
            if in_place:
                image, offset = x, base
            else:
                _fill(x, base, height, row_floats, source, top, left, padded_width)
                image, offset = source, 0
            target = (n * blocks + b) * oh * ow * CHANNELS
            for oy in range(oh):
                for ox in range(0, ow, PIXELS):
                    ox = min(ox, ow - pixels)
                    begin = offset + (oy * sh * padded_width + ox * sw) * CHANNELS
                    out = target + (oy * ow + ox) * CHANNELS
                    whole = pixels == PIXELS
                    if mean:
                        _mean_tile(image, begin, offsets, depth, sw * CHANNELS, scale, oy * ow + ox,
                                   y if whole else tile, out if whole else 0)
                    else:
                        _max_tile(image, begin, offsets, depth, sw * CHANNELS, y if whole else tile,
                                  out if whole else 0)
                    if not whole:
                        y[out:out + pixels * CHANNELS] = tile[:pixels * CHANNELS]


@intrinsic
def _mean_tile(typingctx, x, start, taps, depth, stride, scale, first, y, at):
    """y[at + p * 16 + l] = scale[first + p] times the sum over t of x[start + taps[t] + p * stride + l] (in tap
    order, from 0) for the tile's PIXELS pixels p and 16 lanes l."""
    signature = types.void(x, start, taps, depth, stride, scale, first, y, at)

    def codegen(context, builder, sig, args):
        def data(index):
            return context.make_array(sig.args[index])(context, builder, args[index]).data

        x_ptr, taps_ptr, scale_ptr, y_ptr = (data(i) for i in (0, 2, 5, 7))
        begin, depth, step_x, first, out = args[1], args[3], args[4], args[6], args[8]

        def step(k, sums):
            origin = builder.add(begin, builder.load(builder.gep(taps_ptr, [k])))
            return [builder.fadd(sums[p], builder.load(_vector(builder, x_ptr, builder.add(origin, builder.mul(
                step_x, ir.Constant(llvm.I64, p)))), align=4)) for p in range(PIXELS)]

        for p, total in enumerate(llvm.counted_loop(builder, depth, [llvm.ZEROS] * PIXELS, step, "mean_blocked")):
            factor = llvm.splat(builder, builder.load(builder.gep(scale_ptr, [
                builder.add(first, ir.Constant(llvm.I64, p))])))
            builder.store(builder.fmul(total, factor),
                          _vector(builder, y_ptr, builder.add(out, ir.Constant(llvm.I64, p * CHANNELS))), align=4)
        return context.get_dummy_value()

    return signature, codegen


def mean_scale(oh: int, ow: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int, rows: tuple[int, int],
               columns: tuple[int, int]) -> np.ndarray:
    """average_pool_blocked's ``scale``: 1 / (the taps each output window counts) in float32, as pooling.pool_2d
    divides, for the windows' taps on padded rows [rows[0], rows[1]) and columns [columns[0], columns[1]) (the
    input, or with its declared pads for count_include_pad); PIXELS further ones past the last output, which a
    narrow row's tile reads."""
    def counts(outs, k, s, d, lo, hi):
        at = np.arange(outs)[:, None] * s + np.arange(k)[None, :] * d
        return ((at >= lo) & (at < hi)).sum(axis=1).astype(np.float32)

    taps = counts(oh, kh, sh, dh, *rows)[:, None] * counts(ow, kw, sw, dw, *columns)[None, :]
    with np.errstate(divide="ignore"):
        scale = (np.float32(1) / taps).reshape(-1)
    return np.concatenate([scale, np.ones(PIXELS, np.float32)])


@jit
def average_pool_blocked(x, offsets, scale, y, images, blocks, height, width, oh, ow, sh, sw, top, left, source,
                         padded_height, padded_width, tile):
    """A 2-D average pool over the blocked flat ``x`` into the blocked flat ``y``, max_pool_blocked's tiles over
    ``source`` whose borders hold zeros: each window's sum times its output's ``scale`` (mean_scale)."""
    _pool_blocks(x, offsets, scale, y, images, blocks, height, width, oh, ow, sh, sw, top, left, source, padded_height,
                 padded_width, tile, True)


@jit
def copy_channels_blocked(x, y, images, channels, offset, total, pixels):
    """Channels offset .. offset + ``channels`` of the blocked flat ``y`` (images x ceil(total / 16) x pixels x 16)
    = the blocked flat ``x``'s (images x ceil(channels / 16) x pixels x 16): one input of a channel Concat.
    Where ``offset`` starts a block, x's blocks are copied whole, their lanes past ``channels`` too (the next
    input's copy, in input order, overwrites them; past ``total`` they are padding); else each pixel's lanes of
    an x block go to the lanes they shift to in one or two y blocks. (Unsigned indices: no wraparound checks
    in the way of LLVM's vectors.)"""
    x_blocks = np.uint64((channels + CHANNELS - 1) // CHANNELS)
    y_blocks = np.uint64((total + CHANNELS - 1) // CHANNELS)
    lanes = np.uint64(CHANNELS)
    block_floats = np.uint64(pixels) * lanes
    shift = np.uint64(offset % CHANNELS)
    first = np.uint64(offset // CHANNELS)
    for n in range(np.uint64(images)):
        if shift == 0:
            start = (n * y_blocks + first) * block_floats
            source = n * x_blocks * block_floats
            for k in range(x_blocks * block_floats):
                y[start + k] = x[source + k]
            continue
        for b in range(x_blocks):
            used = min(lanes, np.uint64(channels) - b * lanes)
            low = min(used, lanes - shift)  # (the lanes that land in y block first + b, from lane shift on)
            source = (n * x_blocks + b) * block_floats
            target = (n * y_blocks + first + b) * block_floats
            for p in range(np.uint64(pixels)):
                at = p * lanes
                for lane in range(low):
                    y[target + at + shift + lane] = x[source + at + lane]
                for lane in range(low, used):
                    y[target + block_floats + at + lane - low] = x[source + at + lane]
