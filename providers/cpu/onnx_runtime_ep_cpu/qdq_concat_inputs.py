"""A rounding read only by a ConcatRounded that rounds to the same grid, dropped (a QDQ decoder's past key or value:
quantize_static rounds the past input, then the present Concat's output, calibrated over both, to one grid).

    QuantizeDequantize(p, s, z) -> ConcatRounded(..., p rounded, ..., s', z')   where (s', z') == (s, z)
      ->  ConcatRounded(..., p, ..., s', z')

Exact: the Concat rounds every value it copies to that grid, and rounding a value already on the grid gives it back
(checked per grid at fold time for every code: (c - z) * s rounds to c), saturated and NaN values included (they
round to a code's value once, which the second rounding keeps). Applied where both grids are constant scalars of the
same values and types, p is float32, and the rounded value has no other reader (no graph output, no subgraph) but
Shape or Size nodes (a symbolic plan's), which then read p (of the same shape).
Runs after qdq_epilogues.fold_rounding_epilogues, which makes the ConcatRounded nodes. Saves a decode call one step
per past tensor.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node

from .fusions import FUSED_DOMAIN, GraphView, owned

_F32 = np.dtype(np.float32)
_CODES = {np.dtype(np.uint8): (0, 255), np.dtype(np.int8): (-128, 127)}


def _idempotent(scale: np.ndarray, zero: np.ndarray) -> bool:
    """Whether every code's value of this grid rounds back to that code (QuantizeLinear's float32 arithmetic)."""
    if scale.dtype != _F32 or zero.dtype not in _CODES or scale.size != 1 or zero.size != 1:
        return False
    s, z = scale.reshape(-1)[0], np.float32(zero.reshape(-1)[0])
    if not np.isfinite(s) or s <= 0:
        return False
    low, high = _CODES[zero.dtype]
    codes = np.arange(low, high + 1, dtype=np.float32)
    values = (codes - z) * s
    with np.errstate(all="ignore"):
        return bool(np.array_equal(np.rint(values / s) + z, codes))


def _same_grid(view: GraphView, rounding: Node, concat: Node) -> bool:
    mine = [view.const(name) if name else None for name in rounding.inputs[1:3]]
    theirs = [view.const(name) if name else None for name in concat.inputs[-2:]]
    if any(v is None for v in mine + theirs) or len(rounding.inputs) != 3:
        return False
    return all(a.dtype == b.dtype and a.size == 1 and b.size == 1 and a.reshape(-1)[0] == b.reshape(-1)[0]
               for a, b in zip(mine, theirs)) and _idempotent(*mine)


def _sizes(node: Node, name: str) -> bool:
    """Whether ``node`` reads only the shape of ``name`` (a symbolic plan's Shape of the past): the rounding's input
    has that shape too."""
    return node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx") and list(node.inputs) == [name]


def _foldable(graph: Graph, view: GraphView, rounding: Node) -> Node | None:
    """The ConcatRounded that reads ``rounding``'s output alone and rounds to its grid, else None."""
    if rounding.op_type != "QuantizeDequantize" or rounding.domain != FUSED_DOMAIN or len(rounding.outputs) != 1:
        return None
    name = rounding.outputs[0]
    readers = [r for r in view.consumers.get(name, []) if not _sizes(r, name)]
    if len(readers) != 1 or name in view.outputs or name in view.inner_reads:
        return None
    concat = readers[0]
    if concat.op_type != "ConcatRounded" or concat.domain != FUSED_DOMAIN or name in concat.inputs[-2:]:
        return None
    info = graph.type_of(rounding.inputs[0])
    if info is None or not info.is_tensor or info.dtype is None or info.dtype.numpy != _F32:
        return None
    return concat if _same_grid(view, rounding, concat) else None


def fold_concat_input_roundings(graph: Graph, owns=None) -> bool:
    """Every rounding the module doc names is dropped: its ConcatRounded reads the rounding's input instead."""
    if not any(n.op_type == "ConcatRounded" and n.domain == FUSED_DOMAIN for n in graph.nodes):
        return False
    view = GraphView(graph)
    gone: set[int] = set()
    for node in graph.nodes:
        concat = _foldable(graph, view, node)
        if concat is None or not owned(owns, [node, concat]):
            continue
        for reader in [concat, *view.consumers.get(node.outputs[0], [])]:  # (Shape/Size readers read its input)
            reader.inputs = [node.inputs[0] if name == node.outputs[0] else name for name in reader.inputs]
        graph.value_info.pop(node.outputs[0], None)
        gone.add(id(node))
    if not gone:
        return False
    graph.nodes = [n for n in graph.nodes if id(n) not in gone]
    return True
