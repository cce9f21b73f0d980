"""Matrix products followed by a constant bias become one Gemm (which adds its C in place)."""

from __future__ import annotations

import numpy as np

from ..ir import Graph, Node
from .context import PassContext
from .rewrite import Uses, add_initializer, constant, forget_value, new_node, remove_nodes, set_attr

_FLOATS = (np.float16, np.float32, np.float64)


def fuse_matmul_add(graph: Graph, context: PassContext) -> bool:
    """MatMul(A, B) + D -> Gemm(A, B, D) for a 2-D A of static shape, a constant 2-D B and a constant
    bias D that broadcasts to the product's shape, when the MatMul's provider also runs Gemm."""
    if not _has_ops(graph, "MatMul", "Add"):
        return False
    uses = Uses(graph)
    producers = graph.producers()
    replaced: dict[int, Node] = {}
    removed: list[Node] = []
    for add in graph.nodes:
        found = _bias_add(graph, add, "MatMul", producers, uses)
        if found is None:
            continue
        matmul, bias_name, bias = found
        a_info = graph.type_of(matmul.inputs[0])
        a_shape = a_info.static_shape if a_info is not None and a_info.is_tensor else None
        b = constant(graph, matmul.inputs[1])
        if (a_shape is None or len(a_shape) != 2 or b is None or b.ndim != 2 or b.dtype.type not in _FLOATS
                or bias.dtype != b.dtype or not _broadcasts_to(bias.shape, (a_shape[0], b.shape[1]))):
            continue
        gemm = new_node("Gemm", [matmul.inputs[0], matmul.inputs[1], bias_name], [add.outputs[0]],
                        name=context.fresh(f"{matmul.name}_gemm"), opset=add.opset)
        provider = context.provider_for(matmul, graph)
        if provider is None or context.provider_for(gemm, graph) is not provider:
            continue
        uses.forget(matmul)
        uses.forget(add)
        forget_value(graph, matmul.outputs[0])
        replaced[id(add)] = gemm
        removed.append(matmul)
    if not removed:
        return False
    graph.nodes = [replaced.get(id(node), node) for node in graph.nodes]  # the Gemm runs where the Add did
    remove_nodes(graph, removed)
    return True


def fuse_gemm_add(graph: Graph, context: PassContext) -> bool:
    """Gemm(A, B, C) + D -> Gemm(A, B, beta*C + D) with beta 1, for constant C (or none) and D
    that broadcasts to the Gemm's static output shape."""
    if not _has_ops(graph, "Gemm", "Add"):
        return False
    uses = Uses(graph)
    producers = graph.producers()
    removed: list[Node] = []
    for add in graph.nodes:
        found = _bias_add(graph, add, "Gemm", producers, uses)
        if found is None:
            continue
        gemm, bias_name, bias = found
        info = graph.type_of(gemm.outputs[0])
        shape = info.static_shape if info is not None and info.is_tensor else None
        c_name = gemm.inputs[2] if len(gemm.inputs) > 2 else ""
        c = constant(graph, c_name)
        if (gemm.opset < 7 or shape is None or (c_name and c is None) or bias.dtype.type not in _FLOATS
                or not _broadcasts_to(bias.shape, shape)):
            continue
        total = bias.astype(np.float64)
        if c is not None:
            total = total + float(gemm.attr("beta", 1.0)) * c.astype(np.float64)
        c_name = context.fresh(f"{gemm.name}_C")
        add_initializer(graph, c_name, total.astype(bias.dtype))
        uses.forget(add)
        forget_value(graph, gemm.outputs[0])
        uses.rewire(gemm, inputs=[gemm.inputs[0], gemm.inputs[1], c_name], outputs=[add.outputs[0]])
        if gemm.attr("beta", 1.0) != 1.0:
            set_attr(gemm, "beta", 1.0)
        removed.append(add)
    remove_nodes(graph, removed)
    return bool(removed)


def _bias_add(graph: Graph, add: Node, op_type: str, producers, uses: Uses) -> tuple[Node, str, np.ndarray] | None:
    """(producer, constant's name, its value) when ``add`` adds a constant to the output of an ``op_type``
    node it alone reads."""
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or add.opset < 7 or len(add.inputs) != 2:
        return None  # before opset 7 Add broadcasts by attribute
    for position in (0, 1):
        producer = producers.get(add.inputs[position])
        other = add.inputs[1 - position]
        if (producer is not None and producer.op_type == op_type and producer.domain in ("", "ai.onnx")
                and uses.only_reader(add.inputs[position]) is add):
            value = constant(graph, other)
            if value is not None:
                return producer, other, value
    return None


def _has_ops(graph: Graph, *op_types: str) -> bool:
    present = {node.op_type for node in graph.nodes}
    return all(op in present for op in op_types)


def _broadcasts_to(shape: tuple, target: tuple) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without changing it (Gemm's C rule)."""
    if len(shape) > len(target):
        return False
    return all(dim in (1, want) for dim, want in zip(reversed(shape), reversed(target)))
