"""Register-tiled int16 x int16 -> int32 products for compiled/qgemm.py, on AVX-512BW (VNNI where present).

qgemm.py's portable loop computes each output as one dot product of two int16 rows: at the model sizes of
quantized transformers (K = 64 .. 256) a dot product is a few vector multiply-adds and then a horizontal sum
of 16 lanes, and the horizontal sums cost as much as the products. Here the product runs the other way, the
way the float32 microkernels of gemm.py do: B (the packed weight) is laid out in pairs of k, (K2, N, 2)
int16 (``pairs``), so one 64-byte vector holds 16 columns x 2 values of k; each output row broadcasts its
pair (a[m, 2k], a[m, 2k + 1]) as one int32, and ``vpmaddwd`` multiplies and adds the pairs into 16 int32
lanes: a tile of MR rows x 16*NC columns stays in registers for the whole reduction and is stored once.
Where the host has AVX-512 VNNI, the multiply and the accumulation are one ``vpdpwssd``.

Every product of two int16 values fits in int32 and so does the sum of a pair, so the lanes hold the exact
sum wrapped to int32, whatever the order: the same integers as the portable loop. Only where ``AVAILABLE``
(host.AVX512BW); elsewhere ``tile_product`` is the portable pair loop, which numba compiles on any host.
"""

from __future__ import annotations

import weakref

import numpy as np

from . import host, jit
from .aligned import aligned_empty
from .deferred import Loop

AVAILABLE = host.AVX512BW
VNNI = host.AVX512VNNI
MR = 4  # output rows per tile
LANES = 16  # int32 lanes of a 512-bit register
NC_MAX = 4  # 16-column vectors per tile: MR * NC_MAX accumulators + NC_MAX weights + 1 broadcast <= 32 zmm


def _emit_tile(builder, mr: int, nc: int, pointers: tuple, values: tuple) -> None:
    """The IR of one mr x (16 * nc) tile: c[i*ldc + j] = sum_k2 a32[i*lda + k2] . b[k2*ldb + 2j .. 2j+1], with
    a32 the int16 pairs of ``a`` read as int32 (one broadcast per row and k2) and ``.`` vpmaddwd's pair sum."""
    from llvmlite import ir

    from . import llvm

    i16x32, i32x16 = ir.VectorType(ir.IntType(16), 2 * LANES), ir.VectorType(llvm.I32, LANES)
    a_ptr, b_ptr, c_ptr = pointers
    depth, lda, ldb, ldc = values
    module = builder.module
    if VNNI:
        dot = llvm.declare(module, "llvm.x86.avx512.vpdpwssd.512",
                           ir.FunctionType(i32x16, [i32x16, i16x32, i16x32]))
    else:
        madd = llvm.declare(module, "llvm.x86.avx512.pmaddw.d.512", ir.FunctionType(i32x16, [i16x32, i16x32]))
    a32 = builder.bitcast(a_ptr, llvm.I32.as_pointer())
    b_vec_ptr = i16x32.as_pointer()
    c_vec_ptr = i32x16.as_pointer()

    def const(value):
        return ir.Constant(llvm.I64, value)

    a_rows = [builder.mul(const(i), lda) for i in range(mr)]
    zero = ir.Constant(i32x16, None)

    def step(k, acc):
        b_row = builder.mul(k, ldb)
        weights = [builder.load(builder.bitcast(builder.gep(b_ptr, [builder.add(b_row, const(2 * LANES * j))]),
                                                b_vec_ptr), align=2) for j in range(nc)]
        summed = []
        for i in range(mr):
            pair = builder.load(builder.gep(a32, [builder.add(a_rows[i], k)]), align=2)
            broadcast = builder.bitcast(llvm.splat(builder, pair, i32x16), i16x32)
            for j in range(nc):
                if VNNI:
                    summed.append(builder.call(dot, [acc[i * nc + j], broadcast, weights[j]]))
                else:
                    summed.append(builder.add(acc[i * nc + j], builder.call(madd, [broadcast, weights[j]])))
        return summed

    totals = llvm.counted_loop(builder, depth, [zero] * (mr * nc), step, "qtile")
    for i in range(mr):
        row_at = builder.mul(const(i), ldc)
        for j in range(nc):
            target = builder.bitcast(builder.gep(c_ptr, [builder.add(row_at, const(LANES * j))]), c_vec_ptr)
            builder.store(totals[i * nc + j], target, align=4)


