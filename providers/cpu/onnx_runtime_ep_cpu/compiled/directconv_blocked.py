"""directconv.py's tiles over channel-blocked values, for a segment plan's runs of direct convolutions
(algorithms/segment_layout.py).

A blocked value (N, C, H, W) is stored as (N, ceil(C / 16), H, W, 16): each pixel's 16 channels of a block
contiguous, as onnxruntime's NCHWc keeps activations between layers. A tile's sums are 16 channels x PIXELS
pixels, so a blocked output is stored as the accumulators hold it, where the plain layout takes an 8 x 8 transpose
per half and a row store per channel; a blocked input is read as the plain one, with the taps and the pixel
step scaled by 16. Channels past C in the last block are computed from zero weights and never read.
"""

from __future__ import annotations

import numpy as np

from . import compiler, jit
from .directconv import BLOCKED_OUT, CHANNELS, PIXELS, conv_tile

_inline = compiler(inline="always")


def blocked_taps(offsets: np.ndarray, plane: int) -> np.ndarray:
    """directconv.tap_offsets (channel c at c * plane, a cell r of the window at r) for a blocked image:
    channel c at (c // 16) * plane * 16 + c % 16, cell r at r * 16."""
    channel, cell = np.divmod(offsets, plane)
    return ((channel // CHANNELS) * plane * CHANNELS + channel % CHANNELS + cell * CHANNELS).astype(np.int64)


@jit
def fill_blocked(x, base, planes, lanes, height, width, source, top, left, padded_height, padded_width):
    """Copy ``planes`` planes of ``lanes`` channels each (a plain image: its channels, one lane; a blocked one:
    its blocks of 16) from flat ``x`` at ``base`` into the padded ``source`` at (``top``, ``left``)."""
    rows, columns = min(height, padded_height - top), min(width, padded_width - left)
    plane = padded_height * padded_width
    for b in range(planes):
        for r in range(rows):
            at = (b * plane + (r + top) * padded_width + left) * lanes
            start = base + ((b * height + r) * width) * lanes
            source[at:at + columns * lanes] = x[start:start + columns * lanes]


@jit
def conv_blocked(x, weights, offsets, bias, residual, bounds, flags, y, source, sh, sw, top, left, padded_height,
                 padded_width, in_place, images, channels, height, width, x_blocked, outputs, oh, ow, y_blocked,
                 y_image):
    """directconv.conv_direct for one group over flat ``x`` (images x ``channels`` x ``height`` x ``width``,
    blocked where ``x_blocked``: then ``offsets`` are blocked_taps) into flat ``y`` (images x ``outputs`` x
    ``oh`` x ``ow``, blocked where ``y_blocked``; ``residual`` in y's layout). Unless ``in_place``, each image is
    copied into the interior of ``source`` (source_size floats, zeros elsewhere: the plan's own buffer, allocated
    once, whose pads and margin no call writes). ``y_image``: the floats from one image of y to the next, 0 for
    y's own; more where y is one part of a channel concatenation (its first channel of the first image on), the
    residual then none."""
    tiles = weights.shape[1]
    stored = (channels + CHANNELS - 1) // CHANNELS * CHANNELS if x_blocked else channels
    for n in range(images):
        if in_place:
            image = x[n * stored * height * width:]
        else:
            fill_image(x, n, channels, height, width, x_blocked, source, top, left, padded_height, padded_width)
            image = source
        tile_rows(image, n, weights, offsets, bias, residual, bounds, flags, y, sh, sw, padded_width, x_blocked,
                  outputs, oh, ow, y_blocked, y_image, 0, tiles * oh)


@_inline  # (inlined in its callers: conv_blocked and a split row's fill)
def fill_image(x, n, channels, height, width, x_blocked, source, top, left, padded_height, padded_width):
    """conv_blocked's copy of image ``n`` of flat ``x`` (blocked where ``x_blocked``: whole blocks of 16 channels)
    into the interior of its padded ``source``."""
    lanes = CHANNELS if x_blocked else 1
    stored = (channels + CHANNELS - 1) // CHANNELS * CHANNELS if x_blocked else channels
    fill_blocked(x, n * stored * height * width, stored // lanes, lanes, height, width, source, top, left,
                 padded_height, padded_width)


@_inline  # (inlined in its callers: conv_blocked and a split row's tasks)
def tile_rows(image, n, weights, offsets, bias, residual, bounds, flags, y, sh, sw, padded_width, x_blocked, outputs,
              oh, ow, y_blocked, y_image, first, end):
    """conv_blocked's output rows of image ``n`` from its padded ``image``: rows ``first`` .. ``end`` of its tiles'
    rows in order (tile t's row oy is t * oh + oy), so that threads can share one image's rows."""
    tiles, depth = weights.shape[1], weights.shape[2]
    lanes = CHANNELS if x_blocked else 1
    pixels = min(PIXELS, ow)
    tile_flags = flags | BLOCKED_OUT if y_blocked else flags
    y_stride = y_image if y_image > 0 else (tiles * CHANNELS if y_blocked else outputs) * oh * ow
    if end <= first:
        return
    for t in range(first // oh, (end - 1) // oh + 1):
        w = weights[0, t].reshape(-1)
        first_channel = t * CHANNELS
        count = min(CHANNELS, outputs - first_channel)
        tile_bias = bias[0, first_channel:]
        for oy in range(max(first - t * oh, 0), min(end - t * oh, oh)):
            for ox in range(0, ow, PIXELS):
                ox = min(ox, ow - pixels)
                start = (oy * sh * padded_width + ox * sw) * lanes
                if y_blocked:
                    at = n * y_stride + ((t * oh + oy) * ow + ox) * CHANNELS
                else:
                    at = n * y_stride + (first_channel * oh + oy) * ow + ox
                conv_tile(w, image, start, offsets, depth, sw * lanes, y, at, oh * ow, pixels, count, tile_bias,
                          residual, tile_flags, bounds)


def source_size(channels: int, padded_height: int, padded_width: int, sw: int, x_blocked: bool,
                in_place: bool) -> int:
    """The floats of conv_blocked's ``source`` for an image of ``channels`` channels (its stored ones:
    whole blocks of 16 where ``x_blocked``): the padded planes and a margin for a row's last tile (0 in place)."""
    if in_place:
        return 0
    stored = -(-channels // CHANNELS) * CHANNELS if x_blocked else channels
    return stored * padded_height * padded_width + PIXELS * sw * (CHANNELS if x_blocked else 1)


@jit
def to_blocked(x, y, images, channels, pixels):
    """y (images, ceil(channels / 16), pixels, 16) = x (images, channels, pixels), zeros past the channels."""
    blocks = (channels + CHANNELS - 1) // CHANNELS
    for n in range(images):
        for b in range(blocks):
            out = ((n * blocks + b) * pixels) * CHANNELS
            for c in range(CHANNELS):
                channel = b * CHANNELS + c
                if channel < channels:
                    source = (n * channels + channel) * pixels
                    for p in range(pixels):
                        y[out + p * CHANNELS + c] = x[source + p]
                else:
                    for p in range(pixels):
                        y[out + p * CHANNELS + c] = 0


@jit
def from_blocked(x, y, images, channels, pixels):
    """y (images, channels, pixels) = the blocked x (images, ceil(channels / 16), pixels, 16)."""
    blocks = (channels + CHANNELS - 1) // CHANNELS
    for n in range(images):
        for c in range(channels):
            source = ((n * blocks + c // CHANNELS) * pixels) * CHANNELS + c % CHANNELS
            out = (n * channels + c) * pixels
            for p in range(pixels):
                y[out + p] = x[source + p * CHANNELS]
