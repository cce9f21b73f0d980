"""Quantized models as onnxruntime's quantization tools write them, run on the float and integer fast paths.

QDQ format (static quantization): a QuantizeLinear whose codes only a DequantizeLinear with the same scale and
zero point reads is the rounding of an activation to its quantization grid, spelled as two operators and an
integer tensor. ``fuse_quantize_dequantize`` makes it one QuantizeDequantize node (ops/quantization.py: one
compiled pass, the float32 values DequantizeLinear would give, exactly), so the float operators around it run
on float32 as in the float model. The weights' DequantizeLinear nodes read constants and are folded by the
optimizer's constant folding before this pass runs, so the float convolution and matrix products see float32
weights. The pattern: QuantizeLinear(x, scale, zero) -> q, read by one or more DequantizeLinear(q, scale',
zero'), each with the same constant scale and zero point (by value) and the same axis; q is no graph output
and no subgraph reads it; neither node asks for blocks, an output type or a precision. The first
DequantizeLinear's output becomes the fused node's; the other readers' outputs are renamed to it.

Dynamic quantization: ``fuse_dynamic_matmul`` turns MatMulInteger -> Cast -> Mul by the scales' product
(-> bias Add) into one com.microsoft MatMulIntegerToFloat (see its docstring).
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node

from .fusions import FUSED_DOMAIN, GraphView, owned, until_fixed

# Attributes that change what QuantizeLinear/DequantizeLinear compute beyond scale, zero point and axis.
_EXOTIC = ("block_size", "output_dtype", "precision")
_INTEGER_CODES = frozenset(np.dtype(t) for t in (np.uint8, np.int8, np.uint16, np.int16))


def _params(view: GraphView, node: Node) -> tuple | None:
    """(scale, zero point or None, axis) of a Q or DQ node whose parameters are constants, else None."""
    if node.domain or any(node.attr(name, 0) for name in _EXOTIC):
        return None
    scale = view.const(node.inputs[1]) if len(node.inputs) > 1 else None
    zero_name = node.inputs[2] if len(node.inputs) > 2 else ""
    zero = view.const(zero_name) if zero_name else None
    if scale is None or (zero_name and zero is None):
        return None
    return scale, zero, int(node.attr("axis", 1))


def _same(a: tuple, b: tuple) -> bool:
    (scale_a, zero_a, axis_a), (scale_b, zero_b, axis_b) = a, b
    if scale_a.dtype != scale_b.dtype or scale_a.shape != scale_b.shape or not np.array_equal(scale_a, scale_b):
        return False
    if (zero_a is None) != (zero_b is None):
        return False
    if zero_a is not None and (zero_a.dtype != zero_b.dtype or not np.array_equal(zero_a, zero_b)):
        return False
    return scale_a.size == 1 or axis_a == axis_b


def fuse_quantize_dequantize(graph: Graph, owns=None) -> bool:
    view = GraphView(graph)
    for quantize in list(graph.nodes):
        if quantize.op_type != "QuantizeLinear" or quantize.domain:
            continue
        codes = quantize.outputs[0]
        readers = view.consumers.get(codes, [])
        if not readers or codes in view.outputs or codes in view.inner_reads:
            continue
        params = _params(view, quantize)
        # Integer codes only (without a zero point their type is an attribute's; float8 rounds otherwise).
        if params is None or params[1] is None or params[1].dtype not in _INTEGER_CODES:
            continue
        if not all(r.op_type == "DequantizeLinear" and r.inputs[0] == codes and (p := _params(view, r)) is not None
                   and _same(params, p) for r in readers):
            continue
        first, others = readers[0], readers[1:]
        renamed = {r.outputs[0] for r in others}
        if renamed & view.outputs or renamed & view.inner_reads or not owned(owns, [quantize, *readers]):
            continue
        fused = Node("QuantizeDequantize", list(quantize.inputs[:3]), [first.outputs[0]],
                     name=f"{quantize.name}/qdq", domain=FUSED_DOMAIN,
                     attrs={"axis": params[2], "opset": quantize.opset}, opset=1)
        gone = {id(r) for r in readers}
        # Where the QuantizeLinear was: its inputs come before, every reader of the outputs after.
        graph.nodes = [fused if n is quantize else n for n in graph.nodes if id(n) not in gone]
        for node in graph.nodes:
            node.inputs = [first.outputs[0] if name in renamed else name for name in node.inputs]
        return True
    return False


def _made_by(view: GraphView, name: str, op_type: str) -> Node | None:
    node = view.producer.get(name)
    return node if node is not None and node.op_type == op_type and not node.domain else None


def _scales_product(view: GraphView, name: str, a_scale: str) -> tuple[Node, str] | None:
    """(the Mul, the weight's constant scale) when ``name`` is Mul(a_scale, weight scale) in either order."""
    mul = _made_by(view, name, "Mul")
    if mul is None or len(mul.inputs) != 2 or a_scale not in mul.inputs:
        return None
    other = mul.inputs[1] if mul.inputs[0] == a_scale else mul.inputs[0]
    scale = view.const(other)
    return (mul, other) if scale is not None and scale.dtype == np.float32 else None


def _dynamic_chain(view: GraphView, matmul: Node) -> tuple | None:
    """(DynamicQuantizeLinear, Cast, Mul, scales' Mul, weight scale name) around a MatMulInteger of a
    dynamically quantized input by a constant matrix, or None."""
    a, w, a_zero, w_zero = matmul.inputs
    quantize = _made_by(view, a, "DynamicQuantizeLinear")
    weight = view.const(w)
    if quantize is None or quantize.outputs[0] != a or quantize.outputs[2] != a_zero or weight is None \
            or weight.ndim != 2 or view.const(w_zero) is None:
        return None
    cast = view.only_consumer(matmul.outputs[0], "Cast")
    if cast is None or int(cast.attr("to", 0)) != 1:  # to float32
        return None
    scale_mul = view.only_consumer(cast.outputs[0], "Mul")
    if scale_mul is None:
        return None
    other = scale_mul.inputs[1] if scale_mul.inputs[0] == cast.outputs[0] else scale_mul.inputs[0]
    scales = _scales_product(view, other, quantize.outputs[1])
    return None if scales is None else (quantize, cast, scale_mul, *scales)


def fuse_dynamic_matmul(graph: Graph, owns=None) -> bool:
    """onnxruntime's dynamic quantization spells each MatMul as MatMulInteger(DynamicQuantizeLinear(x), W)
    -> Cast to float -> Mul by Mul(x's scale, W's scale), then the float model's bias Add: one
    com.microsoft MatMulIntegerToFloat (with the bias when it is a constant of one value per column) does it
    in one node, the constant W packed once (its int32 product exact, rescaled in float64 and rounded once
    to float32, where the graph rounds the accumulator and the scale product to float32 first)."""
    view = GraphView(graph)
    for matmul in list(graph.nodes):
        if matmul.op_type != "MatMulInteger" or matmul.domain or len(matmul.inputs) != 4:
            continue
        chain = _dynamic_chain(view, matmul)
        if chain is None:
            continue
        quantize, cast, scale_mul, product, w_scale = chain
        a, w, a_zero, w_zero = matmul.inputs
        weight = view.const(w)
        removed = [matmul, cast, scale_mul]
        output, bias = scale_mul.outputs[0], ""
        add = view.only_consumer(output, "Add")
        if add is not None:
            candidate = add.inputs[1] if add.inputs[0] == output else add.inputs[0]
            value = view.const(candidate)
            if value is not None and value.dtype == np.float32 and value.shape == (weight.shape[1],):
                removed.append(add)
                output, bias = add.outputs[0], candidate
        shared = len(view.consumers.get(product.outputs[0], [])) > 1 or product.outputs[0] in view.outputs \
            or product.outputs[0] in view.inner_reads
        if not shared:
            removed.append(product)
        if not owned(owns, removed):
            continue
        inputs = [a, w, quantize.outputs[1], w_scale, a_zero, w_zero] + ([bias] if bias else [])
        fused = Node("MatMulIntegerToFloat", inputs, [output], name=f"{matmul.name}/to_float",
                     domain="com.microsoft", opset=1)
        gone = {id(n) for n in removed}
        # Where the MatMulInteger was: every input exists by then (the scales' Mul reads only the quantizer's
        # output and a constant; the bias is a constant), every reader of the output comes later.
        graph.nodes = [fused if n is matmul else n for n in graph.nodes if id(n) not in gone or n is matmul]
        return True
    return False


QDQ_PASSES = [until_fixed(fuse_quantize_dequantize), until_fixed(fuse_dynamic_matmul)]