def tile_kernel(emit_tile, mr: int, nc: int):
    """The numba intrinsic of one MR x NC tile whose IR ``emit_tile(builder, mr, nc, (a, b, c), (depth, lda, ldb,
    ldc))`` writes: called as (a, a_at, b, b_at, c, c_at, depth, lda, ldb, ldc), arrays with their element
    offsets. Here ``a`` is int16 (rows of 2*lda values) and ``b`` int16 pairs, depth pairs of k; qgemm_quads
    passes uint8 rows of 4*lda values and int8 quads, depth quads of k. ``c`` is int32, rows of ldc values."""
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def microkernel(typingctx, a, a_at, b, b_at, c, c_at, depth, lda, ldb, ldc):
        signature = types.void(a, a_at, b, b_at, c, c_at, depth, lda, ldb, ldc)

        def codegen(context, builder, sig, args):
            def data(index, at):
                base = context.make_array(sig.args[index])(context, builder, args[index]).data
                return builder.gep(base, [args[at]])

            emit_tile(builder, mr, nc, (data(0, 1), data(2, 3), data(4, 5)), (args[6], args[7], args[8], args[9]))
            return context.get_dummy_value()

        return signature, codegen
    return microkernel


# The microkernels by NC, globals for the loops that call them: made when those loops are compiled
# (_define_kernels), so that importing this module imports neither numba nor llvmlite.
# _tile_<nc>: MR rows; _row_<nc>: one row (the last M % MR rows).
_tile_1 = _tile_2 = _tile_3 = _tile_4 = _row_1 = _row_2 = _row_3 = _row_4 = None


def _define_kernels() -> None:
    global _tile_1, _tile_2, _tile_3, _tile_4, _row_1, _row_2, _row_3, _row_4
    if _tile_4 is None:
        _row_1, _row_2, _row_3, _row_4 = (tile_kernel(_emit_tile, 1, nc) for nc in range(1, NC_MAX + 1))
        _tile_1, _tile_2, _tile_3, _tile_4 = (tile_kernel(_emit_tile, MR, nc) for nc in range(1, NC_MAX + 1))


def _with_kernels(function):
    """``jit(function)`` for a loop that calls the microkernels: they are defined before numba compiles it."""
    standard = jit(function)
    return Loop(function, lambda _: (_define_kernels(), standard.dispatcher())[1])


@jit
def pack_pairs(packed, out):
    """out[k2, n, t] = packed[n, 2*k2 + t] (0 past K and past N) for int16 ``packed`` (N, K): qgemm's packed
    weight in pairs of k, out (ceil(K / 2), N rounded up to 16, 2) int16."""
    columns, depth = packed.shape
    out[:] = 0
    for k2 in range(out.shape[0]):
        for n in range(columns):
            for t in range(2):
                k = 2 * k2 + t
                if k < depth:
                    out[k2, n, t] = packed[n, k]


