"""Graphs specialized per input signature: the shapes a run's feeds have, resolved once.

Exported models compute their reshapes, masks and slices from ``Shape`` nodes at every run (hundreds of
Shape, Gather, Unsqueeze and Concat nodes in a transformer), and their fusions cannot match while those
values are unknown. For a signature (the shapes of the feeds) a session infers every value's shape anew
(onnx shape inference over the model with those input shapes), copies its optimized graph with those
shapes, and runs the optimizer, the providers' passes and placement on the copy again: ``Shape`` of a
value whose shape is known folds, the chains reading it fold after it, and the fusions that need
constant shapes apply. The plan is kept for the signature.

A decode loop's feeds grow every step (the past length): a second signature that differs from the first
only in some dimensions makes those dimensions symbolic instead, and that one specialization serves every
later step (only what depends on them stays computed). Feeds whose dimensions agree share a symbol, and
its specialization is used only while they still agree. Specializations are bounded; past the bound, or
where inference fails, runs use the session's generic plan.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from ..ir import Graph, ValueInfo, clone_graph
from ..loader import SHAPE_VALUE_LIMIT, convert_type, infer_graph
from ..optimizer import PassContext
from ..optimizer.constant_folding import fold_constants
from ..provider_handle import ProviderHandle
from .executor import Executor

# Distinct specializations a session keeps (exact signatures and symbolic templates together).
LIMIT = 8
# Rounds of inference and folding; exported models settle in two or three.
MAX_ROUNDS = 6


class _Template:
    """A signature with some dimensions symbolic: per input, per axis, an int or a symbol's index; the
    symbols' dimensions must agree with one another."""

    __slots__ = ("dims", "symbols")

    def __init__(self, dims: tuple, symbols: int):
        self.dims = dims
        self.symbols = symbols

    def matches(self, signature: tuple) -> bool:
        values: list = [None] * self.symbols
        for want_shape, shape in zip(self.dims, signature):
            if len(want_shape) != len(shape):
                return False
            for want, got in zip(want_shape, shape):
                if isinstance(want, int):
                    if want != got:
                        return False
                else:
                    index = want[0]
                    if values[index] is None:
                        values[index] = got
                    elif values[index] != got:
                        return False
        return True


