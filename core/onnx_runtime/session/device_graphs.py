"""Device-graph capture and replay, for sessions that enable it.

Enable it with ``SessionOptions.add_session_config_entry("session.graph_capture", "1")``. Which steps of a
plan are captured, and which run eagerly in the *seams* between the captured *segments*, is planned by
:mod:`.device_graph_regions`: the nodes of one device provider with device graphs, except those that read
run-time values on the host, fail its ``plan_capture_region`` policy or have kernels marked
``capturable = False``. A plan whose every step is captured is one graph (any provider with device graphs
replays it, as it does one segment with seams only before or after it); seams between segments need a provider
that replays graph segments one by one (``replay_device_graph_segment``).

Per signature of the feeds (:func:`device_graph_key`: names, shapes, dtypes, addresses of device feeds):

1. The first run is eager, while a recorder follows the provider's allocations to size an *arena*:
   one device allocation that will hold every buffer the captured segments allocate.
2. The second run captures: the feeds are uploaded into persistent input buffers, then each segment's
   kernels run inside ``begin/end_owned_device_graph_capture`` (later segments continue the first one's
   token), each allocation served from the arena (frees return blocks of the same size for reuse), so every
   buffer a graph touches keeps its address for as long as the graph lives. Nothing executes during a
   capture: each segment is launched right after it is recorded, and the seam after it runs eagerly on what
   it computed. A seam value a later segment reads is copied into a persistent (*pinned*) buffer.
3. Later runs copy the feeds into the persistent inputs, launch the segments with the seams between them
   (reading segment values at their arena addresses, pinning what they give back), and download outputs.

IO-bound runs (:meth:`DeviceGraphRunner.run_plan`) may feed Tensors already on the device: those are not
copied into persistent inputs but captured where they are, so their addresses are part of the signature
(a bound buffer whose address stays the same replays; another address is another signature). Outputs the
binding keeps on the device are handed out as device copies of the arena's, which the next replay rewrites.

Tails. A bound run may offer a tail (session/device_step.py: the writes of its outputs into their bindings and
an epilogue such as a decode step's KV moves, argmax and token writer). Where the last segment ends the run and
produces every output, the tail is recorded into that segment after its kernels, the tail's key joins the
signature, and each replay runs it inside the graph; elsewhere the caller runs it after the run.

Slots. A run is captured in the slot its caller names (``PRIMARY``, the decode step, by default; ``VERIFY``
for a multi-token verification step, selected by the run option :data:`.executor.GRAPH_SLOT_KEY`). Each slot
keeps its own signatures, at most ``MAX_GRAPHS`` each (the least recently used one is dropped: graph reset,
owner retired, arena freed), so verification steps never evict the decode step's graph. A provider that owns
only the PRIMARY slot refuses a VERIFY capture: those runs stay eager and the decode graph stays installed.

A run that cannot be captured runs eagerly and says why in :attr:`DeviceGraphRunner.status` (the session's
``device_graph_status()``); :attr:`DeviceGraphRunner.counts` counts captures, replays and segments. A capture
that fails (a kernel synchronizing with the host, say) is abandoned for that signature, with the error as the
reason; a kernel chosen for the run's shapes that refuses capture becomes a seam at the next capture. A graph the
provider resets as its capture ends (a release the capture held, of memory the graph recorded) is captured again at
the next run, unless that happened at every capture so far.

Each captured signature is its own :class:`DeviceGraphOwner`, so graphs of different signatures never
replace each other on a provider that keeps a graph per owner. On one that holds a single graph per slot
(the contract's defaults over the slot hooks), a capture replaces the graph of the signature before; that
signature's token then reports its graph gone, and its next run is captured afresh instead of replaying
another signature's graph. Validation submissions work as in eager runs: a graph captured during a
submission keeps raising flags into the executor's validation word at every replay.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..contract.buffers import DeviceBuffer, Ownership
from ..contract.graphs import DeviceGraphOwner, DeviceGraphSlot, DeviceGraphToken
from ..contract.markers import hookimpl
from ..dtypes import DataType
from ..errors import KernelError, OnnxRuntimeError
from ..provider_handle import ProviderHandle
from ..tensor import Tensor
from . import device_step
from .device_graph_regions import Region, RegionPlanner
from .io_binding import copy_on_device
from .steps import Plan, ShapeKeyedKernel, Step, Steps, Uploader, run_steps, shape_of, to_host

if TYPE_CHECKING:
    from .executor import Executor

MAX_GRAPHS = 8
MAX_CAPTURE_ATTEMPTS = 3  # an arena that turns out too small is grown and the capture retried this often
_ARENA_ALIGNMENT = 256


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class _Layout:
    """Offsets for a sequence of allocations and frees: a freed block is reused by the next request of the
    same rounded size, else the arena grows at its top. ``top`` is the extent needed so far."""

    def __init__(self):
        self.top = 0
        self._free: dict[int, list[int]] = {}

    def allocate(self, size: int, alignment: int) -> tuple[int, int]:
        alignment = max(alignment, _ARENA_ALIGNMENT)
        rounded = _round_up(max(size, 1), _ARENA_ALIGNMENT)
        for index, offset in enumerate(self._free.get(rounded, ())):
            if offset % alignment == 0:
                return self._free[rounded].pop(index), rounded
        offset = _round_up(self.top, alignment)
        self.top = offset + rounded
        return offset, rounded

    def free(self, offset: int, rounded: int) -> None:
        self._free.setdefault(rounded, []).append(offset)


class _ArenaExhausted(OnnxRuntimeError):
    """The capture needed more arena than the eager run suggested."""


class _GraphReset(OnnxRuntimeError):
    """The provider reset a graph just recorded: a release the capture held (a free, the end of a borrow) ran when
    it ended and reset the graph that recorded the address, or another thread reset it."""


class _NotCapturable(KernelError):
    """A kernel (chosen for the run's shapes) is marked ``capturable = False``."""


@dataclass(eq=False)
class _Block:
    arena: _Arena
    offset: int
    rounded: int


class _Arena:
    """One device allocation carved into the buffers of a captured run."""

    def __init__(self, handle: ProviderHandle, capacity: int):
        self.handle = handle
        self.capacity = capacity
        self.backing = handle.allocate(max(capacity, 1), _ARENA_ALIGNMENT)
        self.layout = _Layout()
        self.closed = False

    def allocate(self, size: int, alignment: int) -> DeviceBuffer:
        offset, rounded = self.layout.allocate(size, alignment)
        if offset + rounded > self.capacity:
            raise _ArenaExhausted(f"the capture needed more than the {self.capacity}-byte arena the eager run sized")
        return DeviceBuffer(self.handle.device_id, size, max(alignment, 1), self.backing.ptr + offset,
                            Ownership.OWNED, provider_state=_Block(self, offset, rounded))

    def free(self, block: _Block) -> None:
        if not self.closed:
            self.layout.free(block.offset, block.rounded)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.handle.deallocate(self.backing)


class _ArenaServer:
    """Plugin on the device provider's handle: while ``arena`` is set (a capture is recording),
    allocations come from it; frees of arena blocks go back to their arena and never reach the provider.

    A provider buffer freed during a capture (say, by the garbage collector) is freed after it instead:
    a stream-ordered free issued inside the capture would become part of the graph and repeat at every
    replay."""

    def __init__(self):
        self.arena: _Arena | None = None
        self.deferred: list[DeviceBuffer] = []

    @hookimpl(tryfirst=True)
    def allocate(self, size, alignment):
        arena = self.arena
        return None if arena is None else arena.allocate(size, alignment)

    @hookimpl(tryfirst=True)
    def deallocate(self, buffer):
        block = buffer.provider_state
        if type(block) is _Block:
            block.arena.free(block)
            return True
        if self.arena is not None:  # the handle marks `buffer` released: keep what freeing it needs
            self.deferred.append(DeviceBuffer(buffer.device, buffer.size, buffer.alignment, buffer.ptr,
                                              buffer.ownership, provider_state=buffer.provider_state))
            return True
        return None

    def stop(self, handle: ProviderHandle) -> None:
        """The capture ended: serve no more, and free what was freed during it."""
        self.arena = None
        deferred, self.deferred = self.deferred, []
        for buffer in deferred:
            handle.hook.deallocate(buffer=buffer)


class _AllocationRecorder:
    """Plugin on the device provider's handle during the sizing run: lays out what it sees like the arena."""

    def __init__(self):
        self.layout = _Layout()
        self._blocks: dict[int, tuple[int, int]] = {}

    @hookimpl(wrapper=True)
    def allocate(self, size, alignment):
        buffer = yield
        if isinstance(buffer, DeviceBuffer):
            self._blocks[buffer.ptr] = self.layout.allocate(size, alignment)
        return buffer

    @hookimpl(wrapper=True)
    def deallocate(self, buffer):
        block = self._blocks.pop(buffer.ptr, None)
        if block is not None:
            self.layout.free(*block)
        return (yield)


class _SeamChanged(OnnxRuntimeError):
    """A seam value a segment reads changed type or shape between runs of one signature."""


@dataclass(eq=False)
class _Pin:
    """The persistent buffer on the region's provider that a seam value a segment reads is copied into."""

    handle: ProviderHandle
    label: str
    tensor: Tensor | None = None

    def store(self, value) -> Tensor:
        handle = self.handle
        on_device = isinstance(value, Tensor) and value.device == handle.device_id
        if on_device:
            dtype, shape = value.dtype, value.shape
        else:
            value = np.ascontiguousarray(to_host(value))
            dtype, shape = DataType.from_numpy(value.dtype), value.shape
        tensor = self.tensor
        if tensor is None:
            tensor = self.tensor = Tensor.empty(dtype, shape, handle)
        elif tensor.dtype is not dtype or tensor.shape != tuple(shape):
            raise _SeamChanged(
                f"{self.label} gave {dtype.ort_type} {list(shape)} where the captured graph reads "
                f"{tensor.dtype.ort_type} {list(tensor.shape)} (a shape that depends on data)"
            )
        if tensor.nbytes:
            if on_device:
                copy_on_device(handle, value.buffer, tensor.buffer, tensor.nbytes)
            else:
                handle.copy_from_host(value, tensor.buffer)
        return tensor

    def close(self) -> None:
        if self.tensor is not None:
            self.tensor.close()
            self.tensor = None


class _Pinning:
    """A seam step whose outputs at ``pins`` (output index, pin) go to persistent buffers."""

    __slots__ = ("run", "pins")

    def __init__(self, run, pins: list[tuple[int, _Pin]]):
        self.run, self.pins = run, pins

    def __call__(self, *inputs):
        if isinstance(self.run, Uploader):  # straight into the pin, without a buffer of its own
            return (self.pins[0][1].store(inputs[0]),)
        results = list(self.run(*inputs))
        for index, pin in self.pins:
            # A host value a device provider's kernel returned (its shape computations: the same at every run of
            # the signature) is read on the host by that provider's kernels, baked into the captured launches.
            if isinstance(results[index], Tensor):
                results[index] = pin.store(results[index])
        return results


@dataclass(eq=False)
class _Run:
    """One run's plan, feeds and output conversion (the executor's), as the runner passes them along."""

    plan_key: tuple
    plan: Plan
    feeds: dict
    convert: Callable[[Any], Any]
    copied: frozenset[int] = frozenset()  # output positions the caller copies out before the next run
    tail: device_step.CapturedTail | None = None

    def eager(self, executor: Executor) -> list:
        return executor.run_plan(self.plan, self.feeds, None, self.convert)


@dataclass(eq=False)
class _Entry:
    """One captured feed signature, in one slot."""

    region: Region
    owner: DeviceGraphOwner
    slot: DeviceGraphSlot
    arena_bytes: int
    forced: frozenset[str] = frozenset()  # nodes whose kernel for these shapes turned out not capturable
    attempts: int = 0
    resets: int = 0  # captures whose graph the provider reset before their first launch
    failure: str = ""
    token: DeviceGraphToken | None = None
    arena: _Arena | None = None
    inputs: list[tuple[str, int, Tensor]] = field(default_factory=list)  # (feed, slot, persistent input)
    outputs: dict[int, Tensor] = field(default_factory=dict)  # segment slot -> arena tensor, kept to the end
    views: dict[int, Tensor] = field(default_factory=dict)  # segment slot a seam reads -> view of its arena block
    parts: list[tuple[bool, Steps]] = field(default_factory=list)  # the schedule, seams pinning
    pins: list[_Pin] = field(default_factory=list)
    tail: bool = False  # the bound run's tail (device_step) is in the graph

    @property
    def handle(self) -> ProviderHandle:
        return self.region.handle


def device_graph_key(plan_key: tuple, plan: Plan, feeds: dict) -> tuple | None:
    """The key a run's device graph is kept under (within its slot): the plan, and per feed its name, shape and
    dtype; a feed already on the device (IO binding) is captured where it is, so its address too. None when a
    feed is not a tensor."""
    signature: list[tuple] = []
    for name, value in feeds.items():
        if isinstance(value, np.ndarray):
            signature.append((name, value.shape, value.dtype.str))
        elif isinstance(value, Tensor) and name in plan.device_feeds:
            signature.append((name, value.shape, value.dtype.name, value.device_ptr))
        else:
            return None
    return (plan_key, tuple(sorted(signature)))


class DeviceGraphRunner:
    """Captures and replays the runs of one :class:`Executor` (see the module docstring)."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.status = "eager: no run yet"
        self.captures = 0  # signatures captured
        self.replays = 0  # runs that replayed graphs (the capturing runs included)
        self.segment_captures = 0  # graph segments recorded
        self.segment_replays = 0  # graph segments launched
        self.seam_steps = 0  # steps run eagerly between segments
        self._planner = RegionPlanner(executor)
        self._regions: dict[tuple, Region | str] = {}  # (plan key, forced seams) -> region
        self._entries: dict[DeviceGraphSlot, OrderedDict[tuple, _Entry]] = {s: OrderedDict() for s in DeviceGraphSlot}
        self._server = _ArenaServer()
        self._handles: dict[int, ProviderHandle] = {}  # the handles the arena server is registered on

    @property
    def counts(self) -> dict[str, int]:
        """Captures and replays so far: signatures, graph segments, and steps run eagerly in seams."""
        return {"captures": self.captures, "replays": self.replays, "segment_captures": self.segment_captures,
                "segment_replays": self.segment_replays, "seam_steps": self.seam_steps}

    def _region(self, plan_key: tuple, plan: Plan, forced: frozenset[str] = frozenset()) -> Region | str:
        region = self._regions.get((plan_key, forced))
        if region is None:
            region = self._regions[(plan_key, forced)] = self._planner.analyze(plan, forced)
        return region

    # -- running ------------------------------------------------------------------------------------
    def run(self, feeds: dict, output_names: tuple[str, ...], slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY
            ) -> list | None:
        """This run's outputs through device graphs, or None when it must run eagerly (see ``status``)."""
        return self.run_plan(feeds, output_names, self.executor.plan(output_names), to_host, slot)

    def run_plan(self, feeds: dict, plan_key: tuple, plan: Plan, convert: Callable[[Any], Any],
                 slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY, copied: frozenset[int] = frozenset()
                 ) -> list | None:
        """:meth:`run` for any of the executor's plans (``plan_key`` names it); ``convert`` is the executor's
        conversion of output values that pass straight through or come out of a seam. ``slot`` is the slot the
        graphs are captured in: each slot keeps its own signatures, so one never evicts the other's. ``copied``:
        positions of outputs the caller copies elsewhere before the next run, handed out as views of the arena
        rather than copies of it."""
        tail = device_step.take()  # taken whatever happens: an eager run leaves it to its caller
        region = self._region(plan_key, plan)
        if isinstance(region, str):
            self.status = f"eager: {region}"
            return None
        key = device_graph_key(plan_key, plan, feeds)
        if key is None:
            self.status = "eager: a feed is not a tensor"
            return None
        if tail is not None:  # what its launches bake makes another graph
            key = (*key, tail.key)
        entries = self._entries[slot]
        run = _Run(plan_key, plan, feeds, convert, copied, tail)
        entry = entries.get(key)
        if entry is None:
            return self._size(slot, key, region, run)
        entries.move_to_end(key)
        if entry.failure:
            self.status = f"eager: {entry.failure}"
            return None
        if entry.token is None:
            return self._capture(entry, run)
        if not entry.handle.hook.has_owned_device_graph(token=entry.token):
            self._drop(slot, key)  # reset out of band (e.g. by the provider): capture these shapes afresh
            return self._size(slot, key, region, run)
        return self._replay(slot, key, entry, run)

    def _size(self, slot: DeviceGraphSlot, key: tuple, region: Region, run: _Run) -> list:
        self._attach(region.handle)
        recorder = _AllocationRecorder()
        region.handle.pm.register(recorder, name=f"device-graph-sizing-{id(recorder)}")
        try:
            outputs = run.eager(self.executor)
        finally:
            region.handle.pm.unregister(recorder)
        entries = self._entries[slot]
        entries[key] = _Entry(region, DeviceGraphOwner.new(), slot, recorder.layout.top)
        while len(entries) > MAX_GRAPHS:
            self._drop(slot, next(iter(entries)))
        self.status = "eager: warming up (the next run with these feed shapes is captured)"
        return outputs

    def _attach(self, handle: ProviderHandle) -> None:
        if id(handle) not in self._handles:
            handle.pm.register(self._server, name=f"device-graph-arena-{id(self)}")
            self._handles[id(handle)] = handle

    def _schedule(self, entry: _Entry) -> list[tuple[bool, Steps]]:
        """The entry's parts as its runs execute them: segments guarded, seams storing pinned values."""
        region, parts = entry.region, []
        makers = {slot: step.node for part in region.parts for step in part.steps for slot in step.outputs}
        for part in region.parts:
            if part.captured:
                parts.append((True, Steps([_guarded(step) for step in part.steps])))
                continue
            steps = []
            for step in part.steps:
                pins = []
                for index, slot in enumerate(step.outputs):
                    if slot in region.pins:  # named after the node that computed the value (a copy moves it)
                        node = step.node or (makers.get(step.inputs[0]) if step.inputs else None)
                        label = f"node {node.name!r} ({node.op_type})" if node is not None else step.provider
                        pins.append((index, _Pin(region.handle, label)))
                entry.pins.extend(pin for _index, pin in pins)
                run = _Pinning(step.run, pins) if pins else step.run
                steps.append(Step(run, step.inputs, step.outputs, step.release, step.node, step.provider))
            parts.append((False, Steps(steps)))
        return parts

    def _capture(self, entry: _Entry, run: _Run) -> list:
        region, handle = entry.region, entry.handle
        plan, feeds = run.plan, run.feeds
        entry.attempts += 1
        submissions = self.executor.begin_validation(run.plan)
        env = _env(plan, feeds)
        seam_reads = {slot for part in region.parts if not part.captured for step in part.steps
                      for slot in step.inputs if slot in region.produced}
        token, arena, failure, segment = None, None, None, 0
        try:
            for name, slot in region.uploads:
                tensor = Tensor.from_numpy(np.ascontiguousarray(feeds[name]), provider=handle)
                entry.inputs.append((name, slot, tensor))
                env[slot] = tensor
            arena = _Arena(handle, entry.arena_bytes)
            entry.parts = self._schedule(entry)
            last = len(entry.parts) - 1
            entry.tail = run.tail is not None and _tail_capturable(entry, plan)
            for index, (captured, steps) in enumerate(entry.parts):
                if not captured:
                    run_steps(steps, env)
                    continue
                self._server.arena = arena
                token = handle.hook.begin_owned_device_graph_capture(
                    owner=entry.owner, slot=entry.slot, continuation=token if segment else None,
                    kernels=[step.run for step in steps.steps])
                try:
                    with handle.prepaid():  # blocks carved from the arena, whose backing is charged already
                        run_steps(steps, env)
                        if entry.tail and index == last:
                            assert run.tail is not None
                            run.tail.run([env[slot] for slot in plan.output_slots])
                    handle.hook.end_owned_device_graph_capture(token=token)
                finally:
                    self._server.stop(handle)  # the stream is idle: frees deferred during the capture may run
                entry.token = token
                self.segment_captures += 1
                self._launch_captured(entry, segment)  # the seams after it read what it computes
                entry.views.update((slot, _view(env[slot])) for step in steps.steps for slot in step.outputs
                                   if slot in seam_reads)
                segment += 1
        except BaseException as exc:  # an interrupt too: the stream must not stay in capture mode
            failure = exc
            self._server.stop(handle)
            if token is not None:
                handle.hook.abort_owned_device_graph_capture(token=token)
                handle.hook.reset_owned_device_graph(token=token)
        if failure is None:
            entry.arena, entry.resets = arena, 0
            entry.outputs = {slot: env[slot] for slot in {*plan.output_slots, *region.downloads.values()}
                             if slot in region.produced}
            self.captures += 1
            return self._finish(entry, run, env, submissions)
        env.clear()  # arena blocks go back before the arena goes
        entry.token, entry.tail = None, False
        self._release(entry, arena)
        if not isinstance(failure, Exception):
            raise failure
        if submissions:
            self.executor.abort_validation(submissions, failure)
        self._capture_failed(entry, run, failure)
        del failure
        return run.eager(self.executor)

    def _launch_captured(self, entry: _Entry, index: int) -> None:
        """Launch a segment just recorded; :class:`_GraphReset` where the provider reset its graph since."""
        hook = entry.handle.hook
        if hook.has_owned_device_graph(token=entry.token):
            try:
                self._launch_segment(entry, index)
                return
            except Exception as exc:
                if hook.has_owned_device_graph(token=entry.token):
                    raise
                raise _GraphReset(f"the provider reset the graph it had just recorded ({exc})") from exc
        raise _GraphReset("the provider reset the graph as its capture ended (a release the capture held, of "
                          "memory the graph recorded)")

    def _capture_failed(self, entry: _Entry, run: _Run, failure: Exception) -> None:
        if isinstance(failure, _GraphReset):
            # Says nothing against capturing these shapes: the next run captures them again, unless every
            # capture so far was reset.
            entry.attempts -= 1
            entry.resets += 1
            if entry.resets < MAX_CAPTURE_ATTEMPTS:
                self.status = f"eager: {failure}; the next run captures again"
                return
            entry.failure = f"{failure}, at each of its {entry.resets} captures"
            self.status = f"eager: {entry.failure}"
            return
        if isinstance(failure, _ArenaExhausted) and entry.attempts < MAX_CAPTURE_ATTEMPTS:
            entry.arena_bytes = max(2 * entry.arena_bytes, 1 << 20)
            self.status = "eager: the capture arena was too small; it is grown and the next run captures again"
            return
        step = getattr(failure, "step", None)  # set when a step failed (see node_error)
        if isinstance(failure, _NotCapturable) and step is not None and entry.attempts < MAX_CAPTURE_ATTEMPTS:
            # A kernel chosen for these shapes refuses capture: the next run captures around it, as a seam.
            if self._with_seams(entry, run, frozenset({step.node.name}),
                                f"eager: {failure.__cause__}; the next run captures the segments around it"):
                return
        elif step is not None and step.node is not None and step.node.name in self._planner.fixed_readers \
                and not entry.forced >= self._planner.fixed_readers and entry.attempts < MAX_CAPTURE_ATTEMPTS:
            # A node reading a value the feed shapes fix failed the capture (its provider computed the value on
            # the device, and reading it synchronized): every such node runs as a seam from now on.
            if self._with_seams(entry, run, self._planner.fixed_readers,
                                f"eager: {failure}; the next run captures with the nodes reading shapes as seams"):
                return
        elif isinstance(failure, _NotCapturable):
            entry.failure = str(failure.__cause__)  # the guard's words, not the node error restating them
        else:
            where = f" at node {step.node.name!r}" if step is not None and step.node is not None else ""
            entry.failure = f"capture failed{where}: {type(failure).__name__}: {failure}"
        self.status = f"eager: {entry.failure}"

    def _with_seams(self, entry: _Entry, run: _Run, nodes: frozenset[str], status: str) -> bool:
        """Plan the next capture with ``nodes`` run eagerly as seams (``status`` says so); False, with
        ``entry.failure`` set to the reason, where no capturable region is left."""
        entry.forced = entry.forced | nodes
        region = self._region(run.plan_key, run.plan, entry.forced)
        if isinstance(region, Region):
            entry.region = region
            self.status = status
            return True
        entry.failure = region
        return False

    def _launch_segment(self, entry: _Entry, index: int) -> None:
        if entry.region.segments == 1:  # one graph, seams or not: any provider with device graphs replays it
            entry.handle.hook.replay_owned_device_graph(token=entry.token)
        else:
            entry.handle.hook.replay_owned_device_graph_segment(token=entry.token, index=index)
        self.segment_replays += 1

    def _replay(self, slot: DeviceGraphSlot, key: tuple, entry: _Entry, run: _Run) -> list:
        handle = entry.handle
        submissions = self.executor.begin_validation(run.plan)
        env = _env(run.plan, run.feeds)
        env_update = env.__setitem__
        segment = 0
        try:
            for name, slot_index, tensor in entry.inputs:
                handle.copy_from_host(np.ascontiguousarray(run.feeds[name]), tensor.buffer)
                env_update(slot_index, tensor)
            for slot_index, view in entry.views.items():
                env_update(slot_index, view)
            for captured, steps in entry.parts:
                if captured:
                    self._launch_segment(entry, segment)
                    segment += 1
                else:
                    run_steps(steps, env)
                    self.seam_steps += len(steps.steps)
        except Exception as exc:
            if submissions:
                self.executor.abort_validation(submissions, exc)
            if not handle.hook.has_owned_device_graph(token=entry.token):
                # Reset since the check in run_plan, by another thread (a free of memory the graph recorded): the
                # segments launched wrote only arena blocks (a tail is in the last one), so this run goes eagerly
                # and the next captures these shapes afresh.
                self._drop(slot, key)
                return self._size(slot, key, entry.region, run)
            if not isinstance(exc, _SeamChanged):
                raise
            entry.failure = f"{exc.__cause__ or exc}: these feed shapes run eagerly"
            self._drop(slot, key)
            self._entries[slot][key] = entry  # remembered, with its reason, so it is not captured again
            self.status = f"eager: {entry.failure}"
            return run.eager(self.executor)
        return self._finish(entry, run, env, submissions)

    def _finish(self, entry: _Entry, run: _Run, env: list, submissions: list) -> list:
        """The outputs, once every part ran: downloads after the last part, kept outputs as device copies."""
        plan, region = run.plan, entry.region
        try:
            if submissions:
                self.executor.activate_validation(submissions)
            outputs = []
            for index, slot in enumerate(plan.output_slots):
                if slot in region.downloads:
                    device_slot = region.downloads[slot]
                    outputs.append(to_host(entry.outputs.get(device_slot, env[device_slot])))
                elif slot in entry.outputs:  # the arena's buffer is rewritten by the next replay: hand out a copy
                    tensor = entry.outputs[slot]
                    outputs.append(_view(tensor) if index in run.copied else _device_copy(tensor))
                else:  # a feed or a constant passed straight through, or a seam's value
                    outputs.append(run.convert(env[slot]))
        except Exception as exc:
            if submissions:
                self.executor.abort_validation(submissions, exc)
            raise
        finally:
            env.clear()
        if submissions:
            self.executor.settle_validation(submissions)
        if entry.tail and run.tail is not None:
            run.tail.captured = True
        self.replays += 1
        n = entry.region.segments
        self.status = "replaying" if len(entry.parts) == 1 else (
            f"replaying {n} graph segment{'s' if n > 1 else ''} with eager seams ({entry.region.seam_reason})")
        return outputs

    # -- teardown -----------------------------------------------------------------------------------
    def _release(self, entry: _Entry, arena: _Arena | None) -> None:
        for tensor in entry.outputs.values():
            # Arena blocks are ours to close; an output a kernel handed out from its own cache is only dropped.
            if not tensor.closed and type(tensor.buffer.provider_state) is _Block:
                tensor.close()
        for _name, _slot, tensor in entry.inputs:
            tensor.close()
        for pin in entry.pins:
            pin.close()
        entry.outputs, entry.inputs, entry.views, entry.pins, entry.parts = {}, [], {}, [], []
        if arena is not None:
            arena.close()  # stream-ordered after the last replay that used it

    def _drop(self, slot: DeviceGraphSlot, key: tuple) -> None:
        entry = self._entries[slot].pop(key)
        handle = entry.handle
        if entry.token is not None:
            handle.hook.reset_owned_device_graph(token=entry.token)
        handle.hook.retire_owned_device_graphs(owner=entry.owner)
        self._release(entry, entry.arena)
        entry.token = entry.arena = None

    def close(self) -> None:
        for slot, entries in self._entries.items():
            while entries:
                self._drop(slot, next(iter(entries)))
        for handle in self._handles.values():
            handle.pm.unregister(self._server)
        self._handles.clear()


def _tail_capturable(entry: _Entry, plan: Plan) -> bool:
    """Whether a bound run's tail can join the last segment: that segment ends the run and every output is a
    device value one of the captured segments produces (see session/device_step.py)."""
    if not entry.parts or not entry.parts[-1][0] or entry.region.downloads:
        return False
    captured = {slot for is_captured, steps in entry.parts if is_captured for step in steps.steps
                for slot in step.outputs}
    return all(slot in captured for slot in plan.output_slots)


def _env(plan: Plan, feeds: dict) -> list:
    env = list(plan.template)
    for name, slot in plan.feed_slots.items():
        if name in feeds:
            env[slot] = feeds[name]
    return env


def _view(tensor):
    """A borrowed view of an arena tensor: its block may be reused later in the run, and a view frees nothing. A
    host value a captured kernel returned (a provider's shape computation, a function of the feed shapes and the
    constants, so the same at every run of the signature) is kept as it is."""
    if not isinstance(tensor, Tensor):
        return tensor
    return Tensor(tensor.dtype, tensor.shape, tensor.buffer.alias(writable=True), tensor.provider,
                  layout=tensor.layout)


def _device_copy(tensor: Tensor) -> Tensor:
    """A copy of the device tensor ``tensor`` on its device, ordered after the replay that wrote it."""
    clone = Tensor.empty(tensor.dtype, tensor.shape, tensor.provider)
    if tensor.nbytes:
        copy_on_device(tensor.provider, tensor.buffer, clone.buffer, tensor.nbytes)
    return clone


def _guarded(step: Step) -> Step:
    """``step`` as a capture runs it: a kernel cached per shape is known only once the capture's shapes are,
    so it is checked there (the others were checked when the region was planned)."""
    if not isinstance(step.run, ShapeKeyedKernel):
        return step
    return Step(_CaptureGuard(step.run), step.inputs, step.outputs, step.release, step.node, step.provider)


class _CaptureGuard:
    """Runs a shape-keyed kernel in a capture, refusing the kernel its shapes select if it is marked not
    capturable."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: ShapeKeyedKernel):
        self.kernel = kernel

    def __call__(self, *inputs):
        kernel = self.kernel
        chosen = kernel.cache.get(tuple(shape_of(x) for x in inputs), kernel)
        if getattr(chosen, "capturable", True) is False:
            node = kernel.node
            raise _NotCapturable(f"node {node.name!r} ({node.op_type}): its kernel is marked not capturable")
        return kernel(*inputs)
