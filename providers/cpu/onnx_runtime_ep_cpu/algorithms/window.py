"""Sliding-window geometry shared by convolution and pooling: :class:`Window` parses and validates a node's
window attributes and caches a :class:`Geometry` (pads and output size) per input shape; geometries pad
inputs, give strided window views (the im2col copy), and fold windows separably (pooling without pads).
"""

from __future__ import annotations

import math
from functools import reduce

import numpy as np
from numpy.lib.stride_tricks import as_strided
from onnx_runtime.windows import WindowAttributes


def strided_view(array: np.ndarray, shape, strides) -> np.ndarray:
    """A read-only view of ``array``'s memory with the given shape and strides: ``as_strided``,
    without its few microseconds of overhead when ``array`` can export its buffer directly."""
    if not array.flags.c_contiguous:
        return as_strided(array, shape, strides, writeable=False)
    view = np.ndarray(shape, array.dtype, array, 0, strides)
    view.flags.writeable = False
    return view


class Geometry:
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
        return strided_view(xp, xp.shape[:lead] + self.kernel + self.out, strides)

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


class Window(WindowAttributes):
    """The window attributes of a Conv/ConvTranspose/pooling node, with geometries cached per shape."""

    def __init__(self, node, shapes, *, needs_kernel: bool):
        super().__init__(node, needs_kernel=needs_kernel)
        rank = self._known_rank(shapes)
        if rank is not None:
            self.check_rank(rank)
        self._cache: dict[tuple, Geometry] = {}

    def _known_rank(self, shapes) -> int | None:
        if self.kernel is not None:
            return len(self.kernel)
        if shapes and shapes[0] is not None:
            return len(shapes[0]) - 2
        return None

    def resolve(self, in_shape: tuple[int, ...], kernel: tuple[int, ...] | None = None) -> Geometry:
        """The geometry for spatial input shape ``in_shape`` (``kernel`` from the weight when given)."""
        key = (in_shape, kernel)
        geometry = self._cache.get(key)
        if geometry is None:
            geometry = self._cache[key] = self._shared(tuple(in_shape), kernel)
        return geometry

    def _shared(self, in_shape: tuple[int, ...], kernel) -> Geometry:
        """The process's one Geometry for these attributes over this shape: a model's many convolutions and pools
        of one shape, and every later session of the model, build it once. A Geometry is read-only but for its
        divisor cache, whose arrays depend on the geometry alone."""
        key = (self.auto_pad, self.ceil_mode, self.kernel, self.strides, self.dilations, self.pads, in_shape,
               None if kernel is None else tuple(kernel))
        geometry = _GEOMETRIES.get(key)
        if geometry is None:  # (raises, naming this node, for attributes that do not fit the shape: never kept)
            geometry = Geometry(in_shape, *self.geometry(in_shape, kernel))
            if len(_GEOMETRIES) >= _GEOMETRIES_KEPT:
                _GEOMETRIES.clear()
            _GEOMETRIES[key] = geometry
        return geometry


_GEOMETRIES: dict[tuple, Geometry] = {}  # Window._shared's, bounded
_GEOMETRIES_KEPT = 4096
