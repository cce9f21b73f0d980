"""Constant folding: nodes computable at session creation become initializers.

A node folds when every input is a constant (an initializer, or a node folded earlier in the same
sweep, so chains fold at once), or when it only asks for the static shape of its input (``Shape``,
``Size``). The node runs once through a host provider's own kernel, so folding computes exactly
what the run would have; ``ConstantOfShape`` of a constant shape, whose output the spec fixes
(``value`` repeated), is filled here: exported models carry hundreds, and a provider round trip for
each was a large share of their session creation (measured in b39d876).

An ``If`` whose condition is constant becomes the nodes of the branch it takes, which fold in turn:
exported models guard shape-dependent code with ``If`` on a shape comparison, and once a run's shapes
are known (session/specialize.py) the comparison folds. In a subgraph, the enclosing graphs' constants
and shapes (``PassContext.outer_constants``/``outer_types``) count as the subgraph's own.
"""

from __future__ import annotations

import math
import time
from collections import ChainMap

import numpy as np
import onnx

from .. import budget
from ..dtypes import DataType
from ..ir import Graph, Node, TypeInfo, ValueInfo
from ..loader import SHAPE_VALUE_LIMIT, convert_type
from .context import PassContext
from .rewrite import Uses, add_initializer, live_values, new_node, visit_subgraphs

