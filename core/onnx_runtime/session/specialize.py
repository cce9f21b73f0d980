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

import contextlib
import functools
import gc
import operator
import threading
import warnings
from collections import ChainMap
from collections.abc import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from .. import budget
from ..ir import Graph, ValueInfo, clone_graph
from ..loader import SHAPE_VALUE_LIMIT, SerializedModel, convert_node, convert_type, infer_graph
from ..memory import MemoryBudgetError
from ..memory.activations import symbols_bound
from ..optimizer import PassContext
from ..optimizer.constant_folding import FOLDABLE_DOMAINS, NONDETERMINISTIC, fold_constants_everywhere
from ..proto_walk import all_graphs, node_subgraphs
from ..provider_handle import ProviderHandle
from .executor import Executor
from .shape_program import Template
from .shape_wheres import see_through_shape_wheres

# Distinct specializations a session keeps (exact signatures and symbolic templates together).
LIMIT = 8
MATCHED = 4096  # signatures kept per session with the template executor that serves them
# Rounds of inference and folding; exported models settle in two or three.
MAX_ROUNDS = 6
# The most bytes one model node evaluated for inference (Specializer._derived) may make: shape values are small.
DERIVED_BYTES = SHAPE_VALUE_LIMIT * 8


@contextlib.contextmanager
def _collector_paused():
    """A specialization builds thousands of long-lived objects (a graph copy, its plan and kernels, and the kernel
    families its placement imports), as session creation does (inference_session._collector_paused): the cyclic
    collector, which would rescan them generation after generation, is paused meanwhile (a fresh process's first
    run spent 2-4 ms of main-thread CPU in it); it runs as usual afterwards, and one already disabled stays so."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            promote_built()
            gc.enable()


def promote_built() -> None:
    """After a paused build (a session's creation, a specialization): move every object of the young generations
    to the oldest without scanning them (``gc.freeze()`` then ``gc.unfreeze()``), as surviving two collections
    would. What the build made lives as long as its session; otherwise the first allocation after the pause runs a
    generation-0 collection over all of it (2-3 ms of a fresh process's resnet creation). Only for a process's
    first PROMOTIONS builds (a fresh process's first sessions and signatures, where that time shows): garbage
    promoted with them waits for a full collection, and a loop creating and dropping sessions, each promoted,
    would never trigger one (its memory grew 40 KB per session). Never where the process holds frozen objects of
    its own, which ``unfreeze`` would release into collections."""
    if _promotions[0] > 0 and gc.get_freeze_count() == 0:
        _promotions[0] -= 1
        gc.freeze()
        gc.unfreeze()


PROMOTIONS = 8
_promotions = [PROMOTIONS]  # left to this process


class Specializer:
    """The specialized executors of one session, made on first sight of a signature."""

    def __init__(self, graph: Graph, inputs: list[str], proto: onnx.ModelProto | SerializedModel,
                 handles: list[ProviderHandle],
                 prepare: Callable[[Graph], Executor] | None, folded: dict[str, np.ndarray] | None = None):
        # The session's optimized graph, before placement: kept as it is by ``snapshot`` (a copy), at the first
        # signature resolved here or before the session places that graph, whichever comes first (a session
        # whose specialized plans all come from the plan cache never copies it).
        self._source: Graph | None = graph
        self._graph: Graph | None = None
        self._snapshot_lock = threading.Lock()
        self._inputs = inputs
        self._given_proto, self._folded = proto, folded or {}  # read by the properties below, at the first resolve
        self._handles = handles
        self._prepare = prepare
        self._exact: dict[tuple, Executor | None] = {}
        self._templates: list[tuple[Template, Executor]] = []
        # Signatures a template served, with its executor: a decode loop's later generations pass the same lengths
        # again, and a dict lookup costs less than the templates' tests. Bounded (MATCHED), started over past it.
        self._matched: dict[tuple, Executor] = {}
        self._last: tuple = ((), None)
        self._lock = threading.Lock()
        self._failed = False

    def prepare(self, graph: Graph) -> Executor:
        """The planned executor of ``graph``, a specialized copy of the session's (``prepare`` as given; a subclass
        that overrides this passes None: a bound method of its own, held, would be a reference cycle)."""
        assert self._prepare is not None  # (a subclass that passes None overrides this)
        return self._prepare(graph)

    # What inference over the model needs, made at the first signature resolved here (a cached plan may need none).
    @functools.cached_property
    def _model_proto(self) -> onnx.ModelProto:
        given = self._given_proto  # a cached plan's is parsed only now (loader.SerializedModel)
        return given.parsed() if isinstance(given, SerializedModel) else given

    @functools.cached_property
    def _proto(self) -> onnx.ModelProto:
        return _in_order(self._model_proto)

    @functools.cached_property
    def _produced(self) -> set[str]:
        return {out for sub in all_graphs(self._model_proto.graph) for node in sub.node for out in node.output if out}

    @functools.cached_property
    def _creation_constants(self) -> dict[str, np.ndarray]:
        """What folding at session creation computed of the model's values: the optimized graph may no longer
        hold them (an If it decided is gone with its condition), but inference over the model needs them."""
        return {name: value for name, value in self._folded.items() if name in self._produced}

    @functools.cached_property
    def _written(self) -> dict[str, int]:
        """The float type each value has in the model: a provider's pass may compute a value in another
        (half-precision models in float32), and inference over the model needs its constants as written."""
        return {vi.name: vi.type.tensor_type.elem_type for sub in all_graphs(self._model_proto.graph)
                for vi in (*sub.value_info, *sub.output) if vi.type.HasField("tensor_type")}

    def snapshot(self) -> Graph:
        """The session's graph as it was at creation: copied now if not yet. The session calls it before placing
        that graph (placement may expand function calls in place)."""
        with self._snapshot_lock:
            if self._graph is None:
                assert self._source is not None
                self._graph, self._source = clone_graph(self._source), None
            return self._graph

    def executor_for(self, feeds: dict) -> Executor | None:
        """The executor for these feeds' shapes, made now if new; None: the session's generic plan."""
        try:
            signature = tuple([feeds[name].shape for name in self._inputs])
        except AttributeError:  # a feed without a shape (a sequence)
            signature = tuple(getattr(feeds[name], "shape", ()) for name in self._inputs)
        last_signature, last = self._last
        if signature == last_signature:
            return last
        return self._found(signature)

    def executor_for_signature(self, signature: tuple) -> Executor | None:
        """:meth:`executor_for` of feeds whose shapes, in the model's input order, are ``signature`` (a bound run
        that has them at hand: see :meth:`signature_order`)."""
        last_signature, last = self._last
        if signature == last_signature:
            return last
        return self._found(signature)

    def _found(self, signature: tuple) -> Executor | None:
        executor = self._matched.get(signature)
        if executor is None:
            executor = self._exact[signature] if signature in self._exact else self._lookup(signature)
        self._last = (signature, executor)
        return executor

    def signature_order(self, names: tuple[str, ...]):
        """A function taking shapes listed in ``names``' order (a bound run's inputs) to the signature
        :meth:`executor_for_signature` takes; None where ``names`` are not each of the model's inputs once."""
        if len(set(names)) != len(names) or set(names) != set(self._inputs) or not self._inputs:
            return None
        position = {name: index for index, name in enumerate(names)}
        order = [position[name] for name in self._inputs]
        if len(order) == 1:
            return lambda shapes: (shapes[order[0]],)
        return operator.itemgetter(*order)

    def _lookup(self, signature: tuple) -> Executor | None:
        for known, found in self._templates:
            if known.matches(signature):
                self._remember(signature, found)
                return found
        with self._lock:
            if signature in self._exact:
                return self._exact[signature]
            if self._failed or len(self._exact) + len(self._templates) >= LIMIT:
                return None
            template = self._template(signature)
            with symbols_bound(() if template is None else template.dims, signature, "specialized_"), \
                    _collector_paused():
                executor = self._build(signature if template is None else template.dims)  # (sized at these feeds)
            if template is not None and executor is not None:
                self._templates.append((template, executor))
                self._remember(signature, executor)
            else:
                self._exact[signature] = executor
            return executor

    def _remember(self, signature: tuple, executor: Executor) -> None:
        matched = self._matched
        if len(matched) >= MATCHED:  # (lengths without bound: start over)
            matched.clear()
        matched[signature] = executor

    def close(self) -> None:
        with self._lock:
            for executor in [*self._exact.values(), *(executor for _, executor in self._templates)]:
                if executor is not None:
                    executor.close()
            self._exact.clear()
            self._templates.clear()
            self._matched.clear()
            self._last = ((), None)

    def _template(self, signature: tuple) -> Template | None:
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
                # A dimension that is 1 now stays 1: broadcasting and the fusions depend on it (a decode
                # step's one token after a prefill), and a later length other than 1 gets its own template.
                if ref == got or got == 1:
                    row.append(got)
                else:
                    row.append((symbols.setdefault((ref, got), len(symbols)), 0))
            dims.append(tuple(row))
        return Template(tuple(dims), len(symbols))

    def _build(self, dims: tuple) -> Executor | None:
        """The executor of the graph specialized to ``dims`` (per input, per axis: an int, or a symbol as
        ``(index, 0)``, a :class:`.shape_program.Template`'s form)."""
        try:
            graph = clone_graph(self.snapshot())
            if not self._resolve(graph, dims):
                return None
            return self.prepare(graph)
        except MemoryBudgetError:  # its activations do not fit the host budget (memory/activations.py): not run
            raise
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
        found: dict[str, np.ndarray] = dict(self._creation_constants)
        dropped = self._dropped(graph)
        for _ in range(MAX_ROUNDS):
            inferred = self._infer(dims, found)
            if inferred is None:
                return len(found) > len(self._creation_constants)
            _apply_types(graph, inferred)
            context.folded = {}
            fold_constants_everywhere(graph, context)
            # What the model computes and the graph holds as a constant (folded now, or at session creation
            # where inference had not seen it) is a constant for the next round's inference; so is what folding
            # computed and then dropped (the condition of an If it inlined): inference needs it to take that
            # branch too, or the shapes after the If stay unknown.
            computed = {**context.folded, **_constants(graph)}
            new = {name: value for name, value in computed.items()
                   if name not in found and name in self._produced and value.size <= SHAPE_VALUE_LIMIT}
            found.update(new)
            # The model's own nodes over what is now known: the optimized graph may no longer hold a node the
            # model's inference needs the value of (a ShuffleNet's chunk bound ``Mul(Div(c, 2), 1)``, removed as
            # a multiplication by one, fed a Slice whose channels then stayed unknown, and every shape after it).
            derived = self._derived(dropped, found, context, graph)
            if not new and not derived:
                return True
            found.update(derived)
        return True

    @functools.cached_property
    def _small_initializers(self) -> dict[str, np.ndarray]:
        small: dict[str, np.ndarray] = {}
        for init in self._proto.graph.initializer:
            if _elements(init) <= SHAPE_VALUE_LIMIT and init.data_location != onnx.TensorProto.EXTERNAL:
                with contextlib.suppress(Exception):
                    small[init.name] = numpy_helper.to_array(init)
        return small

    def _dropped(self, graph: Graph) -> list[onnx.NodeProto]:
        """The model's main-graph nodes (standard domains, with inputs, no subgraphs) that compute a value
        ``graph`` (the optimized graph, before this signature's folding) no longer holds: folding over ``graph``
        can never find those values, and the model's inference may need them."""
        held = set(graph.initializers)
        held.update(out for node in graph.nodes for out in node.outputs)
        dropped = []
        for proto_node in self._proto.graph.node:
            if proto_node.input and proto_node.op_type not in NONDETERMINISTIC \
                    and proto_node.domain in FOLDABLE_DOMAINS \
                    and any(out and out not in held for out in proto_node.output) \
                    and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                for a in proto_node.attribute):
                dropped.append(proto_node)
        return dropped

    def _derived(self, dropped: list[onnx.NodeProto], found: dict[str, np.ndarray], context: PassContext,
                 graph: Graph) -> dict[str, np.ndarray]:
        """Values of ``dropped`` nodes whose inputs are all known (``found`` or small initializers) and which
        ``found`` lacks, evaluated in order as constant folding evaluates a node (a host provider's kernel); only
        small results are kept. A node evaluated, kept or not, leaves ``dropped``."""
        opsets = {entry.domain or "": entry.version for entry in self._model_proto.opset_import}
        derived: dict[str, np.ndarray] = {}
        known = ChainMap(derived, found, self._small_initializers)
        for index, proto_node in enumerate(list(dropped)):
            if any(name and name not in known for name in proto_node.input):
                continue
            dropped.remove(proto_node)
            if all(out in known for out in proto_node.output if out):
                continue
            try:
                node = convert_node(proto_node, index, opsets, None)
            except Exception:  # (an attribute the loader refuses: the model's load reported it already)
                continue
            inputs = [known[name] if name else None for name in node.inputs]
            if any(array is not None and array.size > SHAPE_VALUE_LIMIT for array in inputs):
                continue
            token = budget.enter(DERIVED_BYTES)  # a ConstantOfShape or Expand asked for more refuses before allocating
            try:
                results = context.evaluate(node, graph, inputs)
            finally:
                budget.leave(token)
            if results is None or len(results) < len(proto_node.output):
                continue
            values = {out: np.asarray(value) for out, value in zip(proto_node.output, results) if out}
            if all(isinstance(value, np.ndarray) and value.dtype != object and value.size <= SHAPE_VALUE_LIMIT
                   for value in values.values()):
                derived.update(values)
        return derived

    def _infer(self, dims: tuple, found: dict[str, np.ndarray]) -> onnx.GraphProto | None:
        """onnx shape inference over the model with input shapes ``dims`` and the values ``found`` so far as
        constants of the graphs that computed them (the nodes that produced them dropped)."""
        proto = onnx.ModelProto()
        proto.CopyFrom(self._proto)
        for sub in all_graphs(proto.graph):
            # A symbolic dimension annotated on what onnx infers (a converter's annotations) would stay symbolic:
            # left unknown, inference fills it in. Other domains' outputs keep theirs: inference has nothing else.
            inferred = {out for node in sub.node if node.domain in ("", "ai.onnx") for out in node.output}
            for vi in sub.value_info:
                if vi.name in inferred:
                    for dim in vi.type.tensor_type.shape.dim:
                        dim.ClearField("dim_param")
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
        # Even with nothing found: the subgraphs get local copies of the outer constants they read (a branch's
        # Pad or Slice reading the main graph's pads was shapeless, and everything after it).
        written = {name: self._as_written(name, value) for name, value in found.items()}
        _substitute(proto.graph, _through_casts(proto.graph, written) if written else written)
        return infer_graph(see_through_shape_wheres(proto))  # (a shape vector's "-1 -> 1" Where: its input)

    def _as_written(self, name: str, value: np.ndarray) -> np.ndarray:
        elem_type = self._written.get(name)
        if elem_type is None or value.dtype.kind != "f":
            return value
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem_type)
        return value.astype(dtype) if dtype.kind == "f" and dtype != value.dtype else value


