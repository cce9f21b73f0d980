"""Device-graph capture and replay of whole runs, for sessions that enable it.

Enable it with ``SessionOptions.add_session_config_entry("session.graph_capture", "1")``. A plan is
captured when every node runs on one device provider that implements the owner-scoped device-graph
hooks, no node reads a value computed at run time on the host (a declared ``host_inputs`` position that
is not a constant: reading it back synchronizes, which a capture cannot record), every node passes that
provider's ``plan_capture_region`` policy (no control flow or sequences, every input and output shape
fixed by the feed shapes), and no kernel says ``capturable = False``.

Shapes fixed by the feed shapes ("resolved"): an initializer's, one shape inference expressed in the graph
inputs' dimensions, and, where inference gave up (a Slice whose starts were folded to constants after it
ran, say), the outputs of a node whose provider declares its ``host_inputs``, whose input shapes are
resolved and whose host inputs are constants: the declaration says the output shapes follow from those.
Per signature of the feeds (names, shapes, dtypes):

1. The first run is eager, while a recorder follows the provider's allocations to size an *arena*:
   one device allocation that will hold every buffer the captured run allocates.
2. The second run captures: the feeds are uploaded into persistent input buffers, then the node
   kernels run once more inside ``begin/end_owned_device_graph_capture``, each allocation served from
   the arena (frees return blocks of the same size for reuse), so every buffer the graph touches keeps
   its address for as long as the graph lives. Nothing executes during a capture: the graph is then
   replayed once for this run's outputs.
3. Later runs copy the feeds into the persistent inputs, replay, and download the persistent outputs.

IO-bound runs (:meth:`DeviceGraphRunner.run_plan`) may feed Tensors already on the device: those are not
copied into persistent inputs but captured where they are, so their addresses are part of the signature
(a bound buffer whose address stays the same replays; another address is another signature). Outputs the
binding keeps on the device are handed out as device copies of the arena's, which the next replay rewrites.

A run that cannot be captured runs eagerly and says why in :attr:`DeviceGraphRunner.status` (the
session's ``device_graph_status()``); a capture that fails (a kernel synchronizing with the host, say)
is abandoned for that signature, with the error as the reason. At most ``MAX_GRAPHS`` signatures keep a
graph; the least recently used one is dropped (graph reset, owner retired, arena freed).

Each captured signature is its own :class:`DeviceGraphOwner` in the PRIMARY slot, so graphs of
different signatures never replace each other on a provider that keeps a graph per owner. On one that
holds a single graph (the contract's defaults over the single-slot hooks), a capture replaces the graph
of the signature before; that signature's token then reports its graph gone, and its next run is
captured afresh instead of replaying another signature's graph. Validation submissions work as in eager runs: a graph
captured during a submission keeps raising flags into the executor's validation word at every replay.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..contract.buffers import DeviceBuffer, Ownership
from ..contract.graphs import CaptureRegionShapeStatus, DeviceGraphOwner, DeviceGraphSlot, DeviceGraphToken
from ..contract.markers import hookimpl
from ..errors import KernelError, OnnxRuntimeError
from ..ir import Node
from ..provider_handle import ProviderHandle
from ..tensor import Tensor
from .io_binding import copy_on_device
from .steps import Plan, ShapeKeyedKernel, Step, Steps, Uploader, downloader, run_steps, shape_of, to_host

if TYPE_CHECKING:
    from .executor import Executor

MAX_GRAPHS = 8
MAX_CAPTURE_ATTEMPTS = 3  # an arena that turns out too small is grown and the capture retried this often
_GRAPH_HOOKS = ("begin_owned_device_graph_capture", "begin_device_graph_capture_in", "begin_device_graph_capture")
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


@dataclass
class _Region:
    """What capturing one plan involves. A plan that cannot be captured has a reason instead (a str)."""

    handle: ProviderHandle  # the one device provider every node runs on
    node_steps: list[Step]
    steps: Steps  # the node steps as a capture runs them (see _CaptureGuard)
    uploads: list[tuple[str, int]]  # (feed name, device slot)
    downloads: dict[int, int]  # host output slot -> device slot
    kept: set[int]  # output slots returned on the device (IO binding)


@dataclass(eq=False)
class _Run:
    """One run's plan, feeds and output conversion (the executor's), as the runner passes them along."""

    plan: Plan
    feeds: dict
    convert: Callable[[Any], Any]

    def eager(self, executor: Executor) -> list:
        return executor.run_plan(self.plan, self.feeds, None, self.convert)


@dataclass(eq=False)
class _Entry:
    """One captured feed signature."""

    handle: ProviderHandle  # its region's device provider
    owner: DeviceGraphOwner
    arena_bytes: int
    attempts: int = 0
    failure: str = ""
    token: DeviceGraphToken | None = None
    arena: _Arena | None = None
    inputs: list[tuple[str, Tensor]] = field(default_factory=list)
    outputs: dict[int, Tensor] = field(default_factory=dict)  # host output slot -> persistent device tensor


class DeviceGraphRunner:
    """Captures and replays the runs of one :class:`Executor` (see the module docstring)."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.status = "eager: no run yet"
        self.captures = 0
        self.replays = 0
        self._regions: dict[tuple, _Region | str] = {}  # plan key (output names, or IO binding's) -> region
        self._bound: set[str] = set()
        self._derived: set[str] = set()  # values whose shapes follow from resolved inputs and constants
        self._entries: OrderedDict[tuple, _Entry] = OrderedDict()
        self._server = _ArenaServer()
        self._handles: dict[int, ProviderHandle] = {}  # the handles the arena server is registered on

    # -- eligibility --------------------------------------------------------------------------------
    def _region(self, plan_key: tuple, plan: Plan) -> _Region | str:
        region = self._regions.get(plan_key)
        if region is None:
            region = self._regions[plan_key] = self._analyze(plan)
        return region

    def _analyze(self, plan: Plan) -> _Region | str:
        """The region capturing ``plan`` involves, or the reason it cannot be captured."""
        executor = self.executor
        graph = executor.graph
        # Symbolic dims of the graph inputs are fixed by the feeds, so shapes built from them are resolved.
        self._bound = {d for vi in graph.inputs if vi.type.shape for d in vi.type.shape if isinstance(d, str)}
        host_inputs = {id(step.node): executor.assignment[step.node.name].hook.host_inputs(
            node=step.node, opset=step.node.opset) for step in plan.steps if step.node is not None}
        self._derive_shapes(plan, host_inputs)
        feed_names = {slot: name for name, slot in plan.feed_slots.items()}
        output_slots = set(plan.output_slots)
        device: ProviderHandle | None = None
        node_steps: list[Step] = []
        for step in plan.steps:  # the nodes first: a host node is the reason, not the copies around it
            node = step.node
            if node is None:
                continue
            handle = executor.assignment[node.name]
            label = f"node {node.name!r} ({node.op_type})"
            if handle.is_host_accessible:
                return (f"{label} runs on {handle.name}, a host provider, inside the capture region; every "
                        f"node must run on one device provider")
            if device is None:
                device = handle
            elif handle is not device:
                return f"nodes run on two device providers ({device.name} and {handle.name})"
            for position in host_inputs[id(node)] or ():
                name = node.inputs[position] if position < len(node.inputs) else ""
                if name and name not in graph.initializers:
                    return (f"{label} reads input {position} ({name!r}) on the host, and it is computed at "
                            f"run time, not a constant: the kernel copies it back from the device at every "
                            f"run, a synchronization a capture cannot record")
            decline = handle.hook.plan_capture_region(node=node, shape_status=self._shape_status(node))
            if decline is not None:
                return f"{label}: {getattr(decline, 'reason', decline)}"
            if getattr(step.run, "capturable", True) is False:
                return f"{label}: its kernel is marked not capturable"
            node_steps.append(step)
        uploads: list[tuple[str, int]] = []
        downloads: dict[int, int] = {}
        for step in plan.steps:  # copies at the region's edges: feeds in, outputs out
            if step.node is not None:
                continue
            if isinstance(step.run, Uploader):  # host -> device
                if step.inputs[0] not in feed_names:
                    return f"{step.provider}: a value computed on the host enters the device region"
                uploads.append((feed_names[step.inputs[0]], step.outputs[0]))
            elif step.run is downloader and step.outputs[0] in output_slots:
                downloads[step.outputs[0]] = step.inputs[0]
            else:
                return f"{step.provider}: a device value is read on the host during the run"
        if device is None:
            return "no node runs on a device provider"
        produced = {slot for step in node_steps for slot in step.outputs}
        kept = {slot for slot in plan.output_slots if slot in produced}
        if not any(device.implements(hook) for hook in _GRAPH_HOOKS):
            return f"{device.name} does not implement device graphs (begin_owned_device_graph_capture)"
        return _Region(device, node_steps, Steps([_guarded(step) for step in node_steps]), uploads, downloads, kept)

    def _inferred(self, name: str) -> bool:
        """Whether ``name``'s shape is an initializer's or one shape inference expressed in the feeds' dims."""
        graph, bound = self.executor.graph, self._bound
        if name in graph.initializers:
            return True
        info = graph.type_of(name)
        return bool(info is not None and info.is_tensor and info.shape is not None
                    and all(isinstance(d, int) or (isinstance(d, str) and d in bound) for d in info.shape))

    def _derive_shapes(self, plan: Plan, host_inputs: dict[int, tuple[int, ...] | None]) -> None:
        """Resolve, in plan order, the outputs of nodes whose declared host inputs are constants and whose
        input shapes are resolved (see the module docstring)."""
        graph = self.executor.graph
        self._derived = set()
        for step in plan.steps:
            node = step.node
            if node is None:
                continue
            declared = host_inputs.get(id(node))
            if declared is None or any(node.inputs[p] not in graph.initializers for p in declared
                                       if p < len(node.inputs) and node.inputs[p]):
                continue
            if all(name in self._derived or self._inferred(name) for name in node.inputs if name):
                self._derived.update(name for name in node.outputs if name)

    def _shape_status(self, node: Node) -> CaptureRegionShapeStatus:
        derived = self._derived

        def resolved(name: str) -> bool:
            return name in derived or self._inferred(name)

        return CaptureRegionShapeStatus(inputs_resolved=all(resolved(n) for n in node.inputs if n),
                                        outputs_resolved=all(resolved(n) for n in node.outputs if n))

    # -- running ------------------------------------------------------------------------------------
    def run(self, feeds: dict, output_names: tuple[str, ...]) -> list | None:
        """This run's outputs through a device graph, or None when it must run eagerly (see ``status``)."""
        return self.run_plan(feeds, output_names, self.executor.plan(output_names), to_host)

    def run_plan(self, feeds: dict, plan_key: tuple, plan: Plan, convert: Callable[[Any], Any]) -> list | None:
        """:meth:`run` for any of the executor's plans (``plan_key`` names it); ``convert`` is the executor's
        conversion of output values, used for outputs that pass straight through."""
        region = self._region(plan_key, plan)
        if isinstance(region, str):
            self.status = f"eager: {region}"
            return None
        signature: list[tuple] = []
        for name, value in feeds.items():
            if isinstance(value, np.ndarray):
                signature.append((name, value.shape, value.dtype.str))
            elif isinstance(value, Tensor) and name in plan.device_feeds:
                signature.append((name, value.shape, value.dtype.name, value.device_ptr))  # captured in place
            else:
                self.status = "eager: a feed is not a tensor"
                return None
        key = (plan_key, tuple(sorted(signature)))
        run = _Run(plan, feeds, convert)
        entry = self._entries.get(key)
        if entry is None:
            return self._size(key, region, run)
        self._entries.move_to_end(key)
        if entry.failure:
            self.status = f"eager: {entry.failure}"
            return None
        if entry.token is None:
            return self._capture(entry, region, run)
        if not region.handle.hook.has_owned_device_graph(token=entry.token):
            self._drop(key)  # reset out of band (e.g. by the provider): capture these shapes afresh
            return self._size(key, region, run)
        return self._replay(entry, region, run)

    def _size(self, key: tuple, region: _Region, run: _Run) -> list:
        self._attach(region.handle)
        recorder = _AllocationRecorder()
        region.handle.pm.register(recorder, name=f"device-graph-sizing-{id(recorder)}")
        try:
            outputs = run.eager(self.executor)
        finally:
            region.handle.pm.unregister(recorder)
        self._entries[key] = _Entry(region.handle, DeviceGraphOwner.new(), recorder.layout.top)
        while len(self._entries) > MAX_GRAPHS:
            self._drop(next(iter(self._entries)))
        self.status = "eager: warming up (the next run with these feed shapes is captured)"
        return outputs

    def _attach(self, handle: ProviderHandle) -> None:
        if id(handle) not in self._handles:
            handle.pm.register(self._server, name=f"device-graph-arena-{id(self)}")
            self._handles[id(handle)] = handle

    def _capture(self, entry: _Entry, region: _Region, run: _Run) -> list:
        handle = region.handle
        plan, feeds = run.plan, run.feeds
        entry.attempts += 1
        submissions = self.executor.begin_validation()
        env = list(plan.template)
        for name, slot in plan.feed_slots.items():
            if name in feeds:
                env[slot] = feeds[name]
        token, arena, failure = None, None, None
        try:
            for name, slot in region.uploads:
                tensor = Tensor.from_numpy(np.ascontiguousarray(feeds[name]), provider=handle)
                entry.inputs.append((name, tensor))
                env[slot] = tensor
            arena = _Arena(handle, entry.arena_bytes)
            self._server.arena = arena
            token = handle.hook.begin_owned_device_graph_capture(
                owner=entry.owner, slot=DeviceGraphSlot.PRIMARY, continuation=None,
                kernels=[step.run for step in region.node_steps])
            run_steps(region.steps, env)
            handle.hook.end_owned_device_graph_capture(token=token)
        except BaseException as exc:  # an interrupt too: the stream must not stay in capture mode
            failure = exc
            self._server.arena = None
            if token is not None:
                handle.hook.abort_owned_device_graph_capture(token=token)
                handle.hook.reset_owned_device_graph(token=token)
        finally:
            self._server.stop(handle)  # the stream is idle again: frees deferred during the capture may run
        if failure is None:
            entry.token, entry.arena = token, arena
            entry.outputs = {host: env[device] for host, device in region.downloads.items()}
            entry.outputs.update((slot, env[slot]) for slot in region.kept)
            env.clear()
            self.captures += 1
            return self._launch(entry, region, run, submissions)
        env.clear()  # arena blocks go back before the arena goes
        self._release(entry, arena)
        if not isinstance(failure, Exception):
            raise failure
        if submissions:
            self.executor.abort_validation(submissions, failure)
        if isinstance(failure, _ArenaExhausted) and entry.attempts < MAX_CAPTURE_ATTEMPTS:
            entry.arena_bytes = max(2 * entry.arena_bytes, 1 << 20)
            self.status = "eager: the capture arena was too small; it is grown and the next run captures again"
        else:
            if isinstance(failure, _NotCapturable):
                entry.failure = str(failure.__cause__)  # the guard's words, not the node error restating them
            else:
                step = getattr(failure, "step", None)  # set when a node step failed (see node_error)
                where = f" at node {step.node.name!r}" if step is not None else ""
                entry.failure = f"capture failed{where}: {type(failure).__name__}: {failure}"
            self.status = f"eager: {entry.failure}"
        del failure
        return run.eager(self.executor)

    def _replay(self, entry: _Entry, region: _Region, run: _Run) -> list:
        handle = region.handle
        submissions = self.executor.begin_validation()
        try:
            for name, tensor in entry.inputs:
                handle.copy_from_host(np.ascontiguousarray(run.feeds[name]), tensor.buffer)
        except Exception as exc:
            if submissions:
                self.executor.abort_validation(submissions, exc)
            raise
        return self._launch(entry, region, run, submissions)

    def _launch(self, entry: _Entry, region: _Region, run: _Run, submissions: list) -> list:
        plan, feeds = run.plan, run.feeds
        feed_names = {slot: name for name, slot in plan.feed_slots.items()}
        try:
            region.handle.hook.replay_owned_device_graph(token=entry.token)
            if submissions:
                self.executor.activate_validation(submissions)
            outputs = []
            for slot in plan.output_slots:
                if slot in region.kept:  # the arena's buffer is rewritten by the next replay: hand out a copy
                    outputs.append(_device_copy(entry.outputs[slot]))
                elif slot in entry.outputs:
                    outputs.append(to_host(entry.outputs[slot]))
                else:  # a feed or a constant passed straight through
                    value = feeds[feed_names[slot]] if slot in feed_names else plan.template[slot]
                    outputs.append(run.convert(value))
        except Exception as exc:
            if submissions:
                self.executor.abort_validation(submissions, exc)
            raise
        if submissions:
            self.executor.consume_validation(submissions)
        self.replays += 1
        self.status = "replaying"
        return outputs

    # -- teardown -----------------------------------------------------------------------------------
    def _release(self, entry: _Entry, arena: _Arena | None) -> None:
        for tensor in entry.outputs.values():
            # Arena blocks are ours to close; an output a kernel handed out from its own cache is only dropped.
            if not tensor.closed and type(tensor.buffer.provider_state) is _Block:
                tensor.close()
        for _name, tensor in entry.inputs:
            tensor.close()
        entry.outputs, entry.inputs = {}, []
        if arena is not None:
            arena.close()  # stream-ordered after the last replay that used it

    def _drop(self, key: tuple) -> None:
        entry = self._entries.pop(key)
        handle = entry.handle
        if entry.token is not None:
            handle.hook.reset_owned_device_graph(token=entry.token)
        handle.hook.retire_owned_device_graphs(owner=entry.owner)
        self._release(entry, entry.arena)
        entry.token = entry.arena = None

    def close(self) -> None:
        while self._entries:
            self._drop(next(iter(self._entries)))
        for handle in self._handles.values():
            handle.pm.unregister(self._server)
        self._handles.clear()



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
