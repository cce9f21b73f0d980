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
weights (an initializer a MatMul, Gemm, convolution or Gather reads) whose control-flow bodies read no outer
half-precision value by name; graphs of single operators on float16 feeds (the ONNX backend cases) keep their
per-operator float16 semantics. Nodes that must keep their half-precision types (another provider's, operators
outside the standard and Microsoft domains, control flow whose bodies compute in half precision) stay as
written, and the float32 regions between them meet them through one conversion per value each way (the
region pass: FloatToHalf of a value they read, HalfToFloat of a value they make; the weights they read keep a
half-precision copy).
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.dtypes import DataType
from onnx_runtime.ir import Graph, Node, TypeInfo, ValueInfo
from onnx_runtime.optimizer.context import FreshNames

from .code_tables import fuse_code_tables
from .contrib_lowering import lower_contrib_operators
from .fusions import FUSED_DOMAIN

HALF = frozenset({DataType.FLOAT16, DataType.BFLOAT16})
# Operators whose constant inputs are weights: a half-precision one marks a converted model.
_WEIGHTED = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Gather", "Einsum"})
# Domains whose operators are generic in their float type (T in float16, float, ...).
_DOMAINS = frozenset({"", "com.microsoft", "ai.onnx.ml"})
# Operators that read only their input's shape.
_SHAPE_READERS = frozenset({"Shape", "Size"})
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


def _kept_nodes(graph: Graph, half: _Half, nodes: list[Node], owns) -> set[int] | None:
    """The ids of the half-precision nodes that keep their types (the region pass: another provider's nodes,
    other domains' operators, control flow whose bodies compute in half precision), the others computing in
    float32 with conversions at the edges between; None where the graph cannot be converted at all."""
    bodies = [sub for node in graph.nodes for sub in node.subgraphs()]
    if graph.outer_names or any(any(name in half.types for name in sub.outer_names) for sub in bodies):
        return None  # a body reads an outer half-precision value by name: it would see it in float32
    inputs = {vi.name for vi in graph.inputs}
    if any(name in inputs for name in graph.initializers if name in half.types):
        return None  # an overridable weight: a feed may replace it in its own type
    if any(vi.name in half.types and vi.name in graph.initializers for vi in graph.outputs):
        return None
    return {id(node) for node in nodes if node.domain not in _DOMAINS or (owns is not None and not owns(node))
            or not all(_half_free(sub) for sub in node.subgraphs())}


def _float32_type(info: TypeInfo) -> TypeInfo:
    return TypeInfo(info.kind, DataType.FLOAT, info.shape, info.elem, info.key_dtype)


