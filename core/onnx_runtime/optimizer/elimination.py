"""Removing what a run does not need: dead nodes and initializers, Identity and inference Dropout, and
the no-ops exporters write (a Cast to the type the value has, a one-input Concat, a product with or a
quotient by a constant 1 that broadcasts nothing, an Expand or Reshape to the shape the value has). In a graph
specialized to one input signature also a Slice whose constant bounds cover whole static axes, and a Concat's
parts of static length 0 along its axis (a rotary embedding that rotates every column: torch's TorchScript
export of Phi-3 slices the head into the rotated part, all of it, and the passed-through rest, empty, and
concatenates them again)."""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import DataType
from ..ir import Graph, Node
from .context import PassContext
from .rewrite import Uses, constant, forget_value, live_values, remove_nodes, set_io


def remove_dead_nodes(graph: Graph, context: PassContext) -> bool:
    """Drop nodes whose outputs nothing reads (node, subgraph or graph output), and unread initializers."""
    live, dead = live_values(graph)
    unread = [name for name in graph.initializers if name not in live]
    for name in unread:
        del graph.initializers[name]
        forget_value(graph, name)
    remove_nodes(graph, dead)
    return bool(dead or unread)


def eliminate_identities(graph: Graph, context: PassContext) -> bool:
    """Bypass Identity, inference-mode Dropout and no-op Cast/Concat/Mul/Div: their readers read the
    (data) input instead.

    When the node's output is a graph output, the input's producer takes over the output's name
    instead, so the graph's outputs keep their names. A value a subgraph reads by name is left alone.
    """
    if not any(node.op_type in _CANDIDATES for node in graph.nodes):
        return False
    uses = Uses(graph)
    producers = graph.producers()
    removed: list[Node] = []
    for node in graph.nodes:
        if not _is_passthrough(node, graph, uses, context.specialized):
            continue
        source, output = _source(node, graph), node.outputs[0]
        if output in uses.implicit:
            continue
        if output in uses.graph_outputs:
            producer = producers.get(source)
            if producer is None or uses.pinned(source):
                continue  # the input is a graph input, initializer or output itself: keep the copy
            uses.forget(node)
            set_io(producer, outputs=[output if out == source else out for out in producer.outputs])
            producers[output] = producers.pop(source)
            uses.move_readers(source, output)
            forget_value(graph, source)
        else:
            uses.forget(node)
            uses.move_readers(output, source)
        removed.append(node)
    for node in removed:
        for out in node.outputs[1:]:
            forget_value(graph, out)  # Dropout's unread mask
    remove_nodes(graph, removed)
    return bool(removed)


_CANDIDATES = frozenset({"Identity", "Dropout", "Cast", "Concat", "Mul", "Div", "Expand", "Reshape", "Slice"})


def _source(node: Node, graph: Graph) -> str:
    """The input a pass-through node's output equals (Mul by 1 may have the 1 first)."""
    if node.op_type == "Mul" and _is_one(graph, node.inputs[0], node.inputs[1]):
        return node.inputs[1]
    return node.inputs[0]


def _is_one(graph: Graph, name: str, other: str) -> bool:
    """Whether ``name`` is a constant 1 that, broadcast against ``other``, leaves its shape alone."""
    value = constant(graph, name)
    if value is None or value.size != 1 or value.reshape(-1)[0] != 1:
        return False
    info = graph.type_of(other)
    return value.ndim == 0 or (info is not None and info.shape is not None and value.ndim <= len(info.shape))


def reshaped(shape: tuple[int, ...], target: list[int], allowzero: bool) -> tuple[int, ...] | None:
    """The shape Reshape gives ``shape`` for ``target`` (0 copies a dimension unless ``allowzero``, one -1
    takes what the rest leave), or None where the target is not valid for it."""
    dims = [shape[axis] if want == 0 and not allowzero and axis < len(shape) else want
            for axis, want in enumerate(target)]
    if dims.count(-1) > 1 or any(d < -1 for d in dims):
        return None
    size = math.prod(shape)
    if -1 in dims:
        rest = math.prod(d for d in dims if d != -1)
        if rest == 0 or size % rest:
            return None
        dims[dims.index(-1)] = size // rest
    return tuple(dims) if math.prod(dims) == size else None


def _same_type(graph: Graph, a: str, b: str) -> bool:
    ta, tb = graph.type_of(a), graph.type_of(b)
    return ta is not None and tb is not None and ta.is_tensor and tb.is_tensor and ta.dtype is not None \
        and ta.dtype == tb.dtype


