"""A float operator whose output only a QuantizeDequantize reads, as one node (qdq_epilogues.py).

A statically quantized (QDQ) model rounds every activation to its 8-bit grid right after the operator that makes
it. In a decode call the tensors hold a few hundred values, so each rounding costs a step of the run loop, its
kernel's entry and a fresh array more than its arithmetic. Add, Sub, Mul and Div of float32 operands of which one
repeats over the other in flat order, and Concat of two float32 inputs, run as one compiled pass that rounds each
value as it is made (compiled/quantize.rounded_binary, rounded_concat: the operator's float32 arithmetic, then
the rounding's, bit for bit); every other call runs the producer's own kernel and then the rounding's.

Op type: the producer's with the suffix ``Rounded`` (``AddRounded``, ``ConcatRounded``, ...; ROUNDED_OPS).
Inputs: the producer's, then the rounding's scale and zero point. Attributes: the producer's, and
``rounding_axis``, ``rounding_opset`` (the QuantizeDequantize's ``axis`` and ``opset``) and ``inner_opset``
(the producer's opset).
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime.ir import Node

from ..algorithms.bound_loop import EntryOnce
from ..algorithms.quantize import integer_range
from ..fused_domain import FUSED_DOMAIN
from ..qdq_epilogues import BROADCASTING, ELEMENTWISE, SHAPED, SUFFIX
from ..registry import NEEDS, lookup, register
from ._common import shape_free
from .quantization import quantize_dequantize

ROUNDED_OPS = tuple(op + SUFFIX for op in BROADCASTING + ELEMENTWISE + SHAPED)
_OWN = ("rounding_axis", "rounding_opset", "inner_opset")


def inner_node(node: Node) -> tuple[Node, Node]:
    """(the producer, the rounding) a fused node stands for."""
    count = len(node.inputs) - 2
    attrs = {k: v for k, v in (node.attrs or {}).items() if k not in _OWN}
    producer = Node(node.op_type[:-len(SUFFIX)], list(node.inputs[:count]), list(node.outputs), name=node.name,
                    attrs=attrs, opset=int(node.attr("inner_opset", 1)))
    rounding = Node("QuantizeDequantize", [node.outputs[0], *node.inputs[count:]], list(node.outputs),
                    name=f"{node.name}/rounding", domain=FUSED_DOMAIN,
                    attrs={"axis": int(node.attr("rounding_axis", 1)), "opset": int(node.attr("rounding_opset", 13))},
                    opset=1)
    return producer, rounding


def rounded_output(node, shapes, opset):
    producer, rounding = inner_node(node)
    factory = lookup(producer.op_type, "", producer.opset)
    if factory is None or NEEDS.get(factory):
        raise OnnxRuntimeError(f"node {node.name!r} ({node.op_type}): {producer.op_type} at opset {producer.opset} "
                               "has no CPU kernel that runs on its inputs alone; run the model without the "
                               "provider's fusions")
    count = len(producer.inputs)
    run = factory(producer, list(shapes[:count]), producer.opset)
    round_ = quantize_dequantize(rounding, [None, *shapes[count:]], 1)  # (serves any shapes)
    if producer.op_type in _BINARY and count == 2:
        kernel = _rounded_binary(_BINARY[producer.op_type], run, round_)
    elif producer.op_type == "Concat" and count == 2 and producer.attr("axis") is not None:
        kernel = _rounded_concat(int(producer.attr("axis")), run, round_)
    elif count == 1:
        def kernel(x, scale, zero_point):
            return round_(run(x)[0], scale, zero_point)
    else:
        def kernel(*inputs):
            return round_(run(*inputs[:count])[0], inputs[count], inputs[count + 1])
    return shape_free(kernel) if getattr(run, "shape_free", False) else kernel


_F32 = np.dtype(np.float32)
_BINARY = {"Add": 0, "Sub": 1, "Mul": 2, "Div": 3}
_CODES = frozenset(np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.int16))


class _Grid:
    """The per-tensor grid of the last (scale, zero point) constants seen, as the compiled loops take it."""

    __slots__ = ("scale", "zero", "values")

    def __init__(self):
        self.scale = self.zero = self.values = None

    def of(self, scale, zero_point):
        if scale is self.scale and zero_point is self.zero:
            return self.values
        values = None
        if scale.size == 1 and zero_point.size == 1 and scale.dtype == _F32 and zero_point.dtype in _CODES:
            values = (float(scale.reshape(-1)[0]), float(zero_point.reshape(-1)[0]), *integer_range(zero_point.dtype))
        if not scale.flags.writeable and not zero_point.flags.writeable:
            self.scale, self.zero, self.values = scale, zero_point, values
        return values


def _broadcast(a_shape: tuple, b_shape: tuple) -> tuple | None:
    """The broadcast output shape where, in flat order, each operand is either the whole output or one block
    repeated over it (the output's trailing dimensions, or one value), else None."""
    if a_shape == b_shape:
        return a_shape
    try:
        shape = np.broadcast_shapes(a_shape, b_shape)
    except ValueError:
        return None
    size = math.prod(shape)
    if max(math.prod(a_shape), math.prod(b_shape)) != size:
        return None
    for operand in (a_shape, b_shape):
        if math.prod(operand) != size:  # (a whole operand is the output's flat order: nothing of it stretched)
            tail = operand[next((i for i, d in enumerate(operand) if d != 1), len(operand)):]
            if tuple(shape[len(shape) - len(tail):]) != tail:
                return None
    return tuple(shape)


def _rounded_binary(op: int, run, round_):
    """Add/Sub/Mul/Div of float32 operands whose broadcast repeats one over the other: one compiled pass;
    other operands: the operator's kernel, then the rounding's."""
    from ..compiled import quantize as compiled

    grid = _Grid()
    layouts: dict = {}
    # The last compiled call's (A's shape, B's shape, scale, zero point, the loop's bound entry point, its grid
    # arguments, the output's size and shape): a decode step repeats it every run, and the checks above and
    # the dispatcher's typing of eight arguments cost more than a few hundred values' arithmetic.
    kept = (None,) * 8
    bind = EntryOnce(compiled.rounded_binary)

    def kernel(a, b, scale, zero_point):
        nonlocal kept
        a_shape, b_shape, kept_scale, kept_zero, entry, grid_args, size, shape = kept  # (one read: threads)
        if a.shape == a_shape and b.shape == b_shape and scale is kept_scale and zero_point is kept_zero \
                and a.dtype is _F32 and b.dtype is _F32 and a.flags.c_contiguous and b.flags.c_contiguous:
            out = np.empty(size, _F32)
            entry(a.reshape(-1), b.reshape(-1), op, *grid_args, out)
            return (out.reshape(shape),)
        params = grid.of(scale, zero_point)
        if params is not None and a.dtype is _F32 and b.dtype is _F32:
            key = (a.shape, b.shape)
            shape = layouts.get(key, False)
            if shape is False:
                if len(layouts) >= 64:  # (a growing length: start over)
                    layouts.clear()
                shape = layouts[key] = _broadcast(*key)
            if shape is not None and a.size and b.size:
                out = np.empty(shape, _F32)
                arguments = (a.reshape(-1), b.reshape(-1), op, *params, out.reshape(-1))
                compiled.rounded_binary(*arguments)
                if scale is grid.scale and a.flags.c_contiguous and b.flags.c_contiguous:  # (constant parameters)
                    bound = bind(arguments)
                    if bound is not None:
                        kept = (a.shape, b.shape, scale, zero_point, bound, params, out.size, shape)
                return (out,)
        return round_(run(a, b)[0], scale, zero_point)

    return kernel


def _rounded_concat(axis: int, run, round_):
    """Concat of two float32 inputs: each row of the output written rounded in one compiled pass; other
    inputs: the operator's kernel, then the rounding's."""
    from ..compiled import quantize as compiled

    grid = _Grid()
    # The last compiled call's (A's shape, B's shape, scale, zero point, the loop's bound entry point, its grid
    # arguments, the 2-D views' shapes for A, B and the output, the output's shape), as in _rounded_binary.
    kept = (None,) * 10
    bind = EntryOnce(compiled.rounded_concat)

    def kernel(a, b, scale, zero_point):
        nonlocal kept
        a_shape, b_shape, kept_scale, kept_zero, entry, grid_args, a_rows, b_rows, out_rows, shape = kept
        if a.shape == a_shape and b.shape == b_shape and scale is kept_scale and zero_point is kept_zero \
                and a.dtype is _F32 and b.dtype is _F32 and a.flags.c_contiguous and b.flags.c_contiguous:
            out = np.empty(out_rows, _F32)
            entry(a.reshape(a_rows), b.reshape(b_rows), *grid_args, out)
            return (out.reshape(shape),)
        params = grid.of(scale, zero_point)
        rank = a.ndim
        if params is not None and a.dtype is _F32 and b.dtype is _F32 and rank == b.ndim and -rank <= axis < rank:
            at = axis % rank
            outer = math.prod(a.shape[:at])
            # (one part may be empty: a prefill's past, whose present is its new part rounded)
            if a.shape[:at] == b.shape[:at] and a.shape[at + 1:] == b.shape[at + 1:] and outer and a.size + b.size:
                shape = a.shape[:at] + (a.shape[at] + b.shape[at],) + a.shape[at + 1:]
                out = np.empty(shape, _F32)
                arguments = (a.reshape(outer, a.size // outer), b.reshape(outer, b.size // outer), *params,
                             out.reshape(outer, out.size // outer))
                compiled.rounded_concat(*arguments)
                if scale is grid.scale and a.flags.c_contiguous and b.flags.c_contiguous:  # (constant parameters)
                    bound = bind(arguments)
                    if bound is not None:
                        kept = (a.shape, b.shape, scale, zero_point, bound, params, arguments[0].shape,
                                arguments[1].shape, arguments[-1].shape, shape)
                return (out,)
        return round_(run(a, b)[0], scale, zero_point)

    return kernel


for _op in ROUNDED_OPS:
    register(_op, domain=FUSED_DOMAIN, since=1)(rounded_output)
