"""Register-tiled uint8 x int8 -> int32 products on AVX-512 VNNI (``vpdpbusd``): qgemm_tiles' tiles with four
values of k per int32 lane instead of two, so each instruction does twice the multiply-adds.

qgemm_tiles multiplies centred int16 codes (-255 .. 255) by int16 pairs, two products per lane per
instruction. ``vpdpbusd`` multiplies unsigned bytes by signed bytes, four per lane, and adds them into the
int32 lane without saturating: the operands must be the raw codes (centring widens them past a byte). The
callers make them so: the input's codes shifted to unsigned (u = code - low), the weight's to signed, and the
zero points' terms added afterwards (compiled/dynamic_conv.quantized_conv_quads):
sum (u - zu) (s - zs) = sum u s - zs sum u - zu sum s + K zu zs, every term exact modulo 2**32, so the
int32 result is the same integers the centred products give. Four products of a byte by a byte are at most
4 * 255 * 128 in size, and the lanes wrap as an int32 accumulator does, whatever the order.

The weight is laid out in quads of k, (K4, N rounded up to 16, 4) int8 (``quads_of``): one 64-byte vector
holds 16 columns x 4 values of k; each output row broadcasts its four bytes as one int32. Only where
``AVAILABLE`` (host.AVX512VNNI); the callers take qgemm_tiles' pairs elsewhere.
"""

from __future__ import annotations

import numpy as np

from . import host, jit
from .aligned import aligned_copy
from .deferred import Loop
from .qgemm_tiles import LANES, MR, NC_MAX, tile_kernel

AVAILABLE = host.AVX512VNNI
# AMX-INT8's tiles (amx_requantized_tiles): 16 rows of 64 bytes, tdpbsud multiplying signed rows (the weight's) by
# unsigned quads (the patches'), 1024 multiply-adds a cycle where vpdpbusd does 128
AMX = host.AMX_INT8
AMX_ROWS, AMX_DEPTH = 32, 64  # the output channels a tile group takes (two A tiles), the bytes of k a tile holds
# A 2-D convolution's tile groups read patches (a copy of the input per weight, KH x KW times its size) and round
# each 32 x 32 group of sums, costs that only many output channels and a deep k amortize; quantized_conv_grid reads
# the input in place, in row vectors of 16 positions. Measured per convolution against the grid (one thread): the
# groups win on 1 x 1 kernels from AMX_WIDE channels and k, and on wider kernels only over rows of at most
# AMX_NARROW_ROW positions (7 x 7 maps), where the grid's vectors run half empty.
AMX_WIDE, AMX_NARROW_ROW = 256, 8


def amx_beats_grid(channels: int, depth: int, taps: int, row: int) -> bool:
    """Whether AMX's tile groups (quantized_conv_blocks) run a 2-D convolution of ``channels`` outputs, ``depth``
    bytes of k, ``taps`` = KH x KW and output rows of ``row`` positions faster than the grid (see above)."""
    return AMX and channels >= AMX_WIDE and depth >= AMX_WIDE and (taps == 1 or row <= AMX_NARROW_ROW)


def _emit_tile(builder, mr: int, nc: int, pointers: tuple, values: tuple) -> None:
    """The IR of one mr x (16 * nc) tile: c[i*ldc + j] = sum_k4 a32[i*lda + k4] . b[k4*ldb + 4j .. 4j+3], with
    a32 the bytes of ``a`` read as int32 (one broadcast per row and k4) and ``.`` vpdpbusd's sum of four
    unsigned-by-signed byte products: ``a`` the unsigned bytes, ``b`` the signed ones."""
    _emit_quad_tile(builder, mr, nc, pointers, values, True)


def _emit_weight_tile(builder, mr: int, nc: int, pointers: tuple, values: tuple) -> None:
    """_emit_tile with the roles of the bytes swapped: ``a`` (broadcast, a weight's rows) signed, ``b`` (vectors,
    an input's quads) unsigned. The product then comes out with the input's positions along a row: a
    convolution's channel-major output (weight_tiles)."""
    _emit_quad_tile(builder, mr, nc, pointers, values, False)


def _emit_quad_tile(builder, mr: int, nc: int, pointers: tuple, values: tuple, unsigned_broadcast: bool) -> None:
    from llvmlite import ir

    from . import llvm

    i32x16 = ir.VectorType(llvm.I32, LANES)
    c_ptr, ldc = pointers[2], values[3]
    totals = _quad_totals(builder, mr, nc, pointers[:2], values[:3], unsigned_broadcast)

    def const(value):
        return ir.Constant(llvm.I64, value)

    for i in range(mr):
        row_at = builder.mul(const(i), ldc)
        for j in range(nc):
            target = builder.bitcast(builder.gep(c_ptr, [builder.add(row_at, const(LANES * j))]),
                                     i32x16.as_pointer())
            builder.store(totals[i * nc + j], target, align=4)


def _quad_totals(builder, mr: int, nc: int, pointers: tuple, values: tuple, unsigned_broadcast: bool,
                 offsets=None) -> list:
    """The IR of an mr x (16 * nc) tile's k loop: its int32 sums, mr * nc vectors of 16 lanes (row-major). The
    vectors of quad k are ldb * k bytes past ``b``, or with ``offsets`` (int64, one per k) offsets[k] bytes past."""
    from llvmlite import ir

    from . import llvm

    i8x64, i32x16 = ir.VectorType(ir.IntType(8), 4 * LANES), ir.VectorType(llvm.I32, LANES)
    a_ptr, b_ptr = pointers
    depth, lda, ldb = values
    dot = llvm.declare(builder.module, "llvm.x86.avx512.vpdpbusd.512",
                       ir.FunctionType(i32x16, [i32x16, i8x64, i8x64]))
    a32 = builder.bitcast(a_ptr, llvm.I32.as_pointer())

    def const(value):
        return ir.Constant(llvm.I64, value)

    a_rows = [builder.mul(const(i), lda) for i in range(mr)]

    def step(k, acc):
        b_row = builder.mul(k, ldb) if offsets is None else builder.load(builder.gep(offsets, [k]))
        weights = [builder.load(builder.bitcast(builder.gep(b_ptr, [builder.add(b_row, const(4 * LANES * j))]),
                                                i8x64.as_pointer()), align=1) for j in range(nc)]
        summed = []
        for i in range(mr):
            quad = builder.load(builder.gep(a32, [builder.add(a_rows[i], k)]), align=1)
            broadcast = builder.bitcast(llvm.splat(builder, quad, i32x16), i8x64)
            summed.extend(builder.call(dot, [acc[i * nc + j], broadcast, weights[j]] if unsigned_broadcast
                                       else [acc[i * nc + j], weights[j], broadcast]) for j in range(nc))
        return summed

    return llvm.counted_loop(builder, depth, [ir.Constant(i32x16, None)] * (mr * nc), step, "quadtile")


