"""com.microsoft RotaryEmbedding in one compiled pass: per token its position's cos/sin row, each head's rotary
pairs rotated (interleaved (2i, 2i + 1) or halves (i, i + half)) and the features past the rotary dim copied.
Through numpy the rotation is a fancy index per table, two broadcast products per half and a copy of the input,
each a pass over memory for a decode step's few rows."""

from __future__ import annotations

from . import jit


@jit
def rotary_embedding_(x, positions, start, cos, sin, interleaved, out):
    """out[b, s, n] = x[b, s, n] rotated by position p = positions[b or 0, s] (or start + s where ``positions``
    has no rows): real = first * cos[p] - second * sin[p], imag = first * sin[p] + second * cos[p], features
    from 2 * half on copied. x and out are (B, S, N, D) views of any layout. Returns -1, or the flat (b, s)
    index of the first position outside the cos/sin tables (nothing promised of ``out`` then)."""
    batch, steps, heads, size = x.shape
    half, rows = cos.shape[1], cos.shape[0]
    given, per_batch = positions.shape[0] > 0, positions.shape[0] > 1
    for b in range(batch):
        for s in range(steps):
            p = positions[b if per_batch else 0, s] if given else start + s
            if p < 0 or p >= rows:
                return b * steps + s
            c, si = cos[p], sin[p]
            for n in range(heads):
                _rotate_head(x[b, s, n], c, si, half, interleaved, out[b, s, n])
    return -1


@jit
def _rotate_head(xi, c, si, half, interleaved, o):
    """One head's rotation (rotary_embedding_'s formula) and the pass-through of its remaining features."""
    if interleaved:
        for i in range(half):
            first, second = xi[2 * i], xi[2 * i + 1]
            o[2 * i] = first * c[i] - second * si[i]
            o[2 * i + 1] = first * si[i] + second * c[i]
    else:
        for i in range(half):
            first, second = xi[i], xi[i + half]
            o[i] = first * c[i] - second * si[i]
            o[i + half] = first * si[i] + second * c[i]
    for i in range(2 * half, xi.shape[0]):
        o[i] = xi[i]