# Fresh values on every run, by design.
NONDETERMINISTIC = frozenset({
    "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Bernoulli", "Multinomial",
    "Dropout",  # random in training mode; inference Dropout is removed by eliminate_identities
})
# Only the ONNX domains have operators known to be pure functions of their inputs.
FOLDABLE_DOMAINS = frozenset({"", "ai.onnx", "ai.onnx.ml"})
# A folded result stays resident for the session's life; above this size it must replace inputs
# that die with the fold (or be generated from tiny ones), so that resident memory does not double.
MAX_FOLDED_BYTES = 16 << 20
TINY_BYTES = 4096
# What a fold may generate from tiny inputs (a mask buffer from ConstantOfShape, a Tile or Expand of a
# constant); anything larger is left to the kernel at run time rather than materialized at creation...
MAX_GENERATED_BYTES = 256 << 20
# ... unless every run needs it (the main graph's live nodes read it): the run would make it anyway, every
# time (onnx's light VGG and ZFNet generate their classifier weights so), so creation makes it once, for
# as many bytes per session as this budget allows: more is a hostile or mistaken size, left to the run.
LARGE_GENERATED_BUDGET = min(1 << 30, (budget.physical_memory() or 0) // 8)
# The most multiply-adds (or window taps) one fold may cost: a product of two constants with a long inner dimension
# is small to hold but can take minutes to compute at creation; past this it is left to the run.
MAX_FOLD_WORK = 1 << 30
# The CPU seconds one fold_constants call may spend evaluating nodes; the nodes after that are left to the run.
MAX_FOLD_SECONDS = 10.0


def fold_constants(graph: Graph, context: PassContext) -> bool:
    scope = _Scope(graph, context, time.thread_time() + MAX_FOLD_SECONDS)
    changed = False
    while True:  # an inlined branch's nodes fold in the next sweep, and may decide another If
        folded = _sweep(graph, context, scope)
        inlined = _inline_decided_branches(graph, context, scope)
        changed |= folded or inlined
        if inlined:
            continue
        if not _fold_large_generated(graph, context, scope):
            return changed
        changed = True  # and sweep again: what reads the generated constant may fold now


def fold_constants_everywhere(graph: Graph, context: PassContext) -> bool:
    """:func:`fold_constants` in ``graph`` and then, seeing its constants and shapes, in its subgraphs."""
    changed = [fold_constants(graph, context)]
    visit_subgraphs(graph, context, lambda sub: changed.append(fold_constants_everywhere(sub, context)))
    return any(changed)


class _Scope:
    """Constants and value types visible in ``graph``: its own, then the enclosing graphs'."""

    def __init__(self, graph: Graph, context: PassContext, deadline: float):
        self.graph = graph
        self.deadline = deadline  # thread CPU time after which nothing more is evaluated
        self.constants = ChainMap(graph.initializers, context.outer_constants)  # type: ignore[arg-type]
        self._outer_types = context.outer_types

    def type_of(self, name: str) -> TypeInfo | None:
        info = self.graph.value_info.get(name) or self._outer_types.get(name)
        return info.type if info is not None else None


def _sweep(graph: Graph, context: PassContext, scope: _Scope) -> bool:
    uses = Uses(graph)
    folded: set[int] = set()
    partial: dict[str, tuple] = {}  # Shape outputs with some dims unknown: their known dims, None elsewhere
    for node in graph.nodes:
        values = _fold(node, graph, uses, context, scope)
        if values is None:
            values = _partial_shape_value(node, uses, partial, scope)
        if values is None:
            continue
        for name, value in zip(node.outputs, values):
            if name:
                add_initializer(graph, name, value)
                if context.folded is not None and value.size <= SHAPE_VALUE_LIMIT:
                    context.folded[name] = value
        folded.add(id(node))
    if not folded:
        return False
    graph.nodes = [node for node in graph.nodes if id(node) not in folded]
    return True


def _inline_decided_branches(graph: Graph, context: PassContext, scope: _Scope) -> bool:
    """Replace each ``If`` with a constant condition by the branch it takes: the branch's nodes, constants
    and value types join the graph (ONNX names are unique across subgraphs, so nothing clashes), and an
    Identity per output gives the If's outputs their values (eliminate_identities removes most)."""
    nodes: list[Node] = []
    inlined = False
    for node in graph.nodes:
        condition = scope.constants.get(node.inputs[0]) if node.op_type == "If" and node.inputs \
            and node.domain in ("", "ai.onnx") else None
        if condition is None or condition.size != 1:
            nodes.append(node)
            continue
        branch = node.attr("then_branch" if bool(condition.reshape(-1)[0]) else "else_branch")
        if not isinstance(branch, Graph) or len(branch.outputs) != len(node.outputs):
            nodes.append(node)
            continue
        for name, array in branch.initializers.items():
            graph.initializers[name] = array
        for info in (*branch.value_info.values(), *branch.outputs):
            graph.value_info.setdefault(info.name, info)
        nodes.extend(branch.nodes)
        opset = graph.opsets.get("", node.opset)
        for source, target in zip(branch.outputs, node.outputs):
            if target:
                nodes.append(new_node("Identity", [source.name], [target], context.fresh(f"{node.name}_taken"), opset))
                known = branch.value_info.get(source.name, source)  # the taken branch's type, not both's merge
                if known.type.is_tensor and known.type.dtype is not None:
                    graph.value_info[target] = ValueInfo(target, known.type)
        inlined = True
    if inlined:
        graph.nodes = nodes
    return inlined


def _fold_large_generated(graph: Graph, context: PassContext, scope: _Scope) -> bool:
    """Fold the generators (ConstantOfShape, Tile, Expand, Range, OneHot of constants) past MAX_GENERATED_BYTES
    that the main graph's live nodes read, while LARGE_GENERATED_BUDGET lasts; True when one folded.

    Left to the run, such a value is made again by every run. A graph specialized to one input signature does
    not: each signature would hold its own copy."""
    if context.depth or context.specialized:
        return False
    live, _ = live_values(graph)
    uses = Uses(graph)
    for node in graph.nodes:
        if not any(out in live for out in node.outputs if out) \
                or any(name and name not in scope.constants for name in node.inputs):
            continue
        size = _generated_bytes(node, [scope.constants[name] if name else None for name in node.inputs])
        if not MAX_GENERATED_BYTES < size <= LARGE_GENERATED_BUDGET - context.generated_resident:
            continue
        values = _fold(node, graph, uses, context, scope, generated_cap=size)
        if values is None:
            continue
        context.generated_resident += sum(value.nbytes for value in values)
        for name, value in zip(node.outputs, values):
            if name:
                add_initializer(graph, name, value)
        graph.nodes = [other for other in graph.nodes if other is not node]
        return True
    return False


def _fold(node: Node, graph: Graph, uses: Uses, context: PassContext, scope: _Scope,
          generated_cap: int | None = None) -> list[np.ndarray] | None:
    """The node's output values when it can and should be folded, else None. ``generated_cap``: the most bytes
    a generator (see _generated_bytes) may make (MAX_GENERATED_BYTES unless given)."""
    if generated_cap is None:
        generated_cap = MAX_GENERATED_BYTES
    if node.domain not in FOLDABLE_DOMAINS or node.op_type in NONDETERMINISTIC:
        return None
    if any(out in uses.graph_outputs for out in node.outputs):
        return None  # graph outputs stay computed: a run returns fresh arrays, not a shared constant
    static = _static_shape_value(node, scope)
    if static is None:
        static = filled_value(node, scope, generated_cap)
    if static is not None:
        return [static]
    constants = scope.constants
    if any(name and name not in constants for name in node.inputs) or node.subgraphs():
        return None
    inputs = [constants[name] if name else None for name in node.inputs]
    for array in inputs:
        if array is not None:
            array.flags.writeable = False  # a kernel must not be able to change a weight
    cap = max(_result_cap(inputs), generated_cap)
    declared = _declared_bytes(node, graph) or _inferred_bytes(node, inputs)
    if declared > cap or not _may_fold(node, inputs, uses, declared) \
            or _generated_bytes(node, inputs) > generated_cap:
        return None
    if fold_work(node, inputs, declared) > MAX_FOLD_WORK or time.thread_time() > scope.deadline:
        return None
    token = budget.enter(cap)  # kernels that size their output from data refuse past the cap, before allocating
    try:
        results = context.evaluate(node, graph, inputs)
    finally:
        budget.leave(token)
    if results is None or len(results) < max((i + 1 for i, out in enumerate(node.outputs) if out), default=0):
        return None
    values = [np.asarray(value) if isinstance(value, np.generic) else value for value in results]
    if not all(isinstance(value, np.ndarray) for value, out in zip(values, node.outputs) if out):
        return None  # sequences and optionals have no initializer form
    produced = sum(v.nbytes for v, out in zip(values, node.outputs) if out)
    if produced > cap or not _may_fold(node, inputs, uses, produced):
        return None
    # A view would keep its whole base alive (and could alias a kernel's buffer): own the data.
    return [value.copy() if isinstance(value, np.ndarray) and value.base is not None else value for value in values]


def _static_shape_value(node: Node, scope: _Scope) -> np.ndarray | None:
    """``Shape`` or ``Size`` of a value whose shape is fully known, computed without running."""
    if node.op_type not in ("Shape", "Size") or node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    info = scope.type_of(node.inputs[0])
    shape = info.static_shape if info is not None and info.is_tensor else None
    if shape is None:
        return None
    if node.op_type == "Size":
        return np.array(math.prod(shape), dtype=np.int64)
    # Python slicing clamps start/end after adding the rank to negatives, exactly as Shape-15 does.
    return np.array(shape[slice(node.attr("start", 0), node.attr("end"))], dtype=np.int64)


def _partial_shape_value(node: Node, uses: Uses, partial: dict[str, tuple], scope: _Scope) \
        -> list[np.ndarray] | None:
    """Where a shape is only partly known (a dimension symbolic): ``Shape`` is noted in ``partial``, and a
    ``Gather`` or ``Slice`` of it with constant indices that picks known dimensions only folds (the exporters'
    per-dimension Shape -> Gather/Slice chains)."""
    if node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    if node.op_type == "Shape":
        info = scope.type_of(node.inputs[0])
        if info is not None and info.is_tensor and info.shape is not None:
            window = tuple(d if isinstance(d, int) else None
                           for d in info.shape[slice(node.attr("start", 0), node.attr("end"))])
            if None not in window and node.outputs[0] not in uses.graph_outputs:  # Shape-15's window: all known
                return [np.asarray(window, dtype=np.int64)]
            partial[node.outputs[0]] = window
        return None
    known = partial.get(node.inputs[0])
    if known is None or node.outputs[0] in uses.graph_outputs:
        return None
    dims: tuple = known
    constants = [scope.constants.get(name) if name else None for name in node.inputs[1:]]
    if any(name and value is None for name, value in zip(node.inputs[1:], constants)):
        return None
    picked = None
    if node.op_type == "Gather" and node.attr("axis", 0) in (0, -1) and constants and constants[0] is not None \
            and constants[0].dtype.kind in "iu":
        indices = constants[0]
        if np.all((indices >= -len(dims)) & (indices < len(dims))):
            picked = np.asarray([dims[int(i)] for i in indices.reshape(-1)], dtype=object).reshape(indices.shape)
    elif node.op_type == "Slice" and node.opset >= 10 and len(constants) >= 2 and constants[0] is not None \
            and constants[1] is not None:
        starts, ends = constants[0], constants[1]
        axes = constants[2] if len(constants) > 2 else None
        steps = constants[3] if len(constants) > 3 else None
        if starts.size == 1 and ends.size == 1 and (axes is None or int(axes.reshape(-1)[0]) in (0, -1)):
            step = 1 if steps is None else int(steps.reshape(-1)[0])
            if step != 0:
                picked = np.asarray(dims[slice(int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0]), step)],
                                    dtype=object)
    if picked is None:
        return None
    if any(d is None for d in picked.reshape(-1)):
        if picked.ndim == 1:
            partial[node.outputs[0]] = tuple(picked)
        return None
    return [picked.astype(np.int64)]


