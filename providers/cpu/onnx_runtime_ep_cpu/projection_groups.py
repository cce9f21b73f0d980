"""An attention's query, key and value projections of one input as one product.

Both torch exporters write a layer's projections as three products of the same normalized input, each with or
without a bias (MatMul, or the FusedMatMul that fusions.py makes of MatMul + Add), read by the 3-D Attention that
attention_heads.py folds:

    Attention(A @ Wq [+ bq], A @ Wk [+ bk], A @ Wv [+ bv], ...)
      ->  q, k, v = ProjectionGroup(A, [Wq | Wk | Wv], [bq | bk | bv]; widths)
          Attention(q, k, v, ...)

One product over the weights side by side reads A once and pays one step's fixed cost instead of three; the
outputs are column views of it, which the attention reads in place (ops/transformer.py). A member without a bias
gets zeros (adding zero changes no value). Applied where every member's weight is a constant float32 matrix of
one row count, its bias (if any) a constant vector of its width, its output read only by that Attention and by
nothing else. The merged weights replace the members' (they are dropped where no other node reads them).

A decoder's projections of one input reach their attention through head splits and rotary embeddings, and a
gated feed-forward block's gate and up products meet in SwishMul, or in a Mul after an activation of the gate:

    ReshapeTranspose(A @ Wq), ReshapeTranspose(A @ Wk), ReshapeTranspose(A @ Wv)  (rotary after, on the heads)
    SwishMul(A @ Wg, A @ Wu)
    GeluMul(A @ Wg, A @ Wu)  (Gemma's Mul(Gelu(A @ Wg), A @ Wu), fused by decoder_fusions.py)

group_sibling_projections merges any such products of one input the same way, where every reader of each
member's output takes a column view as it takes a whole array (_VIEW_READERS), in specialized plans where the
product is below the packed_macs knob (larger ones keep ops/linalg.py's packed product). A product already merged
(GPT-2's c_attn, Phi-3's qkv_proj and gate_up_proj, or the optimizer's sibling MatMuls) and cut along its last
axis into such readers' inputs is one too (split_projection_outputs): by a Split, or by Slices of adjacent
constant column ranges that cover it once (Phi-3's exports), whose copies become the product's column views; a
FusedMatMul into which norm_projections already folded a normalization counts (over symbolic lengths the generic
plan folds it before a specialized plan's static shapes allow the group: onnxruntime's optimized decoders, whose
normalization feeds the merged product directly), the group taking the normalization over. A
part whose only reader is an Add of a constant bias of its width (OPT's merged q/k/v: the product without its
biases, each added after the Split) takes that bias into the group's, so the Add's readers read the view. An
int8_dynamic export's DynamicQuantizeMatMul cut the same way (Phi-3's, GPT-2's c_attn) keeps its product and gives
the parts as its column views (split_dynamic_quantize_outputs).

Last, a member whose only reader is its head split (ReshapeTranspose) comes out split (fold_head_splits): the
group's kernel reshapes and transposes the column as the split did, and at a decode step's one token (where the
transpose moves only axes of length 1) its members are slices of the product reshaped once, so a layer's q, k
and v cost one step, not four. A split's target dimension 0 that copies the column's (TorchScript's [0, 0, heads,
size]) is read off the column's static shape in a specialized plan. An int8_dynamic export's columns node folds its
head splits the same way (GPT-2's and Phi-3's q, k and v).
"""

from __future__ import annotations

import math
import weakref

import numpy as np
from onnx_runtime.ir import Graph, Node
from onnx_runtime.optimizer.rewrite import add_initializer, forget_value, fresh_name

from .fusions import FUSED_DOMAIN, GraphView, other_input, owned
from .tuning import KNOBS

_F32 = np.dtype(np.float32)
# (ids of the members' weights and biases) -> (weak references to them, the merged weight, the merged bias): each
# specialized graph (session/specialize.py) is fused again over the same constants and shares their merge; an
# entry goes when the first member's weight does (the session that owns it closed).
_MERGED: dict[tuple, tuple] = {}
_MERGED_LIMIT = 256


