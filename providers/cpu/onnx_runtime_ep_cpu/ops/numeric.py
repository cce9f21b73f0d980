"""Numeric kernels: CumProd, Det, ReverseSequence, TensorScatter, LpNormalization, Shrink,
MeanVarianceNormalization and Swish.

Half-precision floats compute in float32 (algorithms/precision.py) and round back to the input type once.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import InvalidGraphError

from ..algorithms.precision import compute_dtype, upcast
from ..registry import register
from ._common import argument_error, normalize_axis, quiet


def _error(node, attr: str, message: str) -> InvalidGraphError:
    return InvalidGraphError(f"node {node.name!r} ({node.op_type}): attribute {attr!r} {message}")


# -- CumProd ----------------------------------------------------------------------------------------


@register("CumProd", since=26)
def cum_prod(node, shapes, opset):
    exclusive = bool(node.attr("exclusive", 0))
    reverse = bool(node.attr("reverse", 0))

    def kernel(x, axis):
        if axis.size != 1:
            raise argument_error(node, f"axis has shape {axis.shape}; expected a scalar")
        ax = normalize_axis(node, int(axis.reshape(())), max(x.ndim, 1))
        data = upcast(x)
        if reverse:
            data = np.flip(data, ax)
        # dtype= keeps int32 from widening to the platform integer.
        y = np.cumprod(data, axis=ax, dtype=data.dtype)
        if exclusive:  # shift by one along the axis, the product of nothing (1) first
            y = np.concatenate([np.ones_like(np.take(y, [0], axis=ax)), np.delete(y, -1, axis=ax)], axis=ax)
        if reverse:
            y = np.flip(y, ax)
        return (np.ascontiguousarray(y).astype(x.dtype, copy=False),)

    return kernel


# -- Det --------------------------------------------------------------------------------------------


# Det-22 only adds bfloat16.
@register("Det", since=11)
def det(node, shapes, opset):
    def kernel(x):
        if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
            raise argument_error(node, f"input has shape {x.shape}; expected [*, M, M]")
        return (np.asarray(np.linalg.det(upcast(x))).astype(x.dtype, copy=False),)

    return kernel


# -- ReverseSequence --------------------------------------------------------------------------------


# ReverseSequence-28 only adds types.
@register("ReverseSequence", since=10)
def reverse_sequence(node, shapes, opset):
    time_axis = int(node.attr("time_axis", 0))
    batch_axis = int(node.attr("batch_axis", 1))
    if time_axis not in (0, 1):
        raise _error(node, "time_axis", f"is {time_axis}; expected 0 or 1")
    if batch_axis not in (0, 1) or batch_axis == time_axis:
        raise _error(node, "batch_axis", f"is {batch_axis}; expected 0 or 1, unlike time_axis ({time_axis})")

    def kernel(x, sequence_lens):
        if x.ndim < 2:
            raise argument_error(node, f"input has shape {list(x.shape)}; expected rank 2 or more (time and batch "
                                       f"axes {time_axis} and {batch_axis})")
        steps, batch = x.shape[time_axis], x.shape[batch_axis]
        lens = sequence_lens.reshape(-1).astype(np.int64)
        if lens.shape != (batch,) or np.any((lens < 0) | (lens > steps)):
            raise argument_error(
                node, f"sequence_lens {lens.tolist()} must hold {batch} lengths in [0, {steps}]"
            )
        # Source time index of every (time, batch) output position: reversed within the length.
        t = np.arange(steps)[:, None]
        source = np.where(t < lens[None, :], lens[None, :] - 1 - t, t)
        if time_axis == 1:
            source = source.T
        index = source.reshape(source.shape + (1,) * (x.ndim - 2))
        return (np.take_along_axis(x, index, axis=time_axis),)

    return kernel


# -- TensorScatter ----------------------------------------------------------------------------------


@register("TensorScatter", since=24)
def tensor_scatter(node, shapes, opset):
    mode = node.attr("mode", "linear")
    if mode not in ("linear", "circular"):
        raise _error(node, "mode", f"is {mode!r}; expected 'linear' or 'circular'")
    axis_attr = int(node.attr("axis", -2))

    def kernel(past_cache, update, write_indices=None):
        rank = past_cache.ndim
        axis = normalize_axis(node, axis_attr, rank)
        if axis == 0:
            raise _error(node, "axis", f"is {axis_attr}, the batch dimension; expected a sequence dimension")
        if update.ndim != rank or any(u != p for i, (u, p) in enumerate(zip(update.shape, past_cache.shape))
                                      if i != axis):
            raise argument_error(
                node, f"update {update.shape} must match past_cache {past_cache.shape} outside axis {axis}"
            )
        batch, length, capacity = past_cache.shape[0], update.shape[axis], past_cache.shape[axis]
        starts = np.zeros(batch, np.int64) if write_indices is None else write_indices.reshape(-1).astype(np.int64)
        positions = starts[:, None] + np.arange(length)[None, :]  # (batch, length)
        if mode == "circular":
            positions %= capacity
        elif np.any(starts < 0) or np.any(positions >= capacity):
            raise argument_error(
                node, f"write_indices {starts.tolist()} plus {length} updates overrun the cache length {capacity}"
            )
        shape = (batch,) + (1,) * (axis - 1) + (length,) + (1,) * (rank - axis - 1)
        index = np.broadcast_to(positions.reshape(shape), update.shape)
        present = past_cache.copy()
        np.put_along_axis(present, index, update, axis=axis)
        return (present,)

    return kernel


# -- LpNormalization, MeanVarianceNormalization -----------------------------------------------------


# LpNormalization-22 defines a zero norm to give zeros (and adds bfloat16); that is the one behaviour here.
@register("LpNormalization", since=1)
def lp_normalization(node, shapes, opset):
    p = int(node.attr("p", 2))
    if p not in (1, 2):
        raise _error(node, "p", f"is {p}; expected 1 or 2")
    axis_attr = int(node.attr("axis", -1))

    def kernel(x):
        axis = normalize_axis(node, axis_attr, x.ndim)
        xc = upcast(x)
        if p == 1:
            norm = np.sum(np.abs(xc), axis=axis, keepdims=True)
        else:
            norm = np.sqrt(np.sum(xc * xc, axis=axis, keepdims=True))
        y = np.divide(xc, norm, out=np.zeros_like(xc), where=norm != 0)
        return (y.astype(x.dtype, copy=False),)

    return kernel


# The MeanVarianceNormalization function body's epsilon, added to the standard deviation.
_MVN_EPSILON = 1e-9


# MeanVarianceNormalization-13 only adds bfloat16.
@register("MeanVarianceNormalization", since=9)
def mean_variance_normalization(node, shapes, opset):
    axes_attr = [int(a) for a in node.attr("axes", [0, 2, 3])]

    def kernel(x):
        axes = tuple(sorted({normalize_axis(node, a, x.ndim) for a in axes_attr}))
        xc = upcast(x)
        centred = xc - np.mean(xc, axis=axes, keepdims=True)
        std = np.sqrt(np.mean(centred * centred, axis=axes, keepdims=True))
        return ((centred / (std + xc.dtype.type(_MVN_EPSILON))).astype(x.dtype, copy=False),)

    return kernel


# -- Shrink, Swish ----------------------------------------------------------------------------------


@register("Shrink", since=9)
def shrink(node, shapes, opset):
    lambd = float(node.attr("lambd", 0.5))
    bias = float(node.attr("bias", 0.0))

    def kernel(x):
        # Integer inputs compare and shift in float64 (exact for the attribute values) and cast back.
        dtype = compute_dtype(x.dtype) if x.dtype.kind == "f" else np.dtype(np.float64)
        xc = x.astype(dtype, copy=False)
        low, high, shift = dtype.type(-lambd), dtype.type(lambd), dtype.type(bias)
        y = np.where(xc < low, xc + shift, np.where(xc > high, xc - shift, dtype.type(0)))
        return (y.astype(x.dtype, copy=False),)

    return kernel


_silu_loop: list = [None]  # compiled/silu.py's loop, imported on the first float32 Swish


@register("Swish", since=24)
def swish(node, shapes, opset):
    alpha = float(node.attr("alpha", 1.0))

    @quiet  # exp overflows to inf for large negative inputs, giving the correct limit 0
    def kernel(x):
        if isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous:
            # one pass instead of numpy's four over memory (EfficientNet's batch-sized maps)
            loop = _silu_loop[0]
            if loop is None:
                from ..compiled.silu import silu_float32

                loop = _silu_loop[0] = silu_float32
            y = np.empty_like(x)
            loop(x.reshape(-1), y.reshape(-1), alpha)
            return (y,)
        xc = upcast(x)
        y = xc / (1 + np.exp(-xc.dtype.type(alpha) * xc))
        return (y.astype(x.dtype, copy=False),)

    return kernel
