"""MatMuls that read one input with constant weights of one row count become one MatMul over the
weights side by side, and a Split of its last axis (attention's q/k/v, a gated MLP's gate/up):

    MatMul(A, W1), MatMul(A, W2), ...  ->  Split(MatMul(A, [W1 | W2 | ...]), axis=-1)

One bigger product streams the weights in one pass and lets the kernel split it across threads
where the pieces were each too small to be worth splitting. Every output keeps its name, so readers
see no change; the merged weight replaces the old ones, which dead-node removal drops once nothing
else reads them.
"""

from __future__ import annotations

import numpy as np

from ..ir import Graph, Node, TypeInfo, ValueInfo
from .context import PassContext
from .rewrite import add_initializer, constant, new_node, tensor_type

_FLOATS = (np.float16, np.float32, np.float64)
_ONNX = ("", "ai.onnx")
# Merging pays when the merged product is big enough: merged products of this size and up measured faster on
# a LLaMA-like decode step's q/k/v and gate/up (a74a05e), when the CPU provider split few-row products across
# threads from far fewer weights than its gemv_split_weights knob now asks (99c5824); merges under that knob
# run as one one-thread product, not re-measured. Below this size the pieces and the merged product stream the
# weights at the same speed, and the Split the merge adds costs more than the calls it saves.
_MIN_MERGED_SIZE = 65_536
# Split takes its sizes as an input from opset 13 on, as an attribute before.
_SPLIT_SIZES_AS_INPUT = 13


def fuse_sibling_matmuls(graph: Graph, context: PassContext) -> bool:
    """Merge each group of sibling MatMuls (same input, constant 2-D weights of one row count and
    dtype, one provider for all of them and for the merged nodes) at the first sibling's place."""
    groups = _sibling_groups(graph)
    if not groups:
        return False
    replaced: dict[int, list[Node]] = {}
    removed: set[int] = set()
    for siblings in groups:
        merged = _merge(graph, context, siblings)
        if merged is None:
            continue
        replaced[id(siblings[0])] = merged
        removed.update(id(node) for node in siblings[1:])
    if not replaced:
        return False
    graph.nodes = [new for node in graph.nodes if id(node) not in removed
                   for new in replaced.get(id(node), [node])]
    return True


def _sibling_groups(graph: Graph) -> list[list[Node]]:
    """MatMuls with a constant float 2-D weight, grouped by (input, weight rows, dtype); groups of two or more."""
    groups: dict[tuple, list[Node]] = {}
    for node in graph.nodes:
        if (node.op_type != "MatMul" or node.domain not in _ONNX or len(node.inputs) != 2 or not node.inputs[0]
                or constant(graph, node.inputs[0]) is not None):
            continue
        weight = constant(graph, node.inputs[1])
        if weight is None or weight.ndim != 2 or weight.dtype.type not in _FLOATS:
            continue
        groups.setdefault((node.inputs[0], weight.shape[0], weight.dtype, node.opset), []).append(node)
    return [nodes for nodes in groups.values()
            if len(nodes) > 1 and sum(graph.initializers[node.inputs[1]].size for node in nodes) >= _MIN_MERGED_SIZE]


def _merge(graph: Graph, context: PassContext, siblings: list[Node]) -> list[Node] | None:
    """[merged MatMul, Split] computing the siblings' outputs, or None when their provider would not run them."""
    provider = context.provider_for(siblings[0], graph)
    if provider is None or any(context.provider_for(node, graph) is not provider for node in siblings[1:]):
        return None
    first = siblings[0]
    weights = [graph.initializers[node.inputs[1]] for node in siblings]  # constants: see _sibling_groups
    sizes = [w.shape[1] for w in weights]
    weight_name = context.fresh(f"{first.name or 'matmul'}_merged_weight")
    product = context.fresh(f"{first.name or 'matmul'}_merged")
    matmul = new_node("MatMul", [first.inputs[0], weight_name], [product], name=context.fresh(product),
                      opset=first.opset)
    outputs = [node.outputs[0] for node in siblings]
    split_name = context.fresh(f"{product}_split")
    if first.opset >= _SPLIT_SIZES_AS_INPUT:
        sizes_name = context.fresh(f"{product}_sizes")
        split = new_node("Split", [product, sizes_name], outputs, name=split_name, opset=first.opset, axis=-1)
    else:
        sizes_name = ""
        split = new_node("Split", [product], outputs, name=split_name, opset=first.opset, axis=-1, split=sizes)
    merged_weight = np.concatenate(weights, axis=1)
    add_initializer(graph, weight_name, merged_weight)
    if sizes_name:
        add_initializer(graph, sizes_name, np.array(sizes, dtype=np.int64))
    graph.value_info[product] = ValueInfo(product, _product_type(graph, first, merged_weight))
    if context.provider_for(matmul, graph) is not provider or context.provider_for(split, graph) is not provider:
        for name in (weight_name, sizes_name, product):
            graph.initializers.pop(name, None)
            graph.value_info.pop(name, None)
        return None
    return [matmul, split]


def _product_type(graph: Graph, first: Node, merged_weight: np.ndarray) -> TypeInfo:
    """The merged product's type: the first sibling's output with the merged column count last."""
    info = graph.type_of(first.outputs[0])
    if info is None or not info.is_tensor or not info.shape:
        return TypeInfo("tensor", tensor_type(merged_weight).dtype, None)
    return TypeInfo("tensor", info.dtype, tuple(info.shape[:-1]) + (merged_weight.shape[1],))
