"""Graph fusions for the small per-token chains of a transformer decoder, run after fusions.py's passes
(they read the RMSNormalization and Swish nodes those create).

On a decode step every tensor is a row of a few hundred values, so a node costs its dispatch and its
kernel's per-call overhead, not its arithmetic; each pass here removes one node per match:

- residual add, then RMS normalization: Add(a, b) -> RMSNormalization  ->  SkipRMSNormalization(a, b, w),
  which outputs the normalized sum and the sum (the residual stream reads it too)
- SwiGLU's gate: Swish(a) -> Mul(., b)  ->  SwishMul(a, b)
- GeGLU's gate (Gemma): Gelu(a) -> Mul(., b)  ->  GeluMul(a, b), for ONNX's Gelu (either approximation),
  contrib's Gelu and FastGelu without a bias
- splitting heads: Reshape(x, constant shape) -> Transpose  ->  ReshapeTranspose(x)
- merging heads: Transpose(x) -> Reshape(., constant shape)  ->  TransposeReshape(x)

A last pass records the output shapes of the fused operators (and Attention's) where shape inference
left them unknown.

Each fusion pass matches exactly (every intermediate read only inside the pattern) and leaves anything
else alone.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime.ir import Graph, Node, TypeInfo, ValueInfo

from .fusions import FUSED_DOMAIN, GraphView, other_input, owned, replace_nodes, until_fixed
from .gemm_epilogues import fuse_gemm_relu


def _rank(graph: Graph, name: str) -> int | None:
    info = graph.type_of(name)
    return len(info.shape) if info is not None and info.is_tensor and info.shape is not None else None


def _is(node: Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and not node.domain


def fuse_skip_rms_norm(graph: Graph, owns=None) -> bool:
    view = GraphView(graph)
    for norm in list(graph.nodes):
        if not _is(norm, "RMSNormalization") or len(norm.inputs) != 2 or len(norm.outputs) != 1:
            continue
        add = view.made_by(norm.inputs[0], "Add")
        if add is None or len(add.inputs) != 2 or not all(add.inputs):
            continue
        axis, rank = int(norm.attr("axis", -1)), _rank(graph, norm.inputs[0])
        if (axis != -1 and (rank is None or axis != rank - 1)) or not owned(owns, [add, norm]):
            continue  # the fused kernel normalizes the last axis (a broadcasting add takes its numpy path)
        attrs = {"epsilon": float(norm.attr("epsilon", 1e-5)), "stash_type": int(norm.attr("stash_type", 1))}
        fused = Node("SkipRMSNormalization", [*add.inputs, norm.inputs[1]], [norm.outputs[0], add.outputs[0]],
                     name=f"{norm.name}/skip", domain=FUSED_DOMAIN, attrs=attrs, opset=1)
        replace_nodes(graph, [add, norm], fused)
        return True
    return False


def fuse_swish_mul(graph: Graph, owns=None) -> bool:
    view = GraphView(graph)
    for swish in list(graph.nodes):
        if not _is(swish, "Swish"):
            continue
        gate = view.only_consumer(swish.outputs[0], "Mul")
        other = other_input(gate, swish.outputs[0]) if gate else None
        if other is None or other == swish.outputs[0] or not owned(owns, [swish, gate]):
            continue
        fused = Node("SwishMul", [swish.inputs[0], other], list(gate.outputs), name=f"{gate.name}/swish_mul",
                     domain=FUSED_DOMAIN, attrs={"alpha": float(swish.attr("alpha", 1.0))}, opset=1)
        replace_nodes(graph, [swish, gate], fused)
        return True
    return False


def _gelu_form(node: Node) -> str | None:
    """The approximation a one-input Gelu computes ("none": erf, "tanh"), else None."""
    if len(node.inputs) != 1 or len(node.outputs) != 1:
        return None
    if node.op_type == "Gelu" and node.domain in ("", "ai.onnx"):
        form = node.attr("approximate", "none")
        return form if form in ("none", "tanh") else None
    if node.domain == "com.microsoft":
        return {"Gelu": "none", "FastGelu": "tanh"}.get(node.op_type)
    return None


def fuse_gelu_mul(graph: Graph, owns=None) -> bool:
    view = GraphView(graph)
    for gelu in list(graph.nodes):
        form = _gelu_form(gelu)
        gate = view.only_consumer(gelu.outputs[0], "Mul") if form is not None else None
        other = other_input(gate, gelu.outputs[0]) if gate else None
        if other is None or other == gelu.outputs[0] or not owned(owns, [gelu, gate]):
            continue
        fused = Node("GeluMul", [gelu.inputs[0], other], list(gate.outputs), name=f"{gate.name}/gelu_mul",
                     domain=FUSED_DOMAIN, attrs={"approximate": form}, opset=1)
        replace_nodes(graph, [gelu, gate], fused)
        return True
    return False


def _constant_shape(view: GraphView, reshape: Node) -> np.ndarray | None:
    """The target shape of a Reshape (opset >= 5) when it is a constant, else None."""
    if reshape.opset < 5 or len(reshape.inputs) != 2:
        return None
    shape = view.const(reshape.inputs[1])
    return shape.reshape(-1).astype(np.int64) if shape is not None and shape.dtype.kind in "iu" else None


def _perm(node: Node, rank: int | None) -> list[int] | None:
    """A Transpose's permutation; None reverses the axes, which needs the rank."""
    perm = node.attr("perm")
    if perm is not None:
        return [int(p) for p in perm]
    return list(range(rank - 1, -1, -1)) if rank is not None else None


