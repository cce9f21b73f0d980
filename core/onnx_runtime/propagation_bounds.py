"""An upper bound on what onnx's data propagation would hold in memory, computed before it runs.

onnx's shape inference with ``data_prop=True`` evaluates the values of Shape, Size, Gather, Slice, Concat,
Squeeze, Unsqueeze, Cast, Add, Sub, Mul and Div in C++, one protobuf dimension (tens of bytes) per element,
whatever their number: a Concat that repeats one constant a thousand times, nested three deep, asks for
billions and ends in ``std::bad_alloc`` (or the OOM killer, without an address-space limit) after minutes.
The bound here walks the same operators over element counts only (a Concat's is the sum of its inputs', an
elementwise operator's the largest, Gather's its indices'), so a model whose propagated values could pass
``DATA_PROP_ELEMENTS`` is inferred without data propagation: an aid to planning, not needed to run.

A ConstantOfShape's element count is the product of its input's values, which propagation may know: the bound
keeps, beside element counts, a bound on the magnitude of small integer values (constants, ``Size`` of a shape,
sums and products of those), so ``ConstantOfShape(Size(Shape(x)) - axis)`` with a mutated ``axis`` of -2**31 is
seen to make a 2**31-element shape whose Reshape would ask onnx for a rank of two billion. A ConstantOfShape of
values nothing bounds (a shape of symbolic dimensions) is unsized; only its use as a rank-setting input stops
propagation.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import numpy_helper

DATA_PROP_ELEMENTS = 1 << 20

_SAME = frozenset({"Cast", "CastLike", "Identity", "Squeeze", "Unsqueeze", "Slice", "Neg", "Abs", "Reshape",
                   "Flatten"})
# Operators whose output's rank is the length of one input's value (its index).
_SHAPING = {"Reshape": 1, "Expand": 1, "ConstantOfShape": 0, "Resize": 3, "Upsample": 1}
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div", "Max", "Min", "Mod", "Where", "Equal"})


def _attribute_elements(attr: onnx.AttributeProto) -> int:
    if attr.type == onnx.AttributeProto.TENSOR:
        return math.prod(max(int(d), 0) for d in attr.t.dims)
    if attr.type == onnx.AttributeProto.SPARSE_TENSOR:
        return math.prod(max(int(d), 0) for d in attr.sparse_tensor.dims)
    return max(len(attr.ints), len(attr.floats), len(attr.strings), 1)


_MAGNITUDE_ELEMENTS = 64  # constants up to this many integer elements have their magnitude read
_KEEPS_MAGNITUDE = frozenset({"Cast", "Identity", "Squeeze", "Unsqueeze", "Slice", "Neg", "Abs", "Reshape",
                              "Flatten", "Gather", "Concat", "Max", "Min", "Div", "Mod", "Expand"})


def _tensor_magnitude(tensor: onnx.TensorProto) -> int | None:
    """The largest |element| of a small integer tensor; None for other tensors (not bounded here)."""
    if math.prod(tensor.dims) > _MAGNITUDE_ELEMENTS:
        return None
    try:
        values = numpy_helper.to_array(tensor)
    except Exception:  # a malformed constant: model_checks names it; here it is just not bounded
        return None
    if values.dtype.kind not in "iub" or values.size == 0:
        return 0 if values.size == 0 else None
    return int(np.abs(values.astype(np.int64)).max())


def _constant_magnitude(node: onnx.NodeProto) -> int | None:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.TENSOR:
            return _tensor_magnitude(attr.t)
        if attr.name == "value_int":
            return abs(attr.i)
        if attr.name == "value_ints":
            return max((abs(v) for v in attr.ints), default=0)
    return None


def _magnitude(node: onnx.NodeProto, known: list[int | None]) -> int | None:
    """A bound on |element| of ``node``'s output from its inputs' bounds (None: not bounded here)."""
    op = node.op_type
    if op == "Constant":
        return _constant_magnitude(node)
    if op == "ConstantOfShape":
        fill = next((a.t for a in node.attribute if a.name == "value"), None)
        return _tensor_magnitude(fill) if fill is not None else 0
    data = known[:1] if op in ("Gather", "Slice", "Reshape", "Expand", "Div", "Mod") else known
    if not data or any(m is None for m in data):
        return None
    bounds = [m for m in data if m is not None]
    if op in ("Add", "Sub"):
        return sum(bounds)
    if op == "Mul":
        return math.prod(bounds)
    return max(bounds) if op in _KEEPS_MAGNITUDE else None


def _capped_power(base: int, exponent: int, cap: int) -> int:
    """min(base ** exponent, cap + 1) without building huge integers."""
    result = 1
    for _ in range(exponent):
        result *= max(base, 0)
        if result > cap:
            return cap + 1
    return result


def _declared_rank(graph: onnx.GraphProto) -> int:
    values = (*graph.input, *graph.output, *graph.value_info)
    return max((len(vi.type.tensor_type.shape.dim) for vi in values if vi.type.HasField("tensor_type")), default=0)


def _node_elements(node: onnx.NodeProto, found: list[int], rank: int) -> int | None:
    """A bound on the elements of ``node``'s propagated output, given its inputs' bounds (None: not propagated)."""
    op = node.op_type
    if op == "Constant":
        return max((_attribute_elements(a) for a in node.attribute), default=0)
    if op == "Concat":
        return sum(found)
    if op in _ELEMENTWISE:
        return max(found, default=0)
    if op in _SAME:
        return found[0] if found else 0
    if op == "Gather":
        return found[1] if len(found) > 1 else 0
    if op == "Shape":
        return rank
    return 1 if op == "Size" else None


class _Bounds:
    def __init__(self, model: onnx.ModelProto, limit: int):
        self.limit = limit
        self.sizes: dict[str, int] = {}
        self.rank = _declared_rank(model.graph)  # the largest rank a value may have: declared, or a shape's length
        self.largest = self.rank  # what a function's argument may hold: the largest value yet
        self.magnitudes: dict[str, int] = {}  # a bound on |element| of small integer values, where known
        self.unsized: set[str] = set()  # values whose element count nothing here bounds
        self.shapes: dict[str, str] = {}  # output of a Shape -> its input (a Size of it is a rank)

    def exceeded(self, graph: onnx.GraphProto) -> bool:
        self.rank = max(self.rank, _declared_rank(graph))
        for init in graph.initializer:
            self.sizes[init.name] = math.prod(max(int(d), 0) for d in init.dims)
            magnitude = _tensor_magnitude(init)
            if magnitude is not None:
                self.magnitudes[init.name] = magnitude
        for node in graph.node:
            for attr in node.attribute:
                subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                if any(self.exceeded(sub) for sub in subgraphs):
                    return True
            found = [self.sizes.get(name, 0) for name in node.input if name]
            shaping = _SHAPING.get(node.op_type)
            if shaping is not None and len(node.input) > shaping:  # a value that sets a rank
                if node.input[shaping] in self.unsized:
                    return True
                self.rank = max(self.rank, self.sizes.get(node.input[shaping], 0))
            self._track_magnitude(node)
            size = self._constant_of_shape_elements(node) if node.op_type == "ConstantOfShape" \
                else _node_elements(node, found, self.rank)
            if size is None:
                continue
            if size > self.limit:
                return True
            self.largest = max(self.largest, size)
            self.sizes.update((name, size) for name in node.output if name)
        return False

    def _constant_of_shape_elements(self, node: onnx.NodeProto) -> int | None:
        """Elements of a 1-D ConstantOfShape output (a shape value): at most its one input value's magnitude."""
        shape = node.input[0] if node.input else ""
        if self.sizes.get(shape, 1) != 1:
            return None  # an output of rank 0 or above 1: not a shape value, so nothing propagation holds
        of = self.shapes.get(shape)
        if of is not None and of in self.sizes:  # the shape of a value: as many elements as that value
            return self.sizes[of]
        magnitude = self.magnitudes.get(shape)
        if magnitude is None:
            self.unsized.update(name for name in node.output if name)
            return None
        return _capped_power(magnitude, self.sizes.get(shape, 0), self.limit)

    def _track_magnitude(self, node: onnx.NodeProto) -> None:
        """Record a bound on |element| of ``node``'s output, and carry unsized values through."""
        op, inputs = node.op_type, [name for name in node.input if name]
        outputs = [name for name in node.output if name]
        if op in _SAME or op in _ELEMENTWISE or op == "Concat" or op == "Gather":
            data = inputs if op in _ELEMENTWISE or op == "Concat" else inputs[:1]
            if any(name in self.unsized for name in data):
                self.unsized.update(outputs)
        magnitude: int | None
        if op == "Shape":  # each dimension of a value of n elements is at most n
            self.shapes.update((name, inputs[0]) for name in outputs if inputs)
            magnitude = self.sizes.get(inputs[0]) if inputs else None
        elif op == "Size":
            magnitude = self.rank if inputs and inputs[0] in self.shapes else None
        else:
            magnitude = _magnitude(node, [self.magnitudes.get(name) for name in inputs])
        if magnitude is not None:
            self.magnitudes.update((name, magnitude) for name in outputs)


def propagates_large_values(model: onnx.ModelProto, limit: int = DATA_PROP_ELEMENTS) -> bool:
    """Whether any value onnx's data propagation could compute for ``model`` (its graph, subgraphs and local
    functions) might hold more than ``limit`` elements."""
    bounds = _Bounds(model, limit)
    if bounds.exceeded(model.graph):
        return True
    for _ in range(2):  # a function may call another: its arguments are bounded by what any value holds
        for function in model.functions:
            bounds.sizes.update((name, bounds.largest) for name in function.input)
            if bounds.exceeded(onnx.GraphProto(node=function.node)):
                return True
    return False


__all__ = ["DATA_PROP_ELEMENTS", "propagates_large_values"]
