"""Dimensions that onnx shape inference leaves unknown, derived from the graph: a decode step's template
keeps the past's length symbolic (session/specialize.py), and the exporters compute the mask's and the
present's lengths from it (Shape(past)[2] + 1 -> Range -> Expand; Concat(past, new)). onnx inference gives
each such length a fresh symbol, so nothing proves the mask fits the scores or that an attention's output
is [batch, heads, 1, head_size], and every Shape read downstream stays computed.

This pass tracks small int64 tensors as lists of affine terms (a shape symbol plus an offset) through the
shape arithmetic (Shape, Gather, Slice, Squeeze, Unsqueeze, Reshape, Concat, Cast, Add, Sub, Max, Equal,
Where), names the lengths they give Range, Expand, Reshape, ConstantOfShape and Concat along an axis, and
re-infers the nodes downstream (onnx inference, node by node) with the refined shapes. A derived length is
written as a symbol of its own spelling (``_PREFIX``), so two values of one derived length share it. Every
symbol is a shape dimension, so never negative; nothing is assumed beyond that.
"""

from __future__ import annotations

import math
import re
from typing import Any

import onnx

from ..dtypes import DataType
from ..ir import Dim, Graph, Node, TypeInfo, ValueInfo
from ..loader import SHAPE_VALUE_LIMIT, convert_type
from .context import PassContext
from .rewrite import constant

# A symbol plus an offset; the symbol None for a number. Booleans stand for Equal's results.
Term = tuple[str | None, int]
_PREFIX = "~"  # derived lengths: "~<symbol>~<offset>"
_DERIVED = re.compile(r"^~(.+)~(-?\d+)$")
_ONNX = ("", "ai.onnx")
_INTS = frozenset({DataType.INT64, DataType.INT32})


def refine_symbolic_dims(graph: Graph, context: PassContext) -> bool:
    """Refine the shapes of ``graph``'s values where a derived length replaces an unknown or a fresh
    symbol; return whether any changed."""
    if not any(_has_symbol(vi.type) for vi in graph.inputs):
        return False
    if any(isinstance(d, str) and d.startswith(_PREFIX) and not _DERIVED.match(d)
           for vi in graph.value_info.values() if vi.type.is_tensor and vi.type.shape for d in vi.type.shape):
        return False  # a model's own symbol spelled like ours: leave its shapes alone
    state = _State(graph)
    changed = False
    for node in graph.nodes:
        if node.domain not in _ONNX or node.subgraphs():
            continue
        state.track_value(node)
        for name, shape in zip(node.outputs, state.shapes_of(node)):
            if name and shape is not None and state.refine(name, shape):
                changed = True
    return changed


def _has_symbol(info: TypeInfo) -> bool:
    return info.is_tensor and info.shape is not None and any(not isinstance(d, int) for d in info.shape)


def _term(dim: Dim) -> Term | None:
    if isinstance(dim, int):
        return (None, dim)
    if not isinstance(dim, str) or dim.startswith("unk__"):
        return None
    match = _DERIVED.match(dim)
    return (match.group(1), int(match.group(2))) if match else (dim, 0)


def _dim(term: Term | None) -> Dim:
    if term is None:
        return None
    symbol, offset = term
    if symbol is None:
        return offset
    return symbol if offset == 0 else f"{_PREFIX}{symbol}~{offset}"


def _plus(a, b) -> Term | None:
    """a + b where at most one has a symbol."""
    if a is None or b is None or isinstance(a, bool) or isinstance(b, bool) or (a[0] is not None and b[0] is not None):
        return None
    return (a[0] if a[0] is not None else b[0], a[1] + b[1])


def _known_length(term: Term | None) -> bool:
    """A term that is a length: a number >= 0, or a symbol (>= 0) plus an offset >= 0."""
    return term is not None and not isinstance(term, bool) and term[1] >= 0


