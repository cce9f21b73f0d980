"""Attention spelled out node by node becomes one ONNX ``Attention`` (opset 23):

    MatMul(Q, K^T) -> [Div by c | Mul by c] -> [Add mask [-> Add mask2]] -> Softmax(last axis) -> MatMul(., V)
        ->  Attention(Q, K, V[, mask (+ mask2)], scale=1/c | c | 1)

Two Adds are a position bias and an attention mask (T5 in both exporters): one Add sums them for Attention.

K^T is usually a Transpose: its permutation is changed (or the Transpose dropped) so that it yields
K; any other K^T gets a Transpose. Grouped-query models repeat each KV head for the query heads that
share it (Unsqueeze at axis 2 -> Tile/Expand along it -> Reshape merging the two head axes, so head
j is KV head j // group); Attention shares KV heads the same way by itself, so the un-repeated K and
V feed it and the repeats go.

The match is exact: constants by value, every intermediate read only inside the pattern, Softmax
over the last axis only, and shapes that prove neither MatMul broadcasts a batch or head axis in a
way Attention would not (Q, K and V of one batch size; K and V of one head count that divides Q's).
The mask must broadcast to the scores without growing them and cover every key (Attention pads a
shorter mask with -inf instead of broadcasting it). A constant mask that masks a whole row is left
alone: Softmax makes NaN of that row where Attention makes zeros.
"""

from __future__ import annotations

import numpy as np
import onnx

from ..dtypes import DataType
from ..ir import Dim, Graph, Node, TypeInfo, ValueInfo
from ..loader import SHAPE_VALUE_LIMIT, convert_type
from ..records import Record
from .context import PassContext
from .rewrite import Uses, constant, forget_value, new_node, remove_nodes, set_attr

ATTENTION_OPSET = 23
_DTYPES = frozenset({DataType.FLOAT, DataType.FLOAT16, DataType.BFLOAT16})  # Attention-23's T1
_ONNX = ("", "ai.onnx")
# How far back through producers a partly unknown shape is re-inferred (it reads the values of
# constants up to the loader's SHAPE_VALUE_LIMIT: starts, ends, axes, target shapes).
_REFINE_DEPTH = 8


def fuse_attention(graph: Graph, context: PassContext) -> bool:
    """Replace each exactly matched attention pattern with one Attention node where the second
    MatMul was (every input of the pattern exists by then)."""
    present = {node.op_type for node in graph.nodes}
    if ("Softmax" not in present or "MatMul" not in present) and "Attention" not in present:
        return False
    matcher = _Matcher(graph)
    replaced: dict[int, list[Node]] = {}
    removed: list[Node] = []
    for softmax in list(graph.nodes):
        match = matcher.match(softmax)
        if match is None:
            continue
        fused = _commit(graph, context, matcher.uses, match)
        if fused is None:
            continue
        replaced[id(match.core[-1])] = fused
        removed.extend(match.core[:-1] + match.dropped)
    removed.extend(_ungroup_repeats(graph, matcher))
    if not replaced and not removed:
        return False
    graph.nodes = [new for node in graph.nodes for new in replaced.get(id(node), [node])]
    remove_nodes(graph, removed)
    return True


def _ungroup_repeats(graph: Graph, matcher: _Matcher) -> list[Node]:
    """An Attention fused before its K and V repeats were provable (a generic graph's unknown shapes, then
    specialized) reads the un-repeated K and V once they are; returns the repeat nodes it no longer reads."""
    removed: list[Node] = []
    for node in graph.nodes:
        if node.op_type != "Attention" or node.domain not in _ONNX or len(node.inputs) not in (3, 4):
            continue
        key, value = matcher.repeat(node.inputs[1], node), matcher.repeat(node.inputs[2], node)
        if key is None or value is None or key.times != value.times or node.inputs[1] == node.inputs[2]:
            continue
        q, k, v = matcher.shapes.of(node.inputs[0]), matcher.shapes.of(key.kv), matcher.shapes.of(value.kv)
        if q is None or k is None or v is None or len(q) != 4 or len(k) != 4 or len(v) != 4:
            continue
        if not (_same(k[1], v[1]) and isinstance(q[1], int) and isinstance(k[1], int) and q[1] == k[1] * key.times):
            continue
        for nodes in (key.nodes, value.nodes):
            for dropped in nodes:
                matcher.uses.forget(dropped)
        matcher.uses.rewire(node, inputs=[node.inputs[0], key.kv, value.kv, *node.inputs[3:]])
        removed += key.nodes + value.nodes
    return removed


