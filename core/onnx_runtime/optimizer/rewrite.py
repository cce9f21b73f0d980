"""Graph-editing helpers the passes share: who reads a value, rewiring nodes, adding constants.

Every edit keeps a node's ``proto`` (the NodeProto function expansion reads) in step with its
inputs and outputs, and keeps ``graph.value_info`` describing exactly the values that exist.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

import numpy as np
import onnx

from ..dtypes import DataType
from ..ir import Graph, Node, TypeInfo, ValueInfo
from ..loader import implicit_inputs, outer_reads
from .context import PassContext


class Uses:
    """Who reads each value of one graph: nodes (explicit inputs), nested subgraphs (outer-scope
    reads, by name) and the graph's outputs. The maps are built on first use."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.graph_outputs = {vi.name for vi in graph.outputs}

    @cached_property
    def readers(self) -> dict[str, list[Node]]:
        readers: dict[str, list[Node]] = {}
        for node in self.graph.nodes:
            for name in node.inputs:
                if name:
                    readers.setdefault(name, []).append(node)
        return readers

    @cached_property
    def implicit(self) -> set[str]:
        return {name for node in self.graph.nodes for name in implicit_inputs(node)}

    def is_read(self, name: str) -> bool:
        return name in self.readers or name in self.implicit or name in self.graph_outputs

    def pinned(self, name: str) -> bool:
        """Whether ``name`` must keep existing under that name (a graph output or a subgraph's read)."""
        return name in self.graph_outputs or name in self.implicit

    def only_reader(self, name: str) -> Node | None:
        """The one node reading ``name`` (once), when nothing else reads it."""
        readers = self.readers.get(name, [])
        if len(readers) != 1 or self.pinned(name):
            return None
        return readers[0]

    def move_readers(self, old: str, new: str) -> None:
        """Make every node reading ``old`` read ``new`` instead."""
        moved = self.readers.pop(old, [])
        for node in dict.fromkeys(moved):  # a node reading ``old`` twice is rewired once
            set_io(node, inputs=[new if name == old else name for name in node.inputs])
        self.readers.setdefault(new, []).extend(moved)

    def rewire(self, node: Node, inputs: list[str] | None = None, outputs: list[str] | None = None) -> None:
        """:func:`set_io`, keeping the reader lists in step."""
        self.forget(node)
        set_io(node, inputs, outputs)
        for name in node.inputs:
            if name:
                self.readers.setdefault(name, []).append(node)

    def forget(self, node: Node) -> None:
        """Drop ``node``'s reads (it is being removed or rewired)."""
        for name in node.inputs:
            readers = self.readers.get(name)
            if readers is not None and node in readers:
                readers.remove(node)
                if not readers:
                    del self.readers[name]


def live_values(graph: Graph) -> tuple[set[str], list[Node]]:
    """(the values something reads on the way to the graph's outputs, the nodes nothing live reads, last first):
    one backward sweep, readers coming after producers, subgraphs' outer reads included."""
    live = {vi.name for vi in graph.outputs}
    dead: list[Node] = []
    for node in reversed(graph.nodes):
        if any(out and out in live for out in node.outputs):
            live.update(name for name in node.inputs if name)
            live.update(implicit_inputs(node))
        else:
            dead.append(node)
    return live, dead


def set_io(node: Node, inputs: list[str] | None = None, outputs: list[str] | None = None) -> None:
    """Replace a node's inputs and/or outputs, and its proto's to match (on a copy: the proto may be
    the caller's model)."""
    if inputs is not None:
        node.inputs = list(inputs)
    if outputs is not None:
        node.outputs = list(outputs)
    if node.proto is not None:
        proto = onnx.NodeProto()
        proto.CopyFrom(node.proto)
        del proto.input[:]
        del proto.output[:]
        proto.input.extend(node.inputs)
        proto.output.extend(node.outputs)
        node.proto = proto


