"""A QDQ Conv group's 2-D convolution (ops/qdq_linear.quantized_conv) on AVX-512 VNNI read in place: no patches.

quantized_conv_blocks gathers each image's patches as quads of taps by output position (an im2col of bytes, as
much time as the products on ResNet's 3x3 and 1x1 convolutions). Here the input's codes are laid out once as a grid
of channel quads, four channels' codes interleaved at every padded pixel: grid[image, c4, a, b, Y, X, t] = the
padded code of channel 4 * c4 + t at padded row sh * Y + a and column sw * X + b (a stride's phases as separate
planes, so a unit stride's positions are adjacent in each of them). A position q = y * wide + x of the phase grid
(wide its width) reads tap (i, j) of quad c4 at q plus a fixed offset, so 16 positions' quads are one 64-byte
vector at a table's offset per quad of k (qgemm_quads.grid_tiles, the weight's rows ordered k = ((c4 * KH + i) *
KW + j) * 4 + t to match). Lanes at x >= OW (a row's end, read from the next row's pixels) are computed and dropped:
each vector's lanes that are positions are compressed in the register and stored one after another (a masked store)
from the vector's first position's place in the output plane. The codes are quantized_conv_blocks' bit for bit: the
tiles requantize in float32 first and in float64 where a value lies near a half (qgemm_quads._single_first).

Absent channels (past C, to a whole quad) hold code 0 with weight 0; pads hold the input's zero point. Only where
every weight zero point is 0 (symmetric weights, what the quantization tools write) and the requantization is
finite: the position sums a non-zero zero point needs, and a NaN bias's code 0, stay with quantized_conv_blocks.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .dynamic_conv import BLOCK, CODES, PRODUCTS
from .qgemm import A_LOW, A_QUANTIZE, A_SCALE, A_ZERO, DEQUANTIZE, Y_HIGH, Y_LOW, Y_SCALE, Y_ZERO
from .qgemm_quads import grid_tiles
from .qgemm_tiles import LANES, MR

# geometry's entries past quantized_conv_blocks' 15: the phase grid's rows and width, the channel quads, the
# positions (the last valid one's q plus one) and the vectors of 16 they take
TALL, WIDE, QUADS, POSITIONS, VECTORS = 15, 16, 17, 18, 19
GEOMETRY = 20


@jit
def quantized_conv_grid(x, x_codes, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, terms,
                        factors, shifts, singles, consts, offsets, starts, lanes, out, out_codes):
    """The whole convolution on the calling thread: x (N, C, H, W) float32 or x_codes (N, C, H, W) uint8 (the other
    empty); ``weight`` (M, 4 * C4 * KH * KW) int8 the signed codes in grid order (grid_weight); ``terms`` (M,) int32
    -zu * each row's sum (wrapped; zu the input's zero point shifted to unsigned); factors and shifts (M,) float64;
    singles (3 * M,) float32 their float32 forms and margins (single_params); consts qgemm's layout; offsets,
    starts and lanes grid_tables' for this geometry; out (N, M, OH * OW) float32 or out_codes uint8 (the other
    empty)."""
    codes, geometry = grid_plan(x, x_codes, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, 1)
    for phase in (CODES, PRODUCTS):
        grid_phase(phase, x, x_codes, codes, offsets, starts, lanes, weight, terms, factors, shifts, singles, consts,
                   out, out_codes, geometry, 1, 0, 1)


@jit
def grid_plan(x, x_codes, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, tasks):
    """The grid's buffer for ``tasks`` tasks a phase: (the grid's bytes, with room past the last image for the
    dropped lanes' reads; geometry: kh .. ow, the blocks of BLOCK positions, the output channels a product unit
    takes, the units over them, then TALL .. VECTORS)."""
    batch, channels, height, width = x.shape if x.size else x_codes.shape
    tall, wide = (height + top + bottom + sh - 1) // sh, (width + left + right + sw - 1) // sw
    quads = (channels + 3) // 4
    positions = (oh - 1) * wide + ow
    blocks = (positions + BLOCK - 1) // BLOCK
    columns = weight.shape[0]
    units = batch * blocks
    split = min((columns + MR - 1) // MR, max(1, (tasks + units - 1) // units))
    step = ((columns + split - 1) // split + MR - 1) // MR * MR
    geometry = np.array([kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, blocks, step,
                         (columns + step - 1) // step, tall, wide, quads, positions, (positions + LANES - 1) // LANES])
    # dropped lanes read up to a block and a row past the last image's planes
    codes = np.empty(4 * (batch * quads * sh * sw * tall * wide + BLOCK + wide), np.uint8)
    codes[4 * batch * quads * sh * sw * tall * wide:] = 0
    return codes, geometry


@jit
def grid_tables(channels, height, width, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow):
    """What the tiles read by for a geometry, made once per geometry by the caller: (each quad of k's byte offset
    from a position's; each vector's first place in a plane and the mask of its lanes that are positions)."""
    tall, wide = (height + top + bottom + sh - 1) // sh, (width + left + right + sw - 1) // sw
    quads = (channels + 3) // 4
    positions = (oh - 1) * wide + ow
    vectors = (positions + LANES - 1) // LANES
    offsets = np.empty(quads * kh * kw, np.int64)
    for c4 in range(quads):
        for i in range(kh):
            for j in range(kw):
                plane = (c4 * sh + i * dh % sh) * sw + j * dw % sw
                offsets[(c4 * kh + i) * kw + j] = 4 * ((plane * tall + i * dh // sh) * wide + j * dw // sw)
    starts = np.empty(vectors, np.int64)
    lanes = np.empty(vectors, np.int64)
    placed, column = 0, 0  # the positions stored before q, and q's column (q % wide)
    for v in range(vectors):
        starts[v] = placed
        mask = 0
        for lane in range(LANES):
            if v * LANES + lane < positions and column < ow:
                mask |= 1 << lane
                placed += 1
            column = 0 if column + 1 == wide else column + 1
        lanes[v] = mask
    return offsets, starts, lanes


@jit
def grid_phase(phase, x, x_codes, codes, offsets, starts, lanes, weight, terms, factors, shifts, singles, consts,
               out, out_codes, geometry, tasks, first, end):
    """Tasks first .. end of ``tasks`` of a phase of quantized_conv_grid (each its share of the phase's items):
    CODES, the grid's planes ((image, quad, row phase) units, each with its column phases); PRODUCTS, (image,
    block of positions, output channels) units."""
    batch = x.shape[0] if x.size else x_codes.shape[0]
    sh, quads = geometry[2], geometry[QUADS]
    blocks, channel_units = geometry[12], geometry[14]
    count = batch * quads * sh if phase == CODES else batch * blocks * channel_units
    words, flat, raw = codes.view(np.uint32), x.reshape(-1), x_codes.reshape(-1)
    for task in range(first, end):
        a, b = count * task // tasks, count * (task + 1) // tasks
        for unit in range(a, b):
            if phase == CODES:
                _grid_planes(x.shape if x.size else x_codes.shape, flat, raw, consts, geometry, words, unit)
            else:
                _grid_unit(codes, offsets, starts, lanes, weight, terms, factors, shifts, singles, consts, out,
                           out_codes, geometry, unit)


@jit
def _grid_planes(shape, flat, raw, consts, geometry, words, unit):
    """Unit (image * quads + c4) * sh + a of the grid: the padded rows sh * Y + a of channels 4 * c4 .. 4 * c4 + 3,
    in each column phase's plane. Codes less the code range's low end (uint8 as they are, int8 plus 128, float32
    data quantized as QuantizeLinear does, the zero point and range shifted alike); pads the shifted zero point;
    absent channels 0. Where the rows have no side pads and unit stride, a plane's real rows are one run. A phase
    no tap reads (a strided 1x1 convolution's but the first) is left unwritten: only dropped lanes read it."""
    kh, kw, sh, sw, dh, dw = geometry[0], geometry[1], geometry[2], geometry[3], geometry[4], geometry[5]
    top, left, right = geometry[6], geometry[8], geometry[9]
    tall, wide, quads = geometry[TALL], geometry[WIDE], geometry[QUADS]
    channels, height, width = shape[1], shape[2], shape[3]
    a, rest = unit % sh, unit // sh
    c4, image = rest % quads, rest // quads
    if not _phase_read(a, kh, dh, sh):
        return
    present = min(4, channels - 4 * c4)
    low = consts[A_LOW]
    pad = np.uint32(np.int32(consts[A_ZERO] - low))
    pad_word = np.uint32(0)
    for t in range(present):
        pad_word |= pad << np.uint32(8 * t)
    quantize = flat.size > 0 and consts[A_QUANTIZE] != 0
    scale, zero = np.float32(consts[A_SCALE]), np.float32(consts[A_ZERO] - low)
    flip = np.uint32(128) if low < 0 else np.uint32(0)
    plane = np.uint64(height * width)
    channel_at = (image * channels + 4 * c4) * height
    for b in range(sw):
        if not _phase_read(b, kw, dw, sw):
            continue
        # the columns X whose padded column sw * X + b is a real one: lo .. hi
        lo = max(0, (left - b + sw - 1) // sw)
        hi = max(lo, min(wide, (left + width - 1 - b) // sw + 1))
        base = (((image * quads + c4) * sh + a) * sw + b) * tall * wide
        row = 0
        while row < tall:
            line = np.uint64(base + row * wide)
            h = sh * row + a - top
            if h < 0 or h >= height:
                _fill_words(words, line, wide, pad_word)
                row += 1
                continue
            # rows run together where a row's real columns end where the next one's begin
            rows = 1
            if sw == 1 and left == 0 and right == 0 and sh == 1:
                rows = min(tall - row, height - h)
            _fill_words(words, line, lo, pad_word)
            count = (hi - lo) + (rows - 1) * wide
            source = np.uint64((channel_at + h) * width + sw * lo + b - left)
            at = line + np.uint64(lo)
            if quantize:
                _quantized_words(flat, source, plane, np.uint64(sw), present, scale, zero, words, at, count)
            else:
                _code_words(raw, source, plane, np.uint64(sw), present, flip, words, at, count)
            _fill_words(words, line + np.uint64((rows - 1) * wide + hi), wide - hi, pad_word)
            row += rows


@jit
def _phase_read(phase, taps, dilation, stride):
    """Whether some tap i of ``taps`` reads phase ``phase`` of a stride: i * dilation % stride == phase."""
    for i in range(taps):
        if i * dilation % stride == phase:
            return True
    return False


@jit
def _fill_words(words, at, count, value):
    for p in range(count):
        words[at + np.uint64(p)] = value


@jit
def _quad_planes(source, plane, present):
    """The four channels' first offsets and byte masks of a quad of which ``present`` channels are real, as scalars
    (arrays cost an allocation per row run): an absent channel reads the last real one's codes (in bounds) and
    masks them off, so one branch-free loop serves."""
    one, two, three = np.uint64(min(1, present - 1)), np.uint64(min(2, present - 1)), np.uint64(present - 1)
    full, none = np.uint32(255), np.uint32(0)
    return (source, source + one * plane, source + two * plane, source + three * plane,
            full, full if present > 1 else none, full if present > 2 else none, full if present > 3 else none)


@jit
def _code_words(raw, source, plane, stride, present, flip, words, at, count):
    """words[at:][:count] = four channels' codes (planes ``plane`` apart from raw[source], ``stride`` apart along
    the row) as one word each, channel 4 * c4 lowest, each code's byte xor ``flip``, an absent channel's 0 (past
    ``present``). Unsigned offsets and 32-bit words throughout (numba widens a uint64 mixed with an int64 to
    float64): the loop vectorizes."""
    s0, s1, s2, s3, m0, m1, m2, m3 = _quad_planes(source, plane, present)
    eight, sixteen, twenty_four = np.uint32(8), np.uint32(16), np.uint32(24)
    for p in range(count):
        d = np.uint64(p) * stride
        words[at + np.uint64(p)] = (((np.uint32(raw[s0 + d]) ^ flip) & m0)
                                    | (((np.uint32(raw[s1 + d]) ^ flip) & m1) << eight)
                                    | (((np.uint32(raw[s2 + d]) ^ flip) & m2) << sixteen)
                                    | (((np.uint32(raw[s3 + d]) ^ flip) & m3) << twenty_four))


@jit
def _quantized_words(values, source, plane, stride, present, scale, zero, words, at, count):
    """_code_words of float32 data quantized as QuantizeLinear does (rint(v / scale) + zero saturated to [0, 255],
    ``zero`` the shifted zero point; NaN as 0). The offsets and masks in scalars: read from their arrays inside the
    loop, the loop ran a value at a time (light Inception v2, one thread, 16.7 -> 26.9 ms)."""
    s0, s1, s2, s3, m0, m1, m2, m3 = _quad_planes(source, plane, present)
    top, eight, sixteen, twenty_four = np.float32(255), np.uint32(8), np.uint32(16), np.uint32(24)
    for p in range(count):
        d = np.uint64(p) * stride
        v0 = np.rint(values[s0 + d] / scale) + zero
        v1 = np.rint(values[s1 + d] / scale) + zero
        v2 = np.rint(values[s2 + d] / scale) + zero
        v3 = np.rint(values[s3 + d] / scale) + zero
        v0 = top if v0 > top else (np.float32(0) if v0 < 0 else v0)
        v1 = top if v1 > top else (np.float32(0) if v1 < 0 else v1)
        v2 = top if v2 > top else (np.float32(0) if v2 < 0 else v2)
        v3 = top if v3 > top else (np.float32(0) if v3 < 0 else v3)
        c0 = np.uint32(np.int32(v0) if v0 == v0 else 0)
        c1 = np.uint32(np.int32(v1) if v1 == v1 else 0)
        c2 = np.uint32(np.int32(v2) if v2 == v2 else 0)
        c3 = np.uint32(np.int32(v3) if v3 == v3 else 0)
        words[at + np.uint64(p)] = (c0 & m0) | ((c1 & m1) << eight) | ((c2 & m2) << sixteen) \
            | ((c3 & m3) << twenty_four)


@jit
def _grid_unit(codes, offsets, starts, lanes, weight, terms, factors, shifts, singles, consts, out, out_codes,
               geometry, unit):
    """Product unit (image, block, channel group): output channels m_first .. m_first + step (fewer at M) of the
    block's positions, requantized in the tiles and stored into their planes."""
    blocks, step, channel_units = geometry[12], geometry[13], geometry[14]
    oh, ow, sh, sw = geometry[10], geometry[11], geometry[2], geometry[3]
    tall, wide, quads, vectors = geometry[TALL], geometry[WIDE], geometry[QUADS], geometry[VECTORS]
    image, rest = unit // (blocks * channel_units), unit % (blocks * channel_units)
    block, m_first = rest // channel_units, (rest % channel_units) * step
    columns = terms.shape[0]
    m_end = min(m_first + step, columns)
    first_vector = block * (BLOCK // LANES)
    count = min(BLOCK // LANES, vectors - first_vector)
    spots = oh * ow
    b_at = 4 * (image * quads * sh * sw * tall * wide + block * BLOCK)
    z, s = np.float64(consts[Y_ZERO]), np.float64(consts[Y_SCALE])
    bounds = np.empty(4, np.float64)
    bounds[0], bounds[1] = np.float64(consts[Y_LOW]) - z, np.float64(consts[Y_HIGH]) - z
    bounds[2], bounds[3] = z, s
    target = (image * columns + m_first) * spots
    if consts[DEQUANTIZE] != 0:
        grid_tiles(weight, m_first, m_end, codes, b_at, offsets, count, terms, factors, shifts, singles, bounds,
                   out.reshape(-1), target, spots, starts, lanes, first_vector)
    else:
        grid_tiles(weight, m_first, m_end, codes, b_at, offsets, count, terms, factors, shifts, singles, bounds,
                   out_codes.reshape(-1), target, spots, starts, lanes, first_vector)


def grid_weight(w: np.ndarray, input_zero: int) -> tuple[np.ndarray, np.ndarray]:
    """An 8-bit weight (M, C, KH, KW) in the grid's order: ((M, 4 * C4 * KH * KW) int8 signed codes, k = ((c4 *
    KH + i) * KW + j) * 4 + t for channel 4 * c4 + t, 0 for absent channels; (M,) int32 terms, -input_zero times
    each row's sum, wrapped as the tiles' sums wrap). uint8 codes shift down by 128 (their zero points too: the
    callers take this path where the shifted ones are 0)."""
    shift = 128 if w.dtype == np.uint8 else 0
    signed = w.astype(np.int16) - shift
    m, c, kh, kw = signed.shape
    quads = (c + 3) // 4
    padded = np.zeros((m, 4 * quads, kh, kw), np.int8)
    padded[:, :c] = signed
    rows = np.ascontiguousarray(padded.reshape(m, quads, 4, kh, kw).transpose(0, 1, 3, 4, 2)).reshape(m, -1)
    terms = -np.int64(input_zero) * signed.reshape(m, -1).sum(axis=1, dtype=np.int64)
    return rows, terms.astype(np.uint32).view(np.int32)


def single_params(factors: np.ndarray, shifts: np.ndarray, low: int, high: int, zero: int) -> np.ndarray:
    """The tiles' float32 try of the requantization (qgemm_quads._single_first): per output channel its factor and
    shift rounded to float32 and a margin below a half. The float32 value v = fma(float32(total), f, s) is off the
    float64 one by at most about 2^-23 (|total * factor|) + 2^-24 (|shift| + |v|); where the saturation does not
    settle the code |v| <= V (the codes' range off the zero point, plus one) and |total * factor| <= V + |shift|,
    so 2^-21 (V + |shift| + 1) bounds it with room to spare. A factor or shift too large or too small for float32's
    relative bounds gets margin -1: the float64 way for every tile."""
    v = max(abs(low - zero), abs(high - zero)) + 1
    magnitude = np.abs(factors)
    fits = np.isfinite(factors) & np.isfinite(shifts) & (magnitude <= 2.0 ** 100) \
        & ((magnitude == 0) | (magnitude >= 2.0 ** -100)) & (np.abs(shifts) <= 2.0 ** 20)
    margins = np.where(fits, 0.5 - 2.0 ** -21 * (v + np.abs(shifts) + 1), -1.0)
    return np.ascontiguousarray(np.stack([factors, np.where(fits, shifts, 0.0), margins], axis=1),
                                dtype=np.float32).reshape(-1)
