"""Removing what a run does not need: dead nodes and initializers, Identity and inference Dropout, and
the no-ops exporters write (a Cast to the type the value has, a one-input Concat, a product with or a
quotient by a constant 1 that broadcasts nothing, an Expand or Reshape to the shape the value has)."""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import DataType
from ..ir import Graph, Node
from ..loader import implicit_inputs
from .context import PassContext
from .rewrite import Uses, constant, forget_value, remove_nodes, set_io


def remove_dead_nodes(graph: Graph, context: PassContext) -> bool:
    """Drop nodes whose outputs nothing reads (node, subgraph or graph output), and unread initializers."""
    live = {vi.name for vi in graph.outputs}
    dead: list[Node] = []
    for node in reversed(graph.nodes):  # readers come after producers: one backward sweep finds chains
        if any(out and out in live for out in node.outputs):
            live.update(name for name in node.inputs if name)
            live.update(implicit_inputs(node))
        else:
            dead.append(node)
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
        if not _is_passthrough(node, graph, uses):
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


def _is_passthrough(node: Node, graph: Graph, uses: Uses) -> bool:
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
    if node.op_type == "Slice" and node.opset >= 10 and len(node.inputs) >= 3:
        return _whole_slice(node, graph)
    return False


def _whole_slice(node: Node, graph: Graph) -> bool:
    """A Slice taking every element in order on each axis it names: step 1 from 0 to past any end (exporters write
    int64's largest value). An end equal to the axis's length is left: a Slice there may be what a later
    inference round reads to type its output."""
    starts, ends = constant(graph, node.inputs[1]), constant(graph, node.inputs[2])
    steps = constant(graph, node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else None
    if starts is None or ends is None or (len(node.inputs) > 4 and node.inputs[4] and steps is None):
        return False
    if starts.shape != ends.shape or starts.ndim != 1 or (steps is not None and steps.shape != starts.shape):
        return False
    return bool(np.all(starts == 0) and np.all(ends >= _PAST_ANY_END) and (steps is None or np.all(steps == 1)))


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