def _folded_norm(view: GraphView, fed: set[str], node: Node) -> tuple[list[str], dict] | None:
    """(the scale and shift inputs, the normalization's attributes) of a FusedMatMul without activation or residual
    into which norm_projections folded its normalization, else None. A generic plan folds it before a specialized
    plan (static shapes) may group the product: the ProjectionGroup takes the normalization over."""
    if node.op_type != "FusedMatMul" or node.domain != FUSED_DOMAIN or not node.attr("normalize", "") \
            or node.attr("activation", "none") != "none" or len(node.inputs) not in (5, 6) or node.inputs[3]:
        return None
    tail = list(node.inputs[4:])
    if not tail[0] or fed & set(tail) or any(name and view.const(name) is None for name in tail):
        return None
    return tail, {"normalize": node.attr("normalize"), "norm_epsilon": float(node.attr("norm_epsilon", 1e-5))}


def _member(view: GraphView, fed: set[str], node: Node | None, normalized: bool = False) -> tuple | None:
    """(A, weight, bias or None) of a product this pass merges, else None; with ``normalized``, a FusedMatMul
    carrying a folded normalization (_folded_norm) too, A then being the normalization's input."""
    if node is None:
        return None
    if node.op_type == "MatMul" and node.domain in ("", "ai.onnx") and len(node.inputs) == 2:
        bias = None
    elif node.op_type == "FusedMatMul" and node.domain == FUSED_DOMAIN and len(node.inputs) == 3 \
            and node.attr("activation", "none") == "none":
        bias = view.const(node.inputs[2])
        if bias is None:
            return None
    elif normalized and _folded_norm(view, fed, node) is not None:
        bias = view.const(node.inputs[2]) if node.inputs[2] else None
        if node.inputs[2] and bias is None:
            return None
    else:
        return None
    weight = view.const(node.inputs[1])
    if fed & set(node.inputs[1:]):  # initializers a feed may override
        return None
    if not node.inputs[0] or view.const(node.inputs[0]) is not None or weight is None or weight.ndim != 2 \
            or weight.dtype != _F32 or (bias is not None and (bias.dtype != _F32 or bias.shape != weight.shape[1:])):
        return None
    return node.inputs[0], weight, bias


