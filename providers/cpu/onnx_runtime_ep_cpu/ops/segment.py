"""FusedSegment (segment_fusions.py): a run of convolution-network nodes as one kernel.

While a new process serves its first runs from numpy (compiled/deferred.py), the segment runs its nodes one
by one with their own kernels (built for the concrete shapes each signature gives them). Once the compiled
kernels have loaded, each input signature gets a *bound plan* (algorithms/segment_steps.py) at its next run:
every value of the segment in a buffer allocated once, and each node as a few prepared calls over those
buffers (a compiled convolution's loop with its arguments bound, a numpy ufunc with ``out=``), or as its own
kernel whose outputs are copied into their buffers where it cannot be prepared. A run of the plan is then one
Python loop over those calls: the feeds copied in, the outputs copied out (fresh arrays, as node kernels
return).

The plan is checked once against the node-by-node run it was built from (to float rounding: a prepared call
may sum in another order), and dropped where they differ; from then on every run of the signature returns
the plan's values. One run uses a plan at a time (its buffers are shared): concurrent runs of a signature get
copies of its plan, up to _COPIES, then wait for one. Plans over POOL_LIMIT_BYTES of buffers are not made
(the node-by-node run frees each value after its last reader): such a batch then runs in chunks of images whose
values together take at most POOL_LIMIT_BYTES, each chunk's signature planned as any, where one image's run proves
that no node reads another image (segment_split.per_image). A batch whose values pass PLANNING_LIMIT_BYTES is not
planned whole at all (the planning run holds every value at once, and binds each again): chunks from its first
run, or its nodes.

A plan made while a loop it (or a node's kernel) calls was served by a fallback, the loader's child compiling it
(compiled/deferred.py), is provisional (provisional.py): it runs inside a Trial, node by node where a
step would compile, and is made again once those misses are settled, at the signature's next run or in
deferred.wait_ready. So is a signature that such a window left to the nodes.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
from onnx_runtime.errors import OnnxRuntimeError

from .. import provisional
from ..algorithms.conv_choice import SEGMENT_NODES
from ..compiled import deferred
from ..compiled.reference_run import ReferenceRun
from ..fused_domain import FUSED_DOMAIN, concat_part
from ..registry import NEEDS, lookup, register
from ..threads import kernel_threads

if TYPE_CHECKING:
    from ..algorithms.segment_steps import BoundPlan

POOL_LIMIT_BYTES = 64 << 20
PLANNING_LIMIT_BYTES = 1 << 30
_SIGNATURES = 16  # bound plans (and node kernels) kept per segment; past that, they start over
_COPIES = 4  # plans per signature at most, for as many concurrent runs (more wait for the first)


# "1": the session's graph inputs are new data at every run (a batch job's rows), never weights fed as inputs, so a
# segment copies a read-only graph input in from its first plan instead of binding it and planning again.
DATA_INPUTS_KEY = "session.graph_inputs_are_data"

_FED: dict[tuple, tuple] = {}  # (segment name, id of a weight) -> (a weak reference to it, the fed set)


def _shared_fed(segment, inputs) -> set[int]:
    """The fed set of every copy of this segment the session specializes by input shapes, found by the segment's
    name and its last read-only input (a weight: the same array in each copy): a new shape (a batch's partial last
    micro-batch) would otherwise bind a feed already seen to change, and plan again at its next run."""
    anchor = next((x for x in reversed(inputs) if isinstance(x, np.ndarray) and not x.flags.writeable), None)
    if anchor is None:
        return segment.fed
    key = (segment.name, id(anchor))
    found = _FED.get(key)
    if found is not None and found[0]() is anchor:
        found[1].update(segment.fed)
        return found[1]
    if len(_FED) >= 1024:
        _FED.clear()
    _FED[key] = (weakref.ref(anchor), segment.fed)
    return segment.fed


class _Inner:
    """One node of the segment: its value slots and its kernels per input shapes."""

    __slots__ = ("node", "factory", "inputs", "outputs", "release", "kernels")

    def __init__(self, node, factory, inputs, outputs):
        self.node, self.factory, self.inputs, self.outputs = node, factory, inputs, outputs
        self.release: tuple[int, ...] = ()
        self.kernels: dict[tuple, object] = {}

    def kernel(self, values):
        key = tuple(None if v is None else (v.shape, v.dtype) for v in values)
        found = self.kernels.get(key)
        if found is None:
            if len(self.kernels) >= _SIGNATURES:
                self.kernels.clear()
            shapes = [None if v is None else tuple(v.shape) for v in values]
            found = self.kernels[key] = self.factory(self.node, shapes, self.node.opset)
        return found


class _Chunks(NamedTuple):
    """How a batch runs in chunks (Segment._chunk): the feeds cut along the batch, and the images of a chunk."""

    feeds: tuple[int, ...]
    images: int


class _ValueBytes:
    """``value_bytes(inputs)``: the bytes of every value the segment's nodes make, for these inputs, from the
    body's declared shapes, their symbolic dimensions (a batch) read off the inputs' shapes; 0 where a value's
    shape or a dimension is not known."""

    def __init__(self, body):
        self.values: list[tuple[int, tuple[str, ...]]] = []  # (bytes over the known dimensions, symbolic ones)
        self.symbols: list[tuple[int, int, str]] = []  # (input position, axis, name)
        for position, info in enumerate(body.inputs):
            shape = info.type.shape if info.type is not None and info.type.is_tensor else None
            for axis, dim in enumerate(shape or ()):
                if isinstance(dim, str) and dim:
                    self.symbols.append((position, axis, dim))
        for inner in body.nodes:
            for name in inner.outputs:
                info = body.value_info.get(name) if name else None
                kind = info.type if info is not None else None
                if kind is None or not kind.is_tensor or kind.shape is None or kind.dtype is None:
                    self.values = []
                    return
                known, symbolic = kind.dtype.numpy.itemsize, []
                for dim in kind.shape:
                    if isinstance(dim, int):
                        known *= dim
                    elif isinstance(dim, str) and dim:
                        symbolic.append(dim)
                    else:
                        self.values = []
                        return
                self.values.append((known, tuple(symbolic)))

    def __call__(self, inputs) -> int:
        sizes: dict[str, int] = {}
        for position, axis, name in self.symbols:
            value = inputs[position] if position < len(inputs) else None
            if isinstance(value, np.ndarray) and axis < value.ndim:
                sizes.setdefault(name, value.shape[axis])
        total = 0
        for known, symbolic in self.values:
            for name in symbolic:
                if name not in sizes:
                    return 0
                known *= sizes[name]
            total += known
        return total


class Segment:
    """The FusedSegment kernel: ``segment(*inputs) -> outputs``."""

    def __init__(self, node):
        body = node.attr("body")
        slots: dict[str, int] = {"": -1}
        for name in node.inputs:
            slots.setdefault(name, len(slots) - 1)
        self.inner: list[_Inner] = []
        for inner in body.nodes:
            factory = lookup(inner.op_type, inner.domain, inner.opset)
            if factory is None or NEEDS.get(factory):
                raise OnnxRuntimeError(f"node {node.name!r} (FusedSegment): its node {inner.name!r} "
                                       f"({inner.op_type}) has no CPU kernel that runs on its inputs alone")
            for name in inner.outputs:
                slots.setdefault(name, len(slots) - 1)
            self.inner.append(_Inner(inner, factory, tuple(slots[n] for n in inner.inputs),
                                     tuple(slots[n] for n in inner.outputs)))
        self.slot_count = len(slots) - 1
        self.feeds = len(node.inputs)
        self.results = tuple(slots[name] for name in node.outputs)
        self.producers = {slot: inner for inner in self.inner for slot in inner.outputs}
        last_use: dict[int, int] = {}
        for index, inner in enumerate(self.inner):
            for slot in inner.inputs:
                if slot >= self.feeds:
                    last_use[slot] = index
        keep = set(self.results)
        for index, inner in enumerate(self.inner):
            inner.release = tuple(s for s, last in last_use.items() if last == index and s not in keep)
        self.name = node.name
        self.output_names = tuple(node.outputs)
        self.value_bytes = _ValueBytes(body)
        self.chunks: dict[tuple, _Chunks | None] = {}  # per signature weighed for chunks (None: not): see _chunk
        self.per_image: bool | None = None  # whether no node reads another image (None: not yet proved)
        # per signature: its plans (copies for concurrent callers), or None where it runs node by node
        self.plans: dict[tuple, list[BoundPlan] | None] = {}
        self.last: BoundPlan | None = None
        self.replanned: set[tuple] = set()
        # read-only inputs seen to change between runs (a feed from Arrow or a memory map): copied in like feeds
        self.fed: set[int] = set()
        self.fed_shared = False  # self.fed is the specializations' shared set (_shared_fed)
        self.waiting: dict[tuple, provisional.Ticket] = {}  # signatures left to the nodes by a provisional window
        self.lock = threading.Lock()  # planning

    def __call__(self, *inputs):
        plan = self.last  # the plan of the signature last run: usually this one's (one read: threads swap it)
        if plan is not None and plan.matches(inputs) and plan.lock.acquire(False):
            try:
                return plan.run(inputs)
            finally:
                plan.lock.release()
        return self._signature_run(inputs)

    def _signature_run(self, inputs):
        """A run of a signature other than the last one run: its plan, a plan made now, or its nodes."""
        key = tuple([(x.shape, x.dtype) if isinstance(x, np.ndarray) else None for x in inputs])
        plans = self.plans.get(key, ())
        if plans and not plans[0].fits(inputs):
            plans = self._other_constants(key, inputs, plans[0])
        if plans is None and self.waiting and key in self.waiting and self.waiting[key].settled():
            plans = self._drop(key)
        plans = self._plannable(key, plans, inputs)
        if isinstance(plans, _Chunks):
            return self._chunked_run(inputs, plans)
        if plans is None or deferred.numpy_first():
            return self._node_by_node(inputs, keep_all=False)[1]
        if plans and plans[0].ticket is not None and plans[0].ticket.settled():
            plans = self._drop(key)  # its misses are linked now: made again, once
        for plan in plans:
            if plan.lock.acquire(False):
                try:
                    if plan.ticket is not None:  # (never self.last: the fast path runs final plans)
                        return self._provisional_run(plan, inputs)
                    self.last = plan
                    return plan.run(inputs)
                finally:
                    plan.lock.release()
        if len(plans) < _COPIES:  # (none yet, or all busy: another copy, computing the same values)
            return self._plan_and_run(key, inputs)
        with plans[0].lock:
            return plans[0].run(inputs) if plans[0].ticket is None else self._provisional_run(plans[0], inputs)

    def _plannable(self, key, plans, inputs):
        """``plans``, or how the signature runs instead: in chunks of images where its plan would pass
        POOL_LIMIT_BYTES (_chunk: found so once planned, or before where its values would pass PLANNING_LIMIT_BYTES);
        else None from now on where they would pass PLANNING_LIMIT_BYTES (see the module doc)."""
        if plans:
            return plans
        if key in self.chunks:
            return self.chunks[key] or plans
        size, waiting = self.value_bytes(inputs), key in self.waiting
        if plans is not None and not waiting and size <= PLANNING_LIMIT_BYTES:
            return plans  # (planned at this run)
        chunks = self.chunks[key] = self._chunk(inputs, size) if size > POOL_LIMIT_BYTES and not waiting else None
        if chunks is None and size > PLANNING_LIMIT_BYTES:
            self.plans[key] = None
            return None
        return chunks or plans

    def _chunk(self, inputs, size: int) -> _Chunks | None:
        """How the batch of ``inputs``, whose values take ``size`` bytes, runs in chunks of images whose values take
        at most POOL_LIMIT_BYTES; None where it has one image, or one image's node-by-node run does not prove that
        no node reads another image (segment_split.per_image)."""
        from ..algorithms import segment_split
        from ..algorithms.segment_steps import is_constant

        feeds = [slot for slot in range(self.feeds) if not is_constant(self, slot, inputs[slot])]
        batch = inputs[feeds[0]].shape[0] if feeds and inputs[feeds[0]].ndim else 0
        images = max(1, batch * POOL_LIMIT_BYTES // size)
        if batch < 2 or images >= batch:
            return None
        if self.per_image is None:
            constants = set(range(self.feeds)) - set(feeds)
            env, _ = self._node_by_node(segment_split.sliced(inputs, feeds, 0, 1), keep_all=True)
            self.per_image = segment_split.batch_of(self, env, constants) == 1 \
                and segment_split.per_image(self, env, constants)
        return _Chunks(tuple(feeds), images) if self.per_image else None

    def _chunked_run(self, inputs, chunk: _Chunks):
        """The batch's outputs from runs of ``chunk``'s images at a time (each range a signature of its own, planned
        as any), joined along the batch."""
        from ..algorithms.segment_split import sliced

        feeds, images = chunk
        batch = inputs[feeds[0]].shape[0]
        parts = [self(*sliced(inputs, feeds, start, min(start + images, batch)))
                 for start in range(0, batch, images)]
        return tuple(np.concatenate(outputs) for outputs in zip(*parts))

    def _provisional_run(self, plan, inputs):
        """A provisional plan's run: a step whose loop would compile here serves this run node by node."""
        try:
            with deferred.Trial():
                return plan.run(inputs)
        except deferred.WouldCompile:
            return self._node_by_node(inputs, keep_all=False)[1]

    def _drop(self, key) -> tuple:
        """Forget the signature's provisional plans or its provisional None, to plan it again."""
        with self.lock:
            current = self.plans.get(key, ())
            if (current is None and key in self.waiting) or (current and current[0].ticket is not None):
                self.plans.pop(key, None)
                self.waiting.pop(key, None)
        return ()

    def settle(self) -> tuple[bool, bool]:
        """(made again, still provisional): every provisional plan or None whose misses are settled made again
        from the inputs its window ran (provisional.settle_held, called by deferred.wait_ready)."""
        remade = still = False
        for key, plans in list(self.plans.items()):
            ticket = self.waiting.get(key) if plans is None else plans[0].ticket if plans else None
            if ticket is None:
                continue
            if not ticket.settled():
                still = True
                continue
            self._drop(key)
            remade = True
            with provisional.watching() as seen:
                try:  # in a Trial: a node's call that misses the cache is the loader's, not this thread's, to compile
                    with deferred.Trial():
                        self._plan_and_run(key, list(ticket.inputs))
                except deferred.WouldCompile:
                    pass
                except OnnxRuntimeError:  # (as it ran before: its next run says so)
                    continue
            if key not in self.plans and seen:  # (stopped at a miss: made again after the round that links it)
                waiting = provisional.Ticket(frozenset(seen))
                waiting.inputs = ticket.inputs
                with self.lock:
                    if self.plans.setdefault(key, None) is None:
                        self.waiting[key] = waiting
            again = self.plans.get(key)
            still = still or key in self.waiting or bool(again and again[0].ticket is not None)
        return remade, still

    def _other_constants(self, key, inputs, plan):
        """A read-only input is not the array the plan was bound to: a read-only feed (Arrow, a memory map) or
        weights fed as an input. Those inputs are copied in like feeds from then on, planned anew; a signature
        whose constants still change runs node by node from then on (None is kept)."""
        changed = {slot for slot, value, bound in zip(plan.constant_slots, plan.constant_values(inputs),
                                                      plan.constants) if value is not bound}
        if changed - self.fed:
            self.fed |= changed
            self.plans.pop(key, None)
            return ()
        if key in self.replanned:
            self.plans[key] = None
            return None
        self.replanned.add(key)
        self.plans.pop(key, None)
        return ()

    def _node_by_node(self, inputs, keep_all: bool):
        token = SEGMENT_NODES.set(True)  # (its convolutions chosen as a segment plan runs them)
        try:
            return self._each_node(inputs, keep_all)
        finally:
            SEGMENT_NODES.reset(token)

    def _each_node(self, inputs, keep_all: bool):
        env: list = [None] * self.slot_count
        env[:self.feeds] = inputs
        for inner in self.inner:
            values = [None if s < 0 else env[s] for s in inner.inputs]
            try:
                results = inner.kernel(values)(*values)
            except OnnxRuntimeError as exc:
                message = str(exc)
                if inner.node.name not in message:
                    message = f"node {inner.node.name!r} ({inner.node.op_type}): {message}"
                raise type(exc)(f"{message} (a node of segment {self.name!r})") from exc
            for slot, value in zip(inner.outputs, results):
                env[slot] = value
            if not keep_all:
                for slot in inner.release:
                    env[slot] = None
        return env, tuple(env[s] for s in self.results)

    def _plan_and_run(self, key, inputs):
        """Plan this signature (another copy where its plans are busy) from a node-by-node run of ``inputs``,
        check the plan against it, and return the plan's outputs: every run of a planned signature gives the
        plan's values, whichever copy and however many threads. A plan that cannot be made or disagrees leaves
        the signature to the nodes for good (made while fallbacks served: until those misses settle)."""
        if not self.fed_shared:
            self.fed, self.fed_shared = _shared_fed(self, inputs), True
        with provisional.watching() as seen:  # fallbacks served while it is made: a provisional plan
            with ReferenceRun():  # (its per-node compiled code is never called again: numpy's paths serve it)
                env, outputs = self._node_by_node(inputs, keep_all=True)
            plan, outputs = self._made_plan(env, inputs, outputs)
        ticket = provisional.ticket(seen)
        if plan is False and ticket is None:  # (a miss the child gave up on: tried again at the next run)
            return outputs
        plan = plan or None
        if ticket is not None:
            ticket.inputs = tuple(x.copy() if isinstance(x, np.ndarray) and x.flags.writeable else x for x in inputs)
            provisional.hold(self)
            if plan is not None:
                plan.ticket = ticket
        with self.lock:
            if len(self.plans) >= _SIGNATURES and key not in self.plans:
                self.plans.clear()
                self.waiting.clear()
                self.last = None
            plans = self.plans.get(key, [])
            if plan is None:
                if not plans:
                    self.plans[key] = None
                    if ticket is not None:
                        self.waiting[key] = ticket
            else:
                self.plans[key] = [*(plans or []), plan]
                if ticket is None:
                    self.last = plan
        return outputs

    def _made_plan(self, env, inputs, outputs):
        """(plan, outputs): a batch split into image ranges where that applies, else the batch's plan."""
        plan, planned = self._split_plan(env, inputs, outputs)
        return (plan, planned) if plan is not None else self._checked_plan(env, inputs, outputs)

    def _split_plan(self, env, inputs, outputs):
        """(plan, outputs) as _checked_plan's, for a batch whose images run in parallel ranges
        (algorithms/segment_split.py); (None, outputs) where that does not apply: one thread, one image, a value
        that does not keep the batch first, a node not proved to read its own image only, a range whose plan does
        not start with a chained call."""
        if kernel_threads() < 2:
            return None, outputs
        from ..algorithms import segment_split
        from ..algorithms.segment_steps import is_constant

        constants = {slot for slot in range(self.feeds) if is_constant(self, slot, inputs[slot])}
        feeds = [slot for slot in range(self.feeds) if slot not in constants]

        batch = segment_split.batch_of(self, env, constants)
        if batch < 2 or not feeds or segment_split.part_count(batch) < 2 \
                or not segment_split.per_image(self, env, constants):
            return None, outputs

        def reference(part_inputs):
            with ReferenceRun():
                return self._node_by_node(part_inputs, keep_all=True)

        try:
            with deferred.Trial():  # (a loop or the job's runner that numba's cache misses: the plan of the whole)
                try:
                    plan = segment_split.build_split(self, inputs, feeds, batch, reference,
                                                     lambda env: build_plan(self, env, POOL_LIMIT_BYTES))
                except OnnxRuntimeError:
                    return None, outputs
                if plan is None:
                    return None, outputs
                from ..compiled.conv_chain import CHAIN

                CHAIN.address()
                with plan.lock:
                    planned = plan.run(inputs)
        except deferred.WouldCompile:
            return None, outputs
        if self._agree(env, planned, outputs):
            return plan, planned
        return None, outputs

    def _agree(self, env, planned, outputs) -> bool:
        """Whether a plan's outputs match the node-by-node run's (_close), over what each holds: a result that a
        Concat's part writes (a convolution into its channels, conv_fusions.fuse_concat_convs) holds the
        channels up to its own, the later parts' still unset (whatever the buffer held)."""
        for slot, a, b in zip(self.results, planned, outputs):
            inner = self.producers.get(slot)
            weights = env[inner.inputs[1]] if inner is not None and concat_part(inner.node) else None
            if weights is not None and isinstance(a, np.ndarray) and a.ndim > 1 and a.shape == getattr(b, "shape", ()):
                end = int(inner.node.attr("concat_offset")) + weights.shape[0]
                a, b = a[:, :end], b[:, :end]
            if not _close(a, b):
                return False
        return True

    def _checked_plan(self, env, inputs, outputs):
        """(plan, outputs): the plan built from ``env`` and its outputs for ``inputs`` where they match the
        node-by-node ``outputs``; (None, outputs) where it cannot be made or disagrees, (False, outputs) where it
        would compile here."""
        try:
            with deferred.Trial():  # a loop numba's cache misses: planned again once the loader has it
                try:
                    plan = build_plan(self, env, POOL_LIMIT_BYTES)
                except OnnxRuntimeError:
                    return None, outputs
                if plan is None:
                    return None, outputs
                with plan.lock:
                    planned = plan.run(inputs)
        except deferred.WouldCompile:  # (its check would compile: the nodes serve until the misses settle)
            return False, outputs
        if self._agree(env, planned, outputs):
            return plan, planned
        return None, outputs


