"""Depthwise 2-D float32 convolution with channels across the lanes, for AVX2 hosts (8 floats a vector).

depthwise.py's loop runs each channel over its own zero-padded phase planes: on the small maps of light
CNNs (MobileNet's 8x8 and 4x4 layers) each channel costs its copies and passes more than its taps. Here,
as in onnxruntime's NCHWc kernels, a block of 8 channels is copied once into a padded buffer with the
channels innermost (pixel (r, q) of the block at (r * padded_width + q) * 8), so that each tap of a window
is one vector load for all 8 channels and one multiply-add with the tap's 8 weights. A tile is 4 output
pixels of a row (4 accumulators in registers over the taps), stored channel-major to a small buffer,
from which the pixels go to the output with the bias and activation.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import compiler, jit, llvm
from .aligned import aligned_copy
from .directconv import LANES, int_const, vector_at
from .epilogue import activate

PIXELS = 4  # output pixels per tile
_VEC = ir.VectorType(llvm.F32, LANES)
# Inlined into the loop: a call between compiled functions passes its arrays with reference counting.
_inline = compiler(inline="always")


def pack_weights(w: np.ndarray) -> np.ndarray:
    """w (C, 1, KH, KW) as float32 (blocks, KH*KW, 8): each tap's 8 channels of a block together, zeros
    past the last channel."""
    c = w.shape[0]
    flat = w.astype(np.float32, copy=False).reshape(c, -1)
    blocks = -(-c // LANES)
    packed = np.zeros((blocks * LANES, flat.shape[1]), dtype=np.float32)
    packed[:c] = flat
    return aligned_copy(packed.reshape(blocks, LANES, -1).transpose(0, 2, 1))


def tap_offsets(kh: int, kw: int, dh: int, dw: int, padded_width: int) -> np.ndarray:
    """Each tap's offset (in floats) in the block's buffer from its window's first pixel."""
    i, j = np.meshgrid(np.arange(kh), np.arange(kw), indexing="ij")
    return ((i * dh * padded_width + j * dw) * LANES).reshape(-1).astype(np.int64)


def _emit_tile(builder, pointers: tuple, values: tuple) -> None:
    """The IR of one tile (see _tile)."""
    w_ptr, x_ptr, taps_ptr, out_ptr = pointers
    start, depth, stride = values
    fma = llvm.declare(builder.module, "llvm.fma.v8f32", ir.FunctionType(_VEC, [_VEC, _VEC, _VEC]))

    def step(k, sums):
        origin = builder.add(start, builder.load(builder.gep(taps_ptr, [k])))
        weights = builder.load(vector_at(builder, w_ptr, builder.mul(k, int_const(LANES))), align=4)
        return [builder.call(fma, [weights, builder.load(vector_at(
            builder, x_ptr, builder.add(origin, builder.mul(stride, int_const(p)))), align=4), sums[p]])
            for p in range(PIXELS)]

    zeros = ir.Constant(_VEC, [0.0] * LANES)
    sums = llvm.counted_loop(builder, depth, [zeros] * PIXELS, step, "depthwise")
    for p, v in enumerate(sums):
        builder.store(v, vector_at(builder, out_ptr, int_const(p * LANES)), align=4)


@intrinsic
def _tile(typingctx, w, x, start, taps, depth, stride, out):
    """out[p*8 + l] = sum_t w[t*8 + l] * x[start + taps[t] + p*stride + l] for pixels p < 4, lanes l < 8."""
    signature = types.void(w, x, start, taps, depth, stride, out)

    def codegen(context, builder, sig, args):
        def data(index):
            return context.make_array(sig.args[index])(context, builder, args[index]).data

        _emit_tile(builder, tuple(data(i) for i in (0, 1, 3, 6)), (args[2], args[4], args[5]))
        return context.get_dummy_value()

    return signature, codegen


@_inline
def _fill(x, at, count, plane, width, buffer, top, left, padded_height, padded_width):
    """``count`` channels of flat x from ``at`` (planes ``plane`` apart, rows ``width`` long) into ``buffer``
    (padded pixels x 8 channels, channels innermost); pads, the lanes past ``count`` and the margin keep
    their zeros."""
    height = plane // width
    rows, columns = min(height, padded_height - top), min(width, padded_width - left)
    for lane in range(count):
        for r in range(rows):
            row = np.uint64(((r + top) * padded_width + left) * LANES + lane)
            source = np.uint64(at + lane * plane + r * width)
            for q in range(np.uint64(columns)):
                buffer[row + q * np.uint64(LANES)] = x[source + q]


_SIXTH, _HALF, _ZERO, _ONE = np.float32(1 / 6), np.float32(0.5), np.float32(0), np.float32(1)


@_inline
def _store(tile, y, at, plane, count, pixels, bias, with_bias, low, high, slope, hard_swish):
    """The tile's ``pixels`` x ``count`` channels to flat y from ``at`` (planes ``plane`` apart), with the
    bias and activation, then HardSwish where ``hard_swish`` (the HardSwish kernel's float32 operations)."""
    for lane in range(count):
        b = bias[lane] if with_bias else _ZERO
        row = at + lane * plane
        for p in range(pixels):
            v = tile[p * LANES + lane]
            if with_bias:
                v += b
            v = activate(v, low, high, slope)
            if hard_swish:
                gate = v * _SIXTH + _HALF
                gate = _ZERO if gate < _ZERO else gate
                v = v * (_ONE if gate > _ONE else gate)
            y[row + p] = v


@jit
def conv_depthwise(x, weights, offsets, bias, bounds, y, sh, sw, top, left, padded_height, padded_width,
                   hard_swish):
    """y (N, C, OH, OW) = activation(the depthwise convolution of float32 x (N, C, H, W) by ``weights``
    (pack_weights) + ``bias`` (C,; empty: none)), over the padded image (``padded_height`` x
    ``padded_width``, x at ``top``/``left``) with window taps at ``offsets`` (tap_offsets); ``bounds``
    as epilogue.activation_bounds, then HardSwish where ``hard_swish``. A row's last tile is shifted back
    to end at its end where the row holds a tile; narrower rows compute past their end (into the buffer's
    margin) and store their own."""
    channels, oh, ow = x.shape[1], y.shape[2], y.shape[3]
    plane, out_plane = x.shape[2] * x.shape[3], oh * ow
    flat_x, flat_y = x.reshape(-1), y.reshape(-1)
    low, high, slope = bounds[0], bounds[1], bounds[2]
    with_bias = bias.shape[0] > 0
    depth = offsets.shape[0]
    buffer = np.zeros((padded_height * padded_width + PIXELS * sw) * LANES, dtype=np.float32)
    tile = np.empty(PIXELS * LANES, dtype=np.float32)
    pixels = min(PIXELS, ow)
    for n in range(x.shape[0]):
        for block in range(weights.shape[0]):
            first = block * LANES
            count = min(LANES, channels - first)
            _fill(flat_x, (n * channels + first) * plane, count, plane, x.shape[3], buffer, top, left,
                  padded_height, padded_width)
            w = weights[block].reshape(-1)
            block_bias = bias[first:first + count] if with_bias else bias
            for oy in range(oh):
                for ox in range(0, ow, PIXELS):
                    ox = min(ox, ow - pixels)
                    _tile(w, buffer, (oy * sh * padded_width + ox * sw) * LANES, offsets, depth, sw * LANES, tile)
                    _store(tile, flat_y, (n * channels + first) * out_plane + oy * ow + ox, out_plane, count,
                           pixels, block_bias, with_bias, low, high, slope, hard_swish)
