"""What the operator families share: attribute errors, axes, per-channel parameters, stash types, group
counts, a fused node's activation, and numpy's floating-point warnings off where inf/nan are ONNX semantics.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

# The domain of onnxruntime's contrib operators (docs/ContribOperators.md).
CONTRIB_DOMAIN = "com.microsoft"


def graph_error(node, attr: str, message: str) -> InvalidGraphError:
    return InvalidGraphError(f"node {node.name!r} ({node.op_type}): attribute {attr!r} {message}")


def required_attr(node, attr: str, expected: str):
    """The value of a required attribute, or an InvalidGraphError saying it is missing and what it expects
    (for operators without an onnx schema, which model_checks cannot check)."""
    value = node.attr(attr)
    if value is None:
        raise graph_error(node, attr, f"is missing; expected {expected}")
    return value


def has_input(node, index: int) -> bool:
    """Whether the node gives an optional input at ``index`` (listed and named)."""
    return len(node.inputs) > index and bool(node.inputs[index])


def wants_output(node, index: int) -> bool:
    """Whether the node lists an optional output at ``index``."""
    return len(node.outputs) > index


def normalize_axis(node, axis: int, rank: int) -> int:
    if not -rank <= axis < rank:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): axis {axis} is out of range for a rank-{rank} input; "
            f"expected a value in [{-rank}, {rank - 1}]"
        )
    return axis % rank


def channel_param(p: np.ndarray, ndim: int, dtype) -> np.ndarray:
    """A per-channel (C,) or per-activation (C, D1, ...) parameter shaped to broadcast over (N, C, ...)."""
    return p.astype(dtype, copy=False).reshape(p.shape + (1,) * (ndim - 1 - p.ndim))


def stash_dtype(node) -> np.dtype:
    stash_type = int(node.attr("stash_type", 1))
    try:
        dtype = DataType(stash_type)
    except ValueError:
        dtype = None
    if dtype not in (DataType.FLOAT, DataType.DOUBLE, DataType.FLOAT16, DataType.BFLOAT16):
        raise graph_error(node, "stash_type", f"is {stash_type}; expected a float type (1, 10, 11 or 16)")
    return dtype.numpy


def group_count(node) -> int:
    group = int(node.attr("group", 1))
    if group < 1:
        raise graph_error(node, "group", f"is {group}; expected a positive group count")
    return group


def spatial_axes(x: np.ndarray) -> tuple[int, ...]:
    return tuple(range(2, x.ndim))


def shape_free(kernel):
    """Mark ``kernel`` as serving any input shapes: a node whose shapes change from run to run (a decode step's
    mask and cache) keeps it, where the session would otherwise ask for a new kernel per shape (see
    onnx_runtime.session.steps.ShapeKeyedKernel). Only for kernels that read no planned shape."""
    kernel.shape_free = True
    return kernel


def indices_checked(factory):
    """A kernel factory whose kernels report an out-of-range index as an InvalidArgumentError naming the node and
    the rule, where numpy's IndexError would reach the caller as a kernel failure. Checking only on failure keeps
    the happy path free of a min/max pass over the indices."""

    @functools.wraps(factory)
    def make(node, shapes, opset):
        kernel = factory(node, shapes, opset)

        def checked(*inputs):
            try:
                return kernel(*inputs)
            except IndexError as exc:
                raise InvalidArgumentError(
                    f"node {node.name!r} ({node.op_type}): an index is out of range ({exc}); indices along an axis of "
                    f"size n must lie in [-n, n)") from None

        checked.__dict__.update(vars(kernel) if hasattr(kernel, "__dict__") else {})
        return checked

    return make


def quiet(fn):
    """Run ``fn`` with numpy's floating-point warnings off: inf/nan results are ONNX semantics."""

    @functools.wraps(fn)
    def wrapper(*args):
        with np.errstate(all="ignore"):
            return fn(*args)

    return wrapper


def in_place_activation(node):
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
    raise graph_error(node, "activation", f"is {kind!r}; expected Relu, Clip or LeakyRelu")


def activation_code(node):
    """The node's fused activation as the compiled epilogue's (code, parameters) pair."""
    from ..compiled import epilogue

    kind = node.attr("activation")
    params = [float(p) for p in node.attr("activation_params", [])]
    codes = {None: epilogue.NONE, "Relu": epilogue.RELU, "Clip": epilogue.CLIP, "LeakyRelu": epilogue.LEAKY_RELU}
    return codes[kind], (params + [0.0, 0.0])[:2]


def choice_attr(node, attr: str, default: str, allowed) -> str:
    value = node.attr(attr, default)
    if value not in allowed:
        raise graph_error(node, attr, f"is {value!r}; expected one of {', '.join(map(repr, allowed))}")
    return value


def ints_attr(node, attr: str, default, minimum: int) -> tuple[int, ...] | None:
    value = node.attr(attr)
    if value is None:
        return default
    value = tuple(int(v) for v in value)
    if any(v < minimum for v in value):
        raise graph_error(node, attr, f"is {list(value)}; expected values >= {minimum}")
    return value


def argument_error(node, message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"node {node.name!r} ({node.op_type}): {message}")


def present(value) -> bool:
    """Whether an optional input was fed with data (old opsets pass empty tensors for 'absent')."""
    return value is not None and value.size > 0


def frozen(value) -> bool:
    """Whether ``value`` is a read-only array (an initializer: the executor freezes them), or absent: one whose
    identity stands for its contents, as algorithms/prepared.py's Prepared assumes."""
    return value is None or (isinstance(value, np.ndarray) and not value.flags.writeable)