class _Rewriter:
    def __init__(self, graph: Graph, half: _Half, kept: set[int] | frozenset = frozenset()):
        self.graph, self.half, self.kept = graph, half, kept
        self.opset = graph.opsets.get("", 13)
        self.fresh = FreshNames(graph)
        self.half_copies: dict[str, str] = {}  # a value -> its half-precision copy, which kept nodes read

    def cast(self, source: str, target: str, to: DataType, shape_of: str) -> Node:
        """A Cast node, with the value info of ``target`` (the shape of ``shape_of``)."""
        info = self.graph.type_of(shape_of)
        shape = info.shape if info is not None and info.is_tensor else None
        self.graph.value_info[target] = ValueInfo(target, TypeInfo("tensor", to, shape))
        return Node("Cast", [source], [target], name=self.fresh(f"{target}/cast"), attrs={"to": int(to)},
                    opset=self.opset)

    def run(self) -> None:
        graph, half = self.graph, self.half
        self.keep_half_weights()
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
            if id(node) in self.kept:
                nodes.extend(self.kept_node(node, renamed, inputs, outputs))
                continue
            written = (list(node.inputs), list(node.outputs), {key: id(value) for key, value in node.attrs.items()})
            node.inputs = [renamed.get(name, name) for name in node.inputs]
            node.outputs = [renamed.get(name, name) if name in outputs else name for name in node.outputs]
            nodes.extend(self.node(node))
            if written != (node.inputs, node.outputs, {key: id(value) for key, value in node.attrs.items()}):
                node.proto = None  # no longer the node as written (onnx inference of it reads the proto)
        graph.nodes = _merge_input_roundings(nodes, inputs) + tail

    def keep_half_weights(self) -> None:
        """The half-precision weights the kept nodes read stay, under new names, beside their float32 copies."""
        graph = self.graph
        for node in graph.nodes:
            if id(node) not in self.kept:
                continue
            for name in node.inputs:
                if name in graph.initializers and name in self.half.types and name not in self.half_copies:
                    copy = self.fresh(f"{name}/{self.half.types[name].name.lower()}")
                    graph.initializers[copy] = graph.initializers[name]
                    graph.value_info[copy] = ValueInfo(copy, TypeInfo("tensor", self.half.types[name],
                                                                      graph.initializers[name].shape))
                    self.half_copies[name] = copy

    def kept_node(self, node: Node, renamed: dict[str, str], inputs: set[str], outputs: set[str]) -> list[Node]:
        """A node that keeps its half-precision types: its half inputs narrowed from their float32 values (one
        copy per value, shared by the kept nodes), its half outputs under new names, widened for the rest."""
        half, before, after = self.half.types, [], []
        reads = []
        for name in node.inputs:
            if name in half and name not in inputs and name not in self.half_copies:
                copy = self.fresh(f"{name}/{half[name].name.lower()}")
                source = renamed.get(name, name) if name in outputs else name
                before.append(self.conversion("FloatToHalf", [source], [copy], half[name]))
                self.half_copies[name] = copy
            reads.append(self.half_copies.get(name, name) if name in half else name)
        writes = []
        for name in node.outputs:
            if name not in half:
                writes.append(name)
                continue
            copy = self.fresh(f"{name}/{half[name].name.lower()}")
            info = self.graph.type_of(name)
            self.graph.value_info[copy] = ValueInfo(copy, TypeInfo("tensor", half[name], info.shape if info else None))
            self.half_copies[name] = copy
            writes.append(copy)
            target = renamed.get(name, name) if name in outputs else name
            after.append(self.conversion("HalfToFloat", [copy], [target], DataType.FLOAT))
        if (reads, writes) != (list(node.inputs), list(node.outputs)):
            node.inputs, node.outputs, node.proto = reads, writes, None
        return [*before, node, *after]

    def edges(self, renamed: dict[str, str], inputs: set[str]) -> tuple[list[Node], list[Node]]:
        """The conversions at the graph's half-precision inputs (widened once, in one node: their readers read
        the float32 copies) and outputs (computed in float32 under new names, narrowed once, in one node per
        type); ``renamed`` gets the new names."""
        graph, half = self.graph, self.half
        head, tail = [], []
        sources = [vi.name for vi in graph.inputs if vi.name in half.types]
        for name in sources:
            renamed[name] = self.fresh(f"{name}/float32")
        if sources:
            head.append(self.conversion("HalfToFloat", sources, [renamed[n] for n in sources], DataType.FLOAT))
        for to in (DataType.FLOAT16, DataType.BFLOAT16):
            targets = [vi.name for vi in graph.outputs if half.types.get(vi.name) == to and vi.name not in inputs]
            for name in targets:
                renamed[name] = self.fresh(f"{name}/float32")
            if targets:
                tail.append(self.conversion("FloatToHalf", [renamed[n] for n in targets], targets, to))
        return head, tail

    def conversion(self, op_type: str, sources: list[str], targets: list[str], to: DataType) -> Node:
        """A node of ops/precision.py converting each of ``sources`` to ``targets`` (type ``to``)."""
        for source, target in zip(sources, targets):
            info = self.graph.type_of(source)
            shape = info.shape if info is not None and info.is_tensor else None
            self.graph.value_info[target] = ValueInfo(target, TypeInfo("tensor", to, shape))
        attrs = {} if op_type == "HalfToFloat" else {"to": int(to)}
        return Node(op_type, list(sources), list(targets), name=self.fresh(f"{targets[0]}/{op_type}"),
                    domain=FUSED_DOMAIN, attrs=attrs, opset=1)

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


def _merge_input_roundings(nodes: list[Node], inputs: set[str]) -> list[Node]:
    """The roundings of graph inputs to each half type as one node, where the first of them was: a decoder's
    past keys and values are rounded in one call instead of a node each."""
    groups: dict[int, list[Node]] = {}
    for node in nodes:
        if node.op_type == "RoundToHalf" and node.domain == FUSED_DOMAIN and node.inputs[0] in inputs:
            groups.setdefault(node.attrs["to"], []).append(node)
    merged = {id(group[0]): group for group in groups.values() if len(group) > 1}
    dropped = {id(node) for group in merged.values() for node in group[1:]}
    result = []
    for node in nodes:
        if id(node) in dropped:
            continue
        group = merged.get(id(node))
        if group is not None:
            node.inputs = [rounding.inputs[0] for rounding in group]
            node.outputs = [rounding.outputs[0] for rounding in group]
        result.append(node)
    return result


