"""What capturing one plan into device graphs involves: its segments, its eager seams, its edges.

The device provider of a region is the one, among the device providers that implement device graphs, that
runs the most nodes of the plan. A node step is *captured* when it runs on that provider, reads no value
computed at run time on the host (a declared ``host_inputs`` position that is not a constant: reading it back
synchronizes, which a capture cannot record), passes the provider's ``plan_capture_region`` policy (no control
flow or sequences, every input and output shape fixed by the feed shapes) and its kernel does not say
``capturable = False``. Every other step is a *seam*: it runs eagerly, between the captured *segments* (the
maximal runs of captured steps in plan order), at capture and at every replay.

Edges of the region: uploads of feeds to the provider are hoisted (the feeds are copied into persistent input
buffers before the first segment) and downloads of outputs no later step reads are done after the last one.
A seam value a segment reads is *pinned*: copied into a persistent buffer on the provider, whose address the
segment's graph recorded.

Values fixed by the feed shapes: ``Shape`` (``Size``) of a value whose shape is resolved (below), and what a
deterministic node computes from such values and constants alone. A graph is kept per feed signature, so
such a value is the same at every run of the graph, as a constant is: a node reading one at a declared host
input is captured (the value it reads at the capture is the value of every replay).
A provider that computes such values on the host reads them with no synchronization; one that computes them
on the device would synchronize inside the capture, which fails it: the runner then runs every node reading
one as a seam, as for a value computed from the data (``fixed_readers``).

Shapes fixed by the feed shapes ("resolved"): an initializer's, one shape inference expressed in the graph
inputs' dimensions, and, where inference gave up (a Reshape whose target is computed from ``Shape`` nodes,
a Slice whose starts were folded to constants after it ran), the outputs of a node whose provider declares
its ``host_inputs``, whose input shapes are resolved and whose host inputs are constants or values fixed by
the feed shapes: the declaration says the output shapes follow from those.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..contract.graphs import CaptureRegionShapeStatus
from ..ir import Node
from ..optimizer.constant_folding import NONDETERMINISTIC
from ..provider_handle import ProviderHandle
from .steps import Plan, Step, Uploader, downloader

if TYPE_CHECKING:
    from .executor import Executor

GRAPH_HOOKS = ("begin_owned_device_graph_capture", "begin_device_graph_capture_in", "begin_device_graph_capture")
SEGMENT_HOOKS = ("replay_owned_device_graph_segment", "replay_device_graph_segment_in", "replay_device_graph_segment")


@dataclass
class Part:
    """A run of steps in plan order: a captured segment, or an eager seam."""

    captured: bool
    steps: list[Step] = field(default_factory=list)


@dataclass
class Region:
    """What capturing one plan involves. A plan that cannot be captured has a reason instead (a str)."""

    handle: ProviderHandle  # the device provider whose nodes are captured
    parts: list[Part]  # segments and seams alternating, in plan order
    uploads: list[tuple[str, int]]  # (feed name, device slot): hoisted into persistent inputs
    downloads: dict[int, int]  # host output slot -> device slot, downloaded after the last part
    produced: set[int]  # slots the segments write
    pins: set[int]  # seam slots a segment reads: copied into persistent buffers at every run
    seam_reason: str = ""  # why the first seam node is not captured ("" when there is no seam node)

    @property
    def segments(self) -> int:
        return sum(part.captured for part in self.parts)


class RegionPlanner:
    """Plans the regions of one executor's plans (the reasons and facts are per executor graph)."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self._bound: set[str] = set()
        self._derived: set[str] = set()  # values whose shapes follow from resolved inputs and constants
        self._fixed: set[str] = set()  # values the feed shapes fix (see the module docstring)
        self.fixed_readers: frozenset[str] = frozenset()  # nodes reading one of them at a declared host input

    def analyze(self, plan: Plan, forced: frozenset[str] = frozenset()) -> Region | str:
        """The region capturing ``plan`` involves, or the reason no part of it can be captured. ``forced``: names
        of nodes found not capturable at a capture (a kernel chosen per shape), run as seams."""
        executor = self.executor
        graph = executor.graph
        # Symbolic dims of the graph inputs are fixed by the feeds, so shapes built from them are resolved.
        self._bound = {d for vi in graph.inputs if vi.type.shape for d in vi.type.shape if isinstance(d, str)}
        host_inputs = {id(step.node): executor.assignment[step.node.name].hook.host_inputs(
            node=step.node, opset=step.node.opset) for step in plan.steps if step.node is not None}
        self._derive(plan, host_inputs)
        device = self._device(plan)
        if isinstance(device, str):
            return device
        parts, uploads, downloads, first_reason = self._parts(plan, device, host_inputs, forced)
        if not any(part.captured for part in parts):
            return first_reason or "no node can be captured"
        if sum(part.captured for part in parts) > 1 and not any(device.implements(hook) for hook in SEGMENT_HOOKS):
            return (f"{first_reason or 'a step runs outside the capture region'}; {device.name} does not replay "
                    f"graph segments (replay_device_graph_segment), so the eager seams between segments cannot run")
        produced = {slot for part in parts if part.captured for step in part.steps for slot in step.outputs}
        seam_made = {slot for part in parts if not part.captured for step in part.steps for slot in step.outputs}
        pins = {slot for part in parts if part.captured for step in part.steps for slot in step.inputs
                if slot in seam_made}
        return Region(device, parts, uploads, downloads, produced, pins, first_reason)

    def _parts(self, plan: Plan, device: ProviderHandle, host_inputs: dict, forced: frozenset[str]):
        """The plan's steps split into segments and seams, with the hoisted feed uploads and output downloads,
        and the reason of the first seam (a node's rather than a copy's)."""
        feed_names = {slot: name for name, slot in plan.feed_slots.items()}
        output_slots = set(plan.output_slots)
        last_read = {slot: index for index, step in enumerate(plan.steps) for slot in step.inputs}
        parts: list[Part] = []
        uploads: list[tuple[str, int]] = []
        downloads: dict[int, int] = {}
        first_reason, first_copy = "", False  # the first node's reason is preferred to a copy's
        for index, step in enumerate(plan.steps):
            node = step.node
            if node is None:
                if isinstance(step.run, Uploader) and step.run.handle is device and step.inputs[0] in feed_names:
                    uploads.append((feed_names[step.inputs[0]], step.outputs[0]))
                    continue
                if step.run is downloader and step.outputs[0] in output_slots \
                        and last_read.get(step.outputs[0], -1) <= index:
                    downloads[step.outputs[0]] = step.inputs[0]
                    continue
                reason: str | None = f"{step.provider}: a value crosses between the host and the device mid-run"
            else:
                reason = self._decline(step, device, host_inputs[id(node)], forced)
            captured = reason is None
            if reason is not None and (not first_reason or (node is not None and first_copy)):
                first_reason, first_copy = reason, node is None
            if not parts or parts[-1].captured is not captured:
                parts.append(Part(captured))
            parts[-1].steps.append(step)
        return parts, uploads, downloads, first_reason

    def _device(self, plan: Plan) -> ProviderHandle | str:
        """The device provider with device graphs that runs the most nodes of ``plan``, or why there is none."""
        counts: dict[int, list] = {}
        for step in plan.steps:
            if step.node is not None:
                handle = self.executor.assignment[step.node.name]
                if not handle.is_host_accessible:
                    counts.setdefault(id(handle), [handle, 0])[1] += 1
        if not counts:
            return "no node runs on a device provider"
        capable = [(count, handle) for handle, count in counts.values()
                   if any(handle.implements(hook) for hook in GRAPH_HOOKS)]
        if not capable:
            names = sorted({handle.name for handle, _count in counts.values()})
            return f"{', '.join(names)} does not implement device graphs (begin_owned_device_graph_capture)"
        return max(capable, key=lambda pair: pair[0])[1]

    def _decline(self, step: Step, device: ProviderHandle, host_inputs, forced: frozenset[str]) -> str | None:
        """Why node ``step`` runs in a seam, or None when it is captured."""
        node = step.node
        assert node is not None
        handle = self.executor.assignment[node.name]
        label = f"node {node.name!r} ({node.op_type})"
        if handle is not device:
            where = "a host provider" if handle.is_host_accessible else "another device provider"
            return f"{label} runs on {handle.name}, {where}"
        fixed_ok = node.name not in forced  # forced: a capture failed while fixed values were read
        for position in host_inputs or ():
            name = node.inputs[position] if position < len(node.inputs) else ""
            if name and not (self._constant(name) if fixed_ok else name in self.executor.graph.initializers):
                return (f"{label} reads input {position} ({name!r}) on the host, and it is computed at run time, "
                        f"not a constant: a capture would record the value of one run (and reading it back from "
                        f"the device is a synchronization), so the node runs eagerly at every run")
        decline = handle.hook.plan_capture_region(node=node, shape_status=self._shape_status(node))
        if decline is not None:
            return f"{label}: {getattr(decline, 'reason', decline)}"
        if getattr(step.run, "capturable", True) is False or node.name in forced:
            return f"{label}: its kernel is marked not capturable"
        return None

    def _inferred(self, name: str) -> bool:
        """Whether ``name``'s shape is an initializer's or one shape inference expressed in the feeds' dims."""
        graph, bound = self.executor.graph, self._bound
        if name in graph.initializers:
            return True
        info = graph.type_of(name)
        return bool(info is not None and info.is_tensor and info.shape is not None
                    and all(isinstance(d, int) or (isinstance(d, str) and d in bound) for d in info.shape))

    def _constant(self, name: str) -> bool:
        """Whether ``name`` is the same at every run of one feed signature: an initializer, or fixed by the
        feed shapes."""
        return name in self.executor.graph.initializers or name in self._fixed

    def _resolved(self, name: str) -> bool:
        return name in self._derived or self._inferred(name)

    def _derive(self, plan: Plan, host_inputs: dict[int, tuple[int, ...] | None]) -> None:
        """In plan order: the values the feed shapes fix, and the outputs whose shapes they resolve (see the
        module docstring); then the nodes that read a fixed value at a declared host input."""
        self._derived, self._fixed = set(), set()
        for step in plan.steps:
            node = step.node
            if node is None:
                continue
            read = [name for name in node.inputs if name]
            if node.domain in ("", "ai.onnx") and node.op_type in ("Shape", "Size"):
                fixed = bool(read) and self._resolved(read[0])
            else:
                fixed = bool(read) and not node.subgraphs() and node.op_type not in NONDETERMINISTIC \
                    and all(self._constant(name) for name in read)
            outputs = [name for name in node.outputs if name]
            if fixed:  # a value the same at every run has a shape the same at every run
                self._fixed.update(outputs)
                self._derived.update(outputs)
                continue
            declared = host_inputs.get(id(node))
            if declared is not None and all(self._constant(node.inputs[p]) for p in declared
                                            if p < len(node.inputs) and node.inputs[p]) \
                    and all(self._resolved(name) for name in read):
                self._derived.update(outputs)
        self.fixed_readers = frozenset(
            step.node.name for step in plan.steps if step.node is not None
            and any(step.node.inputs[p] in self._fixed for p in host_inputs.get(id(step.node)) or ()
                    if p < len(step.node.inputs)))

    def _shape_status(self, node: Node) -> CaptureRegionShapeStatus:
        return CaptureRegionShapeStatus(inputs_resolved=all(self._resolved(n) for n in node.inputs if n),
                                        outputs_resolved=all(self._resolved(n) for n in node.outputs if n))
