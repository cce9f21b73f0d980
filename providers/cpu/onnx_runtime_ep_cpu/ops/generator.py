"""Generators: Constant, ConstantOfShape, Range, EyeLike, and the random ops.

Random ops own a numpy Generator per node, created once at session creation: with a ``seed``
attribute a session's sequence of outputs is reproducible, and successive runs draw fresh values.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime import budget
from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from ..registry import register

# Constant's value attributes and how each becomes an array. Exactly one must be present.
_CONSTANT_VALUES = {
    "value": np.asarray,
    "sparse_value": np.asarray,  # the loader has already densified it
    "value_float": lambda v: np.array(v, dtype=np.float32),
    "value_floats": lambda v: np.array(v, dtype=np.float32).reshape(-1),
    "value_int": lambda v: np.array(v, dtype=np.int64),
    "value_ints": lambda v: np.array(v, dtype=np.int64).reshape(-1),
    "value_string": lambda v: np.array(v, dtype=object),
    "value_strings": lambda v: np.array(v, dtype=object).reshape(-1),
}


@register("Constant", since=1)
def constant(node, shapes, opset):
    present = [name for name in _CONSTANT_VALUES if name in node.attrs]
    if len(present) != 1:
        raise InvalidGraphError(
            f"node {node.name!r} (Constant): has value attributes {present}; expected exactly one of "
            f"{list(_CONSTANT_VALUES)}"
        )
    value = _CONSTANT_VALUES[present[0]](node.attrs[present[0]])
    return lambda: (value,)


@register("ConstantOfShape", since=9)
def constant_of_shape(node, shapes, opset):
    value = np.zeros(1, dtype=np.float32) if node.attr("value") is None else np.asarray(node.attr("value"))
    if value.size != 1:
        raise InvalidGraphError(
            f"node {node.name!r} (ConstantOfShape): attribute 'value' has {value.size} elements; "
            "expected a one-element tensor"
        )
    fill = value.reshape(-1)[0]

    def kernel(shape):
        if np.asarray(shape).dtype.kind not in "iu":
            raise InvalidArgumentError(f"node {node.name!r} (ConstantOfShape): shape must be int64, got "
                                       f"{np.asarray(shape).dtype}")
        dims = np.asarray(shape).reshape(-1).tolist()
        if any(d < 0 for d in dims):
            raise InvalidArgumentError(f"node {node.name!r} (ConstantOfShape): shape {dims} has a negative dimension")
        budget.check_shape(dims, fill.dtype.itemsize, "ConstantOfShape's output")
        return (np.full(dims, fill, dtype=fill.dtype),)

    return kernel


def _range(start, limit, delta, compute_dtype, span: int):
    """ONNX Range: output[i] = start + i * delta for i < max(ceil((limit - start) / delta), 0); ``span`` is that
    length from exact integers or float64 (_check_range), used as it is for integers."""
    dtype = start.dtype
    if dtype.kind in "iu" and np.dtype(compute_dtype).kind in "iu":
        # Integers (a mask's or position's Range, every run of a decode step): the exact count, and one numpy
        # call where no element can overflow (the general path's scalar arrays cost ten times the arithmetic)
        count = max(span, 0)
        first, step = start.item(), delta.item()
        if dtype.kind == "i" and abs(first) + abs(count * step) < 1 << (8 * dtype.itemsize - 2):
            return np.arange(first, first + count * step, step, dtype=dtype)
        start, delta = (np.asarray(v).reshape(()).astype(compute_dtype) for v in (start, delta))
    else:
        start, limit, delta = (np.asarray(v).reshape(()).astype(compute_dtype) for v in (start, limit, delta))
        count = max(int(np.ceil((limit - start) / delta)), 0)  # in the compute type, as the spec's float Range
    return (start + np.arange(count, dtype=compute_dtype) * delta).astype(dtype, copy=False)


def _check_range(node, start, limit, delta) -> int:
    """Range's inputs are scalars of one type; its length, from exact integers or float64, within the budget:
    returned."""
    if not start.dtype == limit.dtype == delta.dtype or start.size != 1 or limit.size != 1 or delta.size != 1:
        raise InvalidArgumentError(f"node {node.name!r} (Range): start, limit and delta must be scalars of one type, "
                                   f"got {start.dtype}{start.shape}, {limit.dtype}{limit.shape}, {delta.dtype}"
                                   f"{delta.shape}")
    first, end, step = (v.reshape(()).item() for v in (start, limit, delta))
    if step == 0:
        raise InvalidArgumentError(f"node {node.name!r} (Range): delta must be non-zero")
    if start.dtype.kind in "iu":
        span = -((first - end) // step)
    else:
        ratio = (float(end) - float(first)) / float(step)
        if not math.isfinite(ratio):
            raise InvalidArgumentError(f"node {node.name!r} (Range): start {first}, limit {end} and delta {step} "
                                       "give no finite length; expected finite values")
        span = math.ceil(ratio)
    # (the general path builds the values in a 64-bit or float compute type, with one temporary, before the cast)
    budget.check(max(span, 0), 2 * max(start.dtype.itemsize, 8), "Range's output and its working copies")
    return span


@register("Range", since=11)
def range_(node, shapes, opset):
    def kernel(start, limit, delta):
        span = _check_range(node, start, limit, delta)
        return (_range(start, limit, delta, start.dtype, span),)

    return kernel


@register("Range", since=27)
def range_stashed(node, shapes, opset):
    # stash_type=1 (the default) computes float16/bfloat16 ranges in float32.
    stash = bool(node.attr("stash_type", 1))

    def kernel(start, limit, delta):
        span = _check_range(node, start, limit, delta)
        narrow = start.dtype == np.float16 or start.dtype.kind == "V"
        return (_range(start, limit, delta, np.float32 if stash and narrow else start.dtype, span),)

    return kernel


def _dtype_attr(node, default=None):
    """The numpy dtype named by the node's 'dtype' attribute (an ONNX data type code)."""
    code = node.attr("dtype")
    if code is None:
        return default
    try:
        return DataType(int(code)).numpy
    except ValueError as exc:
        raise InvalidGraphError(
            f"node {node.name!r} ({node.op_type}): attribute 'dtype' is {code!r}; expected an ONNX tensor data type"
        ) from exc


