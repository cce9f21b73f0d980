"""Matrix products followed by a constant bias become one Gemm (which adds its C in place); a Gemm that
an exporter wrapped in Reshapes to flatten a batch of rows becomes the MatMul (+ Add) it stands for."""

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


def unflatten_gemm(graph: Graph, context: PassContext) -> bool:
    """Reshape(x, (-1, K)) -> Gemm(., B, C) -> Reshape(., (*x's leading dims, N)) -> MatMul(x, B) [+ Add C],
    for a constant 2-D B (transposed once when transB), a constant C of N values or none, alpha = beta = 1
    and static shapes proving the reshapes only flatten and restore x's leading dimensions (PyTorch's
    Linear and GPT-2's Conv1D export so): the products then take the whole rank, as the fusions expect."""
    if not _has_ops(graph, "Gemm", "Reshape"):
        return False
    uses = Uses(graph)
    producers = graph.producers()
    replaced: dict[int, list[Node]] = {}
    removed: list[Node] = []
    for reshape in graph.nodes:
        match = _flattened_gemm(graph, reshape, producers, uses)
        if match is None:
            continue
        flatten, gemm, x, weight, bias = match
        nodes, constants = _unflattened(context, gemm, reshape, x, weight, bias)
        provider = context.provider_for(gemm, graph)
        if provider is None or any(context.provider_for(node, graph) is not provider for node in nodes):
            continue
        for name, value in constants.items():
            add_initializer(graph, name, value)
        for node in (flatten, gemm, reshape):
            uses.forget(node)
        forget_value(graph, flatten.outputs[0])
        forget_value(graph, gemm.outputs[0])
        replaced[id(reshape)] = nodes
        removed += [flatten, gemm]
    if not removed:
        return False
    graph.nodes = [new for node in graph.nodes for new in replaced.get(id(node), [node])]
    remove_nodes(graph, removed)
    return True


def _flattened_gemm(graph: Graph, reshape: Node, producers, uses: Uses):
    """(flattening Reshape, Gemm, x, B as MatMul takes it, C or None) when ``reshape`` restores what a
    Reshape flattened around a Gemm."""
    if reshape.op_type != "Reshape" or reshape.domain not in ("", "ai.onnx") or reshape.opset < 5:
        return None
    gemm: Node | None = producers.get(reshape.inputs[0])
    if gemm is None or gemm.op_type != "Gemm" or gemm.domain not in ("", "ai.onnx") or gemm.opset < 7:
        return None
    flatten: Node | None = producers.get(gemm.inputs[0])
    if flatten is None or flatten.op_type != "Reshape" or flatten.domain not in ("", "ai.onnx"):
        return None
    if uses.only_reader(gemm.outputs[0]) is not reshape or uses.only_reader(flatten.outputs[0]) is not gemm:
        return None
    if gemm.attr("transA", 0) or float(gemm.attr("alpha", 1.0)) != 1.0 or float(gemm.attr("beta", 1.0)) != 1.0:
        return None
    b = constant(graph, gemm.inputs[1])
    c = constant(graph, gemm.inputs[2]) if len(gemm.inputs) > 2 and gemm.inputs[2] else None
    if b is None or b.ndim != 2 or b.dtype.type not in _FLOATS or (len(gemm.inputs) > 2 and gemm.inputs[2]
                                                                    and c is None):
        return None
    weight = b.T if gemm.attr("transB", 0) else b
    if c is not None and (c.dtype != b.dtype or c.size != weight.shape[1] or c.ndim > 1):
        return None
    x_shape, out_shape = _static(graph, flatten.inputs[0]), _static(graph, reshape.outputs[0])
    if x_shape is None or out_shape is None or len(x_shape) < 2 or x_shape[-1] != weight.shape[0] \
            or out_shape != x_shape[:-1] + (weight.shape[1],):
        return None
    return flatten, gemm, flatten.inputs[0], weight, c


def _unflattened(context: PassContext, gemm: Node, reshape: Node, x: str, weight: np.ndarray,
                 bias: np.ndarray | None) -> tuple[list[Node], dict[str, np.ndarray]]:
    """MatMul(x, weight) [+ bias] producing ``reshape``'s output, and the constants to add for it (a
    transposed weight, a 1-element bias made 1-D)."""
    constants: dict[str, np.ndarray] = {}
    weight_name = gemm.inputs[1]
    if gemm.attr("transB", 0):
        weight_name = context.fresh(f"{gemm.name}_weight")
        constants[weight_name] = np.ascontiguousarray(weight)
    out = reshape.outputs[0]
    matmul_name = context.fresh(f"{gemm.name}_matmul")
    if bias is None:
        return [new_node("MatMul", [x, weight_name], [out], name=matmul_name, opset=13)], constants
    product = context.fresh(f"{gemm.name}_product")
    bias_name = gemm.inputs[2]
    if bias.ndim == 0:
        bias_name = context.fresh(f"{gemm.name}_bias")
        constants[bias_name] = bias.reshape(1)
    return [new_node("MatMul", [x, weight_name], [product], name=matmul_name, opset=13),
            new_node("Add", [product, bias_name], [out], name=context.fresh(f"{gemm.name}_bias_add"), opset=14)], \
        constants


def _static(graph: Graph, name: str) -> tuple | None:
    info = graph.type_of(name)
    return info.static_shape if info is not None and info.is_tensor else None


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
