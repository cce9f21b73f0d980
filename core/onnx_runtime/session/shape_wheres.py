"""Exporters' "replace -1 by 1" in a shape value, seen through for shape inference.

torch writes ``expand(-1, ...)`` targets as ``Where(Equal(c, -1), 1, c)`` over a shape vector ``c`` that a
``Concat`` builds from ``Shape`` dimensions. onnx's data propagation does not evaluate ``Where`` or ``Equal``,
so the ``Expand`` reading it gets no shape, and everything after it (the causal mask, the attention scores it
is added to, the layers after them) stays unknown in a specialized graph: no shape chain folds and the
attention fusions do not apply. When ``c`` is a ``Concat`` of unsqueezed scalars and constants, every scalar
provably non-negative (dimensions, sizes, and sums, products and picks of them) and the compared constant all
negative, the ``Where`` decides only on the constant pieces: for inference only, it is replaced by the same
``Concat`` with those pieces replaced where they equal the compared value, which onnx propagates. The model
that runs keeps its ``Where``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Operators whose outputs are non-negative when the inputs named by index are (None: all of them).
_KEEPS_SIGN: dict[str, tuple[int, ...] | None] = {
    "Gather": (0,), "GatherElements": (0,), "Slice": (0,), "Squeeze": (0,), "Unsqueeze": (0,), "Reshape": (0,),
    "Identity": (0,), "Flatten": (0,), "Expand": (0,), "Cast": (0,), "Tile": (0,), "Concat": None, "Add": None,
    "Mul": None, "Max": None, "Min": None, "ReduceSum": (0,), "ReduceProd": (0,), "ReduceMax": (0,),
    "ReduceMin": (0,), "Abs": (), "Shape": (), "Size": (),
}
_DEPTH = 48  # how far back a value's sign is traced


class _Signs:
    def __init__(self, graph: onnx.GraphProto):
        self.producer = {out: node for node in graph.node for out in node.output if out}
        self.constants = {init.name: init for init in graph.initializer}
        for node in graph.node:
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1 \
                    and node.attribute[0].name == "value":
                self.constants[node.output[0]] = node.attribute[0].t
        self.memo: dict[str, bool] = {}

    def constant(self, name: str) -> np.ndarray | None:
        tensor = self.constants.get(name)
        if tensor is None or tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
            return None
        count = int(np.prod(tensor.dims)) if tensor.dims else 1
        return numpy_helper.to_array(tensor) if count <= 64 else None

    def nonnegative(self, name: str, depth: int = _DEPTH) -> bool:
        if name in self.memo:
            return self.memo[name]
        value = self.constant(name)
        if value is not None:
            found = value.dtype.kind in "iub" and bool(np.all(value >= 0))
        else:
            node = self.producer.get(name)
            if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in _KEEPS_SIGN \
                    or depth <= 0:
                found = False
            else:
                inputs = _KEEPS_SIGN[node.op_type]
                names = [n for n in node.input if n] if inputs is None else [node.input[i] for i in inputs]
                found = all(self.nonnegative(n, depth - 1) for n in names)
        self.memo[name] = found
        return found


def _elem_type(signs: _Signs, name: str, depth: int = _DEPTH) -> int | None:
    """The element type of the shape value ``name``: a constant's, a Shape's or Size's (int64), a Cast's
    target, else that of the first input of an operator that keeps it."""
    value = signs.constant(name)
    if value is not None:
        return helper.np_dtype_to_tensor_dtype(value.dtype)
    node = signs.producer.get(name)
    if node is None or depth <= 0:
        return None
    if node.op_type in ("Shape", "Size"):
        return onnx.TensorProto.INT64
    if node.op_type == "Cast":
        return next((int(a.i) for a in node.attribute if a.name == "to"), None)
    return _elem_type(signs, node.input[0], depth - 1) if node.op_type in _KEEPS_SIGN and node.input else None


def _scalar(signs: _Signs, name: str, depth: int = 8) -> bool:
    """Whether ``name`` is a scalar: a 0-d constant, a Gather of one 0-d index, or arithmetic of scalars."""
    value = signs.constant(name)
    if value is not None:
        return value.ndim == 0
    node = signs.producer.get(name)
    if node is None or depth <= 0 or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Gather":
        index = signs.constant(node.input[1])
        return index is not None and index.ndim == 0
    if node.op_type in ("Add", "Sub", "Mul", "Div", "Max", "Min", "Cast"):
        return all(_scalar(signs, n, depth - 1) for n in node.input if n)
    return False


def _parts(signs: _Signs, name: str) -> list | None:
    """The one-element pieces of the 1-D shape vector ``name`` (a Concat of constants and unsqueezed scalars,
    or a constant): each a value name, or a constant's element."""
    value = signs.constant(name)
    if value is not None:
        return list(value.reshape(-1)) if value.ndim == 1 else None
    node = signs.producer.get(name)
    if node is None or node.op_type != "Concat" or node.domain not in ("", "ai.onnx"):
        return None
    parts: list = []
    for part in node.input:
        value = signs.constant(part)
        producer = signs.producer.get(part)
        if value is not None and value.ndim == 1:
            parts.extend(value)
        elif producer is not None and producer.op_type == "Unsqueeze" and _scalar(signs, producer.input[0]):
            parts.append(part)
        else:
            return None
    return parts


