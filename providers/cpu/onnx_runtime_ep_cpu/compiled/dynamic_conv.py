"""A dynamically quantized convolution in one call (ops/dynamic_quantize_conv.py): onnxruntime's dynamic
quantization writes each Conv as DynamicQuantizeLinear -> ConvInteger -> Cast -> Mul by the scales' product
(-> bias Add). Here the input is quantized as DynamicQuantizeLinear does (one scale and zero point over all of
it), its codes gathered into patch rows (padding takes the zero point's code, as ConvInteger pads), and the
rows multiplied by the packed weight with scaled_product's exact int32 accumulation and float64 rescaling. On
AVX-512 VNNI (dynamic_conv_quads) the codes are gathered as quads of taps by output position instead and the
weight's rows broadcast, so the product comes out channel-major, as the output is laid out; its phases are
shared with the helper threads by dynamic_conv_jobs.py.
QLinearConv (ops/quantization.py) runs the same patch rows of its 8-bit input through QGemm's requantizing
product (qgemm.qgemm), and a QDQ Conv group (ops/qdq_linear.py) through qgemm.requantized_product.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .qgemm import (
    A_HIGH,
    A_LOW,
    A_QUANTIZE,
    A_SCALE,
    A_ZERO,
    DEQUANTIZE,
    Y_HIGH,
    Y_LOW,
    Y_SCALE,
    Y_ZERO,
    centred_rows_of,
    finish_requantized,
    float_code,
    qgemm,
    requantized_product,
    scaled_product,
)
from .qgemm_quads import strided_quads, weight_tiles
from .qgemm_tiles import LANES, MR, strided_product
from .quantize import dynamic_parameters, quantize_row, range_parameters, requantized_code, value_range


@jit
def _padded_codes(x, scale, zero, top, bottom, left, right):
    """x's (N, C, H, W) DynamicQuantizeLinear codes (compiled/quantize.dynamic_quantize's arithmetic) in a flat
    (N, C, H + top + bottom, W + left + right) buffer whose border holds the zero point's code."""
    batch, channels, height, width = x.shape
    codes = np.empty(batch * channels * (height + top + bottom) * (width + left + right), np.uint8)
    _code_lines(x, scale, zero, top, bottom, left, right, codes, 0, batch * channels * (height + top + bottom))
    return codes


@jit
def _code_lines(x, scale, zero, top, bottom, left, right, codes, first, end):
    """Lines first .. end of _padded_codes' buffer ``codes`` (N * C * (H + top + bottom) lines of W + left + right
    codes): a pad line all the zero point's code, the others x's line between its pads. Without side pads, a
    plane's lines are quantized as one row (a line's few values run the vector loop's scalar remainder)."""
    height, width = x.shape[2], x.shape[3]
    tall, wide = height + top + bottom, width + left + right
    flat = x.reshape(-1)
    pad = np.uint8(zero)
    line = first
    while line < end:
        plane, h = line // tall, line % tall - top
        if h < 0 or h >= height:
            codes[line * wide:(line + 1) * wide] = pad
            line += 1
            continue
        stop = min(end, plane * tall + top + height) if left == 0 and right == 0 else line + 1
        at = (plane * height + h) * width
        target = codes[line * wide:stop * wide]
        target[:left] = pad
        target[target.shape[0] - right:] = pad
        # (DynamicQuantizeLinear's codes: quantize's rounding and saturation to [0, 255])
        quantize_row(flat[at:at + (stop - line) * width], scale, zero, np.float32(0), np.float32(255),
                     target[left:target.shape[0] - right])
        line = stop