class _Match(Record):
    __match_args__ = ("q", "k_source", "k_perm", "k_transpose", "v", "mask", "mask_parts", "scale", "k_shape",
                      "grouped", "core", "dropped", "rewires", "guarded", "mask_shape")
    q: str
    k_source: str  # K, or what a Transpose by ``k_perm`` turns into K
    k_perm: list[int] | None
    k_transpose: Node | None  # the K^T Transpose, to re-permute (``k_perm``) or drop (no ``k_perm``)
    v: str
    mask: str
    mask_parts: tuple[str, str] | None  # a position bias and a mask that one inserted Add sums into ``mask``
    scale: float
    k_shape: tuple
    grouped: bool  # K and V are un-repeated: Q's heads share them in groups
    core: list[Node]  # first MatMul ... second MatMul, in order: the nodes Attention computes
    dropped: list[Node]  # nodes feeding the core that go with it
    rewires: list[tuple[Node, str, str]]  # (node, input it reads, input it reads now)
    guarded: bool  # Softmax's NaN (a row the mask hides entirely) is zeroed, as Attention does
    mask_shape: tuple  # the summed mask's, with ``mask_parts``

    def __init__(self,
                 q: str, k_source: str, k_perm: list[int] | None, k_transpose: Node | None, v: str, mask: str,
                 mask_parts: tuple[str, str] | None, scale: float, k_shape: tuple, grouped: bool, core: list[Node],
                 dropped: list[Node] | None = None, rewires: list[tuple[Node, str, str]] | None = None,
                 guarded: bool = False, mask_shape: tuple = ()) -> None:
        self.q = q
        self.k_source = k_source
        self.k_perm = k_perm
        self.k_transpose = k_transpose
        self.v = v
        self.mask = mask
        self.mask_parts = mask_parts
        self.scale = scale
        self.k_shape = k_shape
        self.grouped = grouped
        self.core = core
        self.dropped = [] if dropped is None else dropped
        self.rewires = [] if rewires is None else rewires
        self.guarded = guarded
        self.mask_shape = mask_shape


class _Repeat(Record):
    """A KV tensor whose heads a repeat_kv pattern repeats ``times`` times each."""

    __match_args__ = ("kv", "times", "nodes")
    kv: str
    times: int
    nodes: list[Node]

    def __init__(self, kv: str, times: int, nodes: list[Node]) -> None:
        self.kv = kv
        self.times = times
        self.nodes = nodes