def pairs_of(packed: np.ndarray) -> np.ndarray:
    """``packed`` (N, K) in pairs of k, for ``tile_product``; an empty (0, 0, 2) array where there are no tiles
    (the products then take qgemm's portable loop)."""
    if not AVAILABLE:
        return _NONE
    columns, depth = packed.shape
    out = aligned_empty(((depth + 1) // 2, (columns + LANES - 1) // LANES * LANES, 2), np.int16)
    pack_pairs(packed, out)
    return out


_NONE = np.zeros((0, 0, 2), np.int16)
_PAIRS: dict[int, tuple] = {}  # id(packed) -> (a weak reference to it, its pairs)


def _remember(packed: np.ndarray, pairs: np.ndarray) -> None:
    key = id(packed)
    _PAIRS[key] = (weakref.ref(packed, lambda _, key=key: _PAIRS.pop(key, None)), pairs)


def compact(packed: np.ndarray) -> np.ndarray:
    """A packed weight to keep: where the tiles run, the products read only its pairs, so the int16 (N, K)
    array goes once they are made and an (N, 0) stub stands in for it (its column count; pairs_for gives its
    pairs while it lives), which halves what a constant int8 weight holds. Elsewhere ``packed`` itself."""
    columns, depth = packed.shape
    if not AVAILABLE or not depth:
        return packed
    stub = np.empty((columns, 0), np.int16)
    _remember(stub, pairs_of(packed))
    return stub


def pairs_for(packed: np.ndarray) -> np.ndarray:
    """pairs_of(packed), made once per packed weight (callers keep a constant weight's packed array, so its
    pairs live as long as it does: the entry goes with the array)."""
    if not AVAILABLE:
        return _NONE
    key = id(packed)
    entry = _PAIRS.get(key)
    if entry is not None and entry[0]() is packed:
        return entry[1]
    pairs = pairs_of(packed)
    _remember(packed, pairs)
    return pairs


@jit
def portable_product(centred, pairs, out):
    """tile_product where there are no tiles: the same integers, a row at a time over the pairs."""
    rows, depth = centred.shape
    for m in range(rows):
        line = out[m]
        line[:] = 0
        for k2 in range(pairs.shape[0]):
            a0 = np.int32(centred[m, 2 * k2])
            a1 = np.int32(centred[m, 2 * k2 + 1]) if 2 * k2 + 1 < depth else np.int32(0)
            for n in range(out.shape[1]):
                line[n] += a0 * np.int32(pairs[k2, n, 0]) + a1 * np.int32(pairs[k2, n, 1])


if AVAILABLE:
    @_with_kernels
    def _row_tiles(flat_a, a_at, lda, pairs, wide, c, c_at, ldc, single):
        """MR rows (one with ``single``) of int16 ``flat_a``, the first from a_at and each ``lda`` pairs after
        the one before, by the first ``wide`` columns of the pairs, into int32 ``c`` (flat, rows of ldc values)
        from c_at."""
        depth2, ldb = pairs.shape[0], 2 * pairs.shape[1]
        flat_b = pairs.reshape(-1)
        j0 = 0
        while j0 < wide:
            nc = min(NC_MAX, (wide - j0) // LANES)
            b_at, at = 2 * j0, c_at + j0
            if single:
                if nc == 4:
                    _row_4(flat_a, a_at, flat_b, b_at, c, at, depth2, lda, ldb, ldc)
                elif nc == 3:
                    _row_3(flat_a, a_at, flat_b, b_at, c, at, depth2, lda, ldb, ldc)
                elif nc == 2:
                    _row_2(flat_a, a_at, flat_b, b_at, c, at, depth2, lda, ldb, ldc)
                else:
                    _row_1(flat_a, a_at, flat_b, b_at, c, at, depth2, lda, ldb, ldc)
            elif nc == 4:
                _tile_4(flat_a, a_at, flat_b, b_at, c, at, depth2, lda, ldb, ldc)
            elif nc == 3:
                _tile_3(flat_a, a_at, flat_b, b_at, c, at, depth2, lda, ldb, ldc)
            elif nc == 2:
                _tile_2(flat_a, a_at, flat_b, b_at, c, at, depth2, lda, ldb, ldc)
            else:
                _tile_1(flat_a, a_at, flat_b, b_at, c, at, depth2, lda, ldb, ldc)
            j0 += nc * LANES

    @jit
    def _rows_by_pairs(flat_a, start, lda, rows, pairs, out):
        """out (rows, N) int32, C-contiguous: row r the product of the 2 * K2 int16 values of ``flat_a`` from
        start + 2 * lda * r by the pairs (K2, N rounded up to 16, 2). Tiles of MR rows (then of one row, for
        the last rows % MR) by 16 * NC columns stored in place, the last partial 16 columns through a scratch
        tile."""
        columns = out.shape[1]
        full = rows - rows % MR
        wide = columns - columns % LANES
        flat_out = out.reshape(-1)
        tail = np.ascontiguousarray(pairs[:, wide:wide + LANES])
        scratch = np.empty(MR * LANES, np.int32)
        i0 = 0
        while i0 < rows:
            single = i0 >= full
            a_at = start + 2 * lda * i0
            if wide:
                _row_tiles(flat_a, a_at, lda, pairs, wide, flat_out, i0 * columns, columns, single)
            if wide < columns:
                _row_tiles(flat_a, a_at, lda, tail, LANES, scratch, 0, LANES, single)
                for i in range(1 if single else MR):
                    out[i0 + i, wide:] = scratch[i * LANES:i * LANES + columns - wide]
            i0 += 1 if single else MR

    @jit
    def _tiled(centred, pairs, out):
        """out (M, N) int32, C-contiguous = centred (M, K) int16 times the pairs (K2, N rounded up to 16, 2). A
        is read in place where its rows are whole pairs, else from a zero-padded copy."""
        rows, depth = centred.shape
        depth2 = pairs.shape[0]
        if depth == 2 * depth2:
            a = np.ascontiguousarray(centred)
        else:
            a = np.zeros((rows, 2 * depth2), np.int16)
            a[:, :depth] = centred
        _rows_by_pairs(a.reshape(-1), 0, depth2, rows, pairs, out)

    @jit
    def strided_product(flat, start, stride, rows, pairs, out):
        """out (rows, N) int32, C-contiguous: row r the product of int16 flat[start + r * stride:][:2 * K2] by the
        pairs, read in place: rows that overlap in one buffer (the windows of a 1-D convolution over channel-last
        codes, compiled/dynamic_conv.quantized_conv_lines). ``stride`` even; every row within ``flat``."""
        _rows_by_pairs(flat, start, stride // 2, rows, pairs, out)

    tile_product = _tiled
else:
    tile_product = portable_product

    @jit
    def strided_product(flat, start, stride, rows, pairs, out):
        """The register tiles' strided_product where there are none: the same integers, a row at a time."""
        for m in range(rows):
            line, at = out[m], start + m * stride
            line[:] = 0
            for k2 in range(pairs.shape[0]):
                a0, a1 = np.int32(flat[at + 2 * k2]), np.int32(flat[at + 2 * k2 + 1])
                for n in range(out.shape[1]):
                    line[n] += a0 * np.int32(pairs[k2, n, 0]) + a1 * np.int32(pairs[k2, n, 1])
