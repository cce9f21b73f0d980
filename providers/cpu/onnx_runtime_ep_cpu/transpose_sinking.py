"""Transposes moved through the operators that commute with them, so inverse pairs meet and cancel.

A network written channels-first around channels-last blocks (ConvNeXt: each block's LayerNorm and pointwise
products run on Transpose(x, (0, 2, 3, 1)) and give their result back through Transpose(., (0, 3, 1, 2))) adds
the residual in the channels-first layout and transposes the sum again for the next block. Our Transpose is a
view, so each pair costs its readers a copy of a permuted view (or a strided pass) and the plan two steps.
Rewrites, repeated until none applies:

- Transpose(Transpose(x, p), q): one Transpose by the composed permutation, none where it is the identity;
- an elementwise node (Add, Sub, Mul, Div; a one-input elementwise op) with inputs transposed by one permutation p
  runs on their sources, where its result is read only by Transposes by p's inverse (and, with every input
  transposed, by reductions the next rule maps): its result is then what those inverse Transposes gave, under
  the first one's name, and they go. Inputs not transposed (of the same rank only) get a Transpose by p's inverse
  of their own: one input's Transpose is traded for one that cancels (a reduction alone would not cancel it, and
  moving it back and forth would gain nothing);
- a reduction with keepdims=0 of Transpose(x, p) reduces x over the mapped axes, where the kept axes keep
  their order (ConvNeXt's final mean over the spatial axes).

Elsewhere the readers would read a permuted view of what the node now writes contiguous, so nothing else moves:
a value that some reader needs channels-first keeps its Transposes. Each rewrite gives the same bits (permuting
axes commutes with elementwise arithmetic and with broadcasting between equal ranks). After it, FusedMatMul's
residual fusion (fusions.py, after this pass) takes the channels-last residual Add into the block's last product
(its rounding then that of the fused epilogue), and the next LayerNormalization reads its input contiguous.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node, TypeInfo, ValueInfo

from .fusions import GraphView, owned

# Elementwise operators of any rank whose inputs broadcast alike (numpy rules), by input count.
_BINARY = frozenset({"Add", "Sub", "Mul", "Div"})
_UNARY = frozenset({"Relu", "Sigmoid", "Tanh", "Erf", "Gelu", "Neg", "Abs", "Sqrt", "Exp", "Identity"})
# Reductions with axes (an attribute before opset 18, an input from it; ReduceSum's from 13).
_REDUCTIONS = frozenset({"ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
                         "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp"})
# The names of the values this pass's own Transposes write end with this (_retype_transposes types them again).
MOVED = "/channels_moved"
# Each rewrite moves a Transpose past one node or removes one; the bound only guards against a graph that would
# trade them back and forth.
MAX_REWRITES = 256


def _perm(node: Node | None) -> tuple[int, ...] | None:
    """A plain Transpose's permutation (None for any other node, or one without an explicit perm)."""
    if node is None or node.op_type != "Transpose" or node.domain not in ("", "ai.onnx"):
        return None
    perm = node.attr("perm")
    return tuple(int(a) for a in perm) if perm is not None else None


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
        self.names = {name for node in graph.nodes for name in (*node.inputs, *node.outputs)}
        self.names.update(graph.initializers, (vi.name for vi in graph.inputs))

    def fresh(self, base: str) -> str:
        name, index = base, 0
        while name in self.names:
            index += 1
            name = f"{base}_{index}"
        self.names.add(name)
        return name

    def pinned(self, name: str) -> bool:
        return name in self.view.outputs or name in self.view.inner_reads

    def transposed(self, name: str) -> tuple[Node, tuple[int, ...]] | None:
        node = self.view.producer.get(name)
        perm = _perm(node)
        return (node, perm) if perm is not None else None  # type: ignore[return-value]

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
        Transpose (they cancel), or (``reductions``) a reduction that sink_into_reduction maps."""
        if _perm(reader) == _inverse(perm):
            return True
        return reductions and reader.inputs[:1] == [name] and name not in reader.inputs[1:] \
            and self._reduced_axes(reader, perm) is not None

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
        if not cancelling or any(self.pinned(reader.outputs[0]) for reader in cancelling[1:]) \
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
        result = cancelling[0].outputs[0]
        rewritten = Node(node.op_type, inputs, [result], name=node.name, domain=node.domain, attrs=dict(node.attrs),
                         opset=node.opset)
        for reader in cancelling[1:]:
            for later in self.view.consumers.get(reader.outputs[0], []):
                later.inputs = [result if name == reader.outputs[0] else name for name in later.inputs]
            self.graph.value_info.pop(reader.outputs[0], None)
        # reductions reading the result keep a Transpose by p of it (sink_into_reduction takes it next)
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

    def rewrite_one(self) -> bool:
        """One rewrite, pairs cancelling first: a Transpose just moved below a node cancels before that node is
        looked at again (whose readers would otherwise still absorb the moved one's inverse)."""
        nodes = list(self.graph.nodes)
        return any(_perm(node) is not None and self.merge_pair(node) for node in nodes) \
            or any(node.op_type in _REDUCTIONS and self.sink_into_reduction(node) for node in nodes) \
            or any((node.op_type in _BINARY or node.op_type in _UNARY) and self.sink_elementwise(node)
                   for node in nodes)


def _retype_transposes(graph: Graph) -> bool:
    """Give each Transpose this pass added whose output's shape is not static its input's static shape, permuted:
    their values have names of their own, which a specialized signature's shape inference (over the model) does not
    type, and their readers' kernels are planned for static shapes."""
    retyped = False
    for node in graph.nodes:
        perm = _perm(node)
        if perm is None or MOVED not in node.outputs[0]:
            continue
        source, output = graph.type_of(node.inputs[0]), graph.type_of(node.outputs[0])
        if source is None or source.static_shape is None or len(source.static_shape) != len(perm) \
                or (output is not None and output.static_shape is not None):
            continue
        shape = tuple(source.static_shape[a] for a in perm)
        graph.value_info[node.outputs[0]] = ValueInfo(node.outputs[0], TypeInfo("tensor", source.dtype, shape))
        retyped = True
    return retyped


def sink_transposes(graph: Graph, owns=None) -> bool:
    """Apply the module's rewrites until none applies (see the docstring); whether any did."""
    if not any(_perm(node) is not None for node in graph.nodes):
        return False
    changed = _retype_transposes(graph)
    for _ in range(MAX_REWRITES):
        if not _Sinking(graph, owns).rewrite_one():
            break
        changed = True
    return changed


LAYOUT_PASSES = [sink_transposes]
