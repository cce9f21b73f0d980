"""The in-memory graph the runtime plans and executes: plain Python objects built from ONNX protos.

A :class:`Graph` holds nodes in topological order, its initializers as numpy arrays, and what is
known of each value's type and shape (from onnx shape inference). Subgraph attributes (If, Loop,
Scan bodies) are :class:`Graph` objects too; their ``outer_names`` list the outer-scope values
they read.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .dtypes import DataType
from .records import Record

# A dimension is a concrete int, a symbolic name, or None when unknown.
Dim = int | str | None


class TypeInfo(Record):
    """The type of one value: a tensor (dtype + shape), a sequence, an optional, or a map.

    ``shape`` is None when the rank is unknown. ``elem`` is the element type of a sequence or
    optional.
    """

    __slots__ = __match_args__ = ("kind", "dtype", "shape", "elem", "key_dtype")
    kind: str  # "tensor" | "sparse_tensor" | "sequence" | "optional" | "map" | "unknown"
    dtype: DataType | None
    shape: tuple[Dim, ...] | None
    elem: TypeInfo | None
    key_dtype: DataType | None

    def __init__(self,
                 kind: str = "tensor", dtype: DataType | None = None, shape: tuple[Dim, ...] | None = None,
                 elem: TypeInfo | None = None, key_dtype: DataType | None = None) -> None:
        self.kind = kind
        self.dtype = dtype
        self.shape = shape
        self.elem = elem
        self.key_dtype = key_dtype

    @property
    def is_tensor(self) -> bool:
        return self.kind == "tensor"

    @property
    def static_shape(self) -> tuple[int, ...] | None:
        """The shape when every dimension is a concrete int, else None."""
        shape = self.shape
        if shape is None:
            return None
        for d in shape:  # (a plain loop: asked per node input at planning, where a generator is slower; 50054a1)
            if not isinstance(d, int):
                return None
        return tuple(shape)  # type: ignore[arg-type]  # every dim is an int: checked above

    def describe(self) -> str:
        if self.kind == "tensor":
            dims = "?" if self.shape is None else "[" + ", ".join(
                "?" if d is None else str(d) for d in self.shape) + "]"
            return f"tensor({self.dtype if self.dtype is not None else '?'}){dims}"
        if self.kind in ("sequence", "optional"):
            return f"{self.kind}({self.elem.describe() if self.elem else '?'})"
        return self.kind


class ValueInfo(Record):
    __slots__ = __match_args__ = ("name", "type", "doc")
    name: str
    type: TypeInfo
    doc: str

    def __init__(self, name: str, type: TypeInfo | None = None, doc: str = "") -> None:
        self.name = name
        self.type = TypeInfo() if type is None else type
        self.doc = doc


class Node(Record):
    """One operator application. ``inputs`` uses "" for an omitted optional input.

    ``attrs`` maps attribute names to Python values: int, float, str, numpy arrays (tensors),
    :class:`Graph` (subgraphs) and lists of those. ``opset`` is the effective opset version of
    the node's domain in the model.
    """

    __slots__ = __match_args__ = ("op_type", "inputs", "outputs", "name", "domain", "attrs", "opset", "doc", "proto")
    op_type: str
    inputs: list[str]
    outputs: list[str]
    name: str
    domain: str
    attrs: dict[str, Any]
    opset: int
    doc: str
    proto: Any  # the onnx.NodeProto it came from, kept for function expansion

    def __init__(self,
                 op_type: str, inputs: list[str], outputs: list[str], name: str = "", domain: str = "",
                 attrs: dict[str, Any] | None = None, opset: int = 0, doc: str = "", proto: Any = None) -> None:
        self.op_type = op_type
        self.inputs = inputs
        self.outputs = outputs
        self.name = name
        self.domain = domain
        self.attrs = {} if attrs is None else attrs
        self.opset = opset
        self.doc = doc
        self.proto = proto

    __eq__ = object.__eq__  # (equal only to itself, and hashable)
    __hash__ = object.__hash__

    @property
    def qualified_op(self) -> str:
        return f"{self.domain}::{self.op_type}" if self.domain else self.op_type

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def subgraphs(self) -> list[Graph]:
        if not self.attrs:  # most nodes: asked for by every pass over the graph
            return []
        found: list[Graph] = []
        for value in self.attrs.values():
            if isinstance(value, Graph):
                found.append(value)
            elif isinstance(value, list) and value and isinstance(value[0], Graph):
                found.extend(value)  # an attribute's list holds one kind (GRAPHS), not mixed
        return found

    def __repr__(self) -> str:
        return f"Node({self.name!r}, {self.qualified_op}, in={self.inputs}, out={self.outputs})"


class Graph(Record):
    __slots__ = __match_args__ = ("name", "nodes", "inputs", "outputs", "initializers", "value_info", "opsets",
                                  "outer_names", "doc")
    name: str
    nodes: list[Node]
    inputs: list[ValueInfo]
    outputs: list[ValueInfo]
    initializers: dict[str, np.ndarray]
    value_info: dict[str, ValueInfo]
    opsets: dict[str, int]
    outer_names: list[str]
    doc: str

    def __init__(self,
                 name: str, nodes: list[Node], inputs: list[ValueInfo], outputs: list[ValueInfo],
                 initializers: dict[str, np.ndarray], value_info: dict[str, ValueInfo], opsets: dict[str, int],
                 outer_names: list[str] | None = None, doc: str = "") -> None:
        self.name = name
        self.nodes = nodes
        self.inputs = inputs
        self.outputs = outputs
        self.initializers = initializers
        self.value_info = value_info
        self.opsets = opsets
        self.outer_names = [] if outer_names is None else outer_names
        self.doc = doc

    __eq__ = object.__eq__  # (equal only to itself, and hashable)
    __hash__ = object.__hash__

    def type_of(self, name: str) -> TypeInfo | None:
        info = self.value_info.get(name)
        return info.type if info is not None else None

    def producers(self) -> dict[str, Node]:
        return {out: node for node in self.nodes for out in node.outputs if out}

    def consumers(self) -> dict[str, list[Node]]:
        found: dict[str, list[Node]] = {}
        for node in self.nodes:
            for name in node.inputs:
                if name:
                    found.setdefault(name, []).append(node)
        return found

    def walk(self):
        """Every node of this graph and, depth first, of its subgraphs."""
        for node in self.nodes:
            yield node
            for sub in node.subgraphs():
                yield from sub.walk()


class Model(Record):
    __slots__ = __match_args__ = ("graph", "opsets", "ir_version", "producer_name", "producer_version", "domain",
                                  "model_version", "doc_string", "metadata", "functions", "path", "inference_proto")
    graph: Graph
    opsets: dict[str, int]
    ir_version: int
    producer_name: str
    producer_version: str
    domain: str
    model_version: int
    doc_string: str
    metadata: dict[str, str]
    functions: dict[tuple[str, str], Any]
    path: str | None
    # The model as onnx shape inference reads it (large initializers as typed inputs): inferred anew
    # per input signature when a session specializes its graph (session/specialize.py).
    inference_proto: Any

    def __init__(self,
                 graph: Graph, opsets: dict[str, int], ir_version: int = 0, producer_name: str = "",
                 producer_version: str = "", domain: str = "", model_version: int = 0, doc_string: str = "",
                 metadata: dict[str, str] | None = None, functions: dict[tuple[str, str], Any] | None = None,
                 path: str | None = None, inference_proto: Any = None) -> None:
        self.graph = graph
        self.opsets = opsets
        self.ir_version = ir_version
        self.producer_name = producer_name
        self.producer_version = producer_version
        self.domain = domain
        self.model_version = model_version
        self.doc_string = doc_string
        self.metadata = {} if metadata is None else metadata
        self.functions = {} if functions is None else functions
        self.path = path
        self.inference_proto = inference_proto

    __eq__ = object.__eq__  # (equal only to itself, and hashable)
    __hash__ = object.__hash__


def clone_graph(graph: Graph) -> Graph:
    """A copy of ``graph`` that passes may rewrite without touching the original: nodes, their lists and
    attributes, value infos and subgraphs are copied; weights (numpy arrays, read-only) are shared."""
    nodes = [Node(n.op_type, list(n.inputs), list(n.outputs), n.name, n.domain,
                  {k: _clone_attribute(v) for k, v in n.attrs.items()} if n.attrs else {}, n.opset, n.doc, n.proto)
             for n in graph.nodes]
    return Graph(graph.name, nodes, list(graph.inputs), list(graph.outputs), dict(graph.initializers),
                 dict(graph.value_info), dict(graph.opsets), list(graph.outer_names), graph.doc)


def _clone_attribute(value: Any) -> Any:
    if isinstance(value, Graph):
        return clone_graph(value)
    if isinstance(value, list):
        return [_clone_attribute(v) for v in value]
    return value