def filled_value(node: Node, scope: _Scope, generated_cap: int) -> np.ndarray | None:
    """``ConstantOfShape`` of a constant, non-negative shape: ``value``'s one element (float32 zero
    without it) in every cell (generated from a tiny input: any size may fold, see _may_fold); anything
    else is left to the provider's kernel (which reports bad input at the run)."""
    if node.op_type != "ConstantOfShape" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
        return None
    shape = scope.constants.get(node.inputs[0])
    value = node.attr("value")
    fill = np.zeros(1, dtype=np.float32) if value is None else np.asarray(value)
    if shape is None or shape.ndim != 1 or shape.dtype != np.int64 or fill.size != 1 or (shape < 0).any():
        return None
    if _generated_bytes(node, [shape]) > generated_cap:
        return None  # and _fold does not evaluate it either: the kernel makes it at the run
    if any(d > MAX_GENERATED_BYTES for d in shape.tolist()):
        return None  # empty, but numpy cannot size it (2**62 x 2**62 x 0): the kernel reports it at the run
    return np.full([int(d) for d in shape], fill.reshape(-1)[0], dtype=fill.dtype)


def _declared_bytes(node: Node, graph: Graph) -> int:
    """The outputs' size from their static shapes (0 where unknown): a check before evaluating."""
    total = 0
    for name in node.outputs:
        info = graph.type_of(name) if name else None
        if info is None or not info.is_tensor or info.dtype is None:
            continue
        shape = info.static_shape
        if shape is not None:
            try:
                total += math.prod(shape) * info.dtype.numpy.itemsize
            except Exception:  # a dtype numpy cannot hold (strings): size unknown
                pass
    return total


