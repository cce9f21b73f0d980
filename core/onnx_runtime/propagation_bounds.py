"""An upper bound on what onnx's data propagation would hold in memory, computed before it runs.

onnx's shape inference with ``data_prop=True`` evaluates the values of Shape, Size, Gather, Slice, Concat,
Squeeze, Unsqueeze, Cast, Add, Sub, Mul and Div in C++, one protobuf dimension (tens of bytes) per element,
whatever their number: a Concat that repeats one constant a thousand times, nested three deep, asks for
billions and ends in ``std::bad_alloc`` (or the OOM killer, without an address-space limit) after minutes.
The bound here walks the same operators over element counts only (a Concat's is the sum of its inputs', an
elementwise operator's the largest, Gather's its indices'), so a model whose propagated values could pass
``DATA_PROP_ELEMENTS`` is inferred without data propagation: an aid to planning, not needed to run.
"""

from __future__ import annotations

import math

import onnx

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

    def exceeded(self, graph: onnx.GraphProto) -> bool:
        self.rank = max(self.rank, _declared_rank(graph))
        for init in graph.initializer:
            self.sizes[init.name] = math.prod(max(int(d), 0) for d in init.dims)
        for node in graph.node:
            for attr in node.attribute:
                subgraphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
                if any(self.exceeded(sub) for sub in subgraphs):
                    return True
            found = [self.sizes.get(name, 0) for name in node.input if name]
            shaping = _SHAPING.get(node.op_type)
            if shaping is not None and len(node.input) > shaping:  # a value that sets a rank
                self.rank = max(self.rank, self.sizes.get(node.input[shaping], 0))
            size = _node_elements(node, found, self.rank)
            if size is None:
                continue
            if size > self.limit:
                return True
            self.largest = max(self.largest, size)
            self.sizes.update((name, size) for name in node.output if name)
        return False


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
