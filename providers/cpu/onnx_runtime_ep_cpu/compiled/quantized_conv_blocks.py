"""A QDQ Conv group's 2-D convolution (ops/qdq_linear.quantized_conv) on AVX-512 VNNI's byte products,
channel-major, as dynamic_conv_quads runs a dynamically quantized one: the input's codes (or float32 data quantized
with the group's own scale and zero point) shifted to unsigned in padded lines, each image's patches as quads of
taps by output position (dynamic_conv.patch_quads), multiplied by the weight's signed rows broadcast
(qgemm_quads.weight_tiles), and each output channel's int32 sums requantized along its plane of the output: the
codes QLinearConv gives (rint(acc * multiplier + offset) + zero, saturated, in float64, as requantize_affine), or
their float32 values. Its phases (codes, patches, products) are shared with the helper threads by
dynamic_conv_jobs.split_quantized_conv.

The input and the output each come as two arrays, one of them empty: ``x`` float32 data or ``x_codes`` the 8-bit
codes as uint8 bytes (int8 codes viewed as uint8), ``out`` float32 values or ``out_codes`` the codes' bytes (an
int8 code's two's-complement byte), so that one compiled body (and one job kind) serves every type.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .dynamic_conv import BLOCK, CODES, PATCHES, PRODUCTS, dynamic_plan, patch_quads
from .qgemm import A_LOW, A_QUANTIZE, A_SCALE, A_ZERO, DEQUANTIZE, Y_HIGH, Y_LOW, Y_SCALE, Y_ZERO
from .qgemm_quads import AMX, AMX_DEPTH, AMX_ROWS, amx_tiles, requantized_tiles, weight_tiles
from .qgemm_tiles import LANES, MR


@jit
def quantized_conv_blocks(x, x_codes, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, terms,
                          weight_zeros, factors, shifts, consts, out, out_codes):
    """The whole convolution on the calling thread: x (N, C, H, W) float32 or x_codes (N, C, H, W) uint8 (the
    other empty); ``weight`` (M, 4 * K4) int8, the weight's signed codes (uint8 ones less 128 with their zero
    points), k = (c*KH + i)*KW + j, 0 past K; ``terms`` (M,) int32 the zero points' constant term zu * (K * zs[m] -
    sum_k s[k, m]) wrapped (zu the input's zero point shifted to unsigned); ``weight_zeros`` (M,) int32 the signed
    zero points zs; factors and shifts (M,) float64, requantize_affine's multiplier and offset per channel;
    consts qgemm's layout; out (N, M, OH * OW) float32 or out_codes (N, M, OH * OW) uint8 (the other empty)."""
    codes, patches, _, _, geometry = quantized_plan(x, x_codes, kh, kw, sh, sw, dh, dw, top, bottom, left, right,
                                                    oh, ow, weight, 1)
    for phase in (CODES, PATCHES, PRODUCTS):
        quantized_phase(phase, x, x_codes, codes, patches, weight, terms, weight_zeros, factors, shifts, consts,
                        out, out_codes, geometry, 1, 0, 1)


@jit
def quantized_plan(x, x_codes, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, tasks):
    """dynamic_conv.dynamic_plan's buffers for whichever of x and x_codes holds the input (the output channels
    split in whole groups of AMX's tiles where those take the weight)."""
    rows = AMX_ROWS if amx_shaped(weight) else MR
    if x.size:
        return dynamic_plan(x, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, tasks, rows)
    return dynamic_plan(x_codes, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, tasks, rows)


@jit
def quantized_phase(phase, x, x_codes, codes, patches, weight, terms, weight_zeros, factors, shifts, consts,
                    out, out_codes, geometry, tasks, first, end):
    """Tasks first .. end of ``tasks`` of a phase of quantized_conv_blocks (each its share of the phase's items):
    CODES, the padded unsigned code lines; PATCHES, (image, column block) units (their quads); PRODUCTS, (image,
    column block, output channels) units (multiplied and requantized into the output)."""
    kh, kw, sh, sw, dh, dw = geometry[0], geometry[1], geometry[2], geometry[3], geometry[4], geometry[5]
    top, bottom, left, right, oh, ow = geometry[6], geometry[7], geometry[8], geometry[9], geometry[10], geometry[11]
    blocks, step, channel_units = geometry[12], geometry[13], geometry[14]
    batch, channels, height, width = x.shape if x.size else x_codes.shape
    tall, wide = height + top + bottom, width + left + right
    # uint8 codes without pads are their own padded lines: the patches read them in place
    direct = x.size == 0 and consts[A_LOW] == 0 and top == bottom == left == right == 0
    source = x_codes.reshape(-1) if direct else codes
    if phase == CODES:
        count = 0 if direct else batch * channels * tall
    elif phase == PATCHES:
        count = batch * blocks
    else:
        count = batch * blocks * channel_units
    for task in range(first, end):
        a, b = count * task // tasks, count * (task + 1) // tasks
        if phase == CODES:
            _unsigned_code_lines(x, x_codes, consts, top, bottom, left, right, codes, a, b)
        elif phase == PATCHES:
            for unit in range(a, b):
                patch_quads(source, channels, tall, wide, kh, kw, sh, sw, dh, dw, oh, ow, blocks, weight.shape[1],
                            unit // blocks, unit % blocks, patches)
        else:
            for unit in range(a, b):
                image, rest = unit // (blocks * channel_units), unit % (blocks * channel_units)
                _requantized_unit(patches, weight, image, rest // channel_units, (rest % channel_units) * step,
                                  step, blocks, oh * ow, terms, weight_zeros, factors, shifts, consts, out,
                                  out_codes)


@jit
def _unsigned_code_lines(x, x_codes, consts, top, bottom, left, right, codes, first, end):
    """Lines first .. end of the padded buffer ``codes`` (N * C * (H + top + bottom) lines of W + left + right
    bytes): each code less the code range's low end (uint8 codes as they are, int8 ones plus 128, float32 data
    quantized as QuantizeLinear does with the zero point and range shifted alike, which is the same
    saturation), the pads the zero point's shifted code. Without side pads a plane's lines go as one run.
    Index loops, not slices: a 14-value line's slices cost more than its copy."""
    floats = x.size > 0
    height, width = (x.shape[2], x.shape[3]) if floats else (x_codes.shape[2], x_codes.shape[3])
    tall, wide = height + top + bottom, width + left + right
    low = consts[A_LOW]
    pad = np.uint8(np.int32(consts[A_ZERO] - low))
    scale, zero = np.float32(consts[A_SCALE]), np.float32(consts[A_ZERO] - low)
    quantize, signed = floats and consts[A_QUANTIZE] != 0, low < 0
    flat = x.reshape(-1)
    raw = x_codes.reshape(-1)
    flip = np.uint8(128) if signed else np.uint8(0)
    scratch = np.empty(height * width if quantize and (left or right) else 0, np.uint8)
    # the line's plane and row among the padded ones, stepped (no division per line); unsigned offsets, which
    # numba does not check for wraparound, so the loops vectorize
    plane, row = first // tall, first % tall
    line = first
    while line < end:
        base = np.uint64(line * wide)
        h = row - top
        if h < 0 or h >= height:
            _fill(codes, base, np.uint64(wide), pad)
            lines = 1
        else:
            # the plane's real lines in this range: quantized as one run (into their padded lines, or where
            # there are side pads into scratch first), then laid out line by line between the pads
            lines = min(end - line, height - h)
            source, count = np.uint64((plane * height + h) * width), np.uint64(lines * width)
            if left == 0 and right == 0:
                if quantize:
                    _quantize_run(flat, source, count, scale, zero, codes, base)
                else:
                    _copy_run(raw, source, count, flip, codes, base)
            else:
                origin, flips = (raw, source), flip
                if quantize:
                    _quantize_run(flat, source, count, scale, zero, scratch, np.uint64(0))
                    origin, flips = (scratch, np.uint64(0)), np.uint8(0)
                for k in range(lines):
                    at = base + np.uint64(k * wide)
                    _fill(codes, at, np.uint64(left), pad)
                    _copy_run(origin[0], origin[1] + np.uint64(k * width), np.uint64(width), flips, codes,
                              at + np.uint64(left))
                    _fill(codes, at + np.uint64(left + width), np.uint64(right), pad)
        line += lines
        row += lines
        if row >= tall:
            plane, row = plane + 1, row - tall


@jit
def _quantize_run(values, source, count, scale, zero, codes, at):
    """codes[at:][:count] = quantize_row's codes of values[source:][:count] in [0, 255] (``zero`` shifted)."""
    top = np.float32(255)
    for i in range(count):
        v = np.rint(values[source + i] / scale) + zero
        v = np.float32(0) if v < 0 else v
        v = top if v > top else v
        codes[at + i] = np.int32(v) if v == v else 0


@jit
def _copy_run(raw, source, count, flip, codes, at):
    """codes[at:][:count] = raw[source:][:count] ^ flip (128: int8 codes' bytes to the unsigned codes)."""
    for i in range(count):
        codes[at + i] = raw[source + i] ^ flip


@jit
def _fill(codes, at, count, value):
    for i in range(count):
        codes[at + i] = value


@jit
def _requantized_unit(patches, weight, image, block, m_first, step, blocks, spots, terms, weight_zeros, factors,
                      shifts, consts, out, out_codes):
    """Output channels m_first .. m_first + step (fewer at M) of image ``image``'s column block ``block``: the int32
    sums of their weight rows by the block's patches plus the zero points' terms (terms[m], and where the weight's
    zero point zs[m] is not 0, -zs[m] times the patch's sum of codes), wrapped to int32 as an accumulator wraps,
    then requantize_affine's code rint(total * factors[m] + shifts[m]) + z saturated: with the saturation first
    (rint is monotonic and the bounds less z are integers) and rint as the sum and difference of 1.5 * 2**52, which
    rounds half to even in float64 below 2**51: in the tiles' registers (qgemm_quads.requantized_tiles, or
    amx_tiles where AMX's groups take the weight). The
    patches' sums of codes, where a zero point zs is not 0, as the product of a row of ones by them."""
    columns = terms.shape[0]  # (the weight's rows may be padded for AMX's tiles)
    m_end = min(m_first + step, columns)
    first = block * BLOCK
    count = min(first + BLOCK, spots) - first
    depth4 = weight.shape[1] // 4
    at, vectors = (image * blocks + block) * depth4 * BLOCK * 4, (count + LANES - 1) // LANES
    z, s = np.float64(consts[Y_ZERO]), np.float64(consts[Y_SCALE])
    bounds = np.empty(4, np.float64)
    bounds[0], bounds[1] = np.float64(consts[Y_LOW]) - z, np.float64(consts[Y_HIGH]) - z
    bounds[2], bounds[3] = z, s
    sums = np.zeros(BLOCK, np.int32)
    if np.any(weight_zeros[m_first:m_end] != 0):
        weight_tiles(np.ones((1, weight.shape[1]), np.int8), 0, 1, patches, at, 4 * BLOCK, vectors, sums, BLOCK)
    arguments = (weight, m_first, m_end, patches, at, 4 * BLOCK, vectors, terms, weight_zeros, sums, factors, shifts,
                 bounds)
    target = (image * columns + m_first) * spots + first
    if amx_shaped(weight):
        if consts[DEQUANTIZE] != 0:
            amx_tiles(*arguments, out.reshape(-1), target, spots, count)
        else:
            amx_tiles(*arguments, out_codes.reshape(-1), target, spots, count)
    elif consts[DEQUANTIZE] != 0:
        requantized_tiles(*arguments, out.reshape(-1), target, spots, count)
    else:
        requantized_tiles(*arguments, out_codes.reshape(-1), target, spots, count)


@jit
def amx_shaped(weight):
    """Whether AMX's tile groups take this weight: the process has them and its rows and k are whole groups."""
    return AMX and weight.shape[0] % AMX_ROWS == 0 and weight.shape[1] % AMX_DEPTH == 0