def _replacement(signs: _Signs, node: onnx.NodeProto) -> tuple[str, list] | None:
    """(c, its pieces with the Where applied to the constant ones) when ``node`` is Where(Equal(c, k), a, c)
    (or Equal(k, c)) over a shape vector ``c`` whose other pieces are non-negative, ``k`` all negative and
    ``k``, ``a`` broadcasting into ``c`` without widening it; else None."""
    if node.op_type != "Where" or node.domain not in ("", "ai.onnx") or len(node.input) != 3:
        return None
    equal = signs.producer.get(node.input[0])
    if equal is None or equal.op_type != "Equal" or equal.domain not in ("", "ai.onnx"):
        return None
    c = node.input[2]
    if c not in equal.input:
        return None
    k = equal.input[1] if equal.input[0] == c else equal.input[0]
    negatives, filler = signs.constant(k), signs.constant(node.input[1])
    if negatives is None or filler is None or negatives.dtype.kind not in "iu" or not np.all(negatives < 0) \
            or negatives.ndim > 1 or filler.ndim > 1:
        return None
    parts = _parts(signs, c)
    if parts is None or any(size not in (1, len(parts)) for size in (negatives.size, filler.size)):
        return None
    negatives = np.broadcast_to(negatives.reshape(-1), (len(parts),))
    filler = np.broadcast_to(filler.reshape(-1), (len(parts),))
    resolved = []
    for part, negative, fill in zip(parts, negatives, filler):
        if isinstance(part, str):
            if not signs.nonnegative(part):
                return None
            resolved.append(part)
        else:
            resolved.append(fill if part == negative else part)
    return c, resolved


def see_through_shape_wheres(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each such top-level Where replaced by a Cast of ``c`` to its own type, in place (the
    caller's copy: the constants folding found are in it by then)."""
    if not any(node.op_type == "Where" for node in model.graph.node):
        return model
    signs = _Signs(model.graph)
    found = {index: made for index, node in enumerate(model.graph.node)
             if node.op_type == "Where" and (made := _replacement(signs, node)) is not None}
    for index, (c, parts) in found.items():
        node = model.graph.node[index]
        elem = _elem_type(signs, c)
        if elem is None:
            continue
        dtype = helper.tensor_dtype_to_np_dtype(elem)
        inputs = []
        for position, part in enumerate(parts):
            if not isinstance(part, str):
                part_name = f"{node.output[0]}__shape_where_{position}"
                model.graph.initializer.append(numpy_helper.from_array(np.array([part], dtype), part_name))
                part = part_name
            inputs.append(part)
        node.CopyFrom(helper.make_node("Concat", inputs, [node.output[0]], name=node.name, axis=0))
    return model
