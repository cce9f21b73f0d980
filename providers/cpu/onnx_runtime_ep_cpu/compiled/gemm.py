"""Packed float32 convolution: a register-tiled GEMM microkernel written as LLVM IR, fed straight
from the input image, with the convolution's epilogue applied while the tile is still in registers.

numpy's OpenBLAS computes a convolution's product well, but a convolution through it is three passes:
the im2col copy, the product (which packs its operands again), and the epilogue (bias, residual,
activation). Here the column matrix is never built. Lanes of 32 output pixels form a panel; for a
stride-1 window the lanes run over the zero-padded image's rows, so each column row of a panel is a
contiguous run of the image (one offset per kernel tap) that the microkernel reads in place, and so
do they for a strided window over the image split into its stride's phases (phase_tap_offsets); other
windows pack each panel into the (K, NR) layout first. The microkernel keeps an MR x NR tile of the
output in vector registers over a block of the reduction, then adds the bias and the residual and
applies the activation as it stores the tile. The weights are packed once per constant array into
(M / MR, K * MR) panels, MR = 12 output channels per tile, or 8 where 12 would leave many rows of the
last tile empty.

The microkernel is emitted as LLVM IR through a numba intrinsic (24 AVX-512 accumulators, one fused
multiply-add per weight and half panel), since numba's own loops cannot keep an accumulator tile in
registers. Reductions run in the order k = 0 .. K-1 for every output, whichever thread or tile
computes it, so results do not depend on the partition. Used only where the host has AVX-512
(``AVAILABLE``, host.AVX512); elsewhere the convolution keeps its BLAS paths.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from . import host, jit, llvm
from .aligned import aligned_zeros

MR, NR = 12, 32  # output channels (at most) x output pixels per tile: 24 zmm accumulators
BIAS, RESIDUAL, ACCUMULATE, PARTIAL = 1, 2, 4, 8  # the microkernel's flags


AVAILABLE = host.AVX512  # read by the callers of every 16-lane kernel (see host.py)



def _emit_tile(context, builder, mr: int, pointers: tuple, values: tuple, lda=None) -> None:
    """The IR of one MR x NR tile (see _tile_kernel): ``pointers`` = (a, b, rows, c, bias, residual,
    bounds), ``values`` = (depth, ldc, ldr, flags). With ``lda`` (matmul_kernel) a's row i starts at
    i * lda and k runs along it (a row-major matrix read in place) and the bias is per lane (a
    MatMul's, over the output's columns); without, a is the packed panel (a[k*MR + i]) and the bias
    per row (a convolution's, per output channel)."""
    a_ptr, b_ptr, rows_ptr, c_ptr, bias_ptr, res_ptr, bounds_ptr = pointers
    depth_v, ldc_v, ldr_v, flags_v = values
    fma = llvm.fma(builder.module)
    prefetch = llvm.declare(builder.module, "llvm.prefetch.p0",
                            ir.FunctionType(ir.VoidType(), [llvm.BYTE_PTR, llvm.I32, llvm.I32, llvm.I32]))
    vec_ptr = llvm.VEC.as_pointer()

    def const(value):
        return ir.Constant(llvm.I64, value)

    def splat(scalar):
        return llvm.splat(builder, scalar)

    def vector_at(pointer, offset):
        return builder.bitcast(builder.gep(pointer, [offset]), vec_ptr)

    # The starting values: zero, or the partial sums of earlier blocks of k stored in c.
    zero = llvm.ZEROS
    entry = builder.block
    a_rows = None if lda is None else [builder.mul(const(i), lda) for i in range(mr)]  # where a's rows start
    load = builder.append_basic_block("tile.load")
    start = builder.append_basic_block("tile.start")
    accumulate = builder.icmp_signed("!=", builder.and_(flags_v, const(ACCUMULATE)), const(0))
    builder.cbranch(accumulate, load, start)
    builder.position_at_end(load)
    loaded = [builder.load(vector_at(c_ptr, builder.add(builder.mul(const(i), ldc_v), const(half * llvm.LANES))),
                           align=4)
              for i in range(mr) for half in range(2)]
    builder.branch(start)
    builder.position_at_end(start)
    initial = llvm.merged(builder, ([zero] * len(loaded), entry), (loaded, load))

    def row(k, acc):
        """One k: the tile's MR x 2 accumulators plus row k of a times row k of the panel."""
        b_row = builder.load(builder.gep(rows_ptr, [k]))
        b_lo = builder.load(vector_at(b_ptr, b_row), align=4)
        b_hi = builder.load(vector_at(b_ptr, builder.add(b_row, const(llvm.LANES))), align=4)
        # The same row of the next panel, read in place (right after this one in the image): a
        # prefetch, since the K rows of a panel are K streams too many for the hardware prefetcher.
        for ahead in (NR, NR + llvm.LANES):
            target = builder.bitcast(builder.gep(b_ptr, [builder.add(b_row, const(ahead))]), llvm.BYTE_PTR)
            read, locality, data = (ir.Constant(llvm.I32, v) for v in (0, 3, 1))
            builder.call(prefetch, [target, read, locality, data])
        a_row = builder.mul(k, const(mr)) if a_rows is None else k
        summed = []
        for i in range(mr):
            at = builder.add(a_row, const(i)) if a_rows is None else builder.add(a_rows[i], k)
            weight = splat(builder.load(builder.gep(a_ptr, [at])))
            summed.append(builder.call(fma, [weight, b_lo, acc[2 * i]]))
            summed.append(builder.call(fma, [weight, b_hi, acc[2 * i + 1]]))
        return summed

    # The reduction: one loop, MR*2 accumulators carried in registers.
    totals = llvm.counted_loop(builder, depth_v, initial, row, "tile")

    # The epilogue, as the tile is stored; partial sums are stored as they are.
    store_partial = builder.append_basic_block("tile.partial")
    epilogue = builder.append_basic_block("tile.epilogue")
    builder.cbranch(builder.icmp_signed("!=", builder.and_(flags_v, const(PARTIAL)), const(0)), store_partial,
                    epilogue)
    builder.position_at_end(store_partial)
    for i in range(mr):
        row_at = builder.mul(const(i), ldc_v)
        for half in range(2):
            target = vector_at(c_ptr, builder.add(row_at, const(half * llvm.LANES)))
            builder.store(totals[2 * i + half], target, align=4)
    done = builder.append_basic_block("tile.done")
    builder.branch(done)
    builder.position_at_end(epilogue)
    with_bias = builder.icmp_signed("!=", builder.and_(flags_v, const(BIAS)), const(0))
    with_residual = builder.icmp_signed("!=", builder.and_(flags_v, const(RESIDUAL)), const(0))
    bounds = [splat(builder.load(builder.gep(bounds_ptr, [const(i)]))) for i in range(3)]
    if lda is not None:  # a bias per lane: the same two vectors for every row
        lane_bias = [builder.load(vector_at(bias_ptr, const(half * llvm.LANES)), align=4) for half in range(2)]
    for i in range(mr):
        row_bias = splat(builder.load(builder.gep(bias_ptr, [const(i)]))) if lda is None else None
        for half in range(2):
            v = totals[2 * i + half]
            bias_v = row_bias if lda is None else lane_bias[half]
            v = builder.select(with_bias, builder.fadd(v, bias_v), v)  # adding 0 would turn -0.0 into +0.0
            totals[2 * i + half] = v
    finish = builder.append_basic_block("tile.finish")
    add_residual = builder.append_basic_block("tile.residual")
    before = builder.block
    builder.cbranch(with_residual, add_residual, finish)
    builder.position_at_end(add_residual)
    with_res = []
    for i in range(mr):
        row_at = builder.mul(const(i), ldr_v)
        for half in range(2):
            z = builder.load(vector_at(res_ptr, builder.add(row_at, const(half * llvm.LANES))), align=4)
            with_res.append(builder.fadd(totals[2 * i + half], z))
    builder.branch(finish)
    builder.position_at_end(finish)
    merged = llvm.merged(builder, (totals, before), (with_res, add_residual))
    for i in range(mr):
        row_at = builder.mul(const(i), ldc_v)
        for half in range(2):
            v = llvm.activated(builder, merged[2 * i + half], bounds)
            builder.store(v, vector_at(c_ptr, builder.add(row_at, const(half * llvm.LANES))), align=4)
    builder.branch(done)
    builder.position_at_end(done)


def _tile_kernel(rows_per_tile: int):
    """The microkernel for tiles of ``rows_per_tile`` output channels (its MR) x NR pixels."""

    @intrinsic
    def microkernel(typingctx, a, b, rows, c, depth, ldc, bias, residual, ldr, flags, bounds):
        """c[i*ldc + j] = act(sum_k a[k*MR + i] * b[rows[k] + j] (+ bias[i]) (+ residual[i*ldr + j])) for an
        MR x NR tile; ``flags``: BIAS adds the bias, RESIDUAL the residual; ACCUMULATE starts the sums
        from c (the partial sums of earlier blocks of k) instead of zero; PARTIAL stores the sums without
        the epilogue (a block of k before the last). ``bounds`` = (low, high, slope) of the activation, as
        compiled/epilogue.py's activate (NaN passes through). ``rows`` holds where each of the K rows of
        NR lanes starts in ``b``: k*NR in a packed panel, or a tap's offset in the image itself."""
        signature = types.void(a, b, rows, c, depth, ldc, bias, residual, ldr, flags, bounds)

        def codegen(context, builder, sig, args):
            def data(index):
                return context.make_array(sig.args[index])(context, builder, args[index]).data

            _emit_tile(context, builder, rows_per_tile, tuple(data(i) for i in (0, 1, 2, 3, 6, 7, 10)),
                       (args[4], args[5], args[8], args[9]))
            return context.get_dummy_value()

        return signature, codegen
    return microkernel


def matmul_kernel(rows_per_tile: int):
    """The microkernel of a MatMul's tiles, ``rows_per_tile`` rows of a row-major ``a`` (read in place,
    row i at a[i*lda:]) x NR columns: c[i*ldc + j] = act(sum_k a[i*lda + k] * b[rows[k] + j] (+ bias[j])
    (+ residual[i*ldr + j])), flags and bounds as _tile_kernel's."""

    @intrinsic
    def microkernel(typingctx, a, lda, b, rows, c, depth, ldc, bias, residual, ldr, flags, bounds):
        signature = types.void(a, lda, b, rows, c, depth, ldc, bias, residual, ldr, flags, bounds)

        def codegen(context, builder, sig, args):
            def data(index):
                return context.make_array(sig.args[index])(context, builder, args[index]).data

            _emit_tile(context, builder, rows_per_tile, tuple(data(i) for i in (0, 2, 3, 4, 7, 8, 11)),
                       (args[5], args[6], args[9], args[10]), lda=args[1])
            return context.get_dummy_value()

        return signature, codegen
    return microkernel


_microkernel_12, _microkernel_8 = _tile_kernel(12), _tile_kernel(8)


@intrinsic
def _copy_panel_row(typingctx, dst, dst_at, src, src_at):
    """dst[dst_at : dst_at + NR] = src[src_at : src_at + NR] as NR / 16 vector loads and stores (LLVM
    leaves this copy scalar: it cannot rule out that the arrays overlap)."""
    signature = types.void(dst, dst_at, src, src_at)

    def codegen(context, builder, sig, args):
        dst_ptr = context.make_array(sig.args[0])(context, builder, args[0]).data
        src_ptr = context.make_array(sig.args[2])(context, builder, args[2]).data
        vec_ptr = llvm.VEC.as_pointer()
        for half in range(NR // llvm.LANES):
            offset = ir.Constant(llvm.I64, half * llvm.LANES)
            source = builder.bitcast(builder.gep(src_ptr, [builder.add(args[3], offset)]), vec_ptr)
            target = builder.bitcast(builder.gep(dst_ptr, [builder.add(args[1], offset)]), vec_ptr)
            builder.store(builder.load(source, align=4), target, align=4)
        return context.get_dummy_value()

    return signature, codegen


def tile_rows(m: int) -> int:
    """The tile height for m output channels: 12, or 8 where 12 would leave over 6% of the rows empty
    (64 channels: 72 rows in 12s, 64 in 8s)."""
    return 8 if -(-m // 12) * 12 > 1.06 * (-(-m // 8) * 8) else 12


def pack_weights(w: np.ndarray, rows: int, out: np.ndarray | None = None) -> np.ndarray:
    """(M, K) weights as (ceil(M / rows), K * rows) float32 panels for tiles ``rows`` high: panel t holds
    rows t*rows .. t*rows + rows - 1 interleaved by k (zero rows past M), the order the microkernel
    reads them; written into ``out`` (zeros of that shape, C-contiguous: one group's part of a grouped
    convolution's panels) where given, else into a new array that starts on a cache line."""
    m, depth = w.shape
    tiles, whole = -(-m // rows), m // rows
    # (written in place: no padded copy of w first)
    packed = aligned_zeros((tiles, depth, rows)) if out is None else out.reshape(tiles, depth, rows)
    packed[:whole] = w[:whole * rows].reshape(whole, rows, depth).transpose(0, 2, 1)
    if whole < tiles:
        packed[whole, :, :m - whole * rows] = w[whole * rows:].T
    return packed.reshape(tiles, depth * rows)


# Panels packed per chunk and weight tiles per block: about 512 KiB each, so a chunk of packed input
# and a block of weights stay in the L2 cache while every pairing of their tiles is computed.
_CHUNK_BYTES = 1 << 19


@jit
def pad_planes(x, out, top, left, padded_height, padded_width):
    """out = the planes of x (C, H, W) with ``top`` zero rows and ``left`` zero columns before each and zeros
    after, up to (padded_height, padded_width), as C * padded_height * padded_width values; the rest of
    out (a margin) zero. Every cell written, so ``out`` may be any scratch buffer: numpy's assignment into
    the interior of a padded view copied row by row, many times slower on small planes (41debc9)."""
    channels, height, width = x.shape
    plane = padded_height * padded_width
    for c in range(channels):
        # (Loop indices from range over slices: numba then knows them non-negative and the loops vectorize.)
        _zero(out[c * plane:c * plane + top * padded_width])
        for r in range(height):
            row = out[c * plane + (top + r) * padded_width:c * plane + (top + r + 1) * padded_width]
            line = x[c, r]
            for j in range(left):
                row[j] = 0
            inner = row[left:left + width]
            for j in range(width):
                inner[j] = line[j]
            for j in range(left + width, padded_width):
                row[j] = 0
        _zero(out[c * plane + (top + height) * padded_width:(c + 1) * plane])
    _zero(out[channels * plane:])


@jit
def _zero(a):
    for j in range(a.shape[0]):
        a[j] = 0


@jit
def _pack_runs(xp, buf, start, count, channels, kh, kw, sh, sw, dh, dw, wp, plane, ow):
    """buf[k*NR + q] = column k of output pixel start + q from the zero-padded image ``xp`` (flat,
    channels x plane, rows wp wide), for q < count; zero lanes after. k = (c*kh + i)*kw + j. The
    panel's pixels are copied per output row they lie on (any stride)."""
    depth = channels * kh * kw
    q = 0
    while q < count:
        pixel = start + q
        oy, ox = pixel // ow, pixel % ow
        run = min(count - q, ow - ox)  # the panel's pixels on output row oy
        origin = oy * sh * wp + ox * sw
        for c in range(channels):
            for i in range(kh):
                for j in range(kw):
                    src = np.uint64(c * plane + origin + i * dh * wp + j * dw)
                    dst = np.uint64(((c * kh + i) * kw + j) * NR + q)
                    if sw == 1:
                        for r in range(run):
                            buf[dst + np.uint64(r)] = xp[src + np.uint64(r)]
                    else:
                        for r in range(run):
                            buf[dst + np.uint64(r)] = xp[src + np.uint64(r * sw)]
        q += run
    if count < NR:
        for k in range(depth):
            for r in range(count, NR):
                buf[k * NR + r] = 0


@jit
def _pack_taps(xp, buf, start, taps):
    """A panel read in place (column row k at start + taps[k], NR lanes) copied into buf[k * NR:], cut
    where ``xp`` ends (the lanes past it belong to dropped columns: their values do not matter)."""
    size = xp.shape[0]
    for k in range(taps.shape[0]):
        src = start + taps[k]
        if src + NR <= size:
            _copy_panel_row(buf, k * NR, xp, src)
        else:
            for r in range(NR):
                buf[k * NR + r] = xp[src + r] if src + r < size else 0


@jit
def _store_lanes(tile, y, residual, ldy, row0, rows, start, grid, ow, oh, flags, bounds):
    """The lanes of a tile (rows x NR, already holding the bias) that are output pixels, finished with
    the residual and activation: lane q is grid position start + q, on output row (start + q) // grid,
    column (start + q) % grid, which is a pixel where the column is < ow and the row < oh."""
    low, high, slope = bounds[0], bounds[1], bounds[2]
    q = 0
    while q < NR:
        position = start + q
        oy, ox = position // grid, position % grid
        if oy >= oh:
            break
        run = min(NR - q, grid - ox)
        count = min(run, ow - ox)
        for i in range(rows):
            at = np.uint64((row0 + i) * ldy + oy * ow + ox)
            lane = np.uint64(i * NR + q)
            if flags & 2:
                for r in range(count):
                    v = tile[lane + np.uint64(r)] + residual[at + np.uint64(r)]
                    v = v * slope if v < 0 else v
                    v = low if v < low else v
                    y[at + np.uint64(r)] = high if v > high else v
            else:
                for r in range(count):
                    v = tile[lane + np.uint64(r)]
                    v = v * slope if v < 0 else v
                    v = low if v < low else v
                    y[at + np.uint64(r)] = high if v > high else v
        q += run


@jit
def conv_panels(xp, weights, bias, y, residual, flags, bounds, m_rows, oh, ow, grid, channels, kh, kw, sh, sw, dh,
                dw, wp, plane, taps, packed, first, end, tile_first, tile_end, buf):
    """Panels first .. end (NR lanes each) and weight tiles tile_first .. tile_end (8 or 12 output
    channels each, as the weights were packed) of one image (and group): y (m_rows * oh * ow, flat)
    = act(weights * columns(xp) + bias + residual), see the module docstring. ``bias`` is padded to
    whole tiles; ``buf`` holds a chunk of packed panels. The reduction runs in blocks of _DEPTH_BLOCK
    rows of k, partial sums kept in y (or, for tiles stored lane by lane, in a buffer) between blocks.

    Lanes run over output rows ``grid`` wide. For stride 1, ``grid`` is the padded width ``wp`` (the
    lanes past ow computed and dropped): the lanes of each column row are then a contiguous run of
    the image at ``taps[k]`` (the tap's offset) from the panel's start, and the microkernel reads them
    there, without packing. Otherwise (grid = ow) each panel is packed (``packed`` = k * NR)."""
    depth = channels * kh * kw
    pixels = oh * ow
    lanes = oh * grid
    panel_size = depth * NR
    direct = grid == wp and sh == 1 and sw == 1
    reach = NR  # a panel read in place needs start + reach <= size
    for k in range(depth if direct else 0):
        reach = max(reach, taps[k] + NR)
    chunk = end - first if direct else max(1, min(buf.shape[0] // panel_size, end - first))
    mr = weights.shape[1] // max(depth, 1)  # the tile height the weights were packed for
    span = min(depth, _DEPTH_BLOCK)
    block = max(1, min(tile_end - tile_first, _CHUNK_BYTES // max(1, span * mr * 4)))
    partial = np.empty(block * mr * NR, dtype=np.float32)  # the block's tiles stored lane by lane
    for chunk_start in range(first, end, chunk):
        chunk_end = min(end, chunk_start + chunk)
        if not direct:
            for p in range(chunk_start, chunk_end):
                start = p * NR
                _pack_runs(xp, buf[(p - chunk_start) * panel_size:], start, min(NR, pixels - start), channels, kh, kw,
                           sh, sw, dh, dw, wp, plane, ow)
        for block_start in range(tile_first, tile_end, block):
            block_end = min(tile_end, block_start + block)
            for p in range(chunk_start, chunk_end):
                start = p * NR
                if not direct:
                    b, rows_at = buf[(p - chunk_start) * panel_size:], packed
                elif start + reach <= xp.shape[0]:
                    b, rows_at = xp[start:], taps
                else:  # the image ends within this panel's reach: a bounded copy
                    _pack_taps(xp, buf, start, taps)
                    b, rows_at = buf, packed
                # Whether the panel's lanes are NR pixels in a row of y, from ``origin``: every lane a pixel
                # in order (grid = ow), or the panel lies within one output row (grid = wp).
                line, column = start // grid, start % grid
                whole = start + NR <= lanes and (grid == ow or column + NR <= ow)
                origin = start if grid == ow else line * ow + column
                # Blocks of k: a block's rows of the panel stay in L1 while every tile of the block uses them.
                for k0 in range(0, depth, span):
                    count = min(span, depth - k0)
                    last = k0 + count == depth
                    step = (0 if k0 == 0 else ACCUMULATE) | (0 if last else PARTIAL)
                    for t in range(block_start, block_end):
                        row0 = t * mr
                        a = weights[t, k0 * mr:]
                        if whole and row0 + mr <= m_rows:
                            at = row0 * pixels + origin
                            _tile(mr, a, b, rows_at[k0:], y[at:], count, pixels, bias[row0:], residual[at:], pixels,
                                  flags | step, bounds)
                        else:
                            own = partial[(t - block_start) * mr * NR:]
                            _tile(mr, a, b, rows_at[k0:], own, count, NR, bias[row0:], own, NR, (flags & BIAS) | step,
                                  IDENTITY)
                            if last:
                                _store_lanes(own, y, residual, pixels, row0, min(mr, m_rows - row0), start, grid, ow,
                                             oh, flags, bounds)


@jit
def _tile(mr, a, b, rows, c, depth, ldc, bias, residual, ldr, flags, bounds):
    """The microkernel for tiles ``mr`` high."""
    if mr == 8:
        _microkernel_8(a, b, rows, c, depth, ldc, bias, residual, ldr, flags, bounds)
    else:
        _microkernel_12(a, b, rows, c, depth, ldc, bias, residual, ldr, flags, bounds)


# Rows of k per block: the block's rows of a panel (64 KiB) stay near the core across the tiles
# (faster on whole models than no blocks, and 256 no better: 540b01f).
_DEPTH_BLOCK = 512
IDENTITY = np.array([-np.inf, np.inf, 1.0], dtype=np.float32)  # the bounds of no activation


def tap_offsets(channels: int, kh: int, kw: int, dh: int, dw: int, wp: int, plane: int) -> np.ndarray:
    """Where column row k = (c*kh + i)*kw + j of a panel read in place starts, from the panel's start in
    the padded image: c*plane + i*dh*wp + j*dw (increasing in k)."""
    c, i, j = np.meshgrid(np.arange(channels), np.arange(kh), np.arange(kw), indexing="ij")
    return np.ascontiguousarray((c * plane + i * dh * wp + j * dw).reshape(-1), dtype=np.int64)


def phase_tap_offsets(channels: int, kh: int, kw: int, sh: int, sw: int, dh: int, dw: int, phase_height: int,
                      phase_width: int) -> np.ndarray:
    """tap_offsets for a strided window over the padded image split into its sh x sw phases (phase (p, q)
    holds rows p, p + sh, ... and columns q, q + sw, ...; laid out (p, q, channel, row, column), each
    plane phase_height x phase_width): tap (i, j) of channel c reads phase (i*dh % sh, j*dw % sw) of c,
    shifted (i*dh // sh) rows and (j*dw // sw) columns. Output (y, x) then reads its taps at its own
    position y * phase_width + x of every phase, as a stride-1 window reads the image: the microkernel
    reads the panels in place."""
    c, i, j = np.meshgrid(np.arange(channels), np.arange(kh) * dh, np.arange(kw) * dw, indexing="ij")
    plane = phase_height * phase_width
    offsets = (((i % sh) * sw + j % sw) * channels + c) * plane + (i // sh) * phase_width + j // sw
    return np.ascontiguousarray(offsets.reshape(-1), dtype=np.int64)


def packed_offsets(depth: int) -> np.ndarray:
    """Where column row k of a packed panel starts: k * NR."""
    return np.arange(depth, dtype=np.int64) * NR


def scratch_size(depth: int) -> int:
    """Floats of packed-panel buffer conv_tasks needs for a reduction of ``depth``: one chunk."""
    return max(depth * NR, _CHUNK_BYTES // 4)


@jit
def conv_tasks(xp, weights, bias, y, residual, flags, bounds, m_rows, oh, ow, grid, channels, kh, kw, sh, sw, dh, dw,
               wp, plane, taps, packed, tasks, buf):
    """conv_panels for each task (image, group, first panel, end panel, first tile, end tile) of ``tasks``
    (T, 6): xp is the
    zero-padded input (N, C * plane), y and residual (N, M * oh * ow) with M = groups * m_rows, weights
    (G, tiles, K * mr) and bias (G, tiles * mr) for tiles mr high; ``taps`` and ``packed`` the row offsets of
    conv_panels (tap_offsets, packed_offsets). One call per thread, with its own ``buf`` (at least
    scratch_size(K) floats)."""
    group_in, group_out = channels * plane, m_rows * oh * ow
    for t in range(tasks.shape[0]):
        n, g, first, end = tasks[t, 0], tasks[t, 1], tasks[t, 2], tasks[t, 3]
        tile_first, tile_end = tasks[t, 4], tasks[t, 5]
        image = xp[n, g * group_in:(g + 1) * group_in]
        out = y[n, g * group_out:(g + 1) * group_out]
        res = residual[n, g * group_out:(g + 1) * group_out] if flags & 2 else residual[0, :0]
        conv_panels(image, weights[g], bias[g], out, res, flags, bounds, m_rows, oh, ow, grid, channels, kh, kw,
                    sh, sw, dh, dw, wp, plane, taps, packed, first, end, tile_first, tile_end, buf)
