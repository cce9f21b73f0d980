"""Pad: constant, reflect, edge and wrap borders, negative pads as crops, layouts kept per input shape."""

from __future__ import annotations

import numpy as np
from onnx_runtime import budget
from onnx_runtime.errors import InvalidArgumentError

from ..registry import register
from ._common import frozen, graph_error
from .view import normalize_axes

_PAD_MODES = ("constant", "reflect", "edge")


def _pad_mode(node, opset):
    mode = node.attr("mode", "constant")
    allowed = _PAD_MODES + (("wrap",) if opset >= 19 else ())
    if mode not in allowed:
        raise graph_error(node, "mode", f"is {mode!r}; expected one of {allowed}")
    return mode


def _pad(x, pads, mode, value=0, axes=None):
    return _pad_layout(x.shape, pads, mode, axes, x.dtype.itemsize).apply(x, value)


class _PadLayout:
    """One Pad over one input shape: the crop of negative pads, then either the slice copies of the padded
    array's borders (see _pads_by_slices) or numpy.pad's widths. Built once per (shape, pads) and kept by
    the kernel while both stay."""

    __slots__ = ("crop", "width", "mode", "shape", "inner", "copies")

    def __init__(self, shape, begin, end, mode):
        # Negative pads remove elements: crop first, then pad with what is left.
        for axis, (dim, b, e) in enumerate(zip(shape, begin, end)):
            if max(-b, 0) + max(-e, 0) > dim:
                raise InvalidArgumentError(
                    f"Pad removes {max(-b, 0) + max(-e, 0)} elements of axis {axis}, which has {dim} (pads {b} and "
                    f"{e}); negative pads may remove at most the axis's elements")
        self.crop = tuple(slice(max(-b, 0), dim - max(-e, 0)) for dim, b, e in zip(shape, begin, end))
        if all(b >= 0 and e >= 0 for b, e in zip(begin, end)):
            self.crop = None
        kept = [len(range(dim)[c]) for dim, c in zip(shape, self.crop)] if self.crop else list(shape)
        self.width = [(max(b, 0), max(e, 0)) for b, e in zip(begin, end)]
        self.mode = mode
        self.copies = None
        if _pads_by_slices(kept, self.width, mode):
            self.shape = tuple(d + b + e for d, (b, e) in zip(kept, self.width))
            self.inner = tuple(slice(b, b + d) for d, (b, _) in zip(kept, self.width))
            self.copies = _border_copies(kept, self.width, mode, self.inner)

    def apply(self, x, value):
        if self.crop is not None:
            x = x[self.crop]
        if self.copies is None:
            if self.mode == "constant":
                fill = np.asarray(value, dtype=x.dtype).reshape(())
                return np.pad(x, self.width, mode="constant", constant_values=fill)
            return np.pad(x, self.width, mode=self.mode)
        return _pad_by_slices(x, self, value)


def _pad_layout(shape, pads, mode, axes=None, itemsize=8) -> _PadLayout:
    pads = np.asarray(pads).reshape(-1).tolist()
    rank = len(shape)
    axes = range(rank) if axes is None else normalize_axes(axes, rank)
    if len(pads) != 2 * len(axes):
        raise InvalidArgumentError(f"Pad got {len(pads)} pads for {len(axes)} axes; expected two per axis")
    begin, end = [0] * rank, [0] * rank
    for i, axis in enumerate(axes):
        begin[axis], end[axis] = pads[i], pads[i + len(axes)]
    budget.check_shape([d + b + e for d, b, e in zip(shape, begin, end)], itemsize, "Pad's output")
    return _PadLayout(shape, begin, end, mode)


def _pads_by_slices(shape, width, mode) -> bool:
    """Whether each border is one slice copy: reflect within the axis (pads < dim), wrap (pads <= dim),
    edge of a non-empty axis, or any constant. Wider reflections repeat; numpy.pad does those."""
    if mode == "constant":
        return True
    limit = {"reflect": -1, "wrap": 0, "edge": None}[mode]
    return all(dim > 0 and (limit is None or (b <= dim + limit and e <= dim + limit))
               for dim, (b, e) in zip(shape, width) if b or e)


def _pad_by_slices(x, layout: _PadLayout, value):
    """numpy.pad's result with one slice copy per border (``layout.copies``)."""
    out = np.empty(layout.shape, dtype=x.dtype)
    out[layout.inner] = x
    fill = np.asarray(value, dtype=x.dtype).reshape(()) if layout.mode == "constant" else None
    for dst, src in layout.copies:
        out[dst] = fill if src is None else out[src]
    return out


def _border_copies(shape, width, mode, inner) -> list:
    """(destination, source) index tuples of the padded array, axis by axis: an axis's borders span the
    already padded earlier axes, so corners come out as numpy.pad's; a constant's source is None."""
    copies = []
    for axis, (d, (b, e)) in enumerate(zip(shape, width)):
        lead, tail = (slice(None),) * axis, inner[axis + 1:]
        for dst, src in _border_sources(mode, d, b, e):
            copies.append(((*lead, dst, *tail), None if src is None else (*lead, src, *tail)))
    return copies


def _border_sources(mode, d, b, e):
    """(destination, source) slices along one axis of the padded array for its begin and end borders."""
    last = b + d - 1  # the input's last position in the padded array
    pairs = []
    if b:
        source = {"reflect": slice(2 * b, b, -1), "edge": slice(b, b + 1), "wrap": slice(last + 1 - b, last + 1),
                  "constant": None}[mode]
        pairs.append((slice(0, b), source))
    if e:
        stop = last - 1 - e
        source = {"reflect": slice(last - 1, None if stop < 0 else stop, -1), "edge": slice(last, last + 1),
                  "wrap": slice(b, b + e), "constant": None}[mode]
        pairs.append((slice(last + 1, last + 1 + e), source))
    return pairs


@register("Pad", since=1)
def pad_v1(node, shapes, opset):
    mode, pads, value = _pad_mode(node, opset), node.attr("paddings"), node.attr("value", 0.0)
    return lambda x: (_pad(x, pads, mode, value),)


@register("Pad", since=2)
def pad_v2(node, shapes, opset):
    mode, pads, value = _pad_mode(node, opset), node.attr("pads"), node.attr("value", 0.0)
    return lambda x: (_pad(x, pads, mode, value),)


@register("Pad", since=11)
def pad(node, shapes, opset):
    # pads and constant_value became inputs in 11; the optional axes input arrived in 18.
    mode = _pad_mode(node, opset)

    # Constant pads and axes (nearly always initializers): the last layout is kept for the same input shape.
    last: list = [((), None, None)]

    def kernel(x, pads, value=None, axes=None):
        held, shape, layout = last[0]
        if shape != x.shape or len(held) != 2 or held[0] is not pads or held[1] is not axes:
            layout = _pad_layout(x.shape, pads, mode, axes, x.dtype.itemsize)
            if frozen(pads) and frozen(axes):
                last[0] = ((pads, axes), x.shape, layout)
        return (layout.apply(x, 0 if value is None else value),)

    return kernel
