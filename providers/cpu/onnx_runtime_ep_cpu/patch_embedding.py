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
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node
from onnx_runtime.optimizer.rewrite import add_initializer, forget_value

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


def _tokens(view: GraphView, conv: Node, x_shape: tuple, weight: np.ndarray) -> Node | None:
    """The ReshapeTranspose that makes the convolution's output (N, M, Hp, Wp) tokens (N, Hp * Wp, M), its only
    reader; else None."""
    out = conv.outputs[0]
    readers = view.consumers.get(out, [])
    if len(readers) != 1 or out in view.outputs or out in view.inner_reads:
        return None
    layout = readers[0]
    if layout.op_type != "ReshapeTranspose" or layout.domain != FUSED_DOMAIN \
            or list(layout.attr("perm", [])) != [0, 2, 1]:
        return None
    conv_shape, tokens = _static(view.graph, out), _static(view.graph, layout.outputs[0])
    if conv_shape is None or tokens is None or len(conv_shape) != 4:
        return None
    batch, channels, rows, columns = conv_shape
    if (batch, channels) != (x_shape[0], weight.shape[0]) or tokens != (batch, rows * columns, channels):
        return None
    return layout


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
        if weight is None or weight.dtype != _F32 or (len(conv.inputs) == 3 and conv.inputs[2] and (
                bias is None or bias.dtype != _F32 or bias.shape != weight.shape[:1])) \
                or x_shape is None or len(x_shape) != 4 or x_shape[1] != weight.shape[1]:
            continue
        patch = _patch_kernel(conv, weight)
        layout = _tokens(view, conv, x_shape, weight) if patch is not None else None
        if layout is None or not owned(owns, [conv, layout]):
            continue
        matrix = np.ascontiguousarray(weight.reshape(weight.shape[0], -1).T)
        name, index = f"{conv.name or 'conv'}/patch_weight", 0
        while name in graph.initializers or graph.type_of(name) is not None:
            index += 1
            name = f"{conv.name or 'conv'}/patch_weight_{index}"
        add_initializer(graph, name, matrix)
        inputs = [conv.inputs[0], name] + ([conv.inputs[2]] if bias is not None else [])
        fused = Node("PatchEmbedding", inputs, list(layout.outputs), name=f"{conv.name}/patches",
                     domain=FUSED_DOMAIN, attrs={"kernel_shape": list(patch)}, opset=1)
        replace_nodes(graph, [conv, layout], fused)
        if not any(conv.inputs[1] in node.inputs for node in graph.nodes) and conv.inputs[1] not in view.outputs \
                and conv.inputs[1] not in view.inner_reads:
            graph.initializers.pop(conv.inputs[1], None)
            forget_value(graph, conv.inputs[1])
        view = GraphView(graph)
        changed = True
    return changed
