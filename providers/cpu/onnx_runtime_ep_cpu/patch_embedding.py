"""A vision transformer's patch embedding as one product.

Both torch exporters write ViT's patch embedding as a convolution whose stride equals its kernel (no padding,
no dilation, one group), then flatten(2).transpose(1, 2) into tokens, which decoder_fusions.py makes one
ReshapeTranspose:

    ReshapeTranspose(Conv(x, W, b; kernel = stride), perm (0, 2, 1))  ->  PatchEmbedding(x, W^T, b)

Each output position reads its own patch and no other, so the convolution is the patches laid out as rows
(a copy of x in another order) times the weight as a (C * kh * kw, M) matrix, plus the bias: one BLAS product
that writes the tokens (N, patches, M) in place of a general convolution path and a layout step. Applied where
x's shape is static, the weight and bias are constant float32, and the convolution's output feeds only the
ReshapeTranspose.

In a static-QDQ export the convolution's output is rounded to its 8-bit grid first (qdq_fusions' QuantizeDequantize,
one scale and zero point) and the layout reads the rounded values. The rounding is elementwise, so it moves past
the layout: Conv -> QuantizeDequantize -> ReshapeTranspose becomes PatchEmbedding -> QuantizeDequantize on the
tokens.

Both exporters then put the class token (and any other learned tokens) before the patches and add the position
table: Concat(Expand(cls), tokens; axis 1) -> Add(., positions). fuse_patch_tokens folds those into the node too:

    Add(Concat(C, PatchEmbedding(x, W, b); axis 1), P)  ->  PatchEmbedding(x, W, b, C + P[:c], P[c:])

The leading rows C + P[:c] are constants (the same for every image) and each patch row's (x W + b) + P[c + t]
is added in the unfused graph's order as the product is stored, so the values are the unfused graph's, in one
step instead of three. Either half applies alone (no class token, or no position table). Applied where the
tokens' shape is static, the leading tokens are constant float32 rows equal across the batch (an Expand the
specialized plan folded), the position table a constant float32 array that broadcasts to (1, c + T, M), and
each intermediate is read only by the next node.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node, ValueInfo
from onnx_runtime.optimizer.rewrite import add_initializer, forget_value, fresh_name

from .fusions import FUSED_DOMAIN, GraphView, owned, replace_nodes

_F32 = np.dtype(np.float32)


def _static(graph: Graph, name: str) -> tuple | None:
    info = graph.type_of(name)
    shape = info.static_shape if info is not None and info.is_tensor else None
    return tuple(shape) if shape is not None else None


def _patch_kernel(conv: Node, weight: np.ndarray) -> tuple[int, int] | None:
    """(kh, kw) of a 2-D convolution whose stride is its kernel, without padding, dilation or groups; else None."""
    kernel = tuple(int(k) for k in conv.attr("kernel_shape", weight.shape[2:]))
    pads = [int(p) for p in conv.attr("pads", [0] * 4)]
    if weight.ndim != 4 or kernel != weight.shape[2:] or tuple(int(s) for s in conv.attr("strides", [1, 1])) != kernel \
            or any(pads) or any(int(d) != 1 for d in conv.attr("dilations", [1, 1])) or int(conv.attr("group", 1)) != 1:
        return None
    auto_pad = conv.attr("auto_pad", "NOTSET")
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    return (int(kernel[0]), int(kernel[1])) if auto_pad in ("NOTSET", "VALID") else None


def _tokens(view: GraphView, conv: Node, x_shape: tuple, weight: np.ndarray) -> tuple[Node, Node | None] | None:
    """The ReshapeTranspose that makes the convolution's output (N, M, Hp, Wp) tokens (N, Hp * Wp, M), its only
    reader or the only reader of a per-tensor rounding that is the convolution's only reader, and that rounding
    (or None); else None."""
    rounding, out = None, conv.outputs[0]
    readers = view.consumers.get(out, [])
    if len(readers) == 1 and _per_tensor_rounding(view, readers[0]) and out not in view.outputs \
            and out not in view.inner_reads:
        rounding, out = readers[0], readers[0].outputs[0]
        readers = view.consumers.get(out, [])
    if len(readers) != 1 or out in view.outputs or out in view.inner_reads:
        return None
    layout = readers[0]
    if layout.op_type != "ReshapeTranspose" or layout.domain != FUSED_DOMAIN \
            or list(layout.attr("perm", [])) != [0, 2, 1]:
        return None
    conv_shape, tokens = _static(view.graph, conv.outputs[0]), _static(view.graph, layout.outputs[0])
    if conv_shape is None or tokens is None or len(conv_shape) != 4:
        return None
    batch, channels, rows, columns = conv_shape
    if (batch, channels) != (x_shape[0], weight.shape[0]) or tokens != (batch, rows * columns, channels):
        return None
    return layout, rounding


def _per_tensor_rounding(view: GraphView, node: Node) -> bool:
    """Whether ``node`` is a QuantizeDequantize of one output with a constant scale and zero point of one value
    each (elementwise: it commutes with a layout change)."""
    if node.op_type != "QuantizeDequantize" or node.domain != FUSED_DOMAIN or len(node.inputs) != 3 \
            or len(node.outputs) != 1:
        return False
    scale, zero = view.const(node.inputs[1]), view.const(node.inputs[2])
    return scale is not None and zero is not None and scale.size == 1 and zero.size == 1


def fuse_patch_embedding(graph: Graph, owns=None) -> bool:
    """Each patch-embedding convolution and its token layout as one PatchEmbedding (see the module docstring)."""
    view, changed = GraphView(graph), False
    fed = {vi.name for vi in graph.inputs}
    for conv in list(graph.nodes):
        if conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or not 2 <= len(conv.inputs) <= 3 \
                or len(conv.outputs) != 1 or fed & set(conv.inputs[1:]):
            continue
        weight = view.const(conv.inputs[1])
        bias = view.const(conv.inputs[2]) if len(conv.inputs) == 3 and conv.inputs[2] else None
        x_shape = _static(graph, conv.inputs[0])
        if weight is None or weight.dtype != _F32 or weight.ndim != 4 or (len(conv.inputs) == 3 and conv.inputs[2] and (
                bias is None or bias.dtype != _F32 or bias.shape != weight.shape[:1])) \
                or x_shape is None or len(x_shape) != 4 or x_shape[1] != weight.shape[1]:
            continue
        patch = _patch_kernel(conv, weight)
        found = _tokens(view, conv, x_shape, weight) if patch is not None else None
        members = [conv, *(n for n in found[::-1] if n is not None)] if found is not None else []
        if found is None or not owned(owns, members):
            continue
        layout, rounding = found
        matrix = np.ascontiguousarray(weight.reshape(weight.shape[0], -1).T)
        name = fresh_name(graph, f"{conv.name or 'conv'}/patch_weight")
        add_initializer(graph, name, matrix)
        inputs = [conv.inputs[0], name] + ([conv.inputs[2]] if bias is not None else [])
        tokens = list(layout.outputs) if rounding is None else [fresh_name(graph, f"{conv.name or 'conv'}/tokens")]
        fused = Node("PatchEmbedding", inputs, tokens, name=f"{conv.name}/patches",
                     domain=FUSED_DOMAIN, attrs={"kernel_shape": list(patch)}, opset=1)
        replace_nodes(graph, members, fused)
        if rounding is not None:  # the rounding on the tokens, after the product
            graph.value_info[tokens[0]] = ValueInfo(tokens[0], graph.type_of(layout.outputs[0]))
            moved = Node(rounding.op_type, [tokens[0], *rounding.inputs[1:]], list(layout.outputs),
                         name=rounding.name, domain=rounding.domain, attrs=dict(rounding.attrs), opset=rounding.opset)
            graph.nodes.insert(graph.nodes.index(fused) + 1, moved)
        if not any(conv.inputs[1] in node.inputs for node in graph.nodes) and conv.inputs[1] not in view.outputs \
                and conv.inputs[1] not in view.inner_reads:
            graph.initializers.pop(conv.inputs[1], None)
            forget_value(graph, conv.inputs[1])
        view = GraphView(graph)
        changed = True
    return changed


def _only_reader(view: GraphView, name: str, op_type: str) -> Node | None:
    readers = view.consumers.get(name, [])
    if len(readers) != 1 or name in view.outputs or name in view.inner_reads:
        return None
    node = readers[0]
    return node if node.op_type == op_type and node.domain in ("", "ai.onnx") and node.inputs.count(name) == 1 \
        else None


def _leading(view: GraphView, concat: Node | None, tokens: tuple) -> np.ndarray | None:
    """The (c, M) rows a Concat puts before the patch tokens (its last input), each the same for every image;
    else None."""
    if concat is None or len(concat.inputs) < 2 or int(concat.attr("axis", 0)) not in (1, -2):
        return None
    batch, _, width = tokens
    blocks = [view.const(name) for name in concat.inputs[:-1]]
    if any(b is None or b.dtype != _F32 or b.ndim != 3 or b.shape[0] != batch or b.shape[2] != width for b in blocks):
        return None
    rows = np.concatenate(blocks, axis=1)
    return rows[0] if all(np.array_equal(rows[i], rows[0]) for i in range(1, batch)) else None


def _positions(view: GraphView, out: str, shape: tuple) -> tuple[Node, np.ndarray] | None:
    """The Add of a constant float32 table broadcasting to (1, c + T, M) that is ``out``'s only reader (``shape``:
    its (N, c + T, M)), and the table as (c + T, M); else None."""
    add = _only_reader(view, out, "Add")
    if add is None or len(add.inputs) != 2 or _static(view.graph, add.outputs[0]) != shape:
        return None
    table, rows = view.const(add.inputs[1] if add.inputs[0] == out else add.inputs[0]), (1, *shape[1:])
    try:
        fits = table is not None and table.dtype == _F32 and np.broadcast_shapes(table.shape, rows) == rows
    except ValueError:
        return None
    return (add, np.broadcast_to(table, rows)[0]) if fits else None


def _constant_inputs(graph: Graph, name: str, **values) -> list[str]:
    """An initializer per value that is not None, named after ``name``; "" for those that are."""
    inputs = []
    for part, value in values.items():
        if value is None:
            inputs.append("")
            continue
        inputs.append(fresh_name(graph, f"{name}/{part}"))
        add_initializer(graph, inputs[-1], np.ascontiguousarray(value, dtype=_F32))
    return inputs


def fuse_patch_tokens(graph: Graph, owns=None) -> bool:
    """Each PatchEmbedding's leading-token Concat and position Add folded into it (see the module docstring)."""
    view, changed = GraphView(graph), False
    for patches in list(graph.nodes):
        if patches.op_type != "PatchEmbedding" or patches.domain != FUSED_DOMAIN or len(patches.inputs) > 3:
            continue
        tokens = _static(graph, patches.outputs[0])
        if tokens is None or len(tokens) != 3:
            continue
        batch, count, width = tokens
        members, out = [patches], patches.outputs[0]
        concat = _only_reader(view, out, "Concat")
        head = _leading(view, concat, tokens) if concat is not None and concat.inputs[-1] == out else None
        if head is not None:
            members.append(concat)
            out = concat.outputs[0]
        lead = 0 if head is None else head.shape[0]
        positions = _positions(view, out, (batch, lead + count, width))
        table = None
        if positions is not None:
            members.append(positions[0])
            out, table = positions[0].outputs[0], positions[1]
            head = None if head is None else head + table[:lead]  # (float32, as the unfused Add makes these rows)
        if len(members) == 1 or not owned(owns, members) or _static(graph, out) != (batch, lead + count, width):
            continue
        inputs = list(patches.inputs) + [""] * (3 - len(patches.inputs)) + _constant_inputs(
            graph, patches.name or "patches", head=head, positions=None if table is None else table[lead:])
        while inputs[-1] == "":
            inputs.pop()
        fused = Node("PatchEmbedding", inputs, [out], name=f"{patches.name}/tokens", domain=FUSED_DOMAIN,
                     attrs=dict(patches.attrs), opset=patches.opset)
        replace_nodes(graph, members, fused)
        view = GraphView(graph)
        changed = True
    return changed
