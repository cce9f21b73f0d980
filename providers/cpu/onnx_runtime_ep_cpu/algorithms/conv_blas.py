"""Convolution through numpy's BLAS: im2col (its column matrix written a block of output rows at a time,
by compiled/im2col.py for float32/float64), im2col over contiguous runs of the unpadded rows when a
stride-1 output is as wide as its input, 1x1 kernels on the pixels themselves, one product per kernel
tap accumulated in BLAS (see blas.py), and Winograd F(2x2, 3x3). Each takes a FusedConv's epilogue
(``finish``) per block of output where it can.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from ..blas import gemm_accumulate
from ..compiled import reference_run
from ..compiled import takes as takes_compiled
from ..tuning import KNOBS
from .window import Geometry, strided_view


def grouped_weights(w: np.ndarray, b, group: int, dtype) -> np.ndarray:
    """(G, Mg, Cg*K) weights; with a bias, one more column holding it (it multiplies a row of ones)."""
    m = w.shape[0]
    flat = w.astype(dtype, copy=False).reshape(group, m // group, -1)
    if b is None:
        return flat
    return np.concatenate([flat, b.astype(dtype, copy=False).reshape(group, m // group, 1)], axis=2)


def conv_im2col(x, weights, geo: Geometry, group: int, with_bias: bool, finish=None) -> np.ndarray:
    """General convolution: (G, Mg, Cg*K [+1]) weights times the im2col matrix of ``x``.

    The column matrix is written one block of output rows at a time, each block feeding one batched
    matmul that writes straight into its rows of the result: for 2-D float32/float64 windows by a
    compiled loop straight from the input (compiled/im2col.py), otherwise copied out of a strided
    window view of the padded input. With a bias, the matrix gets a row of ones so the matmul adds it.
    A FusedConv's ``finish`` (an _Epilogue) runs on each block of output rows right after its matmul.
    """
    n, c = x.shape[:2]
    cg, mg, depth = c // group, weights.shape[1], weights.shape[2]
    # A segment's reference run serves the compiled loop by its numpy equivalent, one image and block at a
    # time (a tap's copy each); the window view copies every image's taps of a block at once.
    if len(geo.kernel) == 2 and takes_compiled(x) and not reference_run.active():
        fill = _compiled_im2col(x.reshape(n, group, cg, *x.shape[2:]), geo)
    else:
        windows = geo.windows(geo.pad(x, 0).reshape(n, group, cg, *geo.padded_shape(x.shape)[2:]))

        def fill(taps, block, count):
            taps = taps[..., : count * math.prod(geo.out[1:])]
            np.copyto(taps.reshape(n, group, cg, *geo.kernel, count, *geo.out[1:], copy=False), windows[block])
    y = np.empty((n, group, mg, *geo.out), dtype=x.dtype)
    rest = math.prod(geo.out[1:])
    rows = max(1, min(geo.out[0], KNOBS.im2col_block_bytes // max(1, x.itemsize * n * group * depth * rest)))
    buffer = np.empty((n, group, depth, rows * rest), dtype=x.dtype)
    if with_bias:
        buffer[:, :, -1] = 1
    spatial = (slice(None),) * (len(geo.out) - 1)
    for start in range(0, geo.out[0], rows):
        block = (Ellipsis, slice(start, start + rows), *spatial)
        count = min(rows, geo.out[0] - start)
        cols = buffer[..., : count * rest]
        fill(buffer[:, :, : depth - 1] if with_bias else buffer, block, count)  # whole rows: contiguous
        np.matmul(weights, cols, out=y[block].reshape(n, group, mg, count * rest, copy=False))
        if finish is not None:
            finish.rows(y.reshape(n, group * mg, geo.out[0] * rest), start * rest, (start + count) * rest)
    return y


def _compiled_im2col(xg: np.ndarray, geo: Geometry):
    """``fill(taps, block, count)`` writing the column rows of output rows ``block`` of (N, G, Cg, H, W)
    ``xg`` into the first count*OW columns of ``taps`` (N, G, Cg*K, rows*OW) with the compiled loop."""
    from ..compiled.im2col import fill_columns

    xg = np.ascontiguousarray(xg)
    (kh, kw), (sh, sw), (dh, dw), (top, left), ow = geo.kernel, geo.strides, geo.dilations, geo.begin, geo.out[1]

    def fill(taps, block, count):
        start = block[-2].start
        for image in range(xg.shape[0]):
            for g in range(xg.shape[1]):
                fill_columns(xg[image, g], taps[image, g], kh, kw, sh, sw, dh, dw, top, left, start, count, ow)

    return fill


def tight_fits(geo: Geometry) -> bool:
    """Whether a stride-1 2-D window's output is exactly as wide as its input (e.g. 'same' pads):
    its taps are then contiguous runs of _tight_rows computed straight into the output."""
    return rows_fit(geo) and geo.out[1] == geo.in_shape[1]


def conv_tight_rows(x, weights, geo: Geometry, with_bias: bool, finish=None) -> np.ndarray:
    """Stride-1 2-D convolution (one group) whose output is as wide as its input: im2col where each
    (channel, tap) row of a block of output rows is one contiguous run of the flattened image,
    shifted by the tap, instead of one short copy per output row; the matmul writes y directly.

    float32/float64 fill the column matrix straight from x with a compiled loop; other dtypes copy
    it from the staged rows of _tight_rows and zero the wrapped columns (see tap_source). A FusedConv's
    ``finish`` (an _Epilogue) runs on each block of output rows while the matmul's result is in cache."""
    n, c = x.shape[:2]
    m, depth = weights.shape[1], weights.shape[2]
    oh, width = geo.out
    taps = c * math.prod(geo.kernel)
    rows = max(1, min(oh, KNOBS.im2col_block_bytes // max(1, x.itemsize * depth * width)))
    buffer = np.empty((depth, rows * width), dtype=x.dtype)
    if with_bias:
        buffer[-1] = 1
    fill = tight_fill(x, geo, buffer[:taps])
    y = np.empty((n, m, oh, width), dtype=x.dtype)
    for image in range(n):
        for start in range(0, oh, rows):
            count = min(rows, oh - start)
            fill(image, start, count)
            out = y[image, :, start:start + count].reshape(m, -1, copy=False)
            np.matmul(weights[0], buffer[:, : count * width], out=out)
            if finish is not None:
                finish.rows(y.reshape(n, m, oh * width), start * width, (start + count) * width, image)
    return y


def tight_fill(x, geo: Geometry, taps: np.ndarray):
    """``fill(image, start, count)``: the column rows of output rows start .. start + count of one
    image into the first count * W columns of ``taps`` (C*K, rows * W), for conv_tight_rows. In a segment's
    reference run the staged rows serve (one copy a block), not the compiled fill's numpy equivalent (one a tap)."""
    if takes_compiled(x) and not reference_run.active():
        from ..compiled.im2col import fill_tight_columns

        xc = np.ascontiguousarray(x)
        (kh, kw), (dh, dw), (top, left) = geo.kernel, geo.dilations, geo.begin

        def fill(image, start, count):
            fill_tight_columns(xc[image], taps, kh, kw, dh, dw, top, left, start, count)

        return fill
    source, (_, width), wrapped = tap_source(x, geo)

    def fill(image, start, count):
        tap_cols = taps[:, : count * width].reshape(x.shape[1], *geo.kernel, count, width, copy=False)
        np.copyto(tap_cols, source[image, :, :, :, start:start + count])
        for j, first, end in wrapped:
            tap_cols[:, :, j, :, first:end] = 0

    return fill


def conv_pointwise(x, weights, group: int, with_bias: bool) -> np.ndarray:
    """1x1 convolution without pads or strides: the input pixels are already the column matrix.
    A bias rides on a row of ones when that copy of the input is cheaper than a pass over the output."""
    n, c = x.shape[:2]
    cg, mg = c // group, weights.shape[1]
    cols = x.reshape(n, group, cg, math.prod(x.shape[2:]))
    y = np.empty((n, group, mg, cols.shape[-1]), dtype=x.dtype)
    if not with_bias:
        np.matmul(weights, cols, out=y)
    elif mg > cg:
        ones = np.empty((n, group, cg + 1, cols.shape[-1]), dtype=x.dtype)
        ones[:, :, :cg] = cols
        ones[:, :, cg] = 1
        np.matmul(weights, ones, out=y)
    else:
        np.matmul(weights[:, :, :cg], cols, out=y)
        y += weights[:, :, cg:]
    return y


def tap_weights(w: np.ndarray, dtype) -> np.ndarray:
    """(KH*KW, M, C) weights: one (M, C) matrix per kernel tap."""
    m, c = w.shape[:2]
    return np.ascontiguousarray(w.astype(dtype, copy=False).reshape(m, c, -1).transpose(2, 0, 1))


def _padded_width(geo: Geometry) -> int:
    return geo.in_shape[1] + geo.begin[1] + geo.reach[1]


def _padded_rows(x: np.ndarray, geo: Geometry) -> np.ndarray:
    """The padded 2-D image of each channel flattened to one row, (N, C, Hp*Wp + tail).

    A kernel tap of a stride-1 window is then an offset into the row, and a run of ``OH * Wp``
    elements from it covers whole padded rows; outputs past the true width are dropped at the end,
    and the zero tail holds what the last row's dropped outputs read.
    """
    n, c = x.shape[:2]
    hp, wp = geo.in_shape[0] + geo.begin[0] + geo.reach[0], _padded_width(geo)
    tail = (geo.kernel[1] - 1) * geo.dilations[1]
    flat = np.empty((n, c, hp * wp + tail), dtype=x.dtype)
    flat[:, :, hp * wp:] = 0
    geo.pad(x, 0, out=flat[:, :, : hp * wp].reshape(n, c, hp, wp, copy=False))
    return flat


def _tap_offsets(geo: Geometry) -> list[int]:
    """Where each kernel tap of a stride-1 2-D window starts in a padded row from _padded_rows."""
    wp = _padded_width(geo)
    (kh, kw), (dh, dw) = geo.kernel, geo.dilations
    return [i * dh * wp + j * dw for i in range(kh) for j in range(kw)]


def crop_rows(rows: np.ndarray, geo: Geometry, out: np.ndarray, b=None) -> None:
    """Write (..., OH * Wp) padded-row results into ``out`` (..., OH, OW), adding a bias if given."""
    oh, ow = geo.out
    valid = rows.reshape(*rows.shape[:-1], oh, -1)[..., :ow]
    if b is None:
        np.copyto(out, valid)
    else:
        np.add(valid, b.astype(out.dtype, copy=False).reshape(-1, 1, 1), out=out)


def conv_by_taps(x, taps, b, geo: Geometry, finish=None) -> np.ndarray:
    """Stride-1 2-D convolution as one matmul per kernel tap over shifted runs of the padded rows,
    with no column matrix: BLAS accumulates each tap's product into the output rows (see blas.py).
    A FusedConv's ``finish`` (an _Epilogue, in place of ``b``) crops and finishes them in one pass."""
    n, m = x.shape[0], taps.shape[1]
    flat = _padded_rows(x, geo)
    length = geo.out[0] * _padded_width(geo)
    y = np.empty((n, m, *geo.out), dtype=x.dtype)
    total = np.empty((m, length), dtype=x.dtype)
    product = np.empty_like(total)
    for image in range(n):
        for t, offset in enumerate(_tap_offsets(geo)):
            source = flat[image, :, offset:offset + length]
            if t == 0:
                np.matmul(taps[0], source, out=total)
            else:
                gemm_accumulate(taps[t], source, total, scratch=product)
        if finish is None:
            crop_rows(total, geo, y[image], b)
        else:
            finish.crop(total, y.reshape(n, m, math.prod(geo.out)), geo.out[1], image)
    return y


def _tight_rows(x: np.ndarray, geo: Geometry) -> np.ndarray:
    """Each channel's image as one row of input-wide lines with zero lines above and below, (N, C, size).

    For a stride-1 2-D window whose output is at most as wide as the input, tap (i, j) of output
    line r, column q reads the run at offset ``i*dh*W + j*dw`` plus ``r*W + q``: copying x in is one
    contiguous run per channel. A read left or right of the image wraps into the neighbouring
    line instead of a pad; the column matrix zeroes those reads (see _wrapped_columns).
    """
    n, c = x.shape[:2]
    h, w = geo.in_shape
    (kh, kw), (dh, dw) = geo.kernel, geo.dilations
    size = (kh - 1) * dh * w + (kw - 1) * dw + geo.out[0] * w
    first = geo.begin[1] + geo.begin[0] * w  # where input pixel (0, 0) lands
    flat = np.empty((n, c, size), dtype=x.dtype)
    flat[:, :, :first] = 0
    flat[:, :, first:first + h * w] = x.reshape(n, c, h * w)
    flat[:, :, first + h * w:] = 0
    return flat


def _wrapped_columns(geo: Geometry) -> list[tuple[int, int, int]]:
    """(kernel column j, first, end): the output columns whose tap in kernel column j falls left
    or right of the image in the layout of _tight_rows."""
    w, ow, bw, dw = geo.in_shape[1], geo.out[1], geo.begin[1], geo.dilations[1]
    spans = []
    for j in range(geo.kernel[1]):
        left, right = min(ow, bw - j * dw), max(0, w + bw - j * dw)
        spans += [(j, 0, left)] if left > 0 else []
        spans += [(j, right, ow)] if right < ow else []
    return spans


def tap_source(x: np.ndarray, geo: Geometry):
    """The taps of every output as a read-only (N, C, *kernel, *run) view, the run's shape, and the
    (kernel column, first, end) columns to zero after copying it.

    Stride-1 2-D windows no wider than the input read runs of _tight_rows (no crop when the output
    is as wide as the input); other stride-1 2-D windows read the fully padded rows of
    _padded_rows (cropped at the end); any other window reads the strided window view.
    """
    if rows_fit(geo) and geo.out[1] <= geo.in_shape[1]:
        flat, width, wrapped = _tight_rows(x, geo), geo.in_shape[1], _wrapped_columns(geo)
    elif rows_fit(geo):
        flat, width, wrapped = _padded_rows(x, geo), _padded_width(geo), []
    else:
        return geo.windows(geo.pad(x, 0)), geo.out, []
    (dh, dw), item, run = geo.dilations, flat.itemsize, (geo.out[0], width)
    view = strided_view(flat, (*flat.shape[:2], *geo.kernel, *run),
                 flat.strides[:2] + (dh * width * item, dw * item, width * item, item))
    return view, run, wrapped


# Winograd F(2x2, 3x3) (Lavin & Gray, 2015): a 2x2 output tile is A^T [(G g G^T) * (B^T d B)] A for
# its 4x4 input tile d, 16 multiplies per input channel instead of 36. Kronecker products apply each
# two-sided transform to a whole stack of tiles as one matmul.
_WINOGRAD_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
# G (x) G, (16, 9): G g G^T of a 3x3 kernel g as one product with its 9 taps (one BLAS call for all channel
# pairs, where an einsum over both factors loops in C per element: a large net's first run paid it).
_WINOGRAD_GG = (_WINOGRAD_G[:, None, :, None] * _WINOGRAD_G[None, :, None, :]).reshape(16, 9)


@functools.cache
def _winograd_tile_transforms() -> tuple[np.ndarray, np.ndarray]:
    """(B^T d B, A^T m A) of every tile at once: (16, 16) and (4, 16). Made at the first Winograd convolution,
    not at import: numpy-served first runs never take Winograd, and np.kron's first call in a process costs
    more than the rest of this module's import."""
    b4 = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=np.float64)
    a2 = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=np.float64)
    transforms = np.kron(b4, b4), np.kron(a2, a2)
    for shared in transforms:
        shared.flags.writeable = False  # (one pair for every call)
    return transforms