def merged(weights: list[np.ndarray], biases: list[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray | None]:
    """The members' weights side by side, and their biases (zeros for a member without one; None if none has
    one), made once per set of constant arrays."""
    key = tuple(id(w) for w in weights) + tuple(id(b) for b in biases)
    known = _MERGED.get(key)
    arrays = [*weights, *(b for b in biases if b is not None)]
    if known is not None and len(known[0]) == len(arrays) and all(r() is a for r, a in zip(known[0], arrays)):
        return known[1], known[2]
    weight = np.concatenate(weights, axis=1)
    bias = None if all(b is None for b in biases) else np.concatenate(
        [np.zeros(w.shape[1], _F32) if b is None else b.reshape(-1) for w, b in zip(weights, biases)])
    weight.flags.writeable = False
    if bias is not None:
        bias.flags.writeable = False
    if len(_MERGED) >= _MERGED_LIMIT:
        _MERGED.clear()
    try:
        _MERGED[key] = ([weakref.ref(a) for a in arrays], weight, bias)
        weakref.finalize(weights[0], _MERGED.pop, key, None)  # gone with the session's weights, not kept after
    except TypeError:  # an array type without weak references: not kept
        pass
    return weight, bias


def kept_merges() -> int:
    """How many merged weight sets are kept (one per live set of member weights)."""
    return len(_MERGED)


def _members(view: GraphView, fed: set[str], attention: Node) -> tuple[list[Node], list[tuple]]:
    """The products of the Attention's query, key and value this pass merges, with their (A, weight, bias): the
    largest set reading one A whose weights have one row count."""
    members: list[Node] = []
    parts: list[tuple] = []
    for name in attention.inputs[:3]:
        node = view.producer.get(name) if name else None
        part = _member(view, fed, node)
        readers = view.consumers.get(name, [])
        if part is None or node in members or len(readers) != 1 or readers[0] is not attention \
                or attention.inputs.count(name) != 1 or name in view.outputs or name in view.inner_reads:
            continue
        members.append(node)
        parts.append(part)
    by_input: dict[tuple, list[int]] = {}
    for index, part in enumerate(parts):
        by_input.setdefault((part[0], part[1].shape[0]), []).append(index)
    chosen = max(by_input.values(), key=len, default=[])
    return [members[i] for i in chosen], [parts[i] for i in chosen]


def group_attention_projections(graph: Graph, owns=None) -> bool:
    """Merge the products feeding each Attention's query, key and value (see the module docstring)."""
    view, fed = GraphView(graph), {vi.name for vi in graph.inputs}
    changed = False
    for attention in list(graph.nodes):
        if attention.op_type != "Attention" or attention.domain not in ("", "ai.onnx") or len(attention.inputs) < 3:
            continue
        members, parts = _members(view, fed, attention)
        if len(members) < 2 or not owned(owns, members):
            continue
        _group(graph, members, parts, view)
        view = GraphView(graph)
        changed = True
    return changed


# (op_type, domain) of the readers that take a member's column view of the merged product as a whole array: the
# head split reshapes it, SwishMul, GeluMul and the Gelus copy a strided operand before their compiled pass,
# Attention reads it in place, Mul is numpy's (a gated feed-forward block whose gate has its own activation where
# GeluMul did not fuse).
_VIEW_READERS = frozenset({("ReshapeTranspose", FUSED_DOMAIN), ("SwishMul", FUSED_DOMAIN), ("GeluMul", FUSED_DOMAIN),
                           ("Attention", ""), ("Attention", "ai.onnx"), ("Gelu", ""), ("Gelu", "ai.onnx"),
                           ("Gelu", "com.microsoft"), ("FastGelu", "com.microsoft"), ("Mul", ""), ("Mul", "ai.onnx")})


def _view_read(view: GraphView, name: str) -> bool:
    """Whether ``name`` is read, only by _VIEW_READERS, and is no graph output or subgraph read."""
    readers = view.consumers.get(name, [])
    return bool(readers) and name not in view.outputs and name not in view.inner_reads \
        and all((reader.op_type, reader.domain) in _VIEW_READERS for reader in readers)


def _blas_sized(graph: Graph, a: str, depth: int, total: int) -> bool:
    """Whether A's shape is static (a specialized plan) and its product by a (depth, total) weight is below the
    packed_macs knob: ProjectionGroup's kernel runs one BLAS product, where a MatMul or FusedMatMul of more
    multiply-adds runs the packed product (ops/linalg.py)."""
    info = graph.type_of(a)
    shape = info.static_shape if info is not None and info.is_tensor else None
    return shape is not None and len(shape) >= 1 and shape[-1] == depth \
        and math.prod(shape[:-1]) * depth * total < KNOBS.packed_macs


def group_sibling_projections(graph: Graph, owns=None) -> bool:
    """Merge the products of one input (weights of one row count) whose outputs only _VIEW_READERS read (see the
    module docstring)."""
    view, fed = GraphView(graph), {vi.name for vi in graph.inputs}
    siblings: dict[tuple, list[tuple[Node, tuple]]] = {}
    for node in graph.nodes:
        part = _member(view, fed, node)
        if part is not None and len(node.outputs) == 1 and _view_read(view, node.outputs[0]):
            siblings.setdefault((part[0], part[1].shape[0]), []).append((node, part))
    changed = False
    for (a, depth), found in siblings.items():
        members = [node for node, _ in found]
        if len(members) < 2 or not _blas_sized(graph, a, depth, sum(int(p[1].shape[1]) for _, p in found)) \
                or not owned(owns, members):
            continue
        _group(graph, members, [part for _, part in found], view)
        changed = True
    return changed


def _group(graph: Graph, members: list[Node], parts: list[tuple], view: GraphView) -> None:
    """One ProjectionGroup of ``members`` (their (A, weight, bias) ``parts``) in their place."""
    weight, bias = merged([part[1] for part in parts], [part[2] for part in parts])
    first = members[0]
    weight_name = fresh_name(graph, f"{first.name or 'projection'}/group_weight")
    add_initializer(graph, weight_name, weight)
    inputs = [parts[0][0], weight_name]
    if bias is not None:
        bias_name = fresh_name(graph, f"{first.name or 'projection'}/group_bias")
        add_initializer(graph, bias_name, bias)
        inputs.append(bias_name)
    fused = Node("ProjectionGroup", inputs, [m.outputs[0] for m in members], name=f"{first.name}/group",
                 domain=FUSED_DOMAIN, attrs={"widths": [int(part[1].shape[1]) for part in parts]}, opset=1)
    _replace(graph, members, fused, view)


def _replace(graph: Graph, members: list[Node], fused: Node, view: GraphView) -> None:
    """``fused`` where the first member was (its inputs: A, produced before every member, and constants); the
    members' weights and biases that nothing else reads dropped."""
    gone = {id(m) for m in members}
    position = min(graph.nodes.index(m) for m in members)
    nodes = [n for n in graph.nodes if id(n) not in gone]
    nodes.insert(sum(1 for n in graph.nodes[:position] if id(n) not in gone), fused)
    graph.nodes = nodes
    still_read = {name for node in graph.nodes for name in node.inputs} | view.outputs | view.inner_reads
    for member in members:
        for name in member.inputs[1:]:
            if name not in still_read and graph.initializers.pop(name, None) is not None:
                forget_value(graph, name)


def _split_widths(view: GraphView, split: Node, total: int, rank: int | None) -> list[int] | None:
    """The widths a Split of a (..., total) product's last axis cuts (its sizes, or equal parts), else None."""
    axis = int(split.attr("axis", 0))
    if axis != -1 and (rank is None or axis != rank - 1):
        return None
    count = len(split.outputs)
    if split.opset >= 13:
        sizes = view.const(split.inputs[1]) if len(split.inputs) > 1 and split.inputs[1] else None
        if sizes is None and len(split.inputs) > 1 and split.inputs[1]:
            return None  # sizes computed at run time
    else:
        sizes = split.attr("split")
    if sizes is None:
        widths = [total // count] * count if count and total % count == 0 else None
    else:
        widths = [int(w) for w in np.asarray(sizes).reshape(-1)]
    if widths is None or len(widths) != count or sum(widths) != total or min(widths) <= 0:
        return None
    return widths


def _split_parts(view: GraphView, names: list[str], widths: list[int]) -> list[tuple] | None:
    """Per cut part ``names`` (of ``widths``): (the name its readers read, the constant bias added to it or None,
    that Add or None), where each part is read only by _VIEW_READERS, or only by an Add of a constant float32
    vector of its width whose output they alone read; else None."""
    parts = []
    for name, width in zip(names, widths):
        if _view_read(view, name):
            parts.append((name, None, None))
            continue
        add = view.only_consumer(name, "Add")
        bias_name = other_input(add, name) if add is not None and add.domain in ("", "ai.onnx") else None
        bias = view.const(bias_name) if bias_name else None
        if bias is None or bias.dtype != _F32 or bias.shape != (width,) or len(add.outputs) != 1 \
                or not _view_read(view, add.outputs[0]):
            return None
        parts.append((add.outputs[0], bias, add))
    return parts


def _ints(view: GraphView, fed: set[str], node: Node, index: int) -> list[int] | None:
    """Slice input ``index`` of ``node`` as ints where it is a constant vector (not one a feed may override);
    [] where the input is absent; None where it is computed."""
    if len(node.inputs) <= index or not node.inputs[index]:
        return []
    value = None if node.inputs[index] in fed else view.const(node.inputs[index])
    if value is None or value.ndim != 1 or value.dtype.kind not in "iu":
        return None
    return [int(v) for v in value]


def _slice_span(view: GraphView, fed: set[str], node: Node, name: str, total: int,
                rank: int | None) -> tuple[int, int] | None:
    """The columns [start, end) of a (..., total) ``name`` that the Slice ``node`` cuts: constant bounds of the last
    axis alone, step 1, a part of at least one column; else None."""
    if node.op_type != "Slice" or node.domain not in ("", "ai.onnx") or not node.inputs \
            or node.inputs[0] != name or node.inputs.count(name) != 1 or len(node.outputs) != 1 \
            or not node.outputs[0]:
        return None
    if node.opset >= 10:
        starts, ends, axes, steps = (_ints(view, fed, node, index) for index in (1, 2, 3, 4))
    else:
        starts, ends, axes, steps = (None if node.attr(key) is None else [int(v) for v in node.attr(key)]
                                     for key in ("starts", "ends", "axes", "steps"))
        axes, steps = axes or [], []
    if starts is None or ends is None or axes is None or steps is None or len(starts) != 1 or len(ends) != 1 \
            or len(axes) > 1 or steps not in ([], [1]):
        return None
    axis = axes[0] if axes else 0  # (no axes: the first, the last only for a vector)
    if axis != -1 and (rank is None or axis != rank - 1):
        return None
    start, end = (min(max(bound + total if bound < 0 else bound, 0), total) for bound in (starts[0], ends[0]))
    return (start, end) if end > start else None


def _slice_cuts(view: GraphView, fed: set[str], name: str, total: int,
                rank: int | None) -> tuple[list[Node], list[str], list[int]] | None:
    """(the Slices, their outputs in column order, their widths) where ``name`` is read only by two or more Slices
    of its last axis that cut it into adjacent parts covering every column once (Phi-3's fused q/k/v and
    gate/up), else None."""
    readers = view.consumers.get(name, [])
    if len(readers) < 2 or len({id(reader) for reader in readers}) != len(readers):
        return None
    spans = []
    for reader in readers:
        span = _slice_span(view, fed, reader, name, total, rank)
        if span is None:
            return None
        spans.append((span, reader))
    spans.sort(key=lambda found: found[0])
    at = 0
    for (start, end), _reader in spans:
        if start != at:
            return None
        at = end
    if at != total:
        return None
    return [reader for _span, reader in spans], [reader.outputs[0] for _span, reader in spans], \
        [end - start for (start, end), _reader in spans]


def _cuts(view: GraphView, fed: set[str], name: str, total: int,
          rank: int | None) -> tuple[list[Node], list[str], list[int]] | None:
    """(the nodes cutting ``name``, the parts in column order, their widths): one Split of its last axis, or
    Slices of it (_slice_cuts); else None."""
    readers = view.consumers.get(name, [])
    if len(readers) == 1 and readers[0].op_type == "Split":
        split = readers[0]
        if split.domain not in ("", "ai.onnx") or split.inputs[:1] != [name] or split.inputs.count(name) != 1 \
                or not all(split.outputs):
            return None
        widths = _split_widths(view, split, total, rank)
        return None if widths is None else ([split], list(split.outputs), widths)
    return _slice_cuts(view, fed, name, total, rank)


def _cut_group_inputs(graph: Graph, product: Node, biased: bool, parts: list[tuple], widths: list[int],
                      norm: tuple | None) -> list[str]:
    """The ProjectionGroup's inputs for a cut product: A, the weight, its bias (or the parts' Adds' biases side by
    side, a new initializer), then a folded normalization's scale and shift as norm_projections writes a group's."""
    inputs = [*product.inputs[:2], product.inputs[2] if biased else ""]
    if any(add is not None for _read, _bias, add in parts):
        bias = np.concatenate([np.zeros(width, _F32) if b is None else b
                               for (_read, b, _add), width in zip(parts, widths)])
        inputs[2] = fresh_name(graph, f"{product.name or 'projection'}/group_bias")
        add_initializer(graph, inputs[2], bias)
    if norm:
        return inputs + norm[0]
    return inputs if inputs[2] else inputs[:2]


def split_projection_outputs(graph: Graph, owns=None) -> bool:
    """Each product cut along its last axis, by one Split or by Slices, into _VIEW_READERS' inputs (directly, or
    through an Add of a constant bias per part) as one ProjectionGroup over the same weight (see the module
    docstring)."""
    view, fed = GraphView(graph), {vi.name for vi in graph.inputs}
    changed = False
    for product in list(graph.nodes):
        part = _member(view, fed, product, normalized=True)
        if part is None or len(product.outputs) != 1:
            continue
        name = product.outputs[0]
        if name in view.outputs or name in view.inner_reads:
            continue
        norm = _folded_norm(view, fed, product)
        info = graph.type_of(name)
        rank = len(info.shape) if info is not None and info.is_tensor and info.shape is not None else None
        cut = _cuts(view, fed, name, int(part[1].shape[1]), rank)
        if cut is None:
            continue
        cutters, names, widths = cut
        parts = _split_parts(view, names, widths)
        adds = [] if parts is None else [add for _name, _bias, add in parts if add is not None]
        # (a product with its own bias keeps the Adds: adding the two biases first would round differently)
        if parts is None or (adds and part[2] is not None) or not _blas_sized(graph, part[0], *part[1].shape) \
                or not owned(owns, [product, *cutters, *adds]):
            continue
        fused = Node("ProjectionGroup", _cut_group_inputs(graph, product, part[2] is not None, parts, widths, norm),
                     [read for read, _bias, _add in parts], name=f"{product.name}/group", domain=FUSED_DOMAIN,
                     attrs={"widths": widths, **(norm[1] if norm else {})}, opset=1)
        _replace(graph, [product, *cutters, *adds], fused, view)
        still_read = {n for node in graph.nodes for n in node.inputs} | view.outputs | view.inner_reads
        for add in adds:  # (an Add's bias may be its first input, which _replace leaves)
            for bias_name in add.inputs:
                if bias_name not in still_read and graph.initializers.pop(bias_name, None) is not None:
                    forget_value(graph, bias_name)
        view = GraphView(graph)
        changed = True
    return changed


def _dynamic_quantized_width(view: GraphView, fed: set[str], node: Node) -> int | None:
    """The column count of a contrib DynamicQuantizeMatMul by a constant 2-D weight with constant parameters (none a
    feed may override), else None."""
    if node.op_type != "DynamicQuantizeMatMul" or node.domain != "com.microsoft" or len(node.outputs) != 1 \
            or not 3 <= len(node.inputs) <= 5 or not node.inputs[0] or fed & set(node.inputs[1:]):
        return None
    weight = view.const(node.inputs[1])
    if weight is None or weight.ndim != 2 or any(name and view.const(name) is None for name in node.inputs[2:]):
        return None
    return int(weight.shape[1])


def split_dynamic_quantize_outputs(graph: Graph, owns=None) -> bool:
    """The int8_dynamic spelling of split_projection_outputs: a DynamicQuantizeMatMul cut along its last axis, by one
    Split or by Slices, into _VIEW_READERS' inputs (Phi-3's q/k/v into their head splits, gate/up into SwishMul)
    becomes one DynamicQuantizeMatMulColumns (ops/dynamic_quantize_group.py) whose outputs are the product's column
    views. The product is unchanged (one node already), so no size rule applies."""
    view, fed = GraphView(graph), {vi.name for vi in graph.inputs}
    changed = False
    for product in list(graph.nodes):
        total = _dynamic_quantized_width(view, fed, product)
        name = product.outputs[0] if total is not None else ""
        if not name or name in view.outputs or name in view.inner_reads:
            continue
        info = graph.type_of(name)
        rank = len(info.shape) if info is not None and info.is_tensor and info.shape is not None else None
        cut = _cuts(view, fed, name, total, rank)
        if cut is None or not all(_view_read(view, part) for part in cut[1]) or not owned(owns, [product, *cut[0]]):
            continue
        cutters, names, widths = cut
        fused = Node("DynamicQuantizeMatMulColumns", list(product.inputs), names, name=f"{product.name}/columns",
                     domain=FUSED_DOMAIN, attrs={"widths": widths}, opset=1)
        _replace(graph, [product, *cutters], fused, view)
        view = GraphView(graph)
        changed = True
    return changed


def _head_split(graph: Graph, view: GraphView, name: str) -> tuple[Node, list[int]] | None:
    """(the ReshapeTranspose, its layout [rank, *shape, *perm]) where that fused head split is the only reader of
    ``name`` (no graph output or subgraph read) and its target shape is constant, else None. A 0 that copies the
    column's dimension (TorchScript's [0, 0, heads, size]) is read off the column's static shape (a specialized
    plan's); without one it depends on the column's shape at run time, and the split stays."""
    readers = view.consumers.get(name, [])
    if len(readers) != 1 or name in view.outputs or name in view.inner_reads:
        return None
    split = readers[0]
    if split.op_type != "ReshapeTranspose" or split.domain != FUSED_DOMAIN or split.inputs != [name] \
            or len(split.outputs) != 1 or not split.outputs[0]:
        return None
    shape = [int(d) for d in np.asarray(split.attr("shape", [])).reshape(-1)]
    perm = [int(p) for p in split.attr("perm", [])]
    if 0 in shape and not int(split.attr("allowzero", 0)):
        info = graph.type_of(name)
        column = info.static_shape if info is not None and info.is_tensor else None
        if column is not None and all(axis < len(column) for axis, d in enumerate(shape) if d == 0):
            shape = [column[axis] if d == 0 else d for axis, d in enumerate(shape)]
    if not shape or 0 in shape or shape.count(-1) > 1 or sorted(perm) != list(range(len(shape))):
        return None
    return split, [len(shape), *shape, *perm]


# The column-view groups whose kernels take a ``layouts`` attribute (ops/projection_group.py's columns)
_LAYOUT_GROUPS = ("ProjectionGroup", "DynamicQuantizeMatMulColumns")


def fold_head_splits(graph: Graph, owns=None) -> bool:
    """A ProjectionGroup's (or DynamicQuantizeMatMulColumns') outputs that a head split (ReshapeTranspose) alone
    reads come out split: the group's kernel reshapes and transposes its column views as the split did (attribute
    ``layouts``), one step instead of one per member (a decode step's q, k and v). Runs after the passes that read
    ReshapeTranspose (the 3-D attention fold, the patch embedding)."""
    view = GraphView(graph)
    changed = False
    for group in list(graph.nodes):
        if group.op_type not in _LAYOUT_GROUPS or group.domain != FUSED_DOMAIN or group.attr("layouts") is not None:
            continue
        splits = [_head_split(graph, view, name) for name in group.outputs]
        found = [split for split, _layout in filter(None, splits)]
        if not found or not owned(owns, [group, *found]):
            continue
        layouts = [value for found_split in splits for value in (found_split[1] if found_split else [0])]
        outputs = [found_split[0].outputs[0] if found_split else name
                   for name, found_split in zip(group.outputs, splits)]
        fused = Node(group.op_type, list(group.inputs), outputs, name=group.name, domain=FUSED_DOMAIN,
                     attrs={**dict(group.attrs), "layouts": layouts}, opset=group.opset)
        gone = {id(split) for split in found}
        graph.nodes = [fused if node is group else node for node in graph.nodes if id(node) not in gone]
        for name, found_split in zip(group.outputs, splits):
            if found_split:
                forget_value(graph, name)
        view = GraphView(graph)
        changed = True
    return changed