class _Matcher:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.uses = Uses(graph)
        self.producers = graph.producers()
        self.shapes = _Shapes(graph, self.producers)

    def made_by(self, name: str, op_type: str, reader: Node | None = None) -> Node | None:
        """The ``op_type`` node producing ``name``, when ``reader`` (if given) alone reads that value."""
        node = self.producers.get(name)
        if node is None or node.op_type != op_type or node.domain not in _ONNX:
            return None
        if reader is not None and self.uses.only_reader(name) is not reader:
            return None
        return node

    def match(self, softmax: Node) -> _Match | None:
        if softmax.op_type != "Softmax" or softmax.domain not in _ONNX or not _on_last_axis(softmax):
            return None
        guard = self._nan_guard(softmax)
        probabilities = guard[-1].outputs[0] if guard else softmax.outputs[0]
        matmul_v = self.uses.only_reader(probabilities)
        if (matmul_v is None or matmul_v.op_type != "MatMul" or matmul_v.domain not in _ONNX
                or matmul_v.inputs[0] != probabilities):
            return None
        core = self._scores(softmax.inputs[0], softmax)
        if core is None:
            return None
        nodes, scale, mask = core
        parts = mask if isinstance(mask, tuple) else None
        mask = parts[0] if parts else mask
        matmul_qk = nodes[0]
        dtype = _dtype_of(self.graph, matmul_qk.outputs[0])
        if dtype not in _DTYPES:
            return None
        q, q_scale = self._unscaled(matmul_qk.inputs[0], matmul_qk)
        key_t, k_scale = self._unscaled(matmul_qk.inputs[1], matmul_qk)
        match = self._key_value(matmul_qk, q, key_t, matmul_v, nodes + [softmax, *guard, matmul_v],
                                scale * q_scale[0] * k_scale[0], mask)
        if match is None:
            return None
        match.mask_parts = parts
        match.dropped += q_scale[1] + k_scale[1]
        if not q_scale[1] and q_scale[0] == 1.0:  # Whisper scales Q before splitting its heads
            before = self._scaled_before_layout(q, matmul_qk)
            if before is not None:
                factor, mul, layout, source = before
                match.scale *= factor
                match.dropped.append(mul)
                match.rewires.append((layout, mul.outputs[0], source))
        match.guarded = bool(guard)
        return match if self._shapes_fit(match, dtype) else None

    def _nan_guard(self, softmax: Node) -> list[Node]:
        """[IsNaN, Where] when Softmax's output is read only by Where(IsNaN(p), 0, p) (exporters zero the
        rows a mask hides entirely, where Softmax gives NaN): Attention outputs zeros there itself."""
        readers = self.uses.readers.get(softmax.outputs[0], [])
        if len(readers) != 2 or self.uses.pinned(softmax.outputs[0]):
            return []
        isnan = next((r for r in readers if r.op_type == "IsNaN" and r.domain in _ONNX), None)
        where = next((r for r in readers if r.op_type == "Where" and r.domain in _ONNX), None)
        if isnan is None or where is None or self.uses.only_reader(isnan.outputs[0]) is not where \
                or where.inputs[0] != isnan.outputs[0] or where.inputs[2] != softmax.outputs[0]:
            return []
        zero = constant(self.graph, where.inputs[1])
        if zero is None or zero.size != 1 or float(zero.reshape(-1)[0]) != 0.0 or zero.ndim > 4:
            return []
        return [isnan, where]

    def _scaled_before_layout(self, q: str, reader: Node) -> tuple[float, Node, Node, str] | None:
        """(factor, the Mul, the first layout node, what the Mul scales) when ``q`` is Transpose/Reshape (one or
        two, each read only by the next) of a Mul by a constant scalar read only by them: a scalar product
        commutes with the layout, so Attention's scale takes the factor."""
        node: Node | None = self.producers.get(q)
        consumer: Node | None = reader
        for _ in range(2):
            if node is None or node.op_type not in ("Transpose", "Reshape") or node.domain not in _ONNX \
                    or self.uses.only_reader(node.outputs[0]) is not consumer:
                return None
            source = node.inputs[0]
            mul = self.made_by(source, "Mul", node)
            if mul is not None and mul.opset >= 7 and len(mul.inputs) == 2:
                for position in (0, 1):
                    factor = _scalar(self.graph, mul.inputs[1 - position])
                    value = mul.inputs[position]
                    if factor is not None and factor != 0 and constant(self.graph, value) is None \
                            and _dtype_of(self.graph, value) == _dtype_of(self.graph, source) \
                            and _same_shape(self.shapes.of(value), self.shapes.of(source)):
                        return factor, mul, node, value
            node, consumer = self.producers.get(source), node
        return None

    def _unscaled(self, name: str, reader: Node) -> tuple[str, tuple[float, list[Node]]]:
        """(what ``name`` scales, (the factor, [the scaling node])) when ``name`` is a Mul by (or Div by) a
        constant scalar that ``reader`` alone reads (exporters scale Q and K by sqrt(scale) each); else
        (``name``, (1.0, []))."""
        for op_type in ("Mul", "Div"):
            node = self.made_by(name, op_type, reader)
            if node is None or node.opset < 7 or len(node.inputs) != 2:
                continue
            for position in ((0, 1) if op_type == "Mul" else (0,)):
                factor = _scalar(self.graph, node.inputs[1 - position])
                if factor is not None and factor != 0 and constant(self.graph, node.inputs[position]) is None:
                    return node.inputs[position], (factor if op_type == "Mul" else 1.0 / factor, [node])
        return name, (1.0, [])

    def _scores(self, name: str, reader: Node):
        """([MatMul, scale node?, mask Add?], scale, mask) for the Softmax input ``name``, or None."""
        add = self.made_by(name, "Add", reader)
        if add is not None:
            if add.opset < 7 or len(add.inputs) != 2:
                return None  # before opset 7 Add broadcasts by attribute
            for position in (0, 1):
                found = self._scaled(add.inputs[position], add)
                if found is not None:
                    nodes, scale = found
                    return nodes + [add], scale, add.inputs[1 - position]
            for position in (0, 1):  # (scores + bias) + mask
                inner = self.made_by(add.inputs[position], "Add", add)
                if inner is None or inner.opset < 7 or len(inner.inputs) != 2:
                    continue
                for inner_position in (0, 1):
                    found = self._scaled(inner.inputs[inner_position], inner)
                    if found is not None:
                        nodes, scale = found
                        return nodes + [inner, add], scale, (inner.inputs[1 - inner_position],
                                                            add.inputs[1 - position])
            return None
        found = self._scaled(name, reader)
        return None if found is None else (found[0], found[1], "")

    def _scaled(self, name: str, reader: Node):
        """([MatMul, scale node?], scale) for scores ``name`` read by ``reader`` alone, or None."""
        matmul = self.made_by(name, "MatMul", reader)
        if matmul is not None:
            return [matmul], 1.0
        for op_type in ("Div", "Mul"):
            node = self.made_by(name, op_type, reader)
            if node is None or node.opset < 7 or len(node.inputs) != 2:
                continue
            positions = (0,) if op_type == "Div" else (0, 1)  # only the dividend may be the scores
            for position in positions:
                matmul = self.made_by(node.inputs[position], "MatMul", node)
                factor = _scalar(self.graph, node.inputs[1 - position])
                if matmul is not None and factor is not None and (factor != 0 or op_type == "Mul"):
                    return [matmul, node], 1.0 / factor if op_type == "Div" else factor
        return None

    def _key_value(self, matmul_qk: Node, q: str, key_t: str, matmul_v: Node, core: list[Node], scale: float,
                   mask: str):
        """Where K and V come from: the K^T Transpose undone, and repeat_kv patterns skipped."""
        transpose = self.made_by(key_t, "Transpose")
        perm: list[int] | None
        if transpose is None:
            source, perm, reused = key_t, [0, 1, 3, 2], None
        else:
            forward = transpose.attr("perm", [3, 2, 1, 0])  # K^T = Transpose(source, forward)
            if len(forward) != 4:
                return None
            source, perm = transpose.inputs[0], [forward[0], forward[1], forward[3], forward[2]]
            reader = self.uses.only_reader(key_t)
            reused = transpose if reader is matmul_qk or (reader is not None and key_t != matmul_qk.inputs[1]
                                                          and reader.outputs[0] == matmul_qk.inputs[1]) else None
        if perm == [0, 1, 2, 3]:
            perm = None
        match = _Match(q=q, k_source=source, k_perm=perm, k_transpose=reused,
                       v=matmul_v.inputs[1], mask=mask, mask_parts=None, scale=scale, k_shape=(), grouped=False,
                       core=core)
        if perm is None and reused is not None:
            match.dropped.append(reused)
            self._skip_repeats(match, reused, matmul_v)
        source_shape = self.shapes.of(match.k_source)
        if source_shape is None or len(source_shape) != 4 or (perm is not None and sorted(perm) != [0, 1, 2, 3]):
            return None  # (a perm that is no permutation of the 4 axes is the Transpose kernel's to report)
        match.k_shape = source_shape if perm is None else tuple(source_shape[axis] for axis in perm)
        return match

    def _skip_repeats(self, match: _Match, k_reader: Node, v_reader: Node) -> None:
        """Feed the un-repeated K and V when both come from repeat_kv patterns with one group size
        and head count that, times the group, is Q's head count."""
        key = self.repeat(match.k_source, k_reader)
        value = self.repeat(match.v, v_reader)
        if key is None or value is None or key.times != value.times:
            return
        q, k, v = self.shapes.of(match.q), self.shapes.of(key.kv), self.shapes.of(value.kv)
        if q is None or k is None or v is None or len(q) != 4 or len(k) != 4 or len(v) != 4:
            return
        if not (_same(k[1], v[1]) and isinstance(q[1], int) and isinstance(k[1], int) and q[1] == k[1] * key.times):
            return
        match.k_source, match.v, match.grouped = key.kv, value.kv, True
        match.dropped += key.nodes + value.nodes

    def repeat(self, name: str, reader: Node) -> _Repeat | None:
        """``name`` as Reshape(Tile|Expand(Unsqueeze(kv, axis 2)), (B, H * n, S, D)) of a 4-D ``kv``,
        every intermediate read only by the next node and ``name`` only by ``reader``."""
        reshape = self.made_by(name, "Reshape", reader)
        if reshape is None or reshape.opset < 5:
            return None
        target = constant(self.graph, reshape.inputs[1])
        repeat = self.producers.get(reshape.inputs[0])
        if (repeat is None or repeat.op_type not in ("Tile", "Expand")
                or self.made_by(reshape.inputs[0], repeat.op_type, reshape) is None):
            return None
        unsqueeze = self.made_by(repeat.inputs[0], "Unsqueeze", repeat)
        if unsqueeze is None or _unsqueeze_axes(self.graph, unsqueeze) not in ([2], [-3]):
            return None
        kv_shape = self.shapes.of(unsqueeze.inputs[0])
        if kv_shape is None or len(kv_shape) != 4:
            return None
        if target is None:  # computed targets (a symbolic length): the shapes alone fix what they do
            return self._repeat_by_shapes(kv_shape, unsqueeze, repeat, reshape)
        return self._repeat_by_target(kv_shape, target, unsqueeze, repeat, reshape)

    def _repeat_by_target(self, kv: tuple, target: np.ndarray, unsqueeze: Node, repeat: Node,
                          reshape: Node) -> _Repeat | None:
        batch, heads, length, size = kv
        if target.shape != (4,):
            return None
        times = _repeat_count(self.graph, repeat, (batch, heads, 1, length, size))
        if times is None:
            return None
        tiled = (batch, heads, times, length, size)
        merged = (batch, heads * times if isinstance(heads, int) else None, length, size)
        if int(reshape.attr("allowzero", 0)) and 0 in target.tolist():
            return None
        if list(target).count(-1) > 1:
            return None
        for axis, want in enumerate(int(t) for t in target):
            # 0 copies the input's dim; -1 is what the element count leaves, which the others fix.
            if want != -1 and not _same(tiled[axis] if want == 0 else want, merged[axis]):
                return None
        return _Repeat(unsqueeze.inputs[0], times, [unsqueeze, repeat, reshape])

    def _repeat_by_shapes(self, kv: tuple, unsqueeze: Node, repeat: Node, reshape: Node) -> _Repeat | None:
        """An Expand from (B, H, 1, S, D) to (B, H, n, S, D) repeats each head n times whatever its target
        spells, and a Reshape from there to (B, H * n, S, D) merges the two head axes: proven by the shapes."""
        tiled, merged = self.shapes.of(repeat.outputs[0]), self.shapes.of(reshape.outputs[0])
        if repeat.op_type != "Expand" or tiled is None or merged is None or len(tiled) != 5 or len(merged) != 4:
            return None
        batch, heads, length, size = kv
        times = tiled[2]
        if not (isinstance(times, int) and times >= 1 and isinstance(heads, int)):
            return None
        if not all(_same(a, b) for a, b in zip(tiled, (batch, heads, times, length, size))):
            return None
        if not all(_same(a, b) for a, b in zip(merged, (batch, heads * times, length, size))):
            return None
        return _Repeat(unsqueeze.inputs[0], times, [unsqueeze, repeat, reshape])

    def _shapes_fit(self, match: _Match, dtype: DataType) -> bool:
        q, k, v = self.shapes.of(match.q), match.k_shape, self.shapes.of(match.v)
        if q is None or v is None or len(q) != 4 or len(v) != 4:
            return False
        if not (_same(q[0], k[0]) and _same(q[0], v[0]) and _same(k[1], v[1])):
            return False
        # Without skipped repeats the MatMuls pair heads one to one, or broadcast a single K/V head.
        if not (match.grouped or _same(q[1], k[1]) or k[1] == 1):
            return False
        scores = (q[0], q[1], q[2], k[2])
        parts = match.mask_parts or ((match.mask,) if match.mask else ())
        if not all(self._mask_fits(part, scores, dtype, match.guarded) for part in parts):
            return False
        if match.mask_parts:
            shape = _broadcast(*(self.shapes.of(part) for part in match.mask_parts))
            if shape is None:
                return False
            match.mask_shape = shape
        return True

    def _mask_fits(self, mask: str, scores: tuple, dtype: DataType, guarded: bool) -> bool:
        shape = self.shapes.of(mask)
        if shape is None or not 1 <= len(shape) <= 4 or _dtype_of(self.graph, mask) != dtype:
            return False
        if not _same(shape[-1], scores[-1]):
            return False
        if not all(dim == 1 or _same(dim, want) for dim, want in zip(shape, scores[-len(shape):])):
            return False
        values = constant(self.graph, mask)
        return guarded or values is None or not np.isneginf(values).all(axis=-1).any()


