"""A feed-forward block's Gemm -> Relu -> Gemm [+ residual] as two FusedMatMuls, the Relu and the residual Add in
their epilogues.

OPT's decoder layers (and any ReLU MLP over rows flattened to 2-D) leave the optimizer as

    h = Relu(Gemm(x, W1, b1; transB=1));  y = Gemm(h, W2, b2; transB=1) + residual

(TorchScript keeps the biases as Gemm's C; dynamo drops a bias of zeros). At a decode step's one row the Relu and
the Add are steps of their own that cost more than their work, so

    h = FusedMatMul(x, W1ᵀ, b1; activation=relu);  y = FusedMatMul(h, W2ᵀ, b2, residual)

with the weights transposed once here (constants) and a missing bias as zeros. Only a Gemm whose product a Relu
alone reads, and the Gemm that reads such a product (with the Add its product alone feeds, if any): other Gemms
keep their kernel.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node
from onnx_runtime.optimizer.rewrite import add_initializer, fresh_name

from .algorithms.prepared import transposed
from .fusions import FUSED_DOMAIN, GraphView, other_input, owned, replace_nodes


def _operands(graph: Graph, view: GraphView, gemm: Node) -> tuple[str, str] | None:
    """(the weight as a (K, N) constant's name, the bias's name) made for a Gemm A x B (+ C) of constant float B and
    a constant C of N values (or none), alpha = beta = 1, A not transposed and 2-D; else None."""
    if gemm.op_type != "Gemm" or gemm.domain not in ("", "ai.onnx") or not 2 <= len(gemm.inputs) <= 3 \
            or gemm.attr("transA", 0) or float(gemm.attr("alpha", 1.0)) != 1.0 or float(gemm.attr("beta", 1.0)) != 1.0:
        return None
    a = graph.type_of(gemm.inputs[0])
    weight = view.const(gemm.inputs[1])
    if a is None or not a.is_tensor or a.shape is None or len(a.shape) != 2 or weight is None or weight.ndim != 2 \
            or weight.dtype not in (np.float32, np.float64):
        return None
    columns = weight.shape[0] if gemm.attr("transB", 0) else weight.shape[1]
    bias_name = gemm.inputs[2] if len(gemm.inputs) == 3 and gemm.inputs[2] else None
    bias = view.const(bias_name) if bias_name else np.zeros(columns, weight.dtype)
    if bias is None or bias.dtype != weight.dtype or bias.shape != (columns,):
        return None
    base = gemm.name or gemm.outputs[0]
    weight_name = gemm.inputs[1]
    if gemm.attr("transB", 0):
        weight_name = fresh_name(graph, f"{base}/weight_t")
        add_initializer(graph, weight_name, transposed(weight))
    if bias_name is None:
        bias_name = fresh_name(graph, f"{base}/bias")
        add_initializer(graph, bias_name, bias)
    return weight_name, bias_name


def fuse_gemm_relu(graph: Graph, owns=None) -> bool:
    """Fold each Gemm -> Relu and the Gemm reading it (with its residual Add) into FusedMatMuls (module docstring)."""
    changed = False
    view = GraphView(graph)
    relu_made: set[str] = set()
    for gemm in list(graph.nodes):
        if gemm.op_type != "Gemm" or gemm.domain not in ("", "ai.onnx") or gemm.outputs[0] in view.outputs:
            continue
        relu = view.only_consumer(gemm.outputs[0], "Relu")
        if relu is None and gemm.inputs[0] not in relu_made:
            continue
        matched, activation = [gemm], "none"
        if relu is not None:
            matched.append(relu)
            activation = "relu"
        else:  # the second product: its residual Add, where the product alone feeds one
            add = view.only_consumer(gemm.outputs[0], "Add")
            residual = other_input(add, gemm.outputs[0]) if add is not None else None
            if residual is not None and residual != gemm.outputs[0]:
                matched.append(add)
        if not owned(owns, matched):
            continue
        operands = _operands(graph, view, gemm)
        if operands is None:
            continue
        inputs = [gemm.inputs[0], *operands] + ([other_input(matched[1], gemm.outputs[0])]
                                                if activation == "none" and len(matched) == 2 else [])
        fused = Node("FusedMatMul", inputs, list(matched[-1].outputs), name=f"{gemm.name}/fused",
                     domain=FUSED_DOMAIN, attrs={"activation": activation}, opset=1)
        replace_nodes(graph, matched, fused)
        for node in matched[:-1]:
            graph.value_info.pop(node.outputs[0], None)
        if activation == "relu":
            relu_made.add(fused.outputs[0])
        view = GraphView(graph)
        changed = True
    return changed