ROUNDER = 1.5 * 2.0 ** 52  # x + ROUNDER - ROUNDER rounds float64 x half to even while |x| < 2**51


def _emit_requantized_tile(builder, mr: int, nc: int, pointers: tuple, values: tuple, dequantize: bool) -> None:
    """An mr x (16 * nc) tile of _emit_weight_tile's products (output channels by positions) requantized in its
    registers and stored along each channel's plane (_emit_requantized)."""
    a_ptr, b_ptr = pointers[:2]
    depth, lda, ldb = values[:3]
    totals = _quad_totals(builder, mr, nc, (a_ptr, b_ptr), (depth, lda, ldb), False)
    _emit_requantized(builder, totals, mr, nc, pointers[2:], values[3:], dequantize, None)


def _emit_requantized(builder, totals: list, mr: int, nc: int, pointers: tuple, values: tuple, dequantize: bool,
                      rows, places=None, singles=None) -> None:
    """Requantizes an mr x (16 * nc) block of int32 sums (``totals``, row-major vectors of 16 positions) and stores
    it along each output channel's plane: for row i (channel m = row + i), total = acc + terms[m] - zeros[m] *
    sums[j] (int32, wrapping; sums the positions' sums of codes), v = float64(total) * factors[m] + shifts[m]
    saturated to [bounds[0], bounds[1]] (the codes' range less the zero point), rounded half to even (NaN, from a
    NaN shift, as code 0), then the code's byte, int32(v + bounds[2]) & 255, or with ``dequantize`` its float32
    value, float32(v * bounds[3]). Lanes at or past ``count`` positions are not stored (masked stores), so a
    block's tail writes nothing past its positions; nor rows at or past ``rows`` (None: every row).

    With ``places`` (int64 pointers (starts, lanes), one of each per vector: the vector's first stored element in
    the plane and the bit mask of its lanes that are positions) each vector's masked lanes are stored one after
    another from its start (a compress store), its other lanes dropped: a grid tile's lanes past a row's end
    (quantized_conv_grid). Then ``zeros`` and ``sums`` are None (no weight zero point's term) and ``count`` unused,
    and the factors and shifts are finite (the callers check): no NaN to map to code 0, so rint is LLVM's (the
    current rounding, half to even: vrndscalepd) and the code's conversion exact.

    With ``singles`` (float32, three per output channel: its factor and shift rounded to float32 and a margin,
    _single_first) the tile is first requantized in float32, a third of float64's work, and kept where no lane's
    value lies within the margin of a half (then both round alike); else the tile goes the float64 way."""
    from llvmlite import ir

    from . import llvm

    terms, zeros, sums, factors, shifts, bounds, out = pointers
    row, out_at, ldo, count = values
    f64x16, i32x16 = ir.VectorType(ir.DoubleType(), LANES), ir.VectorType(llvm.I32, LANES)
    vector = ir.VectorType(llvm.F32 if dequantize else ir.IntType(8), LANES)

    def const(value):
        return ir.Constant(llvm.I64, value)

    def wide(scalar):
        return llvm.splat(builder, scalar, f64x16)

    low, high, zero, scale = (wide(builder.load(builder.gep(bounds, [const(b)]))) for b in range(4))
    rounded = _rounding(builder, zero, places is None)
    put = _vector_stores(builder, nc, out, vector, count, places)
    position_sums = None if places else [
        builder.load(builder.bitcast(builder.gep(sums, [const(LANES * j)]), i32x16.as_pointer()), align=4)
        for j in range(nc)]

    def emit_row(i):
        m = builder.add(row, const(i))
        term = llvm.splat(builder, builder.load(builder.gep(terms, [m])), i32x16)
        zero_point = None if places else llvm.splat(builder, builder.load(builder.gep(zeros, [m])), i32x16)
        factor, shift = wide(builder.load(builder.gep(factors, [m]))), wide(builder.load(builder.gep(shifts, [m])))
        plane = builder.add(out_at, builder.mul(const(i), ldo))
        for j in range(nc):
            total = builder.add(totals[i * nc + j], term)
            total = total if zero_point is None else builder.sub(total, builder.mul(zero_point, position_sums[j]))
            v = builder.sitofp(total, f64x16)
            v = builder.fadd(builder.fmul(v, factor), shift)
            v = builder.select(builder.fcmp_ordered("<", v, low), low, v)
            v = rounded(builder.select(builder.fcmp_ordered(">", v, high), high, v))
            put(j, builder.fptrunc(builder.fmul(v, scale), vector) if dequantize
                else builder.trunc(builder.fptosi(builder.fadd(v, zero), i32x16), vector), plane)

    if singles is None:
        _each_row(builder, mr, rows, emit_row)
        return
    near, values = _single_first(builder, totals, mr, nc, (terms, singles, bounds), row, dequantize)
    with builder.if_else(near) as (slow, fast):
        with slow:
            for i in range(mr):
                emit_row(i)
        with fast:
            for i in range(mr):
                plane = builder.add(out_at, builder.mul(const(i), ldo))
                for j in range(nc):
                    put(j, values[i * nc + j], plane)