def _commit(graph: Graph, context: PassContext, uses: Uses, match: _Match) -> list[Node] | None:
    """The nodes replacing the second MatMul (an inserted K Transpose, then the Attention), after
    the rewiring the match needs; None, leaving the graph as it was, when the Attention would not
    run on the provider that runs the matched nodes."""
    key, inserted = match.k_source, list[Node]()
    if match.k_perm is not None:
        key = context.fresh(f"{match.core[0].name or match.k_source}_key")
        graph.value_info[key] = ValueInfo(key, TypeInfo("tensor", _dtype_of(graph, match.q), match.k_shape))
    mask = _summed_mask(graph, context, match, inserted) if match.mask_parts else _nonzero(graph, match.mask)
    inputs = [match.q, key, match.v] + ([mask] if mask else [])
    output = match.core[-1].outputs[0]
    attention = new_node("Attention", inputs, [output], name=context.fresh(f"{match.core[-2].name}_attention"),
                         opset=ATTENTION_OPSET, scale=float(match.scale))
    provider = context.provider_for(match.core[0], graph)
    if provider is None or any(context.provider_for(node, graph) is not provider
                               for node in match.core[1:] + [attention]):
        if match.k_perm is not None:
            del graph.value_info[key]
        if match.mask_parts:
            del graph.value_info[mask]
        return None
    if match.k_perm is not None:
        if match.k_transpose is not None:
            forget_value(graph, match.k_transpose.outputs[0])
            uses.rewire(match.k_transpose, outputs=[key])
            set_attr(match.k_transpose, "perm", match.k_perm)
        else:
            inserted.append(new_node("Transpose", [match.k_source], [key], name=context.fresh(f"{key}_transpose"),
                                     opset=match.core[0].opset, perm=match.k_perm))
    for node, old, new in match.rewires:
        uses.rewire(node, inputs=[new if name == old else name for name in node.inputs])
    for node in match.core + match.dropped:
        uses.forget(node)
    for node in inserted + [attention]:
        uses.rewire(node, inputs=node.inputs)  # records the new nodes' reads
    return inserted + [attention]


