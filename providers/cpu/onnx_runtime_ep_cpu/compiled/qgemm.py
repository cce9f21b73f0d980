"""Integer matrix products of 8-bit operands with 32-bit accumulation: MatMulInteger, QLinearMatMul, QGemm,
MatMulIntegerToFloat and DynamicQuantizeMatMul, (A - a_zero) @ (B - b_zero) exactly, wrapping as an int32
accumulator does.

B (the weight, usually constant) is packed once per set of constant inputs as int16 (N, K): each column
with its zero point already subtracted (-255 .. 255 fits). Where qgemm_tiles' register tiles run, a kept weight
is only their pairs (qgemm_tiles.compact), with an (N, 0) stub in the packed argument. Each row of A is
centred into an int16 row buffer, and every output is a dot product of two contiguous int16 rows summed in
int32: the pattern LLVM turns into vpmaddwd on AVX2 (16 products, pairwise added into 8 int32 lanes per
instruction; numba compiles for the host CPU, so wider or VNNI instructions are LLVM's choice where present), the same
integers either way. Integer addition is
associative modulo 2**32, so the result equals the exact int64 sum wrapped to int32 whatever the order.
"""

from __future__ import annotations

import numpy as np

from . import jit, qgemm_tiles
from .qgemm_tiles import (
    LANES,
    compact,  # noqa: F401  (the callers' way to keep a constant weight: its pairs only, where tiles run)
    pairs_for,  # noqa: F401  (the callers' way to a packed weight's pairs)
    tile_product,
)
from .quantize import dynamic_parameters, requantize_affine, requantized_code

_TILES = qgemm_tiles.AVAILABLE  # a constant for numba: the branch on it compiles away
_BLOCK = 32  # columns of packed B per pass over A: 32 rows of K int16 stay in the L1/L2 cache


@jit
def pack_columns(b, zero, out):
    """out[n, k] = b[k, n] - zero[n] (or zero[0] for a single zero point) as int16; b is (K, N)."""
    depth, columns = b.shape
    single = zero.shape[0] == 1
    for n in range(columns):
        z = np.int16(zero[0] if single else zero[n])
        for k in range(depth):
            out[n, k] = np.int16(b[k, n]) - z


@jit
def _centre(a, zero, out):
    """out[m, k] = a[m, k] - zero[m or 0] as int16 for (M, K) 8-bit ``a``."""
    single = zero.shape[0] == 1
    for m in range(a.shape[0]):
        z = np.int16(zero[0] if single else zero[m])
        for k in range(a.shape[1]):
            out[m, k] = np.int16(a[m, k]) - z


@jit
def float_code(x, scale, zero, low, high):
    """QuantizeLinear of one float32 value: x / scale in float32, rounded half to even, plus the zero point,
    saturated to [low, high] (NaN gives code 0); all float32."""
    v = np.rint(x / scale) + zero
    v = low if v < low else v
    v = high if v > high else v
    return v if v == v else np.float32(0)


@jit
def _centred_rows(a, scale, zero, low, high, quantize, out):
    """out[m, k] = code(a[m, k]) - zero as int16 for (M, K) ``a``: its 8-bit codes, or with ``quantize``
    float32 data quantized as QuantizeLinear does."""
    z, lo, hi = np.float32(zero), np.float32(low), np.float32(high)
    for m in range(a.shape[0]):
        if quantize:
            for k in range(a.shape[1]):
                out[m, k] = np.int16(float_code(a[m, k], scale, z, lo, hi) - z)
        else:
            for k in range(a.shape[1]):
                out[m, k] = np.int16(a[m, k]) - np.int16(zero)


@jit
def centred_columns(b, scale, zero, low, high, quantize, out):
    """out[n, k] = code(b[k, n]) - zero as int16 for (K, N) ``b``: B packed like a weight, per tensor."""
    z, lo, hi = np.float32(zero), np.float32(low), np.float32(high)
    for n in range(b.shape[1]):
        if quantize:
            for k in range(b.shape[0]):
                out[n, k] = np.int16(float_code(b[k, n], scale, z, lo, hi) - z)
        else:
            for k in range(b.shape[0]):
                out[n, k] = np.int16(b[k, n]) - np.int16(zero)