class _State:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.values: dict[str, list] = {}  # int tensors of rank <= 1: their elements as terms (None unknown)
        self.scalars: set[str] = set()
        self.refined: set[str] = set()

    # -- values ----------------------------------------------------------------------------------
    def value(self, name: str) -> list | None:
        if name in self.values:
            return self.values[name]
        array = constant(self.graph, name)
        if array is None or array.dtype.kind not in "iub" or array.ndim > 1 or array.size > SHAPE_VALUE_LIMIT:
            return None
        return [bool(v) if array.dtype.kind == "b" else (None, int(v)) for v in array.reshape(-1)]

    def _set(self, node: Node, terms: list | None, scalar: bool) -> None:
        if terms is None or all(t is None for t in terms):
            return
        self.values[node.outputs[0]] = terms
        if scalar:
            self.scalars.add(node.outputs[0])

    def is_scalar(self, name: str) -> bool:
        if name in self.scalars:
            return True
        array = constant(self.graph, name)
        return array is not None and array.ndim == 0

    def track_value(self, node: Node) -> None:
        if not node.outputs or not node.outputs[0] or not node.inputs:
            return
        info = self.graph.type_of(node.outputs[0])
        if info is None or not info.is_tensor or info.dtype not in (*_INTS, DataType.BOOL):
            return
        track = self._TRACKERS.get(node.op_type)
        if track is not None:
            track(self, node, info)

    def _shape(self, node: Node, info: TypeInfo) -> None:
        shape = self.shape(node.inputs[0])
        if shape is not None:
            self._set(node, [_term(d) for d in shape[slice(node.attr("start", 0), node.attr("end"))]], False)

    def _same_elements(self, node: Node, info: TypeInfo) -> None:
        """Cast, Identity and the reshapes of a value of rank <= 1 into rank <= 1: the elements in order."""
        source = self.value(node.inputs[0])
        if node.op_type == "Cast" and (info.dtype not in _INTS or _dtype(self.graph, node.inputs[0]) not in _INTS):
            return  # to or from bool the values change
        rank = len(info.shape) if info.shape is not None else None
        if source is not None and rank is not None and rank <= 1 and (rank == 1 or len(source) == 1):
            self._set(node, list(source), rank == 0)

    def _concat(self, node: Node, info: TypeInfo) -> None:
        parts = [self.value(name) for name in node.inputs]
        if int(node.attr("axis", 0)) in (0, -1) and all(p is not None for p in parts):
            self._set(node, [t for p in parts if p is not None for t in p], False)

    def _gather(self, node: Node, info: TypeInfo) -> None:
        if len(node.inputs) != 2 or int(node.attr("axis", 0)) not in (0, -1):
            return
        data, indices = self.value(node.inputs[0]), constant(self.graph, node.inputs[1])
        if data is not None and indices is not None and indices.ndim <= 1 \
                and all(-len(data) <= int(i) < len(data) for i in indices.reshape(-1)):
            self._set(node, [data[int(i)] for i in indices.reshape(-1)], indices.ndim == 0)

    def _slice(self, node: Node, info: TypeInfo) -> None:
        if len(node.inputs) < 3:
            return
        data = self.value(node.inputs[0])
        bounds = [constant(self.graph, n) if n else None for n in node.inputs[1:5]] + [None] * (5 - len(node.inputs))
        if data is None or bounds[0] is None or bounds[1] is None or bounds[0].size != 1 or bounds[1].size != 1:
            return
        if bounds[2] is not None and int(bounds[2].reshape(-1)[0]) not in (0, -1):
            return
        step = 1 if bounds[3] is None else int(bounds[3].reshape(-1)[0])
        if step == 0:
            return
        self._set(node, data[int(bounds[0].reshape(-1)[0]):int(bounds[1].reshape(-1)[0]):step], False)

    def _elementwise(self, node: Node, info: TypeInfo) -> None:
        found = [self.value(name) for name in node.inputs]
        operands = [o for o in found if o is not None]
        if len(operands) != len(found) or len({len(o) for o in operands} - {1}) > 1:
            return
        size = max(len(o) for o in operands)
        columns = [[o[0] if len(o) == 1 else o[i] for o in operands] for i in range(size)]
        combine: Any = {"Add": lambda a, b: _plus(a, b),
                   "Sub": lambda a, b: None if b is None or isinstance(b, bool) or b[0] is not None
                   else _plus(a, (None, -b[1])),
                   "Max": _max, "Equal": _equal, "Where": _where}[node.op_type]
        terms = [combine(*column) for column in columns]
        self._set(node, terms, all(self.is_scalar(name) for name in node.inputs))

    _TRACKERS = {"Shape": _shape, "Gather": _gather, "Slice": _slice, "Concat": _concat,
                 **dict.fromkeys(("Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape", "Flatten"), _same_elements),
                 **dict.fromkeys(("Add", "Sub", "Max", "Equal", "Where"), _elementwise)}

    # -- shapes ----------------------------------------------------------------------------------
    def shape(self, name: str) -> tuple | None:
        info = self.graph.type_of(name)
        if info is None or not info.is_tensor:
            array = constant(self.graph, name)
            return None if array is None else tuple(array.shape)
        return info.shape

    def shapes_of(self, node: Node) -> list[tuple | None]:
        op, inputs = node.op_type, node.inputs
        if op == "Range" and len(inputs) == 3:
            start, limit, delta = (self.value(n) for n in inputs)
            if start == [(None, 0)] and delta == [(None, 1)] and limit is not None and len(limit) == 1 \
                    and _known_length(limit[0]):
                return [(_dim(limit[0]),)]
            return [None]
        if op in ("Expand", "ConstantOfShape", "Reshape"):
            target = self.value(inputs[1] if op != "ConstantOfShape" else inputs[0]) if inputs else None
            if target is not None and all(isinstance(t, tuple) or t is None for t in target):
                return [self._targeted(node, target)]
            return [None]
        if op == "Concat" and node.opset >= 4:
            return [self._concatenated(node)]
        if not any(name in self.refined for name in inputs if name):
            return [None] * len(node.outputs)
        return self._inferred(node)

    def _targeted(self, node: Node, target: list) -> tuple | None:
        if node.op_type == "ConstantOfShape":
            return tuple(_dim(t) if _known_length(t) else None for t in target)
        shape = self.shape(node.inputs[0])
        if shape is None:
            return None
        if node.op_type == "Reshape":
            return _reshaped(shape, target, bool(node.attr("allowzero", 0)))
        rank = max(len(shape), len(target))
        padded = (1,) * (rank - len(shape)) + tuple(shape)
        wanted = [(None, 1)] * (rank - len(target)) + list(target)
        dims: list[Dim] = []
        for have, want in zip(padded, wanted):
            if want is None or (want != (None, 1) and isinstance(have, int) and have != 1):
                # A number other than 1 is what any valid target broadcasts it to; a symbol may be 1.
                dims.append(have if isinstance(have, int) and have != 1 else None)
            elif want == (None, 1):
                dims.append(have)
            elif have == 1 and _known_length(want):
                dims.append(_dim(want))
            elif _term(have) is not None and _term(have) == want:
                dims.append(have)
            else:
                dims.append(None)
        return tuple(dims)

    def _concatenated(self, node: Node) -> tuple | None:
        found = [self.shape(n) for n in node.inputs]
        shapes = [s for s in found if s is not None]
        if len(shapes) != len(found) or not shapes or len({len(s) for s in shapes}) != 1:
            return None
        rank = len(shapes[0])
        axis = int(node.attr("axis", 0))
        axis = axis + rank if axis < 0 else axis
        if not 0 <= axis < rank:
            return None
        total: Term | None = (None, 0)
        for s in shapes:
            total = _plus(total, _term(s[axis]))
        dims = []
        for i in range(rank):
            if i == axis:
                dims.append(_dim(total))
            else:
                known = sorted((s[i] for s in shapes if _term(s[i]) is not None), key=lambda d: not isinstance(d, int))
                dims.append(known[0] if known else None)
        return tuple(dims)

    def _inferred(self, node: Node) -> list[tuple | None]:
        """Output shapes by onnx inference on ``node`` alone, given the refined input shapes."""
        proto = node.proto if node.proto is not None else _proto_of(node)
        if proto is None:
            return [None] * len(node.outputs)
        types, values = {}, {}
        for name in filter(None, node.inputs):
            info = self.graph.type_of(name)
            array = constant(self.graph, name)
            if array is not None:
                if array.size <= SHAPE_VALUE_LIMIT:
                    values[name] = onnx.numpy_helper.from_array(array, name)
                dtype, shape = DataType.from_numpy(array.dtype), tuple(array.shape)
            elif info is None or not info.is_tensor or info.dtype is None:
                return [None] * len(node.outputs)
            else:
                dtype, shape = info.dtype, info.shape  # type: ignore[assignment]
            types[name] = onnx.helper.make_tensor_type_proto(int(dtype), None if shape is None else list(shape))
        try:
            schema = onnx.defs.get_schema(node.op_type, node.opset, "")
            inferred = onnx.shape_inference.infer_node_outputs(
                schema, proto, types, values, opset_imports=[onnx.helper.make_opsetid("", node.opset)])
        except Exception:  # an aid only: what it cannot infer stays as it was
            return [None] * len(node.outputs)
        found = [inferred.get(name) for name in node.outputs]
        return [None if f is None else convert_type(f).shape for f in found]

    def refine(self, name: str, shape: tuple) -> bool:
        """Write ``shape`` where it says more than the value's: a number, or a derived length for an unknown
        or a fresh symbol."""
        info = self.graph.type_of(name)
        if info is None or not info.is_tensor or info.shape is None or len(info.shape) != len(shape):
            return False
        merged = tuple(_better(old, new) for old, new in zip(info.shape, shape))
        if merged == info.shape:
            return False
        self.graph.value_info[name] = ValueInfo(name, TypeInfo("tensor", info.dtype, merged))
        self.refined.add(name)
        return True


