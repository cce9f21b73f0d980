"""directconv_blocked's convolution for outputs whose rows are narrower than a tile (a CNN's last stages: 2 x 2
or 4 x 4 outputs), between blocked values.

A directconv tile is PIXELS pixels of one output row, computed whole however few the row has: at two pixels
a row, three quarters of its multiply-adds are dropped. Here a tile's PIXELS pixels are any PIXELS output pixels
in order, across rows and images (``starts``: each pixel's first input float, ``outs``: its first output
float, both made once per plan by gathered_offsets), so every tile but the last is full; the arithmetic per
pixel and the epilogue's order are directconv's.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import intrinsic

from . import compiler, jit
from .directconv import (
    BIAS,
    CHANNELS,
    HARD_SWISH,
    LANES,
    PIXELS,
    RESIDUAL,
    activated_8,
    channel_sums,
    hard_swished_8,
    int_const,
    splat_8,
    vector_at,
)
from .directconv_blocked import fill_blocked

_inline = compiler(inline="always")


def gathered_offsets(images: int, stored: int, padded_height: int, padded_width: int, oh: int, ow: int, sh: int,
                     sw: int, tiles: int) -> tuple[np.ndarray, np.ndarray]:
    """(starts, outs) over the N * OH * OW output pixels padded to whole tiles: pixel (n, oy, ox)'s window's first
    float in the padded images (``stored`` floats per padded pixel, images one after another) and its first
    float in the blocked output's first channel block; the last tile's extra pixels repeat the last pixel."""
    n, oy, ox = np.meshgrid(np.arange(images), np.arange(oh), np.arange(ow), indexing="ij")
    starts = n * stored * padded_height * padded_width + (oy * sh * padded_width + ox * sw) * CHANNELS
    outs = (n * tiles * oh * ow + oy * ow + ox) * CHANNELS
    count = starts.size
    whole = -(-count // PIXELS) * PIXELS
    pad = np.full(whole - count, count - 1)
    order = np.concatenate([np.arange(count), pad]).astype(np.int64)
    return starts.reshape(-1)[order].astype(np.int64), outs.reshape(-1)[order].astype(np.int64)


@intrinsic
def gathered_tile(typingctx, w, x, starts, first, taps, depth, y, outs, shift, pixels, bias, residual, flags,
                  bounds):
    """y[outs[first + p] + shift + c] = act(sum_k w[k*16 + c] * x[starts[first + p] + taps[k]] + bias[c]
    (+ residual[same place])) for the pixels p < ``pixels`` of the tile and its 16 channels c (directconv's
    conv_tile with each pixel's own input and output place, the output blocked)."""
    signature = types.void(w, x, starts, first, taps, depth, y, outs, shift, pixels, bias, residual, flags, bounds)

    def codegen(context, builder, sig, args):
        def data(index):
            return context.make_array(sig.args[index])(context, builder, args[index]).data

        w_ptr, x_ptr, starts_ptr, taps_ptr, y_ptr, outs_ptr, bias_ptr, res_ptr, bounds_ptr = (
            data(i) for i in (0, 1, 2, 4, 6, 7, 10, 11, 13))
        first, depth, shift, pixels, flags = args[3], args[5], args[8], args[9], args[12]
        begin = [builder.load(builder.gep(starts_ptr, [builder.add(first, int_const(p))])) for p in range(PIXELS)]
        def pixel_values(k):
            origin = builder.load(builder.gep(taps_ptr, [k]))
            return [builder.load(builder.gep(x_ptr, [builder.add(begin[p], origin)])) for p in range(PIXELS)]

        sums = channel_sums(builder, w_ptr, depth, pixel_values, "gathered")
        with_bias = builder.icmp_signed("!=", builder.and_(flags, int_const(BIAS)), int_const(0))
        with_residual = builder.icmp_signed("!=", builder.and_(flags, int_const(RESIDUAL)), int_const(0))
        hard = builder.icmp_signed("!=", builder.and_(flags, int_const(HARD_SWISH)), int_const(0))
        limits = [splat_8(builder, builder.load(builder.gep(bounds_ptr, [int_const(i)]))) for i in range(3)]
        for p in range(PIXELS):
            with builder.if_then(builder.icmp_signed("<", int_const(p), pixels)):
                out = builder.add(builder.load(builder.gep(outs_ptr, [builder.add(first, int_const(p))])), shift)
                for h in range(2):
                    place = builder.add(out, int_const(h * LANES))
                    v = sums[2 * p + h]
                    b = builder.load(vector_at(builder, bias_ptr, int_const(h * LANES)), align=4)
                    v = builder.select(with_bias, builder.fadd(v, b), v)
                    with builder.if_else(with_residual) as (added, alone):
                        with added:
                            total = builder.fadd(v, builder.load(vector_at(builder, res_ptr, place), align=4))
                            builder.store(hard_swished_8(builder, activated_8(builder, total, limits), hard),
                                          vector_at(builder, y_ptr, place), align=4)
                        with alone:
                            builder.store(hard_swished_8(builder, activated_8(builder, v, limits), hard),
                                          vector_at(builder, y_ptr, place), align=4)
        return context.get_dummy_value()

    return signature, codegen


@jit
def conv_gathered(x, weights, offsets, bias, residual, bounds, flags, y, source, starts, outs, count, images, stored,
                  height, width, top, left, padded_height, padded_width, in_place, plane_out):
    """directconv_blocked.conv_blocked between blocked values, in tiles of any PIXELS output pixels: x (images x
    ``stored`` / 16 blocks x height x width x 16, flat) copied into the zero borders of ``source`` (images one
    after another, each padded_height x padded_width) unless ``in_place``, then for each block of 16 output
    channels the ``count`` pixels of ``starts``/``outs`` (gathered_offsets), ``plane_out`` = OH * OW.
    ``residual`` (flat, y's layout) is read only where ``flags`` has RESIDUAL."""
    plane = padded_height * padded_width
    image = x
    if not in_place:
        for n in range(images):
            fill_blocked(x, n * stored * height * width, stored // CHANNELS, CHANNELS, height, width,
                  source[n * stored * plane:], top, left, padded_height, padded_width)
        image = source
    gathered_rows(image, weights, offsets, bias, residual, bounds, flags, y, starts, outs, count, plane_out, 0,
                  weights.shape[1] * (starts.shape[0] // PIXELS))


@_inline  # (inlined in its callers: conv_gathered and a split row's tasks)
def gathered_rows(image, weights, offsets, bias, residual, bounds, flags, y, starts, outs, count, plane_out, first,
                  end):
    """conv_gathered's tiles from its padded ``image``: tiles ``first`` .. ``end`` in order (block t's pixel group g
    is t * groups + g), so that threads can share them."""
    depth = weights.shape[2]
    groups = starts.shape[0] // PIXELS
    if end <= first:
        return
    for t in range(first // groups, (end - 1) // groups + 1):
        w = weights[0, t].reshape(-1)
        tile_bias = bias[0, t * CHANNELS:]
        shift = t * plane_out * CHANNELS
        for g in range(max(first - t * groups, 0), min(end - t * groups, groups)):
            pixels = min(PIXELS, count - g * PIXELS)
            gathered_tile(w, image, starts, g * PIXELS, offsets, depth, y, outs, shift, pixels, tile_bias, residual,
                          flags, bounds)