_NO_PAIRS = np.zeros((0, 0, 2), np.int16)  # the products of a B packed per call: the portable loop


@jit
def _centred_product(centred, packed, pairs, out):
    """out[m, n] = sum_k centred[m, k] * packed[n, k] in int32 for int16 (M, K) and (N, K): by qgemm_tiles'
    register tiles where B has its ``pairs`` (qgemm_tiles.pairs_for; none: an empty array), else here, blocks of
    columns of B taking turns, each against every row of A."""
    rows, depth = centred.shape
    # (always where qgemm_tiles.compact left an (N, 0) stub for packed; out is C-contiguous: numba types the
    # tile call for that layout only)
    if pairs.shape[0] > 0:
        if rows:
            tile_product(centred, pairs, out)
        return
    columns = packed.shape[0]
    for first in range(0, columns, _BLOCK):
        end = min(first + _BLOCK, columns)
        for m in range(rows):
            row = centred[m]
            for n in range(first, end):
                column = packed[n]
                acc = np.int32(0)
                for k in range(depth):
                    acc += np.int32(row[k]) * np.int32(column[k])
                out[m, n] = acc


@jit
def product(a, zero, packed, pairs, out):
    """out[m, n] = sum_k (a[m, k] - zero[m or 0]) * packed[n, k] in int32; a is (M, K) 8-bit, packed (N, K)
    int16 and its pairs (see _centred_product), out (M, N) int32."""
    centred = np.empty(a.shape, np.int16)
    _centre(a, zero, centred)
    _centred_product(centred, packed, pairs, out)


# The layout of the ``consts`` array the requantizing products take (one float64 array: fewer arguments to
# type-check per call): A's scale (a float32 value), zero point and code range, whether A is float32 data
# to quantize, the output's zero point, code range and scale, whether to dequantize, then B's as A's.
A_SCALE, A_ZERO, A_LOW, A_HIGH, A_QUANTIZE, Y_ZERO, Y_LOW, Y_HIGH, Y_SCALE, DEQUANTIZE = range(10)
B_SCALE, B_ZERO, B_LOW, B_HIGH, B_QUANTIZE = range(10, 15)
CONSTS = 15


@jit
def finish_requantized(acc, multiplier, offset, consts, out):
    """requantize_affine of an (M, N) accumulator into ``out``: per column n, or per tensor for one
    multiplier."""
    rows, columns = acc.shape
    layout = (1, 1, rows * columns) if multiplier.shape[0] == 1 else (rows, columns, 1)
    requantize_affine(acc.reshape(layout), multiplier, offset, consts[Y_ZERO], consts[Y_LOW], consts[Y_HIGH],
                      consts[Y_SCALE], consts[DEQUANTIZE] != 0, out.reshape(layout))


@jit
def centred_rows_of(a, consts, out):
    _centred_rows(a, np.float32(consts[A_SCALE]), consts[A_ZERO], consts[A_LOW], consts[A_HIGH],
                  consts[A_QUANTIZE] != 0, out)


@jit
def requantized_product(a, packed, pairs, multiplier, offset, consts, out):
    """A QDQ MatMul/Gemm on integers: the int32 acc[m, n] = sum_k (code(a[m, k]) - a_zero) * packed[n, k], then
    quantize.requantize_affine per column n (the output codes, or dequantized, their float32 values).

    ``a`` is (M, K): 8-bit codes, or float32 data quantized here as QuantizeLinear does (``consts``, laid out
    as above, says which and holds the parameters). packed (N, K) int16 (pack_columns) and its pairs
    (_centred_product), multiplier and offset
    (N,) or (1,) float64, out (M, N) of the codes' type or float32."""
    rows, depth = a.shape
    centred = np.empty((rows, depth), np.int16)
    centred_rows_of(a, consts, centred)
    acc = np.empty((rows, packed.shape[0]), np.int32)
    _centred_product(centred, packed, pairs, acc)
    finish_requantized(acc, multiplier, offset, consts, out)


