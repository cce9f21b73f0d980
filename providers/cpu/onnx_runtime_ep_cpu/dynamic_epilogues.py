"""What onnxruntime's dynamic quantization leaves around its products, folded into them.

- A DynamicQuantizeMatMul's Gelu and residual Add as its epilogue (ops/dynamic_quantize_fused.py): an encoder's
  feed-forward layer is DynamicQuantizeLinear -> MatMulInteger -> scales -> bias Add, which qdq_fusions.py makes
  one DynamicQuantizeMatMul; the Gelu after it (fusions.fuse_gelu's, or the dynamo exporter's own Gelu) and the
  residual Add after the layer's output products stay a node each, over a small activation.
- A small embedding table's Gather -> DequantizeLinear as a Gather of its float32 values.
- A DynamicQuantizeConv's Relu (ops/dynamic_quantize_conv.py's activation).

Runs after fusions.PASSES (the torchscript exporter's Erf chain is a Gelu only then), as fusions.fuse_matmul_bias
folds the same nodes into a float product."""

from __future__ import annotations

import numpy as np
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


# The largest 8-bit table whose Gather -> DequantizeLinear becomes a Gather of its float32 values: the float copy
# is four times the codes (a tiny encoder's 1000 x 64 vocabulary: 256 KB); a real vocabulary's stays 8-bit.
DEQUANTIZED_TABLE_VALUES = 1 << 18
_CODES = frozenset(np.dtype(t) for t in (np.int8, np.uint8))


def dequantize_small_tables(graph: Graph, owns=None) -> bool:
    """Gather(table, indices) -> DequantizeLinear(scale, zero point), as onnxruntime's dynamic quantization
    writes an embedding, with a constant 8-bit table of at most DEQUANTIZED_TABLE_VALUES values and one constant
    float32 scale and zero point: a Gather of the table's float32 values, dequantized once here. Each value is
    (code - zero point) * scale rounded once to float32, as the DequantizeLinear kernel gives it (the integer
    difference times a float32 scale is exact in float64); the Gather's rows are the same either way."""
    view = GraphView(graph)
    for gather in graph.nodes:
        if gather.op_type != "Gather" or gather.domain or len(gather.inputs) != 2:
            continue
        table = view.const(gather.inputs[0])
        dequantize = view.only_consumer(gather.outputs[0], "DequantizeLinear")
        if table is None or table.dtype not in _CODES or table.size > DEQUANTIZED_TABLE_VALUES \
                or dequantize is None or len(dequantize.inputs) != 3 \
                or any(dequantize.attr(name, 0) for name in ("block_size", "output_dtype", "precision")):
            continue
        scale, zero = view.const(dequantize.inputs[1]), view.const(dequantize.inputs[2])
        if scale is None or zero is None or scale.size != 1 or zero.size != 1 or scale.dtype != np.float32 \
                or zero.dtype != table.dtype or not owned(owns, [gather, dequantize]):
            continue
        values = ((table.astype(np.float64) - float(zero.reshape(-1)[0])) * float(scale.reshape(-1)[0]))
        name = f"{gather.inputs[0]}/dequantized"
        while name in graph.initializers or name in graph.value_info:
            name += "_"
        graph.initializers[name] = values.astype(np.float32)
        fused = Node("Gather", [name, gather.inputs[1]], list(dequantize.outputs), name=f"{gather.name}/dequantized",
                     attrs=dict(gather.attrs or {}), opset=gather.opset)
        graph.value_info.pop(gather.outputs[0], None)
        replace_nodes(graph, [gather, dequantize], fused)
        codes = gather.inputs[0]
        if codes not in view.inner_reads and codes not in view.outputs and not any(codes in n.inputs
                                                                                    for n in graph.nodes):
            graph.initializers.pop(codes, None)  # (the codes' only reader was this Gather)
        return True
    return False


def fold_dynamic_conv_relu(graph: Graph, owns=None) -> bool:
    """DynamicQuantizeConv (dynamic_conv_fusions.py) -> Relu, the Relu its output's only reader: the conv with
    activation "relu", which clamps its fresh output in place (a dynamically quantized ResNet's every block)."""
    view = GraphView(graph)
    for conv in graph.nodes:
        if conv.op_type != "DynamicQuantizeConv" or conv.domain != FUSED_DOMAIN or len(conv.outputs) != 1 \
                or conv.attr("activation", "none") != "none":
            continue
        relu = view.only_consumer(conv.outputs[0], "Relu")
        if relu is None or not owned(owns, [conv, relu]):
            continue
        fused = Node(conv.op_type, list(conv.inputs), list(relu.outputs), name=f"{conv.name}/relu",
                     domain=conv.domain, attrs={**(conv.attrs or {}), "activation": "relu"}, opset=conv.opset)
        graph.value_info.pop(conv.outputs[0], None)
        replace_nodes(graph, [conv, relu], fused)
        return True
    return False


DYNAMIC_EPILOGUE_PASSES = [until_fixed(fuse_dynamic_epilogue), until_fixed(dequantize_small_tables),
                           until_fixed(fold_dynamic_conv_relu)]