def _dtype(graph: Graph, name: str) -> DataType | None:
    info = graph.type_of(name)
    if info is not None and info.is_tensor:
        return info.dtype
    array = constant(graph, name)
    return None if array is None else DataType.from_numpy(array.dtype)


def _proto_of(node: Node) -> onnx.NodeProto | None:
    """A NodeProto for a node a pass made (a fusion's Gelu or RMSNormalization), for onnx inference."""
    try:
        return onnx.helper.make_node(node.op_type, list(node.inputs), list(node.outputs), name=node.name,
                                     **(node.attrs or {}))
    except Exception:  # an attribute onnx.helper cannot write: no inference for it
        return None


def _reshaped(shape: tuple, target: list, allowzero: bool) -> tuple:
    """Reshape's output dims: 0 copies the input's (unless allowzero), a length names itself, and one -1 is
    what the element count leaves where every other factor is a number."""
    dims: list[Dim] = []
    for axis, t in enumerate(target):
        if t == (None, 0) and not allowzero:
            dims.append(shape[axis] if axis < len(shape) else None)
        elif t is not None and t[0] is not None and t[1] == 0 and not allowzero:
            dims.append(None)  # a bare symbol may be 0 at run time, which copies the input's dim instead
        else:
            dims.append(_dim(t) if _known_length(t) else None)
    if target.count((None, -1)) != 1:
        return tuple(dims)
    rest = [d for d, t in zip(dims, target) if t != (None, -1) and isinstance(d, int)]
    if len(rest) != len(target) - 1:
        return tuple(dims)
    product = math.prod(rest)
    numbers = [d for d in shape if isinstance(d, int)]
    if len(numbers) == len(shape):
        if product and math.prod(shape) % product == 0:
            dims[target.index((None, -1))] = math.prod(shape) // product
    elif len(numbers) == len(shape) - 1 and product and product == math.prod(numbers):
        # One symbolic dimension and the other factors cancel: -1 is that dimension ([1, s] -> [1, -1]).
        (symbolic,) = [d for d in shape if not isinstance(d, int)]
        if _term(symbolic) is not None:
            dims[target.index((None, -1))] = symbolic
    return tuple(dims)


def _better(old: Dim, new: Dim) -> Dim:
    if isinstance(old, int) or new is None:
        return old
    if isinstance(new, int):
        return new
    if old is None or old.startswith("unk__"):
        return new
    if old.startswith("specialized_"):
        return old  # the template's own symbol
    # A derived length over a symbol onnx could not relate to it (a model's declared symbol stays otherwise).
    return new if _DERIVED.match(new) or new.startswith("specialized_") else old


def _max(a, b):
    if a is None or b is None or isinstance(a, bool) or isinstance(b, bool):
        return None
    if a == b:
        return a
    if a[0] is None and b[0] is None:
        return (None, max(a[1], b[1]))
    return None


def _equal(a, b):
    if a is None or b is None or isinstance(a, bool) or isinstance(b, bool):
        return None
    if a == b:
        return True
    if a[0] is None and b[0] is None:
        return False
    # A symbol plus an offset >= 0 is a length: never a negative number.
    symbolic, number = (a, b) if a[0] is not None else (b, a)
    if number[0] is None and symbolic[1] >= 0 and number[1] < 0:
        return False
    return None


def _where(condition, a, b):
    if not isinstance(condition, bool):
        return None
    return a if condition else b


__all__ = ["refine_symbolic_dims"]