@jit
def _patch_rows(codes, channels, tall, wide, kh, kw, sh, sw, dh, dw, oh, ow, rows):
    """rows[(b*OH + r)*OW + q, (c*KH + i)*KW + j] = padded[b, c, r*sh + i*dh, q*sw + j*dw] from the flat padded
    codes (N, C, tall, wide): one gather per element through a table of the taps' offsets; 0 in the columns past
    C*KH*KW (rows padded to whole quads of bytes)."""
    depth = channels * kh * kw
    taps = np.empty(depth, np.uint64)
    for c in range(channels):
        for i in range(kh):
            for j in range(kw):
                taps[(c * kh + i) * kw + j] = np.uint64((c * tall + i * dh) * wide + j * dw)
    for p in range(rows.shape[0]):
        b, spot = p // (oh * ow), p % (oh * ow)
        r, q = spot // ow, spot % ow
        # unsigned offsets: numba checks signed ones for wraparound, which keeps the gather from vectorizing
        base = np.uint64((b * channels * tall + r * sh) * wide + q * sw)
        line = rows[p]
        for k in range(depth):
            line[k] = codes[base + taps[k]]
        for k in range(depth, rows.shape[1]):
            line[k] = 0


@jit
def dynamic_conv(x, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, packed, pairs, b_scales, bias, out):
    """out (N, M, OH * OW) float32 = float32(acc * (x_scale * b_scales[m or 0])) (+ bias[m] in float32), acc the
    int32 sum over taps of (code - zero) * packed[m, tap], for float32 ``x`` (N, C, H, W) quantized as
    DynamicQuantizeLinear does. packed (M, C*KH*KW) int16 (qgemm.pack_columns of the weight's rows) and its
    pairs, b_scales (1,) or (M,) float64, bias (M,) or (0,) float32."""
    scale, zero = dynamic_parameters(x.reshape(-1))
    codes = _padded_codes(x, scale, zero, top, bottom, left, right)
    batch, channels = x.shape[0], x.shape[1]
    spots = oh * ow
    rows = np.empty((batch * spots, channels * kh * kw), np.uint8)
    _patch_rows(codes, channels, x.shape[2] + top + bottom, x.shape[3] + left + right, kh, kw, sh, sw, dh, dw, oh,
                ow, rows)
    y = np.empty((batch * spots, out.shape[1]), np.float32)
    scaled_product(rows, np.int32(zero), packed, pairs, np.float64(scale), b_scales, bias, y)
    _images_by_channel(y, out)


# dynamic_conv_quads' columns of output positions per product unit: NC_MAX vectors of 16
BLOCK = 4 * LANES
# its phases, one job each where dynamic_conv_jobs.split_dynamic_conv shares them: x's range, its padded codes,
# the patches' quads, the products
RANGE, CODES, PATCHES, PRODUCTS = 0, 1, 2, 3


@jit
def dynamic_conv_quads(x, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, column_sums, weight_zeros,
                       b_scales, bias, out):
    """dynamic_conv on AVX-512 VNNI's byte products (compiled/qgemm_quads.weight_tiles), channel-major: each
    image's patches as quads of k by output position, in blocks of BLOCK positions (uint8 [block, k4, p, t] = the
    code of tap 4 * k4 + t at position block * BLOCK + p, 0 past the positions and past K: a block's quads
    contiguous), multiplied by the weight's signed codes (``weight``
    (M, 4 * K4) int8, k = (c*KH + i)*KW + j, uint8 weights shifted by 128 with their zero points) broadcast a row
    at a time, so each output channel's sums come out along its plane of ``out`` (N, M, OH * OW): no turn of the
    product. The zero points' terms are added after it, per output channel m: zu * (K * zs[m] -
    column_sums[m]) and, where zs[m] (``weight_zeros``, the signed weight's zero points, (M,) int64) is not 0,
    -zs[m] times the patch's sum of codes. The same int32 sums and float64 rescaling as dynamic_conv."""
    plan = dynamic_plan(x, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, 1)
    codes, patches, extremes, parameters, geometry = plan
    for phase in (RANGE, CODES, PATCHES, PRODUCTS):
        if phase == CODES:
            parameters[0], parameters[1] = range_parameters(extremes[0, 0], extremes[1, 0])
        dynamic_phase(phase, x, codes, patches, weight, column_sums, weight_zeros, b_scales, bias, out,
                       extremes, parameters, geometry, 0, 1)