def _is_passthrough(node: Node, graph: Graph, uses: Uses, specialized: bool) -> bool:
    if node.domain not in ("", "ai.onnx") or not node.inputs or not node.inputs[0] or not node.outputs[0]:
        return False
    if node.op_type == "Identity":
        return True
    if node.op_type == "Dropout":
        return _inference_dropout(node, graph, uses)
    if node.op_type == "Cast":  # to the type the input has: the values unchanged, saturate or not
        source = graph.type_of(node.inputs[0])
        return source is not None and source.is_tensor and source.dtype is not None \
            and source.dtype == DataType.parse(node.attr("to", 0))  # Cast-1 names it ("FLOAT"), model_checks vets it
    if node.op_type == "Concat":
        return len(node.inputs) == 1
    if node.op_type in ("Mul", "Div") and len(node.inputs) == 2 and all(node.inputs):
        # x * 1 and x / 1 are exact in every numeric type (NaN, infinities and signed zeros included).
        x, one = node.inputs
        if node.op_type == "Mul" and not _is_one(graph, one, x):
            x, one = one, x
        return _is_one(graph, one, x) and _same_type(graph, x, node.outputs[0])
    if node.op_type in ("Expand", "Reshape") and len(node.inputs) == 2 and node.opset >= 5:
        return _keeps_shape(node, graph)
    if node.op_type == "Slice":
        return _whole_slice(node, graph, specialized)
    return False


def _slice_bounds(node: Node, graph: Graph) -> tuple[list[int], list[int], list[int] | None, list[int]] | None:
    """A Slice's (starts, ends, axes or None where omitted, steps) where they are constant vectors of one length
    (inputs from opset 10, attributes before), else None."""
    if node.opset >= 10:
        if len(node.inputs) < 3:
            return None
        given = [*node.inputs[1:5], "", ""][:4]
        values = [constant(graph, name) if name else None for name in given]
        if any(name and value is None for name, value in zip(given, values)):
            return None  # computed at run time
        if any(value is not None and (value.ndim != 1 or value.dtype.kind not in "iu") for value in values):
            return None
        lists = [None if value is None else [int(v) for v in value] for value in values]
    else:
        lists = [None if node.attr(key) is None else [int(v) for v in node.attr(key)]
                 for key in ("starts", "ends", "axes", "steps")]
    starts, ends, axes, steps = lists
    if starts is None or ends is None or len(starts) != len(ends) or (axes is not None and len(axes) != len(starts)) \
            or (steps is not None and len(steps) != len(starts)):
        return None
    return starts, ends, axes, steps if steps is not None else [1] * len(starts)


def _whole_slice(node: Node, graph: Graph, specialized: bool) -> bool:
    """A Slice taking every element in order on each axis it names: step 1 from 0 to past any end (exporters write
    int64's largest value), or, in a specialized graph, bounds that clamp to the whole of a static axis. Elsewhere
    an end equal to the axis's length is left: a Slice there may be what a later inference round reads to type
    its output."""
    bounds = _slice_bounds(node, graph)
    if bounds is None:
        return False
    starts, ends, axes, steps = bounds
    if any(step != 1 for step in steps):
        return False
    if all(start == 0 for start in starts) and all(end >= _PAST_ANY_END for end in ends):
        return True
    info = graph.type_of(node.inputs[0]) if specialized else None
    shape = info.shape if info is not None and info.is_tensor else None
    if shape is None:
        return False
    rank = len(shape)
    named = list(range(len(starts))) if axes is None else [axis + rank if axis < 0 else axis for axis in axes]
    if len(set(named)) != len(named) or any(not 0 <= axis < rank for axis in named):
        return False
    for axis, start, end in zip(named, starts, ends):
        length = shape[axis]
        if not isinstance(length, int) or _clamped(start, length) != 0 or _clamped(end, length) != length:
            return False
    return True


def _clamped(bound: int, length: int) -> int:
    """A Slice bound of step 1 as an index into an axis of ``length`` (negative counts from the end, clamped)."""
    return min(max(bound + length if bound < 0 else bound, 0), length)