def _nonzero(graph: Graph, mask: str) -> str:
    """``mask``, or "" (none) for a constant of zeros only (the dynamo exporter's bias where no mask was given:
    adding it changes no score)."""
    values = None if not mask else constant(graph, mask)
    return "" if values is not None and values.size > 0 and not np.any(values) else mask


def _summed_mask(graph: Graph, context: PassContext, match: _Match, inserted: list[Node]) -> str:
    """A new value, bias + mask, and the Add computing it (appended to ``inserted``)."""
    mask = context.fresh(f"{match.core[0].name or match.mask}_mask")
    graph.value_info[mask] = ValueInfo(mask, TypeInfo("tensor", _dtype_of(graph, match.mask), match.mask_shape))
    inserted.append(new_node("Add", list(match.mask_parts or ()), [mask], name=context.fresh(f"{mask}_add"),
                             opset=match.core[0].opset))
    return mask


class _Shapes:
    """Value shapes, with dimensions that the model's shape inference left unknown re-inferred node by
    node from the producers' (now folded) constant inputs."""

    def __init__(self, graph: Graph, producers: dict[str, Node]):
        self.graph = graph
        self.producers = producers
        self.known: dict[str, tuple | None] = {}

    def of(self, name: str, depth: int = _REFINE_DEPTH) -> tuple | None:
        if name in self.known:
            return self.known[name]
        info = self.graph.type_of(name)
        shape = info.shape if info is not None and info.is_tensor else None
        if shape is None or not all(isinstance(dim, int) for dim in shape):
            if depth > 0 and name in self.producers:
                shape = _merge(shape, self._infer(self.producers[name], name, depth - 1))
        self.known[name] = shape
        return shape

    def _infer(self, node: Node, name: str, depth: int) -> tuple | None:
        """``name``'s shape by onnx shape inference on its producer alone, given refined input shapes."""
        if node.domain not in _ONNX or node.proto is None or node.subgraphs():
            return None
        types, values = {}, {}
        for input_name in filter(None, node.inputs):
            dtype = _dtype_of(self.graph, input_name)
            if dtype is None:
                return None
            shape = self.of(input_name, depth)
            types[input_name] = onnx.helper.make_tensor_type_proto(int(dtype), None if shape is None else list(shape))
            array = self.graph.initializers.get(input_name)
            if array is not None and array.size <= SHAPE_VALUE_LIMIT:
                values[input_name] = onnx.numpy_helper.from_array(array, input_name)
        try:
            schema = onnx.defs.get_schema(node.op_type, node.opset, "")
            inferred = onnx.shape_inference.infer_node_outputs(
                schema, node.proto, types, values, opset_imports=[onnx.helper.make_opsetid("", node.opset)])
        except Exception:  # an inference aid only: what it cannot infer stays unknown
            return None
        found = inferred.get(name)
        return None if found is None else convert_type(found).shape