def winograd_weights(w: np.ndarray, dtype) -> np.ndarray:
    """(16, M, C): the transformed 3x3 kernel G g G^T of each (output, input) channel pair."""
    m, c = w.shape[:2]
    u = _WINOGRAD_GG @ w.reshape(m * c, 9).T.astype(np.float64)
    return np.ascontiguousarray(u.reshape(16, m, c), dtype=dtype)


def conv_winograd(x, u, b, geo: Geometry) -> np.ndarray:
    """Stride-1 3x3 convolution by Winograd F(2x2, 3x3): one strided copy gathers the overlapping
    4x4 input tiles; the input transform, the 16 channel-mixing products and the output transform
    are matmuls; the 2x2 output tiles are scattered into place with the bias added."""
    n, c = x.shape[:2]
    m = u.shape[1]
    oh, ow = geo.out
    th, tw = -(-oh // 2), -(-ow // 2)
    # Padded to whole tiles: past the declared pads the extra rows/columns are zeros.
    xp = geo.pad(x, 0, out=np.empty((n, c, 2 * th + 2, 2 * tw + 2), dtype=x.dtype))
    sn, sc, sh, sw = xp.strides
    tiles = strided_view(xp, (4, 4, c, n, th, tw), (sh, sw, sc, sn, 2 * sh, 2 * sw))
    d = np.empty((16, c * n * th * tw), dtype=x.dtype)
    np.copyto(d.reshape(4, 4, c, n, th, tw), tiles)
    bt, at = _winograd_tile_transforms()
    v = np.matmul(bt.astype(x.dtype), d).reshape(16, c, n * th * tw)
    products = np.matmul(u, v).reshape(16, m * n * th * tw)
    out_tiles = np.matmul(at.astype(x.dtype), products).reshape(2, 2, m, n, th, tw)
    y = np.empty((n, m, 2 * th, 2 * tw), dtype=x.dtype)
    placed = y.reshape(n, m, th, 2, tw, 2).transpose(3, 5, 1, 0, 2, 4)  # (2, 2, M, N, TH, TW)
    if b is None:
        np.copyto(placed, out_tiles)
    else:
        np.add(out_tiles, b.astype(x.dtype, copy=False).reshape(m, 1, 1, 1), out=placed)
    if (2 * th, 2 * tw) != (oh, ow):
        y = np.ascontiguousarray(y[:, :, :oh, :ow])
    return y


def rows_fit(geo: Geometry) -> bool:
    """Whether the padded-row layout of _padded_rows applies: a stride-1 2-D window."""
    return len(geo.kernel) == 2 and geo.strides == (1, 1) and math.prod(geo.kernel) > 1