def _generated_bytes(node: Node, inputs: list) -> int:
    """The output size of the operators whose output size comes from their inputs' values, computed from
    those values before evaluating (0 where not such an operator or not computable): ConstantOfShape,
    Tile, Expand, Range, OneHot."""
    op = node.op_type
    try:
        first = inputs[0]
        if op == "ConstantOfShape" and first is not None:
            value = node.attr("value")
            itemsize = np.asarray(value).itemsize if value is not None else 4  # float32 zero by default
            return itemsize * math.prod(max(int(d), 0) for d in np.asarray(first).reshape(-1))
        if op == "Tile" and first is not None and inputs[1] is not None:
            repeats = [int(r) for r in np.asarray(inputs[1]).reshape(-1)]
            return first.nbytes * math.prod(max(r, 0) for r in repeats)
        if op == "Expand" and first is not None and inputs[1] is not None:
            target = [int(d) for d in np.asarray(inputs[1]).reshape(-1)]
            dims = list(first.shape)
            rank = max(len(dims), len(target))
            dims, target = [1] * (rank - len(dims)) + dims, [1] * (rank - len(target)) + target
            return first.itemsize * math.prod(max(a, b, 0) for a, b in zip(dims, target))
        if op == "Range" and all(v is not None for v in inputs[:3]):
            start, limit, delta = (float(np.asarray(v).reshape(-1)[0]) for v in inputs[:3])
            count = math.ceil((limit - start) / delta) if delta else 0
            return max(count, 0) * np.asarray(first).itemsize
        if op == "OneHot" and first is not None and inputs[1] is not None and inputs[2] is not None:
            depth = int(np.asarray(inputs[1]).reshape(-1)[0])
            return first.size * max(depth, 0) * np.asarray(inputs[2]).itemsize
    except (TypeError, ValueError, OverflowError, IndexError):
        return 0  # malformed inputs: the evaluation reports them
    return 0


