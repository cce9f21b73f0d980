"""Roundings that the readers make again: a QuantizeDequantize whose values only integer QDQ groups quantize, with
the same grid, is left to them.

qdq_fusions.absorb_quantize lets a QuantizedMatMul quantize its float32 operand itself (attributes quantize_a,
quantize_b). Where that operand is an activation the graph also rounds to the same grid first (GPT-2's
LayerNorm -> rounding -> Reshape -> product, its query heads Split -> rounding -> ReshapeTranspose -> product),
the rounding is a step whose result the product maps back to the same codes: QuantizeLinear of a grid value
(code - zero) * scale gives that code again (float32 scales; see qdq_fusions._grid_of), so quantizing the
unrounded value gives exactly the codes quantizing the rounded one does. The pass drops such a rounding when
every reader of its output, through data movement, is a group quantizing it with the same per-tensor scale and
zero point; the readers then read its input.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node

from .fusions import FUSED_DOMAIN, GraphView, bypass, owned

_F32 = np.dtype(np.float32)
_EIGHT_BIT = frozenset({np.dtype(np.uint8), np.dtype(np.int8)})
# Layout operators that move values without changing them (input 0 is the data).
_MOVING = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten"})
_FUSED_MOVING = frozenset({"ReshapeTranspose", "TransposeReshape"})
# A group's (operand input, its scale input, flag) slots that quantize float32 data.
_QUANTIZING = ((0, 1, "quantize_a"), (3, 4, "quantize_b"))


def _grid(view: GraphView, scale: str, zero: str) -> tuple | None:
    s, z = view.const(scale), view.const(zero)
    if s is None or z is None or s.size != 1 or z.size != 1 or s.dtype != _F32 or z.dtype not in _EIGHT_BIT:
        return None
    return float(s.reshape(-1)[0]), z.dtype, int(z.reshape(-1)[0])


def _moving(node: Node, name: str) -> bool:
    plain = node.domain in ("", "ai.onnx") and node.op_type in _MOVING
    fused = node.domain == FUSED_DOMAIN and node.op_type in _FUSED_MOVING
    return (plain or fused) and node.inputs[0] == name and name not in node.inputs[1:] and len(node.outputs) == 1


def _quantized_by_readers(view: GraphView, name: str, grid: tuple, depth: int = 0) -> bool:
    """Whether every reader of ``name`` (through data movement) is a QuantizedMatMul quantizing it with ``grid``."""
    readers = view.consumers.get(name, [])
    if not readers or name in view.outputs or name in view.inner_reads or depth > 6:
        return False
    for reader in readers:
        if _moving(reader, name):
            if not _quantized_by_readers(view, reader.outputs[0], grid, depth + 1):
                return False
            continue
        if reader.op_type != "QuantizedMatMul" or reader.domain != FUSED_DOMAIN:
            return False
        slots = [(scale, flag) for operand, scale, flag in _QUANTIZING
                 if operand < len(reader.inputs) and reader.inputs[operand] == name]
        if len(slots) != reader.inputs.count(name) or not all(
                reader.attr(flag, 0) and scale + 1 < len(reader.inputs)
                and _grid(view, reader.inputs[scale], reader.inputs[scale + 1]) == grid for scale, flag in slots):
            return False
    return True


def drop_rounding_before_quantizing(graph: Graph, owns=None) -> bool:
    """The module doc's roundings go; their readers read their input."""
    view = GraphView(graph)
    for node in list(graph.nodes):
        if node.op_type != "QuantizeDequantize" or node.domain != FUSED_DOMAIN or len(node.inputs) != 3:
            continue
        grid = _grid(view, node.inputs[1], node.inputs[2])
        info = graph.type_of(node.inputs[0])
        if grid is None or info is None or info.dtype is None or info.dtype.numpy != _F32 \
                or not _quantized_by_readers(view, node.outputs[0], grid) or not owned(owns, [node]):
            continue
        bypass(graph, node, node.inputs[0])
        return True
    return False
