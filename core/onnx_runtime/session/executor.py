"""The planned executor: a flat list of steps over integer value slots.

Planning (once per requested output set) resolves everything the hot loop would otherwise look up:
which nodes are needed, each value's slot, the kernel of each node (cached per input shapes),
copy steps at device boundaries, and after which step each intermediate is released. A run is
then one loop (:func:`.steps.run_steps`): gather inputs by slot, call the kernel, store outputs,
drop dead values.

Values live where their producer's provider works: numpy arrays for host-accessible providers,
:class:`onnx_runtime.Tensor` objects on device providers. Copies move them across.

Device providers that defer validation (their kernels raise flags on invalid data instead of failing)
get one validation owner per executor: each run is a submission whose flags are read at a host-visible
boundary and raised as :class:`DeviceValidationError`, naming the nodes on that provider. A run that
downloads outputs reads them right after (the download synchronized anyway). An IO-bound run whose outputs
all stay on the device (``run_bound(..., defer_validation=True)``) leaves its submission open instead, so
it reads nothing back, and the next such run joins it while it is still the provider's innermost submission
(no other executor opened one since), so a loop of them reads nothing either. The flags are consumed at the
next host-visible read (:meth:`Executor.settle_validation`, which ``IOBinding.copy_outputs_to_cpu`` and
``synchronize_outputs`` call), or before a run that cannot join opens its own; an error is never dropped.
When the session attaches a device-graph runner (:attr:`Executor.graphs`, see :mod:`.device_graphs`), the
run may instead replay device graphs, in the slot the run options name (:data:`GRAPH_SLOT_KEY`).
"""

from __future__ import annotations

import functools
import threading
import warnings
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..contract.graphs import DeviceGraphSlot
from ..contract.kernels import KernelFn
from ..errors import DeviceValidationError, InvalidArgumentError, OnnxRuntimeError, ProviderError
from ..ir import Graph, Node
from ..loader import implicit_inputs
from ..memory.activations import admit_plan
from ..provider_handle import ProviderHandle
from ..tensor import Tensor
from . import canonical_feeds, mask_values
from .placement import Copy, Placement
from .steps import (
    Plan,
    ShapeKeyedKernel,
    ShapeValues,
    Step,
    Steps,
    Uploader,
    downloader,
    make_kernel,
    on_device,
    run_steps,
    shape_only_steps,
    to_host,
)
from .strict import strict_kernel

_NONE_SLOT = 0  # always holds None: the value of an omitted optional input
GRAPH_SLOT_KEY = "device_graph.slot"  # run config entry: "primary" (default) or "verify"
# id(provider handle) -> the registration whose submission was opened last on it (the innermost one, whose flag
# word the provider's kernels raise into while it stays open).
_LAST_BEGUN: dict[int, object] = {}


def graph_slot_of(run_options) -> DeviceGraphSlot:
    """The device-graph slot ``run_options`` select: ``RunOptions.add_run_config_entry("device_graph.slot",
    "verify")`` for a multi-token verification step, whose graphs then never evict the decode step's."""
    if run_options is None:  # (every plain run)
        return DeviceGraphSlot.PRIMARY
    try:
        value = run_options.get_run_config_entry(GRAPH_SLOT_KEY)
    except (AttributeError, OnnxRuntimeError):  # not set
        return DeviceGraphSlot.PRIMARY
    try:
        return DeviceGraphSlot[str(value).strip().upper()]
    except KeyError:
        raise InvalidArgumentError(
            f"run config entry {GRAPH_SLOT_KEY!r} is {value!r}; use 'primary' (the decode step) or 'verify' "
            f"(a multi-token verification step)"
        ) from None


