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

Activations that the quantization saturates anyway: a Relu whose output only QuantizeLinear nodes read with the
codes' lowest value as zero point (uint8 0, int8 -128) maps every negative value to the code 0 maps to, which
quantizing it without the Relu gives too (a negative value rounds to a code at or below the zero point, and
saturates there); a Clip whose bounds quantize to the codes' lowest and highest values changes no code either
(quantizing is monotone and saturates). ``drop_activation_before_quantizing`` removes them where the quantization
tools left them (onnxruntime's QDQ transformer does the same, ReluQuantFusion and ClipQuantFusion), so the
convolution or product before them and the QuantizeLinear make one integer group.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node

from .algorithms.quantize import integer_range, quantize
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


def _saturating_range(view: GraphView, reader: Node) -> tuple | None:
    """(codes' lowest, highest, scale, zero point) of a plain integer QuantizeLinear with constant parameters: the
    scale and zero point as 0-d arrays per tensor, the scale None per channel; None otherwise."""
    if reader.op_type != "QuantizeLinear" or reader.domain or len(reader.inputs) < 2 \
            or any(reader.attr(name, 0) for name in ("block_size", "output_dtype", "precision")):
        return None
    scale = view.constant(reader.inputs[1])
    zero = view.constant(reader.inputs[2]) if len(reader.inputs) > 2 and reader.inputs[2] else \
        np.zeros((), np.uint8)
    if scale is None or zero is None or scale.dtype != _F32 or zero.dtype.kind not in "iu" or zero.itemsize > 2:
        return None
    low, high = integer_range(zero.dtype)
    if scale.size == 1 and zero.size == 1:
        return low, high, scale.reshape(()), zero.reshape(())
    return (low, high, None, zero) if scale.size == zero.size or zero.size == 1 else None


def _clip_bounds(view: GraphView, clip: Node) -> tuple | None:
    if clip.opset < 11:
        bounds = float(clip.attr("min", -np.inf)), float(clip.attr("max", np.inf))
        return None if any(np.isnan(bounds)) else bounds
    bounds = []
    for index in (1, 2):
        name = clip.inputs[index] if len(clip.inputs) > index else ""
        value = view.constant(name) if name else np.array(np.inf * (1 if index == 2 else -1), _F32)
        if value is None or value.size != 1 or value.dtype != _F32 or np.isnan(value).any():
            return None  # (a NaN bound makes Clip's output NaN, which the quantization would not give)
        bounds.append(float(value.reshape(-1)[0]))
    return tuple(bounds)


def _saturated_anyway(view: GraphView, node: Node, reader: Node) -> bool:
    found = _saturating_range(view, reader)
    if found is None or reader.inputs[0] != node.outputs[0]:
        return False
    low, high, scale, zero = found
    if node.op_type == "Relu":
        return bool(np.all(zero == low))
    bounds = _clip_bounds(view, node)
    if bounds is None or scale is None or not scale > 0:
        return False
    codes = quantize(np.array(bounds, _F32), scale, zero, zero.dtype)
    return int(codes[0]) == low and int(codes[1]) == high


def drop_activation_before_quantizing(graph: Graph, owns=None) -> bool:
    """The module doc's Relu or Clip before QuantizeLinear goes; the QuantizeLinear nodes read its input."""
    view = GraphView(graph)
    for node in list(graph.nodes):
        if node.op_type not in ("Relu", "Clip") or node.domain or len(node.outputs) != 1:
            continue
        # (the readers' float32 scales make the values float32: QuantizeLinear's input and scale share a type)
        readers = view.consumers.get(node.outputs[0], [])
        if not readers or node.outputs[0] in view.outputs or node.outputs[0] in view.inner_reads \
                or not all(_saturated_anyway(view, node, reader) for reader in readers) or not owned(owns, [node]):
            continue
        bypass(graph, node, node.inputs[0])
        return True
    return False
