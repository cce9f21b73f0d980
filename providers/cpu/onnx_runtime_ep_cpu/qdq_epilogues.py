"""Roundings as their producers' epilogues: a QuantizeDequantize (qdq_fusions.fuse_quantize_dequantize) whose input
only it reads, made by a float operator of BROADCASTING, ELEMENTWISE or SHAPED, becomes one node with that operator.

quantize_static writes a rounding after every activation; the earlier QDQ passes fold those the integer products
or grid tables make again, and the rest (a decoder's LayerNorm, residual Add, the presents' Concat, rotary Mul
and Add, the attention's mask Add) each cost a step of their own. The fused node runs the producer's kernel and
then the rounding's, so the values are unchanged.

The pass runs after every other CPU pass (provider.custom_passes): the others match the plain operators
(segments round inside their own plans, and their members must stay plain). A producer whose output another
node, a subgraph or the graph's outputs read keeps its rounding apart: those readers want the unrounded value.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node

from .fused_shapes import BROADCASTING, ELEMENTWISE, SHAPED, SUFFIX
from .fusions import FUSED_DOMAIN, GraphView, owned
from .qdq_attention import fuse_rounded_attention
from .qdq_concat_inputs import fold_concat_input_roundings
from .qdq_groups import group_quantized_products
from .qdq_norms import fuse_rounded_rms_norm
from .qdq_repeat_kv import fold_repeated_kv
from .qdq_rotary import fuse_rounded_rotary
from .registry import NEEDS, lookup

_F32 = np.dtype(np.float32)
# The producers whose rounding folds (SUFFIX, BROADCASTING, ELEMENTWISE and SHAPED: fused_shapes.py, where their
# shape rules are); SHAPED ones other than Concat (whose rule a shape program passes) only where the output's
# shape is static (an exact plan's).
FOLDED = frozenset(BROADCASTING + ELEMENTWISE + SHAPED)


def _static(graph: Graph, name: str) -> bool:
    info = graph.type_of(name)
    shape = info.shape if info is not None and info.is_tensor else None
    return shape is not None and all(isinstance(d, int) for d in shape)


def _float32(graph: Graph, name: str) -> bool:
    info = graph.type_of(name)
    return info is not None and info.is_tensor and info.dtype is not None and info.dtype.numpy == _F32


# Layout operators whose output holds their first input's values (a Shape of it is a Shape of that input).
_MOVING = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Identity", "ReshapeTranspose",
                     "TransposeReshape"})


def _sized(view: GraphView, name: str, depth: int = 0) -> bool:
    """Whether a Shape or Size reads ``name`` (through layout operators): a graph whose shapes are not yet
    known, where the rounding may still go once a specialization has made them constants
    (qdq_folds.drop_rounding_before_quantizing); the pass then runs again there."""
    for reader in view.consumers.get(name, []):
        if reader.op_type in ("Shape", "Size") or (reader.op_type in _MOVING and reader.inputs[0] == name
                                                   and depth < 8 and _sized(view, reader.outputs[0], depth + 1)):
            return True
    return False


def _foldable(graph: Graph, view: GraphView, rounding: Node) -> Node | None:
    """The producer whose epilogue ``rounding`` can be, or None."""
    if rounding.op_type != "QuantizeDequantize" or rounding.domain != FUSED_DOMAIN or len(rounding.inputs) != 3 \
            or not rounding.inputs[2] or any(view.const(name) is None for name in rounding.inputs[1:]):
        return None
    value = rounding.inputs[0]
    producer = view.producer.get(value)
    if producer is None or producer.domain not in ("", "ai.onnx") or producer.op_type not in FOLDED \
            or producer.outputs[0] != value or any(producer.outputs[1:]) or producer.subgraphs():
        return None
    if producer.op_type in SHAPED and producer.op_type != "Concat" and not _static(graph, value):
        return None  # (a shape program cannot pass its rule: a symbolic plan would run the shape work per call)
    readers = view.consumers.get(value, [])
    if len(readers) != 1 or readers[0] is not rounding or value in view.outputs or value in view.inner_reads \
            or rounding.inputs.count(value) != 1 or not _float32(graph, value):
        return None
    if _sized(view, rounding.outputs[0]) and rounding.outputs[0] not in view.outputs:
        return None  # (a graph output's rounding folds all the same: no specialization can drop it)
    factory = lookup(producer.op_type, "", producer.opset)
    return producer if factory is not None and not NEEDS.get(factory) else None


def fold_rounding_epilogues(graph: Graph, owns=None) -> bool:
    """Every rounding the module doc names becomes its producer's epilogue; the fused node stands where the
    producer was (the rounding's scale and zero point are constants)."""
    if not any(n.op_type == "QuantizeDequantize" and n.domain == FUSED_DOMAIN for n in graph.nodes):
        return False
    view = GraphView(graph)
    fused: dict[int, Node] = {}
    gone: set[int] = set()
    for rounding in graph.nodes:
        producer = _foldable(graph, view, rounding)
        if producer is None or id(producer) in fused or not owned(owns, [producer, rounding]):
            continue
        attrs = {**(producer.attrs or {}), "rounding_axis": int(rounding.attr("axis", 1)),
                 "rounding_opset": int(rounding.attr("opset", 13)), "inner_opset": int(producer.opset)}
        fused[id(producer)] = Node(producer.op_type + SUFFIX, [*producer.inputs, *rounding.inputs[1:3]],
                                   [rounding.outputs[0]], name=producer.name or rounding.name, domain=FUSED_DOMAIN,
                                   attrs=attrs, opset=1)
        gone.add(id(rounding))
        graph.value_info.pop(producer.outputs[0], None)
    if not fused:
        return False
    graph.nodes = [fused.get(id(n), n) for n in graph.nodes if id(n) not in gone]
    return True


# (the norms and the Concat inputs read the Rounded nodes; the products are grouped last, after every pass that
# reads a QuantizedMatMul)
QDQ_EPILOGUE_PASSES = [fold_rounding_epilogues, fuse_rounded_rms_norm, fold_concat_input_roundings,
                       fuse_rounded_rotary, fold_repeated_kv, fuse_rounded_attention, group_quantized_products]