# The layout of ``members``, requantized_group's rows (float64, one per member): its first column in the joined
# product, its width, then its output's zero point, code range and scale.
G_FIRST, G_WIDTH, G_ZERO, G_LOW, G_HIGH, G_SCALE = range(6)
GROUP_COLUMNS = 6


@jit
def requantized_group(a, packed, pairs, multiplier, offset, consts, members, out):
    """requantized_product of several QDQ products of one A (a layer's query, key and value, or its gate and
    up projections) as one: A quantized once, one int32 product by the members' weights side by side (packed
    (N, K) over all their columns, multiplier and offset (N,) per joined column), then member g's columns
    finished with its own output zero point, code range and scale (``members``, laid out as above) into its
    own contiguous (M, width) block of the flat ``out``, starting at M * first. Each member's values are what
    requantized_product gives it alone: the same codes, integers and float64 requantization per column."""
    rows, depth = a.shape
    centred = np.empty((rows, depth), np.int16)
    centred_rows_of(a, consts, centred)
    acc = np.empty((rows, packed.shape[0]), np.int32)
    _centred_product(centred, packed, pairs, acc)
    dequantize = consts[DEQUANTIZE] != 0
    for g in range(members.shape[0]):
        first, width = int(members[g, G_FIRST]), int(members[g, G_WIDTH])
        z, lo, hi, s = members[g, G_ZERO], members[g, G_LOW], members[g, G_HIGH], members[g, G_SCALE]
        block = out[rows * first:rows * (first + width)].reshape((rows, width))
        scales, offsets = multiplier[first:first + width], offset[first:first + width]
        # (slices and the branch outside the loops: indexing the joined arrays per element kept LLVM from
        # vectorizing it, 4x slower than requantize_affine's loop)
        for m in range(rows):
            line, sums = block[m], acc[m, first:first + width]
            if dequantize:
                for j in range(width):
                    line[j] = (requantized_code(np.float64(sums[j]), scales[j], offsets[j], z, lo, hi) - z) * s
            else:
                for j in range(width):
                    line[j] = requantized_code(np.float64(sums[j]), scales[j], offsets[j], z, lo, hi)


# The layout of ``after``, requantized_product_rounded's second rounding (float64): scale, zero point, code range.
AFTER_SCALE, AFTER_ZERO, AFTER_LOW, AFTER_HIGH = range(4)


@jit
def requantized_product_rounded(a, packed, pairs, multiplier, offset, consts, row, after, out):
    """requantized_product's float32 values (``consts[DEQUANTIZE]`` on), plus a float32 ``row`` (N,) or (1,)
    added in float32, then rounded to the grid of ``after`` as QuantizeLinear -> DequantizeLinear round them
    (fake_quantize_row): a QDQ MatMul whose bias Add comes after its output's rounding, the same float32
    operations as the Add and QuantizeDequantize nodes, in the same pass."""
    requantized_product(a, packed, pairs, multiplier, offset, consts, out)
    s, z = np.float32(after[AFTER_SCALE]), np.float32(after[AFTER_ZERO])
    lo, hi = np.float32(after[AFTER_LOW]), np.float32(after[AFTER_HIGH])
    # one pass per row, each branch a plain loop over n (an index chosen per element, or the rounding called on
    # the row in place, kept LLVM from vectorizing it): fake_quantize_row's operations on line[n] + row[n]
    zero_value = (np.float32(0) - z) * s
    for m in range(out.shape[0]):
        line = out[m]
        if row.shape[0] == 1:
            b = row[0]
            for n in range(line.shape[0]):
                q = np.rint((line[n] + b) / s) + z
                q = lo if q < lo else q
                q = hi if q > hi else q
                line[n] = (q - z) * s if q == q else zero_value
        else:
            for n in range(line.shape[0]):
                q = np.rint((line[n] + row[n]) / s) + z
                q = lo if q < lo else q
                q = hi if q > hi else q
                line[n] = (q - z) * s if q == q else zero_value


# The layout of ``afters``, requantized_group_rounded's rows (float64, one per member): ``after``'s four values,
# then whether the member has a rounded add at all.
AFTER_ON = 4
AFTER_COLUMNS = 5


