"""Grouped-query attention's repeated keys and values read in place by a QDQ decoder's attention products
(ops/qdq_grouped.py).

A LLaMA-style decoder with fewer key/value heads than query heads repeats each key/value head for its group
(transformers' repeat_kv): Unsqueeze(axis 2) -> Expand -> Reshape, in both torch exporters' forms; the keys are
then transposed (Transpose, or a ReshapeTranspose after the provider's layout passes). After the QDQ passes each
feeds a QuantizedMatMul of two activations (the scores, the context), so a decode step copies every present
twice over three steps per product:

    QuantizedMatMul(A, [Transpose](Reshape(Expand(Unsqueeze(kv, 2)))))  ->  GroupedQuantizedMatMul(A, kv, targets)

which multiplies each group's query rows at once against its one key/value head: A (batch, heads, rows, depth)
read as (batch, kv heads, group * rows, depth), the same integer products and requantization per row, so the
values are the unfused nodes' bit for bit. Applied where the Unsqueeze is at axis 2 of a 4-D kv whose heads and
depth are known, the Expand's output has a known group on that axis, A has heads * group heads, the transposed
form swaps the last two axes, and each intermediate value is read by the next node alone. The Expand's and
Reshape's targets become the fused node's inputs: its kernel checks on each new shape that they only repeat
(else it repeats kv as the nodes did), since a symbolic plan cannot tell from the graph.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node

from .fusions import FUSED_DOMAIN, GraphView, owned


def _shape(graph: Graph, name: str) -> tuple | None:
    info = graph.type_of(name)
    shape = info.shape if info is not None and info.is_tensor else None
    return tuple(shape) if shape is not None else None


def _sole(view: GraphView, name: str, node: Node) -> bool:
    readers = view.consumers.get(name, [])
    return len(readers) == 1 and readers[0] is node and name not in view.outputs and name not in view.inner_reads \
        and node.inputs.count(name) == 1


def _plain(node: Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _unsqueezed_at_2(view: GraphView, node: Node | None) -> bool:
    if not _plain(node, "Unsqueeze"):
        return False
    axes = view.const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else node.attr("axes")
    return axes is not None and [int(a) for a in np.asarray(axes).reshape(-1)] == [2]


def _swaps_last_two(perm) -> bool:
    return perm is not None and [int(p) for p in perm] == [0, 1, 3, 2]


def _repeated(graph: Graph, view: GraphView, product: Node) -> tuple | None:
    """(nodes, kv, group, transposed, Expand's target, Reshape's target input or "", Reshape's attributes) where
    ``product``'s B is kv's heads repeated (and transposed); else None."""
    last = view.producer.get(product.inputs[3])
    if last is None or not _sole(view, last.outputs[0], product):
        return None
    nodes, transposed = [last], False
    if _plain(last, "Transpose") and _swaps_last_two(last.attr("perm")):  # (a symbolic plan's keys)
        nodes, transposed = [view.producer.get(last.inputs[0]), last], True
        if not _plain(nodes[0], "Reshape") or not _sole(view, nodes[0].outputs[0], last):
            return None
        merge, target = nodes[0], {"allowzero": int(nodes[0].attr("allowzero", 0))}
    elif last.op_type == "ReshapeTranspose" and last.domain == FUSED_DOMAIN and _swaps_last_two(last.attr("perm")):
        merge, transposed = last, True
        target = {"allowzero": int(last.attr("allowzero", 0)), "target": [int(d) for d in last.attr("shape")]}
    elif _plain(last, "Reshape"):
        merge, target = last, {"allowzero": int(last.attr("allowzero", 0))}
    else:
        return None
    expand = view.producer.get(merge.inputs[0])
    if not _plain(expand, "Expand") or not _sole(view, expand.outputs[0], merge):
        return None
    unsqueeze = view.producer.get(expand.inputs[0])
    if not _unsqueezed_at_2(view, unsqueeze) or not _sole(view, unsqueeze.outputs[0], expand):
        return None
    kv = unsqueeze.inputs[0]
    kv_shape, spread, a_shape = _shape(graph, kv), _shape(graph, expand.outputs[0]), _shape(graph, product.inputs[0])
    if kv_shape is None or spread is None or a_shape is None or len(kv_shape) != 4 or len(spread) != 5 \
            or len(a_shape) != 4:
        return None
    heads, depth, group = kv_shape[1], kv_shape[3], spread[2]
    if not all(isinstance(d, int) for d in (heads, depth, group)) or group < 1 or spread[1] != heads \
            or spread[4] != depth or a_shape[1] != heads * group:
        return None
    reshape_to = merge.inputs[1] if merge.op_type == "Reshape" else ""
    return [unsqueeze, expand, *nodes], kv, group, transposed, expand.inputs[1], reshape_to, target


def fold_repeated_kv(graph: Graph, owns=None) -> bool:
    """Every QuantizedMatMul of the module doc becomes a GroupedQuantizedMatMul of the unrepeated keys/values where
    it was, with the Expand's and Reshape's targets as inputs (its kernel checks they only repeat); the repeat's
    nodes go."""
    if not any(n.op_type == "Expand" for n in graph.nodes):
        return False
    view = GraphView(graph)
    fused: dict[int, Node] = {}
    gone: set[int] = set()
    for node in graph.nodes:
        if node.op_type != "QuantizedMatMul" or node.domain != FUSED_DOMAIN or len(node.inputs) != 8 \
                or node.attr("transB", 0):
            continue
        found = _repeated(graph, view, node)
        if found is None or not owned(owns, [*found[0], node]) or any(id(n) in gone for n in found[0]):
            continue
        nodes, kv, group, transposed, spread_to, reshape_to, target = found
        inputs = [*node.inputs[:3], kv, *node.inputs[4:], spread_to, reshape_to]
        fused[id(node)] = Node("GroupedQuantizedMatMul", inputs, list(node.outputs), name=f"{node.name}/grouped",
                               domain=FUSED_DOMAIN, opset=1, attrs={**(node.attrs or {}), "group": group,
                                                                    "transposed_b": int(transposed), **target})
        gone.update(id(n) for n in nodes)
        for n in nodes:
            graph.value_info.pop(n.outputs[0], None)
    if not fused:
        return False
    graph.nodes = [fused.get(id(n), n) for n in graph.nodes if id(n) not in gone]
    return True
