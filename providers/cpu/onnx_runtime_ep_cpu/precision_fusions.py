"""Half-precision models computed in float32: the CPU provider's pass run before the generic optimizer.

A model converted to float16 (onnxruntime's ``convert_float_to_float16``, most often with float32 inputs and
outputs and a Cast at each edge) keeps its weights and every intermediate value in float16. Numpy has no
BLAS for half-precision floats, and the kernels compute them in float32 anyway (algorithms/precision.py), so
run node by node the model pays a widening of every weight and a conversion of every value at every node,
and the fusions, written for float32 constants, miss. This pass computes the half-precision part of the graph
in float32 instead, the way onnxruntime's CPU provider does (its cast-insertion pass widens the nodes it has
no float16 kernel for and keeps the values between them in float32):

- half-precision weights (initializers) are widened to float32 once, here, at session creation;
- every half-precision value becomes float32, and the attributes that name or hold a half-precision type
  (Cast's and the generators' ``to``/``dtype``, ConstantOfShape's value) follow;
- the roundings the graph writes stay: a Cast to float16 of a float32 value becomes RoundToHalf (the Cast to
  float16 and back in one compiled pass; from other types, the two Casts), so a value the model rounds (its
  inputs at the edge, the converter's casts around the operators it keeps in float32) is rounded as before;
  half-precision graph inputs and outputs keep their type, converted once at the edge.

The optimizer and the fusions then see a float32 graph. The pass fires only on models with half-precision
weights (an initializer a MatMul, Gemm, convolution or Gather reads), every node of whose half-precision part
this provider runs, in the standard or Microsoft domains, whose control-flow bodies neither read nor make
half-precision values; graphs of single operators on float16 feeds (the ONNX backend cases) keep their
per-operator float16 semantics.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.dtypes import DataType
from onnx_runtime.ir import Graph, Node, TypeInfo, ValueInfo
from onnx_runtime.optimizer.context import FreshNames

from .fusions import FUSED_DOMAIN

HALF = frozenset({DataType.FLOAT16, DataType.BFLOAT16})
# Operators whose constant inputs are weights: a half-precision one marks a converted model.
_WEIGHTED = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Gather", "Einsum"})
# Domains whose operators are generic in their float type (T in float16, float, ...).
_DOMAINS = frozenset({"", "com.microsoft", "ai.onnx.ml"})
# Attributes that name a node's output element type.
_TYPE_ATTRS = ("to", "dtype", "output_dtype")


def _is_half_array(value) -> bool:
    return isinstance(value, np.ndarray) and value.dtype in (np.dtype(np.float16), DataType.BFLOAT16.numpy)


class _Half:
    """The half-precision values of one graph, by name, with their type."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.types: dict[str, DataType] = {}
        for name, array in graph.initializers.items():
            if _is_half_array(array):
                self.types[name] = DataType.from_numpy(array.dtype)
        for info in [*graph.value_info.values(), *graph.inputs, *graph.outputs]:
            if info.type.is_tensor and info.type.dtype in HALF:
                self.types[info.name] = info.type.dtype

    def touches(self, node: Node) -> bool:
        return any(name in self.types for name in (*node.inputs, *node.outputs)) \
            or any(node.attrs.get(attr) in HALF for attr in _TYPE_ATTRS) \
            or any(_is_half_array(value) for value in node.attrs.values())


def _has_half_weights(graph: Graph, half: _Half) -> bool:
    return any(node.op_type in _WEIGHTED and not node.domain
               and any(name in graph.initializers and name in half.types and graph.initializers[name].ndim >= 2
                       for name in node.inputs)
               for node in graph.nodes)


def _half_free(graph: Graph) -> bool:
    """Whether ``graph`` (a branch or loop body) neither holds nor makes a half-precision value."""
    half = _Half(graph)
    return not half.types and not any(half.touches(node) for node in graph.nodes) \
        and all(_half_free(sub) for node in graph.nodes for sub in node.subgraphs())


def _convertible(graph: Graph, half: _Half, nodes: list[Node], owns) -> bool:
    bodies = [sub for node in graph.nodes for sub in node.subgraphs()]
    if graph.outer_names or any(any(name in half.types for name in sub.outer_names) or not _half_free(sub)
                                for sub in bodies):
        return False  # a body would read or make half-precision values with the types it was written for
    inputs = {vi.name for vi in graph.inputs}
    if any(name in inputs for name in graph.initializers if name in half.types):
        return False  # an overridable weight: a feed may replace it in its own type
    if any(vi.name in half.types and vi.name in graph.initializers for vi in graph.outputs):
        return False
    return all(node.domain in _DOMAINS and (owns is None or owns(node)) for node in nodes)


def _float32_type(info: TypeInfo) -> TypeInfo:
    return TypeInfo(info.kind, DataType.FLOAT, info.shape, info.elem, info.key_dtype)