@jit
def _round_added(out, row, s, z, lo, hi):
    """out[m, n] = fake_quantize_row(out[m, n] + row[n]) in place for float32 (M, N) ``out`` and (N,) ``row``:
    requantized_product_rounded's per-column branch (the same float32 operations)."""
    zero_value = (np.float32(0) - z) * s
    for m in range(out.shape[0]):
        line = out[m]
        for n in range(line.shape[0]):
            q = np.rint((line[n] + row[n]) / s) + z
            q = lo if q < lo else q
            q = hi if q > hi else q
            line[n] = (q - z) * s if q == q else zero_value


@jit
def requantized_group_rounded(a, packed, pairs, multiplier, offset, consts, members, row, afters, out):
    """requantized_group's float32 values (``consts[DEQUANTIZE]`` on), then per member with ``afters[g,
    AFTER_ON]`` its rounded add (requantized_product_rounded's second rounding): the joined float32 ``row`` (N,),
    the member's columns of it (a row of one value repeated over them), added to its block and rounded to the grid
    of ``afters[g]`` (AFTER_SCALE .. AFTER_HIGH): an encoder layer's query, key and value Linear layers, each
    what its own QuantizedMatMul gives."""
    requantized_group(a, packed, pairs, multiplier, offset, consts, members, out)
    rows = a.shape[0]
    for g in range(members.shape[0]):
        if afters[g, AFTER_ON] == 0:
            continue
        first, width = int(members[g, G_FIRST]), int(members[g, G_WIDTH])
        block = out[rows * first:rows * (first + width)].reshape((rows, width))
        _round_added(block, row[first:first + width], np.float32(afters[g, AFTER_SCALE]),
                     np.float32(afters[g, AFTER_ZERO]), np.float32(afters[g, AFTER_LOW]),
                     np.float32(afters[g, AFTER_HIGH]))


@jit
def _centred_pairs(b, scale, zero, low, high, quantize, out):
    """centred_columns straight into qgemm_tiles' pairs: out[k2, n, t] = code(b[2*k2 + t, n]) - zero as int16 for
    (K, N) ``b``, zero past K and past N; a row of B is a contiguous run of n."""
    z, lo, hi = np.float32(zero), np.float32(low), np.float32(high)
    depth, columns = b.shape
    out[:] = 0
    for k in range(depth):
        k2, t = k // 2, k % 2
        if quantize:
            for n in range(columns):
                out[k2, n, t] = np.int16(float_code(b[k, n], scale, z, lo, hi) - z)
        else:
            for n in range(columns):
                out[k2, n, t] = np.int16(b[k, n]) - np.int16(zero)