def fold_work(node: Node, inputs: list, result_bytes: int) -> int:
    """Multiply-adds (or window taps) evaluating ``node`` costs, for the operators whose cost grows faster than their
    inputs and outputs (0 for the rest, whose cost the size caps bound). An estimate from shapes, before running."""
    op = node.op_type
    arrays = [a for a in inputs if a is not None]
    if not arrays:
        return 0
    first = arrays[0]
    out_elements = result_bytes // max(first.itemsize, 1) if result_bytes else 0
    try:
        if op in ("MatMul", "MatMulInteger", "Gemm") and len(arrays) >= 2 and first.ndim:
            rows = math.prod(first.shape) // max(first.shape[-1], 1) if first.ndim > 1 else 1
            # Every output element is an inner product along A's contracted dimension (Gemm's transA swaps it).
            inner = first.shape[0] if op == "Gemm" and node.attr("transA", 0) and first.ndim == 2 else first.shape[-1]
            columns = arrays[1].shape[-1] if arrays[1].ndim > 1 else 1
            return max(out_elements, rows * columns) * inner
        if op in ("Conv", "ConvInteger", "ConvTranspose") and len(arrays) >= 2 and first.ndim >= 3:
            w = arrays[1]
            if op == "ConvTranspose":  # every input pixel meets every tap of its channel's filters
                return first.size * (w.size // max(w.shape[0], 1))
            per_output = w.size // max(w.shape[0], 1)  # C/group x kernel taps
            return max(out_elements, first.shape[0] * w.shape[0]) * per_output
        if op in ("MaxPool", "AveragePool", "LpPool"):
            return max(out_elements, first.size) * math.prod(node.attr("kernel_shape", []) or [1])
        if op == "Einsum":
            return _einsum_work(node.attr("equation", ""), arrays)
    except (TypeError, ValueError, IndexError, AttributeError):
        return MAX_FOLD_WORK + 1  # shapes the estimate cannot read: not worth evaluating at creation
    return 0


def _einsum_work(equation, arrays: list) -> int:
    """The product of every index's size (one multiply per combination); the inputs' sizes multiplied when the
    equation uses an ellipsis (an upper bound)."""
    if not isinstance(equation, str) or "..." in equation:
        return math.prod(a.size for a in arrays)
    sizes: dict[str, int] = {}
    for term, array in zip(equation.split("->")[0].replace(" ", "").split(","), arrays):
        for letter, dim in zip(term, array.shape):
            sizes[letter] = max(sizes.get(letter, 1), int(dim))
    return math.prod(sizes.values())


def _result_cap(inputs: list) -> int:
    """The most bytes a fold may produce: a generator's allowance, or a few times its inputs' size (a dequantized
    or widened weight), never what a Gather of repeated indices or a Concat of one input many times can ask."""
    return max(MAX_GENERATED_BYTES, 8 * sum(a.nbytes for a in inputs if a is not None))


def _inferred_bytes(node: Node, inputs: list) -> int:
    """The outputs' size by onnx inference on ``node`` alone with its constant inputs (0 where unknown): the
    check before evaluating when the graph declares no static shape for them."""
    proto = node.proto
    if proto is None:
        return 0
    types, values = {}, {}
    for name, array in zip(node.inputs, inputs):
        if not name or array is None:
            continue
        dtype = DataType.from_numpy(array.dtype) if array.dtype.kind in "biuf" else None
        if dtype is None:
            return 0
        types[name] = onnx.helper.make_tensor_type_proto(int(dtype), list(array.shape))
        if array.size <= SHAPE_VALUE_LIMIT:
            values[name] = onnx.numpy_helper.from_array(array, name)
    try:
        schema = onnx.defs.get_schema(node.op_type, node.opset, node.domain)
        inferred = onnx.shape_inference.infer_node_outputs(
            schema, proto, types, values, opset_imports=[onnx.helper.make_opsetid(node.domain, node.opset)])
    except Exception:  # an aid only: the budget still bounds the kernels that size from data
        return 0
    total = 0
    for name in node.outputs:
        found = inferred.get(name) if name else None
        info = convert_type(found) if found is not None else None
        shape = info.static_shape if info is not None and info.is_tensor and info.dtype is not None else None
        if shape is not None:
            try:
                total += math.prod(shape) * info.dtype.numpy.itemsize  # type: ignore[union-attr]
            except Exception:  # a dtype numpy cannot hold: size unknown
                pass
    return total


def _may_fold(node: Node, inputs: list, uses: Uses, result_bytes: int) -> bool:
    if result_bytes <= MAX_FOLDED_BYTES:
        return True
    return all(
        array is None or array.nbytes <= TINY_BYTES or uses.only_reader(name) is node
        for name, array in zip(node.inputs, inputs)
    )