_CONVERSIONS = frozenset({"HalfToFloat", "FloatToHalf", "RoundToHalf"})


def _known_dims(info: TypeInfo | None) -> int:
    return -1 if info is None or not info.is_tensor or info.shape is None \
        else sum(isinstance(dim, int) for dim in info.shape)


def _refresh_conversion_shapes(graph: Graph) -> bool:
    """A converted graph specialized to an input signature (session/specialize.py): the specializer infers
    the shapes of the model's values only, so each value a conversion made here (an input's float32 copy, an
    output computed in float32) takes the shape of its model counterpart, and the fusions that need shapes
    (attention over a past, say) see them."""
    changed = False
    for node in graph.nodes:
        if node.domain != FUSED_DOMAIN or node.op_type not in _CONVERSIONS:
            continue
        for source, target in zip(node.inputs, node.outputs):
            have, want = (source, target) if _known_dims(graph.type_of(source)) > _known_dims(graph.type_of(target)) \
                else (target, source)
            shape, old = graph.type_of(have).shape, graph.value_info.get(want)
            if _known_dims(graph.type_of(have)) <= _known_dims(graph.type_of(want)) or old is None:
                continue
            graph.value_info[want] = ValueInfo(want, TypeInfo("tensor", old.type.dtype, shape), old.doc)
            changed = True
    return changed


def compute_half_in_float32(graph: Graph, owns=None) -> bool:
    """Rewrite a model with half-precision weights to compute in float32 (see the module docstring)."""
    _refresh_conversion_shapes(graph)
    half = _Half(graph)
    if not half.types or not _has_half_weights(graph, half):
        return False
    nodes = [node for node in graph.nodes if half.touches(node)]
    kept = _kept_nodes(graph, half, nodes, owns)
    if kept is None or len(kept) == len(nodes):
        return False
    _Rewriter(graph, half, kept).run()
    return True


compute_half_in_float32.before_optimizer = True  # type: ignore[attr-defined]  # the fusions then see float32


def shapes_of_inputs_read_from_inputs(graph: Graph, owns=None) -> bool:
    """Shape and Size read a graph input itself rather than its float32 copy or its rounding (the optimizer's
    bypasses, or the converter's Cast of a float32 input, may have led them there): the specializer
    (session/specialize.py) gives the inputs each signature's shapes, but not the values made here, so only the
    inputs' Shape reads fold, and the exporters' shape chains after them, for each signature (and a decode
    loop's shape program sees its lengths). An input only those read is not widened."""
    widenings = [node for node in graph.nodes if node.op_type == "HalfToFloat" and node.domain == FUSED_DOMAIN]
    sources = {target: source for node in graph.nodes if node.domain == FUSED_DOMAIN and node.op_type in _CONVERSIONS
               for source, target in zip(node.inputs, node.outputs)}
    changed = False
    for node in graph.nodes:
        if node.op_type in _SHAPE_READERS and not node.domain and node.inputs and node.inputs[0] in sources \
                and (owns is None or owns(node)):
            source = node.inputs[0]
            while source in sources:
                source = sources[source]
            node.inputs = [source, *node.inputs[1:]]
            node.proto = None
            changed = True
    read = {name for node in graph.nodes for name in node.inputs} | {vi.name for vi in graph.outputs}
    for node in widenings:
        kept = [(source, target) for source, target in zip(node.inputs, node.outputs) if target in read]
        if len(kept) < len(node.outputs):
            node.inputs, node.outputs = [source for source, _ in kept], [target for _, target in kept]
            changed = True
    emptied = {id(node) for node in widenings if not node.outputs}
    graph.nodes = [node for node in graph.nodes if id(node) not in emptied]
    return changed


# The contrib lowering after the conversion: a converted graph's contrib nodes are float32 by then. The code
# tables run after the generic optimizer (constant folding made their scalars) and before the QDQ passes.
PRECISION_PASSES = [compute_half_in_float32, lower_contrib_operators, shapes_of_inputs_read_from_inputs,
                    fuse_code_tables]
