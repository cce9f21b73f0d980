"""Transposes moved through the operators that commute with them, so inverse pairs meet and cancel.

A network written channels-first around channels-last blocks (ConvNeXt: each block's LayerNorm and pointwise
products run on Transpose(x, (0, 2, 3, 1)) and give their result back through Transpose(., (0, 3, 1, 2))) adds
the residual in the channels-first layout and transposes the sum again for the next block. Our Transpose is a
view, so each pair costs its readers a copy of a permuted view (or a strided pass) and the plan two steps.
Rewrites, repeated until none applies:

- Transpose(Transpose(x, p), q): one Transpose by the composed permutation, none where it is the identity;
- Conv(Transpose(x, (0, 3, 1, 2))) where NhwcConv has a channels-last path for its geometry and type
  (ops/conv_nhwc.py: a patch convolution, a float32 depthwise one of stride 1, a depthwise one onto a small map):
  Transpose(NhwcConv(x), (0, 3, 1, 2));
- an elementwise node (Add, Sub, Mul, Div; a one-input elementwise op) with inputs transposed by one permutation p
  runs on their sources, where every reader of its result takes a Transpose by p without a permuted view: a
  Transpose by p's inverse (they cancel), a Conv the rule above then takes, a two-input elementwise node whose
  other input is transposed alike, or (every input transposed) a reduction the next rule maps. Its result is
  what the first inverse Transpose gave, under that one's name, and the others read a Transpose of it. Inputs not
  transposed (of the same rank only) get a Transpose by p's inverse of their own, only where one cancels: one
  input's Transpose is traded for one that cancels (moving it back and forth would gain nothing);
- a reduction with keepdims=0 of Transpose(x, p) reduces x over the mapped axes, where the kept axes keep
  their order (ConvNeXt's final mean over the spatial axes).

Elsewhere the readers would read a permuted view of what the node now writes contiguous, so nothing else moves:
a value that some reader needs channels-first keeps its Transposes. Each rewrite gives the same bits (permuting
axes commutes with elementwise arithmetic and with broadcasting between equal ranks; NhwcConv's paths round as
their channels-first counterparts do, not bit for bit). After it, FusedMatMul's residual fusion (fusions.py, after
this pass) takes a channels-last residual Add into the block's last product (its rounding then that of the fused
epilogue), and the next LayerNormalization reads its input contiguous: ConvNeXt runs channels-last from the stem's
LayerNorm to the final mean. The values this pass names (MOVED) are typed again from their
producers' inputs in a specialized graph, where the model's shape inference does not reach them.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.dtypes import DataType
from onnx_runtime.ir import Graph, Node, TypeInfo, ValueInfo
from onnx_runtime.optimizer.context import FreshNames

from .fused_domain import FUSED_DOMAIN
from .fusions import GraphView, owned

# Elementwise operators of any rank whose inputs broadcast alike (numpy rules), by input count.
_BINARY = frozenset({"Add", "Sub", "Mul", "Div"})
_UNARY = frozenset({"Relu", "Sigmoid", "Tanh", "Erf", "Gelu", "Neg", "Abs", "Sqrt", "Exp", "Identity"})
# Reductions with axes (an attribute before opset 18, an input from it; ReduceSum's from 13).
_REDUCTIONS = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                         "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"})
_TO_FIRST = (0, 3, 1, 2)  # channels-last to channels-first
# The names of the values this pass makes end with this (_retype_moved types them again in a specialized graph).
MOVED = "/channels_moved"
# Each rewrite moves a Transpose past one node or removes one; the bound only guards against a graph that would
# trade them back and forth.
MAX_REWRITES = 256


def _perm(node: Node | None) -> tuple[int, ...] | None:
    """A plain Transpose's permutation (None for any other node, or one without an explicit perm, or one whose perm
    is not a permutation of its axes: such a node is left to the Transpose kernel, which rejects it by name)."""
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") \
            or len(node.inputs) != 1 or not node.inputs[0]:
        return None
    perm = node.attr("perm")
    if perm is None:
        return None
    try:
        axes = tuple(int(a) for a in perm)
    except (TypeError, ValueError):
        return None
    return axes if sorted(axes) == list(range(len(axes))) else None


def _inverse(perm: tuple[int, ...]) -> tuple[int, ...]:
    inverse = [0] * len(perm)
    for position, axis in enumerate(perm):
        inverse[axis] = position
    return tuple(inverse)


def _rank(graph: Graph, name: str) -> int | None:
    info = graph.type_of(name)
    if info is None or not info.is_tensor or info.shape is None:
        array = graph.initializers.get(name)
        return array.ndim if array is not None else None
    return len(info.shape)


class _Sinking:
    """One round's rewrites over ``graph`` (maps rebuilt per rewrite: the graphs are small)."""

    def __init__(self, graph: Graph, owns):
        self.graph, self.owns = graph, owns
        self.view = GraphView(graph)
        self.fresh = FreshNames(graph)

    def pinned(self, name: str) -> bool:
        return name in self.view.outputs or name in self.view.inner_reads

    def transposed(self, name: str) -> tuple[Node, tuple[int, ...]] | None:
        node = self.view.producer.get(name)
        perm = _perm(node)
        if perm is None or _rank(self.graph, node.inputs[0]) not in (None, len(perm)):  # type: ignore[union-attr]
            return None
        return node, perm  # type: ignore[return-value]

    def _typed(self, name: str, source: str, perm: tuple[int, ...]) -> None:
        """``name``'s value info: ``source``'s dtype and its shape permuted by ``perm``."""
        info = self.graph.type_of(source)
        if info is None or not info.is_tensor:
            return
        shape = tuple(info.shape[a] for a in perm) if info.shape is not None and len(info.shape) == len(perm) \
            else None
        self.graph.value_info[name] = ValueInfo(name, TypeInfo("tensor", info.dtype, shape))

    def transpose_node(self, source: str, perm: tuple[int, ...], output: str, like: Node) -> Node:
        node = Node("Transpose", [source], [output], name=self.fresh(f"{like.name or like.op_type}/moved"),
                    attrs={"perm": list(perm)}, opset=self.graph.opsets.get("", like.opset) or like.opset)
        self._typed(output, source, perm)
        return node

    # -- rewrites: each returns whether it changed the graph ---------------------------------------------
    def merge_pair(self, outer: Node) -> bool:
        """Transpose(Transpose(x, p), q) -> Transpose(x, p o q), or x itself for the identity."""
        q = _perm(outer)
        found = self.transposed(outer.inputs[0]) if q is not None else None
        if found is None or not owned(self.owns, [outer]):
            return False
        inner, p = found
        if len(p) != len(q):
            return False
        composed = tuple(p[axis] for axis in q)
        output = outer.outputs[0]
        if composed == tuple(range(len(composed))):
            if self.pinned(output):
                return False
            source = inner.inputs[0]
            for reader in self.view.consumers.get(output, []):
                reader.inputs = [source if name == output else name for name in reader.inputs]
            self.graph.nodes = [n for n in self.graph.nodes if n is not outer]
            self.graph.value_info.pop(output, None)
        else:
            outer.inputs = [inner.inputs[0], *outer.inputs[1:]]
            outer.attrs = {**outer.attrs, "perm": list(composed)}
        self._drop_if_unread(inner)
        return True

    def _drop_if_unread(self, node: Node) -> None:
        reads = {name for n in self.graph.nodes for name in n.inputs}
        if node.outputs[0] not in reads and not self.pinned(node.outputs[0]):
            self.graph.nodes = [n for n in self.graph.nodes if n is not node]
            self.graph.value_info.pop(node.outputs[0], None)

    def absorbs(self, reader: Node, name: str, perm: tuple[int, ...], reductions: bool) -> bool:
        """Whether ``reader`` of ``name`` takes Transpose(name, perm) without reading a permuted view: an inverse
        Transpose (they cancel), a Conv that conv_channels_last then takes, a two-input elementwise node whose
        other input is transposed alike (it sinks in turn), or (``reductions``) a reduction that
        sink_into_reduction maps."""
        if _perm(reader) == _inverse(perm):
            return True
        if reader.domain not in ("", "ai.onnx"):
            return False
        if reader.op_type == "Conv":  # one that conv_channels_last takes once it reads the Transpose
            return perm == _TO_FIRST and reader.inputs[:1] == [name] and name not in reader.inputs[1:] \
                and self._converts(reader, name)
        if reader.op_type in _BINARY and len(reader.inputs) == 2:  # its other input transposed alike
            other = reader.inputs[1] if reader.inputs[0] == name else reader.inputs[0]
            found = self.transposed(other) if other != name else None
            return found is not None and found[1] == perm
        return reductions and reader.inputs[:1] == [name] and name not in reader.inputs[1:] \
            and self._reduced_axes(reader, perm) is not None

    def _converts(self, conv: Node, name: str) -> bool:
        """Whether NhwcConv has a channels-last path for ``conv`` reading ``name`` (channels-first) channels-last."""
        from .ops.conv_nhwc import channels_last_path

        info, weight = self.graph.type_of(name), self.graph.initializers.get(conv.inputs[1]) if len(
            conv.inputs) > 1 else None
        if info is None or info.shape is None or len(info.shape) != 4 or weight is None:
            return False
        shape = tuple(info.shape[a] for a in _inverse(_TO_FIRST))
        return channels_last_path(shape, weight.shape, conv.attrs, info.dtype == DataType.FLOAT) is not None

    def _sinkable(self, node: Node) -> tuple | None:
        """(its inputs' Transposes or None each, their permutation, the inverse Transposes reading its result) where
        sink_elementwise rewrites ``node``, else None."""
        if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1 or not (
                (node.op_type in _BINARY and len(node.inputs) == 2)
                or (node.op_type in _UNARY and len(node.inputs) == 1)):
            return None
        sources = [self.transposed(name) if name else None for name in node.inputs]
        perms = {found[1] for found in sources if found is not None}
        output = node.outputs[0]
        if len(perms) != 1 or self.pinned(output) or not owned(self.owns, [node]):
            return None
        perm = perms.pop()
        readers = self.view.consumers.get(output, [])
        untransposed = None in sources
        cancelling = [reader for reader in readers if _perm(reader) == _inverse(perm)]
        if not readers or (untransposed and not cancelling) \
                or any(self.pinned(reader.outputs[0]) for reader in cancelling[1:]) \
                or not all(self.absorbs(reader, output, perm, not untransposed) for reader in readers):
            return None
        if untransposed and any(found is None and _rank(self.graph, name) != len(perm)
                                for name, found in zip(node.inputs, sources)):
            return None
        return sources, perm, cancelling

    def sink_elementwise(self, node: Node) -> bool:
        """An elementwise node over Transposes by one permutation p runs on their sources, where its result is
        read only by Transposes by p's inverse (and, with every input transposed, reductions that map the axes):
        its result is then what those inverse Transposes gave, under the first one's name (a value of the model,
        which the shape inference of a specialized signature types), and they go."""
        found = self._sinkable(node)
        if found is None:
            return False
        sources, perm, cancelling = found
        inverse, output = _inverse(perm), node.outputs[0]
        inserted: list[Node] = []
        inputs = []
        for name, source in zip(node.inputs, sources):
            if source is not None:
                inputs.append(source[0].inputs[0])
            else:
                moved = self.transpose_node(name, inverse, self.fresh(f"{name}{MOVED}"), node)
                inserted.append(moved)
                inputs.append(moved.outputs[0])
        # (no inverse Transpose reading it: a name of its own, which _retype_moved types in a specialized graph)
        result = cancelling[0].outputs[0] if cancelling else self.fresh(f"{output}{MOVED}")
        if not cancelling:
            self._typed(result, output, inverse)
        rewritten = Node(node.op_type, inputs, [result], name=node.name, domain=node.domain, attrs=dict(node.attrs),
                         opset=node.opset)
        for reader in cancelling[1:]:
            for later in self.view.consumers.get(reader.outputs[0], []):
                later.inputs = [result if name == reader.outputs[0] else name for name in later.inputs]
            self.graph.value_info.pop(reader.outputs[0], None)
        # other readers read a Transpose by p of it (and take it next: they absorb it)
        readers = self.view.consumers.get(output, [])
        after = [self.transpose_node(result, perm, output, node)] if len(cancelling) < len(readers) else []
        if not after:
            self.graph.value_info.pop(output, None)
        gone = {id(reader) for reader in cancelling}
        position = self.graph.nodes.index(node)
        self.graph.nodes[position:position + 1] = [*inserted, rewritten, *after]
        self.graph.nodes = [n for n in self.graph.nodes if id(n) not in gone]
        for source in sources:
            if source is not None:
                self._drop_if_unread(source[0])
        return True

    def _reduced_axes(self, node: Node, perm: tuple[int, ...]) -> list[int] | None:
        """The axes of Transpose(x, perm)'s source that ``node`` (a reduction of that Transpose with keepdims=0)
        reduces, where its kept axes keep their order; else None."""
        if node.op_type not in _REDUCTIONS or node.domain not in ("", "ai.onnx") \
                or int(node.attr("keepdims", 1)) != 0 or len(node.outputs) != 1:
            return None
        rank = len(perm)
        axes_input = len(node.inputs) > 1 and node.inputs[1]
        if axes_input:
            array = self.graph.initializers.get(node.inputs[1])
            if array is None:
                return None
            axes = [int(a) for a in array.reshape(-1)]
        else:
            listed = node.attr("axes")
            axes = [int(a) for a in listed] if listed is not None else []
        if not axes:
            if int(node.attr("noop_with_empty_axes", 0)):
                return None
            axes = list(range(rank))
        if any(not -rank <= a < rank for a in axes):
            return None
        axes = sorted({a % rank for a in axes})
        kept = [perm[a] for a in range(rank) if a not in axes]
        if kept != sorted(kept):
            return None
        return sorted(perm[a] for a in axes)

    def sink_into_reduction(self, node: Node) -> bool:
        """Reduce(Transpose(x, p), axes, keepdims=0) -> Reduce(x, the axes p maps them to)."""
        found = self.transposed(node.inputs[0]) if node.inputs and node.inputs[0] else None
        if found is None or node.inputs[0] in node.inputs[1:] or not owned(self.owns, [node]):
            return False
        transpose, perm = found
        axes = self._reduced_axes(node, perm)
        if axes is None:
            return False
        if len(node.inputs) > 1 and node.inputs[1]:
            name = self.fresh(f"{node.name or node.op_type}/source_axes")
            self.graph.initializers[name] = np.array(axes, dtype=np.int64)
            axes_info = self.graph.type_of(node.inputs[1])
            self.graph.value_info[name] = ValueInfo(name, TypeInfo("tensor", axes_info.dtype if axes_info else None,
                                                                   (len(axes),)))
            node.inputs = [transpose.inputs[0], name, *node.inputs[2:]]
        else:
            node.inputs = [transpose.inputs[0], *node.inputs[1:]]
            node.attrs = {**node.attrs, "axes": axes}
        self._drop_if_unread(transpose)
        return True

    def conv_channels_last(self, node: Node) -> bool:
        """Conv(Transpose(x, (0, 3, 1, 2)), W, B) -> Transpose(NhwcConv(x, W, B), (0, 3, 1, 2)) where NhwcConv has a
        channels-last path for the geometry (ops/conv_nhwc.py): the Transpose after it then meets its readers'."""
        from .ops.conv_nhwc import channels_last_path

        found = self.transposed(node.inputs[0]) if node.domain in ("", "ai.onnx") and node.inputs else None
        if found is None or found[1] != _TO_FIRST or len(node.outputs) != 1 or self.pinned(node.outputs[0]) \
                or not owned(self.owns, [node]):
            return False
        source = found[0].inputs[0]
        x_info, weight = self.graph.type_of(source), self.graph.initializers.get(node.inputs[1])
        if x_info is None or x_info.shape is None or weight is None \
                or channels_last_path(x_info.shape, weight.shape, node.attrs, x_info.dtype == DataType.FLOAT) is None:
            return False
        output = node.outputs[0]
        result = self.fresh(f"{output}{MOVED}")
        self._typed(result, output, _inverse(_TO_FIRST))
        conv = Node("NhwcConv", [source, *node.inputs[1:]], [result], name=node.name, domain=FUSED_DOMAIN,
                    attrs=dict(node.attrs), opset=1)
        position = self.graph.nodes.index(node)
        self.graph.nodes[position:position + 1] = [conv, self.transpose_node(result, _TO_FIRST, output, node)]
        self._drop_if_unread(found[0])
        return True

    def rewrite_one(self) -> bool:
        """One rewrite, pairs cancelling first: a Transpose just moved below a node cancels before that node is
        looked at again (whose readers would otherwise still absorb the moved one's inverse)."""
        nodes = list(self.graph.nodes)
        return any(_perm(node) is not None and self.merge_pair(node) for node in nodes) \
            or any(node.op_type in _REDUCTIONS and self.sink_into_reduction(node) for node in nodes) \
            or any((node.op_type in _BINARY or node.op_type in _UNARY) and self.sink_elementwise(node)
                   for node in nodes) \
            or any(node.op_type == "Conv" and self.conv_channels_last(node) for node in nodes)