def _fuse_layout_pair(graph: Graph, kind: str, first: Node, second: Node, reshape: Node, shape, perm) -> None:
    """Replace ``first -> second`` (a Reshape and a Transpose, in either order) by one ``kind`` node."""
    attrs = {"shape": shape.tolist(), "perm": perm, "allowzero": int(reshape.attr("allowzero", 0))}
    fused = Node(kind, [first.inputs[0]], list(second.outputs), name=f"{second.name}/{kind}",
                 domain=FUSED_DOMAIN, attrs=attrs, opset=1)
    replace_nodes(graph, [first, second], fused)


def fuse_reshape_transpose(graph: Graph, owns=None) -> bool:
    # Every pair in one scan (a CNN's channel shuffles have dozens): a pair is two nodes that only
    # read each other, so fusing one leaves the others' producers and consumers as the view saw them.
    view, changed = GraphView(graph), False
    for reshape in list(graph.nodes):
        if not _is(reshape, "Reshape"):
            continue
        shape = _constant_shape(view, reshape)
        transpose = view.only_consumer(reshape.outputs[0], "Transpose") if shape is not None else None
        perm = _perm(transpose, len(shape)) if transpose else None
        if perm is not None and sorted(perm) == list(range(len(shape))) and owned(owns, [reshape, transpose]):
            _fuse_layout_pair(graph, "ReshapeTranspose", reshape, transpose, reshape, shape, perm)
            changed = True
    return changed


def fuse_transpose_reshape(graph: Graph, owns=None) -> bool:
    view, changed = GraphView(graph), False  # every pair in one scan, as above
    for transpose in list(graph.nodes):
        if not _is(transpose, "Transpose"):
            continue
        reshape = view.only_consumer(transpose.outputs[0], "Reshape")
        shape = _constant_shape(view, reshape) if reshape else None
        perm = _perm(transpose, _rank(graph, transpose.inputs[0])) if shape is not None else None
        if perm is not None and sorted(perm) == list(range(len(perm))) and owned(owns, [transpose, reshape]):
            _fuse_layout_pair(graph, "TransposeReshape", transpose, reshape, reshape, shape, perm)
            changed = True
    return changed


def _reshaped(shape: tuple[int, ...], target: list[int], allowzero: bool) -> tuple[int, ...] | None:
    """The shape Reshape gives a ``shape`` tensor for ``target`` (0 copies a dimension, -1 infers one)."""
    dims = [shape[i] if d == 0 and not allowzero and i < len(shape) else d for i, d in enumerate(target)]
    if dims.count(-1) == 1:
        known = math.prod(d for d in dims if d != -1)
        if known == 0 or math.prod(shape) % known:
            return None
        dims[dims.index(-1)] = math.prod(shape) // known
    return tuple(dims) if -1 not in dims and math.prod(dims) == math.prod(shape) else None