def _each_row(builder, mr: int, rows, emit_row) -> None:
    """emit_row(i) for a tile's mr rows, each at or past ``rows`` (None: none) skipped at run time."""
    from llvmlite import ir

    from . import llvm

    for i in range(mr):
        if rows is None:
            emit_row(i)
        else:
            with builder.if_then(builder.icmp_signed("<", ir.Constant(llvm.I64, i), rows)):
                emit_row(i)


def _single_first(builder, totals: list, mr: int, nc: int, pointers: tuple, row, dequantize: bool) -> tuple:
    """_emit_requantized's float32 try of a tile: (whether some lane must go the float64 way, the tile's values).
    Per channel m: v = fma(float32(total), singles[3m], singles[3m + 1]) saturated and rounded (vrndscaleps); v
    differs from the float64 value by less than singles[3m + 2]'s distance below a half (the callers' bound), so
    where |v - rint(v)| stays under it both round to the same integer. A margin of -1 sends every tile of the
    channel the float64 way."""
    from llvmlite import ir

    from . import llvm

    terms, singles, bounds = pointers
    f32x16, i32x16 = llvm.VEC, ir.VectorType(llvm.I32, LANES)
    vector = llvm.VEC if dequantize else ir.VectorType(ir.IntType(8), LANES)
    rint = llvm.declare(builder.module, "llvm.rint.v16f32", ir.FunctionType(f32x16, [f32x16]))
    fabs = llvm.declare(builder.module, "llvm.fabs.v16f32", ir.FunctionType(f32x16, [f32x16]))
    fma = llvm.fma(builder.module)

    def const(value):
        return ir.Constant(llvm.I64, value)

    def bound(b):
        return builder.fptrunc(builder.load(builder.gep(bounds, [const(b)])), llvm.F32)

    low, high, scale = (llvm.splat(builder, bound(b), f32x16) for b in (0, 1, 3))
    zero = llvm.splat(builder, builder.fptosi(builder.load(builder.gep(bounds, [const(2)])), llvm.I32), i32x16)
    near = ir.Constant(llvm.MASK, None)
    values = []
    for i in range(mr):
        m = builder.add(row, const(i))
        term = llvm.splat(builder, builder.load(builder.gep(terms, [m])), i32x16)
        factor, shift, margin = (llvm.splat(builder, builder.load(builder.gep(singles, [
            builder.add(builder.mul(m, const(3)), const(k))])), f32x16) for k in range(3))
        for j in range(nc):
            v = builder.call(fma, [builder.sitofp(builder.add(totals[i * nc + j], term), f32x16), factor, shift])
            v = builder.select(builder.fcmp_ordered("<", v, low), low, v)
            v = builder.select(builder.fcmp_ordered(">", v, high), high, v)
            r = builder.call(rint, [v])
            near = builder.or_(near, builder.fcmp_unordered(">=", builder.call(fabs, [builder.fsub(v, r)]), margin))
            values.append(builder.fmul(r, scale) if dequantize
                          else builder.trunc(builder.add(builder.fptosi(r, i32x16), zero), vector))
    return builder.icmp_unsigned("!=", builder.bitcast(near, ir.IntType(LANES)), ir.Constant(ir.IntType(LANES), 0)), \
        values


def _rounding(builder, zero, nan_to_zero: bool):
    """rint of a saturated float64 vector, half to even: as the sum and difference of ROUNDER, a NaN (from a NaN
    shift) then code 0's value less ``zero``; or, where no NaN can come (``nan_to_zero`` off), LLVM's rint (the
    current rounding: vrndscalepd)."""
    from llvmlite import ir

    from . import llvm

    f64x16 = ir.VectorType(ir.DoubleType(), LANES)
    if not nan_to_zero:
        rint = llvm.declare(builder.module, "llvm.rint.v16f64", ir.FunctionType(f64x16, [f64x16]))
        return lambda v: builder.call(rint, [v])
    rounder = ir.Constant(f64x16, [ROUNDER] * LANES)
    unset = builder.fsub(ir.Constant(f64x16, [0.0] * LANES), zero)  # code 0 less the zero point

    def rounded(v):
        v = builder.fsub(builder.fadd(v, rounder), rounder)
        return builder.select(builder.fcmp_unordered("uno", v, v), unset, v)

    return rounded


