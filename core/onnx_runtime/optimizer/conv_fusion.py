"""Per-channel affine maps after a Conv (or an inference BatchNormalization) fold into it.

``y = a * conv(x, W, B) + c`` (one ``a``, ``c`` per output channel) is ``conv(x, a*W, a*B + c)``:
inference BatchNormalization, Mul by a constant and Add of a constant all have this form, and a
BatchNormalization absorbs a following Mul/Add the same way. New parameters are computed in
float64 and rounded once to the parameters' type.
"""

from __future__ import annotations

import numpy as np

from ..ir import Graph, Node
from .context import PassContext
from .rewrite import Uses, add_initializer, channel_vector, constant, forget_value, remove_nodes

_FLOATS = (np.float32, np.float64)


def fuse_conv_batchnorm(graph: Graph, context: PassContext) -> bool:
    """Conv -> BatchNormalization (inference, constant statistics) becomes one Conv."""

    def affine(conv: Node, bn: Node, channels: int):
        if not _is_inference_batchnorm(bn) or bn.inputs[0] != conv.outputs[0]:
            return None
        params = [constant(graph, name) for name in bn.inputs[1:5]]
        vectors = [p for p in params if p is not None and p.shape == (channels,)]
        if len(vectors) != 4:
            return None
        scale, bias, mean, var = (p.astype(np.float64) for p in vectors)
        factor = scale / np.sqrt(var + bn.attr("epsilon", 1e-5))
        return factor, bias - mean * factor

    return _fuse_into_conv(graph, context, "BatchNormalization", affine)


def fuse_conv_mul(graph: Graph, context: PassContext) -> bool:
    """Conv -> Mul by a per-channel constant becomes one Conv (scaled weights and bias)."""

    def affine(conv: Node, mul: Node, channels: int):
        vector = _conv_constant(graph, mul, conv, channels)
        return None if vector is None else (vector, np.zeros(channels))

    return _fuse_into_conv(graph, context, "Mul", affine)


def fuse_conv_add(graph: Graph, context: PassContext) -> bool:
    """Conv -> Add of a per-channel constant becomes one Conv (the constant joins the bias)."""

    def affine(conv: Node, add: Node, channels: int):
        vector = _conv_constant(graph, add, conv, channels)
        return None if vector is None else (None, vector)

    return _fuse_into_conv(graph, context, "Add", affine)


def fuse_batchnorm_affine(graph: Graph, context: PassContext) -> bool:
    """Inference BatchNormalization -> Mul/Add of a per-channel constant becomes one
    BatchNormalization: its output is already ``scale' * x + bias'``, so the Mul scales both and
    the Add shifts the bias."""
    if not _has_op(graph, "BatchNormalization"):
        return False
    uses = Uses(graph)
    removed: list[Node] = []
    for bn in graph.nodes:
        if bn.op_type != "BatchNormalization" or bn.domain not in ("", "ai.onnx") or not _is_inference_batchnorm(bn):
            continue
        while (follower := uses.only_reader(bn.outputs[0])) is not None:
            if not _fold_into_batchnorm(graph, context, uses, bn, follower):
                break
            removed.append(follower)
    remove_nodes(graph, removed)
    return bool(removed)


def _fold_into_batchnorm(graph: Graph, context: PassContext, uses: Uses, bn: Node, follower: Node) -> bool:
    scale, bias = constant(graph, bn.inputs[1]), constant(graph, bn.inputs[2])
    info = graph.type_of(bn.outputs[0])
    if (scale is None or bias is None or scale.dtype.type not in _FLOATS or scale.ndim != 1
            or bias.shape != scale.shape  # a malformed BatchNormalization: its kernel reports it at the run
            or info is None or info.shape is None or follower.op_type not in ("Mul", "Add")
            or follower.domain not in ("", "ai.onnx") or len([out for out in follower.outputs if out]) != 1):
        return False
    vector = _other_constant(graph, follower, bn.outputs[0], scale.dtype, len(info.shape), len(scale))
    if vector is None:
        return False
    new_bias = bias.astype(np.float64) + vector if follower.op_type == "Add" else bias.astype(np.float64) * vector
    names = [bn.inputs[1], context.fresh(f"{bn.inputs[2]}_fused")]
    add_initializer(graph, names[1], new_bias.astype(scale.dtype))
    if follower.op_type == "Mul":
        names[0] = context.fresh(f"{bn.inputs[1]}_fused")
        add_initializer(graph, names[0], (scale.astype(np.float64) * vector).astype(scale.dtype))
    uses.forget(follower)
    forget_value(graph, bn.outputs[0])
    uses.rewire(bn, inputs=[bn.inputs[0], *names, *bn.inputs[3:]], outputs=[follower.outputs[0]])
    return True


