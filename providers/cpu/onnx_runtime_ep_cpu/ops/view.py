"""Reshape, Flatten, Transpose, Squeeze and Unsqueeze: kernels that return a view of their input (kernels never
write into their inputs, so sharing the buffer is safe), and the axis normalization the other families share.
A family of their own so that a model whose only shape operators are these (a CNN's Flatten or Reshape before its
classifier) does not import shape.py's.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from ..registry import register
from ._common import frozen, shape_free


def normalize_axis(axis: int, rank: int) -> int:
    """``axis`` in [-rank, rank) as a non-negative axis."""
    axis = int(axis)
    if not -rank <= axis < rank:
        raise InvalidArgumentError(f"axis {axis} is out of range for a rank-{rank} tensor; expected [-{rank}, {rank})")
    return axis + rank if axis < 0 else axis


def normalize_axes(axes, rank: int) -> list[int]:
    """Each axis of ``axes`` (a list or 1-D array) made non-negative; duplicates are rejected."""
    if not isinstance(axes, (list, tuple)) and np.asarray(axes).dtype.kind not in "iu":
        raise InvalidArgumentError(f"axes must be integers (int64), got {np.asarray(axes).dtype} values")
    values = list(axes) if isinstance(axes, (list, tuple)) else np.asarray(axes).reshape(-1).tolist()
    result = [axis + rank if -rank <= axis < 0 else axis if 0 <= axis < rank else normalize_axis(axis, rank)
              for axis in values]
    if len(result) > 1 and len(set(result)) != len(result):
        raise InvalidArgumentError(f"axes {list(np.asarray(axes).reshape(-1))} contain a duplicate")
    return result



def reshape_to(x, shape, allowzero=False):
    # The shape is nearly always a 1-D int64 array; the generic conversion costs a microsecond more.
    if isinstance(shape, np.ndarray) and shape.ndim == 1:
        shape = shape.tolist()
    else:
        shape = np.asarray(shape).reshape(-1).tolist()
    if not allowzero and 0 in shape:  # 0 copies the input's dimension at that position
        if 0 in shape[x.ndim:]:
            raise InvalidArgumentError(f"Reshape's shape {shape} copies dimension {shape.index(0, x.ndim)} (a 0) "
                                       f"that its rank-{x.ndim} input does not have; set it or pass allowzero=1")
        shape = [x.shape[i] if dim == 0 else dim for i, dim in enumerate(shape)]
    if shape and min(shape) < -1:  # numpy would take any negative as the inferred dimension
        raise InvalidArgumentError(f"Reshape's shape {shape} has a dimension below -1; only -1 (inferred) is allowed")
    try:
        return x.reshape(shape)
    except ValueError as exc:  # sizes that do not match, or two -1s
        raise InvalidArgumentError(f"Reshape cannot give shape {shape} to an input of shape {list(x.shape)}: {exc}") \
            from None


@register("Reshape", since=1)
def reshape_v1(node, shapes, opset):
    shape = node.attr("shape")
    if shape is None:  # Reshape-1 reads its target from the attribute; without one there is nothing to give
        raise InvalidGraphError(f"node {node.name!r} (Reshape-1): attribute 'shape' is missing; this version takes "
                                f"the target shape as an attribute (opset 5 and later take it as input 1)")
    return lambda x: (reshape_to(x, shape),)


@register("Reshape", since=5)
def reshape(node, shapes, opset):
    allowzero = bool(node.attr("allowzero", 0))
    return shape_free(lambda x, shape: (reshape_to(x, shape, allowzero),))


@register("Transpose", since=1)
def transpose(node, shapes, opset):
    perm = node.attr("perm")  # None reverses the axes
    return shape_free(lambda x: (np.transpose(x, perm),))


def _squeeze(x, axes):
    if axes is None:
        return np.squeeze(x)
    return np.squeeze(x, axis=tuple(normalize_axes(axes, x.ndim)))


@register("Squeeze", since=1)
def squeeze_v1(node, shapes, opset):
    axes = node.attr("axes")
    return lambda x: (_squeeze(x, axes),)


@register("Squeeze", since=13)
def squeeze(node, shapes, opset):
    return _axes_reshape(_squeeze)


def _axes_reshape(compute, layout=None):
    """``kernel(x, axes)`` for Squeeze/Unsqueeze: ``compute(x, axes)``'s shape, as a reshape of x. The axes
    are nearly always the same constant: the last (input shape, axes) -> output shape is kept (as one tuple:
    sessions may run from several threads), found by the axes' identity when they are read-only (see
    frozen), else by their contents. ``layout(rank, axes)``, where given, says per output dimension which
    input dimension it is (-1: an inserted 1); it is kept per rank for read-only axes, so a decode loop's
    lengths, new every step, cost a tuple instead of the axes' normalization."""
    last: list = [(None, None, None)]
    by_rank: list = [(None, None, None)]  # (axes, rank, layout)

    def kernel(x, axes=None):
        held, key, out = last[0]
        if axes is not None and held is axes and key == x.shape:
            return (x.reshape(out),)
        if not isinstance(axes, np.ndarray) or not isinstance(x, np.ndarray):
            return (compute(x, axes),)
        if frozen(axes) and layout is not None:
            entry = by_rank[0]
            if entry[0] is not axes or entry[1] != x.ndim:
                entry = by_rank[0] = (axes, x.ndim, layout(x.ndim, axes))
            shape = x.shape
            out = tuple([1 if source < 0 else shape[source] for source in entry[2]])
            last[0] = (axes, shape, out)
            return (x.reshape(out),)
        if frozen(axes):
            held, key = axes, x.shape
        else:
            held, key = None, (x.shape, axes.dtype, axes.tobytes())
        entry = last[0]
        if entry[0] is not held or entry[1] != key:
            entry = last[0] = (held, key, compute(x, axes).shape)
        return (x.reshape(entry[2]),)

    return shape_free(kernel)


def _unsqueeze(x, axes):
    axes = np.asarray(axes).reshape(-1)
    rank = x.ndim + axes.size
    inserted = set(normalize_axes(axes, rank))  # axes index the output
    dims = iter(x.shape)
    return x.reshape([1 if i in inserted else next(dims) for i in range(rank)])


@register("Unsqueeze", since=1)
def unsqueeze_v1(node, shapes, opset):
    axes = node.attr("axes")
    if axes is None:
        raise InvalidGraphError(f"node {node.name!r} ({node.op_type}): attribute 'axes' is missing; "
                                f"expected a list of axes to insert")
    return lambda x: (_unsqueeze(x, axes),)


def _unsqueeze_layout(rank: int, axes) -> tuple[int, ...]:
    """Per output dimension of Unsqueeze(x of ``rank``, ``axes``): the input dimension it is, or -1 (inserted)."""
    axes = np.asarray(axes).reshape(-1)
    inserted = set(normalize_axes(axes, rank + axes.size))  # axes index the output
    dims = iter(range(rank))
    return tuple(-1 if i in inserted else next(dims) for i in range(rank + axes.size))


@register("Unsqueeze", since=13)
def unsqueeze(node, shapes, opset):
    return _axes_reshape(_unsqueeze, _unsqueeze_layout)


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

    return shape_free(kernel)