def _vector_stores(builder, nc: int, out, vector, count, places):
    """put(j, value, plane): vector j of a tile row stored from element plane + 16 * j of ``out``, its lanes from
    ``count`` on masked off; or with ``places`` compress-stored from plane + starts[j], the lanes of lanes[j] only
    (_emit_requantized)."""
    from llvmlite import ir

    from . import llvm

    element = vector.element
    i32x16 = ir.VectorType(llvm.I32, LANES)
    suffix = "f32" if element == llvm.F32 else "i8"

    def const(value):
        return ir.Constant(llvm.I64, value)

    if places is None:
        store = llvm.declare(builder.module, f"llvm.masked.store.v16{suffix}.p0",
                             ir.FunctionType(ir.VoidType(), [vector, vector.as_pointer(), llvm.I32, llvm.MASK]))
        limit = llvm.splat(builder, builder.trunc(count, llvm.I32), i32x16)
        masks = [builder.icmp_signed("<", builder.add(llvm.LANE_NUMBERS, ir.Constant(i32x16, [LANES * j] * LANES)),
                                     limit) for j in range(nc)]

        def put(j, value, plane):
            target = builder.bitcast(builder.gep(out, [builder.add(plane, const(LANES * j))]), vector.as_pointer())
            builder.call(store, [value, target, ir.Constant(llvm.I32, 1), masks[j]])

        return put
    # compressed in the register, then a masked store of the leading lanes: a compress store to memory is microcode
    compress = llvm.declare(builder.module, f"llvm.x86.avx512.mask.compress.v16{suffix}",
                            ir.FunctionType(vector, [vector, vector, llvm.MASK]))
    store = llvm.declare(builder.module, f"llvm.masked.store.v16{suffix}.p0",
                         ir.FunctionType(ir.VoidType(), [vector, vector.as_pointer(), llvm.I32, llvm.MASK]))
    popcount = llvm.declare(builder.module, "llvm.ctpop.i64", ir.FunctionType(llvm.I64, [llvm.I64]))
    starts = [builder.load(builder.gep(places[0], [const(j)])) for j in range(nc)]
    bits = [builder.load(builder.gep(places[1], [const(j)])) for j in range(nc)]
    masks = [builder.bitcast(builder.trunc(b, ir.IntType(LANES)), llvm.MASK) for b in bits]
    leading = [builder.icmp_signed("<", llvm.LANE_NUMBERS, llvm.splat(
        builder, builder.trunc(builder.call(popcount, [b]), llvm.I32), i32x16)) for b in bits]
    full = [builder.icmp_signed("==", b, const((1 << LANES) - 1)) for b in bits]
    empty = ir.Constant(vector, None)

    def put(j, value, plane):
        target = builder.bitcast(builder.gep(out, [builder.add(plane, starts[j])]), vector.as_pointer())
        # a vector whose lanes are all positions (most of a row's) is stored as it is
        with builder.if_else(full[j]) as (whole, part):
            with whole:
                builder.store(value, target, align=1)
            with part:
                packed = builder.call(compress, [value, empty, masks[j]])
                builder.call(store, [packed, target, ir.Constant(llvm.I32, 1), leading[j]])

    return put


def requantizing_kernel(mr: int, nc: int):
    """The numba intrinsic of one _emit_requantized_tile, called as (weight, a_at, patches, b_at, depth, lda, ldb,
    terms, zeros, sums, factors, shifts, bounds, row, out, out_at, ldo, count): int8 weight rows from element a_at
    (lda quads a row), uint8 patches from b_at (ldb bytes a quad of k), int32 terms, zeros (per output channel)
    and sums (per position of the tile, from its first), float64 factors, shifts and bounds,
    ``row`` the tile's first output channel, ``out`` uint8 (the codes' bytes) or float32 (their values), the
    tile's first position at out_at and each channel's plane ldo elements after the one before."""
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def microkernel(typingctx, a, a_at, b, b_at, depth, lda, ldb, terms, zeros, sums, factors, shifts, bounds, row,
                    out, out_at, ldo, count):
        signature = types.void(a, a_at, b, b_at, depth, lda, ldb, terms, zeros, sums, factors, shifts, bounds, row,
                               out, out_at, ldo, count)
        dequantize = out.dtype == types.float32

        def codegen(context, builder, sig, args):
            def data(index):
                return context.make_array(sig.args[index])(context, builder, args[index]).data

            pointers = (builder.gep(data(0), [args[1]]), builder.gep(data(2), [args[3]]), data(7), data(8), data(9),
                        data(10), data(11), data(12), data(14))
            _emit_requantized_tile(builder, mr, nc, pointers, (args[4], args[5], args[6], args[13], args[15],
                                                               args[16], args[17]), dequantize)
            return context.get_dummy_value()

        return signature, codegen
    return microkernel


def grid_kernel(mr: int, nc: int):
    """The numba intrinsic of one mr x (16 * nc) tile of a convolution read in place from the grid of channel quads
    (quantized_conv_grid): called as (weight, a_at, codes, b_at, depth, lda, offsets, terms, factors, shifts,
    singles, bounds, row, out, out_at, ldo, starts, lanes, v_at): the int32 sums of int8 weight rows from element
    a_at by the uint8 quads offsets[k] bytes past codes[b_at] (16 positions a 64-byte vector), plus terms[m],
    requantized as _emit_requantized does (in float32 first, ``singles``) and compress-stored: vector j's masked
    lanes (lanes[v_at + j]) from element starts[v_at + j] of the row's plane (out_at for the first row, ldo elements
    a row)."""
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def microkernel(typingctx, a, a_at, b, b_at, depth, lda, offsets, terms, factors, shifts, singles, bounds, row,
                    out, out_at, ldo, starts, lanes, v_at):
        signature = types.void(a, a_at, b, b_at, depth, lda, offsets, terms, factors, shifts, singles, bounds, row,
                               out, out_at, ldo, starts, lanes, v_at)
        dequantize = out.dtype == types.float32

        def codegen(context, builder, sig, args):
            def data(index):
                return context.make_array(sig.args[index])(context, builder, args[index]).data

            totals = _quad_totals(builder, mr, nc, (builder.gep(data(0), [args[1]]), builder.gep(data(2), [args[3]])),
                                  (args[4], args[5], None), False, offsets=data(6))
            places = (builder.gep(data(16), [args[18]]), builder.gep(data(17), [args[18]]))
            _emit_requantized(builder, totals, mr, nc, (data(7), None, None, data(8), data(9), data(11), data(13)),
                              (args[12], args[14], args[15], None), dequantize, None, places, data(10))
            return context.get_dummy_value()

        return signature, codegen
    return microkernel


# The microkernels by NC, globals for the loops that call them, made when those loops are compiled (importing
# this module imports neither numba nor llvmlite). _tile_<nc>: MR rows; _row_<nc>: one row (the last M % MR);
# _wtile_<nc>, _wrow_<nc>: the same of _emit_weight_tile.
_tile_1 = _tile_2 = _tile_3 = _tile_4 = _row_1 = _row_2 = _row_3 = _row_4 = None
_wtile_1 = _wtile_2 = _wtile_3 = _wtile_4 = _wrow_1 = _wrow_2 = _wrow_3 = _wrow_4 = None
# _rtile_<nc>, _rrow_<nc>: requantizing_kernel's; _gtile_<nc>, _grow_<nc>: grid_kernel's
_rtile_1 = _rtile_2 = _rtile_3 = _rtile_4 = _rrow_1 = _rrow_2 = _rrow_3 = _rrow_4 = None
_gtile_1 = _gtile_2 = _gtile_3 = _gtile_4 = _grow_1 = _grow_2 = _grow_3 = _grow_4 = None


