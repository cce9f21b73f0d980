"""Dynamically quantized convolutions as one node (ops/dynamic_quantize_conv.py).

onnxruntime's quantize_dynamic writes each Conv as DynamicQuantizeLinear(x) -> ConvInteger(codes, W, zero
point, W's zero point) -> Cast to float32 -> Mul by Mul(x's scale, W's scale), then the float model's bias Add.
``fuse_dynamic_quantize_conv`` makes it one DynamicQuantizeConv of the float input, as qdq_fusions does for
the MatMulInteger form. The match asks for a constant 3-D or 4-D weight, group 1, explicit pads, a constant
float32 weight scale of one value, a constant zero point of one value or one per output channel, a constant
bias of one value per output channel (or none), and no other reader of the values it removes. A quantized
input that several convolutions read (a residual block's first convolution and its strided shortcut) is
quantized by each of their fused nodes: the same codes, the same scale and zero point, once per reader.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node

from .fusions import FUSED_DOMAIN, GraphView, owned, until_fixed

_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))


def _private(view: GraphView, name: str, readers: int) -> bool:
    """Whether ``name`` is read by exactly ``readers`` nodes and nothing else sees it."""
    return len(view.consumers.get(name, [])) == readers and name not in view.outputs \
        and name not in view.inner_reads


def _weight_ok(view: GraphView, conv: Node) -> bool:
    weight = view.const(conv.inputs[1])
    zero = view.const(conv.inputs[3]) if len(conv.inputs) > 3 and conv.inputs[3] else None
    if weight is None or weight.ndim not in (3, 4) or weight.dtype not in _EIGHT_BIT:
        return False
    if len(conv.inputs) > 3 and conv.inputs[3] and (zero is None or zero.dtype != weight.dtype
                                                    or zero.size not in (1, weight.shape[0])):
        return False
    auto_pad = conv.attr("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    return int(conv.attr("group", 1)) == 1 and auto_pad == "NOTSET"


def _bias(view: GraphView, add: Node, output: str, channels: int, rank: int) -> str | None:
    """The Add's other input when it is a constant float32 bias of one value per channel laid along axis 1."""
    if len(add.inputs) != 2:
        return None
    name = add.inputs[1] if add.inputs[0] == output else add.inputs[0]
    value = view.const(name)
    if value is None or value.dtype != np.float32 or value.size != channels or value.ndim > rank:
        return None
    shape = (1,) * (rank - value.ndim) + value.shape
    return name if shape[1] == channels else None


def _chain(view: GraphView, conv: Node, readers: int = 1) -> tuple | None:
    """(quantize, cast, scale Mul, scales' Mul, W's scale name, output Add or None, bias name) around a
    ConvInteger, or None; ``readers``: the convolutions that read the quantized input, each with a chain."""
    if len(conv.inputs) < 3 or not _weight_ok(view, conv):
        return None
    quantize = view.made_by(conv.inputs[0], "DynamicQuantizeLinear")
    if quantize is None or len(quantize.outputs) != 3 or quantize.outputs[0] != conv.inputs[0] \
            or quantize.outputs[2] != conv.inputs[2]:
        return None
    codes, x_scale, x_zero = quantize.outputs
    cast = view.only_consumer(conv.outputs[0], "Cast")
    if cast is None or int(cast.attr("to", 0)) != 1 or not _private(view, codes, readers) \
            or not _private(view, x_zero, readers) or not _private(view, x_scale, readers):
        return None
    scale_mul = view.only_consumer(cast.outputs[0], "Mul")
    if scale_mul is None or len(scale_mul.inputs) != 2:
        return None
    product_name = scale_mul.inputs[1] if scale_mul.inputs[0] == cast.outputs[0] else scale_mul.inputs[0]
    product = view.made_by(product_name, "Mul")
    if product is None or len(product.inputs) != 2 or x_scale not in product.inputs \
            or not _private(view, product_name, 1):
        return None
    w_scale = product.inputs[1] if product.inputs[0] == x_scale else product.inputs[0]
    scale = view.const(w_scale)
    if scale is None or scale.dtype != np.float32 or scale.size != 1:
        return None
    weight = view.const(conv.inputs[1])
    add = view.only_consumer(scale_mul.outputs[0], "Add")
    bias = _bias(view, add, scale_mul.outputs[0], weight.shape[0], weight.ndim) if add is not None else None
    return quantize, cast, scale_mul, product, w_scale, add if bias else None, bias


def _chains(view: GraphView, conv: Node) -> list | None:
    """(ConvInteger, its _chain) for every convolution that reads ``conv``'s quantized input, or None unless
    each has a chain and its own scales' Mul."""
    readers = view.consumers.get(conv.inputs[0], []) if conv.inputs else []
    if not all(r.op_type == "ConvInteger" and not r.domain and r.inputs[0] == conv.inputs[0] for r in readers):
        return None
    chains = [(reader, _chain(view, reader, len(readers))) for reader in readers]
    if any(chain is None for _, chain in chains) or len({id(chain[3]) for _, chain in chains}) != len(chains):
        return None
    return chains


def _fused(graph: Graph, conv: Node, chain: tuple) -> tuple[Node, Node]:
    """The DynamicQuantizeConv of one chain and the node it replaces in place (the chain's last)."""
    quantize, cast, scale_mul, product, w_scale, add, bias = chain
    w_zero = conv.inputs[3] if len(conv.inputs) > 3 else ""
    inputs = [quantize.inputs[0], conv.inputs[1], w_scale, w_zero] + ([bias] if bias else [])
    if bias:
        value = graph.initializers[bias]
        if value.ndim != 1:  # the kernel reads one value per channel
            flat = f"{bias}/channels"
            while flat in graph.initializers:
                flat += "_"
            graph.initializers[flat] = value.reshape(-1)
            inputs[-1] = flat
    attrs = {k: v for k, v in (conv.attrs or {}).items() if k in ("kernel_shape", "strides", "pads", "dilations")}
    last = add if add is not None else scale_mul
    return Node("DynamicQuantizeConv", inputs, list(last.outputs), name=f"{conv.name}/dynamic",
                domain=FUSED_DOMAIN, attrs=attrs, opset=1), last


def fuse_dynamic_quantize_conv(graph: Graph, owns=None) -> bool:
    """One DynamicQuantizeConv for each dynamically quantized Conv (the module's docstring), the convolutions
    of one quantized input together; one input per call."""
    view = GraphView(graph)
    for conv in graph.nodes:
        if conv.op_type != "ConvInteger" or conv.domain:
            continue
        chains = _chains(view, conv)
        if chains is None:
            continue
        removed = [chains[0][1][0]]  # the quantize, then each chain's nodes
        for reader, (_, cast, scale_mul, product, _, add, _) in chains:
            removed += [product, reader, cast, scale_mul] + ([add] if add is not None else [])
        if not owned(owns, removed):
            continue
        # Each fused node where its chain's last node was: its inputs (the float input, constants) exist by then.
        in_place = {id(last): fused for fused, last in (_fused(graph, reader, chain) for reader, chain in chains)}
        gone = {id(n) for n in removed}
        graph.nodes = [in_place.get(id(n), n) for n in graph.nodes if id(n) not in gone or id(n) in in_place]
        return True
    return False


DYNAMIC_CONV_PASSES = [until_fixed(fuse_dynamic_quantize_conv)]
