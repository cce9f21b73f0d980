"""Neural-network kernels: convolution, pooling, normalization, softmax family, dropout, Gelu.

Sliding-window ops share :class:`_Window` (attribute parsing and validation) and :class:`_Geometry`
(pads and output size resolved for one input shape). Convolution picks a path once per input
signature: for 2-D float32 windows on AVX-512 hosts (depthwise ones aside) the packed convolution of
compiled/gemm.py (:class:`_PackedConv`, split across the helper threads, epilogue fused); otherwise
a plain matmul for 1x1 kernels, a compiled loop for depthwise kernels (compiled/depthwise.py;
per-channel matmuls over cache-sized blocks for other dtypes), one matmul per kernel tap when there are
few output channels or the column matrix would be large (BLAS accumulating the taps, see blas.py),
Winograd F(2x2, 3x3) for wide 3x3 layers on small images, im2col over the unpadded image rows when a
stride-1 output is as wide as its input, and otherwise im2col (the column rows of a block of output
rows written by compiled/im2col.py, then a batched matmul); weights rearranged for a path are kept
while the same constant arrays come in. FusedConv and FusedBatchNormalization (see conv_fusions.py)
apply bias, residual and activation in one compiled pass (compiled/epilogue.py), or numpy passes in
place for other dtypes.
MaxPool/AveragePool over 1-D and 2-D windows, GlobalAveragePool and LRN run compiled loops
(compiled/pooling.py, compiled/lrn.py) for float32/float64; otherwise pooling folds the unpadded
input one spatial dim at a time, so Python only loops over the (few) kernel taps. float32 pooling,
batch normalization and depthwise convolution of one image split their planes/channels across the
helper threads (:func:`_thread_spans`).
"""

from __future__ import annotations

import math
import threading
from functools import reduce

import numpy as np
from numpy.lib.stride_tricks import as_strided
from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError
from onnx_runtime.windows import WindowAttributes

from ..blas import available as blas_accumulates
from ..blas import gemm_accumulate
from ..compiled import takes as takes_compiled
from ..fusions import FUSED_DOMAIN
from ..registry import register
from ..threads import helper_count, kernel_threads
from .special import _scaled_coefficients, erf_float32, erf_float64

# -- shared helpers ------------------------------------------------------------------------------


def _graph_error(node, attr: str, message: str) -> InvalidGraphError:
    return InvalidGraphError(f"node {node.name!r} ({node.op_type}): attribute {attr!r} {message}")