@jit
def requantized_batched_product(a, b, multiplier, offset, consts, out):
    """requantized_product of stacked operands, (L, M, K) ``a`` by (L, K, N) ``b`` (both varying: attention's
    products), each b[i] quantized (or centred) into the packed form on the fly (qgemm_tiles' pairs where the
    host has the tiles); per-tensor parameters."""
    count, rows, depth = a.shape
    columns = b.shape[2]
    centred = np.empty((rows, depth), np.int16)
    acc = np.empty((rows, columns), np.int32)
    b_scale, b_zero = np.float32(consts[B_SCALE]), consts[B_ZERO]
    b_low, b_high, b_quantize = consts[B_LOW], consts[B_HIGH], consts[B_QUANTIZE] != 0
    if _TILES:
        pairs = np.empty(((depth + 1) // 2, (columns + LANES - 1) // LANES * LANES, 2), np.int16)
        for i in range(count):
            centred_rows_of(a[i], consts, centred)
            _centred_pairs(b[i], b_scale, b_zero, b_low, b_high, b_quantize, pairs)
            tile_product(centred, pairs, acc)
            finish_requantized(acc, multiplier, offset, consts, out[i])
        return
    packed = np.empty((columns, depth), np.int16)
    for i in range(count):
        centred_rows_of(a[i], consts, centred)
        centred_columns(b[i], b_scale, b_zero, b_low, b_high, b_quantize, packed)
        _centred_product(centred, packed, _NO_PAIRS, acc)
        finish_requantized(acc, multiplier, offset, consts, out[i])


@jit
def scaled_product(a, a_zero, packed, pairs, a_scale, b_scales, bias, out):
    """MatMulIntegerToFloat: out[m, n] = float32(acc * (a_scale * b_scales[n or 0])), plus the float32 bias[n]
    in float32 when ``bias`` is not empty, with acc the int32 sum_k (a[m, k] - a_zero) * packed[n, k]: numpy's
    order of the same float64 products. a (M, K) 8-bit, a_scale the float64 value of a float32 scale,
    b_scales (1,) or (N,) float64, bias (N,) or (0,) float32, out (M, N) float32."""
    rows, depth = a.shape
    centred = np.empty((rows, depth), np.int16)
    _centre(a, np.full(1, a_zero, np.int32), centred)
    _rescaled_product(centred, packed, pairs, a_scale, b_scales, bias, out)


@jit
def _rescaled_product(centred, packed, pairs, a_scale, b_scales, bias, out):
    """scaled_product from A's centred int16 rows."""
    rows, columns = centred.shape[0], packed.shape[0]
    acc = np.empty((rows, columns), np.int32)
    _centred_product(centred, packed, pairs, acc)
    one = b_scales.shape[0] == 1
    with_bias = bias.shape[0] > 0
    for m in range(rows):
        for n in range(columns):
            y = np.float32(np.float64(acc[m, n]) * (a_scale * b_scales[0 if one else n]))
            out[m, n] = y + bias[n] if with_bias else y


@jit
def dynamic_scaled_product(a, packed, pairs, b_scales, bias, out):
    """DynamicQuantizeMatMul in one call: A (M, K) float32 quantized as DynamicQuantizeLinear does (one scale
    and zero point over all of A, compiled/quantize.dynamic_parameters), its centred codes kept as int16
    (code - zero, never an 8-bit tensor), then scaled_product's integer product and rescaling, the same bits
    as the two nodes. packed (N, K) int16, b_scales (1,) or (N,) float64, bias (N,) or (0,) float32."""
    centred, scale = _dynamic_centred(a)
    _rescaled_product(centred, packed, pairs, scale, b_scales, bias, out)


@jit
def _dynamic_centred(a):
    """DynamicQuantizeLinear's codes of (M, K) float32 ``a`` minus their zero point, as int16, and the scale
    (the float64 value of the float32 scale)."""
    rows, depth = a.shape
    scale, zero = dynamic_parameters(a.reshape(-1))
    centred = np.empty((rows, depth), np.int16)
    for m in range(rows):
        for k in range(depth):
            v = np.rint(a[m, k] / scale) + zero
            v = np.float32(0) if v < 0 else v
            v = np.float32(255) if v > 255 else v
            centred[m, k] = np.int16(v - zero) if v == v else np.int16(-zero)
    return centred, np.float64(scale)


@jit
def dynamic_scaled_group(a, packed, pairs, b_scales, bias, out):
    """Several DynamicQuantizeMatMul of one A (a layer's query, key and value projections) as one: A quantized
    once, one integer product by the members' weights side by side (packed (G * W, K), b_scales and bias per
    column of that), member g's columns rescaled into out[g] (out (G, M, W) float32). Each output is what
    dynamic_scaled_product gives for that member alone: the same codes, integers and float64 rescaling."""
    centred, scale = _dynamic_centred(a)
    rows, columns = centred.shape[0], packed.shape[0]
    acc = np.empty((rows, columns), np.int32)
    _centred_product(centred, packed, pairs, acc)
    with_bias = bias.shape[0] > 0
    width = out.shape[2]
    for g in range(out.shape[0]):
        first = g * width
        for m in range(rows):
            line = out[g, m]
            for j in range(width):
                n = first + j
                y = np.float32(np.float64(acc[m, n]) * (scale * b_scales[n]))
                line[j] = y + bias[n] if with_bias else y


@jit
def batched_product(a, a_zero, b, b_zero, out):
    """out[i] = (a[i] - a_zero) @ (b[i] - b_zero) in int32 for (L, M, K) ``a`` and (L, K, N) ``b`` (both
    operands varying: attention's products), each b[i] packed on the fly like a weight."""
    count, rows, depth = a.shape
    columns = b.shape[2]
    packed = np.empty((columns, depth), np.int16)
    zero = np.full(1, a_zero, np.int32)
    b_zeros = np.full(1, b_zero, np.int32)
    for i in range(count):
        pack_columns(b[i], b_zeros, packed)
        product(a[i], zero, packed, _NO_PAIRS, out[i])


@jit
def qgemm(a, a_zero, packed, pairs, c, multiplier, zero, low, high, quantized, out):
    """QGemm with a non-transposed A: acc[m, n] = sum_k (a[m, k] - a_zero) * packed[n, k] + c[n or 0] in int32
    (wrapping as the accumulator does; ``c`` empty: no C), then with ``quantized`` the code
    saturate(rint(acc * multiplier[n or 0]) + zero) (NaN: 0), else float32(acc * multiplier[n or 0]): the
    float64 products numpy forms. a (M, K) 8-bit, packed (N, K) int16, c int32 (1,), (N,) or (0,), multiplier
    float64 (1,) or (N,), out (M, N) of the output codes' type or float32."""
    rows, depth = a.shape
    columns = packed.shape[0]
    centred = np.empty((rows, depth), np.int16)
    _centre(a, np.full(1, a_zero, np.int32), centred)
    acc = np.empty((rows, columns), np.int32)
    _centred_product(centred, packed, pairs, acc)
    one_c, no_c = c.shape[0] == 1, c.shape[0] == 0
    one_m = multiplier.shape[0] == 1
    z, lo, hi = np.float64(zero), np.float64(low), np.float64(high)
    for m in range(rows):
        for n in range(columns):
            total = acc[m, n] if no_c else np.int32(np.int64(acc[m, n]) + np.int64(c[0 if one_c else n]))
            v = np.float64(total) * multiplier[0 if one_m else n]
            if quantized:
                v = np.rint(v) + z
                v = 0.0 if v != v else v
                v = lo if v < lo else v
                out[m, n] = hi if v > hi else v
            else:
                out[m, n] = np.float32(v)


# The layout of ``add``, requantized_product_add's QLinearAdd parameters (float64): the product codes' zero point
# and scale as the Add reads them, the other operand's, the output's, and its code range.
X_ZERO, X_SCALE, BIAS_ZERO, BIAS_SCALE, C_ZERO, C_SCALE, C_LOW, C_HIGH = range(8)


@jit
def requantized_product_add(a, packed, pairs, multiplier, offset, consts, bias, add, out):
    """QLinearMatMul's codes (requantized_product, ``consts[DEQUANTIZE]`` off) then QLinearAdd of a constant row
    ``bias`` (N,) or (1,) codes, in one pass: each product code is rounded as QLinearMatMul rounds it, then
    (x_scale * (code - x_zero) + bias_scale * (bias[n] - bias_zero)) / c_scale in float64, rounded half to even,
    plus c_zero, saturated, as QLinearAdd computes it (the sum of two terms does not depend on their order)."""
    rows, depth = a.shape
    columns = packed.shape[0]
    centred = np.empty((rows, depth), np.int16)
    centred_rows_of(a, consts, centred)
    acc = np.empty((rows, columns), np.int32)
    _centred_product(centred, packed, pairs, acc)
    one_m, one_b = multiplier.shape[0] == 1, bias.shape[0] == 1
    z, lo, hi = np.float64(consts[Y_ZERO]), np.float64(consts[Y_LOW]), np.float64(consts[Y_HIGH])
    zx, sx, zb, sb = np.int64(add[X_ZERO]), add[X_SCALE], np.int64(add[BIAS_ZERO]), add[BIAS_SCALE]
    zc, sc, c_lo, c_hi = add[C_ZERO], add[C_SCALE], add[C_LOW], add[C_HIGH]
    for m in range(rows):
        for n in range(columns):
            k = 0 if one_m else n
            code = requantized_code(np.float64(acc[m, n]), multiplier[k], offset[k], z, lo, hi)
            x = np.int64(code) - zx
            y = np.int64(bias[0 if one_b else n]) - zb
            v = np.rint((sx * np.float64(x) + sb * np.float64(y)) / sc) + zc
            v = c_lo if v < c_lo else v
            out[m, n] = c_hi if v > c_hi else v