class _Rewriter:
    def __init__(self, graph: Graph, half: _Half):
        self.graph, self.half = graph, half
        self.opset = graph.opsets.get("", 13)
        self.fresh = FreshNames(graph)

    def cast(self, source: str, target: str, to: DataType, shape_of: str) -> Node:
        """A Cast node, with the value info of ``target`` (the shape of ``shape_of``)."""
        info = self.graph.type_of(shape_of)
        shape = info.shape if info is not None and info.is_tensor else None
        self.graph.value_info[target] = ValueInfo(target, TypeInfo("tensor", to, shape))
        return Node("Cast", [source], [target], name=self.fresh(f"{target}/cast"), attrs={"to": int(to)},
                    opset=self.opset)

    def run(self) -> None:
        graph, half = self.graph, self.half
        for name, array in list(graph.initializers.items()):
            if name in half.types:
                graph.initializers[name] = np.asarray(array, dtype=np.float32)
        inputs, outputs = {vi.name for vi in graph.inputs}, {vi.name for vi in graph.outputs}
        renamed: dict[str, str] = {}
        head, tail = self.edges(renamed, inputs)
        for name, info in list(graph.value_info.items()):
            if name in half.types and name not in inputs and name not in outputs and info.type.is_tensor:
                graph.value_info[name] = ValueInfo(name, _float32_type(info.type), info.doc)
        for old, new in renamed.items():
            info = graph.type_of(old)
            if info is not None and new not in graph.value_info:
                graph.value_info[new] = ValueInfo(new, _float32_type(info))
        nodes: list[Node] = list(head)
        for node in graph.nodes:
            node.inputs = [renamed.get(name, name) for name in node.inputs]
            node.outputs = [renamed.get(name, name) if name in outputs else name for name in node.outputs]
            nodes.extend(self.node(node))
        graph.nodes = nodes + tail

    def edges(self, renamed: dict[str, str], inputs: set[str]) -> tuple[list[Node], list[Node]]:
        """The Casts at the graph's half-precision inputs (widened once, their readers read the float32 copy)
        and outputs (computed in float32 under a new name, rounded once); ``renamed`` gets the new names."""
        graph, half = self.graph, self.half
        head, tail = [], []
        for vi in graph.inputs:
            if vi.name in half.types:
                wide = renamed[vi.name] = self.fresh(f"{vi.name}/float32")
                head.append(self.cast(vi.name, wide, DataType.FLOAT, vi.name))
        for vi in graph.outputs:
            if vi.name in half.types and vi.name not in inputs:
                wide = renamed[vi.name] = self.fresh(f"{vi.name}/float32")
                tail.append(self.cast(wide, vi.name, half.types[vi.name], vi.name))
        return head, tail

    def node(self, node: Node) -> list[Node]:
        """``node`` computing in float32; a Cast to a half type becomes the rounding it computes."""
        for attr in _TYPE_ATTRS:
            if node.attrs.get(attr) in HALF and not (node.op_type == "Cast" and attr == "to"):
                node.attrs[attr] = int(DataType.FLOAT)
        for key, value in node.attrs.items():
            if _is_half_array(value):
                node.attrs[key] = np.asarray(value, dtype=np.float32)
        if node.op_type != "Cast" or node.domain or node.attrs.get("to") not in HALF:
            return [node]
        to = DataType(node.attrs["to"])
        source = self.graph.type_of(node.inputs[0])
        source_type = self.half.types.get(node.inputs[0], source.dtype if source is not None else None)
        node.attrs["to"] = int(DataType.FLOAT)
        if source_type in (to, DataType.BOOL):
            return [node]  # already of the type (a no-op Cast), or a bool: exact in float32
        if source_type in (DataType.FLOAT, *HALF):  # float32 now: rounded in place of the two Casts
            return [Node("RoundToHalf", list(node.inputs), list(node.outputs), name=node.name, domain=FUSED_DOMAIN,
                         attrs={"to": int(to)}, opset=1)]
        # The rounding the graph writes: to the half type, and back to float32 for the readers.
        rounded = self.fresh(f"{node.outputs[0]}/{to.name.lower()}")
        narrow = self.cast(node.inputs[0], rounded, to, node.outputs[0])
        node.inputs = [rounded]
        return [narrow, node]


def compute_half_in_float32(graph: Graph, owns=None) -> bool:
    """Rewrite a model with half-precision weights to compute in float32 (see the module docstring)."""
    half = _Half(graph)
    if not half.types or not _has_half_weights(graph, half):
        return False
    nodes = [node for node in graph.nodes if half.touches(node)]
    if not _convertible(graph, half, nodes, owns):
        return False
    _Rewriter(graph, half).run()
    return True


compute_half_in_float32.before_optimizer = True  # type: ignore[attr-defined]  # the fusions then see float32

PRECISION_PASSES = [compute_half_in_float32]