class Specializer:
    """The specialized executors of one session, made on first sight of a signature."""

    def __init__(self, graph: Graph, inputs: list[str], proto: onnx.ModelProto, handles: list[ProviderHandle],
                 prepare: Callable[[Graph], Executor]):
        self._graph = clone_graph(graph)  # the session's optimized graph, before placement
        self._inputs = inputs
        self._proto = proto
        self._produced = {out for node in proto.graph.node for out in node.output if out}
        self._handles = handles
        self._prepare = prepare
        self._exact: dict[tuple, Executor | None] = {}
        self._templates: list[tuple[_Template, Executor]] = []
        self._last: tuple = ((), None)
        self._lock = threading.Lock()
        self._failed = False

    def executor_for(self, feeds: dict) -> Executor | None:
        """The executor for these feeds' shapes, made now if new; None: the session's generic plan."""
        signature = tuple(getattr(feeds[name], "shape", ()) for name in self._inputs)
        last_signature, last = self._last
        if signature == last_signature:
            return last
        executor = self._exact[signature] if signature in self._exact else self._lookup(signature)
        self._last = (signature, executor)
        return executor

    def _lookup(self, signature: tuple) -> Executor | None:
        for known, found in self._templates:
            if known.matches(signature):
                return found
        with self._lock:
            if signature in self._exact:
                return self._exact[signature]
            if self._failed or len(self._exact) + len(self._templates) >= LIMIT:
                return None
            template = self._template(signature)
            executor = self._build(signature if template is None else template.dims)
            if template is not None and executor is not None:
                self._templates.append((template, executor))
            else:
                self._exact[signature] = executor
            return executor

    def close(self) -> None:
        with self._lock:
            for executor in [*self._exact.values(), *(executor for _, executor in self._templates)]:
                if executor is not None:
                    executor.close()
            self._exact.clear()
            self._templates.clear()
            self._last = ((), None)

    def _template(self, signature: tuple) -> _Template | None:
        """None for an exact specialization (the first signature, or one of another rank); else the template
        that makes symbolic the dimensions where ``signature`` differs from an earlier exact one."""
        earlier = [s for s, executor in self._exact.items() if executor is not None
                   and all(len(a) == len(b) for a, b in zip(s, signature))]
        if not earlier:
            return None
        reference = earlier[-1]
        symbols: dict[tuple, int] = {}
        dims = []
        for ref_shape, shape in zip(reference, signature):
            row = []
            for ref, got in zip(ref_shape, shape):
                if ref == got:
                    row.append(got)
                else:
                    row.append((symbols.setdefault((ref, got), len(symbols)),))
            dims.append(tuple(row))
        return _Template(tuple(dims), len(symbols))

    def _build(self, dims: tuple) -> Executor | None:
        """The executor of the graph specialized to ``dims`` (per input, per axis: an int, or a symbol as
        a 1-tuple of its index)."""
        try:
            graph = clone_graph(self._graph)
            if not self._resolve(graph, dims):
                return None
            return self._prepare(graph)
        except Exception as exc:  # specialization is an optimization: the generic plan still runs
            self._failed = True
            warnings.warn(f"onnx-runtime: shape specialization failed ({type(exc).__name__}: {exc}); runs use the "
                          f"generic plan", RuntimeWarning, stacklevel=4)
            return None

    def _resolve(self, graph: Graph, dims: tuple) -> bool:
        """Give ``graph`` the shapes ``dims`` imply, folding what they make constant. onnx's inference stops
        at values it cannot compute (a Range of computed bounds, say) and constant folding at unknown shapes:
        rounds alternate between them, inference seeing what folding found, until neither finds more."""
        context = PassContext(graph, self._handles)
        found: dict[str, np.ndarray] = {}
        for _ in range(MAX_ROUNDS):
            inferred = self._infer(dims, found)
            if inferred is None:
                return bool(found)
            _apply_types(graph, inferred)
            before = set(graph.initializers)
            fold_constants(graph, context)
            new = {name: graph.initializers[name] for name in graph.initializers.keys() - before
                   if name in self._produced and graph.initializers[name].size <= SHAPE_VALUE_LIMIT}
            if not new:
                return True
            found.update(new)
        return True

    def _infer(self, dims: tuple, found: dict[str, np.ndarray]) -> onnx.GraphProto | None:
        """onnx shape inference over the model with input shapes ``dims`` and the values ``found`` so far as
        constants (the nodes that produced them dropped)."""
        proto = onnx.ModelProto()
        proto.CopyFrom(self._proto)
        by_name = {vi.name: vi for vi in proto.graph.input}
        for name, shape in zip(self._inputs, dims):
            vi = by_name.get(name)
            if vi is None or not vi.type.HasField("tensor_type"):
                continue
            target = vi.type.tensor_type.shape
            target.Clear()
            for dim in shape:
                entry = target.dim.add()
                if isinstance(dim, int):
                    entry.dim_value = dim
                else:
                    entry.dim_param = f"specialized_{dim[0]}"
        if found:
            kept = [node for node in proto.graph.node if not all(out in found for out in node.output if out)]
            del proto.graph.node[:]
            proto.graph.node.extend(kept)
            proto.graph.initializer.extend(numpy_helper.from_array(value, name) for name, value in found.items())
        return infer_graph(proto)


def _apply_types(graph: Graph, inferred: onnx.GraphProto) -> None:
    """Give ``graph``'s values (and inputs) the types inference found; values the optimizer created keep
    theirs. A dimension inference left unknown stays as the graph had it."""
    found = {vi.name: vi for vi in (*inferred.value_info, *inferred.input, *inferred.output)}
    for name, vi in found.items():
        old = graph.value_info.get(name)
        if old is None and name not in {i.name for i in graph.inputs}:
            continue
        new = convert_type(vi.type)
        if old is not None and old.type.is_tensor and new.is_tensor and new.shape is not None \
                and old.type.shape is not None and len(old.type.shape) == len(new.shape):
            new.shape = tuple(n if n is not None else o for n, o in zip(new.shape, old.type.shape))
        if old is not None and (not new.is_tensor or new.dtype is None):
            continue
        graph.value_info[name] = ValueInfo(name, new)
    graph.inputs = [ValueInfo(vi.name, graph.value_info[vi.name].type, vi.doc) if vi.name in graph.value_info else vi
                    for vi in graph.inputs]