def _static(graph: Graph, name: str) -> tuple | None:
    info = graph.type_of(name)
    if info is not None and info.static_shape is not None:
        return info.static_shape
    array = graph.initializers.get(name)
    return array.shape if array is not None else None


def _moved_shape(graph: Graph, node: Node) -> tuple | None:
    """The static shape of ``node``'s output from its inputs' (the kinds of node that write a value this pass made:
    its Transposes, NhwcConvs and elementwise nodes, and the FusedMatMul a residual Add became), or None."""
    shapes = [_static(graph, name) if name else None for name in node.inputs]
    if not shapes or shapes[0] is None:
        return None
    perm = _perm(node)
    if perm is not None:
        return tuple(shapes[0][a] for a in perm) if len(shapes[0]) == len(perm) else None
    if node.op_type == "NhwcConv" and node.domain == FUSED_DOMAIN:
        from .ops.conv_nhwc import output_shape

        return output_shape(shapes[0], shapes[1], node.attrs) if len(shapes) > 1 and shapes[1] else None
    if node.op_type == "FusedMatMul" and node.domain == FUSED_DOMAIN:
        return (*shapes[0][:-1], shapes[1][-1]) if len(shapes) > 1 and shapes[1] and len(shapes[1]) == 2 else None
    if node.domain in ("", "ai.onnx") and (node.op_type in _BINARY or node.op_type in _UNARY) \
            and all(shape is not None and len(shape) == len(shapes[0]) for shape in shapes):
        return tuple(max(dims) if min(dims) == 1 or len(set(dims)) == 1 else -1 for dims in zip(*shapes))
    return None


