"""A QDQ decoder's rotate-half rotary embedding as one node (ops/qdq_rotary.py, compiled/rounded_rotary.py).

LLaMA-style decoders rotate q and k by x * cos + concat(-x[..., half:], x[..., :half]) * sin; quantize_static
rounds the activations between those operators. After the earlier QDQ passes the chain reads, in both torch
exporters' forms (the dynamo export's Slice axis is 3, the torchscript one's -1):

    MulRounded(x, cos); Slice(x, 0:half), Slice(x, half:end) -> GridTable (Neg, rounding) or NegRounded ->
      ConcatRounded -> MulRounded(sin); Add or AddRounded of the two products
      ->  RoundedRotary(x, cos, sin, the four or five roundings' grids)

seven steps of a few dozen values per q or k in a decode call, as one pass with the same float32 values bit for
bit. Applied where x is float32 with a static last dimension that the second Slice reaches, every rounding's
parameters are constant scalars, and each intermediate value is read by the next node alone (no graph output, no
subgraph). Runs after qdq_epilogues.fold_rounding_epilogues, which makes the Rounded nodes.
"""

from __future__ import annotations

from onnx_runtime.ir import Graph, Node

from .fusions import FUSED_DOMAIN, GraphView, fuse_chains, slice_bounds

_QDQ = f"{FUSED_DOMAIN}:QuantizeDequantize:1"


def _sole(view: GraphView, name: str, op_types: tuple, domain: str) -> Node | None:
    """The one node reading ``name``, when it is one of ``op_types`` of ``domain`` and reads it once."""
    readers = view.consumers.get(name, [])
    if len(readers) != 1 or name in view.outputs or name in view.inner_reads:
        return None
    node = readers[0]
    return node if node.op_type in op_types and node.domain == domain and node.inputs.count(name) == 1 else None


def _scalars(view: GraphView, names) -> bool:
    return all(name and (value := view.const(name)) is not None and value.size == 1 for name in names)


def _negation(node: Node | None) -> tuple | None:
    """(input, grid scale, grid zero point) of a rounded negation: NegRounded, or a GridTable whose chain is Neg
    then one rounding of it; else None."""
    if node is None or node.domain != FUSED_DOMAIN:
        return None
    if node.op_type == "NegRounded" and len(node.inputs) == 3:
        return tuple(node.inputs)
    if node.op_type != "GridTable" or len(node.inputs) != 5:
        return None
    chain, wiring, names = node.attr("chain"), node.attr("wiring"), node.attr("names")
    if chain is None or wiring is None or names is None or len(chain) != 2 or len(wiring) != 2:
        return None
    op = str(chain[0]).split(":")
    root, scale, zero = node.inputs[0], node.inputs[3], node.inputs[4]
    if op[:2] != ["", "Neg"] or str(chain[1]) != _QDQ or list(names) != [root, scale, zero]:
        return None
    head, _, middle = str(wiring[0]).partition("|")
    if head != root or str(wiring[1]) != f"{middle},{scale},{zero}|{node.outputs[0]}":
        return None
    return root, scale, zero


def _chain(graph: Graph, view: GraphView, concat: Node) -> tuple | None:
    """(nodes, fused inputs, half, end, output) of a rotation whose rounded concatenation is ``concat``; else None."""
    if concat.op_type != "ConcatRounded" or concat.domain != FUSED_DOMAIN or len(concat.inputs) != 4 \
            or not _scalars(view, concat.inputs[2:]):
        return None
    negation = view.producer.get(concat.inputs[0])
    found = _negation(negation)
    low, high = view.producer.get(concat.inputs[1]), view.producer.get(found[0]) if found else None
    if high is None or low is None or low.inputs[0] != high.inputs[0] or not _scalars(view, found[1:]):
        return None
    x = low.inputs[0]
    info = graph.type_of(x)
    shape = info.shape if info is not None and info.is_tensor else None
    if not shape or not isinstance(shape[-1], int) or info.dtype is None or info.dtype.numpy != "float32":
        return None
    axis = int(concat.attr("axis", 0))
    low_bounds, high_bounds = slice_bounds(view, low), slice_bounds(view, high)
    if axis not in (-1, len(shape) - 1) or low_bounds is None or high_bounds is None or low_bounds[0] != 0 \
            or high_bounds != (low_bounds[1], shape[-1]):
        return None
    if _sole(view, high.outputs[0], (negation.op_type,), FUSED_DOMAIN) is not negation \
            or _sole(view, negation.outputs[0], ("ConcatRounded",), FUSED_DOMAIN) is not concat \
            or _sole(view, low.outputs[0], ("ConcatRounded",), FUSED_DOMAIN) is not concat:
        return None
    rotate = _sole(view, concat.outputs[0], ("MulRounded",), FUSED_DOMAIN)
    if rotate is None or len(rotate.inputs) != 4 or not _scalars(view, rotate.inputs[2:]):
        return None
    sin = rotate.inputs[1] if rotate.inputs[0] == concat.outputs[0] else rotate.inputs[0]
    add = _sole(view, rotate.outputs[0], ("Add",), "") or _sole(view, rotate.outputs[0], ("AddRounded",), FUSED_DOMAIN)
    if add is None or len(add.inputs) != (2 if add.domain == "" else 4) or not _scalars(view, add.inputs[2:]):
        return None
    other = add.inputs[1] if add.inputs[0] == rotate.outputs[0] else add.inputs[0]
    direct = view.producer.get(other)
    if direct is None or direct.op_type != "MulRounded" or direct.domain != FUSED_DOMAIN or len(direct.inputs) != 4 \
            or x not in direct.inputs[:2] or not _scalars(view, direct.inputs[2:]) \
            or _sole(view, other, (add.op_type,), add.domain) is not add:
        return None
    cos = direct.inputs[1] if direct.inputs[0] == x else direct.inputs[0]
    inputs = [x, cos, sin, *direct.inputs[2:], *found[1:], *concat.inputs[2:], *rotate.inputs[2:], *add.inputs[2:]]
    return [direct, low, high, negation, concat, rotate, add], inputs, low_bounds[1], shape[-1]


def fuse_rounded_rotary(graph: Graph, owns=None) -> bool:
    """Every rotation the module doc names becomes one RoundedRotary where its Add was."""
    if not any(n.op_type == "ConcatRounded" and n.domain == FUSED_DOMAIN for n in graph.nodes):
        return False
    return fuse_chains(graph, owns, _chain, _rotary)


def _rotary(found) -> Node:
    nodes, inputs, half, end = found
    add = nodes[-1]
    return Node("RoundedRotary", inputs, [add.outputs[0]], name=f"{add.name}/rotary", domain=FUSED_DOMAIN,
                attrs={"half": half, "end": end}, opset=1)
