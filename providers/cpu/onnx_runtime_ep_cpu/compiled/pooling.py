"""Max and average pooling over (planes, H, W) arrays, one output row at a time (whole planes at a
time for stride 1 with an output as wide as the input, see ``_pool_same_width``).

A box window is separable: each output row first folds its kernel rows of the input into a line
buffer (contiguous passes over whole rows; the rows of a window that lie in the input are a
contiguous range of taps, found once per call), then folds the line's kernel columns into the
output row. The line keeps ``pad`` cells of padding on the left and enough on the right for the
last window (a ceil_mode window may overhang the declared pads), filled once with the identity, so
the column passes need no bounds checks. For a stride ``s`` > 1 the line is first split into its
``s`` phases (every s-th cell), so that each kernel column is a contiguous run of one phase:
strided loads vectorize as gathers, several times slower.

Geometry arguments, per spatial dim: kernel size ``k``, stride ``s``, dilation ``d`` and pad
before; output ``o`` reads input ``o * s - pad + t * d`` for tap ``t`` < ``k``.

Each loop nest sits in one function and indexes whole arrays: a compiled call or a view per row
would pay atomic reference counting, more than a small row's work. Offset indices are unsigned:
numba wraps negative indices around, a check LLVM drops (and then vectorizes) only when it knows
the index is non-negative.
"""

from __future__ import annotations

import numpy as np

from . import jit, takes  # noqa: F401  (takes: for the callers)


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
    1), fold its kernel columns into the row, then (for an average) divide by the tap counts while
    the row is still in cache."""
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
                rows = per_row[i]
                for o in range(out_w):
                    y[p, i, o] /= rows * per_column[o]


@jit
def _border_columns(width, kw, dw, pw):
    """The output columns (as wide as the input) whose window reaches past the input's sides, and
    for each the first input column its taps read and how many they read."""
    right = max(0, (kw - 1) * dw - pw)  # columns on the right whose last taps overhang
    left = min(pw, width)
    start_right = max(left, width - right)
    borders = left + width - start_right
    column = np.empty(borders, dtype=np.uint64)
    source = np.zeros(borders, dtype=np.uint64)
    count = np.zeros(borders, dtype=np.int64)
    for k in range(borders):
        j = k if k < left else start_right + (k - left)
        column[k] = j
        for t in range(kw):
            q = j - pw + t * dw
            if 0 <= q < width:
                if count[k] == 0:
                    source[k] = q
                count[k] += 1
    return column, source, count


@jit
def _pool_same_width(x, y, kh, kw, dh, dw, ph, pw, is_max, per_row, per_column):
    """Stride 1 with an output as wide as the input: the rows buffer and the output then share one
    pitch, so the passes run over whole planes, not rows (short rows vectorize poorly). The rows
    pass folds the output rows whose window lies in the input in one run per tap, the others row
    by row; the columns pass lets border columns read into the neighbouring rows, then recomputes
    them from their own row."""
    identity = -np.inf if is_max else 0.0
    planes, height, width = x.shape
    out_h = y.shape[1]
    xf = x.reshape(planes, height * width)
    yf = y.reshape(planes, out_h * width)
    total = np.uint64(out_h * width)
    rows = np.empty(out_h * width, dtype=x.dtype)
    first_row, row_count = _row_taps(out_h, kh, 1, dh, ph, height)
    inner_lo, inner_hi = out_h, out_h  # the output rows whose whole window lies in the input
    for i in range(out_h):
        if row_count[i] == kh:
            inner_lo = min(inner_lo, i)
            inner_hi = i + 1
    border_column, border_source, border_count = _border_columns(width, kw, dw, pw)
    # Columns pass: output m reads rows[m - pw + t * dw]; outputs [lo, hi) stay inside the buffer.
    lo = np.uint64(pw)
    hi = total - np.uint64(max(0, (kw - 1) * dw - pw))
    run_columns = hi - lo if hi > lo else np.uint64(0)
    uwidth = np.uint64(width)
    divisor = np.empty(0 if is_max else out_h * width, dtype=x.dtype)
    if not is_max:
        for i in range(out_h):
            for j in range(width):
                divisor[i * width + j] = per_row[i] * per_column[j]
    for p in range(planes):
        # Kernel rows, in tap order.
        if inner_hi > inner_lo:
            run = np.uint64((inner_hi - inner_lo) * width)
            dst = np.uint64(inner_lo * width)
            src = np.uint64(first_row[inner_lo] * width)
            step = np.uint64(dh * width)
            if kh == 1:
                for m in range(run):
                    rows[dst + m] = xf[p, src + m]
            else:
                for m in range(run):
                    rows[dst + m] = _fold(xf[p, src + m], xf[p, src + step + m], is_max)
                for t in range(2, kh):
                    tap = src + np.uint64(t) * step
                    for m in range(run):
                        rows[dst + m] = _fold(rows[dst + m], xf[p, tap + m], is_max)
        for i in range(out_h):
            if inner_lo <= i < inner_hi:
                continue
            at = np.uint64(i * width)
            count = row_count[i]
            r = first_row[i]
            for j in range(uwidth):
                rows[at + j] = identity if count == 0 else x[p, r, j]
            for _ in range(1, count):
                r += dh
                for j in range(uwidth):
                    rows[at + j] = _fold(rows[at + j], x[p, r, j], is_max)
        # Kernel columns, in tap order.
        if kw == 1:
            for m in range(run_columns):
                yf[p, lo + m] = rows[m]
        else:
            tap = np.uint64(dw)
            for m in range(run_columns):
                yf[p, lo + m] = _fold(rows[m], rows[tap + m], is_max)
            for t in range(2, kw):
                tap = np.uint64(t * dw)
                for m in range(run_columns):
                    yf[p, lo + m] = _fold(yf[p, lo + m], rows[tap + m], is_max)
        for k in range(border_column.shape[0]):
            j, q, count = border_column[k], border_source[k], border_count[k]
            for i in range(out_h):
                y[p, i, j] = identity if count == 0 else rows[i * uwidth + q]
            for _ in range(1, count):
                q += np.uint64(dw)
                for i in range(out_h):
                    y[p, i, j] = _fold(y[p, i, j], rows[i * uwidth + q], is_max)
        if not is_max:
            for m in range(total):
                yf[p, m] /= divisor[m]


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
def _tap_counts(outs, k, s, d, lo, hi, dtype):
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
    per_row = _tap_counts(y.shape[1], kh, sh, dh, lo_h, hi_h, y.dtype)
    per_column = _tap_counts(y.shape[2], kw, sw, dw, lo_w, hi_w, y.dtype)
    covers = dh == dw == 1 and kh - 1 - ph >= x.shape[1] - 1 and kw - 1 - pw >= x.shape[2] - 1
    whole_planes = y.shape[1] == y.shape[2] == 1 and covers and x.shape[1] * x.shape[2] <= PLANE_SUM_LIMIT
    if whole_planes and not is_max:
        # One window over each whole plane (as closing a CNN): a plane mean.
        planes = x.shape[0]
        plane_means(x.reshape(planes, -1), y.reshape(planes), per_row[0] * per_column[0])
    elif sh == sw == 1 and y.shape[2] == x.shape[2]:
        _pool_same_width(x, y, kh, kw, dh, dw, ph, pw, is_max, per_row, per_column)
    else:
        _pool(x, y, kh, kw, sh, sw, dh, dw, ph, pw, is_max, per_row, per_column)
