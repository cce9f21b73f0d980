"""A dynamically quantized product's Gelu and residual Add as its epilogue (ops/dynamic_quantize_fused.py).

onnxruntime's dynamic quantization leaves an encoder's feed-forward layer as DynamicQuantizeLinear ->
MatMulInteger -> scales -> bias Add, which qdq_fusions.py makes one DynamicQuantizeMatMul; the Gelu after it
(fusions.fuse_gelu's, or the dynamo exporter's own Gelu) and the residual Add after the layer's output products
stay a node each, over a small activation. Runs after fusions.PASSES (the torchscript exporter's Erf chain is a
Gelu only then), as fusions.fuse_matmul_bias folds the same nodes into a float product."""

from __future__ import annotations

from onnx_runtime.ir import Graph, Node

from .fusions import FUSED_DOMAIN, GraphView, other_input, owned, replace_nodes, until_fixed

# The fused node's activation for each Gelu approximation (ops/dynamic_quantize_fused.APPROXIMATIONS, not
# imported: a session builds its kernels' modules only where its plan runs them)
_ACTIVATIONS = {"none": "gelu", "tanh": "gelu_tanh"}
_FLOAT = 1  # TensorProto.FLOAT


def _float(graph: Graph, name: str) -> bool:
    info = graph.type_of(name)
    return info is not None and info.dtype == _FLOAT


def fuse_dynamic_epilogue(graph: Graph, owns=None) -> bool:
    """DynamicQuantizeMatMul [-> Gelu] [-> Add(residual)] -> DynamicQuantizeFusedMatMul(A, B, b_scale,
    b_zero_point, bias, residual; activation), where the product's output is read by that Gelu or Add alone (no
    graph output, no subgraph), and so is the Gelu's; the residual a float32 value other than the product."""
    view = GraphView(graph)
    for node in graph.nodes:
        if node.op_type != "DynamicQuantizeMatMul" or node.domain != "com.microsoft" or len(node.outputs) != 1 \
                or not 3 <= len(node.inputs) <= 5:
            continue
        matched, activation = [node], "none"
        gelu = view.only_consumer(node.outputs[0], "Gelu")
        if gelu is not None and gelu.attr("approximate", "none") in _ACTIVATIONS:
            matched.append(gelu)
            activation = _ACTIVATIONS[gelu.attr("approximate", "none")]
        inputs = list(node.inputs) + [""] * (5 - len(node.inputs))
        add = view.only_consumer(matched[-1].outputs[0], "Add")
        residual = other_input(add, matched[-1].outputs[0]) if add is not None else None
        if residual and residual != matched[-1].outputs[0] and _float(graph, residual) \
                and _float(graph, add.outputs[0]):
            matched.append(add)
            inputs.append(residual)
        if len(matched) == 1 or not owned(owns, matched):
            continue
        fused = Node("DynamicQuantizeFusedMatMul", inputs, list(matched[-1].outputs), name=f"{node.name}/epilogue",
                     domain=FUSED_DOMAIN, attrs={"activation": activation}, opset=1)
        replace_nodes(graph, matched, fused)
        return True
    return False


DYNAMIC_EPILOGUE_PASSES = [until_fixed(fuse_dynamic_epilogue)]