def _compute_dtype(dtype: np.dtype) -> np.dtype:
    """Half-precision floats (float16, bfloat16) compute in float32: numpy has no fast float16
    BLAS, and float32 accumulation is more accurate; other types compute as they are."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 and dtype.kind not in "biu" else dtype


def _upcast(x: np.ndarray) -> np.ndarray:
    return x.astype(_compute_dtype(x.dtype), copy=False)


def _wants(node, index: int) -> bool:
    """Whether the node lists an optional output at ``index``."""
    return len(node.outputs) > index


def _normalize_axis(node, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): axis {axis} is out of range for a rank-{rank} input; "
            f"expected a value in [{-rank}, {rank - 1}]"
        )
    return axis % rank


def _channel_param(p: np.ndarray, ndim: int, dtype) -> np.ndarray:
    """A per-channel (C,) or per-activation (C, D1, ...) parameter shaped to broadcast over (N, C, ...)."""
    return p.astype(dtype, copy=False).reshape(p.shape + (1,) * (ndim - 1 - p.ndim))


def _stash_dtype(node) -> np.dtype:
    stash_type = int(node.attr("stash_type", 1))
    try:
        dtype = DataType(stash_type)
    except ValueError:
        dtype = None
    if dtype not in (DataType.FLOAT, DataType.DOUBLE, DataType.FLOAT16, DataType.BFLOAT16):
        raise _graph_error(node, "stash_type", f"is {stash_type}; expected a float type (1, 10, 11 or 16)")
    return dtype.numpy


def _view(array: np.ndarray, shape, strides) -> np.ndarray:
    """A read-only view of ``array``'s memory with the given shape and strides: ``as_strided``,
    without its few microseconds of overhead when ``array`` can export its buffer directly."""
    if not array.flags.c_contiguous:
        return as_strided(array, shape, strides, writeable=False)
    view = np.ndarray(shape, array.dtype, array, 0, strides)
    view.flags.writeable = False
    return view


# -- sliding-window geometry ---------------------------------------------------------------------


class _Geometry:
    """Pads and output size of a sliding window over one concrete spatial input shape."""

    def __init__(self, in_shape, kernel, strides, dilations, begin, end, out):
        self.in_shape = in_shape
        self.kernel = kernel
        self.strides = strides
        self.dilations = dilations
        self.begin = begin  # pads before each spatial dim
        self.end = end  # declared (or auto) pads after each spatial dim
        self.out = out
        # The padded array must hold the last window; with ceil_mode it may overhang the declared pads.
        self.reach = tuple(
            max(0, (o - 1) * s + (k - 1) * d + 1 - n - b)
            for o, s, k, d, n, b in zip(out, strides, kernel, dilations, in_shape, begin)
        )
        self._divisors: dict = {}
        self.unpadded = not any(begin) and not any(self.reach)
        # Index tuples of the padded array, over any leading dims: the input's place and the border
        # slabs (filled after the input, corners included), those of the exact padded shape and
        # those of a larger buffer, whose end slabs reach past the declared pads.
        rank = len(in_shape)
        self._inner = (Ellipsis, *(slice(b, b + n) for b, n in zip(begin, in_shape)))
        slabs = []  # (index, whether the exact padded shape has it)
        for i, (b, n, r) in enumerate(zip(begin, in_shape, self.reach)):
            rest = (slice(None),) * (rank - 1 - i)
            if b:
                slabs.append(((Ellipsis, slice(0, b), *rest), True))
            slabs.append(((Ellipsis, slice(b + n, None), *rest), r > 0))
        self._borders = [index for index, exact in slabs if exact]
        self._borders_to_end = [index for index, _ in slabs]

    def pad(self, x: np.ndarray, value, out: np.ndarray | None = None) -> np.ndarray:
        """``x`` with its trailing spatial dims padded by ``value`` (only the borders are filled),
        written into ``out`` when given (which may be larger than the padded shape)."""
        if self.unpadded and out is None:
            return x
        xp = np.empty(self.padded_shape(x.shape), dtype=x.dtype) if out is None else out
        xp[self._inner] = x
        for border in self._borders if out is None else self._borders_to_end:
            xp[border] = value
        return xp

    def padded_shape(self, shape) -> tuple[int, ...]:
        lead = len(shape) - len(self.in_shape)
        return tuple(shape[:lead]) + tuple(n + b + r for n, b, r in zip(self.in_shape, self.begin, self.reach))

    def reduce_windows(self, x: np.ndarray, combine, identity) -> np.ndarray:
        """Fold every window of unpadded ``x`` with ``combine`` (np.maximum or np.add) into a fresh
        (*lead, *out) array; window taps in the padding are skipped, as if it held ``identity``.

        Max and sum over a box are separable, so this folds one spatial dim at a time, each pass
        combining the k strided views of that dim's taps: k1 + k2 + ... whole-array operations
        instead of k1 * k2 * ..., and numpy runs every one of them. Nothing is padded: a tap that
        overhangs the input covers only the outputs whose window it lies inside.
        """
        y = x
        lead = x.ndim - len(self.kernel)
        for i, (k, s, d, o, b) in enumerate(zip(self.kernel, self.strides, self.dilations, self.out, self.begin)):
            axis = lead + i
            n = y.shape[axis]
            if k == 1 and b == 0 and (o - 1) * s < n:
                y = y[(slice(None),) * axis + (slice(0, (o - 1) * s + 1, s),)]
            elif k > 1 and y.flags.c_contiguous and (n == o * s if axis == y.ndim - 1 else s == 1 and n == o):
                y = _fold_flat(y, axis, k, s, d, o, b, combine, identity)
            else:
                y = _fold_axis(y, axis, k, s, d, o, b, combine, identity)
        return y.copy() if np.may_share_memory(y, x) else y

    def windows(self, xp: np.ndarray) -> np.ndarray:
        """Read-only view (*lead, *kernel, *out) of padded ``xp``; reshaping it is the im2col copy."""
        rank = len(self.kernel)
        lead = xp.ndim - rank
        spatial = xp.strides[lead:]
        strides = (
            xp.strides[:lead]
            + tuple(st * d for st, d in zip(spatial, self.dilations))
            + tuple(st * s for st, s in zip(spatial, self.strides))
        )
        return _view(xp, xp.shape[:lead] + self.kernel + self.out, strides)

    def tap_counts(self, include_pad: bool) -> np.ndarray | None:
        """How many taps of each output window land on counted positions, or None if all of them do.

        Counted positions are the input, plus the declared pads when ``include_pad``; a ceil_mode
        overhang never counts.
        """
        per_dim = []
        for o, k, s, d, n, b, e in zip(
            self.out, self.kernel, self.strides, self.dilations, self.in_shape, self.begin, self.end
        ):
            lo, hi = (0, b + n + e) if include_pad else (b, b + n)
            pos = np.arange(o)[:, None] * s + np.arange(k)[None, :] * d
            per_dim.append(((pos >= lo) & (pos < hi)).sum(axis=1))
        counts = reduce(np.multiply.outer, per_dim)
        return None if np.all(counts == math.prod(self.kernel)) else counts

    def divisor(self, include_pad: bool, dtype):
        """What each window sum is divided by for an average: the tap count, as a scalar when every
        window has the full kernel, else a (*out) array; computed once per geometry and dtype."""
        key = (include_pad, np.dtype(dtype))
        cached = self._divisors.get(key)
        if cached is None:
            counts = self.tap_counts(include_pad)
            size = math.prod(self.kernel)
            cached = self._divisors[key] = np.asarray(size if counts is None else counts, dtype=dtype)
        return cached


def _tap_spans(n: int, k: int, s: int, d: int, o: int, b: int) -> list[tuple[int, int, int]]:
    """For each window tap that reaches an input of size ``n``: (first output, end output, input
    position of the first output's tap); output j's tap t reads input j*s - b + t*d."""
    spans = []
    for t in range(k):
        first = max(0, -(-(b - t * d) // s))
        end = min(o, (n - 1 + b - t * d) // s + 1)
        if first < end:
            spans.append((first, end, first * s - b + t * d))
    return spans


def _fold_axis(y, axis, k, s, d, o, b, combine, identity) -> np.ndarray:
    """One separable pass over ``axis``: each tap combines its strided view into the outputs it covers."""
    before = (slice(None),) * axis

    def tap(span, first, end):
        """The view of tap ``span`` for outputs [first, end), which it must cover."""
        start = span[2] + (first - span[0]) * s
        return y[(*before, slice(start, start + (end - first - 1) * s + 1, s))]

    def outputs(first, end):
        return result[(*before, slice(first, end))]

    spans = _tap_spans(y.shape[axis], k, s, d, o, b)
    full = [span for span in spans if span[:2] == (0, o)]
    result = np.empty(y.shape[:axis] + (o,) + y.shape[axis + 1:], dtype=y.dtype)
    if len(full) >= 2:
        combine(tap(full[0], 0, o), tap(full[1], 0, o), out=result)
        spans = [span for span in spans if span not in full[:2]]
    elif full:
        # The full tap meets the first partial tap where that one reaches, and is copied elsewhere.
        spans.remove(full[0])
        first, end = spans[0][:2] if spans else (o, o)
        if spans:
            combine(tap(full[0], first, end), tap(spans[0], first, end), out=outputs(first, end))
        for lo, hi in ((0, first), (end, o)):
            if lo < hi:
                outputs(lo, hi)[...] = tap(full[0], lo, hi)
        spans = spans[1:]
    else:
        result.fill(identity)
    for span in spans:
        combine(outputs(*span[:2]), tap(span, *span[:2]), out=outputs(*span[:2]))
    return result


def _fold_flat(y, axis, k, s, d, o, b, combine, identity) -> np.ndarray:
    """One separable pass over ``axis`` of a C-contiguous ``y`` run on the flattened array, where
    every output is an evenly spaced input: the last axis with length ``o * s``, or any axis with
    stride 1 and ``o`` equal to its length. Each tap is then one long contiguous operation
    (numpy pays per row of a strided view), and the few border outputs, whose windows would wrap
    into the neighbouring rows, are recomputed from their own row."""
    n = y.shape[axis]
    inner = math.prod(y.shape[axis + 1:])
    step = s if inner == 1 else 1
    flat = y.reshape(-1)
    result = np.empty(y.shape[:axis] + (o,) + y.shape[axis + 1:], dtype=y.dtype)
    out = result.reshape(-1)
    offsets = [t * d - b for t in range(k)]
    # Flat outputs [lo, hi) have every tap inside the array (a border one may read the next row).
    lo = max(0, max(-(off * inner // step) for off in offsets))
    hi = min((flat.size - 1 - off * inner) // step + 1 for off in offsets)
    if hi <= lo:
        return _fold_axis(y, axis, k, s, d, o, b, combine, identity)
    taps = [flat[lo * step + off * inner: (hi - 1) * step + off * inner + 1: step] for off in offsets]
    combine(taps[0], taps[1], out=out[lo:hi])
    for tap in taps[2:]:
        combine(out[lo:hi], tap, out=out[lo:hi])
    before = (slice(None),) * axis
    first_inner = -(min(offsets) // s)  # the outputs from here to last_inner read only their own row
    last_inner = (n - 1 - max(offsets)) // s
    for j in [*range(min(first_inner, o)), *range(max(last_inner + 1, first_inner, 0), o)]:
        inside = [j * s + off for off in offsets if 0 <= j * s + off < n]
        border = result[(*before, j)]
        if len(inside) < 2:
            border[...] = y[(*before, inside[0])] if inside else identity
            continue
        combine(y[(*before, inside[0])], y[(*before, inside[1])], out=border)  # no separate copy pass
        for r in inside[2:]:
            combine(border, y[(*before, r)], out=border)
    return result

class _Window(WindowAttributes):
    """The window attributes of a Conv/ConvTranspose/pooling node, with geometries cached per shape."""

    def __init__(self, node, shapes, *, needs_kernel: bool):
        super().__init__(node, needs_kernel=needs_kernel)
        rank = self._known_rank(shapes)
        if rank is not None:
            self.check_rank(rank)
        self._cache: dict[tuple, _Geometry] = {}

    def _known_rank(self, shapes) -> int | None:
        if self.kernel is not None:
            return len(self.kernel)
        if shapes and shapes[0] is not None:
            return len(shapes[0]) - 2
        return None

    def resolve(self, in_shape: tuple[int, ...], kernel: tuple[int, ...] | None = None) -> _Geometry:
        """The geometry for spatial input shape ``in_shape`` (``kernel`` from the weight when given)."""
        key = (in_shape, kernel)
        geometry = self._cache.get(key)
        if geometry is None:
            geometry = self._cache[key] = _Geometry(tuple(in_shape), *self.geometry(in_shape, kernel))
        return geometry


# -- convolution ---------------------------------------------------------------------------------


def _group(node) -> int:
    group = int(node.attr("group", 1))
    if group < 1:
        raise _graph_error(node, "group", f"is {group}; expected a positive group count")
    return group


def _check_channels(node, x_channels: int, w_shape, group: int, transpose: bool) -> None:
    # Conv weights are (M, C/group, *k); ConvTranspose weights are (C, M/group, *k).
    w_in = w_shape[0] if transpose else w_shape[1] * group
    if x_channels != w_in or w_shape[0] % group:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): input has {x_channels} channels but the weight "
            f"{tuple(w_shape)} with group={group} expects {w_in}"
        )


class _Prepared:
    """A kernel's transform of constant inputs (rearranged weights, folded normalization
    parameters), kept while the same arrays come in.

    Initializers reach kernels as the same read-only array objects on every run, so identity marks
    unchanged constants; writeable (fed) arrays are transformed afresh on every call.
    """

    __slots__ = ("_entry",)

    def __init__(self):
        self._entry = None

    def get(self, key, arrays: tuple, build):
        entry = self._entry  # one read: another thread may swap in a new entry meanwhile
        if entry is not None and entry[0] == key and all(a is b for a, b in zip(entry[1], arrays)):
            return entry[2]
        value = build()
        if all(a is None or not a.flags.writeable for a in arrays):
            self._entry = (key, arrays, value)
        return value


def _grouped_weights(w: np.ndarray, b, group: int, dtype) -> np.ndarray:
    """(G, Mg, Cg*K) weights; with a bias, one more column holding it (it multiplies a row of ones)."""
    m = w.shape[0]
    flat = w.astype(dtype, copy=False).reshape(group, m // group, -1)
    if b is None:
        return flat
    return np.concatenate([flat, b.astype(dtype, copy=False).reshape(group, m // group, 1)], axis=2)


# Column-buffer budget per matmul: about an L2 cache, so each block's matmul reads the columns its
# copy just wrote from cache (larger blocks measured slower in whole models, smaller ones too).
_IM2COL_BYTES = 1 << 22


def _conv_im2col(x, weights, geo: _Geometry, group: int, with_bias: bool, finish=None) -> np.ndarray:
    """General convolution: (G, Mg, Cg*K [+1]) weights times the im2col matrix of ``x``.

    The column matrix is written one block of output rows at a time, each block feeding one batched
    matmul that writes straight into its rows of the result: for 2-D float32/float64 windows by a
    compiled loop straight from the input (compiled/im2col.py), otherwise copied out of a strided
    window view of the padded input. With a bias, the matrix gets a row of ones so the matmul adds it.
    A FusedConv's ``finish`` (an _Epilogue) runs on each block of output rows right after its matmul.
    """
    n, c = x.shape[:2]
    cg, mg, depth = c // group, weights.shape[1], weights.shape[2]
    if len(geo.kernel) == 2 and takes_compiled(x):
        fill = _compiled_im2col(x.reshape(n, group, cg, *x.shape[2:]), geo)
    else:
        windows = geo.windows(geo.pad(x, 0).reshape(n, group, cg, *geo.padded_shape(x.shape)[2:]))

        def fill(taps, block, count):
            taps = taps[..., : count * math.prod(geo.out[1:])]
            np.copyto(taps.reshape(n, group, cg, *geo.kernel, count, *geo.out[1:], copy=False), windows[block])
    y = np.empty((n, group, mg, *geo.out), dtype=x.dtype)
    rest = math.prod(geo.out[1:])
    rows = max(1, min(geo.out[0], _IM2COL_BYTES // max(1, x.itemsize * n * group * depth * rest)))
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


def _compiled_im2col(xg: np.ndarray, geo: _Geometry):
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


def _tight_fits(geo: _Geometry) -> bool:
    """Whether a stride-1 2-D window's output is exactly as wide as its input (e.g. 'same' pads):
    its taps are then contiguous runs of _tight_rows computed straight into the output."""
    return _rows_fit(geo) and geo.out[1] == geo.in_shape[1]


def _conv_tight_rows(x, weights, geo: _Geometry, with_bias: bool, finish=None) -> np.ndarray:
    """Stride-1 2-D convolution (one group) whose output is as wide as its input: im2col where each
    (channel, tap) row of a block of output rows is one contiguous run of the flattened image,
    shifted by the tap, instead of one short copy per output row; the matmul writes y directly.

    float32/float64 fill the column matrix straight from x with a compiled loop; other dtypes copy
    it from the staged rows of _tight_rows and zero the wrapped columns (see _tap_source). A FusedConv's
    ``finish`` (an _Epilogue) runs on each block of output rows while the matmul's result is in cache."""
    n, c = x.shape[:2]
    m, depth = weights.shape[1], weights.shape[2]
    oh, width = geo.out
    taps = c * math.prod(geo.kernel)
    rows = max(1, min(oh, _IM2COL_BYTES // max(1, x.itemsize * depth * width)))
    buffer = np.empty((depth, rows * width), dtype=x.dtype)
    if with_bias:
        buffer[-1] = 1
    fill = _tight_fill(x, geo, buffer[:taps])
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


def _tight_fill(x, geo: _Geometry, taps: np.ndarray):
    """``fill(image, start, count)``: the column rows of output rows start .. start + count of one
    image into the first count * W columns of ``taps`` (C*K, rows * W), for _conv_tight_rows."""
    if takes_compiled(x):
        from ..compiled.im2col import fill_tight_columns

        xc = np.ascontiguousarray(x)
        (kh, kw), (dh, dw), (top, left) = geo.kernel, geo.dilations, geo.begin

        def fill(image, start, count):
            fill_tight_columns(xc[image], taps, kh, kw, dh, dw, top, left, start, count)

        return fill
    source, (_, width), wrapped = _tap_source(x, geo)

    def fill(image, start, count):
        tap_cols = taps[:, : count * width].reshape(x.shape[1], *geo.kernel, count, width, copy=False)
        np.copyto(tap_cols, source[image, :, :, :, start:start + count])
        for j, first, end in wrapped:
            tap_cols[:, :, j, :, first:end] = 0

    return fill


def _conv_pointwise(x, weights, group: int, with_bias: bool) -> np.ndarray:
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


def _tap_weights(w: np.ndarray, dtype) -> np.ndarray:
    """(KH*KW, M, C) weights: one (M, C) matrix per kernel tap."""
    m, c = w.shape[:2]
    return np.ascontiguousarray(w.astype(dtype, copy=False).reshape(m, c, -1).transpose(2, 0, 1))


def _padded_width(geo: _Geometry) -> int:
    return geo.in_shape[1] + geo.begin[1] + geo.reach[1]


def _padded_rows(x: np.ndarray, geo: _Geometry) -> np.ndarray:
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


def _tap_offsets(geo: _Geometry) -> list[int]:
    """Where each kernel tap of a stride-1 2-D window starts in a padded row from _padded_rows."""
    wp = _padded_width(geo)
    (kh, kw), (dh, dw) = geo.kernel, geo.dilations
    return [i * dh * wp + j * dw for i in range(kh) for j in range(kw)]


def _crop_rows(rows: np.ndarray, geo: _Geometry, out: np.ndarray, b=None) -> None:
    """Write (..., OH * Wp) padded-row results into ``out`` (..., OH, OW), adding a bias if given."""
    oh, ow = geo.out
    valid = rows.reshape(*rows.shape[:-1], oh, -1)[..., :ow]
    if b is None:
        np.copyto(out, valid)
    else:
        np.add(valid, b.astype(out.dtype, copy=False).reshape(-1, 1, 1), out=out)


def _conv_by_taps(x, taps, b, geo: _Geometry, finish=None) -> np.ndarray:
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
            _crop_rows(total, geo, y[image], b)
        else:
            finish.crop(total, y.reshape(n, m, math.prod(geo.out)), geo.out[1], image)
    return y


# Column-buffer budget for one-channel groups: their matmuls are tiny, so a cache-sized buffer wins.
_DEPTHWISE_BYTES = 1 << 19


def _tight_rows(x: np.ndarray, geo: _Geometry) -> np.ndarray:
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


def _wrapped_columns(geo: _Geometry) -> list[tuple[int, int, int]]:
    """(kernel column j, first, end): the output columns whose tap in kernel column j falls left
    or right of the image in the layout of _tight_rows."""
    w, ow, bw, dw = geo.in_shape[1], geo.out[1], geo.begin[1], geo.dilations[1]
    spans = []
    for j in range(geo.kernel[1]):
        left, right = min(ow, bw - j * dw), max(0, w + bw - j * dw)
        spans += [(j, 0, left)] if left > 0 else []
        spans += [(j, right, ow)] if right < ow else []
    return spans


def _tap_source(x: np.ndarray, geo: _Geometry):
    """The taps of every output as a read-only (N, C, *kernel, *run) view, the run's shape, and the
    (kernel column, first, end) columns to zero after copying it.

    Stride-1 2-D windows no wider than the input read runs of _tight_rows (no crop when the output
    is as wide as the input); other stride-1 2-D windows read the fully padded rows of
    _padded_rows (cropped at the end); any other window reads the strided window view.
    """
    if _rows_fit(geo) and geo.out[1] <= geo.in_shape[1]:
        flat, width, wrapped = _tight_rows(x, geo), geo.in_shape[1], _wrapped_columns(geo)
    elif _rows_fit(geo):
        flat, width, wrapped = _padded_rows(x, geo), _padded_width(geo), []
    else:
        return geo.windows(geo.pad(x, 0)), geo.out, []
    (dh, dw), item, run = geo.dilations, flat.itemsize, (geo.out[0], width)
    view = _view(flat, (*flat.shape[:2], *geo.kernel, *run),
                 flat.strides[:2] + (dh * width * item, dw * item, width * item, item))
    return view, run, wrapped


def _conv_depthwise(x, weights, geo: _Geometry, with_bias: bool) -> np.ndarray:
    """Convolution with one input channel per group: per channel, a (multiplier, K) matmul over its
    K kernel taps, for a cache-sized block of channels at a time (one batched matmul over all the
    channels would stream a column matrix K times the input through memory). The path for what the
    compiled loop does not take (see _depthwise_compiles): dtypes other than float32/float64, 3-D windows.

    Stride-1 2-D windows copy their taps as long contiguous runs of the flattened rows (see
    _tap_source); outputs computed on a grid wider than the output are cropped at the end.
    """
    n, c = x.shape[:2]
    multiplier, depth = weights.shape[1:]
    taps = math.prod(geo.kernel)
    source, run, wrapped = _tap_source(x, geo)
    length = math.prod(run)
    block = max(1, min(c, _DEPTHWISE_BYTES // max(1, depth * length * x.itemsize)))
    cols = np.empty((block, depth, length), dtype=x.dtype)
    if with_bias:
        cols[:, taps] = 1
    y = np.empty((n, c * multiplier, *geo.out), dtype=x.dtype)
    rows = np.empty((c, multiplier, length), dtype=x.dtype) if tuple(run) != geo.out else None
    for image in range(n):
        target = rows if rows is not None else y[image].reshape(c, multiplier, length, copy=False)
        for start in range(0, c, block):
            stop = min(c, start + block)
            part = cols[: stop - start]
            tap_cols = part[:, :taps].reshape(stop - start, *geo.kernel, *run, copy=False)
            np.copyto(tap_cols, source[image, start:stop])
            for j, first, end in wrapped:
                tap_cols[:, :, j, :, first:end] = 0
            np.matmul(weights[start:stop], part, out=target[start:stop])
        if rows is not None:
            _crop_rows(rows.reshape(-1, length), geo, y[image])
    return y


def _depthwise_compiles(geo: _Geometry, x: np.ndarray) -> bool:
    """Whether the compiled depthwise loop takes this convolution: 1-D or 2-D, float32/float64."""
    return len(geo.kernel) <= 2 and takes_compiled(x)


def _compiled_depthwise(geo: _Geometry, m: int, prepared: _Prepared, dtype):
    """``compute(x, w, b, finish, source=None)`` for a depthwise convolution by the compiled loop
    (compiled/depthwise.py), which adds the bias and applies the activation of ``finish`` (an
    _Epilogue, or None) as it stores; a residual is added after. A 1-D window runs as a 2-D one of
    height 1."""
    from ..compiled import epilogue
    from ..compiled.depthwise import DepthwisePlan  # numba loads only for models that need it

    lift = (1,) * (2 - len(geo.kernel))
    plan = DepthwisePlan(lift + geo.in_shape, lift + geo.kernel, lift + geo.strides, lift + geo.dilations,
                         (0,) * len(lift) + geo.begin, lift + geo.out)
    identity = epilogue.activation_bounds(epilogue.NONE, (), dtype)

    def weights(w, b):
        # Fresh writeable copies: numba compiles a read-only array argument separately.
        bias = np.zeros(m, dtype) if b is None else np.array(b, dtype=dtype)
        return np.array(w.reshape(m, -1), dtype=dtype, order="C"), bias

    def compute(x, w, b, finish, source=None):
        """``source``: the channel map of a channel shuffle folded in (see _ChannelShuffle), or None."""
        flat_w, bias = prepared.get("depthwise", (w, b), lambda: weights(w, b))
        activation, residual = identity, finish is not None and finish.residual.size > 0
        if finish is not None and not residual:  # (with a residual, finish adds the bias after it)
            activation = finish.bounds
            if finish.bias.size:
                bias = finish.bias
        x = np.ascontiguousarray(x)
        # The work counted as elements times taps: each output reads a window of the input.
        work = max(x.size, math.prod(geo.out) * m) * flat_w.shape[1]
        spans = _thread_spans(x.shape[1], work, x.dtype) if x.shape[0] == 1 else None
        if spans is None:
            # A writeable bias: numba compiles a read-only array argument separately (the parts below
            # get arrays by address).
            y = plan(x, flat_w, bias if bias.flags.writeable else bias.copy(), activation, source)
        else:
            from ..compiled import jobs, workers

            def run(arguments):
                """jobs.split_depthwise: posted from compiled code, as the packed convolution's parts."""
                workers.call(jobs.split_depthwise, (*arguments, workers.local_mailbox(0)), jobs.DEPTHWISE.address(),
                             0, helper_count() if len(spans) > 1 else 0)

            # One image: its channels are independent.
            y = plan.split_channels(x, flat_w, bias, activation, _span_bounds(spans), source, run)
        if residual:
            finish.rows(y.reshape(y.shape[0], m, -1), 0, math.prod(geo.out))
        return y

    compute.reads_shuffled = True  # takes a channel map instead of a shuffled copy of x
    return compute


# Winograd F(2x2, 3x3) (Lavin & Gray, 2015): a 2x2 output tile is A^T [(G g G^T) * (B^T d B)] A for
# its 4x4 input tile d, 16 multiplies per input channel instead of 36. Kronecker products apply each
# two-sided transform to a whole stack of tiles as one matmul.
_WINOGRAD_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]])
_WINOGRAD_B4 = np.array([[1, 0, -1, 0], [0, 1, 1, 0], [0, -1, 1, 0], [0, 1, 0, -1]], dtype=np.float64)
_WINOGRAD_A2 = np.array([[1, 1, 1, 0], [0, 1, -1, -1]], dtype=np.float64)
_WINOGRAD_BT = np.kron(_WINOGRAD_B4, _WINOGRAD_B4)  # (16, 16): B^T d B of every tile at once
_WINOGRAD_AT = np.kron(_WINOGRAD_A2, _WINOGRAD_A2)  # (4, 16): A^T m A


def _winograd_weights(w: np.ndarray, dtype) -> np.ndarray:
    """(16, M, C): the transformed 3x3 kernel G g G^T of each (output, input) channel pair."""
    u = np.einsum("ik,mckl,jl->ijmc", _WINOGRAD_G, w.astype(np.float64), _WINOGRAD_G)
    return np.ascontiguousarray(u.reshape(16, *w.shape[:2]), dtype=dtype)


def _conv_winograd(x, u, b, geo: _Geometry) -> np.ndarray:
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
    tiles = _view(xp, (4, 4, c, n, th, tw), (sh, sw, sc, sn, 2 * sh, 2 * sw))
    d = np.empty((16, c * n * th * tw), dtype=x.dtype)
    np.copyto(d.reshape(4, 4, c, n, th, tw), tiles)
    v = np.matmul(_WINOGRAD_BT.astype(x.dtype), d).reshape(16, c, n * th * tw)
    products = np.matmul(u, v).reshape(16, m * n * th * tw)
    out_tiles = np.matmul(_WINOGRAD_AT.astype(x.dtype), products).reshape(2, 2, m, n, th, tw)
    y = np.empty((n, m, 2 * th, 2 * tw), dtype=x.dtype)
    placed = y.reshape(n, m, th, 2, tw, 2).transpose(3, 5, 1, 0, 2, 4)  # (2, 2, M, N, TH, TW)
    if b is None:
        np.copyto(placed, out_tiles)
    else:
        np.add(out_tiles, b.astype(x.dtype, copy=False).reshape(m, 1, 1, 1), out=placed)
    if (2 * th, 2 * tw) != (oh, ow):
        y = np.ascontiguousarray(y[:, :, :oh, :ow])
    return y


def _use_winograd(geo: _Geometry, group: int, c: int, m: int) -> bool:
    """Winograd pays where the channel-mixing products dominate: enough input channels for long
    products (K = C) and enough outputs, on images with enough tiles per product (measured in
    the CNN benchmarks: a 7x7 image loses; below 192 channels the im2col paths measured faster) but
    small enough for the tile stacks to stay near the cache."""
    return (geo.kernel == (3, 3) and geo.strides == (1, 1) and geo.dilations == (1, 1) and group == 1
            and c >= 192 and m >= 192 and 12 * 12 <= math.prod(geo.out) <= 28 * 28)


def _rows_fit(geo: _Geometry) -> bool:
    """Whether the padded-row layout of _padded_rows applies: a stride-1 2-D window."""
    return len(geo.kernel) == 2 and geo.strides == (1, 1) and math.prod(geo.kernel) > 1


def _use_taps(geo: _Geometry, group: int, c: int, m: int, dtype) -> bool:
    """Per-tap matmuls pay off for stride-1 2-D kernels with a few outputs per input channel, and,
    where BLAS accumulates in place, for few input channels on wide images: the im2col copy (K times
    the input) then costs more than the shorter products, and the padded rows waste little."""
    if group != 1 or not _rows_fit(geo):
        return False
    column_bytes = c * math.prod(geo.kernel) * math.prod(geo.out) * dtype.itemsize
    return 4 * m <= c or (blas_accumulates(dtype) and column_bytes >= _TAPS_COLUMN_BYTES)


# Column matrices from this size on stream through memory in im2col; per-tap products accumulated
# in BLAS measured faster from here on (3x3 kernels: 32 channels at 112x112, 256 at 56x56).
_TAPS_COLUMN_BYTES = 12 << 20


def _packed_conv_applies(geo: _Geometry, group: int, x: np.ndarray) -> bool:
    """Whether compiled/gemm.py's packed convolution runs this one: 2-D float32 windows with some output
    on AVX-512 hosts (depthwise convolutions keep their own loop)."""
    if x.dtype != np.float32 or len(geo.kernel) != 2 or (group == x.shape[1] and group > 1) \
            or x.size == 0 or 0 in geo.out:
        return False
    from ..compiled import gemm  # numba (and the IR microkernel) load only for models that need them

    return gemm.AVAILABLE


def _pixel_product_applies(geo: _Geometry, group: int, x: np.ndarray) -> bool:
    """Whether a convolution is a few-row product: a 1x1 kernel over a 1x1 image (a convolutional
    classifier after global pooling, as DenseNet's and MobileNet's) of float32 with a few images. The
    packed convolution would compute 32 lanes for its one pixel (DenseNet's 1024 -> 1000: 762 us)."""
    from .linalg import _GEMV_ROWS

    return (group == 1 and x.dtype == np.float32 and len(geo.kernel) == 2 and geo.kernel == (1, 1)
            and geo.in_shape == (1, 1) and geo.unpadded and 0 < x.shape[0] <= _GEMV_ROWS and x.shape[1] > 0)


def _pixel_product(x: np.ndarray, w: np.ndarray, b) -> np.ndarray:
    """y (N, M, 1, 1) = w (M, C, 1, 1) applied to x's one pixel per image (N, C, 1, 1) (+ b), through
    linalg's few-row products (compiled/gemv.py on AVX-512 hosts, BLAS elsewhere)."""
    from .linalg import _few_rows_product

    n, c, m = x.shape[0], x.shape[1], w.shape[0]
    rows, weights = x.reshape(n, c), w.reshape(m, c)
    y = _few_rows_product(rows, weights, True)
    if y is None:
        y = rows @ weights.T
    if b is not None:
        y += b.astype(np.float32, copy=False)
    return y.reshape(n, m, 1, 1)


def _lane_grid(geo: _Geometry, padded_width: int) -> int:
    """The width of the rows the packed convolution's lanes run over: the padded width for stride-1
    windows (each column row of a panel is then one contiguous copy) unless the columns past the
    output's width would waste more than the copies save (narrow images); else the output's width."""
    if geo.strides == (1, 1) and padded_width <= geo.out[1] * _GRID_WASTE:
        return padded_width
    return geo.out[1]


_GRID_WASTE = 1.3


def _lanes_apply(geo: _Geometry, outputs: int, depth: int) -> bool:
    """Whether the packed convolution puts output channels across its lanes (compiled/lanes.py) for this
    window with ``outputs`` channels per group and a reduction of ``depth``: column strides 1 and 2 (the
    kernel's pixel steps), where its share of useful lanes (channels in tiles of 32, pixels in row chunks
    of 14) times its measured gain at equal shares beats the pixel panels' (pixels in panels of 32 over
    the lane grid, channels in tiles of 8 or 12). Gains: 1.2-1.5x for 3x3 and 1x1 convolutions, 1.4-1.8x
    for shallow stems (each panel tile then mostly stores)."""
    if geo.strides[1] not in (1, 2):
        return False
    from ..compiled import gemm, lanes  # (loaded already by the packed convolution that asks)

    (oh, ow), pixels = geo.out, math.prod(geo.out)
    columns, rows = lanes.shape(ow)
    tiles = lanes.CHANNELS * -(-outputs // lanes.CHANNELS)
    by_lanes = outputs / tiles * pixels / (-(-oh // rows) * rows * -(-ow // columns) * columns)
    grid = _lane_grid(geo, geo.padded_shape(geo.in_shape)[1])
    mr = gemm.tile_rows(outputs)
    panels = pixels / (gemm.NR * -(-(oh * grid) // gemm.NR)) * outputs / (mr * -(-outputs // mr))
    return by_lanes * (_LANES_GAIN_SHALLOW if depth < 64 else _LANES_GAIN) >= panels


_LANES_GAIN, _LANES_GAIN_SHALLOW = 1.25, 1.8


def _phase_split(geo: _Geometry, padded: tuple, outputs: int) -> tuple[int, int] | None:
    """(phase height, phase width) when the packed convolution runs this strided window over the padded
    image split into its stride's phases, else None. Phase (p, q) holds every sh-th row from p and sw-th
    column from q; an output's taps then lie at its own position in the phases they read, so the window
    reads them in place, as a stride-1 window does its image (compiled/gemm.phase_tap_offsets), where the
    strided window otherwise packs every panel first (a gather per run of a few pixels). For windows whose
    taps read every phase (3x3/2, 7x7/2, 11x11/4; a 1x1/2 window reads one, and its packed panels, a
    gather of those pixels only, measured 15-40% faster than copying that phase), with at least
    _PHASE_MACS multiply-adds per input value (the split is a copy of the input), and phases no wider than
    _GRID_WASTE times the output (the lanes past its width are dropped)."""
    (sh, sw), (kh, kw), (dh, dw), ow = geo.strides, geo.kernel, geo.dilations, geo.out[1]
    phase_h, phase_w = -(-padded[0] // sh), -(-padded[1] // sw)
    read = {(i * dh % sh, j * dw % sw) for i in range(kh) for j in range(kw)}
    if (sh, sw) == (1, 1) or len(read) < sh * sw or phase_w > ow * _GRID_WASTE \
            or outputs * kh * kw < _PHASE_MACS * sh * sw:
        return None
    return phase_h, phase_w


# Measured alone (2 threads): 3x3/2 convolutions of 512 channels on 14x14 -17%, of 256 on 28x28 -11%, a 7x7/2
# stem on 224x224 -12% (1152, 576 and 784 multiply-adds per input value); 128 channels on 56x56 (288) -1%, a
# 3x3/2 stem of 64 channels (144) +24%.
_PHASE_MACS = 500

# Below this many multiply-adds per thread the hand-off to a helper thread costs more than it saves;
# from this many per thread (milliseconds), a part waits for a sleeping helper to wake up.
_SPLIT_MACS = 1 << 20
_LONG_MACS = 1 << 28


class _PackedConv:
    """One geometry's packed convolution, output channels across the vector lanes (compiled/lanes.py) or
    pixel panels (compiled/gemm.py), whichever uses more of its lanes (_lanes_apply): weights packed once
    per constant array, the output's pixel blocks or panels (or its channel tiles) split evenly across the
    kernel threads (threads.py), and a FusedConv's bias, residual and activation applied as each output
    tile is stored."""

    def __init__(self, geo: _Geometry, group: int, x_shape, w_shape, prepared: _Prepared):
        from ..compiled import gemm, jobs, lanes, workers

        self._gemm, self._jobs, self._workers = gemm, jobs, workers
        self._out = (x_shape[0], w_shape[0], *geo.out)
        self._flat = None  # the input's shape as one row of pixels, for a pointwise window
        if geo.kernel == (1, 1) and geo.strides == (1, 1) and geo.unpadded:
            # A pointwise window is a product over the pixels, which may run as one long row: tiles
            # take its chunks without each row's tail, and a plane narrower than a tile's 14 pixels
            # (squeezenet's 13x13) needs no margin, so no padded copy of the input (512x13x13 -> 64 on
            # two threads: 100 -> 58 us; with the copy, two threads ran no faster than one).
            pixels = math.prod(geo.out)
            geo = _Geometry((1, pixels), (1, 1), (1, 1), (1, 1), (0, 0), (0, 0), (1, pixels))
            x_shape = self._flat = (x_shape[0], x_shape[1], 1, pixels)
        self._geo, self._group, self._prepared = geo, group, prepared
        self._n, c = x_shape[:2]
        self._m = w_shape[0]
        self._cg, self._mg = c // group, self._m // group
        self._pixels = math.prod(geo.out)
        self._padded = geo.padded_shape(tuple(x_shape))[2:]
        (kh, kw), (dh, dw), (hp, wp) = geo.kernel, geo.dilations, self._padded
        (sh, sw), (oh, ow) = geo.strides, geo.out
        # Output channels across the lanes (compiled/lanes.py), or pixel panels (gemm.py).
        self._by_lanes = _lanes_apply(geo, self._mg, self._cg * kh * kw)
        self._phases = None if self._by_lanes else _phase_split(geo, self._padded, self._mg)
        self._margin = 0
        if self._by_lanes:
            self._rows = lanes.CHANNELS
            columns, rows = lanes.shape(ow)
            self._blocks = -(-oh // rows) * -(-ow // columns)  # the tasks' unit: a tile's pixels
            if ow < columns or oh < rows:  # a tile reads past the image
                self._margin = lanes.margin(sh, sw, wp)
            self._grid = ow
        else:
            self._rows = gemm.tile_rows(self._mg)  # output channels per tile
            self._grid = self._phases[1] if self._phases else _lane_grid(geo, self._padded[1])
            self._blocks = -(-(oh * self._grid) // gemm.NR)  # the tasks' unit: a panel
        self._macs = self._n * self._m * self._cg * math.prod(geo.kernel) * self._pixels
        self._plans: dict[int, list] = {}  # per thread count: the task arrays
        self._no_residual = np.empty((1, 0), dtype=np.float32)
        # conv_tasks' arguments that stay the same from call to call.
        if self._phases:  # a strided window as a stride-1 window over the phases (see _phase_split)
            phase_h, phase_w = self._phases
            self._geometry = np.array([self._mg, oh, ow, self._grid, self._cg, kh, kw, 1, 1, dh, dw, phase_w,
                                       sh * sw * phase_h * phase_w, 0], dtype=np.int64)
            taps = gemm.phase_tap_offsets(self._cg, kh, kw, sh, sw, dh, dw, phase_h, phase_w)
        else:
            self._geometry = np.array([self._mg, oh, ow, self._grid, self._cg, kh, kw, sh, sw, dh, dw, wp, hp * wp,
                                       int(self._by_lanes)], dtype=np.int64)
            taps = gemm.tap_offsets(self._cg, kh, kw, dh, dw, wp, hp * wp)
        self._offsets = (taps, gemm.packed_offsets(self._cg * kh * kw))
        self._scratch = 0 if self._by_lanes else gemm.scratch_size(self._cg * kh * kw)
        self._bias_cache = (None, None)  # (the bias array last seen, its padded copy)
        self._padded_inputs: dict[int, np.ndarray] = {}  # per calling thread: a phase-split input buffer
        if self._phases:
            self._phase_shape = (self._n, group, *geo.strides, self._cg, *self._phases)
            self._keeps_padded = 4 * math.prod(self._phase_shape) <= _KEPT_PADDED_BYTES

    def _plan(self, threads: int) -> tuple:
        """(per thread its tasks, all of them in one array, where each thread's start there): tasks
        (image, group, first panel, end panel, first tile, end tile) that split the panels of every
        (image, group) evenly, or, where there are too few panels to go round (small images), each
        unit's weight tiles, so each thread also reads only its share of the weights."""
        plan = self._plans.get(threads)
        if plan is None:
            panels = self._blocks
            tiles = -(-self._mg // self._rows)
            units = [(n, g) for n in range(self._n) for g in range(self._group)]
            by_tiles = threads > 1 and panels * len(units) < 4 * threads and tiles >= 2 * threads
            if self._by_lanes and threads > 1 and tiles >= 2 * threads:
                # Split by tiles where the pixel blocks go round unevenly and the tiles do better
                # (squeezenet's classifier: 13 blocks 7/6, 32 tiles 16/16), or where the weights
                # outweigh the input 4 to 1 (each thread then reads its share of them, not all: in
                # resnet50's run 0.92, inception_v2's 0.94-0.96; all even splits by tiles were 6-13%
                # slower on resnet50 and densenet121).
                blocks = _uneven(panels * len(units), threads)
                heavy = self._mg * math.prod(self._geo.kernel) > 4 * math.prod(self._padded)
                by_tiles = (blocks > 1.05 and _uneven(tiles, threads) < blocks) or (
                    heavy and _uneven(tiles, threads) <= 1.2)
            total = (tiles if by_tiles else panels) * len(units)
            parts, taken = [], 0
            for t in range(threads):
                goal = total * (t + 1) // threads
                step = -(-(goal - taken) // _SUBTASKS)  # (a thread claims its share a task at a time: see jobs.CONV)
                tasks = []
                while taken < goal:
                    unit, first = divmod(taken, tiles if by_tiles else panels)
                    end = min(tiles if by_tiles else panels, first + min(goal - taken, step))
                    if by_tiles:
                        tasks.append((*units[unit], 0, panels, first, end))
                    else:
                        tasks.append((*units[unit], first, end, 0, tiles))
                    taken += end - first
                parts.append(np.array(tasks, dtype=np.int64).reshape(-1, 6))
            # For jobs.split_conv: every part's tasks in one array, and where each part's start.
            ranges = np.cumsum([0] + [len(tasks) for tasks in parts]).astype(np.int64)
            plan = self._plans[threads] = (parts, np.concatenate(parts), ranges)
        return plan

    def _weights(self, w):
        def build():
            flat = w.astype(np.float32, copy=False).reshape(self._group, self._mg, -1)
            return np.stack([self._gemm.pack_weights(flat[g], self._rows) for g in range(self._group)])

        return self._prepared.get("packed", (w,), build)

    def _bias(self, b, tiles: int) -> np.ndarray:
        """The bias padded to whole tiles per group, kept while the same read-only array comes in."""
        seen, padded = self._bias_cache  # one read: another thread may swap in a new pair meanwhile
        if seen is not None and seen is b:
            return padded
        padded = np.zeros((self._group, tiles * self._rows), dtype=np.float32)
        if b is not None and b.size:
            padded[:, : self._mg] = b.reshape(self._group, self._mg)
            if not b.flags.writeable:
                self._bias_cache = (b, padded)
        return padded

    def _phase_input(self, x) -> np.ndarray:
        """x zero-padded and split into the stride's phases, as (N, G * sh * sw * Cg * phase plane) (see
        _phase_split): phase (p, q) of a group's channel holds the padded image's rows p, p + sh, ... and
        columns q, q + sw, ...; for small inputs in a buffer of the calling thread whose zeros (the pads,
        and the cells past the padded image) stay from call to call, so only x's cells are copied."""
        geo = self._geo
        shape = self._phase_shape
        buffer = self._kept_buffer(shape) if self._keeps_padded else np.zeros(shape, dtype=np.float32)
        n, _, h, w = x.shape
        grouped = x.reshape(n, self._group, self._cg, h, w)
        (sh, sw), (bh, bw) = geo.strides, geo.begin
        for p in range(sh):
            y0 = max(0, -(-(bh - p) // sh))  # the first phase row on the image: padded row y0 * sh + p
            r0 = y0 * sh + p - bh
            for q in range(sw):
                x0 = max(0, -(-(bw - q) // sw))
                c0 = x0 * sw + q - bw
                if r0 < h and c0 < w:
                    rows, cols = len(range(r0, h, sh)), len(range(c0, w, sw))
                    buffer[:, :, p, q, :, y0:y0 + rows, x0:x0 + cols] = grouped[:, :, :, r0::sh, c0::sw]
        return buffer.reshape(n, -1)

    def _padded_input(self, x) -> np.ndarray:
        """x zero-padded, as (N, C * plane) plus the margin a channel-lane tile may read past it: x itself
        without pads or margin; else the calling thread's scratch buffer, every cell written by
        gemm.pad_planes (pads and margin zero). numpy's copy into a padded view went row by row, and a
        fresh buffer per call paid its page faults: densenet121's 58 padded inputs took 3.5 ms a run."""
        geo = self._geo
        x = np.ascontiguousarray(x)
        if geo.unpadded and not self._margin:
            return x.reshape(self._n, -1)
        _, _, padded_height, padded_width = geo.padded_shape(x.shape)
        size = x.shape[1] * padded_height * padded_width
        buffer = _scratch(self._n * (size + self._margin)).reshape(self._n, -1)
        (top, left) = geo.begin
        split = x[0].nbytes >= _SPLIT_PAD_BYTES and kernel_threads() > 1
        for image in range(self._n):  # (rows of the buffer, margin included)
            if split:  # the helpers' share of the channels (memory-bound: the second core's bandwidth)
                self._workers.call(self._jobs.split_pad, (x[image], buffer[image], top, left, padded_height,
                                                          padded_width), self._jobs.PAD.address(), 0, helper_count())
            else:
                self._gemm.pad_planes(x[image], buffer[image], top, left, padded_height, padded_width)
        return buffer

    def _kept_buffer(self, shape) -> np.ndarray:
        """The calling thread's zeroed phase-split input buffer for this node, kept from call to call (its
        zeros, the pads, stay: only the input's cells are written); for the buffers' memory, up to
        _KEPT_PADDED_BYTES per node and a few threads."""
        thread = threading.get_ident()
        buffer = self._padded_inputs.get(thread)
        if buffer is None:
            if len(self._padded_inputs) >= 8:  # callers come and go: keep the buffers of a few
                self._padded_inputs.clear()
            buffer = self._padded_inputs[thread] = np.zeros(shape, dtype=np.float32)
        return buffer

    def __call__(self, x, w, b, finish, out=None):
        weights = self._weights(w)
        flags, bounds, residual = 0, _IDENTITY_BOUNDS, self._no_residual
        if finish is not None:
            b, bounds = finish.bias, finish.bounds
            if finish.residual.size:
                residual, flags = finish.residual.reshape(self._n, -1), 2
        if b is not None and b.size:
            flags |= 1
        bias = self._bias(b, weights.shape[1])
        if self._flat is not None:
            x = x.reshape(self._flat)
        xp = self._phase_input(x) if self._phases else self._padded_input(x)
        y = np.empty(self._out, dtype=np.float32) if out is None else out
        threads = max(1, min(kernel_threads(), self._macs // _SPLIT_MACS))
        parts, tasks, ranges = self._plan(threads)
        head = (xp, weights, bias, y.reshape(self._n, -1), residual, flags, bounds)
        workers = self._workers
        claims = np.zeros(len(parts), dtype=np.int64)  # per call: what each part's tasks have given out
        if threads > 1 and self._macs >= _LONG_MACS * threads:
            # Milliseconds per part: through workers.run, whose parts wait for a sleeping helper.
            fixed = (*self._geometry.tolist(), *self._offsets)
            workers.run(self._jobs.CONV, [(*head, *fixed, tasks, ranges, claims, part) for part in range(len(parts))],
                        helper_count(), True)
            return y
        # Posted from compiled code (jobs.split_conv): per call, the Python of workers.run cost about as
        # much as a small convolution's arithmetic.
        arguments = (*head, self._geometry, *self._offsets, tasks, ranges, claims,
                     workers.local_mailbox(self._scratch))
        workers.call(self._jobs.split_conv, arguments, self._jobs.CONV.address(), self._scratch,
                     helper_count() if threads > 1 else 0)
        return y


_scratches = threading.local()  # per calling thread: the buffer of _scratch
# Images from which the padded copy is split across the helpers too (memory-bound: the second core's bandwidth;
# in the run densenet121's 58 padded inputs 2.6 -> 1.9 ms, resnet50's 1.1 -> 0.8; from 32 KB to 256 KB alike).
_SPLIT_PAD_BYTES = 1 << 16


def _scratch(floats: int) -> np.ndarray:
    """The calling thread's float32 scratch, ``floats`` long (grown as needed, reused by every kernel that
    asks: a kernel's use ends when it returns)."""
    buffer = getattr(_scratches, "buffer", None)
    if buffer is None or buffer.size < floats:
        buffer = _scratches.buffer = np.empty(max(floats, 1), dtype=np.float32)
    return buffer[:floats]


def _uneven(count: int, parts: int) -> float:
    """The largest of ``parts`` near-equal shares of ``count`` units over the mean share."""
    return -(-count // parts) * parts / count


# Tasks per thread's share of a packed convolution: a thread that finished its own claims those another
# has not started, so a helper on a CPU shared with another busy process no longer holds the caller back
# (such a process on the helper's CPU 30% of each 0.5 ms, one share per thread -> 4 tasks: resnet50 53
# -> 46 ms, inception_v2 28 -> 25, densenet121 47 -> 43; 2 tasks gained little; unloaded within 1%, in-process
# A/B of 1 and 4 tasks, both orders).
_SUBTASKS = 4

_IDENTITY_BOUNDS = np.array([-np.inf, np.inf, 1.0], dtype=np.float32)
_KEPT_PADDED_BYTES = 1 << 20


@register("Conv", since=1)
def conv(node, shapes, opset):
    resolve = _conv_resolver(node, shapes)

    def kernel(x, w, b=None):
        return (resolve(x, w, b)[0](x, w, b, None),)

    return kernel


def _conv_resolver(node, shapes):
    """``resolve(x, w, b) -> (path, out_shape)``: the node's convolution path for these inputs'
    signature (see _conv_path), chosen on the first call with that signature and kept."""
    window = _Window(node, shapes, needs_kernel=False)
    group = _group(node)
    prepared = _Prepared()
    paths: dict[tuple, tuple] = {}  # per input signature: the path, with its geometry resolved

    def resolve(x, w, b):
        key = (x.shape, w.shape, x.dtype, b is None, w.flags.writeable)
        found = paths.get(key)
        if found is None:
            _check_channels(node, x.shape[1], w.shape, group, transpose=False)
            geo = window.resolve(x.shape[2:], w.shape[2:])
            found = paths[key] = (_conv_path(geo, group, x, w, prepared), (x.shape[0], w.shape[0], *geo.out))
        return found

    return resolve


def _conv_path(geo: _Geometry, group: int, x: np.ndarray, w: np.ndarray, prepared: _Prepared):
    """``path(x, w, b, finish) -> y`` for inputs shaped like ``x`` and ``w``: the convolution algorithm
    for this geometry, chosen once per input signature. ``finish`` (an _Epilogue for float32/float64,
    or None) is a FusedConv's bias, residual and activation: the im2col, tight-row and taps paths
    apply it to each block of output as they write it, the others to the whole output at the end."""
    dtype = _compute_dtype(x.dtype)
    n, c, m = x.shape[0], x.shape[1], w.shape[0]
    out_shape = (n, m, *geo.out)
    blocks = False  # whether compute takes ``finish``

    def grouped(w, b):
        return prepared.get("grouped", (w, b), lambda: _grouped_weights(w, b, group, dtype))

    if _pixel_product_applies(geo, group, x):
        def compute(xc, w, b):
            return _pixel_product(xc, w, b)
    elif _packed_conv_applies(geo, group, x):
        compute = _PackedConv(geo, group, x.shape, w.shape, prepared)
        blocks = True
    elif group == c and group > 1 and _depthwise_compiles(geo, x):
        compute = _compiled_depthwise(geo, m, prepared, dtype)
        blocks = True
    elif group == c and group > 1:
        def compute(xc, w, b):
            return _conv_depthwise(xc, grouped(w, b), geo, b is not None)
    elif _use_taps(geo, group, c, m, dtype):
        def compute(xc, w, b, finish):
            return _conv_by_taps(xc, prepared.get("taps", (w,), lambda: _tap_weights(w, dtype)), b, geo, finish)
        blocks = True
    elif _use_winograd(geo, group, c, m) and not w.flags.writeable:  # its weight transform is done once
        def compute(xc, w, b):
            return _conv_winograd(xc, prepared.get("winograd", (w,), lambda: _winograd_weights(w, dtype)), b, geo)
    elif all(k == 1 for k in geo.kernel) and geo.unpadded and all(s == 1 for s in geo.strides):
        def compute(xc, w, b):
            return _conv_pointwise(xc, grouped(w, b), group, b is not None)
    elif group == 1 and _tight_fits(geo):
        def compute(xc, w, b, finish):
            return _conv_tight_rows(xc, grouped(w, b), geo, b is not None, finish)
        blocks = True
    else:
        def compute(xc, w, b, finish):
            return _conv_im2col(xc, grouped(w, b), geo, group, b is not None, finish)
        blocks = True

    reads_shuffled = getattr(compute, "reads_shuffled", False)

    def path(x, w, b, finish, out=None, shuffle=None):
        """The convolution; with ``out`` (the output's shape and dtype), written there (in place by the
        packed convolution when ``out`` is C-contiguous: one image's channels of a larger tensor); with
        ``shuffle`` (a _ChannelShuffle), of x's channels shuffled."""
        if shuffle is not None and not reads_shuffled:
            x, shuffle = shuffle.apply(x), None
        xc = x.astype(dtype, copy=False)
        if out is not None and dtype == x.dtype and out.flags.c_contiguous and isinstance(compute, _PackedConv):
            return compute(xc, w, b, finish, out)
        if out is not None:
            out[...] = path(x, w, b, finish, None, shuffle)
            return out
        if blocks:
            y = compute(xc, w, b, finish) if shuffle is None else compute(xc, w, b, finish, shuffle.source)
        else:
            y = compute(xc, w, b)
            if finish is not None:
                y = np.ascontiguousarray(y)  # finished in place, through a reshaped view
                finish.rows(y.reshape(n, m, math.prod(geo.out)), 0, math.prod(geo.out))
        return y.reshape(out_shape).astype(x.dtype, copy=False)

    return path


# -- fused activations (conv_fusions.py) -----------------------------------------------------------


def _in_place_activation(node):
    """The activation a fused node applies to its own fresh output, in place: the same operations
    (on the same dtype) as the Relu/Clip/LeakyRelu kernel it replaces, or None without one."""
    kind = node.attr("activation")
    params = [float(p) for p in node.attr("activation_params", [])]
    if kind is None:
        return None
    if kind == "Relu":
        return lambda y: np.maximum(y, y.dtype.type(0), out=y)
    if kind == "LeakyRelu":
        return lambda y: np.multiply(y, y.dtype.type(params[0]), out=y, where=y < 0)
    if kind == "Clip":
        low, high = params

        def clip(y):
            # max-then-min, as Clip: `high` wins where low > high, and NaN stays NaN.
            if low != -math.inf:
                np.maximum(y, y.dtype.type(low), out=y)
            if high != math.inf:
                np.minimum(y, y.dtype.type(high), out=y)

        return clip
    raise _graph_error(node, "activation", f"is {kind!r}; expected Relu, Clip or LeakyRelu")


def _add_residual(y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """y + z, into ``y`` when the sum keeps its shape and dtype (the common residual connection)."""
    if z.shape == y.shape and z.dtype == y.dtype:
        return np.add(y, z, out=y)
    return np.add(y, z)


def _activation_code(node):
    """The node's fused activation as the compiled epilogue's (code, parameters) pair."""
    from ..compiled import epilogue

    kind = node.attr("activation")
    params = [float(p) for p in node.attr("activation_params", [])]
    codes = {None: epilogue.NONE, "Relu": epilogue.RELU, "Clip": epilogue.CLIP, "LeakyRelu": epilogue.LEAKY_RELU}
    return codes[kind], (params + [0.0, 0.0])[:2]


class _Epilogue:
    """A FusedConv's bias, residual and activation for one run, applied by the compiled loops of
    compiled/epilogue.py to a float32/float64 conv output (N, M, P) in place: to a block of output
    pixels right after the matmul that wrote it (still in cache), or while the taps path crops its
    padded rows. The same arithmetic, in the same order, as conv-then-epilogue. The packed
    convolution reads ``bias`` (empty for none), ``residual`` (N, M, P; empty for none) and
    ``bounds`` (the activation as low, high, slope) and applies them itself."""

    __slots__ = ("_loops", "bias", "residual", "bounds")

    def __init__(self, loops, bias, residual, bounds):
        self._loops, self.bias, self.residual, self.bounds = loops, bias, residual, bounds

    def rows(self, y, first: int, end: int, image: int | None = None) -> None:
        """Finish pixels first .. end of every channel of ``y`` (N, M, P), or of one image of it."""
        residual = self.residual
        if image is not None:
            y, residual = y[image:image + 1], residual[image:image + 1]
        self._loops.bias_residual_activation(y, self.bias, residual, self.bounds, first, end)

    def crop(self, rows, y, width: int, image: int) -> None:
        """Write image ``image`` of ``y`` (N, M, OH*width) from its padded-row results ``rows``
        (M, OH*Wp), finished."""
        self._loops.crop_bias_residual_activation(rows.reshape(1, *rows.shape), y[image:image + 1], width,
                                                  self.bias, self.residual[image:image + 1], self.bounds)


def _compiled_epilogue(node):
    """``prepare(b, z, dtype) -> _Epilogue``: the node's bias ``b``, residual ``z`` (the output's
    shape, or None) and activation ready for the compiled loops, for a float32/float64 output."""
    from ..compiled import epilogue

    kind, params = _activation_code(node)
    # Per dtype, built once: the activation's bounds and the empty stand-ins for no bias/residual.
    constants = {np.dtype(t): (epilogue.activation_bounds(kind, params, t), epilogue.absent(t, 1),
                               epilogue.absent(t, 3))
                 for t in (np.float32, np.float64)}

    def prepare(b, z, dtype):
        bounds, no_bias, no_residual = constants[dtype]
        if b is None:
            bias = no_bias
        elif b.ndim == 1 and b.dtype == dtype and b.flags.c_contiguous:
            bias = b  # the array itself, so the kernels' caches keyed on it (a padded copy) hold from run to run
        else:
            bias = np.ascontiguousarray(b.reshape(-1), dtype=dtype)
        if z is None:
            residual = no_residual
        else:
            residual = np.ascontiguousarray(z).reshape(*z.shape[:2], math.prod(z.shape[2:]))
        return _Epilogue(epilogue, bias, residual, bounds)

    return prepare


@register("FusedConv", domain=FUSED_DOMAIN, since=1)
def fused_conv(node, shapes, opset):
    """Conv (the node's Conv attributes), then an optional residual ``z`` added and an activation
    (without either, the Conv itself: conv_fusions.py's Concat and channel-shuffle fusions).

    For float32/float64 the bias, residual and activation are one compiled pass over each block of
    the output as the convolution writes it (see _Epilogue); other dtypes, and residuals that only
    broadcast to the output, take numpy passes in place after the convolution."""
    resolve = _conv_resolver(node, shapes)
    activate = _in_place_activation(node)
    prepare = _compiled_epilogue(node)
    concat = node.attr("concat_channels")
    shuffled = _ChannelShuffle(node) if node.attr("shuffle_shape") is not None else None

    def convolve(x, w, b, z, out=None):
        shuffle = None
        if shuffled is not None:  # x is the shuffle's input: the convolution reads it through the shuffle
            shuffle = shuffled.over(x)
            if shuffle is None:
                x = shuffled.apply(x)
        path, out_shape = resolve(x, w, b)
        if activate is None and z is None:  # the Conv itself (into a Concat, or through a shuffle)
            return path(x, w, b, None, out, shuffle)
        if takes_compiled(x) and (z is None or (z.shape == out_shape and z.dtype == x.dtype)):
            return path(x, w, None, prepare(b, z, x.dtype), out, shuffle)
        y = path(x, w, b, None, None, shuffle)  # a fresh array, so it may be overwritten
        if z is not None:
            y = _add_residual(y, z)
        if activate is not None:
            activate(y)
        if out is not None:
            out[...] = y
            return out
        return y

    if node.attr("append"):
        return _appending(node, resolve, convolve)
    if not concat:
        return lambda x, w, b=None, z=None: (convolve(x, w, b, z),)
    concat, offset = int(concat), int(node.attr("concat_offset", 0))

    def into_concat(x, w, b=None, z=None, into=None):
        """Write the output's channels at ``offset`` of the concatenated tensor: ``into`` (filled by the
        convolutions before this one, see conv_fusions.fuse_concat_convs), or a new one for the first."""
        _, out_shape = resolve(x, w, b)
        shape = (out_shape[0], concat, *out_shape[2:])
        if into is None:
            into = np.empty(shape, dtype=x.dtype)
        elif into.shape != shape or into.dtype != x.dtype:
            raise InvalidArgumentError(
                f"node {node.name!r} (FusedConv into a Concat): the concatenation so far is {into.dtype}"
                f"{list(into.shape)}, this convolution's output {x.dtype}{list(out_shape)} needs "
                f"{x.dtype}{list(shape)}; the Concat's inputs must agree in every axis but 1"
            )
        target = into[:, offset:offset + out_shape[1]]
        if target.shape != out_shape:
            raise InvalidArgumentError(
                f"node {node.name!r} (FusedConv into a Concat): {out_shape[1]} output channels do not fit at "
                f"channel {offset} of the {concat} concatenated; the weights must keep the shape they were "
                f"fused with"
            )
        convolve(x, w, b, z, target)
        return (into,)

    return into_concat


def _appending(node, resolve, convolve):
    """A FusedConv that appends its output channels to ``so_far``, the channels a ConcatBuffer chain has
    filled (conv_fusions.fuse_dense_concats): written into the buffer behind them, the result being the
    view of every channel up to its own. Anything but such a view is concatenated as Concat would."""

    def append(x, w, b=None, z=None, so_far=None):
        _, out_shape = resolve(x, w, b)
        base, filled = so_far.base, so_far.shape[1]
        others = out_shape[:1] + out_shape[2:]  # the dimensions besides the channels
        if not (isinstance(base, np.ndarray) and base.ndim == so_far.ndim == 4 and base.flags.c_contiguous
                and base.dtype == so_far.dtype == x.dtype and base.shape[1] >= filled + out_shape[1]
                and so_far.shape[:1] + so_far.shape[2:] == base.shape[:1] + base.shape[2:] == others
                and so_far.strides == base.strides and so_far.ctypes.data == base.ctypes.data):
            return (np.concatenate([so_far, convolve(x, w, b, z)], axis=1),)
        convolve(x, w, b, z, base[:, filled:filled + out_shape[1]])
        return (base[:, :filled + out_shape[1]],)

    return append


@register("ConcatBuffer", domain=FUSED_DOMAIN, since=1)
def concat_buffer(node, shapes, opset):
    """x copied into a tensor with ``extra`` more channels (axis 1) behind it, returned as the view of x's
    channels: the start of a chain of appending FusedConv nodes (conv_fusions.fuse_dense_concats)."""
    extra = int(node.attr("extra", 0))

    def kernel(x):
        if x.ndim < 2:
            raise InvalidArgumentError(
                f"node {node.name!r} (ConcatBuffer): the input has shape {list(x.shape)}; channels (axis 1) "
                f"are appended, so it needs at least two dimensions"
            )
        buffer = np.empty((x.shape[0], x.shape[1] + extra, *x.shape[2:]), dtype=x.dtype)
        buffer[:, :x.shape[1]] = x
        return (buffer[:, :x.shape[1]],)

    return kernel


class _ChannelShuffle:
    """A FusedConv's channel shuffle (conv_fusions.fuse_channel_shuffle): its input x (N, C, H, W) is read
    as Reshape(x, (N, g, C/g, H, W)) -> Transpose(0, 2, 1, 3, 4) -> Reshape((N, C, H, W)), the node's
    ``shuffle_shape`` being the first shape; shuffled channel c is x's channel (c % g) * C/g + c // g."""

    def __init__(self, node):
        self.split = tuple(int(d) for d in node.attr("shuffle_shape"))
        n, groups, per_group, h, w = self.split
        self.shape = (n, groups * per_group, h, w)
        channels = np.arange(groups * per_group)
        self.source = ((channels % groups) * per_group + channels // groups).astype(np.uint64)

    def over(self, x):
        """This shuffle when x has the shape it was fused for (else None: apply it)."""
        return self if x.shape == self.shape else None

    def apply(self, x):
        """The shuffled tensor itself, as the three nodes compute it."""
        return np.reshape(x, self.split).transpose(0, 2, 1, 3, 4).reshape(self.shape)


class _TransposeWindow:
    """ConvTranspose geometry: output size, the pads cropped off the full scatter, per input shape."""

    def __init__(self, node, shapes):
        self.node = node
        self.window = _Window(node, shapes, needs_kernel=False)
        self.output_padding = node.attr("output_padding")
        self.output_shape = node.attr("output_shape")
        self._cache: dict[tuple, tuple] = {}

    def resolve(self, in_shape, kernel):
        key = (in_shape, kernel)
        if key not in self._cache:
            self._cache[key] = self._resolve(in_shape, kernel)
        return self._cache[key]

    def _resolve(self, in_shape, kernel):
        w = self.window
        rank = len(in_shape)
        w.check_rank(rank)
        strides = w.strides or (1,) * rank
        dilations = w.dilations or (1,) * rank
        extra = tuple(int(v) for v in self.output_padding) if self.output_padding is not None else (0,) * rank
        if len(extra) != rank:
            raise _graph_error(self.node, "output_padding", f"has {len(extra)} values; expected {rank}")
        full = tuple(s * (n - 1) + p + (k - 1) * d + 1
                     for s, n, p, k, d in zip(strides, in_shape, extra, kernel, dilations))
        target = None
        if self.output_shape is not None:
            target = tuple(int(v) for v in self.output_shape)[-rank:]
            if len(target) != rank:
                raise _graph_error(self.node, "output_shape", f"has {len(target)} values; expected {rank}")
        elif w.auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            target = tuple(n * s for n, s in zip(in_shape, strides))
        if target is not None:
            # Pads are derived from the requested output size; SAME_UPPER crops less at the start.
            totals = [f - t for f, t in zip(full, target)]
            if w.auto_pad == "SAME_UPPER":
                begin = tuple(t // 2 for t in totals)
            else:
                begin = tuple(t - t // 2 for t in totals)
            out = target
        else:
            pads = (0,) * (2 * rank) if w.auto_pad == "VALID" or w.pads is None else w.pads
            begin = pads[:rank]
            out = tuple(f - b - e for f, b, e in zip(full, begin, pads[rank:]))
        if any(o < 1 for o in out):
            raise InvalidArgumentError(
                f"node {self.node.name!r} (ConvTranspose): pads crop the whole output {list(full)}; "
                f"expected a positive output size"
            )
        return tuple(strides), tuple(dilations), full, begin, out


@register("ConvTranspose", since=1)
def conv_transpose(node, shapes, opset):
    window = _TransposeWindow(node, shapes)
    group = _group(node)

    def kernel(x, w, b=None):
        _check_channels(node, x.shape[1], w.shape, group, transpose=True)
        in_shape, kshape = x.shape[2:], w.shape[2:]
        strides, dilations, full, begin, out = window.resolve(in_shape, kshape)
        dtype = _compute_dtype(x.dtype)
        n, c = x.shape[:2]
        m = w.shape[1] * group
        # Every input pixel times every kernel tap: (N, G, Mg*K, pixels), one matmul.
        xg = x.astype(dtype, copy=False).reshape(n, group, c // group, -1)
        wg = w.astype(dtype, copy=False).reshape(group, c // group, -1).transpose(0, 2, 1)
        cols = np.matmul(wg, xg).reshape(n, m, *kshape, *in_shape)
        # Scatter-add each tap into a buffer covering both the full result and the requested output.
        origin = tuple(max(0, -bg) for bg in begin)
        size = tuple(o + max(f, bg + t) for o, f, bg, t in zip(origin, full, begin, out))
        buf = np.zeros((n, m, *size), dtype=dtype)
        for offset in np.ndindex(*kshape):
            index = tuple(
                slice(o + k * d, o + k * d + (i - 1) * s + 1, s)
                for o, k, d, i, s in zip(origin, offset, dilations, in_shape, strides)
            )
            buf[(Ellipsis, *index)] += cols[(slice(None), slice(None), *offset)]
        crop = tuple(slice(o + bg, o + bg + t) for o, bg, t in zip(origin, begin, out))
        y = buf[(Ellipsis, *crop)]
        if b is not None:
            y = y + _channel_param(b, y.ndim, dtype)
        return (np.ascontiguousarray(y).astype(x.dtype, copy=False),)

    return kernel


# -- pooling -------------------------------------------------------------------------------------


def _lowest(dtype: np.dtype):
    return np.iinfo(dtype).min if np.issubdtype(dtype, np.integer) else -np.inf


def _max_pool_with_indices(geo: _Geometry, xp: np.ndarray, x_shape, column_major: bool):
    """Max and its flat index into the unpadded input, row-major (or column-major over spatial dims)."""
    n, c = x_shape[:2]
    rank = len(geo.kernel)
    flat = geo.windows(xp).reshape(n, c, -1, *geo.out)
    arg = flat.argmax(axis=2)
    y = np.take_along_axis(flat, arg[:, :, None], axis=2)[:, :, 0]
    taps = np.unravel_index(arg, geo.kernel)
    spatial = np.zeros(arg.shape, dtype=np.int64)
    order = range(rank - 1, -1, -1) if column_major else range(rank)
    for i in order:
        grid = np.arange(geo.out[i]).reshape((-1,) + (1,) * (rank - 1 - i))
        pos = grid * geo.strides[i] - geo.begin[i] + taps[i] * geo.dilations[i]
        pos = np.clip(pos, 0, geo.in_shape[i] - 1)  # only an all-padding window could point outside
        spatial = spatial * geo.in_shape[i] + pos
    planes = np.arange(n * c, dtype=np.int64).reshape((n, c) + (1,) * rank) * math.prod(geo.in_shape)
    return y, planes + spatial


def _pool_loops():
    """The compiled pooling loops; imported by the op factories, so numba loads only for models that pool."""
    from ..compiled import pooling

    return pooling


def _compiled_pool(loops, x: np.ndarray, geo: _Geometry, include_pad: bool | None = None):
    """Max pooling (``include_pad`` None) or average pooling of ``x`` by the compiled loops, which
    take float32/float64 with 1-D or 2-D windows (a 1-D window is a 2-D one over a single row);
    None where they do not apply."""
    rank = len(geo.kernel)
    if rank > 2 or not takes_compiled(x) or x.size == 0 or 0 in geo.out:
        return None
    fields = (geo.kernel, geo.strides, geo.dilations, geo.begin, geo.end, geo.in_shape)
    if rank == 1:
        fields = tuple((unit, *field) for unit, field in zip((1, 1, 1, 0, 0, 1), fields))
    (kh, kw), (sh, sw), (dh, dw), (ph, pw), (eh, ew), (h, w) = fields
    planes = np.ascontiguousarray(x).reshape(-1, h, w)
    y = np.empty(x.shape[:2] + geo.out, dtype=x.dtype)
    rows = y.reshape(planes.shape[0], -1, y.shape[-1])
    # The positions an average counts, in padded coordinates: the input, plus the declared pads
    # with count_include_pad; a ceil_mode overhang never counts.
    (lo_h, hi_h), (lo_w, hi_w) = (
        (0, p + n + e) if include_pad else (p, p + n) for p, n, e in ((ph, h, eh), (pw, w, ew))
    )
    arguments = (kh, kw, sh, sw, dh, dw, ph, pw, include_pad is None, lo_h, hi_h, lo_w, hi_w)
    spans = _thread_spans(planes.shape[0], x.size, x.dtype)
    if spans is None:
        loops.pool_2d(planes, rows, *arguments)
    else:
        from ..compiled import jobs, workers

        workers.run(jobs.POOL, [(planes[a:b], rows[a:b], *arguments) for a, b in spans], helper_count())
    return y


# Below this much work (input elements; times taps for a depthwise convolution) a kernel split by
# planes or channels (pooling, normalization, depthwise convolution) stays on one thread.
_SPLIT_ELEMENTS = 1 << 16


def _thread_spans(count: int, elements: int, dtype) -> tuple[tuple[int, int], ...] | None:
    """``count`` independent rows (planes, channels) split evenly across the kernel threads, for a
    float32 kernel that runs as a job of compiled/jobs.py (on the helper threads of workers.py, or on
    this one alone: one span when the work is small or there is one thread). None where the jobs do
    not run (other dtypes, hosts without the packed convolution): the caller calls its loop itself.
    Kept per (count, size, threads): building the spans cost ~3 us per call, paid by every run."""
    if dtype != np.float32:
        return None
    threads = kernel_threads()
    key = (count, elements >= _SPLIT_ELEMENTS, threads)
    found = _spans.get(key, False)
    if found is False:
        from ..compiled import gemm

        found = None
        if gemm.AVAILABLE:
            parts = min(threads, count) if key[1] else 1
            bounds = [count * t // max(parts, 1) for t in range(max(parts, 1) + 1)]
            found = tuple((a, b) for a, b in zip(bounds, bounds[1:]) if b > a) or ((0, count),)
        _spans[key] = found
    return found


_spans: dict[tuple, tuple | None] = {}


def _span_bounds(spans: tuple[tuple[int, int], ...]) -> np.ndarray:
    """The spans as part i from bounds[i] to bounds[i + 1] (int64), the form compiled posters take."""
    found = _bounds.get(spans)
    if found is None:
        found = _bounds[spans] = np.array([first for first, _ in spans] + [spans[-1][1]], dtype=np.int64)
    return found


_bounds: dict[tuple, np.ndarray] = {}


@register("MaxPool", since=1)
def max_pool(node, shapes, opset):
    window = _Window(node, shapes, needs_kernel=True)
    storage_order = int(node.attr("storage_order", 0))
    if storage_order not in (0, 1):
        raise _graph_error(node, "storage_order", f"is {storage_order}; expected 0 (row major) or 1")
    with_indices = _wants(node, 1)
    loops = None if with_indices else _pool_loops()

    def kernel(x):
        geo = window.resolve(x.shape[2:])
        if with_indices:
            xp = geo.pad(x, _lowest(x.dtype))
            return _max_pool_with_indices(geo, xp, x.shape, column_major=storage_order == 1)
        y = _compiled_pool(loops, x, geo)
        return (geo.reduce_windows(x, np.maximum, _lowest(x.dtype)) if y is None else y,)

    return kernel


@register("AveragePool", since=1)
def average_pool(node, shapes, opset):
    window = _Window(node, shapes, needs_kernel=True)
    include_pad = bool(node.attr("count_include_pad", 0))
    loops = _pool_loops()

    def kernel(x):
        geo = window.resolve(x.shape[2:])
        y = _compiled_pool(loops, x, geo, include_pad)
        if y is not None:
            return (y,)
        xc = _upcast(x)
        total = geo.reduce_windows(xc, np.add, 0)
        total /= geo.divisor(include_pad, xc.dtype)
        return (total.astype(x.dtype, copy=False),)

    return kernel


def _lp_power(node) -> float:
    p = node.attr("p", 2)
    if p <= 0:
        raise _graph_error(node, "p", f"is {p}; expected a positive norm order")
    return p


def _lp_root(total: np.ndarray, p: float) -> np.ndarray:
    return np.sqrt(total) if p == 2 else np.power(total, 1.0 / p)


def _lp_terms(x: np.ndarray, p: float) -> np.ndarray:
    x = _upcast(x)
    return np.square(x) if p == 2 else np.power(np.abs(x), p)


@register("LpPool", since=1)
def lp_pool(node, shapes, opset):
    window = _Window(node, shapes, needs_kernel=True)
    p = _lp_power(node)

    def kernel(x):
        geo = window.resolve(x.shape[2:])
        total = geo.reduce_windows(_lp_terms(x, p), np.add, 0)
        return (_lp_root(total, p).astype(x.dtype, copy=False),)

    return kernel


def _spatial_axes(x: np.ndarray) -> tuple[int, ...]:
    return tuple(range(2, x.ndim))


@register("GlobalAveragePool", since=1)
def global_average_pool(node, shapes, opset):
    loops = _pool_loops()

    def kernel(x):
        size = math.prod(x.shape[2:])
        if takes_compiled(x) and x.ndim > 2 and 0 < size <= loops.PLANE_SUM_LIMIT and x.size:
            y = np.empty(x.shape[:2] + (1,) * (x.ndim - 2), dtype=x.dtype)
            loops.plane_means(np.ascontiguousarray(x).reshape(-1, size), y.reshape(-1), size)
            return (y,)
        y = x.mean(axis=_spatial_axes(x), keepdims=True, dtype=_compute_dtype(x.dtype))
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("GlobalMaxPool", since=1)
def global_max_pool(node, shapes, opset):
    return lambda x: (x.max(axis=_spatial_axes(x), keepdims=True),)


@register("GlobalLpPool", since=1)
def global_lp_pool(node, shapes, opset):
    p = _lp_power(node)

    def kernel(x):
        total = _lp_terms(x, p).sum(axis=_spatial_axes(x), keepdims=True)
        return (_lp_root(total, p).astype(x.dtype, copy=False),)

    return kernel


# -- normalization -------------------------------------------------------------------------------


def _affine_params(mean, var, scale, bias, epsilon, dtype):
    """The factor and shift that turn scale * (x - mean) / sqrt(var + epsilon) + bias into one
    multiply-add over x."""
    factor = scale / np.sqrt(var + dtype.type(epsilon))
    return factor, bias - mean * factor


def _affine_normalize(x, mean, var, scale, bias, epsilon, dtype):
    factor, shift = _affine_params(mean, var, scale, bias, epsilon, dtype)
    return x.astype(dtype, copy=False) * factor + shift


def _per_channel_affine(x: np.ndarray, factor: np.ndarray, shift: np.ndarray, dtype) -> np.ndarray:
    """x * factor + shift for (C,) parameters, over x viewed as (N, C, pixels): two passes
    without temporaries, each broadcasting a channel's value along its contiguous pixels."""
    n, c = x.shape[:2]
    y = np.multiply(x.astype(dtype, copy=False).reshape(n, c, math.prod(x.shape[2:])), factor.reshape(c, 1))
    y += shift.reshape(c, 1)
    return y.reshape(x.shape)


def _batch_norm_stats(x, axes, mean, var, momentum, dtype):
    """Batch mean/variance and the running statistics updated with them (training mode)."""
    xc = x.astype(dtype, copy=False)
    batch_mean = xc.mean(axis=axes, keepdims=True)
    batch_var = xc.var(axis=axes, keepdims=True)
    running_mean = mean * momentum + batch_mean.reshape(mean.shape) * (1 - momentum)
    running_var = var * momentum + batch_var.reshape(var.shape) * (1 - momentum)
    return batch_mean, batch_var, running_mean, running_var


def _channel_affine_loop(code):
    """``affine(x, factor, shift)``: x * factor + shift for (C,) parameters, then the activation
    ``code`` = (kind, params), in one compiled pass (float32/float64 ``x``; numba loads on the first call)."""
    kind, params = code
    arguments = {np.dtype(t): np.array(params, dtype=t) for t in (np.float32, np.float64)}

    def affine(x, factor, shift):
        from ..compiled import epilogue

        n, c = x.shape[:2]
        rows = np.ascontiguousarray(x).reshape(n, c, math.prod(x.shape[2:]))
        y = np.empty_like(rows)
        factor = np.ascontiguousarray(factor, dtype=x.dtype)
        shift = np.ascontiguousarray(shift, dtype=x.dtype)
        spans = _thread_spans(c, x.size, x.dtype) if n == 1 else None  # one image: its channels are contiguous
        if spans is None:
            epilogue.channel_affine(rows, factor, shift, y, kind, arguments[x.dtype])
        else:
            from ..compiled import jobs, workers

            workers.run(jobs.AFFINE, [(rows[:, a:b], factor[a:b], shift[a:b], y[:, a:b], kind, arguments[x.dtype])
                                      for a, b in spans], helper_count())
        return y.reshape(x.shape)

    return affine


def _batch_norm_kernel(node, training: bool, spatial: bool, fused_activation: bool = False):
    """BatchNormalization returning as many outputs as the node lists.

    Training mode normalizes with the batch statistics and returns the updated running mean/var
    (and, before opset 14, the batch mean/var). Inference mode passes the running statistics
    through for any optional outputs listed, as they do not change; for float32/float64 it is one
    compiled pass. With ``fused_activation`` (FusedBatchNormalization) it also applies the node's
    activation (inside that pass when compiled).
    """
    epsilon = float(node.attr("epsilon", 1e-5))
    momentum = float(node.attr("momentum", 0.9))
    n_outputs = len(node.outputs)
    prepared = _Prepared()
    activate = _in_place_activation(node) if fused_activation else None  # validates the activation
    affine = _channel_affine_loop(_activation_code(node) if fused_activation else (0, [0.0, 0.0]))

    def inference(x, scale, bias, mean, var):
        dtype = _compute_dtype(x.dtype)
        if x.ndim >= 2 and all(p.shape == (x.shape[1],) for p in (scale, bias, mean, var)):
            factor, shift = prepared.get(dtype, (scale, bias, mean, var), lambda: _affine_params(
                *(p.astype(dtype, copy=False) for p in (mean, var, scale, bias)), epsilon, dtype))
            if takes_compiled(x):
                return affine(x, factor, shift)
            y = _per_channel_affine(x, factor, shift, dtype)
        else:
            s, b, mu, v = (_channel_param(p, x.ndim, dtype) for p in (scale, bias, mean, var))
            y = _affine_normalize(x, mu, v, s, b, epsilon, dtype)
        y = y.astype(x.dtype, copy=False)
        if activate is not None:
            activate(y)
        return y

    def kernel(x, scale, bias, mean, var):
        if not training:
            y = inference(x, scale, bias, mean, var)
            return (y, mean, var, mean, var)[:n_outputs]
        dtype = _compute_dtype(x.dtype)
        s, b = (_channel_param(p, x.ndim, dtype) for p in (scale, bias))
        axes = (0,) if not spatial else (0, *range(2, x.ndim))
        batch_mean, batch_var, run_mean, run_var = _batch_norm_stats(
            x, axes, mean.astype(dtype), var.astype(dtype), momentum, dtype)
        y = _affine_normalize(x, batch_mean[0], batch_var[0], s, b, epsilon, dtype)
        outputs = (y, run_mean, run_var, batch_mean.reshape(mean.shape), batch_var.reshape(var.shape))
        return tuple(t.astype(x.dtype, copy=False) for t in outputs[:n_outputs])

    return kernel


@register("FusedBatchNormalization", domain=FUSED_DOMAIN, since=1)
def fused_batch_normalization(node, shapes, opset):
    """Inference BatchNormalization, then an activation in place on its fresh output."""
    normalize = _batch_norm_kernel(node, training=False, spatial=True, fused_activation=True)

    def kernel(x, scale, bias, mean, var):
        return normalize(x, scale, bias, mean, var)[:1]

    return kernel


def _lists_training_outputs(node) -> bool:
    return any(node.outputs[1:])


@register("BatchNormalization", since=1)
def batch_normalization_1(node, shapes, opset):
    # Before opset 14 training mode is implied by naming the optional statistics outputs (opset < 7
    # also requires is_test=0); plain inference ignores is_test, which old exporters left unset.
    training = _lists_training_outputs(node) and not int(node.attr("is_test", 0))
    return _batch_norm_kernel(node, training=training, spatial=bool(node.attr("spatial", 1)))


@register("BatchNormalization", since=9)
def batch_normalization_9(node, shapes, opset):
    return _batch_norm_kernel(node, training=_lists_training_outputs(node), spatial=True)


@register("BatchNormalization", since=14)
def batch_normalization_14(node, shapes, opset):
    return _batch_norm_kernel(node, training=bool(node.attr("training_mode", 0)), spatial=True)


def _standardize(x: np.ndarray, axes, epsilon: float):
    """(x - mean) * inv_std over ``axes`` (computed in x's dtype), with the mean and inv_std."""
    mean = x.mean(axis=axes, keepdims=True)
    centered = x - mean
    var = np.square(centered).mean(axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(var + x.dtype.type(epsilon))
    return centered * inv_std, mean, inv_std


@register("InstanceNormalization", since=1)
def instance_normalization(node, shapes, opset):
    epsilon = float(node.attr("epsilon", 1e-5))

    def kernel(x, scale, bias):
        dtype = _compute_dtype(x.dtype)
        normalized, _, _ = _standardize(x.astype(dtype, copy=False), _spatial_axes(x), epsilon)
        y = normalized * _channel_param(scale, x.ndim, dtype) + _channel_param(bias, x.ndim, dtype)
        return (y.astype(x.dtype, copy=False),)

    return kernel


def _broadcasts_into(shape: tuple, target: tuple) -> bool:
    """Whether an operand of ``shape`` broadcasts onto ``target`` without growing it (in-place safe)."""
    return len(shape) <= len(target) and all(d in (1, t) for d, t in zip(reversed(shape), reversed(target)))


def _row_sums(rows: np.ndarray) -> np.ndarray:
    """Sums of a 2-D array's rows as a column: a BLAS matrix-vector product, several times faster than
    numpy's reduction over short contiguous rows."""
    return rows @ np.ones((rows.shape[1], 1), dtype=rows.dtype)


def _standardize_rows(rows: np.ndarray, epsilon: float):
    """:func:`_standardize` over the rows of a 2-D float32/float64 array, in place on one fresh array:
    BLAS for the sums, no squared temporary."""
    count = rows.shape[1]
    mean = _row_sums(rows)
    mean /= count
    centered = np.subtract(rows, mean)
    var = np.einsum("ij,ij->i", centered, centered)[:, None]
    var /= count
    var += rows.dtype.type(epsilon)
    inv_std = np.reciprocal(np.sqrt(var, out=var), out=var)
    centered *= inv_std
    return centered, mean, inv_std


def _layer_norm_compiles(x, scale, bias, start: int, stash) -> bool:
    """Whether the compiled loop takes this LayerNormalization: statistics in x's own float32/float64,
    and scale and bias (if any) of x's dtype covering the normalized axes exactly (no broadcasting)."""
    if x.dtype != stash or not x.size or not takes_compiled(x):
        return False
    params = (scale,) if bias is None else (scale, bias)
    return all(p.dtype == x.dtype and p.shape == x.shape[start:] for p in params)


@register("LayerNormalization", since=17)
def layer_normalization(node, shapes, opset):
    epsilon = float(node.attr("epsilon", 1e-5))
    axis = int(node.attr("axis", -1))
    stash = _stash_dtype(node)
    n_outputs = len(node.outputs)
    from ..compiled import transformer as compiled

    def kernel(x, scale, bias=None):
        start = _normalize_axis(node, axis, x.ndim)
        stats_shape = x.shape[:start] + (1,) * (x.ndim - start)
        if _layer_norm_compiles(x, scale, bias, start, stash):
            rows = np.ascontiguousarray(x).reshape(math.prod(x.shape[:start]), -1)
            y, mean, inv_std = compiled.layer_norm(rows, np.ascontiguousarray(scale).reshape(-1),
                                                   None if bias is None else np.ascontiguousarray(bias).reshape(-1),
                                                   epsilon)
            return (y.reshape(x.shape), mean.reshape(stats_shape), inv_std.reshape(stats_shape))[:n_outputs]
        xs = x.astype(stash, copy=False)
        if stash in (np.float32, np.float64):
            rows = xs.reshape(math.prod(x.shape[:start]), math.prod(x.shape[start:]))
            normalized, mean, inv_std = _standardize_rows(rows, epsilon)
        else:  # half-precision statistics, as the spec computes them (numpy has no BLAS for them)
            normalized, mean, inv_std = _standardize(xs, tuple(range(start, x.ndim)), epsilon)
        # Scale and shift happen in x's precision, after casting back (the spec's second stage).
        y = normalized.astype(x.dtype, copy=False).reshape(x.shape)
        for param, apply in ((scale, np.multiply), (bias, np.add)):
            if param is not None:
                y = apply(y, param, out=y) if _broadcasts_into(param.shape, y.shape) else apply(y, param)
        return (y.astype(x.dtype, copy=False), mean.reshape(stats_shape), inv_std.reshape(stats_shape))[:n_outputs]

    return kernel


def _group_norm_kernel(node, per_group_params: bool, stash: np.dtype | None):
    epsilon = float(node.attr("epsilon", 1e-5))
    groups = node.attr("num_groups")
    if groups is None or int(groups) < 1:
        raise _graph_error(node, "num_groups", f"is {groups}; expected a positive group count")
    groups = int(groups)

    def kernel(x, scale, bias):
        n, c = x.shape[:2]
        if c % groups:
            raise InvalidArgumentError(
                f"node {node.name!r} (GroupNormalization): {c} channels do not split into "
                f"num_groups={groups} equal groups"
            )
        grouped = x.astype(stash or _compute_dtype(x.dtype)).reshape(n, groups, -1)
        normalized, _, _ = _standardize(grouped, (2,), epsilon)
        normalized = normalized.reshape(x.shape).astype(x.dtype)
        if per_group_params:
            scale, bias = (np.repeat(p, c // groups) for p in (scale, bias))
        y = normalized * _channel_param(scale, x.ndim, x.dtype) + _channel_param(bias, x.ndim, x.dtype)
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("GroupNormalization", since=18)
def group_normalization_18(node, shapes, opset):
    # Opset 18 takes scale/bias per group and has no stash_type (half precision computes in float32).
    return _group_norm_kernel(node, per_group_params=True, stash=None)


@register("GroupNormalization", since=21)
def group_normalization_21(node, shapes, opset):
    return _group_norm_kernel(node, per_group_params=False, stash=_stash_dtype(node))


def _lrn_compiled(loops, x: np.ndarray, size: int, before: int, alpha: float, beta: float, bias: float) -> np.ndarray:
    """LRN with the denominator base from the compiled loop (the same bits as the numpy path:
    the scale and bias are rounded to x's dtype as numpy rounds Python floats), then numpy's
    vectorized power and division in place."""
    x3 = np.ascontiguousarray(x).reshape(x.shape[0], x.shape[1], -1)
    y = np.empty_like(x3)
    loops.lrn_base(x3, y, size, before, x.dtype.type(alpha / size), x.dtype.type(bias))
    np.power(y, beta, out=y)
    np.divide(x3, y, out=y)
    return y.reshape(x.shape)


@register("LRN", since=1)
def lrn(node, shapes, opset):
    size = node.attr("size")
    if size is None or int(size) < 1:
        raise _graph_error(node, "size", f"is {size}; expected a positive channel window size")
    size = int(size)
    alpha = float(node.attr("alpha", 1e-4))
    beta = float(node.attr("beta", 0.75))
    bias = float(node.attr("bias", 1.0))
    before = (size - 1) // 2  # the window over channels is [c - before, c - before + size)
    from ..compiled import lrn as loops  # numba loads only for models with LRN

    def kernel(x):
        if takes_compiled(x) and x.ndim >= 3 and x.size:
            return (_lrn_compiled(loops, x, size, before, alpha, beta, bias),)
        xc = _upcast(x)
        squares = np.zeros((x.shape[0], x.shape[1] + size - 1, *x.shape[2:]), dtype=xc.dtype)
        np.square(xc, out=squares[:, before:before + x.shape[1]])
        total = squares[:, : x.shape[1]].copy()
        for offset in range(1, size):
            total += squares[:, offset:offset + x.shape[1]]
        y = xc / np.power(bias + (alpha / size) * total, beta)
        return (y.astype(x.dtype, copy=False),)

    return kernel


# -- dropout -------------------------------------------------------------------------------------


@register("Dropout", since=1)
def dropout_1(node, shapes, opset):
    # Inference: the output is the input; is_test and ratio only matter for training.
    if _wants(node, 1):
        return lambda x: (x, np.ones(x.shape, dtype=x.dtype))
    return lambda x: (x,)


@register("Dropout", since=10)
def dropout_10(node, shapes, opset):
    if _wants(node, 1):
        return lambda x: (x, np.ones(x.shape, dtype=np.bool_))
    return lambda x: (x,)


@register("Dropout", since=12)
def dropout_12(node, shapes, opset):
    # ratio and training_mode became inputs; with training_mode true the drop is random. The mask
    # comes from numpy's MT19937 RandomState, so a seeded node draws the same mask as onnx's reference.
    seed = node.attr("seed")
    rng = np.random.RandomState(None if seed is None else int(seed) % 2**32)
    with_mask = _wants(node, 1)

    def kernel(x, ratio=None, training_mode=None):
        ratio = 0.5 if ratio is None else float(ratio)
        if training_mode is None or not bool(training_mode) or ratio == 0:
            return (x, np.ones(x.shape, dtype=np.bool_)) if with_mask else (x,)
        if not 0 <= ratio < 1:
            raise InvalidArgumentError(
                f"node {node.name!r} (Dropout): ratio {ratio} is outside [0, 1); feed a ratio below 1"
            )
        mask = rng.random_sample(x.shape) >= ratio
        y = (_upcast(x) * mask / (1 - ratio)).astype(x.dtype, copy=False)
        return (y, mask) if with_mask else (y,)

    return kernel


# -- shape and softmax family --------------------------------------------------------------------


@register("Flatten", since=1)
def flatten(node, shapes, opset):
    axis = int(node.attr("axis", 1))

    def kernel(x):
        if not -x.ndim <= axis <= x.ndim:
            raise InvalidArgumentError(
                f"node {node.name!r} (Flatten): axis {axis} is out of range for a rank-{x.ndim} input; "
                f"expected a value in [{-x.ndim}, {x.ndim}]"
            )
        split = axis % x.ndim if axis < 0 else axis
        return (x.reshape(math.prod(x.shape[:split]), math.prod(x.shape[split:])),)

    return kernel


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    """Softmax of float32 x along its last axis, up to _COMPILED_SOFTMAX elements: one compiled call
    (transformer.softmax_rows_float32_). Otherwise four passes over x: subtract the maximum into a fresh
    array, then exp, sum and scale in place. fmax ignores NaN where maximum is slow propagating it; a NaN
    still spreads over its row through the sum (in both)."""
    if x.dtype == np.float32 and axis == x.ndim - 1 and x.flags.c_contiguous and x.size <= _COMPILED_SOFTMAX:
        from ..compiled import transformer

        y = np.empty(x.shape, np.float32)
        transformer.softmax_rows_float32_(x.reshape(-1, x.shape[-1]), y.reshape(-1, x.shape[-1]))
        return y
    with np.errstate(invalid="ignore"):  # a row of -inf (fully masked) gives NaN, as the spec's formula does
        e = np.subtract(x, np.fmax.reduce(x, axis=axis, keepdims=True))
    np.exp(e, out=e)
    if axis == x.ndim - 1 and e.flags.c_contiguous:
        total = _row_sums(e.reshape(-1, x.shape[-1])).reshape(x.shape[:-1] + (1,))
    else:
        total = e.sum(axis=axis, keepdims=True)
    e *= np.reciprocal(total, out=total)
    return e


# Float32 softmaxes up to this many elements run one compiled call (a CNN's closing 1000 classes).
_COMPILED_SOFTMAX = 1 << 16


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - x.max(axis=axis, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=axis, keepdims=True))


def _hardmax(x: np.ndarray, axis: int) -> np.ndarray:
    y = np.zeros_like(x)
    np.put_along_axis(y, np.expand_dims(x.argmax(axis=axis), axis), 1, axis=axis)
    return y


def _along_axis(node, fn, default_axis: int, coerce_2d: bool):
    """Apply ``fn(x, axis)`` per axis (opset 13+) or over the input flattened to 2-D at axis (<13)."""
    axis = int(node.attr("axis", default_axis))

    def kernel(x):
        if x.size == 0:
            return (x,)
        a = _normalize_axis(node, axis, x.ndim)
        xc = _upcast(x)
        if coerce_2d:
            y = fn(xc.reshape(math.prod(x.shape[:a]), -1), 1).reshape(x.shape)
        else:
            y = fn(xc, a)
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("Softmax", since=1)
def softmax_1(node, shapes, opset):
    return _along_axis(node, _softmax, 1, coerce_2d=True)


@register("Softmax", since=13)
def softmax_13(node, shapes, opset):
    return _along_axis(node, _softmax, -1, coerce_2d=False)


@register("LogSoftmax", since=1)
def log_softmax_1(node, shapes, opset):
    return _along_axis(node, _log_softmax, 1, coerce_2d=True)


@register("LogSoftmax", since=13)
def log_softmax_13(node, shapes, opset):
    return _along_axis(node, _log_softmax, -1, coerce_2d=False)


@register("Hardmax", since=1)
def hardmax_1(node, shapes, opset):
    return _along_axis(node, _hardmax, 1, coerce_2d=True)


@register("Hardmax", since=13)
def hardmax_13(node, shapes, opset):
    return _along_axis(node, _hardmax, -1, coerce_2d=False)


# -- Gelu ----------------------------------------------------------------------------------------


def _gelu_erf(x: np.ndarray) -> np.ndarray:
    """0.5 * x * (1 + erf(x / sqrt(2))); below float64, in float32 and in place on erf's fresh result."""
    if x.dtype == np.float64:
        return 0.5 * x * (1 + erf_float64(x / math.sqrt(2)))
    xc = _upcast(x)
    y = erf_float32(xc, scale=1 / math.sqrt(2))
    y += np.float32(1)
    y *= xc
    y *= np.float32(0.5)
    return y


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    """0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3))), in place over one fresh array."""
    xc = _upcast(x)
    dtype = xc.dtype.type
    y = np.square(xc, out=np.empty_like(xc))
    y *= dtype(math.sqrt(2 / math.pi) * 0.044715)
    y += dtype(math.sqrt(2 / math.pi))
    y *= xc
    np.tanh(y, out=y)
    y += dtype(1)
    y *= xc
    y *= dtype(0.5)
    return y


def _gelu_series(approximate: str, dtype) -> np.ndarray | None:
    """Coefficients (lowest first) of the odd series u * P(u^2) whose tanh both Gelu kernels above take,
    for the compiled loops; None where the numpy kernel runs (other dtypes, float64's erf)."""
    if dtype == np.float32 and approximate == "none":
        return np.array(_scaled_coefficients(1 / math.sqrt(2)), np.float32)
    if dtype in (np.float32, np.float64) and approximate == "tanh":
        return np.array([math.sqrt(2 / math.pi), math.sqrt(2 / math.pi) * 0.044715], dtype)
    return None


@register("Gelu", since=20)
def gelu(node, shapes, opset):
    approximate = node.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise _graph_error(node, "approximate", f"is {approximate!r}; expected 'none' or 'tanh'")
    fn = _gelu_erf if approximate == "none" else _gelu_tanh
    from ..compiled import transformer as compiled

    # The compiled loops: float32 in one pass (with its own vectorized exp), float64 in three (numpy's ~18).
    series = {np.dtype(t): _gelu_series(approximate, t) for t in (np.float32, np.float64)}

    def kernel(x):
        coefficients = series.get(x.dtype)
        if coefficients is not None and x.size:
            return (compiled.gelu(compiled.as_rows(x), coefficients).reshape(x.shape),)
        with np.errstate(over="ignore", invalid="ignore"):  # huge |x| overflows; -inf * 0 is NaN as specified
            return (fn(x).astype(x.dtype, copy=False),)

    return kernel
