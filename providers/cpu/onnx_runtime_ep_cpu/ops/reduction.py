"""Reductions: the Reduce* family, ArgMax/ArgMin and CumSum.

Reduce* ops take their axes from an attribute until an opset version (13 for ReduceSum, 18 for the
rest) and from an optional input afterwards, which also brings ``noop_with_empty_axes``. Narrow
floats (float16, bfloat16) accumulate in float32; results are cast back to the input dtype.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime.errors import InvalidArgumentError

from ..registry import register
from .view import normalize_axes, normalize_axis


def _widened(x):
    """``x`` in the dtype to accumulate in: float32 for narrow floats; other dtypes unchanged."""
    if x.dtype == np.float16 or x.dtype.kind == "V":  # ml_dtypes floats have kind "V"
        return x.astype(np.float32)
    return x


def _as_float(x):
    """``x`` as floats for mean, sqrt and log: integers go through float64."""
    return x.astype(np.float64) if x.dtype.kind in "iub" else _widened(x)


def _lowest(dtype):
    if dtype == np.bool_:
        return False
    return np.iinfo(dtype).min if dtype.kind in "iu" else -np.inf


def _highest(dtype):
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).max if dtype.kind in "iu" else np.inf


# The ufuncs' own reduce methods: np.sum/np.mean/np.max add several microseconds of Python-level
# dispatch per call, which dominates on the small tensors of a decode step.
def _sum(x, axes, keepdims):
    w = _widened(x)
    return np.add.reduce(w, axis=axes, keepdims=keepdims, dtype=w.dtype)  # ints keep their width


def _mean(x, axes, keepdims):
    w = _as_float(x)
    count = w.size if axes is None else math.prod(w.shape[a] for a in axes)
    total = np.add.reduce(w, axis=axes, keepdims=keepdims)
    if count == 0:
        return total * np.nan  # the mean of nothing: NaN, as onnx's reference gives
    total = np.asarray(total)
    total /= count
    return total


def _prod(x, axes, keepdims):
    w = _widened(x)
    return np.multiply.reduce(w, axis=axes, keepdims=keepdims, dtype=w.dtype)


def _max(x, axes, keepdims):
    # `initial` makes an empty reduction yield -inf (or the dtype's minimum) instead of raising.
    return np.maximum.reduce(x, axis=axes, keepdims=keepdims, initial=_lowest(x.dtype))


def _min(x, axes, keepdims):
    return np.minimum.reduce(x, axis=axes, keepdims=keepdims, initial=_highest(x.dtype))


def _l1(x, axes, keepdims):
    return _sum(np.abs(x), axes, keepdims)


def _sum_square(x, axes, keepdims):
    w = _widened(x)
    return _sum(w * w, axes, keepdims)


def _l2(x, axes, keepdims):
    w = _as_float(x)
    return np.sqrt(np.sum(w * w, axis=axes, keepdims=keepdims))


def _log_sum(x, axes, keepdims):
    return np.log(np.sum(_as_float(x), axis=axes, keepdims=keepdims))


def _log_sum_exp(x, axes, keepdims):
    w = _as_float(x)
    # Subtract the maximum so exp cannot overflow; an infinite or empty maximum is left out.
    peak = np.max(w, axis=axes, keepdims=True, initial=-np.inf)
    peak = np.where(np.isfinite(peak), peak, 0)
    out = np.log(np.sum(np.exp(w - peak), axis=axes, keepdims=True)) + peak
    return out if keepdims else np.squeeze(out, axis=axes)


# Reducers whose valid results include -inf/nan from log(0) and friends: numpy must not warn there.
_QUIET = {_log_sum, _log_sum_exp, _l2}

# op_type: (reducer, first opset whose axes come from an input)
_REDUCERS = {
    "ReduceSum": (_sum, 13),
    "ReduceMean": (_mean, 18),
    "ReduceProd": (_prod, 18),
    "ReduceMax": (_max, 18),
    "ReduceMin": (_min, 18),
    "ReduceL1": (_l1, 18),
    "ReduceL2": (_l2, 18),
    "ReduceSumSquare": (_sum_square, 18),
    "ReduceLogSum": (_log_sum, 18),
    "ReduceLogSumExp": (_log_sum_exp, 18),
}


def _check_axes_vector(axes) -> None:
    if axes is not None and np.ndim(axes) != 1:
        raise InvalidArgumentError(f"the axes input must be a 1-D tensor of axis indices; got one of shape "
                                   f"{np.shape(axes)}; pass the axes as a 1-D int64 tensor")


def _reduce(reducer, x, axes, keepdims, noop_with_empty_axes):
    _check_axes_vector(axes)
    if axes is None or len(axes) == 0:
        # No axes reduces every axis, or with noop_with_empty_axes none: each element is then
        # reduced alone (ReduceSumSquare squares it, ReduceLogSum takes its log), like onnx's reference.
        axes = () if noop_with_empty_axes else None
    else:
        axes = tuple(normalize_axes(axes, x.ndim))
    if reducer in _QUIET or x.size == 0:
        with np.errstate(all="ignore"):
            result = reducer(x, axes, keepdims)
    else:
        result = reducer(x, axes, keepdims)
    if isinstance(result, np.ndarray) and result.dtype == x.dtype:
        return result
    return np.asarray(result).astype(x.dtype, copy=False)


class _TrailingMeans:
    """ReduceMean/ReduceSum over the trailing axes of a C-contiguous float32/float64 tensor (a squeeze-and-excitation
    block's pooling, a decomposed normalization's statistics): one row per leading index, summed by the plane
    loop of compiled/pooling.py (as GlobalAveragePool) for rows up to its PLANE_SUM_LIMIT, else by numpy's
    pairwise sum over the 2-D view. The axes are normalized once per (shape, axes) signature."""

    def __init__(self, reducer, keepdims: bool):
        from ..algorithms.pooling import pool_loops

        self._loops, self._mean, self._keepdims = pool_loops(), reducer is _mean, keepdims
        self._plans: dict = {}  # (shape, axes' bytes or tuple) -> (rows, size, result shape) or None

    def plan(self, x, axes):
        key = (x.shape, axes.tobytes() if isinstance(axes, np.ndarray) else axes)
        found = self._plans.get(key, False)
        if found is False:
            _check_axes_vector(axes)  # once per signature: a kept plan was made for a 1-D axes of these values
            found = None
            if axes is not None and len(axes) and x.ndim:
                normalized = sorted(normalize_axes(axes, x.ndim))
                first = x.ndim - len(normalized)
                if normalized == list(range(first, x.ndim)) and first > 0:
                    rows, size = math.prod(x.shape[:first]), math.prod(x.shape[first:])
                    shape = x.shape[:first] + ((1,) * len(normalized) if self._keepdims else ())
                    found = (rows, size, shape) if rows and size else None
                elif normalized == list(range(normalized[0], normalized[-1] + 1)) and normalized[0] > 0:
                    found = self._middle(x.shape, normalized)
            if len(self._plans) < 64:
                self._plans[key] = found
        return found

    def _middle(self, shape: tuple, axes: list) -> tuple | None:
        """The plan of a block of adjacent axes between the first and the last (a channels-last map's spatial axes,
        transpose_sinking's): (rows, size, result shape, columns), the sum one reduce over the block as one axis of
        a (rows, size, columns) view, numpy's arithmetic over the same elements in the same order."""
        rows, size = math.prod(shape[:axes[0]]), math.prod(shape[axes[0]:axes[-1] + 1])
        columns = math.prod(shape[axes[-1] + 1:])
        result = shape[:axes[0]] + ((1,) * len(axes) if self._keepdims else ()) + shape[axes[-1] + 1:]
        return (rows, size, result, columns) if rows and size and columns else None

    def bind(self, x, axes, y):
        """``[(loop, arguments)]``: the plane loop's call for x into the C-contiguous ``y`` prepared once (a
        segment's bound plan), or None where it does not apply."""
        plan = self.plan(x, axes) if x.flags.c_contiguous else None
        if plan is None or len(plan) > 3 or plan[1] > self._loops.PLANE_SUM_LIMIT or y.shape != plan[2] \
                or y.dtype != x.dtype:
            return None
        rows, size, _ = plan
        return [(self._loops.plane_means, (x.reshape(rows, size), y.reshape(rows), size if self._mean else 1))]

    def __call__(self, x, plan):
        if len(plan) > 3:  # a middle block (_middle)
            rows, size, shape, columns = plan
            y = np.add.reduce(x.reshape(rows, size, columns), axis=1)
            if self._mean:
                y /= size
            return y.reshape(shape)
        rows, size, shape = plan
        flat = x.reshape(rows, size)
        if size <= self._loops.PLANE_SUM_LIMIT:
            y = np.empty(rows, dtype=x.dtype)
            self._loops.plane_means(flat, y, size if self._mean else 1)
        else:
            y = np.add.reduce(flat, axis=1)
            if self._mean:
                y /= size
        return y.reshape(shape)


def _trailing(reducer, keepdims: bool):
    """A _TrailingMeans for ReduceMean and ReduceSum, else None."""
    return _TrailingMeans(reducer, keepdims) if reducer in (_mean, _sum) else None


def _reducing(reducer, keepdims: bool, noop: bool):
    """``kernel(x, axes)``: the reduction, by _TrailingMeans where it applies."""
    trailing = _trailing(reducer, keepdims)
    takes = frozenset({np.dtype(np.float32), np.dtype(np.float64)})

    def kernel(x, axes):
        if trailing is not None and x.dtype in takes and x.flags.c_contiguous:
            plan = trailing.plan(x, axes)
            if plan is not None:
                return (trailing(x, plan),)
        return (_reduce(reducer, x, axes, keepdims, noop),)

    kernel.trailing = trailing
    return kernel


def _bindable(kernel, axes_of):
    """``kernel`` (a node's) with ``bind(inputs, outputs, constant)`` for a segment's bound plan: the trailing
    means' loop, the axes from ``axes_of(inputs)`` (constants only)."""
    trailing = kernel.trailing

    def bind(inputs, outputs, constant):
        axes = axes_of(inputs, constant)
        if trailing is None or axes is False or inputs[0].dtype not in (np.float32, np.float64):
            return None
        return trailing.bind(inputs[0], axes, outputs[0])

    return bind


def _attribute_axes_factory(reducer):
    def factory(node, shapes, opset):
        axes, keepdims = node.attr("axes"), bool(node.attr("keepdims", 1))
        kernel = _reducing(reducer, keepdims, False)
        axes = tuple(axes) if axes is not None else None

        def reduce(x):
            return kernel(x, axes)

        reduce.bind = _bindable(kernel, lambda inputs, constant: axes)
        return reduce

    return factory


def _input_axes_factory(reducer):
    def factory(node, shapes, opset):
        keepdims = bool(node.attr("keepdims", 1))
        noop = bool(node.attr("noop_with_empty_axes", 0))
        kernel = _reducing(reducer, keepdims, noop)

        def reduce(x, axes=None):
            return kernel(x, axes)

        # (axes fed at run time can change between runs: bound only where they are a constant)
        reduce.bind = _bindable(kernel, lambda inputs, constant: (
            inputs[1] if len(inputs) > 1 and inputs[1] is not None and constant[1] else False))
        return reduce

    return factory


for _op, (_reducer, _axes_input_since) in _REDUCERS.items():
    register(_op, since=1)(_attribute_axes_factory(_reducer))
    register(_op, since=_axes_input_since)(_input_axes_factory(_reducer))


def _arg_factory(find):
    def factory(node, shapes, opset):
        axis, keepdims = node.attr("axis", 0), bool(node.attr("keepdims", 1))
        last = bool(node.attr("select_last_index", 0))  # attribute added in opset 12

        def kernel(x):
            ax = normalize_axis(axis, x.ndim)
            if last:  # the first match in the reversed axis is the last one in the original
                index = (x.shape[ax] - 1) - find(np.flip(x, ax), axis=ax, keepdims=keepdims)
            else:
                index = find(x, axis=ax, keepdims=keepdims)
            return (np.asarray(index, dtype=np.int64),)

        return kernel

    return factory


register("ArgMax", since=1)(_arg_factory(np.argmax))
register("ArgMin", since=1)(_arg_factory(np.argmin))


@register("CumSum", since=11)
def cum_sum(node, shapes, opset):
    exclusive, reverse = bool(node.attr("exclusive", 0)), bool(node.attr("reverse", 0))

    def kernel(x, axis):
        ax = normalize_axis(np.asarray(axis).item(), x.ndim)
        values = np.flip(x, ax) if reverse else x
        out = np.cumsum(values, axis=ax, dtype=x.dtype)
        if exclusive:  # shift by one along the axis, starting from zero
            shifted = np.zeros_like(out)
            head, tail = [slice(None)] * x.ndim, [slice(None)] * x.ndim
            head[ax], tail[ax] = slice(None, -1), slice(1, None)
            shifted[tuple(tail)] = out[tuple(head)]
            out = shifted
        return (np.flip(out, ax) if reverse else out,)

    return kernel
