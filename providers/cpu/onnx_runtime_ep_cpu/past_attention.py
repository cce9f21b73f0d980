"""A decoder layer's cache appends and head merge folded into its attention: one PastAttention step instead of four.

Both torch exporters write a decoder-with-past layer's attention as

    present_key = Concat(past_key, k, axis=2);  present_value = Concat(past_value, v, axis=2)
    y = TransposeReshape(Attention(q, present_key, present_value, mask))   (the merge of decoder_fusions.py)

(GPT-2, LLaMA and OPT alike, grouped-query heads included once repeat_kv is folded). At a decode step's one token
each of the four is a step whose dispatch and checks cost more than its work, so

    y, present_key, present_value = PastAttention(q, k, v, mask, past_key, past_value)

computes the same values in one (ops/past_attention.py): the appends go where the bound run lets them
(kv_append.py, in place in the cache's buffer) and the attention reads the grown cache there; Y comes out merged
where the merge was folded (attribute ``merge_shape``, the merge's target shape). Applied where both Concats
append along the keys' axis of 4-D pasts and feed only this Attention (and the graph's outputs), and the Attention
gives Y alone.
"""

from __future__ import annotations

from onnx_runtime.ir import Graph, Node

from .fused_domain import FUSED_DOMAIN
from .fusions import GraphView, owned, replace_nodes

_HEADS = [0, 2, 1, 3]


def _rank(graph: Graph, name: str) -> int | None:
    info = graph.type_of(name)
    return len(info.shape) if info is not None and info.is_tensor and info.shape is not None else None


def _append(graph: Graph, view: GraphView, name: str, attention: Node) -> Node | None:
    """The Concat(past, new) along axis 2 of 4-D values that makes ``name``, read only by ``attention`` (besides
    the graph's outputs); else None."""
    node = view.producer.get(name)
    if node is None or node.op_type != "Concat" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2 \
            or not all(node.inputs) or name in view.inner_reads:
        return None
    if _rank(graph, node.inputs[0]) != 4 or _rank(graph, node.inputs[1]) not in (4, None):
        return None
    if int(node.attr("axis", 0)) not in (2, -2):
        return None
    readers = view.consumers.get(name, [])
    return node if len(readers) == 1 and readers[0] is attention and attention.inputs.count(name) == 1 else None


def _merge(view: GraphView, attention: Node) -> Node | None:
    """The TransposeReshape merging the heads of ``attention``'s Y, its only reader; else None."""
    y = attention.outputs[0]
    readers = view.consumers.get(y, [])
    if len(readers) != 1 or y in view.outputs or y in view.inner_reads:
        return None
    merge = readers[0]
    if merge.op_type != "TransposeReshape" or merge.domain != FUSED_DOMAIN or list(merge.attr("perm", [])) != _HEADS:
        return None
    # A flattened (B * S, H * D) target is left to fusions.fuse_gemm_view, which reshapes it for its product.
    shape = merge.attr("shape")
    if shape is None or len(shape) != 3 or merge.attr("allowzero", 0) and 0 in list(shape):
        return None  # (allowzero matters only where the target holds a 0: dynamo's exports set it)
    return merge


def fuse_past_attention(graph: Graph, owns=None) -> bool:
    """Fold each decoder layer's two cache Concats and head merge into its Attention (see the module docstring)."""
    changed = False
    view = GraphView(graph)
    for attention in list(graph.nodes):
        if attention.op_type == "PastAttention" and attention.domain == FUSED_DOMAIN \
                and attention.attr("merge_shape") is None:  # a merge the Gemm fusion has since given three axes
            merge = _merge(view, attention)
            if merge is not None and owned(owns, [attention, merge]):
                attrs = {**attention.attrs, "merge_shape": [int(d) for d in merge.attr("shape")]}
                outputs = [merge.outputs[0]] + list(attention.outputs[1:])
                replace_nodes(graph, [attention, merge], Node("PastAttention", list(attention.inputs), outputs,
                                                              name=attention.name, domain=FUSED_DOMAIN, attrs=attrs,
                                                              opset=attention.opset))
                graph.value_info.pop(attention.outputs[0], None)
                view = GraphView(graph)
                changed = True
            continue
        if attention.op_type != "Attention" or attention.domain not in ("", "ai.onnx") \
                or len(attention.outputs) != 1 or not 3 <= len(attention.inputs) <= 4 \
                or not all(attention.inputs[:3]) or _rank(graph, attention.inputs[0]) != 4:
            continue
        key, value = (_append(graph, view, name, attention) for name in attention.inputs[1:3])
        if key is None or value is None or key is value:
            continue
        merge = _merge(view, attention)
        removed = [key, value, attention] + ([merge] if merge is not None else [])
        if not owned(owns, removed):
            continue
        mask = attention.inputs[3] if len(attention.inputs) == 4 else ""
        attrs = dict(attention.attrs)
        if merge is not None:
            attrs["merge_shape"] = [int(d) for d in merge.attr("shape")]
        fused = Node("PastAttention", [attention.inputs[0], key.inputs[1], value.inputs[1], mask, key.inputs[0],
                                       value.inputs[0]],
                     [(merge or attention).outputs[0], key.outputs[0], value.outputs[0]],
                     name=f"{attention.name}/past", domain=FUSED_DOMAIN, attrs=attrs, opset=attention.opset)
        replace_nodes(graph, removed, fused)
        if merge is not None:
            graph.value_info.pop(attention.outputs[0], None)
        view = GraphView(graph)
        changed = True
    return changed


PAST_ATTENTION_PASSES = [fuse_past_attention]