def build_plan(segment, env, limit_bytes):
    """algorithms/segment_steps.build_plan, imported at a process's first plan: a segment plans only once numba
    serves, so the first runs never load the builder and its modules."""
    from ..algorithms.segment_steps import build_plan as build

    return build(segment, env, limit_bytes)


def _close(a, b) -> bool:
    """Whether the plan's output ``a`` matches the node-by-node run's ``b``: the same shape and dtype, and
    values within float rounding (a prepared call may sum in another order than the node's kernel)."""
    if not isinstance(a, np.ndarray) or not isinstance(b, np.ndarray) or a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.kind != "f":
        return bool(np.array_equal(a, b))
    scale = float(np.max(np.abs(b), initial=0.0)) if b.size else 0.0
    return bool(np.allclose(a, b, rtol=1e-3, atol=1e-4 * max(scale, 1e-30), equal_nan=True))


@register("FusedSegment", domain=FUSED_DOMAIN, since=1, hints=("graph", "config"))
def fused_segment(node, shapes, opset, graph=None, config=None):
    """The nodes of ``body`` in order, over the node's inputs (see the module doc)."""
    segment = Segment(node)
    if graph is not None and (config or {}).get(DATA_INPUTS_KEY, "0") == "1":
        data = {v.name for v in graph.inputs if v.name not in graph.initializers}
        slots: dict[str, int] = {}
        for name in node.inputs:  # (numbered as Segment numbers its input slots)
            slots.setdefault(name, len(slots))
        segment.fed.update(slot for name, slot in slots.items() if name in data)
    return segment