def _define_kernels() -> None:
    global _tile_1, _tile_2, _tile_3, _tile_4, _row_1, _row_2, _row_3, _row_4
    global _wtile_1, _wtile_2, _wtile_3, _wtile_4, _wrow_1, _wrow_2, _wrow_3, _wrow_4
    global _rtile_1, _rtile_2, _rtile_3, _rtile_4, _rrow_1, _rrow_2, _rrow_3, _rrow_4
    global _gtile_1, _gtile_2, _gtile_3, _gtile_4, _grow_1, _grow_2, _grow_3, _grow_4
    if _tile_4 is None:
        _grow_1, _grow_2, _grow_3, _grow_4 = (grid_kernel(1, nc) for nc in range(1, NC_MAX + 1))
        _gtile_1, _gtile_2, _gtile_3, _gtile_4 = (grid_kernel(MR, nc) for nc in range(1, NC_MAX + 1))
        _rrow_1, _rrow_2, _rrow_3, _rrow_4 = (requantizing_kernel(1, nc) for nc in range(1, NC_MAX + 1))
        _rtile_1, _rtile_2, _rtile_3, _rtile_4 = (requantizing_kernel(MR, nc) for nc in range(1, NC_MAX + 1))
        _row_1, _row_2, _row_3, _row_4 = (tile_kernel(_emit_tile, 1, nc) for nc in range(1, NC_MAX + 1))
        _tile_1, _tile_2, _tile_3, _tile_4 = (tile_kernel(_emit_tile, MR, nc) for nc in range(1, NC_MAX + 1))
        _wrow_1, _wrow_2, _wrow_3, _wrow_4 = (tile_kernel(_emit_weight_tile, 1, nc) for nc in range(1, NC_MAX + 1))
        _wtile_1, _wtile_2, _wtile_3, _wtile_4 = (tile_kernel(_emit_weight_tile, MR, nc)
                                                  for nc in range(1, NC_MAX + 1))


def _with_kernels(function):
    """``jit(function)`` for a loop that calls the microkernels: they are defined before numba compiles it."""
    standard = jit(function)
    return Loop(function, lambda _: (_define_kernels(), standard.dispatcher())[1])


