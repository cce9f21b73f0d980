"""A direct convolution for windows with few output positions (a streaming model's 1-D convolutions over a
handful of frames): each output position's taps are gathered once through a table of input offsets, then
every output channel is one dot product over them. At these sizes a BLAS call costs more in setup than
the arithmetic, and the im2col buffers cost more to lay out than to fill.
"""

from __future__ import annotations

import numpy as np

from . import compiler

_fast = compiler(fastmath={"reassoc", "contract"})


def gather_table(in_shape, kernel, strides, dilations, begin, out, channels: int) -> np.ndarray:
    """(P, C*K) offsets into one image's flattened (C, *in_shape) channels, plus one trailing zero element
    (offset C*prod(in_shape)) that every tap in the padding reads; P = prod(out), columns in the
    weight's (channel, *kernel) order."""
    size = int(np.prod(in_shape))
    rank = len(in_shape)
    grids = np.meshgrid(*[np.arange(o) for o in out], *[np.arange(k) for k in kernel], indexing="ij")
    flat = np.zeros(grids[0].shape, dtype=np.int64)
    inside = np.ones(grids[0].shape, dtype=bool)
    for i in range(rank):
        pos = grids[i] * strides[i] + grids[rank + i] * dilations[i] - begin[i]
        inside &= (pos >= 0) & (pos < in_shape[i])
        flat = flat * in_shape[i] + pos
    positions, taps = int(np.prod(out)), int(np.prod(kernel))
    flat = np.where(inside, flat, -1).reshape(positions, 1, taps)
    channel = (np.arange(channels) * size).reshape(1, channels, 1)
    table = np.where(flat >= 0, flat + channel, channels * size)
    return np.ascontiguousarray(table.reshape(positions, channels * taps))


@_fast
def conv_gathered(x, w, b, table, y):
    """y (N, G, Mg, P) = w (G, Mg, D) times the gathered taps of x (N, G, S) (+ b (G, Mg), or an empty b).

    ``table`` (P, D) holds offsets into x's last axis, or S for a tap in the padding (read as zero)."""
    images, groups, size = x.shape
    outputs, depth = w.shape[1], w.shape[2]
    positions = table.shape[0]
    source = np.zeros(size + 1, dtype=x.dtype)
    cols = np.empty((positions, depth), dtype=x.dtype)
    biased = b.size > 0
    zero = source[size]  # a zero of x's dtype
    for n in range(images):
        for g in range(groups):
            source[:size] = x[n, g]
            for p in range(positions):
                for j in range(depth):
                    cols[p, j] = source[table[p, j]]
            for m in range(outputs):
                row = w[g, m]
                start = b[g, m] if biased else zero
                for p in range(positions):
                    column = cols[p]
                    total = zero
                    for j in range(depth):
                        total += row[j] * column[j]
                    y[n, g, m, p] = total + start