@register("EyeLike", since=9)
def eye_like(node, shapes, opset):
    dtype, k = _dtype_attr(node), node.attr("k", 0)

    def kernel(x):
        rows, cols = x.shape
        return (np.eye(rows, cols, k, dtype=x.dtype if dtype is None else dtype),)

    return kernel


def _generator(node):
    seed = node.attr("seed")  # a float attribute; like onnxruntime, its integer part seeds
    return np.random.default_rng(None if seed is None else abs(int(seed)))


def _sampler(node):
    """``sample(shape, dtype)`` for RandomUniform(Like) and RandomNormal(Like)."""
    rng = _generator(node)
    if node.op_type.startswith("RandomUniform"):
        low, high = node.attr("low", 0.0), node.attr("high", 1.0)
        return lambda shape, dtype: rng.uniform(low, high, shape).astype(dtype)
    mean, scale = node.attr("mean", 0.0), node.attr("scale", 1.0)
    return lambda shape, dtype: rng.normal(mean, scale, shape).astype(dtype)


def _random_factory(node, shapes, opset):
    sample = _sampler(node)
    shape, dtype = tuple(node.attr("shape", ())), _dtype_attr(node, np.dtype(np.float32))
    return lambda: (sample(shape, dtype),)


def _random_like_factory(node, shapes, opset):
    sample, dtype = _sampler(node), _dtype_attr(node)
    return lambda x: (sample(x.shape, x.dtype if dtype is None else dtype),)


register("RandomUniform", since=1)(_random_factory)
register("RandomNormal", since=1)(_random_factory)
register("RandomUniformLike", since=1)(_random_like_factory)
register("RandomNormalLike", since=1)(_random_like_factory)


@register("Bernoulli", since=15)
def bernoulli(node, shapes, opset):
    rng, dtype = _generator(node), _dtype_attr(node)

    def kernel(probabilities):
        draws = rng.random(probabilities.shape) < probabilities
        return (draws.astype(probabilities.dtype if dtype is None else dtype),)

    return kernel