def _fuse_into_conv(graph: Graph, context: PassContext, follower_op: str, affine) -> bool:
    """Fold each ``follower_op`` node that is the only reader of a constant-weight Conv into it.

    ``affine(conv, follower, channels)`` returns the follower's per-channel (scale, shift) (scale
    None for 1) or None when it does not fit.
    """
    if not (_has_op(graph, "Conv") and _has_op(graph, follower_op)):
        return False
    uses = Uses(graph)
    removed: list[Node] = []
    for conv in graph.nodes:
        if conv.op_type != "Conv" or conv.domain not in ("", "ai.onnx") or len(conv.outputs) != 1:
            continue
        while (follower := uses.only_reader(conv.outputs[0])) is not None:  # Conv -> Mul -> Mul folds whole
            if not _fold_follower(graph, context, uses, conv, follower, follower_op, affine):
                break
            removed.append(follower)
    remove_nodes(graph, removed)
    return bool(removed)


def _fold_follower(graph, context, uses: Uses, conv: Node, follower: Node, follower_op: str, affine) -> bool:
    weights = constant(graph, conv.inputs[1]) if len(conv.inputs) > 1 else None
    bias_name = conv.inputs[2] if len(conv.inputs) > 2 else ""
    bias = constant(graph, bias_name)
    if (weights is None or weights.dtype.type not in _FLOATS or (bias_name and bias is None)
            or follower.op_type != follower_op or follower.domain not in ("", "ai.onnx")
            or len([out for out in follower.outputs if out]) != 1):
        return False
    channels = weights.shape[0]
    if bias is not None and bias.shape != (channels,):
        return False  # a malformed Conv: its kernel reports it at the run
    found = affine(conv, follower, channels)
    if found is None:
        return False
    scale, shift = found
    new_bias = np.zeros(channels) if bias is None else bias.astype(np.float64)
    weights_name = conv.inputs[1]
    if scale is not None:
        new_bias = new_bias * scale
        # Products in float64 rounded once to the weights' dtype, in one pass (no float64 copy of the
        # weights: the multiply casts as it goes).
        scaled = np.empty_like(weights)
        np.multiply(weights, scale.reshape((channels,) + (1,) * (weights.ndim - 1)), out=scaled, dtype=np.float64,
                    casting="unsafe")
        weights_name = context.fresh(f"{conv.inputs[1]}_fused")
        add_initializer(graph, weights_name, scaled)
    bias_name = context.fresh(f"{bias_name or conv.name + '_bias'}_fused")
    add_initializer(graph, bias_name, (new_bias + shift).astype(weights.dtype))
    uses.forget(follower)
    forget_value(graph, conv.outputs[0])
    uses.rewire(conv, inputs=[conv.inputs[0], weights_name, bias_name], outputs=[follower.outputs[0]])
    return True


def _other_constant(graph: Graph, node: Node, value: str, dtype, rank: int, channels: int) -> np.ndarray | None:
    """The per-channel constant a Mul/Add ``node`` (numpy broadcasting) combines with ``value``, a
    rank-``rank`` tensor of ``dtype`` with ``channels`` channels on axis 1."""
    if node.opset < 7 or len(node.inputs) != 2:
        return None  # before opset 7 Mul/Add broadcast by attribute
    array = constant(graph, node.inputs[1] if node.inputs[0] == value else node.inputs[0])
    if array is None or array.dtype != dtype:
        return None
    return channel_vector(array, rank, channels)


def _conv_constant(graph: Graph, node: Node, conv: Node, channels: int) -> np.ndarray | None:
    weights = graph.initializers[conv.inputs[1]]  # a constant (see _fold_follower); the output has its rank
    return _other_constant(graph, node, conv.outputs[0], weights.dtype, weights.ndim, channels)


def _has_op(graph: Graph, op_type: str) -> bool:
    return any(node.op_type == op_type for node in graph.nodes)


def _is_inference_batchnorm(node: Node) -> bool:
    if node.opset >= 14 and node.attr("training_mode", 0):
        return False
    if node.opset < 9 and not node.attr("spatial", 1):
        return False  # per-activation statistics, not per channel
    return len(node.inputs) == 5 and not any(node.outputs[1:])  # statistics outputs mean training
