"""A decoder's normalization folded into the projection that alone reads it.

Both torch exporters write each layer's normalized input read by one product: GPT-2's ln_1 by the grouped q/k/v
projection, ln_2 by the feed-forward's first product (with its Gelu), a Llama's RMS norms by the grouped
q/k/v and gate/up projections:

    LayerNormalization(X, scale, shift) -> ProjectionGroup(., W, bias)       (or FusedMatMul(., B, bias[, R]))
      ->  ProjectionGroup(X, W, bias, scale, shift; normalize="layer", norm_epsilon)

The reader normalizes X itself (ops/norm_in_front.py: the normalization node's own kernel), and at a decode
step's few rows its bound product runs the normalization and the product as one compiled call
(compiled/normed_rows.py), one kernel call fewer per normalization; many rows (a prefill) run the normalization
kernel and then the reader's product as before. Applied where the normalization is over the last axis with
float32 statistics and one output, its scale (and shift) constant float32 vectors, its output read by nothing
else (no graph output, no subgraph), and the reader a ProjectionGroup, or a FusedMatMul without relu or residual
(the bound call adds none after a normalization), reading it as its A alone. Runs after projection grouping
(attention_heads.HEADS_PASSES), which makes the groups it folds into.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node

from .fused_domain import FUSED_DOMAIN
from .fusions import GraphView, owned, replace_nodes

_F32 = np.dtype(np.float32)
# The normalizations folded, by (domain, op type): the reader's ``normalize`` kind.
_KINDS = {("", "LayerNormalization"): "layer", ("", "RMSNormalization"): "rms"}
_READERS = ("ProjectionGroup", "FusedMatMul")


def _vector(view: GraphView, name: str, depth: int | None) -> np.ndarray | None:
    array = view.const(name) if name else None
    if array is None or array.dtype != _F32 or array.ndim != 1 or (depth is not None and array.shape != (depth,)):
        return None
    return array


def _folds(view: GraphView, norm: Node) -> tuple | None:
    """(kind, its reader) where ``norm`` folds into the one product reading it, else None."""
    kind = _KINDS.get((norm.domain, norm.op_type))
    if kind is None or int(norm.attr("axis", -1)) != -1 or int(norm.attr("stash_type", 1)) != 1 \
            or len(norm.inputs) < 2 or any(norm.outputs[1:]):
        return None
    output = norm.outputs[0]
    readers = view.consumers.get(output, [])
    if len(readers) != 1 or output in view.outputs or output in view.inner_reads:
        return None
    reader = readers[0]
    if reader.domain != FUSED_DOMAIN or reader.op_type not in _READERS or reader.attr("normalize", "") \
            or reader.inputs[0] != output or output in reader.inputs[1:] \
            or (reader.op_type == "FusedMatMul" and (reader.attr("activation", "none") == "relu"
                                                     or any(reader.inputs[3:]))):
        return None
    weight = view.const(reader.inputs[1]) if len(reader.inputs) > 1 else None
    if weight is None or weight.ndim != 2 or weight.dtype != _F32:
        return None
    depth = weight.shape[0]
    scale = _vector(view, norm.inputs[1], depth)
    shifted = kind == "layer" and len(norm.inputs) > 2 and norm.inputs[2]
    if scale is None or (shifted and _vector(view, norm.inputs[2], depth) is None):
        return None
    return kind, reader


def fold_norms_into_projections(graph: Graph, owns=None) -> bool:
    """Each normalization that _folds allows becomes its reader's ``normalize`` (see the module's docstring)."""
    view = GraphView(graph)
    changed = False
    for norm in list(graph.nodes):
        found = _folds(view, norm)
        if found is None or not owned(owns, [norm, found[1]]):
            continue
        kind, reader = found
        shift = norm.inputs[2] if kind == "layer" and len(norm.inputs) > 2 else ""
        # The reader's inputs padded to its optional ones (ProjectionGroup's bias, FusedMatMul's residual), then
        # the scale and shift.
        arity = 3 if reader.op_type == "ProjectionGroup" else 4
        inputs = [norm.inputs[0], *reader.inputs[1:]] + [""] * (arity - len(reader.inputs))
        fused = Node(reader.op_type, [*inputs, norm.inputs[1], shift], list(reader.outputs), name=reader.name,
                     domain=reader.domain, opset=reader.opset,
                     attrs={**reader.attrs, "normalize": kind, "norm_epsilon": float(norm.attr("epsilon", 1e-5))})
        replace_nodes(graph, [norm, reader], fused)
        graph.value_info.pop(norm.outputs[0], None)
        view = GraphView(graph)
        changed = True
    return changed


NORM_PASSES = [fold_norms_into_projections]