def _retype_moved(graph: Graph) -> bool:
    """Give each value this pass made (a name of its own, which a specialized signature's shape inference over the
    model does not type) its static shape from its producer's inputs, in graph order: their readers' kernels are
    planned for static shapes."""
    retyped = False
    for node in graph.nodes:
        if len(node.outputs) != 1 or MOVED not in node.outputs[0]:
            continue
        output, shape = graph.type_of(node.outputs[0]), _moved_shape(graph, node)
        if shape is None or -1 in shape or (output is not None and output.static_shape is not None):
            continue
        source = graph.type_of(node.inputs[0])
        dtype = output.dtype if output is not None and output.dtype is not None else source.dtype if source else None
        graph.value_info[node.outputs[0]] = ValueInfo(node.outputs[0], TypeInfo("tensor", dtype, shape))
        retyped = True
    return retyped


def sink_transposes(graph: Graph, owns=None) -> bool:
    """Apply the module's rewrites until none applies (see the docstring); whether any did."""
    if not any(_perm(node) is not None for node in graph.nodes):
        return False
    changed = _retype_moved(graph)
    for _ in range(MAX_REWRITES):
        if not _Sinking(graph, owns).rewrite_one():
            break
        changed = True
    return changed


LAYOUT_PASSES = [sink_transposes]
