"""Attention over the projections' own layout: the head split and merge around an Attention node folded into
the node.

Both torch exporters split each projection into heads as Reshape(B, S, H, D) -> Transpose(0, 2, 1, 3) and merge
the result back as Transpose(0, 2, 1, 3) -> Reshape(B, S, H * D); decoder_fusions.py makes those pairs
ReshapeTranspose and TransposeReshape nodes, and the optimizer's attention fusion leaves a 4-D Attention between
them. ONNX's Attention also takes 3-D (B, S, H * D) inputs with ``q_num_heads``/``kv_num_heads`` and returns Y as
(B, S, H * Dv), so

    TransposeReshape(Attention(ReshapeTranspose(q), ReshapeTranspose(k), ReshapeTranspose(v), mask))
      ->  Attention(q, k, v, mask; q_num_heads, kv_num_heads)

is the same computation in one node instead of five: a short sequence's attention paid more for the four layout
steps (calls, transposed copies) than for its arithmetic. The kernel reads the heads in place (ops/transformer.py).
Applied where the shapes are static (a specialized plan), the layout steps feed nothing else, and the Attention
has no past inputs and no outputs beyond Y.
"""

from __future__ import annotations

from onnx_runtime.ir import Graph, Node

from .fusions import FUSED_DOMAIN, owned, replace_nodes
from .past_attention import fuse_past_attention
from .patch_embedding import fuse_patch_embedding, fuse_patch_tokens
from .projection_groups import (
    fold_head_splits,
    group_attention_projections,
    group_sibling_projections,
    split_dynamic_quantize_outputs,
    split_projection_outputs,
)

_HEADS = [0, 2, 1, 3]


def _static(graph: Graph, name: str) -> tuple | None:
    info = graph.type_of(name)
    return info.static_shape if info is not None and info.is_tensor else None


def _only_reader(consumers: dict, outputs: set, name: str, reader: Node) -> bool:
    readers = consumers.get(name, [])
    return name not in outputs and len(readers) == 1 and readers[0] is reader and reader.inputs.count(name) == 1


def _split(graph: Graph, producers: dict, consumers: dict, outputs: set, name: str, attention: Node):
    """(the ReshapeTranspose making ``name``, its 3-D input, heads) where ``name`` is the heads of a (B, S, H * D)
    value split as (B, H, S, D) and read only by ``attention``; else None."""
    node = producers.get(name)
    if node is None or node.op_type != "ReshapeTranspose" or node.domain != FUSED_DOMAIN \
            or list(node.attr("perm", [])) != _HEADS or not _only_reader(consumers, outputs, name, attention):
        return None
    source, heads = _static(graph, node.inputs[0]), _static(graph, name)
    if source is None or heads is None or len(source) != 3 or len(heads) != 4 \
            or (heads[0], heads[2], heads[1] * heads[3]) != tuple(source) or heads[1] <= 0:
        return None
    return node, node.inputs[0], heads[1]


def fuse_attention_heads(graph: Graph, owns=None) -> bool:
    """Fold each Attention's head split and merge into it (see the module docstring)."""
    changed = False
    producers, consumers = graph.producers(), graph.consumers()
    outputs = {vi.name for vi in graph.outputs} | {name for node in graph.nodes for sub in node.subgraphs()
                                                     for name in sub.outer_names}
    for attention in list(graph.nodes):
        if attention.op_type != "Attention" or attention.domain not in ("", "ai.onnx") \
                or len(attention.outputs) != 1 or not 3 <= len(attention.inputs) <= 4 or not all(attention.inputs[:3]):
            continue
        parts = [_split(graph, producers, consumers, outputs, name, attention) for name in attention.inputs[:3]]
        readers = consumers.get(attention.outputs[0], [])
        if any(part is None for part in parts) or len(readers) != 1 or attention.outputs[0] in outputs:
            continue
        merge = readers[0]
        merged, heads = _static(graph, merge.outputs[0]), _static(graph, attention.outputs[0])
        if merge.op_type != "TransposeReshape" or merge.domain != FUSED_DOMAIN \
                or list(merge.attr("perm", [])) != _HEADS or merged is None or heads is None or len(heads) != 4 \
                or tuple(merged) != (heads[0], heads[2], heads[1] * heads[3]) or parts[1][2] != parts[2][2]:
            continue
        removed = [part[0] for part in parts] + [attention, merge]
        if not owned(owns, removed):
            continue
        inputs = [part[1] for part in parts] + attention.inputs[3:]
        attrs = {**attention.attrs, "q_num_heads": parts[0][2], "kv_num_heads": parts[1][2]}
        fused = Node("Attention", inputs, [merge.outputs[0]], name=f"{attention.name}/heads", domain=attention.domain,
                     attrs=attrs, opset=attention.opset)
        replace_nodes(graph, removed, fused)
        producers, consumers = graph.producers(), graph.consumers()
        changed = True
    return changed


def drop_zero_masks(graph: Graph, owns=None) -> bool:
    """Drop an Attention's constant mask that changes no score: a float mask of zeros or a boolean one of True
    over every key (ViT's dynamo export folds such a mask out of its shape subgraph). Kept where it could matter:
    a mask narrower than the keys (the keys past it are masked), past inputs (the keys' count is theirs plus
    k's), the scores as an output."""
    changed = False
    for node in list(graph.nodes):
        if node.op_type != "Attention" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 4 \
                or not node.inputs[3] or len(node.outputs) > 3:
            continue
        mask, queries, keys = (graph.initializers.get(node.inputs[3]), _static(graph, node.inputs[0]),
                               _static(graph, node.inputs[1]))
        if mask is None or queries is None or keys is None or len(queries) != len(keys) or len(keys) not in (3, 4):
            continue
        scores = (queries[0], queries[1], queries[2], keys[2]) if len(keys) == 4 else \
            (queries[0], int(node.attr("q_num_heads", 0)), queries[1], keys[1])
        if mask.ndim == 0 or mask.ndim > 4 or mask.shape[-1] != scores[3] \
                or any(d not in (1, full) for d, full in zip(mask.shape[::-1], scores[::-1])):
            continue
        if not (mask.dtype == bool and mask.all() or mask.dtype.kind == "f" and not mask.any()) \
                or not owned(owns, [node]):
            continue
        replace_nodes(graph, [node], Node("Attention", node.inputs[:3], list(node.outputs), name=node.name,
                                          domain=node.domain, attrs=dict(node.attrs), opset=node.opset))
        changed = True
    return changed


# The provider's last passes (after decoder_fusions.py's layout pairs, which the patch embedding also reads; the
# cache appends fold into attention once the projections' head splits have folded).
HEADS_PASSES = [fuse_attention_heads, drop_zero_masks, group_attention_projections, group_sibling_projections,
                split_projection_outputs, split_dynamic_quantize_outputs, fuse_patch_embedding, fuse_patch_tokens,
                fold_head_splits, fuse_past_attention]
