"""A dynamically quantized convolution in one call (ops/dynamic_quantize_conv.py): onnxruntime's dynamic
quantization writes each Conv as DynamicQuantizeLinear -> ConvInteger -> Cast -> Mul by the scales' product
(-> bias Add). Here the input is quantized as DynamicQuantizeLinear does (one scale and zero point over all of
it), its codes gathered into patch rows (padding takes the zero point's code, as ConvInteger pads), and the
rows multiplied by the packed weight with scaled_product's exact int32 accumulation and float64 rescaling.
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
from .qgemm_quads import strided_quads
from .qgemm_tiles import strided_product
from .quantize import dynamic_parameters, requantized_code


@jit
def _padded_codes(x, scale, zero, top, bottom, left, right):
    """x's (N, C, H, W) DynamicQuantizeLinear codes (compiled/quantize.dynamic_quantize's arithmetic) in a flat
    (N, C, H + top + bottom, W + left + right) buffer whose border holds the zero point's code."""
    batch, channels, height, width = x.shape
    tall, wide = height + top + bottom, width + left + right
    codes = np.empty(batch * channels * tall * wide, np.uint8)
    codes[:] = np.uint8(zero)
    flat = x.reshape(-1)
    for line in range(batch * channels * height):
        plane, h = line // height, line % height
        source = flat[line * width:(line + 1) * width]
        start = (plane * tall + h + top) * wide + left
        target = codes[start:start + width]
        for w in range(width):
            v = np.rint(source[w] / scale) + zero
            v = np.float32(0) if v < 0 else v
            v = np.float32(255) if v > 255 else v
            target[w] = np.int32(v) if v == v else 0
    return codes


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


@jit
def dynamic_conv_quads(x, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, quads, column_sums, weight_zeros,
                       b_scales, bias, out):
    """dynamic_conv on AVX-512 VNNI's byte products (compiled/qgemm_quads): the patch rows of x's codes (unsigned
    already: DynamicQuantizeLinear's) padded with zeros to whole quads, by the weight's signed codes in quads
    (k = (c*KH + i)*KW + j, ``quads`` (K4, M rounded up to 16, 4) int8); the zero points' terms added after the
    product, per output channel m: zu * (K * zs[m] - column_sums[m]) and, where zs[m] (``weight_zeros``, the
    signed weight's zero points, (M,) int64) is not 0, -zs[m] times the patch row's sum of codes. The same int32
    sums and float64 rescaling as dynamic_conv, straight into out (N, M, OH * OW)."""
    scale, zero = dynamic_parameters(x.reshape(-1))
    codes = _padded_codes(x, scale, zero, top, bottom, left, right)
    batch, channels = x.shape[0], x.shape[1]
    spots = oh * ow
    wide = 4 * quads.shape[0]
    rows = np.empty((batch * spots, wide), np.uint8)
    _patch_rows(codes, channels, x.shape[2] + top + bottom, x.shape[3] + left + right, kh, kw, sh, sw, dh, dw, oh,
                ow, rows)
    acc = np.empty((batch * spots, out.shape[1]), np.int32)
    strided_quads(rows.reshape(-1), 0, wide, batch * spots, quads, acc)
    _finish_dynamic(acc, rows, channels * kh * kw, np.int64(zero), column_sums, weight_zeros, np.float64(scale),
                    b_scales, bias, out)


@jit
def _finish_dynamic(acc, rows, depth, zero, column_sums, weight_zeros, a_scale, b_scales, bias, out):
    """out[b, m, p] = float32(total * (a_scale * b_scales[m or 0])) (+ bias[m] in float32) with total the int32
    acc[b * spots + p, m] + zero * (depth * zs[m] - column_sums[m]) - zs[m] * sum(rows[b * spots + p]), wrapped
    as an int32 accumulator wraps: _rescaled_product's arithmetic of the centred sums."""
    columns, spots = out.shape[1], out.shape[2]
    one, with_bias = b_scales.shape[0] == 1, bias.shape[0] > 0
    factors = np.empty(columns)
    fix = np.empty(columns, np.int64)
    shifted = False
    for m in range(columns):
        factors[m] = a_scale * b_scales[0 if one else m]
        fix[m] = zero * (depth * weight_zeros[m] - column_sums[m])
        shifted = shifted or weight_zeros[m] != 0
    sums = np.zeros(acc.shape[0], np.int64)
    if shifted:
        for r in range(acc.shape[0]):
            total = np.int64(0)
            line = rows[r]
            for k in range(line.shape[0]):
                total += line[k]
            sums[r] = total
    for b in range(out.shape[0]):
        for m in range(columns):
            target, f, c, zs = out[b, m], factors[m], fix[m], weight_zeros[m]
            for p in range(spots):
                r = b * spots + p
                y = np.float32(np.float64(np.int32(np.int64(acc[r, m]) + c - zs * sums[r])) * f)
                target[p] = y + bias[m] if with_bias else y


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
