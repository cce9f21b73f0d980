"""Max and average pooling over (planes, H, W) arrays.

A box window is separable: the kernel rows of each output row are folded first (contiguous passes
over whole input rows; the rows of a window that lie in the input are a contiguous range of taps,
found once per call), then the kernel columns of that row buffer. Three loop nests share this:

- ``_pool``: one output row at a time, through a line buffer that keeps ``pad`` identity cells on
  the left and enough on the right for the last window (a ceil_mode window may overhang the
  declared pads), so the column passes need no bounds checks. For a stride ``s`` > 1 the line is
  first split into its ``s`` phases (every s-th cell), so that each kernel column is a contiguous
  run of one phase: strided loads vectorize as gathers, several times slower.
- ``_pool_rows_buffer``: the same over the rows of several planes laid end to end, for outputs so
  narrow that a loop per row would run mostly in its scalar remainder.
- ``_pool_same_width``: stride 1 with an output as wide as the input, whole planes (or groups of
  planes) per pass, with taps that fall outside their row or plane masked to the identity.

Geometry arguments, per spatial dim: kernel size ``k``, stride ``s``, dilation ``d`` and pad
before; output ``o`` reads input ``o * s - pad + t * d`` for tap ``t`` < ``k``. An average
multiplies the window sums by the reciprocal tap counts: a division runs several times slower, and
the product stays within rounding of numpy's quotient.

Each loop nest sits in one function and indexes whole arrays: a compiled call or a view per row
would pay atomic reference counting, more than a small row's work. Offset indices are unsigned:
numba wraps negative indices around, a check LLVM drops (and then vectorizes) only when it knows
the index is non-negative.
"""

from __future__ import annotations

import numpy as np

from . import jit


@jit
def _fold(u, v, is_max):
    """max (NaN wins, as in np.maximum) or sum."""
    if is_max:
        return v if (v > u) | (v != v) else u
    return u + v


@jit
def _row_taps(out_h, k, s, d, pad, height):
    """For each output row, the first input row its window covers and how many (consecutive taps) it covers."""
    first = np.zeros(out_h, dtype=np.int64)
    count = np.zeros(out_h, dtype=np.int64)
    for i in range(out_h):
        for t in range(k):
            r = i * s - pad + t * d
            if 0 <= r < height:
                if count[i] == 0:
                    first[i] = r
                count[i] += 1
    return first, count


@jit
def _pool(x, y, kh, kw, sh, sw, dh, dw, ph, pw, is_max, per_row, per_column):
    """Each output row: fold its kernel rows into the line, split the line into phases (stride >
    1), fold its kernel columns into the row, then (for an average) scale it while the row is
    still in cache."""
    identity = -np.inf if is_max else 0.0
    out_h = y.shape[1]
    out_w = np.uint64(y.shape[2])
    width = np.uint64(x.shape[2])
    first_row, row_count = _row_taps(out_h, kh, sh, dh, ph, x.shape[1])
    # Kernel column t reads line cell o * sw + t * dw: cell o + start of phase (t * dw) % sw.
    tap_phase = np.empty(kw, dtype=np.uint64)
    tap_start = np.empty(kw, dtype=np.uint64)
    for t in range(kw):
        tap_phase[t] = (t * dw) % sw
        tap_start[t] = (t * dw) // sw
    cells = y.shape[2] + (kw - 1) * dw // sw  # per phase: enough for the last tap's run
    line = np.full((1, max(pw + x.shape[2], sw * cells)), identity, dtype=x.dtype)
    phases = line if sw == 1 else np.empty((sw, cells), dtype=x.dtype)
    scale = reciprocals(per_row, per_column, is_max)
    pad = np.uint64(pw)
    for p in range(x.shape[0]):
        for i in range(out_h):
            # Kernel rows into line[0, pad:pad + width], in tap order.
            first, count = first_row[i], row_count[i]
            if count == 0:
                for j in range(width):
                    line[0, pad + j] = identity
            elif count == 1:
                for j in range(width):
                    line[0, pad + j] = x[p, first, j]
            else:
                second = first + dh
                for j in range(width):
                    line[0, pad + j] = _fold(x[p, first, j], x[p, second, j], is_max)
                for c in range(2, count):
                    r = first + c * dh
                    for j in range(width):
                        line[0, pad + j] = _fold(line[0, pad + j], x[p, r, j], is_max)
            # The line's phases; stride 2 has its own loop, which LLVM vectorizes with shuffles.
            if sw == 2:
                for m in range(cells):
                    phases[0, m] = line[0, 2 * m]
                    phases[1, m] = line[0, 2 * m + 1]
            elif sw > 2:
                for q in range(sw):
                    for m in range(cells):
                        phases[q, m] = line[0, m * sw + q]
            # Kernel columns into y[p, i], in tap order.
            q, b = tap_phase[0], tap_start[0]
            if kw == 1:
                for o in range(out_w):
                    y[p, i, o] = phases[q, b + o]
            else:
                q1, b1 = tap_phase[1], tap_start[1]
                for o in range(out_w):
                    y[p, i, o] = _fold(phases[q, b + o], phases[q1, b1 + o], is_max)
                for t in range(2, kw):
                    q, b = tap_phase[t], tap_start[t]
                    for o in range(out_w):
                        y[p, i, o] = _fold(y[p, i, o], phases[q, b + o], is_max)
            if not is_max:
                for o in range(out_w):
                    y[p, i, o] *= scale[i, o]


