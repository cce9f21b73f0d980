"""MaxPool, AveragePool, LpPool and the global pools: compiled loops where they apply
(algorithms/pooling.py), else windows folded one spatial dim at a time (algorithms/window.py).
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime import budget
from onnx_runtime.errors import InvalidArgumentError

from ..algorithms.pooling import (
    KeptPool,
    SmallMaxPool,
    bound_pool,
    compiled_pool,
    lowest,
    max_pool_with_indices,
    pool_loops,
)
from ..algorithms.precision import compute_dtype, upcast
from ..algorithms.window import Window
from ..compiled import deferred
from ..compiled import takes as takes_compiled
from ..registry import register
from ._common import graph_error, spatial_axes, wants_output

_SHAPES = 16  # input shapes a pool keeps its resolved path for; past that, it starts over


@register("MaxPool", since=1)
def max_pool(node, shapes, opset):
    window = Window(node, shapes, needs_kernel=True)
    storage_order = int(node.attr("storage_order", 0))
    if storage_order not in (0, 1):
        raise graph_error(node, "storage_order", f"is {storage_order}; expected 0 (row major) or 1")
    with_indices = wants_output(node, 1)
    loops = None if with_indices else pool_loops()
    small: dict = {}  # (shape, dtype) -> SmallMaxPool, or None where the compiled loop serves that input

    def kernel(x):
        if not with_indices:
            key = (x.shape, x.dtype)
            run = small.get(key, False)
            if run is False:
                run = _small_max_pool(node, window, x, small, key, loops)
            y = None if run is None else run(x)
            if y is not None:
                return (y,)
        geo = _resolved(node, window, x)
        if with_indices:
            xp = geo.pad(x, lowest(x.dtype))
            return max_pool_with_indices(geo, xp, x.shape, column_major=storage_order == 1)
        y = compiled_pool(loops, x, geo)
        return (geo.reduce_windows(x, np.maximum, lowest(x.dtype)) if y is None else y,)

    if not with_indices:  # a segment's bound plan (algorithms/segment_steps.py)
        kernel.bind = lambda inputs, outputs, constant: bound_pool(loops, inputs[0], _resolved(node, window, inputs[0]),
                                                                   None, outputs[0])
    return kernel


@register("AveragePool", since=1)
def average_pool(node, shapes, opset):
    window = Window(node, shapes, needs_kernel=True)
    if window.pads is not None and window.kernel is not None and window.auto_pad == "NOTSET":
        dilations = window.dilations or (1,) * len(window.kernel)
        reach = [(k - 1) * d + 1 for k, d in zip(window.kernel, dilations)]
        rank = len(window.kernel)
        if any(p >= reach[i % rank] for i, p in enumerate(window.pads)):
            # A window wholly in the padding averages nothing: 0/0 without count_include_pad.
            raise graph_error(node, "pads", f"is {list(window.pads)}; each pad must be smaller than the kernel's "
                                            f"extent {reach} along its axis")
    include_pad = bool(node.attr("count_include_pad", 0))
    loops = pool_loops()

    def kernel(x):
        geo = _resolved(node, window, x)
        y = compiled_pool(loops, x, geo, include_pad)
        if y is not None:
            return (y,)
        xc = upcast(x)
        total = geo.reduce_windows(xc, np.add, 0)
        total /= geo.divisor(include_pad, xc.dtype)
        return (total.astype(x.dtype, copy=False),)

    kernel.bind = lambda inputs, outputs, constant: bound_pool(loops, inputs[0], _resolved(node, window, inputs[0]),
                                                               include_pad, outputs[0])
    return kernel


def _small_max_pool(node, window: Window, x: np.ndarray, cache: dict, key: tuple, loops):
    """The taps path for ``x``'s shape and dtype, else the compiled loop's kept call (None: compiled_pool's),
    resolved and kept once per shape (not while numpy serves the loops: asked again at the next call)."""
    geo = _resolved(node, window, x)
    run = SmallMaxPool(geo) if SmallMaxPool.fits(x, geo) else KeptPool.of(loops, x, geo)
    if run is None and deferred.state.deferring:
        return None
    if len(cache) >= _SHAPES:
        cache.clear()
    cache[key] = run
    return run


def _resolved(node, window: Window, x: np.ndarray):
    """The window's geometry for ``x``, its output and padded input within the session's budget: pads and
    dilations size both from attributes, so a pad of 2**31 asked for gigabytes."""
    geo = window.resolve(x.shape[2:])
    if any(o < 1 for o in geo.out):
        raise InvalidArgumentError(f"node {node.name!r} ({node.op_type}): kernel_shape, strides, dilations and pads "
                                   f"leave no window along an axis of the input {x.shape} (output {geo.out})")
    lead = x.shape[:2]
    budget.check(max(math.prod((*lead, *geo.out)), math.prod(geo.padded_shape(x.shape))),
                 max(x.dtype.itemsize, 4), f"{node.op_type}'s output or padded input")
    return geo


def _lp_power(node) -> float:
    p = node.attr("p", 2)
    if p <= 0:
        raise graph_error(node, "p", f"is {p}; expected a positive norm order")
    return p


def _lp_root(total: np.ndarray, p: float) -> np.ndarray:
    return np.sqrt(total) if p == 2 else np.power(total, 1.0 / p)


def _lp_terms(x: np.ndarray, p: float) -> np.ndarray:
    x = upcast(x)
    return np.square(x) if p == 2 else np.power(np.abs(x), p)


@register("LpPool", since=1)
def lp_pool(node, shapes, opset):
    window = Window(node, shapes, needs_kernel=True)
    p = _lp_power(node)

    def kernel(x):
        geo = _resolved(node, window, x)
        total = geo.reduce_windows(_lp_terms(x, p), np.add, 0)
        return (_lp_root(total, p).astype(x.dtype, copy=False),)

    return kernel


@register("GlobalAveragePool", since=1)
def global_average_pool(node, shapes, opset):
    loops = pool_loops()

    def kernel(x):
        size = math.prod(x.shape[2:])
        if takes_compiled(x) and x.ndim > 2 and 0 < size <= loops.PLANE_SUM_LIMIT and x.size:
            y = np.empty(x.shape[:2] + (1,) * (x.ndim - 2), dtype=x.dtype)
            loops.plane_means(np.ascontiguousarray(x).reshape(-1, size), y.reshape(-1), size)
            return (y,)
        y = x.mean(axis=spatial_axes(x), keepdims=True, dtype=compute_dtype(x.dtype))
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("GlobalMaxPool", since=1)
def global_max_pool(node, shapes, opset):
    return lambda x: (x.max(axis=spatial_axes(x), keepdims=True),)


@register("GlobalLpPool", since=1)
def global_lp_pool(node, shapes, opset):
    p = _lp_power(node)

    def kernel(x):
        total = _lp_terms(x, p).sum(axis=spatial_axes(x), keepdims=True)
        return (_lp_root(total, p).astype(x.dtype, copy=False),)

    return kernel