def drop_empty_concat_parts(graph: Graph, context: PassContext) -> bool:
    """In a specialized graph, a Concat's inputs that a Slice of constant bounds leaves empty along the Concat's
    axis (a static length 0 there) are left out: they add no element. One input stays where all are empty, and a
    Concat left with one input is then an identity (eliminate_identities). A part empty only for this signature
    (a decoder's past at its prefill, fed or computed) stays: the cache fusions read that Concat."""
    if not context.specialized:
        return False
    producers = graph.producers()
    changed = False
    for node in graph.nodes:
        if node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2 \
                or not all(node.inputs) or node.attr("axis") is None:
            continue
        empty = [_sliced_away(producers.get(name), graph) and _empty_along(graph, name, int(node.attr("axis")))
                 for name in node.inputs]
        if not any(empty):
            continue
        kept = [name for name, gone in zip(node.inputs, empty) if not gone] or node.inputs[:1]
        set_io(node, inputs=kept)
        changed = True
    return changed


def _sliced_away(node: Node | None, graph: Graph) -> bool:
    """Whether ``node`` is a Slice whose constant bounds select nothing on some static axis of its input."""
    if node is None or node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or not node.inputs:
        return False
    bounds = _slice_bounds(node, graph)
    info = graph.type_of(node.inputs[0])
    shape = info.shape if info is not None and info.is_tensor else None
    if bounds is None or shape is None:
        return False
    starts, ends, axes, steps = bounds
    rank = len(shape)
    named = list(range(len(starts))) if axes is None else [axis + rank if axis < 0 else axis for axis in axes]
    lengths = [shape[axis] if 0 <= axis < rank else None for axis in named]
    return any(step == 1 and isinstance(length, int) and _clamped(start, length) >= _clamped(end, length)
               for length, start, end, step in zip(lengths, starts, ends, steps))


def _empty_along(graph: Graph, name: str, axis: int) -> bool:
    """Whether ``name``'s inferred shape has a static 0 at ``axis`` (negative from the end)."""
    info = graph.type_of(name)
    shape = info.shape if info is not None and info.is_tensor else None
    if shape is None or not -len(shape) <= axis < len(shape):
        return False
    return shape[axis] == 0


# An end at or past this is past the end of any axis a tensor this runtime holds can have.
_PAST_ANY_END = 2 ** 31 - 1


def _inference_dropout(node: Node, graph: Graph, uses: Uses) -> bool:
    if any(out and uses.is_read(out) for out in node.outputs[1:]):
        return False
    # Before opset 12 Dropout runs in inference mode; from 12 on, unless training_mode is set.
    training = node.inputs[2] if node.opset >= 12 and len(node.inputs) > 2 else ""
    if not training:
        return True
    flag = constant(graph, training)
    return flag is not None and not flag.any()


def _keeps_shape(node: Node, graph: Graph) -> bool:
    """An Expand or Reshape to the shape its input has: static, or the same symbols as inference gave its
    output (a decode step's mask, whose length is symbolic)."""
    info = graph.type_of(node.inputs[0])
    out = graph.type_of(node.outputs[0])
    if info is not None and out is not None and info.is_tensor and out.is_tensor and info.shape is not None \
            and info.shape == out.shape and None not in info.shape:
        return True
    shape = info.static_shape if info is not None and info.is_tensor else None
    target = constant(graph, node.inputs[1])
    if shape is None or target is None or target.ndim != 1:
        return False
    if node.op_type == "Expand":
        try:
            return np.broadcast_shapes(shape, tuple(int(n) for n in target)) == shape
        except ValueError:
            return False
    return reshaped(shape, [int(n) for n in target], bool(node.attr("allowzero", 0))) == shape


def collapse_reshapes(graph: Graph, context: PassContext) -> bool:
    """Reshape(Reshape(x, a), b) reads x: the outer target alone decides the result when it copies no
    dimension from the intermediate value (no 0 in it, or allowzero). The inner Reshape goes when nothing
    else reads it (remove_dead_nodes)."""
    if sum(node.op_type == "Reshape" for node in graph.nodes) < 2:
        return False
    producers = graph.producers()
    changed = False
    for node in graph.nodes:
        if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or node.opset < 5 or len(node.inputs) != 2:
            continue
        inner = producers.get(node.inputs[0])
        if inner is None or inner.op_type != "Reshape" or inner.domain not in ("", "ai.onnx") or inner.opset < 5:
            continue
        target = constant(graph, node.inputs[1])
        if target is None or (0 in target.tolist() and not int(node.attr("allowzero", 0))):
            continue
        set_io(node, inputs=[inner.inputs[0], node.inputs[1]])
        changed = True
    return changed