def _serialized(method):
    """Runs of one executor that touch device state (device graphs, deferred validation) take its run lock, so
    a session is safe from any thread: such runs' captures, replays and validation generations are the
    executor's own and would interleave. Plain runs (the CPU provider) stay concurrent."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        if self.runs_plain:
            return method(self, *args, **kwargs)
        with self._run_lock:
            return method(self, *args, **kwargs)
    return call


class GraphRunner(Protocol):
    """What the executor asks of the device-graph runner the session attaches, which
    :class:`.device_graphs.DeviceGraphRunner` satisfies structurally. Described here rather than imported: the
    runner drives this executor, and importing it would tie the two modules into a cycle."""

    @property
    def status(self) -> str: ...

    def run(self, feeds: dict[str, object], output_names: tuple[str, ...], slot: DeviceGraphSlot = ...
            ) -> list | None: ...

    def run_plan(self, feeds: dict[str, object], plan_key: tuple, plan: Plan,
                 convert: Callable[[Any], Any], slot: DeviceGraphSlot = ..., copied: frozenset[int] = ...
                 ) -> list | None: ...

    def close(self) -> None: ...


class Executor:
    """Builds and runs plans for one graph whose nodes are already placed."""

    strict = False  # every kernel call checked against its node (session/strict.py); set before planning
    ran = False  # set by the session's first run of this executor (InferenceSession._run)

    def __init__(self, graph: Graph, assignment: dict[str, ProviderHandle], placement: Placement):
        self.graph = graph
        self.assignment = assignment
        self.placement = placement
        self._plans: dict[tuple[str, ...], Plan] = {}
        self._bound_plans: dict[tuple, Plan] = {}  # IO binding: (outputs, feeds on devices, device outputs)
        self._devices = {h.device_id: h for h in assignment.values() if not h.is_host_accessible}
        self._kernels: dict[int, KernelFn] = {}  # id(node) -> kernel (shared across plans)
        self._device_constants: dict[tuple[str, int], Tensor] = {}
        self._consts = {}
        for name, array in graph.initializers.items():
            array = np.asarray(array)
            array.flags.writeable = False  # a kernel bug or a returned alias must not corrupt weights
            self._consts[name] = array
        devices = {id(h): h for h in assignment.values() if not h.is_host_accessible}.values()
        self._validation = [(h, h.hook.register_device_validation_owner()) for h in devices
                            if h.hook.defers_device_validation()]
        # Providers with a stream per instance: a bound run orders the device buffers it shares with other sessions.
        self._ordered = tuple(h for h in devices if h.implements("order_device_access"))
        self._pending: list = []  # submissions of runs whose flags nobody has read yet
        self._defer = False  # whether the run in progress leaves its submission pending
        self._suspects: dict[int, list[str]] = {}  # id(handle) -> the nodes of the last run on it
        self._suspects_of: dict[int, dict[int, list[str]]] = {}  # id(plan) -> its suspects (plans live as long)
        # The device-graph runner the session attaches when it enables capture (see GraphRunner).
        self.graphs: GraphRunner | None = None
        # id(device handle) -> the session's weights on it (memory/weights.py WeightResidency), set before planning.
        self.weights: dict[int, Any] = {}
        self._run_lock = threading.RLock()  # see _serialized

    # -- planning -----------------------------------------------------------------------------------
    def plan(self, output_names: tuple[str, ...]) -> Plan:
        plan = self._plans.get(output_names)
        if plan is None:
            plan = self._plans[output_names] = self._build(output_names)
        return plan

    def _needed_nodes(self, output_names) -> list[Node]:
        """The nodes ``output_names`` depend on, in graph order: one backward sweep over the
        (topologically ordered) nodes, collecting what the kept ones read."""
        wanted = set(output_names)
        kept: list[Node] = []
        for node in reversed(self.graph.nodes):
            if wanted.isdisjoint(node.outputs):
                continue
            kept.append(node)
            wanted.update(node.inputs)
            if node.attrs:
                wanted.update(implicit_inputs(node))
            wanted.discard("")  # an omitted input, not a value some node's omitted output would give
        kept.reverse()
        return kept

    def _build(self, output_names: tuple[str, ...], feed_devices: dict[str, ProviderHandle] | None = None,
               device_outputs: bool = False) -> Plan:
        """``feed_devices``: feeds that arrive as tensors on a device provider's device, read there as they are;
        ``device_outputs``: return outputs where they are produced instead of downloading them."""
        feed_devices = feed_devices or {}
        template: list = [None]
        where: dict[str, tuple[int, ProviderHandle | None]] = {}  # value -> (slot, device or None=host)
        copies: dict[tuple[str, int], int] = {}
        steps: list[Step] = []
        feed_slots: dict[str, int] = {}
        recorded_copies: list[Copy] = []

        def new_slot(value=None) -> int:
            template.append(value)
            return len(template) - 1

        for vi in self.graph.inputs:
            feed_slots[vi.name] = where.setdefault(vi.name, (new_slot(), feed_devices.get(vi.name)))[0]
        for name, array in self._consts.items():
            where[name] = (new_slot(array), None)
        for name in self.graph.outer_names:  # subgraphs: outer-scope values arrive as feeds
            feed_slots.setdefault(name, where.setdefault(name, (new_slot(), None))[0])

        def resident(name: str, target: ProviderHandle | None) -> int:
            slot, device = where[name]
            if device is target:
                return slot
            key = (name, id(target))
            if key in copies:
                return copies[key]
            if name in self._consts and target is not None:  # upload weights once, at plan time
                weights = self.weights.get(id(target)) if self.weights else None
                if weights is not None and weights.paged:  # paged per node under a budget: each read pages
                    out = new_slot()
                    steps.append(Step(weights.pager(name), (), (out,), (), None, f"page {name} to {target.name}"))
                    return out
                tensor = self._device_constants.get(key)
                if tensor is None:
                    tensor = self._device_constants[key] = (
                        weights.upload(name, self._consts[name]) if weights is not None
                        else Tensor.from_numpy(self._consts[name], provider=target))
                copies[key] = new_slot(tensor)
                return copies[key]
            out = new_slot()
            if target is None:
                steps.append(Step(downloader, (slot,), (out,), (), None, f"copy {name} to host"))
            else:
                steps.append(Step(Uploader(target), (slot,), (out,), (), None, f"copy {name} to {target.name}"))
            recorded_copies.append(Copy(name, device.name if device is not None else "host",
                                        target.name if target is not None else "host"))
            copies[key] = out
            return out

        for node in self._needed_nodes(output_names):
            handle = self.assignment[node.name]
            target = None if handle.is_host_accessible else handle
            ins = [resident(n, target) if n else _NONE_SLOT for n in node.inputs]
            ins += [resident(n, target) for n in implicit_inputs(node)]
            outs = []
            for name in node.outputs:
                if name:
                    slot = new_slot()
                    where[name] = (slot, target)
                    outs.append(slot)
                else:
                    outs.append(new_slot())  # an unused optional output still gets a place to land
            steps.append(Step(self._kernel_for(node, handle), tuple(ins), tuple(outs), (), node, handle.name))

        missing = [n for n in output_names if n not in where]
        if missing:
            raise ProviderError(f"outputs {missing} are not produced by the graph")
        output_slots = [where[n][0] if device_outputs else resident(n, None) for n in output_names]
        keep = set(output_slots) | set(feed_slots.values())
        tensor_feeds = {feed_slots[vi.name] for vi in self.graph.inputs if vi.type.is_tensor}
        # Host plans only (device plans have their own replays): the steps that only the feeds' shapes decide.
        constants = {where[name][0] for name in self._consts}
        found = set() if self._devices or recorded_copies else \
            shape_only_steps(steps, tensor_feeds, constants, set(output_slots))
        body = [step.replace() for index, step in enumerate(steps) if index not in found] if found else []
        read = {slot for step in body for slot in step.inputs}
        kept = tuple(slot for index in sorted(found) for slot in steps[index].outputs if slot in read)
        # An unpadded generation's mask and positions: shape-only too (see canonical_feeds), for plans whose feed
        # shapes are symbolic (a decode loop's: an exact plan meets one shape).
        canonical = canonical_feeds.plan(self.graph, steps, feed_slots, tensor_feeds, constants, set(output_slots),
                                         found) if found and canonical_feeds.ENABLED else None
        # A run that computes the kept values (either kind's) keeps them to its end.
        self._assign_releases(steps, keep | set(kept) | set(canonical.kept if canonical is not None else ()))
        plan = Plan(steps, template, feed_slots, output_slots, recorded_copies, frozenset(feed_devices))
        if found:
            self._assign_releases(body, keep)
            declared = {slot: info.shape for name, (slot, _) in where.items()
                        if (info := self.graph.type_of(name)) is not None and info.shape is not None
                        and all(isinstance(d, int) for d in info.shape)}
            values = ShapeValues(steps, body, tuple(sorted(tensor_feeds)), kept, declared)
            if mask_values.ENABLED:  # the attention-mask chain of the body, kept per mask (see mask_values)
                masks = {feed_slots[name] for name in mask_values.mask_feeds(self.graph)}
                chained = mask_values.grouped(body, masks, set(kept), constants)
                if chained is not body:
                    values.body = Steps(chained)
            plan.shape_values = values
            if canonical is not None:
                self._assign_releases(canonical.body, keep)
                plan.shape_values = canonical.values(values, declared)
        admit_plan(plan, self.graph, self.assignment)  # host activations, charged once per plan, not per run
        return plan

    def _kernel_for(self, node: Node, handle: ProviderHandle) -> KernelFn:
        kernel = self._kernels.get(id(node))
        if kernel is None:
            shapes = []
            static = True
            for name in node.inputs:
                info = self.graph.type_of(name) if name else None
                shape = info.static_shape if info is not None and info.is_tensor else None
                static &= shape is not None or not name
                shapes.append(shape)
            if node.subgraphs():
                # Control flow runs any shapes through its compiled subgraphs: one kernel for all.
                kernel = make_kernel(handle, node, [None] * (len(node.inputs) + len(implicit_inputs(node))), self.graph)
            elif static:
                kernel = make_kernel(handle, node, shapes, self.graph)
            else:
                kernel = ShapeKeyedKernel(handle, node, self.graph)
            if self.strict:
                kernel = strict_kernel(kernel, node, self.graph, handle.name)
            self._kernels[id(node)] = kernel
        return kernel

    @staticmethod
    def _assign_releases(steps: list[Step], keep: set[int]) -> None:
        last_use: dict[int, int] = {}
        for index, step in enumerate(steps):
            for slot in step.inputs:
                last_use[slot] = index
            for slot in step.outputs:
                last_use.setdefault(slot, index)  # produced but never read: drop right away
        releases: dict[int, list[int]] = {}
        for slot, index in last_use.items():
            if slot != _NONE_SLOT and slot not in keep:
                releases.setdefault(index, []).append(slot)
        for index, slots in releases.items():
            steps[index].release = tuple(slots)

    # -- running ------------------------------------------------------------------------------------
    @property
    def runs_plain(self) -> bool:
        """Whether a run is just its plan's steps: no device graphs and no deferred device validation."""
        return self.graphs is None and not self._validation

    def run(self, feeds: dict[str, object], output_names: tuple[str, ...], profile: dict | None = None,
            slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY) -> list:
        """Run the plan for ``output_names``. With ``profile`` (a dict), add each operator's
        (seconds, calls) to it; ``slot``: the device-graph slot (see :func:`graph_slot_of`)."""
        if profile is None and self.graphs is None and not self._validation:
            # A plain run (host providers, no profile): the plan's steps and nothing else. A decode step on small
            # weights is a few tens of microseconds of kernels, so the layers above them are kept out of its way.
            plan = self._plans.get(output_names)
            if plan is None:
                plan = self.plan(output_names)
            env = plan.template.copy()
            slots = plan.feed_slots
            for name, value in feeds.items():
                slot_of = slots.get(name)
                if slot_of is not None:
                    env[slot_of] = value
            run_steps(plan, env)
            return [value if type(value) is np.ndarray else to_host(value)
                    for value in map(env.__getitem__, plan.output_slots)]
        return self._run_serialized(feeds, output_names, profile, slot)

    @_serialized
    def _run_serialized(self, feeds: dict[str, object], output_names: tuple[str, ...], profile: dict | None,
                        slot: DeviceGraphSlot) -> list:
        if self.graphs is not None and profile is None:
            if self._ordered:  # host feeds only: a capture that follows records no earlier run's buffers
                self._order_access({}, {}, ())
            outputs = self.graphs.run(feeds, output_names, slot)
            if outputs is not None:
                return outputs
        return self.run_eager(feeds, output_names, profile)

    def run_eager(self, feeds: dict[str, object], output_names: tuple[str, ...], profile: dict | None = None) -> list:
        """Run every step of the plan, without device graphs."""
        return self.run_plan(self.plan(output_names), feeds, profile, to_host)

    @_serialized
    def run_bound(self, feeds: dict[str, object], output_names: tuple[str, ...], device_outputs: bool,
                  profile: dict | None = None, slot: DeviceGraphSlot = DeviceGraphSlot.PRIMARY,
                  defer_validation: bool = False, copied: frozenset[str] = frozenset(), writes: tuple = ()) -> list:
        """IO binding's run: a feed that is a Tensor on the device of a provider of this session is read there
        as it is (no download or upload); with ``device_outputs``, outputs produced on a device are returned as
        Tensors on it. With device graphs, such a feed is captured at its address (see :mod:`.device_graphs`).
        ``defer_validation``: a run whose outputs all stay on the device leaves its validation pending (see the
        module docstring). ``copied``: names of outputs the caller copies into buffers of its own before the next
        run; a replay hands those out as views of its graph's buffers instead of copies (one device copy less).
        ``writes``: device buffers the run writes besides its own (a captured step's bound outputs)."""
        self._defer = defer_validation and device_outputs
        try:
            return self._run_bound(feeds, output_names, device_outputs, profile, slot, copied, writes)
        finally:
            self._defer = False

    def _run_bound(self, feeds: dict[str, object], output_names: tuple[str, ...], device_outputs: bool,
                   profile: dict | None, slot: DeviceGraphSlot, copied: frozenset[str], writes: tuple = ()) -> list:
        feed_devices = {}
        feeds = dict(feeds)
        for name, value in feeds.items():
            if isinstance(value, Tensor):
                handle = self._devices.get(value.device)
                if handle is None:  # on the host, or on a device no node of this session runs on
                    feeds[name] = value.numpy()
                else:
                    feed_devices[name] = handle
        if self._ordered and (feed_devices or writes or self.graphs is not None):
            self._order_access(feeds, feed_devices, writes)
        if not feed_devices and not device_outputs:
            return self.run(feeds, output_names, profile, slot)
        key = (output_names, tuple(sorted((name, id(h)) for name, h in feed_devices.items())), device_outputs)
        plan = self._bound_plans.get(key)
        if plan is None:
            plan = self._bound_plans[key] = self._build(output_names, feed_devices, device_outputs)
        convert = on_device if device_outputs else to_host
        if self.graphs is not None and profile is None:
            positions = frozenset(i for i, name in enumerate(output_names) if name in copied)
            outputs = self.graphs.run_plan(feeds, key, plan, convert, slot, positions)
            if outputs is not None:
                return outputs
        return self.run_plan(plan, feeds, profile, convert)

    def _order_access(self, feeds: dict, feed_devices: dict, writes: tuple) -> None:
        """Before the run's first device work (and outside any capture, so before every replay too): order it
        after other streams' use of the device feeds it reads and the buffers it writes (contract 1.4). With device
        graphs every run calls it, with empty lists too: a capture records what the run's own call named."""
        for handle in self._ordered:
            reads = [feeds[name].buffer for name, h in feed_devices.items() if h is handle]
            mine = [buffer for buffer in writes if buffer.device == handle.device_id]
            if reads or mine or self.graphs is not None:
                handle.hook.order_device_access(reads=reads, writes=mine)

    def run_plan(self, plan: Plan, feeds: dict[str, object], profile: dict | None,
                 convert: Callable[[Any], Any]) -> list:
        """Run ``plan`` eagerly; ``convert`` turns each output slot's value into what the caller gets."""
        env = list(plan.template)
        for name, value in feeds.items():
            slot = plan.feed_slots.get(name)
            if slot is not None:
                env[slot] = value
        submissions = self.begin_validation(plan) if self._validation else None
        try:
            run_steps(plan, env, profile)
            if submissions:
                self.activate_validation(submissions)
            outputs = [convert(env[slot]) for slot in plan.output_slots]
        except Exception as exc:
            if submissions:
                self.abort_validation(submissions, exc)
            raise
        if submissions:
            self.settle_validation(submissions)
        return outputs

    # -- deferred device validation (one submission per run and device provider) ----------------------
    def begin_validation(self, plan: Plan | None = None) -> list:
        """Open this run's submissions, after reading the pending ones (a provider settles an owner's open
        submission when it opens the next, and its flags must reach the caller)."""
        if not self._validation:
            return []
        pending = self._pending
        if pending and self._defer and all(_LAST_BEGUN.get(id(h)) is r for h, r, _token in pending):
            # Still the providers' innermost submission: this run's kernels raise flags into it as well, so the
            # flags of all the deferred runs are read at once, at the next host-visible read. A submission a
            # recipient's read settled meanwhile refuses activation: then it is read here and a new one opened.
            try:
                for handle, _registration, token in pending:
                    handle.hook.activate_device_validation(submission=token)
                return pending
            except OnnxRuntimeError:
                pass
        self.settle_validation()
        if plan is not None:
            self._suspects = self._suspects_of.get(id(plan)) or self._suspects_of.setdefault(id(plan), {
                id(handle): [f"{step.node.name!r} ({step.node.op_type})" for step in plan.steps
                             if step.node is not None and self.assignment[step.node.name] is handle]
                for handle, _registration in self._validation})
        submissions = []
        try:
            for handle, registration in self._validation:
                token = handle.hook.begin_device_validation(registration=registration)
                _LAST_BEGUN[id(handle)] = registration
                submissions.append((handle, registration, token))
        except Exception as exc:
            self.abort_validation(submissions, exc)
            raise
        return submissions

    def validation_suspects(self, handle: ProviderHandle) -> list[str]:
        """The nodes of the run in progress that ``handle`` runs: the ones a flag it raises may come from."""
        return self._suspects.get(id(handle), [])

    @staticmethod
    def activate_validation(submissions: list) -> None:
        for handle, _registration, token in submissions:
            handle.hook.activate_device_validation(submission=token)

    def settle_validation(self, submissions: list | None = None) -> None:
        """Read and raise what the device kernels flagged: ``submissions`` (a finished run's) unless the run in
        progress defers them, and before them whatever earlier runs left pending. A host-visible read of a
        deferred run's outputs calls this with no argument."""
        if submissions and self._defer:
            self._pending = submissions
            return
        pending, self._pending = self._pending, []
        for handle, registration, token in [*pending, *(submissions or ())]:
            flags = handle.hook.consume_device_validation_error(registration=registration, token=token)
            if flags:
                self._pending = []
                raise _validation_error(handle, flags, self._suspects.get(id(handle), []))

    def abort_validation(self, submissions: list, cause: BaseException) -> None:
        """Settle the submissions of a failed run; invalid device data is reported as the root cause."""
        if submissions is self._pending:
            self._pending = []
        for handle, _registration, token in submissions:
            try:
                flags = handle.hook.abort_device_validation_submission(submission=token)
            except Exception:  # the device may be in an error state; the original failure says more
                continue
            if flags:
                raise _validation_error(handle, flags, self._suspects.get(id(handle), [])) from cause

    def device_graph_status(self) -> str:
        if self.graphs is None:
            return ("eager: device graph capture is off (enable it with "
                    "SessionOptions.add_session_config_entry('session.graph_capture', '1'))")
        return self.graphs.status

    def close(self) -> None:
        try:
            self.settle_validation()
        except DeviceValidationError as error:
            warnings.warn(f"closing a session with unread device validation flags: {error}", stacklevel=2)
        if self.graphs is not None:
            self.graphs.close()  # graphs first: they reference the validation words and the constants
        for handle, registration in self._validation:
            handle.hook.unregister_device_validation_owner(registration=registration)
        self._validation = []
        for tensor in self._device_constants.values():
            tensor.close()
        self._device_constants.clear()
        self._plans.clear()
        self._bound_plans.clear()


def _validation_error(handle: ProviderHandle, flags: int, nodes: list[str]) -> DeviceValidationError:
    shown = ", ".join(nodes[:8]) + (f" and {len(nodes) - 8} more" if len(nodes) > 8 else "")
    return DeviceValidationError(
        f"{handle.name}: device validation failed (flags=0x{flags:x}): a device kernel met invalid input data "
        f"(e.g. an index out of range) and skipped it, so the outputs are not valid; check the inputs of the "
        f"nodes on {handle.name}" + (f": {shown}" if shown else "")
    )