def quads_of(weight: np.ndarray) -> np.ndarray:
    """int8 ``weight`` (K, N) as (ceil(K / 4), N rounded up to 16, 4) int8: [k4, n, t] = weight[4*k4 + t, n],
    0 past K and past N."""
    depth, columns = weight.shape
    quads = np.zeros(((depth + 3) // 4 * 4, (columns + LANES - 1) // LANES * LANES), np.int8)
    quads[:depth, :columns] = weight
    return aligned_copy(quads.reshape(-1, 4, quads.shape[1]).transpose(0, 2, 1))


def signed_quads(columns: np.ndarray, zeros: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An 8-bit weight (K, N) with its zero points (one, or one per column) as the byte products take it:
    (quads_of its codes as signed bytes, each column's sum of them (N,) int64, the signed zero points (N,) int64).
    uint8 codes and their zero points shift down by 128 together, which leaves every code - zero as it was."""
    shift = 128 if columns.dtype == np.uint8 else 0
    signed = columns.astype(np.int16) - shift
    signed_zeros = np.broadcast_to(zeros.astype(np.int64).reshape(-1) - shift, (columns.shape[1],)).copy()
    return quads_of(signed.astype(np.int8)), signed.sum(axis=0, dtype=np.int64), signed_zeros


@_with_kernels
def _row_tiles(flat_a, a_at, lda, quads, wide, c, c_at, ldc, single):
    """MR rows (one with ``single``) of uint8 ``flat_a``, the first from a_at and each ``lda`` quads after the one
    before, by the first ``wide`` columns of the quads, into int32 ``c`` (flat, rows of ldc values) from c_at."""
    depth4, ldb = quads.shape[0], 4 * quads.shape[1]
    flat_b = quads.reshape(-1)
    j0 = 0
    while j0 < wide:
        nc = min(NC_MAX, (wide - j0) // LANES)
        b_at, at = 4 * j0, c_at + j0
        if single:
            if nc == 4:
                _row_4(flat_a, a_at, flat_b, b_at, c, at, depth4, lda, ldb, ldc)
            elif nc == 3:
                _row_3(flat_a, a_at, flat_b, b_at, c, at, depth4, lda, ldb, ldc)
            elif nc == 2:
                _row_2(flat_a, a_at, flat_b, b_at, c, at, depth4, lda, ldb, ldc)
            else:
                _row_1(flat_a, a_at, flat_b, b_at, c, at, depth4, lda, ldb, ldc)
        elif nc == 4:
            _tile_4(flat_a, a_at, flat_b, b_at, c, at, depth4, lda, ldb, ldc)
        elif nc == 3:
            _tile_3(flat_a, a_at, flat_b, b_at, c, at, depth4, lda, ldb, ldc)
        elif nc == 2:
            _tile_2(flat_a, a_at, flat_b, b_at, c, at, depth4, lda, ldb, ldc)
        else:
            _tile_1(flat_a, a_at, flat_b, b_at, c, at, depth4, lda, ldb, ldc)
        j0 += nc * LANES


@jit
def portable_quads(flat, start, stride, rows, quads, out):
    """strided_quads without the tiles (hosts without VNNI, where the callers take qgemm_tiles' pairs instead,
    so that nothing compiles VNNI's instruction for them): the same integers, a row at a time."""
    for m in range(rows):
        line, at = out[m], start + m * stride
        line[:] = 0
        for k4 in range(quads.shape[0]):
            for t in range(4):
                value = np.int32(flat[at + 4 * k4 + t])
                for n in range(out.shape[1]):
                    line[n] += value * np.int32(quads[k4, n, t])


@jit
def _tiled_quads(flat, start, stride, rows, quads, out):
    """out (rows, N) int32, C-contiguous: row r the product of uint8 flat[start + r * stride:][:4 * K4] by the
    int8 quads (K4, N rounded up to 16, 4), read in place (rows may overlap: a 1-D convolution's windows).
    ``start`` and ``stride`` multiples of 4; every row within ``flat``. Tiles of MR rows (then of one row, for
    the last rows % MR) by 16 * NC columns stored in place, the last partial 16 columns through a scratch tile."""
    columns = out.shape[1]
    full = rows - rows % MR
    wide = columns - columns % LANES
    flat_out = out.reshape(-1)
    tail = np.ascontiguousarray(quads[:, wide:wide + LANES])
    scratch = np.empty(MR * LANES, np.int32)
    lda = stride // 4
    i0 = 0
    while i0 < rows:
        single = i0 >= full
        a_at = start + stride * i0
        if wide:
            _row_tiles(flat, a_at, lda, quads, wide, flat_out, i0 * columns, columns, single)
        if wide < columns:
            _row_tiles(flat, a_at, lda, tail, LANES, scratch, 0, LANES, single)
            for i in range(1 if single else MR):
                out[i0 + i, wide:] = scratch[i * LANES:i * LANES + columns - wide]
        i0 += 1 if single else MR


strided_quads = _tiled_quads if AVAILABLE else portable_quads


def weight_rows(quads: np.ndarray, columns: int) -> np.ndarray:
    """signed_quads' quads (K4, N rounded up to 16, 4) as weight_tiles takes them: (N, 4 * K4) int8, row n the
    column's signed codes in k order, 0 past K."""
    return np.ascontiguousarray(quads.transpose(1, 0, 2).reshape(quads.shape[1], -1)[:columns])


@_with_kernels
def _weight_tiles(weight, first, end, patches, b_at, ldb, nc, c, ldc):
    """c[(i - first) * ldc + j] (int32, flat) = sum over k of weight[i, k] * patch[k, j] for rows i = first .. end
    of int8 ``weight`` (rows of 4 * K4 signed codes) and 16 * nc columns j of an input's quads, uint8 ``patches``
    (flat, from b_at: [k4 * ldb + 4 * j + t] = patch[4 * k4 + t, j]). Tiles of MR rows, then single rows."""
    lda = weight.shape[1] // 4
    depth4 = lda
    flat_a = weight.reshape(-1)
    i = first
    while i < end:
        single = end - i < MR
        a_at, at = 4 * lda * i, (i - first) * ldc
        if single:
            if nc == 4:
                _wrow_4(flat_a, a_at, patches, b_at, c, at, depth4, lda, ldb, ldc)
            elif nc == 3:
                _wrow_3(flat_a, a_at, patches, b_at, c, at, depth4, lda, ldb, ldc)
            elif nc == 2:
                _wrow_2(flat_a, a_at, patches, b_at, c, at, depth4, lda, ldb, ldc)
            else:
                _wrow_1(flat_a, a_at, patches, b_at, c, at, depth4, lda, ldb, ldc)
        elif nc == 4:
            _wtile_4(flat_a, a_at, patches, b_at, c, at, depth4, lda, ldb, ldc)
        elif nc == 3:
            _wtile_3(flat_a, a_at, patches, b_at, c, at, depth4, lda, ldb, ldc)
        elif nc == 2:
            _wtile_2(flat_a, a_at, patches, b_at, c, at, depth4, lda, ldb, ldc)
        else:
            _wtile_1(flat_a, a_at, patches, b_at, c, at, depth4, lda, ldb, ldc)
        i += 1 if single else MR


@jit
def _portable_weight_tiles(weight, first, end, patches, b_at, ldb, nc, c, ldc):
    """_weight_tiles without the tiles (hosts without VNNI): the same integers."""
    for i in range(first, end):
        at = (i - first) * ldc
        for j in range(LANES * nc):
            total = np.int32(0)
            for k in range(weight.shape[1]):
                total += np.int32(weight[i, k]) * np.int32(patches[b_at + (k // 4) * ldb + 4 * j + k % 4])
            c[at + j] = total


weight_tiles = _weight_tiles if AVAILABLE else _portable_weight_tiles


@_with_kernels
def vnni_requantized_tiles(weight, first, end, patches, b_at, ldb, nc, terms, zeros, sums, factors, shifts, bounds, out,
                       out_at, ldo, count):
    """weight_tiles' products for rows first .. end requantized in the tiles (_emit_requantized_tile) into
    ``out`` (flat: row i's ``count`` positions from out_at + (i - first) * ldo): codes' bytes (uint8) or float32
    values. ``sums`` the positions' sums of codes (zeros where every zero point is 0)."""
    lda = weight.shape[1] // 4
    flat_a = weight.reshape(-1)
    i = first
    while i < end:
        single = end - i < MR
        head = (flat_a, 4 * lda * i, patches, b_at, lda, lda, ldb, terms, zeros, sums, factors, shifts, bounds, i)
        tail = (out, out_at + (i - first) * ldo, ldo, count)
        if single:
            if nc == 4:
                _rrow_4(*head, *tail)
            elif nc == 3:
                _rrow_3(*head, *tail)
            elif nc == 2:
                _rrow_2(*head, *tail)
            else:
                _rrow_1(*head, *tail)
        elif nc == 4:
            _rtile_4(*head, *tail)
        elif nc == 3:
            _rtile_3(*head, *tail)
        elif nc == 2:
            _rtile_2(*head, *tail)
        else:
            _rtile_1(*head, *tail)
        i += 1 if single else MR


@_with_kernels
def grid_tiles(weight, first, end, codes, b_at, offsets, nc, terms, factors, shifts, singles, bounds, out, out_at,
               ldo, starts, lanes, v_at):
    """Rows first .. end of ``weight`` by nc vectors of 16 grid positions from codes[b_at] (grid_kernel's tiles, MR
    rows at a time, then one), requantized and compress-stored into ``out`` (flat: row i's plane from out_at + (i -
    first) * ldo)."""
    lda = weight.shape[1] // 4
    flat_a = weight.reshape(-1)
    depth = offsets.shape[0]
    i = first
    while i < end:
        single = end - i < MR
        head = (flat_a, 4 * lda * i, codes, b_at, depth, lda, offsets, terms, factors, shifts, singles, bounds, i)
        tail = (out, out_at + (i - first) * ldo, ldo, starts, lanes, v_at)
        if single:
            if nc == 4:
                _grow_4(*head, *tail)
            elif nc == 3:
                _grow_3(*head, *tail)
            elif nc == 2:
                _grow_2(*head, *tail)
            else:
                _grow_1(*head, *tail)
        elif nc == 4:
            _gtile_4(*head, *tail)
        elif nc == 3:
            _gtile_3(*head, *tail)
        elif nc == 2:
            _gtile_2(*head, *tail)
        else:
            _gtile_1(*head, *tail)
        i += 1 if single else MR


@jit
def portable_requantized_tiles(weight, first, end, patches, b_at, ldb, nc, terms, zeros, sums, factors, shifts,
                                bounds, out, out_at, ldo, count):
    """vnni_requantized_tiles without the tiles (hosts without VNNI): the same arithmetic, a value at a time."""
    low, high, zero, scale = bounds[0], bounds[1], bounds[2], bounds[3]
    for i in range(first, end):
        for j in range(count):
            total = np.int32(0)
            for k in range(weight.shape[1]):
                total += np.int32(weight[i, k]) * np.int32(patches[b_at + (k // 4) * ldb + 4 * j + k % 4])
            v = np.float64(np.int32(total + terms[i] - zeros[i] * sums[j])) * factors[i] + shifts[i]
            v = low if v < low else v
            v = high if v > high else v
            v = (v + ROUNDER) - ROUNDER
            v = -zero if v != v else v  # NaN (a NaN shift): code 0
            at = out_at + (i - first) * ldo + j
            if out.itemsize == 4:  # float32 values
                out[at] = np.float32(v * scale)
            else:
                out[at] = np.int32(v + zero) & 255


def _amx_config() -> np.ndarray:
    """ldtilecfg's 64 bytes: palette 1, tiles 0-7 each 16 rows of 64 bytes."""
    config = np.zeros(64, np.uint8)
    config[0] = 1
    config[16:32] = np.frombuffer(np.full(8, 64, "<u2").tobytes(), np.uint8)
    config[48:56] = 16
    return config


AMX_CONFIG = _amx_config()


def _emit_amx_group(builder, pointers: tuple, values: tuple, dequantize: bool) -> None:
    """32 output channels by 32 positions on AMX's tiles: C0..C3 (tiles 0-3) the int32 sums of A0, A1 (tiles 4, 5:
    16 weight rows each, 64 bytes of k) by B0, B1 (tiles 6, 7: 16 quads of k by 16 positions each, from the
    patches' rows of ``ldb`` bytes), over ``chunks`` chunks of 64 k; stored to ``scratch`` (32 x 32 int32), then
    requantized and stored along the channels' planes (_emit_requantized, ``rows`` of them). The tiles'
    configuration is the caller's (amx_configure)."""
    from llvmlite import ir

    from . import llvm

    i8 = ir.IntType(8)
    byte_ptr = i8.as_pointer()
    a_ptr, b_ptr, scratch = pointers[:3]
    chunks, lda, ldb, rows = values[:4]
    module = builder.module
    load = llvm.declare(module, "llvm.x86.tileloadd64", ir.FunctionType(ir.VoidType(), [i8, byte_ptr, llvm.I64]))
    zero = llvm.declare(module, "llvm.x86.tilezero", ir.FunctionType(ir.VoidType(), [i8]))
    dot = llvm.declare(module, "llvm.x86.tdpbsud", ir.FunctionType(ir.VoidType(), [i8, i8, i8]))
    store = llvm.declare(module, "llvm.x86.tilestored64", ir.FunctionType(ir.VoidType(), [i8, byte_ptr, llvm.I64]))

    def const(value):
        return ir.Constant(llvm.I64, value)

    def tile(number):
        return ir.Constant(i8, number)

    a_bytes, b_bytes = builder.bitcast(a_ptr, byte_ptr), builder.bitcast(b_ptr, byte_ptr)
    for c in range(4):
        builder.call(zero, [tile(c)])

    def step(k, carried):
        a_at = builder.mul(k, const(AMX_DEPTH))
        b_at = builder.mul(k, builder.mul(const(AMX_DEPTH // 4), ldb))
        builder.call(load, [tile(4), builder.gep(a_bytes, [a_at]), lda])
        builder.call(load, [tile(5), builder.gep(a_bytes, [builder.add(a_at, builder.mul(const(16), lda))]), lda])
        builder.call(load, [tile(6), builder.gep(b_bytes, [b_at]), ldb])
        builder.call(load, [tile(7), builder.gep(b_bytes, [builder.add(b_at, const(64))]), ldb])
        for c, (a, b) in enumerate(((4, 6), (4, 7), (5, 6), (5, 7))):
            builder.call(dot, [tile(c), tile(a), tile(b)])
        return carried

    llvm.counted_loop(builder, chunks, [], step, "amxgroup")
    sums_bytes = builder.bitcast(scratch, byte_ptr)
    for c, at in enumerate((0, 64, 16 * 128, 16 * 128 + 64)):  # (32 int32 = 128 bytes a row of scratch)
        builder.call(store, [tile(c), builder.gep(sums_bytes, [const(at)]), const(128)])
    i32x16 = ir.VectorType(llvm.I32, LANES)
    totals = [builder.load(builder.bitcast(builder.gep(scratch, [const(2 * LANES * i + LANES * j)]),
                                           i32x16.as_pointer()), align=4) for i in range(AMX_ROWS) for j in range(2)]
    _emit_requantized(builder, totals, AMX_ROWS, 2, pointers[3:], values[4:], dequantize, rows)


def amx_kernel():
    """The numba intrinsic of one _emit_amx_group, called as (weight, a_at, lda, patches, b_at, ldb, chunks,
    scratch, terms, zeros, sums, sums_at, factors, shifts, bounds, row, rows, out, out_at, ldo, count): int8
    weight rows (amx_rows) from element a_at, lda bytes apart; uint8 patches from b_at, ldb bytes a quad of k;
    int32 scratch (32 * 32); the requantization's arrays (sums from element sums_at); ``row`` the group's first
    output channel, ``rows`` of them stored; ``out`` uint8 (codes' bytes) or float32, the group's first position
    at out_at, each channel's plane ldo elements after the one before; ``count`` positions stored."""
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def group(typingctx, a, a_at, lda, b, b_at, ldb, chunks, scratch, terms, zeros, sums, sums_at, factors, shifts,
              bounds, row, rows, out, out_at, ldo, count):
        signature = types.void(a, a_at, lda, b, b_at, ldb, chunks, scratch, terms, zeros, sums, sums_at, factors,
                               shifts, bounds, row, rows, out, out_at, ldo, count)
        dequantize = out.dtype == types.float32

        def codegen(context, builder, sig, args):
            def data(index):
                return context.make_array(sig.args[index])(context, builder, args[index]).data

            pointers = (builder.gep(data(0), [args[1]]), builder.gep(data(3), [args[4]]), data(7), data(8), data(9),
                        builder.gep(data(10), [args[11]]), data(12), data(13), data(14), data(17))
            _emit_amx_group(builder, pointers, (args[6], args[2], args[5], args[16], args[15], args[18], args[19],
                                                args[20]), dequantize)
            return context.get_dummy_value()

        return signature, codegen
    return group


def _amx_switch(name: str):
    """The numba intrinsic of ldtilecfg (with AMX_CONFIG) or of tilerelease."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    from . import llvm

    @intrinsic
    def switch(typingctx, config):
        def codegen(context, builder, sig, args):
            module = builder.module
            if name == "configure":
                data = context.make_array(sig.args[0])(context, builder, args[0]).data
                load = llvm.declare(module, "llvm.x86.ldtilecfg", ir.FunctionType(ir.VoidType(), [llvm.BYTE_PTR]))
                builder.call(load, [builder.bitcast(data, llvm.BYTE_PTR)])
            else:
                builder.call(llvm.declare(module, "llvm.x86.tilerelease", ir.FunctionType(ir.VoidType(), [])), [])
            return context.get_dummy_value()

        return types.void(config), codegen
    return switch


_amx_group = _amx_configure = _amx_release = None  # made when the loop that calls them is compiled


def _define_amx() -> None:
    global _amx_group, _amx_configure, _amx_release
    if _amx_group is None:
        _amx_group, _amx_configure, _amx_release = amx_kernel(), _amx_switch("configure"), _amx_switch("release")


def _with_amx(function):
    standard = jit(function)
    return Loop(function, lambda _: (_define_amx(), standard.dispatcher())[1])


@_with_amx
def amx_requantized_tiles(weight, first, end, patches, b_at, ldb, nc, terms, zeros, sums, factors, shifts, bounds,
                           out, out_at, ldo, count):
    """vnni_requantized_tiles on AMX's tiles (amx_rows' ``weight``, rows first .. end; ``count`` positions of at most
    64, ``nc`` unused), in groups of 32 channels by 32 positions."""
    lda = weight.shape[1]
    chunks = lda // AMX_DEPTH
    flat_a = weight.reshape(-1)
    scratch = np.empty(AMX_ROWS * 32, np.int32)
    _amx_configure(AMX_CONFIG)
    for half in range(0, count, 32):
        for row in range(first, end, AMX_ROWS):
            _amx_group(flat_a, row * lda, lda, patches, b_at + 4 * half, ldb, chunks, scratch, terms, zeros, sums,
                       half, factors, shifts, bounds, row, min(AMX_ROWS, end - row), out,
                       out_at + (row - first) * ldo + half, ldo, min(32, count - half))
    _amx_release(AMX_CONFIG)


# The products the channel-major convolutions requantize (compiled/quantized_conv_blocks): VNNI's register tiles
# (else the portable loop), and AMX's tile groups for a weight whose rows and k are whole groups (amx_rows).
requantized_tiles = vnni_requantized_tiles if AVAILABLE else portable_requantized_tiles
amx_tiles = amx_requantized_tiles if AMX else portable_requantized_tiles


def amx_rows(weight: np.ndarray) -> np.ndarray:
    """weight_rows' (M, 4 * K4) int8 rows as the AMX tiles read them: zero rows to a multiple of AMX_ROWS, zero k
    to a multiple of AMX_DEPTH (the patches, as deep as the rows, are zero there too). A weight of fewer than
    AMX_DEPTH bytes of k (a stem's 3 x 3 x 3) stays as it is, for the register tiles: padding would more than
    double its work."""
    if weight.shape[1] < AMX_DEPTH:
        return weight
    rows = -(-weight.shape[0] // AMX_ROWS) * AMX_ROWS
    depth = -(-weight.shape[1] // AMX_DEPTH) * AMX_DEPTH
    padded = np.zeros((rows, depth), np.int8)
    padded[:weight.shape[0], :weight.shape[1]] = weight
    return padded
