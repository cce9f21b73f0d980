"""The im2col copy of a 2-D convolution: the column matrix written straight from the unpadded input.

numpy builds it from a strided window view of a padded copy of the input: one pass to pad, then a
copy whose innermost run is one output row, strided by the convolution's stride, with a fixed cost
per run. Here each column-matrix row (channel, kernel row, kernel column) is filled for a block of
output rows with zeros where the tap falls in the padding, in one pass and without the padded copy.
"""

from __future__ import annotations

import numpy as np

from . import jit


@jit
def _valid_columns(ow_count, stride, offset, width):
    """The output columns [first, end) whose tap at input column ``q * stride + offset`` is inside."""
    first = 0
    while first < ow_count and first * stride + offset < 0:
        first += 1
    end = ow_count
    while end > first and (end - 1) * stride + offset >= width:
        end -= 1
    return first, end


@jit
def fill_columns(x, cols, kh, kw, sh, sw, dh, dw, top, left, row_start, row_count, ow_count):
    """cols[(c*kh + i)*kw + j, r*OW + q] = x[c, (row_start + r)*sh - top + i*dh, q*sw - left + j*dw],
    zero outside the input, for output rows row_start .. row_start + row_count of ``x`` (C, H, W)."""
    channels, height, width = x.shape
    source = x.reshape(-1)
    target = cols.reshape(-1)
    row_size = cols.shape[1]
    for c in range(channels):
        for i in range(kh):
            for j in range(kw):
                offset = j * dw - left
                first, end = _valid_columns(ow_count, sw, offset, width)
                for r in range(row_count):
                    h = (row_start + r) * sh - top + i * dh
                    # Unsigned flat indices: numba checks signed ones for wraparound, which keeps
                    # these loops from vectorizing.
                    out = np.uint64(((c * kh + i) * kw + j) * row_size + r * ow_count)
                    if h < 0 or h >= height:
                        for q in range(ow_count):
                            target[out + np.uint64(q)] = 0
                        continue
                    line = np.uint64((c * height + h) * width + first * sw + offset)
                    for q in range(first):
                        target[out + np.uint64(q)] = 0
                    if sw == 1:  # a contiguous run
                        for q in range(end - first):
                            target[out + np.uint64(first + q)] = source[line + np.uint64(q)]
                    else:
                        for q in range(end - first):
                            target[out + np.uint64(first + q)] = source[line + np.uint64(q * sw)]
                    for q in range(end, ow_count):
                        target[out + np.uint64(q)] = 0


@jit
def fill_patches(x, cols, kh, kw):
    """cols[(c*kh + i)*kw + j, r*OW + q] = x[c, r*kh + i, q*kw + j] for a window that tiles ``x`` (C, H, W)
    (kernel = stride, no padding or dilation; OW = W // kw), for the output rows cols' width holds: a plain
    copy, without fill_columns' edge searches and twelve arguments (a patch merge's few pixels cost less than
    those). Rows of ``cols`` past C*kh*kw are left as they are."""
    channels, height, width = x.shape
    ow = width // kw
    pixels = cols.shape[1]
    source = x.reshape(-1)
    target = cols.reshape(-1)
    for c in range(channels):
        for r in range(pixels // ow):
            for i in range(kh):
                # Unsigned flat indices, as in fill_columns, so the copies vectorize.
                line = np.uint64((c * height + r * kh + i) * width)
                for j in range(kw):
                    out = np.uint64(((c * kh + i) * kw + j) * pixels + r * ow)
                    for q in range(ow):
                        target[out + np.uint64(q)] = source[line + np.uint64(q * kw + j)]


@jit
def fill_tight_columns(x, cols, kh, kw, dh, dw, top, left, row_start, row_count):
    """fill_columns for a stride-1 window whose output is as wide as ``x`` (C, H, W): column row
    (c, i, j) of an output-row block is then one contiguous run of x's channel shifted by the tap,
    zero where it leaves the image above or below, with the wrapped-around edge columns zeroed after.
    Writes the first ``row_count * W`` columns of each row of ``cols``."""
    channels, height, width = x.shape
    size, run, row_size = height * width, row_count * width, cols.shape[1]
    source = x.reshape(-1)
    target = cols.reshape(-1)
    for c in range(channels):
        for i in range(kh):
            for j in range(kw):
                # Unsigned flat indices, as in fill_columns, so the copies vectorize.
                out = np.uint64(((c * kh + i) * kw + j) * row_size)
                shift = (row_start + i * dh - top) * width + j * dw - left
                first = min(run, max(0, -shift))
                end = max(first, min(run, size - shift))
                line = np.uint64(c * size + shift + first)
                for p in range(first):
                    target[out + np.uint64(p)] = 0
                for p in range(end - first):
                    target[out + np.uint64(first + p)] = source[line + np.uint64(p)]
                for p in range(end, run):
                    target[out + np.uint64(p)] = 0
                # Output columns whose tap falls left or right of the image read the neighbouring line.
                low = min(width, max(0, left - j * dw))
                high = max(low, min(width, width + left - j * dw))
                if low > 0 or high < width:
                    for r in range(row_count):
                        row = out + np.uint64(r * width)
                        for q in range(low):
                            target[row + np.uint64(q)] = 0
                        for q in range(high, width):
                            target[row + np.uint64(q)] = 0