def _broadcast(*shapes) -> tuple[int, ...] | None:
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return None


def _fused_output_shapes(node: Node, shapes: list[tuple[int, ...]]) -> list[tuple[int, ...] | None]:
    """The output shapes of the provider's fused operators and Attention, from static input shapes (as
    their kernels compute them); None where unsure."""
    if node.op_type == "Attention":  # 4-D (batch, heads, sequence, head size): Y only
        if len(shapes) != 3 or len(shapes[0]) != 4 or len(shapes[2]) != 4:
            return [None] * len(node.outputs)
        q, v = shapes[0], shapes[2]
        return [(q[0], q[1], q[2], v[3])]
    if node.op_type == "RotateHalfEmbedding":
        q, cos, sin = shapes
        return [_broadcast(q, cos, q[:-1] + (int(node.attr("end")),), sin) if q else None]
    if node.op_type == "SkipRMSNormalization":
        total = _broadcast(shapes[0], shapes[1])
        return [total, total]
    if node.op_type in ("SwishMul", "GeluMul"):
        return [_broadcast(*shapes)]
    if node.op_type == "ReshapeTranspose":
        return [_split_shape(shapes[0], node)]
    target, perm = [int(d) for d in node.attr("shape")], node.attr("perm")
    if node.op_type == "TransposeReshape" and len(perm) == len(shapes[0]):
        return [_reshaped(tuple(shapes[0][p] for p in perm), target, bool(node.attr("allowzero", 0)))]
    return [None] * len(node.outputs)


def _split_shape(shape: tuple[int, ...], node: Node) -> tuple[int, ...] | None:
    """The shape of Transpose(Reshape(x, shape), perm) from the node's attributes, for an x of ``shape``."""
    perm = node.attr("perm")
    reshaped = _reshaped(shape, [int(d) for d in node.attr("shape")], bool(node.attr("allowzero", 0)))
    return tuple(reshaped[p] for p in perm) if reshaped is not None and len(perm) == len(reshaped) else None


_TYPED = ("RotateHalfEmbedding", "SkipRMSNormalization", "SwishMul", "GeluMul", "ReshapeTranspose",
          "TransposeReshape")


def _refines(known: TypeInfo | None, dtype, shape: tuple[int, ...]) -> bool:
    """Whether ``shape`` says more than ``known`` without contradicting it (same dtype and rank, equal
    concrete dimensions)."""
    if known is None:
        return True
    if not known.is_tensor or known.static_shape is not None or (known.dtype is not None and known.dtype != dtype):
        return False
    return known.shape is None or (len(known.shape) == len(shape) and all(
        not isinstance(d, int) or d == s for d, s in zip(known.shape, shape)))


def infer_fused_types(graph: Graph, owns=None) -> bool:
    """Record static output shapes of the fused operators (and of Attention's Y, which the optimizer's
    attention fusion may leave unknown) where shape inference left them unknown, when every input's shape
    is static: the kernels reading them are then made once, at session creation, instead of looked up per
    call by input shapes."""
    changed = False
    for node in graph.nodes:
        if not (node.domain == FUSED_DOMAIN and node.op_type in _TYPED or _is(node, "Attention")):
            continue
        infos = [graph.type_of(name) for name in (node.inputs[:3] if node.op_type == "Attention" else node.inputs)]
        if any(info is None or not info.is_tensor or info.static_shape is None for info in infos):
            continue
        shapes = _fused_output_shapes(node, [info.static_shape for info in infos])
        for name, shape in zip(node.outputs, shapes):
            if name and shape is not None and _refines(graph.type_of(name), infos[0].dtype, shape):
                graph.value_info[name] = ValueInfo(name, TypeInfo("tensor", infos[0].dtype, shape))
                changed = True
    return changed


DECODER_PASSES = [*(until_fixed(f) for f in (fuse_skip_rms_norm, fuse_swish_mul, fuse_gelu_mul, fuse_reshape_transpose,
                                              fuse_transpose_reshape)), fuse_gemm_relu, infer_fused_types]
