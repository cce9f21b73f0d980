"""QDQ products of one activation as one integer product (issue 20).

A decoder layer's query, key and value projections read one normalized activation, and so do its gated
feed-forward block's gate and up projections. In a QDQ export each is a QuantizedMatMul group of its own
(qdq_fusions.fuse_quantized_linear) quantizing that activation with the same scale and zero point
(absorb_quantize gives each the float32 input and ``quantize_a``), by its own constant weight, requantized to its
own output grid:

    QuantizedMatMul(A, s, z, Wq, ..., yq_scale, yq_zero), QuantizedMatMul(A, s, z, Wk, ...), ...
      ->  q, k, v = QuantizedMatMulGroup(A, s, z, [Wq, ..., yq_scale, yq_zero, bq], [Wk, ...], ...)

(ops/qdq_group.py): A quantized once, one int32 product by the weights side by side, each member's columns
requantized per column with its own multiplier, offset, zero point and scale, into its own contiguous block:
the same codes and float32 values as the members, bit for bit. As onnxruntime's CPU provider runs one
QLinearMatMul per member, the joined product saves a node's fixed cost and A's quantization per extra member.

An encoder's query, key and value are Linear layers whose bias Add comes after the product's rounding
(qdq_fusions.absorb_rounded_add gave each QuantizedMatMul the row and the second rounding's grid): such members
make a group with attribute ``rounded``, each member's block then taking its own row and second rounding (a member
without one, BERT/Whisper's bias-free key, none), again the bits the members give alone.

Applied to QuantizedMatMul nodes of one A (by name), with equal A scale and zero point (by value), equal
``quantize_a`` and ``dequantize``, a constant 2-D weight of one depth, constant parameters (none an input a feed
may override; a rounded add's too), no alpha, beta or quantize_b, and an output that is no graph output and no
subgraph read. Groups of two or more; the group stands where its first member was (its inputs are A, produced
before every member, and constants).
"""

from __future__ import annotations

from onnx_runtime.ir import Graph, Node

from .fusions import FUSED_DOMAIN, GraphView, owned

ROUNDED_SLOTS = 9  # a member's inputs after A's three in a rounded group (ops/qdq_group.ROUNDED_SLOTS)

_PLAIN_ATTRS = frozenset({"quantize_a", "dequantize", "transB"})


def _key(view: GraphView, fed: set[str], node: Node) -> tuple | None:
    """The grouping key of a QuantizedMatMul this pass merges, else None."""
    if node.op_type != "QuantizedMatMul" or node.domain != FUSED_DOMAIN or len(node.outputs) != 1 \
            or len(node.inputs) not in (8, 9, 12) or not node.inputs[0] or set(node.attrs or {}) - _PLAIN_ATTRS:
        return None
    out = node.outputs[0]
    if out in view.outputs or out in view.inner_reads or fed & set(node.inputs[1:]):
        return None
    values = [view.const(name) if name else None for name in node.inputs[1:]]
    a_scale, a_zero, weight = values[0], values[1], values[2]
    if any(v is None for v in values[:7]) or (len(values) >= 8 and node.inputs[8] and values[7] is None) \
            or any(v is None for v in values[8:]) or weight.ndim != 2 or view.const(node.inputs[0]) is not None:
        return None
    depth = weight.shape[1] if node.attr("transB", 0) else weight.shape[0]
    return (node.inputs[0], int(node.attr("quantize_a", 0)), int(node.attr("dequantize", 0)), depth,
            a_scale.dtype.str, a_scale.shape, a_scale.tobytes(), a_zero.dtype.str, a_zero.shape, a_zero.tobytes())


def group_quantized_products(graph: Graph, owns=None) -> bool:
    """One QuantizedMatMulGroup per set of QuantizedMatMul nodes the module docstring names."""
    view, fed = GraphView(graph), {vi.name for vi in graph.inputs}
    groups: dict[tuple, list[Node]] = {}
    for node in graph.nodes:
        key = _key(view, fed, node)
        if key is not None:
            groups.setdefault(key, []).append(node)
    replaced: dict[int, Node] = {}
    gone: set[int] = set()
    for members in groups.values():
        if len(members) < 2 or not owned(owns, members):
            continue
        first = members[0]
        rounded = any(len(m.inputs) > 9 for m in members)
        inputs = list(first.inputs[:3])
        for m in members:
            slots = [*m.inputs[3:], *[""] * (3 + ROUNDED_SLOTS - len(m.inputs))]
            inputs += slots if rounded else slots[:6]
        while inputs and not inputs[-1]:
            inputs.pop()
        attrs = {"quantize_a": int(first.attr("quantize_a", 0)), "dequantize": int(first.attr("dequantize", 0)),
                 "trans_b": [int(m.attr("transB", 0)) for m in members]}
        if rounded:
            attrs["rounded"] = 1
        fused = Node("QuantizedMatMulGroup", inputs, [m.outputs[0] for m in members], name=f"{first.name}/group",
                     domain=FUSED_DOMAIN, opset=1, attrs=attrs)
        replaced[id(first)] = fused
        gone.update(id(m) for m in members[1:])
    if not replaced:
        return False
    graph.nodes = [replaced.get(id(n), n) for n in graph.nodes if id(n) not in gone]
    return True