def set_attr(node: Node, name: str, value) -> None:
    """Set one scalar/list attribute on a node and its proto."""
    node.attrs[name] = value
    if node.proto is not None:
        proto = onnx.NodeProto()
        proto.CopyFrom(node.proto)
        kept = [a for a in proto.attribute if a.name != name]
        del proto.attribute[:]
        proto.attribute.extend(kept)
        proto.attribute.append(onnx.helper.make_attribute(name, value))
        node.proto = proto


def new_node(op_type: str, inputs: list[str], outputs: list[str], name: str, opset: int, **attrs) -> Node:
    """A default-domain node, with the proto function expansion would need."""
    proto = onnx.helper.make_node(op_type, inputs, outputs, name=name, **attrs)
    return Node(op_type=op_type, inputs=list(inputs), outputs=list(outputs), name=name, attrs=dict(attrs),
                opset=opset, proto=proto)


def constant(graph: Graph, name: str) -> np.ndarray | None:
    """The initializer ``name`` holds, or None for a computed value (or an omitted input)."""
    return graph.initializers.get(name) if name else None


def tensor_type(array: np.ndarray) -> TypeInfo:
    try:
        dtype = DataType.from_numpy(array.dtype)
    except Exception:  # a dtype with no ONNX type: leave it unknown, as the loader does
        dtype = None
    return TypeInfo("tensor", dtype, tuple(array.shape))


def add_initializer(graph: Graph, name: str, array: np.ndarray) -> None:
    """Make ``name`` a constant of the graph, frozen: kernels share it across runs."""
    array.flags.writeable = False
    graph.initializers[name] = array
    graph.value_info[name] = ValueInfo(name, tensor_type(array))


def fresh_name(graph: Graph, base: str) -> str:
    """``base``, or ``base_1``, ``base_2``, ...: the first that names no constant and no typed value of the graph."""
    name, index = base, 0
    while name in graph.initializers or graph.type_of(name) is not None:
        index += 1
        name = f"{base}_{index}"
    return name


def forget_value(graph: Graph, name: str) -> None:
    """Drop what the graph knows about a value that no longer exists."""
    if name and name not in {vi.name for vi in graph.inputs} | {vi.name for vi in graph.outputs}:
        graph.value_info.pop(name, None)


def remove_nodes(graph: Graph, removed: list[Node]) -> None:
    """Remove nodes (keeping the order of the rest) and forget the values only they produced."""
    if not removed:
        return
    gone = {id(node) for node in removed}
    graph.nodes = [node for node in graph.nodes if id(node) not in gone]
    produced = {out for node in graph.nodes for out in node.outputs}
    for node in removed:
        for out in node.outputs:
            if out not in produced and out not in graph.initializers:
                forget_value(graph, out)


def visit_subgraphs(graph: Graph, context: PassContext, visit: Callable[[Graph], object]) -> None:
    """``visit(sub)`` for each subgraph of ``graph``, with ``graph``'s constants and shapes as the outer ones
    (``context.inside``) and the types of the outer values ``sub`` reads in its value_info, so its passes and
    kernels see their shapes; afterwards ``sub``'s outer reads are recomputed (folding may have dropped some,
    which the enclosing graph then need not keep)."""
    with context.inside(graph):
        for node in graph.nodes:
            for sub in node.subgraphs():
                for name in sub.outer_names:
                    info = graph.value_info.get(name)
                    if info is not None:
                        sub.value_info[name] = info
                visit(sub)
                read = sorted(outer_reads(sub, set(sub.outer_names)))
                for name in set(sub.outer_names) - set(read):
                    sub.value_info.pop(name, None)
                sub.outer_names = read


def channel_vector(array: np.ndarray, rank: int, channels: int) -> np.ndarray | None:
    """``array`` as one value per channel (axis 1) when, broadcast against a rank-``rank`` tensor
    with ``channels`` channels, it varies along that axis at most and adds no dimension."""
    if array.ndim > rank:
        return None
    shape = (1,) * (rank - array.ndim) + array.shape
    if any(dim != 1 for axis, dim in enumerate(shape) if axis != 1) or shape[1] not in (1, channels):
        return None
    return np.broadcast_to(array.reshape(-1), (channels,))