def _merge(known: tuple | None, inferred: tuple | None) -> tuple | None:
    """Per dimension, a number from either shape, else the model's symbol, else the inferred one."""
    if known is None or inferred is None or len(known) != len(inferred):
        return known if known is not None else inferred
    return tuple(a if isinstance(a, int) else b if isinstance(b, int) else a if a is not None else b
                 for a, b in zip(known, inferred))


def _broadcast(a: tuple | None, b: tuple | None) -> tuple | None:
    """The shape two masks broadcast to, when every dimension is provably known; else None."""
    if a is None or b is None:
        return None
    a, b = (1,) * (len(b) - len(a)) + tuple(a), (1,) * (len(a) - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x == 1 or _same(x, y):
            out.append(y)
        elif y == 1:
            out.append(x)
        else:
            return None
    return tuple(out)


def _same_shape(a: tuple | None, b: tuple | None) -> bool:
    """Both shapes known and provably equal (the Mul broadcasts nothing)."""
    return a is not None and b is not None and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))


def _same(a: Dim, b: Dim) -> bool:
    """Whether two dimensions are provably equal: one number, or one symbol of the model."""
    return a is not None and a == b


def _dtype_of(graph: Graph, name: str) -> DataType | None:
    info = graph.type_of(name)
    if info is None or not info.is_tensor:
        array = graph.initializers.get(name)
        return None if array is None else DataType.from_numpy(array.dtype)
    return info.dtype