def _through_casts(graph: onnx.GraphProto, found: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``found`` plus the outputs of the model's Identity, Cast and Not nodes over found values. The optimized
    graph may have dropped such a node (a bool-to-bool Cast is an identity) and decided an If by the value before
    it, while the model's If reads the value after it: inference must take that branch too, or the shapes after
    the If stay unknown."""
    found = dict(found)
    for sub in all_graphs(graph):
        for node in sub.node:
            if node.op_type not in ("Identity", "Cast", "Not") or node.domain not in ("", "ai.onnx") \
                    or len(node.input) != 1 or node.input[0] not in found or node.output[0] in found:
                continue
            value = found[node.input[0]]
            if node.op_type == "Not":
                value = np.logical_not(value)
            elif node.op_type == "Cast":
                to = next((a.i for a in node.attribute if a.name == "to"), 0)
                try:
                    value = value.astype(onnx.helper.tensor_dtype_to_np_dtype(to))
                except (KeyError, TypeError, ValueError):
                    continue  # a type numpy does not hold: left to inference
            found[node.output[0]] = value
    return found


def _in_order(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` with its graph's nodes in topological order (a copy where they were not): onnx's inference
    types a value only after its producer, and some converters append nodes they insert (the float16
    converter's input Casts) after their readers. A cycle or an unknown read keeps the written order."""
    nodes = list(proto.graph.node)
    producer = {out: index for index, node in enumerate(nodes) for out in node.output if out}
    # An If or Loop also reads what its subgraphs take from this graph: sorted by its explicit inputs alone, a
    # branch that reads an earlier If's output moved ahead of it and inference left everything after shapeless.
    waiting = [{producer[name] for name in (*node.input, *_subgraph_reads(node)) if name in producer}
               for node in nodes]
    if all(need < index for index, needs in enumerate(waiting) for need in needs):
        return proto  # already in order: the written order kept
    readers: dict[int, list[int]] = {}
    for index, needs in enumerate(waiting):
        for need in needs:
            readers.setdefault(need, []).append(index)
    ready = [index for index, needs in enumerate(waiting) if not needs]
    ordered: list[onnx.NodeProto] = []
    for index in ready:  # grows while read: a node joins once its producers are in
        ordered.append(nodes[index])
        for reader in readers.get(index, ()):
            waiting[reader].discard(index)
            if not waiting[reader]:
                ready.append(reader)
    if len(ordered) != len(nodes):
        return proto
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    del copy.graph.node[:]
    copy.graph.node.extend(ordered)
    return copy


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Names ``node``'s subgraphs read without defining them (values of the enclosing graphs)."""
    reads: set[str] = set()
    for sub in node_subgraphs(node):
        defined = {init.name for init in sub.initializer} | {vi.name for vi in sub.input}
        for inner in sub.node:
            reads.update(name for name in (*inner.input, *_subgraph_reads(inner)) if name and name not in defined)
            defined.update(inner.output)
        reads.update(vi.name for vi in sub.output if vi.name not in defined)
    return reads


def _substitute(graph: onnx.GraphProto, found: dict[str, np.ndarray],
                outer: dict[str, onnx.TensorProto] | None = None) -> None:
    """Replace the nodes of ``graph`` and its subgraphs that compute values of ``found`` by initializers
    of the graph they were in, and each ``If`` that ``found`` decides by the branch it takes (as constant
    folding inlines it: the branch's nodes, then an Identity per output). ``outer``: the small constants of
    the enclosing graphs, which onnx's inference of a subgraph does not see as values: a subgraph reads
    them through local copies."""
    while _substitute_here(graph, found):  # an inlined branch may hold more of both
        pass
    if outer:
        _localize(graph, outer)
    visible = dict(outer or {})
    visible.update((init.name, init) for init in graph.initializer if _elements(init) <= SHAPE_VALUE_LIMIT)
    for node in graph.node:
        for sub in node_subgraphs(node):
            _substitute(sub, found, visible)


def _elements(tensor: onnx.TensorProto) -> int:
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count


def _localize(graph: onnx.GraphProto, outer: dict[str, onnx.TensorProto]) -> None:
    """Make ``graph``'s nodes read the outer constants they use from copies local to ``graph`` (fresh names:
    a subgraph may not redefine an outer name). Only inputs are renamed; every value keeps its name."""
    defined = {init.name for init in graph.initializer} | {vi.name for vi in graph.input}
    defined.update(out for node in graph.node for out in node.output)
    aliases: dict[str, str] = {}
    for node in graph.node:
        for index, name in enumerate(node.input):
            if not name or name in defined or name not in outer:
                continue
            alias = aliases.get(name)
            if alias is None:
                alias = aliases[name] = f"{name}__specialized_{len(defined)}_{len(aliases)}"
                copy = graph.initializer.add()
                copy.CopyFrom(outer[name])
                copy.name = alias
            node.input[index] = alias


def _substitute_here(graph: onnx.GraphProto, found: dict[str, np.ndarray]) -> bool:
    kept: list[onnx.NodeProto] = []
    changed = False
    for node in graph.node:
        outputs = [out for out in node.output if out]
        if outputs and all(out in found for out in outputs):
            graph.initializer.extend(numpy_helper.from_array(found[out], out) for out in outputs)
        elif node.op_type == "If" and node.domain in ("", "ai.onnx") and node.input[0] in found \
                and found[node.input[0]].size == 1:
            taken = "then_branch" if bool(found[node.input[0]].reshape(-1)[0]) else "else_branch"
            branch = next(a.g for a in node.attribute if a.name == taken)
            kept.extend(branch.node)
            graph.initializer.extend(branch.initializer)
            kept.extend(onnx.helper.make_node("Identity", [source.name], [target])
                        for source, target in zip(branch.output, node.output) if target)
        else:
            kept.append(node)
            continue
        changed = True
    if changed:
        del graph.node[:]  # (re-adding copies the nodes: subgraphs are reached after this, on the copies)
        graph.node.extend(kept)
        # A constant's shape is its array's: an earlier inference's guess (symbolic dimensions) would stay.
        constants = {init.name for init in graph.initializer}
        stale = [vi for vi in graph.value_info if vi.name in constants]
        for vi in stale:
            graph.value_info.remove(vi)
    return changed


def _constants(graph: Graph) -> dict[str, np.ndarray]:
    """The initializers of ``graph`` and its subgraphs, by name (unique model-wide)."""
    found = dict(graph.initializers)
    for node in graph.walk():
        for sub in node.subgraphs():
            found.update(sub.initializers)
    return found


def _apply_types(graph: Graph, inferred: onnx.GraphProto) -> None:
    """Give ``graph``'s values (and inputs), and its subgraphs' values, the types inference found; values the
    optimizer created keep theirs. A dimension inference left unknown stays as the graph had it."""
    found: dict[str, onnx.ValueInfoProto] = {}
    for sub in all_graphs(inferred):  # names are unique model-wide
        for vi in (*sub.value_info, *sub.input, *sub.output):
            found.setdefault(vi.name, vi)
    _apply_found(graph, found)


def _apply_found(graph: Graph, found: dict) -> None:
    for name, old in list(graph.value_info.items()):
        vi = found.get(name)
        if vi is not None:
            _update(graph, name, old, vi)
    # Values the graph has but knew no type of (an input, or a node output inference had left untyped).
    untyped = {vi.name for vi in graph.inputs} | {out for node in graph.nodes for out in node.outputs if out}
    for name in untyped - graph.value_info.keys():
        if name in found:
            _update(graph, name, None, found[name])
    graph.inputs = [ValueInfo(vi.name, graph.value_info[vi.name].type, vi.doc) if vi.name in graph.value_info else vi
                    for vi in graph.inputs]
    for node in graph.nodes:
        for sub in node.subgraphs():
            _apply_found(sub, found)


def _update(graph: Graph, name: str, old: ValueInfo | None, vi: onnx.ValueInfoProto) -> None:
    new = convert_type(vi.type)
    if old is not None and old.type.is_tensor and new.is_tensor and new.shape is not None \
            and old.type.shape is not None and len(old.type.shape) == len(new.shape):
        new.shape = tuple(n if n is not None else o for n, o in zip(new.shape, old.type.shape))
    if old is not None and (not new.is_tensor or new.dtype is None):
        return
    if old is not None and old.type.is_tensor and old.type.dtype is not None:
        new.dtype = old.type.dtype  # the graph's element types are the session's (its passes may widen some)
    graph.value_info[name] = ValueInfo(name, new)