# Small planes run several at a time through the whole-plane loops, about this many output cells
# per group: the flat passes then stay long enough to vectorize (a 7x7 plane is 49 cells), while a
# group's buffers (and masks) stay in L1.
GROUP_CELLS = 1024


@jit
def _tile(pattern, total):
    """``pattern`` (rows, n) repeated along its rows to ``total`` cells. Element loops, not slice
    assignments: numba compiles a boolean slice assignment for many seconds, and this runs once per
    call on a few thousand cells."""
    rows, n = pattern.shape
    tiled = np.empty((rows, total), dtype=pattern.dtype)
    for r in range(rows if n > 0 else 0):  # an empty pattern (a max pool's scales) tiles to nothing
        for start in range(0, total, n):
            for i in range(min(n, total - start)):
                tiled[r, start + i] = pattern[r, i]
    return tiled


@jit
def _spread(pattern, width):
    """Each entry of ``pattern`` (rows, n) repeated ``width`` times in a row: (rows, n * width)."""
    spread = np.empty((pattern.shape[0], pattern.shape[1] * width), dtype=pattern.dtype)
    for t in range(pattern.shape[0]):
        for i in range(pattern.shape[1]):
            for j in range(width):
                spread[t, i * width + j] = pattern[t, i]
    return spread


@jit
def _taps_inside(out, k, d, pad, size):
    """Whether tap t of output o (stride 1) lands in [0, size), and whether any of tap t's do not."""
    ok = np.empty((k, out), dtype=np.bool_)
    masked = np.zeros(k, dtype=np.bool_)
    for t in range(k):
        for o in range(out):
            ok[t, o] = 0 <= o - pad + t * d < size
            masked[t] |= not ok[t, o]
    return ok, masked


@jit
def _fold_taps(dst, at, src, offsets, inside, lo, hi, identity, is_max):
    """``dst[at + m]`` = the fold, in tap order, of ``src[offsets[t] + m]`` over taps t, for m in
    [lo, hi); a tap counts where ``inside[t, m]``, the identity elsewhere. Up to three taps are
    folded per pass over the cells (a pass per tap would store every cell once per tap)."""
    k = offsets.shape[0]
    o0 = offsets[0]
    if k == 1:
        for m in range(lo, hi):
            dst[at + m] = src[o0 + m] if inside[0, m] else identity
        return
    o1 = offsets[1]
    if k == 2:
        for m in range(lo, hi):
            a = src[o0 + m] if inside[0, m] else identity
            b = src[o1 + m] if inside[1, m] else identity
            dst[at + m] = _fold(a, b, is_max)
        return
    o2 = offsets[2]
    for m in range(lo, hi):
        a = src[o0 + m] if inside[0, m] else identity
        b = src[o1 + m] if inside[1, m] else identity
        c = src[o2 + m] if inside[2, m] else identity
        dst[at + m] = _fold(_fold(a, b, is_max), c, is_max)
    for t in range(3, k, 2):
        oa = offsets[t]
        if t + 1 == k:
            for m in range(lo, hi):
                a = src[oa + m] if inside[t, m] else identity
                dst[at + m] = _fold(dst[at + m], a, is_max)
        else:
            ob = offsets[t + 1]
            for m in range(lo, hi):
                a = src[oa + m] if inside[t, m] else identity
                b = src[ob + m] if inside[t + 1, m] else identity
                dst[at + m] = _fold(_fold(dst[at + m], a, is_max), b, is_max)