def _on_last_axis(softmax: Node) -> bool:
    """Softmax over the last axis of the 4-D scores. Before opset 13 Softmax flattens the input
    from ``axis`` (default 1) on, which is the last axis alone only when axis is the last one."""
    axis = int(softmax.attr("axis", -1 if softmax.opset >= 13 else 1))
    return axis in (-1, 3)


def _scalar(graph: Graph, name: str) -> float | None:
    """A finite constant of one element that broadcasts onto 4-D scores without growing them."""
    array = constant(graph, name)
    if array is None or array.size != 1 or array.ndim > 4:
        return None
    value = float(array.reshape(-1)[0])
    return value if np.isfinite(value) else None


def _unsqueeze_axes(graph: Graph, node: Node) -> list[int] | None:
    if node.opset < 13:
        axes = node.attr("axes")
        return None if axes is None else [int(a) for a in axes]
    axes = constant(graph, node.inputs[1]) if len(node.inputs) > 1 else None
    return None if axes is None else [int(a) for a in axes.reshape(-1)]


def _repeat_count(graph: Graph, node: Node, shape: tuple) -> int | None:
    """How many times Tile/Expand ``node`` repeats axis 2 of its 5-D input (of ``shape``, 1 on axis 2),
    when it changes no other axis."""
    if len(node.inputs) != 2:
        return None
    values = constant(graph, node.inputs[1])
    if values is None or values.shape != (5,):
        return None
    spec = [int(n) for n in values]
    times = spec[2]
    if times < 1:
        return None
    # Tile must repeat no other axis; Expand may also name a dimension it keeps (1 always keeps one).
    keeps = (lambda want, dim: want == 1) if node.op_type == "Tile" else (lambda want, dim: want in (1, dim))
    others = all(keeps(want, dim) for axis, (want, dim) in enumerate(zip(spec, shape)) if axis != 2)
    return times if others else None
