"""Constant folding: nodes computable at session creation become initializers.

A node folds when every input is a constant (an initializer, or a node folded earlier in the same
sweep, so chains fold at once), or when it only asks for the static shape of its input (``Shape``,
``Size``). The node runs once through a host provider's own kernel, so folding computes exactly
what the run would have; ``ConstantOfShape`` of a constant shape, whose output the spec fixes
(``value`` repeated), is filled here: exported models carry hundreds, and a provider round trip for
each was a large share of their session creation (measured in b39d876).
"""

from __future__ import annotations

import math

import numpy as np

from ..ir import Graph, Node
from .context import PassContext
from .rewrite import Uses, add_initializer

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


def fold_constants(graph: Graph, context: PassContext) -> bool:
    uses = Uses(graph)
    folded: set[int] = set()
    partial: dict[str, tuple] = {}  # Shape outputs with some dims unknown: their known dims, None elsewhere
    for node in graph.nodes:
        values = _fold(node, graph, uses, context)
        if values is None:
            values = _partial_shape_value(node, graph, partial)
        if values is None:
            continue
        for name, value in zip(node.outputs, values):
            if name:
                add_initializer(graph, name, value)
        folded.add(id(node))
    if not folded:
        return False
    graph.nodes = [node for node in graph.nodes if id(node) not in folded]
    return True


def _fold(node: Node, graph: Graph, uses: Uses, context: PassContext) -> list[np.ndarray] | None:
    """The node's output values when it can and should be folded, else None."""
    if node.domain not in FOLDABLE_DOMAINS or node.op_type in NONDETERMINISTIC:
        return None
    if any(out in uses.graph_outputs for out in node.outputs):
        return None  # graph outputs stay computed: a run returns fresh arrays, not a shared constant
    static = _static_shape_value(node, graph)
    if static is None:
        static = _filled_value(node, graph)
    if static is not None:
        return [static]
    if any(name and name not in graph.initializers for name in node.inputs) or node.subgraphs():
        return None
    inputs = [graph.initializers[name] if name else None for name in node.inputs]
    for array in inputs:
        if array is not None:
            array.flags.writeable = False  # a kernel must not be able to change a weight
    if not _may_fold(node, inputs, uses, _declared_bytes(node, graph)):
        return None
    results = context.evaluate(node, graph, inputs)
    if results is None or len(results) < max((i + 1 for i, out in enumerate(node.outputs) if out), default=0):
        return None
    values = [np.asarray(value) if isinstance(value, np.generic) else value for value in results]
    if not all(isinstance(value, np.ndarray) for value, out in zip(values, node.outputs) if out):
        return None  # sequences and optionals have no initializer form
    if not _may_fold(node, inputs, uses, sum(v.nbytes for v, out in zip(values, node.outputs) if out)):
        return None
    # A view would keep its whole base alive (and could alias a kernel's buffer): own the data.
    return [value.copy() if isinstance(value, np.ndarray) and value.base is not None else value for value in values]


def _static_shape_value(node: Node, graph: Graph) -> np.ndarray | None:
    """``Shape`` or ``Size`` of a value whose shape is fully known, computed without running."""
    if node.op_type not in ("Shape", "Size") or node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    info = graph.type_of(node.inputs[0])
    shape = info.static_shape if info is not None and info.is_tensor else None
    if shape is None:
        return None
    if node.op_type == "Size":
        return np.array(math.prod(shape), dtype=np.int64)
    # Python slicing clamps start/end after adding the rank to negatives, exactly as Shape-15 does.
    return np.array(shape[slice(node.attr("start", 0), node.attr("end"))], dtype=np.int64)


def _partial_shape_value(node: Node, graph: Graph, partial: dict[str, tuple]) -> list[np.ndarray] | None:
    """Where a shape is only partly known (a dimension symbolic): ``Shape`` is noted in ``partial``, and a
    ``Gather`` or ``Slice`` of it with constant indices that picks known dimensions only folds (the exporters'
    per-dimension Shape -> Gather/Slice chains)."""
    if node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    if node.op_type == "Shape":
        info = graph.type_of(node.inputs[0])
        if info is not None and info.is_tensor and info.shape is not None:
            partial[node.outputs[0]] = tuple(
                d if isinstance(d, int) else None for d in info.shape[slice(node.attr("start", 0), node.attr("end"))])
        return None
    known = partial.get(node.inputs[0])
    if known is None or node.outputs[0] in {vi.name for vi in graph.outputs}:
        return None
    dims: tuple = known
    constants = [graph.initializers.get(name) if name else None for name in node.inputs[1:]]
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


def _filled_value(node: Node, graph: Graph) -> np.ndarray | None:
    """``ConstantOfShape`` of a constant, non-negative shape: ``value``'s one element (float32 zero
    without it) in every cell (generated from a tiny input: any size may fold, see _may_fold); anything
    else is left to the provider's kernel (which reports bad input at the run)."""
    if node.op_type != "ConstantOfShape" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
        return None
    shape = graph.initializers.get(node.inputs[0])
    value = node.attr("value")
    fill = np.zeros(1, dtype=np.float32) if value is None else np.asarray(value)
    if shape is None or shape.ndim != 1 or shape.dtype != np.int64 or fill.size != 1 or (shape < 0).any():
        return None
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


def _may_fold(node: Node, inputs: list, uses: Uses, result_bytes: int) -> bool:
    if result_bytes <= MAX_FOLDED_BYTES:
        return True
    return all(
        array is None or array.nbytes <= TINY_BYTES or uses.only_reader(name) is node
        for name, array in zip(node.inputs, inputs)
    )