@jit
def _pool_same_width(x, y, kh, kw, dh, dw, ph, pw, is_max, per_row, per_column):
    """Stride 1 with an output as wide as the input: the rows buffer and the output then share one
    pitch, so the passes run over whole planes, not rows (short rows vectorize poorly), and, when
    the output is as tall as the input, over groups of consecutive planes. A tap that falls
    outside its own plane (rows pass) or row (columns pass) is replaced by the identity through a
    per-cell mask, so the flat passes need no fix-ups, except for the outer rows of a group's
    first and last planes, whose taps would read outside the group: those fold row by row."""
    identity = x.dtype.type(-np.inf if is_max else 0.0)
    planes, height, width = x.shape
    out_h = y.shape[1]
    uwidth = np.uint64(width)
    plane_in = np.uint64(height * width)
    plane_out = np.uint64(out_h * width)
    first_row, row_count = _row_taps(out_h, kh, 1, dh, ph, height)
    inner_lo, inner_hi = out_h, out_h  # the output rows whose whole window lies in the input
    for i in range(out_h):
        if row_count[i] == kh:
            inner_lo = min(inner_lo, i)
            inner_hi = i + 1
    group = 1
    if out_h == height and inner_hi > inner_lo:
        group = max(1, min(planes, GROUP_CELLS // (out_h * width)))
    row_ok, row_masked = _taps_inside(out_h, kh, dh, ph, height)
    column_ok, column_masked = _taps_inside(width, kw, dw, pw, width)
    cells = group * out_h * width
    row_inside = _tile(_spread(row_ok, width), cells)
    column_inside = _tile(column_ok, cells)
    # The rows buffer holds ``pw`` identity cells before the rows and enough after for the last taps.
    rows = np.full(pw + cells + max(0, (kw - 1) * dw - pw), identity, dtype=x.dtype)
    pad = np.uint64(pw)
    scale = _tile(reciprocals(per_row, per_column, is_max).reshape(1, -1), 0 if is_max else cells)[0]
    xf = x.reshape(-1)
    yf = y.reshape(-1)
    step = np.uint64(dh * width)
    row_offsets = np.empty(kh, dtype=np.uint64)
    column_offsets = np.empty(kw, dtype=np.uint64)
    for t in range(kw):
        column_offsets[t] = t * dw
    for p0 in range(0, planes, group):
        g = min(group, planes - p0)
        x0 = np.uint64(p0) * plane_in
        y0 = np.uint64(p0) * plane_out
        total = np.uint64(g) * plane_out
        # Kernel rows, in tap order: from the first plane's first inner row to the last's last one.
        if inner_hi > inner_lo:
            lo = np.uint64(inner_lo) * uwidth
            run = np.uint64(g - 1) * plane_out + np.uint64(inner_hi - inner_lo) * uwidth
            src = x0 + np.uint64(first_row[inner_lo]) * uwidth - lo  # tap 0 of cell m reads src + m
            for t in range(kh):
                row_offsets[t] = src + np.uint64(t) * step
            _fold_taps(rows, pad, xf, row_offsets, row_inside, lo, lo + run, identity, is_max)
        for q in range(g):  # the top rows of the group's first plane, the bottom ones of its last
            if 0 < q < g - 1:
                continue
            for i in range(out_h):
                if inner_lo <= i < inner_hi or (i < inner_lo and q > 0) or (i >= inner_hi and q < g - 1):
                    continue
                at = pad + np.uint64(q) * plane_out + np.uint64(i) * uwidth
                count = row_count[i]
                src = x0 + np.uint64(q) * plane_in + np.uint64(first_row[i]) * uwidth
                for j in range(uwidth):
                    rows[at + j] = xf[src + j] if count > 0 else identity
                for _ in range(1, count):
                    src += step
                    for j in range(uwidth):
                        rows[at + j] = _fold(rows[at + j], xf[src + j], is_max)
        # Kernel columns, in tap order: output m reads rows[pad + m - pw + t * dw].
        _fold_taps(yf, y0, rows, column_offsets, column_inside, np.uint64(0), total, identity, is_max)
        if not is_max:
            for m in range(total):
                yf[y0 + m] *= scale[m]


# Output rows up to this wide pool through a rows buffer over several rows at once: a loop over a
# row this short runs mostly in its scalar remainder (LLVM's vector loop takes 32 floats a step).
# Wider rows pool row by row, which keeps each row's cells in cache between the passes.
NARROW_ROWS = 32


@jit
def _fold_phases(dst, at, phases, tap_phase, tap_start, n, is_max):
    """``dst[at + m]`` = the fold, in tap order, of ``phases[tap_phase[t], tap_start[t] + m]`` over
    taps t, for m in [0, n): unit-stride runs, which vectorize."""
    q, b = tap_phase[0], tap_start[0]
    if tap_phase.shape[0] == 1:
        for m in range(n):
            dst[at + m] = phases[q, b + m]
        return
    q1, b1 = tap_phase[1], tap_start[1]
    for m in range(n):
        dst[at + m] = _fold(phases[q, b + m], phases[q1, b1 + m], is_max)
    for t in range(2, tap_phase.shape[0]):
        q, b = tap_phase[t], tap_start[t]
        for m in range(n):
            dst[at + m] = _fold(dst[at + m], phases[q, b + m], is_max)


@jit
def _pool_rows_buffer(x, y, kh, kw, sh, sw, dh, dw, ph, pw, is_max, per_row, per_column):
    """Narrow outputs: each output row folds its kernel rows into a row of a buffer whose pitch is
    ``sw`` times an output pitch, between identity cells for the pads, so that output cell m of the
    buffer's rows laid end to end reads buffer cell ``sw * m + t * dw``: the phase split and the
    columns pass run over all the rows of a group of planes at once. Outputs past a row's end (the
    output pitch may exceed the output width) are dropped when the outputs are copied into place,
    with an average's scale applied."""
    identity = x.dtype.type(-np.inf if is_max else 0.0)
    planes, height, width = x.shape
    out_h, out_w = y.shape[1], y.shape[2]
    reach = max(pw + width, sw * (out_w - 1) + (kw - 1) * dw + 1)
    out_pitch = -(-reach // sw)
    pitch = np.uint64(sw * out_pitch)
    group = max(1, min(planes, GROUP_CELLS // (out_h * out_pitch)))
    # Kernel column t of output cell m reads cell m + tap_start[t] of phase tap_phase[t] (every
    # sw-th cell of the buffer, from cell tap_phase[t]).
    tap_phase = np.empty(kw, dtype=np.uint64)
    tap_start = np.empty(kw, dtype=np.uint64)
    for t in range(kw):
        tap_phase[t] = (t * dw) % sw
        tap_start[t] = (t * dw) // sw
    phase_cells = group * out_h * out_pitch + (kw - 1) * dw // sw
    buffer = np.full(sw * phase_cells, identity, dtype=x.dtype)
    phases = buffer.reshape(1, -1) if sw == 1 else np.empty((sw, phase_cells), dtype=x.dtype)
    direct = out_pitch == out_w and is_max  # the columns pass writes the output itself
    cells = group * out_h * out_pitch
    z = np.empty(0 if direct else cells, dtype=x.dtype)
    first_row, row_count = _row_taps(out_h, kh, sh, dh, ph, height)
    scale = reciprocals(per_row, per_column, is_max)
    yf = y.reshape(-1)
    uwidth = np.uint64(width)
    pad = np.uint64(pw)
    for p0 in range(0, planes, group):
        g = min(group, planes - p0)
        for q in range(g):  # kernel rows into the buffer's rows, in tap order
            p = p0 + q
            for i in range(out_h):
                at = np.uint64(q * out_h + i) * pitch + pad
                first, count = first_row[i], row_count[i]
                if count == 0:
                    for j in range(uwidth):
                        buffer[at + j] = identity
                elif count == 1:
                    for j in range(uwidth):
                        buffer[at + j] = x[p, first, j]
                else:
                    second = first + dh
                    for j in range(uwidth):
                        buffer[at + j] = _fold(x[p, first, j], x[p, second, j], is_max)
                    for c in range(2, count):
                        r = first + c * dh
                        for j in range(uwidth):
                            buffer[at + j] = _fold(buffer[at + j], x[p, r, j], is_max)
        n = np.uint64(g * out_h * out_pitch)
        used = n + np.uint64((kw - 1) * dw // sw)  # the phase cells the columns read
        if sw == 2:  # its own loop, which LLVM vectorizes with shuffles
            for m in range(used):
                phases[0, m] = buffer[np.uint64(2) * m]
                phases[1, m] = buffer[np.uint64(2) * m + np.uint64(1)]
        elif sw > 2:
            for q in range(sw):
                for m in range(used):
                    phases[q, m] = buffer[m * np.uint64(sw) + np.uint64(q)]
        if direct:
            _fold_phases(yf, np.uint64(p0 * out_h * out_w), phases, tap_phase, tap_start, n, is_max)
            continue
        _fold_phases(z, np.uint64(0), phases, tap_phase, tap_start, n, is_max)
        for q in range(g):
            for i in range(out_h):
                at = np.uint64((q * out_h + i) * out_pitch)
                if is_max:
                    for o in range(out_w):
                        y[p0 + q, i, o] = z[at + o]
                else:
                    for o in range(out_w):
                        y[p0 + q, i, o] = z[at + o] * scale[i, o]


@jit
def reciprocals(per_row, per_column, is_max):
    """1 / (tap count) of each output of an average (empty for a max)."""
    scale = np.empty((0 if is_max else per_row.shape[0], per_column.shape[0]), dtype=per_row.dtype)
    for i in range(scale.shape[0]):
        for j in range(per_column.shape[0]):
            scale[i, j] = 1 / (per_row[i] * per_column[j])
    return scale


# A plane sum runs as 8 interleaved partial sums (in the input dtype), which LLVM packs into one
# vector: a single running sum is a serial chain of additions. Sequential partial sums lose
# accuracy as planes grow, so callers keep numpy's pairwise sums for planes larger than this.
PLANE_SUM_LIMIT = 4096


@jit
def plane_means(x, y, divisor):
    """``y[p]`` = the sum of row ``p`` of ``x`` (planes, size) divided by ``divisor``."""
    size = np.uint64(x.shape[1])
    blocks = size // np.uint64(8)
    zero = x.dtype.type(0)
    for p in range(x.shape[0]):
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
        for b in range(blocks):
            at = b * np.uint64(8)
            s0 += x[p, at]
            s1 += x[p, at + np.uint64(1)]
            s2 += x[p, at + np.uint64(2)]
            s3 += x[p, at + np.uint64(3)]
            s4 += x[p, at + np.uint64(4)]
            s5 += x[p, at + np.uint64(5)]
            s6 += x[p, at + np.uint64(6)]
            s7 += x[p, at + np.uint64(7)]
        total = ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))
        for r in range(blocks * np.uint64(8), size):
            total += x[p, r]
        y[p] = total / divisor


@jit
def tap_counts(outs, k, s, d, lo, hi, dtype):
    """How many taps of each of ``outs`` outputs land on padded positions [lo, hi)."""
    counts = np.zeros(outs, dtype=dtype)
    for o in range(outs):
        for t in range(k):
            q = o * s + t * d
            counts[o] += 1 if lo <= q < hi else 0
    return counts


@jit
def pool_2d(x, y, kh, kw, sh, sw, dh, dw, ph, pw, is_max, lo_h, hi_h, lo_w, hi_w):
    """``y[p, i, j]`` = the max (``is_max``) or average over the window of output (i, j) of plane
    ``p`` of ``x``. Taps in the padding are skipped: a max window wholly in the padding gives -inf;
    an average divides the window sum by how many of its taps land on counted positions, padded
    rows [lo_h, hi_h) and columns [lo_w, hi_w) in padded coordinates (the input alone, or with the
    declared pads for count_include_pad).

    ``is_max`` is a runtime flag (callers pass a Python bool, not a constant), so one compilation
    per dtype serves both ops: LLVM unswitches the loops on it."""
    per_row = tap_counts(y.shape[1], kh, sh, dh, lo_h, hi_h, y.dtype)
    per_column = tap_counts(y.shape[2], kw, sw, dw, lo_w, hi_w, y.dtype)
    covers = dh == dw == 1 and kh - 1 - ph >= x.shape[1] - 1 and kw - 1 - pw >= x.shape[2] - 1
    whole_planes = y.shape[1] == y.shape[2] == 1 and covers and x.shape[1] * x.shape[2] <= PLANE_SUM_LIMIT
    if whole_planes and not is_max:
        # One window over each whole plane (as closing a CNN): a plane mean.
        planes = x.shape[0]
        plane_means(x.reshape(planes, -1), y.reshape(planes), per_row[0] * per_column[0])
    elif sh == sw == 1 and y.shape[2] == x.shape[2]:
        _pool_same_width(x, y, kh, kw, dh, dw, ph, pw, is_max, per_row, per_column)
    elif y.shape[2] <= NARROW_ROWS:
        _pool_rows_buffer(x, y, kh, kw, sh, sw, dh, dw, ph, pw, is_max, per_row, per_column)
    else:
        _pool(x, y, kh, kw, sh, sw, dh, dw, ph, pw, is_max, per_row, per_column)