@jit
def dynamic_plan(x, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, tasks, rows=MR):
    """dynamic_conv_quads' buffers for ``tasks`` tasks a phase: (padded codes, patches, extremes (2,
    tasks) float32, parameters (2,) float32, geometry: kh .. right, oh, ow, then the blocks of
    positions, the output channels a product unit takes (a multiple of ``rows``, fewer units' worth where the
    column blocks are too few for the tasks) and the units over them)."""
    batch, channels, height, width = x.shape
    columns, depth4 = weight.shape[0], weight.shape[1] // 4
    blocks = (oh * ow + BLOCK - 1) // BLOCK
    units = batch * blocks
    split = min((columns + rows - 1) // rows, max(1, (tasks + units - 1) // units))
    step = ((columns + split - 1) // split + rows - 1) // rows * rows
    geometry = np.array([kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, blocks, step,
                         (columns + step - 1) // step])
    codes = np.empty(batch * channels * (height + top + bottom) * (width + left + right), np.uint8)
    patches = np.empty(batch * blocks * depth4 * BLOCK * 4, np.uint8)
    return codes, patches, np.empty((2, tasks), np.float32), np.empty(2, np.float32), geometry


@jit
def dynamic_phase(phase, x, codes, patches, weight, column_sums, weight_zeros, b_scales, bias, out, extremes,
                   parameters, geometry, first, end):
    """Tasks first .. end of ``extremes.shape[1]`` of a phase of dynamic_conv_quads (each its share of the phase's
    items): RANGE, x's values (value_range into extremes[:, task]); CODES, the padded code lines (by the scale and
    zero point in ``parameters``); PATCHES, (image, column block) units (their quads); PRODUCTS, (image,
    column block, output channels) units (multiplied and rescaled into out)."""
    kh, kw, sh, sw, dh, dw = geometry[0], geometry[1], geometry[2], geometry[3], geometry[4], geometry[5]
    top, bottom, left, right, oh, ow = geometry[6], geometry[7], geometry[8], geometry[9], geometry[10], geometry[11]
    blocks, step, channel_units = geometry[12], geometry[13], geometry[14]
    tasks = extremes.shape[1]
    batch = x.shape[0]
    if phase == RANGE:
        count = x.size
    elif phase == CODES:
        count = batch * x.shape[1] * (x.shape[2] + top + bottom)
    elif phase == PATCHES:
        count = batch * blocks
    else:
        count = batch * blocks * channel_units
    flat = x.reshape(-1)
    scale, zero = parameters[0], parameters[1]
    shifted = np.any(weight_zeros != 0)
    for task in range(first, end):
        a, b = count * task // tasks, count * (task + 1) // tasks
        if phase == RANGE:
            extremes[0, task], extremes[1, task] = value_range(flat[a:b])
        elif phase == CODES:
            _code_lines(x, scale, zero, top, bottom, left, right, codes, a, b)
        elif phase == PATCHES:
            for unit in range(a, b):
                patch_quads(codes, x.shape[1], x.shape[2] + top + bottom, x.shape[3] + left + right, kh, kw, sh, sw,
                             dh, dw, oh, ow, blocks, weight.shape[1], unit // blocks, unit % blocks, patches)
        else:
            for unit in range(a, b):
                image, rest = unit // (blocks * channel_units), unit % (blocks * channel_units)
                _product_unit(patches, weight, image, rest // channel_units, (rest % channel_units) * step,
                              step, blocks, x.shape[1] * kh * kw, np.int64(zero), column_sums, weight_zeros,
                              np.float64(scale), b_scales, bias, shifted, out)


@jit
def patch_quads(codes, channels, tall, wide, kh, kw, sh, sw, dh, dw, oh, ow, blocks, depth, image, block, patches):
    """Image ``image``'s block ``block`` of patches (of ``blocks`` an image): patches[(((image * blocks + block) *
    K4 + k4) * BLOCK + p) * 4 + t] = the padded code of tap k = 4 * k4 + t at position block * BLOCK + p (0 past the
    taps, ``depth`` bytes a weight row, and past the positions)."""
    taps, masks = _tap_table(channels, tall, wide, kh, kw, dh, dw, depth)
    first = block * BLOCK
    valid = min(first + BLOCK, oh * ow) - first if oh * ow > first else 0
    starts, places, lengths, runs = _position_runs(image * channels * tall, wide, sh, sw, ow, first, valid)
    depth4 = depth // 4
    size = depth4 * BLOCK * 4
    out = patches[(image * blocks + block) * size:(image * blocks + block + 1) * size]
    words = out.view(np.uint32)  # one int32 per position and quad of taps: their four codes, tap 4 * k4 lowest
    step = np.uint64(sw)
    for k4 in range(depth4):
        o0, o1, o2, o3 = taps[4 * k4], taps[4 * k4 + 1], taps[4 * k4 + 2], taps[4 * k4 + 3]
        m0, m1, m2, m3 = masks[4 * k4], masks[4 * k4 + 1], masks[4 * k4 + 2], masks[4 * k4 + 3]
        line = words[k4 * BLOCK:(k4 + 1) * BLOCK]
        for run in range(runs):
            source, place = starts[run], places[run]
            for j in range(lengths[run]):
                at = source + np.uint64(j) * step
                line[place + j] = (np.uint32(codes[at + o0]) & m0) | ((np.uint32(codes[at + o1]) & m1) << 8) \
                    | ((np.uint32(codes[at + o2]) & m2) << 16) | ((np.uint32(codes[at + o3]) & m3) << 24)
        for p in range(valid, BLOCK):
            line[p] = 0


@jit
def _tap_table(channels, tall, wide, kh, kw, dh, dw, depth):
    """Each of ``depth`` taps' offset in an image's padded codes and the mask of its byte: 255, or 0 past the
    C * KH * KW taps (offset 0 there: every read stays in the buffer)."""
    taps = np.zeros(depth, np.uint64)
    masks = np.zeros(depth, np.uint32)
    for c in range(channels):
        for i in range(kh):
            for j in range(kw):
                k = (c * kh + i) * kw + j
                taps[k] = np.uint64((c * tall + i * dh) * wide + j * dw)
                masks[k] = 255
    return taps, masks


@jit
def _position_runs(image_at, wide, sh, sw, ow, first, valid):
    """The runs of positions first .. first + valid along an output row: (each run's first code's offset in the
    padded codes, from the image's ``image_at``; its place in the block; its length; the runs' count)."""
    starts = np.zeros(BLOCK, np.uint64)
    places = np.zeros(BLOCK, np.int64)
    lengths = np.zeros(BLOCK, np.int64)
    runs = 0
    p = 0
    while p < valid:
        r, q = (first + p) // ow, (first + p) % ow
        # unsigned offsets: numba checks signed ones for wraparound, which keeps the gather from vectorizing
        start, length = np.uint64((image_at + r * sh) * wide + q * sw), min(ow - q, valid - p)
        if runs and starts[runs - 1] + np.uint64(lengths[runs - 1] * sw) == start:
            lengths[runs - 1] += length  # the next row goes on where this one ends (no pads, unit stride: a 1x1)
        else:
            starts[runs], places[runs], lengths[runs] = start, p, length
            runs += 1
        p += length
    return starts, places, lengths, runs


@jit
def _product_unit(patches, weight, image, block, m_first, step, blocks, depth, zero, column_sums, weight_zeros,
                  a_scale, b_scales, bias, shifted, out):
    """Output channels m_first .. m_first + step (fewer at M) of image ``image``'s column block ``block``: the
    int32 sums of their weight rows by the block's patches (weight_tiles), then each channel's run of its plane:
    out[image, m, p] = float32(float64(int32(acc + zu * (depth * zs[m] - column_sums[m]) - zs[m] * sums[p])) *
    (a_scale * b_scales[m or 0])) (+ bias[m] in float32), wrapped as an int32 accumulator wraps; sums[p] the
    patch's sum of codes, where ``shifted`` (a zero point zs not 0): the product of a row of ones by the patches."""
    columns, spots = weight.shape[0], out.shape[2]
    m_end = min(m_first + step, columns)
    first = block * BLOCK
    stop = min(first + BLOCK, spots)
    depth4 = weight.shape[1] // 4
    at, vectors = (image * blocks + block) * depth4 * BLOCK * 4, (stop - first + LANES - 1) // LANES
    acc = np.empty((m_end - m_first) * BLOCK, np.int32)
    weight_tiles(weight, m_first, m_end, patches, at, 4 * BLOCK, vectors, acc, BLOCK)
    one, with_bias = b_scales.shape[0] == 1, bias.shape[0] > 0
    # zs[m] times the patches' sums, once for the block where every channel has one zero point (one per tensor),
    # else the sums, multiplied per channel. The terms held as int32, wrapped: the total is wrapped to int32 at the
    # end, so each term counts only modulo 2**32, and the narrower operands vectorize (the sums in int64 ran 1.5x).
    uniform = shifted and np.all(weight_zeros[m_first:m_end] == weight_zeros[m_first])
    block_sums = np.zeros(BLOCK, np.int32)
    if shifted:
        weight_tiles(np.ones((1, weight.shape[1]), np.int8), 0, 1, patches, at, 4 * BLOCK, vectors, block_sums,
                     BLOCK)  # (the patches are 0 past the taps)
        if uniform:
            factor0 = np.int32(weight_zeros[m_first])
            for p in range(stop - first):
                block_sums[p] = np.int32(np.int64(factor0) * block_sums[p])
    for m in range(m_first, m_end):
        factor = a_scale * b_scales[0 if one else m]
        fix = np.int32(zero * (depth * weight_zeros[m] - column_sums[m]))
        zs = np.int64(np.int32(weight_zeros[m])) if shifted else np.int64(0)
        shift = bias[m] if with_bias else np.float32(0)
        row = acc[(m - m_first) * BLOCK:(m - m_first + 1) * BLOCK]
        plane = out[image, m]
        if uniform:
            for p in range(first, stop):
                total = np.int32(np.int64(row[p - first]) + fix - block_sums[p - first])
                plane[p] = np.float32(np.float64(total) * factor) + shift
        elif shifted:
            for p in range(first, stop):
                total = np.int32(np.int64(row[p - first]) + fix - zs * block_sums[p - first])
                plane[p] = np.float32(np.float64(total) * factor) + shift
        else:
            for p in range(first, stop):
                plane[p] = np.float32(np.float64(np.int32(np.int64(row[p - first]) + fix)) * factor) + shift


@jit
def _padded_copy(x, zero, top, bottom, left, right):
    """x's (N, C, H, W) codes in a flat (N, C, H + top + bottom, W + left + right) buffer bordered by ``zero``."""
    batch, channels, height, width = x.shape
    tall, wide = height + top + bottom, width + left + right
    codes = np.empty(batch * channels * tall * wide, x.dtype)
    codes[:] = zero
    flat = x.reshape(-1)
    for line in range(batch * channels * height):
        plane, h = line // height, line % height
        start = (plane * tall + h + top) * wide + left
        codes[start:start + width] = flat[line * width:(line + 1) * width]
    return codes


@jit
def _padded_patch_rows(x, pad, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow):
    """The patch rows (N * OH * OW, C * KH * KW) of ``x`` (N, C, H, W) padded with ``pad``."""
    codes = _padded_copy(x, pad, top, bottom, left, right)
    channels = x.shape[1]
    rows = np.empty((x.shape[0] * oh * ow, channels * kh * kw), x.dtype)
    _patch_rows(codes, channels, x.shape[2] + top + bottom, x.shape[3] + left + right, kh, kw, sh, sw, dh, dw, oh,
                ow, rows)
    return rows


@jit
def _images_by_channel(y, out):
    """Product rows ``y`` (N * spots, M) into ``out`` (N, M, spots)."""
    spots = out.shape[2]
    for b in range(out.shape[0]):
        for m in range(out.shape[1]):
            target = out[b, m]
            for p in range(spots):
                target[p] = y[b * spots + p, m]


@jit
def qlinear_conv(x, x_zero, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, packed, pairs, c, multiplier,
                 zero, low, high, out):
    """QLinearConv of contiguous 8-bit ``x`` (N, C, H, W) into ``out`` (N, M, OH * OW) codes: padding takes x's
    zero point, each output is qgemm.qgemm's saturate(rint((acc + c[m]) * multiplier[m or 0]) + zero) of the
    int32 sum over taps of (code - x_zero) * packed[m, tap]. c (M,) or (0,) int32, multiplier (1,) or (M,)
    float64."""
    rows = _padded_patch_rows(x, x_zero, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow)
    y = np.empty((rows.shape[0], out.shape[1]), out.dtype)
    qgemm(rows, x_zero, packed, pairs, c, multiplier, zero, low, high, True, y)
    _images_by_channel(y, out)


@jit
def quantized_conv(x, pad, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, packed, pairs, multiplier,
                   offset, consts, out):
    """A QDQ Conv group (ops/qdq_linear.quantized_conv) of contiguous ``x`` (N, C, H, W): its 8-bit codes, or
    float32 data quantized as QuantizeLinear does (``consts``, qgemm's layout, says which). Padding takes ``pad``
    (x's zero point, or 0.0, whose code is the zero point: the centred value 0 either way, as the float
    convolution of the dequantized input pads); the patch rows go through qgemm.requantized_product (int32 sum
    of the centred codes times packed (M, C*KH*KW), then requantize_affine per output channel) into ``out``
    (N, M, OH * OW): codes, or their float32 values where consts says dequantize."""
    rows = _padded_patch_rows(x, pad, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow)
    y = np.empty((rows.shape[0], out.shape[1]), out.dtype)
    requantized_product(rows, packed, pairs, multiplier, offset, consts, y)
    _images_by_channel(y, out)


@jit
def _channel_last_centred(x, consts, left, right):
    """x (N, C, 1, W) as centred int16 codes laid out (N, left + W + right, C): code(x[b, c, 0, w]) - zero at
    [b, left + w, c] (x's 8-bit codes, or float32 data quantized as QuantizeLinear does: qgemm's ``consts``),
    0 in the pads (the zero point's code, centred). Centred along x's rows first (vector code), then turned."""
    batch, channels, width = x.shape[0], x.shape[1], x.shape[3]
    centred = np.empty((batch * channels, width), np.int16)
    centred_rows_of(x.reshape(batch * channels, width), consts, centred)
    out = np.zeros((batch, left + width + right, channels), np.int16)
    for b in range(batch):
        for w in range(width):
            line = out[b, left + w]
            for c in range(channels):
                line[c] = centred[b * channels + c, w]
    return out


@jit
def quantized_conv_lines(x, kw, sw, left, right, ow, pairs, multiplier, offset, consts, out):
    """quantized_conv for a 1-D convolution without dilation (``x`` (N, C, 1, W), C even; qgemm_tiles' register
    tiles): x's centred codes laid out channel-last, where each output's window is kw * C consecutive values,
    so the product reads the windows in place, ``sw * C`` apart (qgemm_tiles.strided_product), instead of
    gathering patch rows. ``pairs``: the weight packed in (tap, channel) order, k = j * C + c. The same int32
    sums and requantization as quantized_conv."""
    channels = x.shape[1]
    codes = _channel_last_centred(x, consts, left, right)
    flat, wide = codes.reshape(-1), codes.shape[1] * channels
    acc = np.empty((ow, out.shape[1]), np.int32)
    y = np.empty((ow, out.shape[1]), out.dtype)
    for b in range(x.shape[0]):
        strided_product(flat, b * wide, sw * channels, ow, pairs, acc)
        finish_requantized(acc, multiplier, offset, consts, y)
        _images_by_channel(y, out[b:b + 1])


@jit
def _channel_last_unsigned(x, consts, left, right):
    """x (N, C, 1, W) as unsigned codes laid out (N, left + W + right, C): code(x[b, c, 0, w]) - low at
    [b, left + w, c] (x's 8-bit codes, or float32 data quantized as QuantizeLinear does: qgemm's ``consts``;
    ``low`` the code range's, so int8 codes shift by 128), the zero point's shifted code in the pads. Coded
    along x's rows first (vector code), then turned."""
    batch, channels, width = x.shape[0], x.shape[1], x.shape[3]
    scale, zero = np.float32(consts[A_SCALE]), np.float32(consts[A_ZERO])
    low, high = np.float32(consts[A_LOW]), np.float32(consts[A_HIGH])
    quantize = consts[A_QUANTIZE] != 0
    rows = x.reshape(batch * channels, width)
    coded = np.empty((batch * channels, width), np.uint8)
    for line in range(batch * channels):
        source, target = rows[line], coded[line]
        if quantize:
            for w in range(width):
                target[w] = np.uint8(np.int32(float_code(source[w], scale, zero, low, high) - low))
        else:
            for w in range(width):
                target[w] = np.uint8(np.int32(source[w]) - np.int32(low))
    out = np.empty((batch, left + width + right, channels), np.uint8)
    out[:] = np.uint8(np.int32(zero - low))
    for b in range(batch):
        for w in range(width):
            line = out[b, left + w]
            for c in range(channels):
                line[c] = coded[b * channels + c, w]
    return out


@jit
def _window_sums(codes, kw, sw, sums):
    """sums[r] = the sum of one image's channel-last ``codes`` (positions, C) over window r: kw positions from
    r * sw."""
    totals = np.zeros(codes.shape[0], np.int64)
    for p in range(codes.shape[0]):
        for c in range(codes.shape[1]):
            totals[p] += codes[p, c]
    for r in range(sums.shape[0]):
        total = np.int64(0)
        for j in range(kw):
            total += totals[r * sw + j]
        sums[r] = total


@jit
def _finish_rows(acc, fix, weight_zeros, sums, multiplier, offset, consts, out):
    """out (rows, M) = the requantized codes (or their float32 values) of the int32 sums acc[r, m] + fix[m] -
    weight_zeros[m] * sums[r] (wrapped to int32 as an accumulator wraps): requantize_affine's arithmetic per
    output channel m, ``multiplier`` and ``offset`` (M,)."""
    rows, columns = acc.shape
    z, lo, hi, s = np.float64(consts[Y_ZERO]), np.float64(consts[Y_LOW]), np.float64(consts[Y_HIGH]), \
        np.float64(consts[Y_SCALE])
    dequantize = consts[DEQUANTIZE] != 0
    for r in range(rows):
        line, target, count = acc[r], out[r], sums[r]
        for m in range(columns):
            total = np.int32(np.int64(line[m]) + fix[m] - weight_zeros[m] * count)
            v = requantized_code(np.float64(total), multiplier[m], offset[m], z, lo, hi)
            target[m] = (v - z) * s if dequantize else v


@jit
def quantized_conv_quads(x, kw, sw, left, right, ow, quads, fix, weight_zeros, multiplier, offset, consts, out):
    """quantized_conv_lines on AVX-512 VNNI's byte products (compiled/qgemm_quads, C a multiple of 4): x's codes
    shifted to unsigned and laid out channel-last, each output's window read in place as kw * C bytes, by the
    weight's signed codes in quads (k = j * C + c); the zero points' terms added after the product, per output
    channel m: ``fix`` (M,) int64 = K * zu * zs[m] - zu * sum_k s[k, m] and, where any ``weight_zeros`` zs[m]
    (the signed weight's zero points) is not 0, -zs[m] times each window's sum of codes. The same int32 sums
    and requantization as quantized_conv."""
    channels = x.shape[1]
    codes = _channel_last_unsigned(x, consts, left, right)
    flat, wide = codes.reshape(-1), codes.shape[1] * channels
    columns = out.shape[1]
    acc = np.empty((ow, columns), np.int32)
    y = np.empty((ow, columns), out.dtype)
    sums = np.zeros(ow, np.int64)
    rows_needed = np.any(weight_zeros != 0)
    scales, shifts = np.empty(columns), np.empty(columns)
    scales[:], shifts[:] = multiplier, offset  # (one per tensor, or per channel)
    for b in range(x.shape[0]):
        strided_quads(flat, b * wide, sw * channels, ow, quads, acc)
        if rows_needed:
            _window_sums(codes[b], kw, sw, sums)
        _finish_rows(acc, fix, weight_zeros, sums, scales, shifts, consts, y)
        _images_by_channel(y, out[b:b + 1])
