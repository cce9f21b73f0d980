"""A QDQ decoder's attention from its scores' product to its context's as one node (ops/qdq_attention.py,
compiled/rounded_attention.py).

After the earlier QDQ passes a quantize_static decoder's attention reads, in both torch exporters' GPT-2, LLaMA
and T5 decoders:

    [Transpose(keys)] -> QuantizedMatMul or GroupedQuantizedMatMul (the scores) -> GridTable (the scale) and/or
      AddRounded (mask, position bias) -> Softmax -> QuantizedMatMul or GroupedQuantizedMatMul (the context)
      ->  RoundedAttention(the chain's outside inputs)

five or six steps over a few hundred values in a decode call, each paying the run loop, its kernel's checks and
a fresh array. The fused node keeps the chain's nodes in plain attributes (table_chains.py's spelling: ``chain``,
``wiring``, ``{index}.{name}``); its kernel runs them as one compiled pass with the same values, or the nodes
themselves where a call's shapes or parameters are not the pass's. Applied where both products quantize both
operands and dequantize their output (no bias, no rounded add), the steps between are at most four (two tables,
two adds) each reading the previous value alone, the Softmax is over the last axis (opset 13 on), and each
intermediate value is read by the next node alone (no graph output, no subgraph).
"""

from __future__ import annotations

from onnx_runtime.ir import Graph, Node

from .fusions import FUSED_DOMAIN, GraphView, fuse_chains

PRODUCTS = ("QuantizedMatMul", "GroupedQuantizedMatMul")
MAX_TABLES = MAX_ADDS = 2


def _sole(view: GraphView, name: str) -> Node | None:
    readers = view.consumers.get(name, [])
    if len(readers) != 1 or name in view.outputs or name in view.inner_reads or readers[0].inputs.count(name) != 1:
        return None
    return readers[0]


def _product(node: Node | None, transposed: int) -> bool:
    """A stacked QDQ product of two quantized activations with a float32 output and nothing added (a grouped
    one reading its keys transposed for the scores, its values as they are for the context)."""
    if node is None or node.domain != FUSED_DOMAIN or node.op_type not in PRODUCTS:
        return False
    own = 8 if node.op_type == "QuantizedMatMul" else 10
    attrs = node.attrs or {}
    return len(node.inputs) == own and all(int(attrs.get(k, 0)) for k in ("quantize_a", "quantize_b", "dequantize")) \
        and not any(k in attrs for k in ("transB", "alpha", "beta")) \
        and (node.op_type == "QuantizedMatMul" or int(attrs.get("transposed_b", 0)) == transposed)


def _keys_transpose(view: GraphView, scores: Node) -> Node | None:
    """The plain Transpose swapping the last two axes of the keys that only the scores' product reads."""
    node = view.producer.get(scores.inputs[3])
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") \
            or [int(p) for p in node.attr("perm", [])] != [0, 1, 3, 2] or _sole(view, node.outputs[0]) is not scores:
        return None
    return node


def _static(graph: Graph, name: str) -> tuple | None:
    info = graph.type_of(name)
    return tuple(info.shape) if info is not None and info.is_tensor and info.shape is not None else None


def _enlarges(graph: Graph, scores: Node, steps: list) -> bool:
    """Whether the graph's shapes show an addend (or the keys) broadcasting the scores beyond q's batch, head and
    row dimensions, which the node's shape rule (MatMul's over q and the values) would not give (where they do not
    tell, the kernel refuses such a call: ops/qdq_attention.py)."""
    q = _static(graph, scores.inputs[0])
    if q is None or len(q) != 4:
        return True
    others, current = [], scores.outputs[0]
    for step in steps:
        if step.op_type == "AddRounded":
            others.append(_static(graph, step.inputs[1] if step.inputs[0] == current else step.inputs[0]))
        current = step.outputs[0]
    keys = _static(graph, scores.inputs[3])
    if keys is not None and scores.op_type == "QuantizedMatMul":
        others.append(keys[:2] + (1, 1))
    for shape in others:
        if shape is None or not 1 <= len(shape) <= 4:
            return True
        for d, mine in zip(shape[:-1], q[4 - len(shape):3]):  # (aligned on the right, the last axis apart)
            if isinstance(d, int) and isinstance(mine, int) and d not in (1, mine):
                return True
    return False


def _find(graph: Graph, view: GraphView, node: Node) -> tuple | None:
    if not _product(node, 1):
        return None
    nodes, current, tables, adds = [node], node, 0, 0
    while True:
        step = _sole(view, current.outputs[0])
        if step is None:
            return None
        if step.domain == FUSED_DOMAIN and step.op_type == "GridTable" and step.inputs[0] == current.outputs[0] \
                and tables < MAX_TABLES:
            tables += 1
        elif step.domain == FUSED_DOMAIN and step.op_type == "AddRounded" and len(step.inputs) == 4 \
                and current.outputs[0] in step.inputs[:2] and adds < MAX_ADDS:
            adds += 1
        elif step.op_type == "Softmax" and step.domain in ("", "ai.onnx") and step.opset >= 13 \
                and int(step.attr("axis", -1)) == -1:
            break
        else:
            return None
        nodes.append(step)
        current = step
    nodes.append(step)
    context = _sole(view, step.outputs[0])
    if not _product(context, 0) or context.inputs[0] != step.outputs[0] or context.op_type != node.op_type:
        return None  # (one product grouped and not the other: fold_repeated_kv may not have reached the second)
    if _enlarges(graph, node, nodes[1:-1]):
        return None
    transpose = _keys_transpose(view, node) if node.op_type == "QuantizedMatMul" else None
    chain = ([transpose] if transpose is not None else []) + nodes + [context]
    if any("," in name or "|" in name for n in chain for name in [*n.inputs, *n.outputs]):
        return None  # (the attributes spell the chain's values with those separators)
    return chain, node


def _make(found: tuple) -> Node:
    chain = found[0]
    made = {n.outputs[0] for n in chain}
    inputs = [found[1].inputs[0], chain[-1].inputs[3]]  # q and the values first: the shape rule's operands
    for n in chain:
        inputs += [name for name in n.inputs if name and name not in made and name not in inputs]
    attrs: dict = {"chain": [f"{n.domain}:{n.op_type}:{n.opset}" for n in chain],
                   "wiring": [",".join(n.inputs) + "|" + n.outputs[0] for n in chain]}
    for index, n in enumerate(chain):
        attrs.update({f"{index}.{key}": value for key, value in (n.attrs or {}).items()})
    last = chain[-1]
    return Node("RoundedAttention", inputs, [last.outputs[0]], name=f"{last.name}/attention", domain=FUSED_DOMAIN,
                opset=1, attrs=attrs)


def fuse_rounded_attention(graph: Graph, owns=None) -> bool:
    """Every chain of the module doc becomes one RoundedAttention node where its context's product was."""
    if not any(n.op_type == "Softmax" for n in graph.nodes):
        return False
    return fuse_chains(graph, owns, _find, _make)
