"""The execution-provider contract, as pluggy hook specifications.

This module is the contract and its documentation: a provider author reads this file and nothing
else. A provider is a class whose methods are marked with ``@onnx_runtime.hookimpl`` and named
after the hooks below. Every hook has a default in :mod:`onnx_runtime.contract.defaults`; a
provider implements a hook simply by defining it, and the default for that hook then steps aside.
So a host provider can be four hooks long (``name``, ``supports_op``, ``get_kernel`` and maybe
``device_type``) and a device provider adds memory, copies and sync.

How hooks are called. Each provider *instance* gets its own ``pluggy.PluginManager`` holding that
instance and the defaults it does not override (see :class:`onnx_runtime.ProviderHandle`), so
``handle.hook.allocate(size=..., alignment=...)`` reaches exactly one implementation. Hooks are
called with keyword arguments; an implementation may accept any subset of the parameters named
here. All hooks are ``firstresult``: the single implementation's return value is the result.
Cross-cutting plugins (tracing, allocation accounting) can wrap any hook with pluggy wrappers.

Hooks are the control plane: placement, kernel creation, planning, copies at boundaries, capture.
The data plane is the kernels ``get_kernel`` returns, which the executor calls directly.

Every hook below is typed and ends its docstring with two lines: ``Default:`` says what the core's
default does when the provider does not implement the hook, and ``Called by:`` names the core module
that calls it and when ("not by the core" marks hooks that exist for providers, tools and tests; the
session works without them).

Errors. Raise :class:`onnx_runtime.errors.ProviderError` (or a subclass) with a message that names
the provider, what was wrong and how to fix it.

Providers are found through the ``onnx_runtime.providers`` entry-point group. The entry point
names a module (or object) implementing the discovery hook :meth:`DiscoverySpec.onnx_runtime_providers`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

from .device_hookspecs import DeviceExecutionSpec
from .markers import hookspec
from .memory_hookspecs import MemoryGovernanceSpec, ResidencySpec

if TYPE_CHECKING:
    from ..devices import DeviceId, DeviceType, TensorLayout
    from ..dtypes import DataType
    from ..ir import Dim, Graph, Node
    from .buffers import DeviceBuffer, Fence, HostBytes, WritableHostBytes
    from .graphs import (
        CaptureRegionShapeStatus,
        StructuralCaptureDecline,
    )
    from .handle import ContractHandle
    from .kernels import Availability, GraphPass, Kernel, KernelMatch


class DiscoverySpec:
    """Process-wide hooks, implemented by the module an entry point names."""

    @hookspec
    def onnx_runtime_providers(self) -> list[Callable[[], object]]:
        """Return a list of provider classes this plugin contributes.

        Each class must be constructible with no arguments and without touching a device;
        device work belongs in ``initialize``. A :class:`~onnx_runtime.contract.deferred.DeferredProvider`
        may stand in for a class whose import is costly: it is imported when a session creates it. Example::

            @hookimpl
            def onnx_runtime_providers():
                return [MyExecutionProvider]

        Default: none; an entry point that names neither a provider class nor a plugin implementing
        this hook is reported as broken (``onnx-runtime providers`` lists it).
        Called by: discovery.py, once per plugin when the provider registry loads the entry points
        (first use) and on ``onnx_runtime.register_provider``.
        """


class ExecutionProviderSpec(DeviceExecutionSpec, MemoryGovernanceSpec, ResidencySpec):
    """Hooks implemented by one execution-provider instance (the device hooks are inherited from
    :class:`onnx_runtime.contract.device_hookspecs.DeviceExecutionSpec`, the memory-governance and residency
    hooks from :class:`onnx_runtime.contract.memory_hookspecs.MemoryGovernanceSpec` and
    :class:`onnx_runtime.contract.memory_hookspecs.ResidencySpec`)."""

    # -- identity -----------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def name(self) -> str:
        """The provider's name as onnxruntime spells it, e.g. ``"CPUExecutionProvider"``.

        Default: none: the hook is required, and a provider without it is rejected with a
        :class:`PluginError`.
        Called by: provider_handle.py, once when a handle is created (at discovery and for every
        session); the handle keeps the answer.
        """

    @hookspec(firstresult=True)
    def contract_version(self) -> str:
        """The version of this contract the provider was written for, "MAJOR.MINOR" (e.g.
        ``onnx_runtime.contract.VERSION`` at the time of writing: return the literal, not the constant).

        A core serves providers of its major version written for the same or an earlier minor version; others
        are listed as unavailable with the reason (contract/version.py, docs/contract-changelog.md).
        Default: "1.0", the first versioned contract.
        Called by: provider_handle.py, once when a handle is created; the handle keeps the answer.
        """

    @hookspec(firstresult=True)
    def selected_by_default(self) -> bool:
        """Whether a session created without ``providers=`` uses this provider.

        A provider for tests, or for hardware a user must opt into, returns False so that installing it does
        not change what plain ``InferenceSession(path)`` runs on; naming it in ``providers=`` still selects it.
        Default: True.
        Called by: discovery.py (``get_available_providers``), once per provider at discovery.
        """

    @hookspec(firstresult=True)
    def short_name(self) -> str:
        """A short alias accepted wherever a provider name is, e.g. ``"cpu"``.

        Default: the name lower-cased without ``ExecutionProvider``.
        Called by: provider_handle.py, once when a handle is created; the handle keeps the answer.
        """

    @hookspec(firstresult=True)
    def device_type(self) -> DeviceType:
        """The :class:`onnx_runtime.DeviceType` of the memory this provider's kernels use.

        Default: ``DeviceType.CPU``.
        Called by: provider_handle.py, when a handle is created and again after ``initialize``.
        """

    @hookspec(firstresult=True)
    def device_id(self) -> DeviceId:
        """The :class:`onnx_runtime.DeviceId` this instance runs on.

        Its ``is_host_accessible`` decides whether the core reads the provider's buffers directly or
        copies through ``copy_from_host`` / ``copy_to_host``.
        Default: ``DeviceId(device_type(), 0)``.
        Called by: provider_handle.py, when a handle is created and again after ``initialize``; the
        default ``allocate`` asks it per allocation.
        """

    @hookspec(firstresult=True)
    def availability(self) -> Availability:
        """An :class:`Availability`: can this provider run on this machine, and if not, why.

        Called before ``initialize`` and must be cheap and side-effect free (e.g. probe for a
        driver library). The reason is shown by ``onnx-runtime providers`` and in session errors,
        so say what is missing and how to get it. An exception is reported as unavailable.
        Default: available.
        Called by: provider_handle.py (``ProviderHandle.availability``), once per provider at
        discovery (discovery.py); sessions read the registry's answer.
        """

    # -- lifecycle ----------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def initialize(self, options: dict[str, str], handle: ContractHandle, session_config: dict[str, str]) -> None:
        """Acquire device resources. ``options`` maps namespaced keys to strings.

        The session passes the user's ``provider_options`` for this provider. Unknown keys should
        raise :class:`InvalidArgumentError` naming the key and the accepted ones. ``handle`` is the
        :class:`ProviderHandle` the core dispatches this instance through (typed as the
        :class:`~onnx_runtime.contract.handle.ContractHandle` it satisfies): keep it to create
        :class:`onnx_runtime.Tensor` outputs on this device from kernels that have no device input.
        ``session_config`` holds session-wide settings as strings under onnxruntime's key names
        (``session.intra_op_num_threads``, ``session.use_deterministic_compute``, and every
        ``SessionOptions.add_session_config_entry``); honour the ones that apply.
        Default: accept no options (any option raises :class:`InvalidArgumentError`).
        Called by: provider_handle.py (``ProviderHandle.initialize``), once per instance: at session
        creation (session/inference_session.py), for ``OrtValue`` device tensors (ort_value.py) and
        for the core's host allocator (host.py).
        """

    @hookspec(firstresult=True)
    def shutdown(self) -> None:
        """Release device resources acquired by ``initialize``.

        Default: nothing to release.
        Called by: provider_handle.py (``ProviderHandle.shutdown``), once when the session that
        initialized the instance closes (session/inference_session.py).
        """

    # -- capability and kernels ---------------------------------------------------------------
    @hookspec(firstresult=True)
    def supports_op(
        self,
        node: Node,
        opset: int,
        shapes: Sequence[tuple[Dim, ...] | None],
        dtypes: Sequence[DataType | None],
        layouts: Sequence[TensorLayout],
    ) -> KernelMatch:
        """Whether this provider can run ``node`` and at what cost: a :class:`KernelMatch`.

        ``opset`` is the model's opset for the node's domain; ``shapes`` per input a tuple of dims
        (int, or str/None when symbolic/unknown) or None when the rank is unknown; ``dtypes`` per
        input a :class:`DataType` or None; ``layouts`` per input a :class:`TensorLayout`.
        ``node.inputs`` uses "" for omitted optional inputs (its shape and dtype are None).
        An unsupported answer must say what the provider accepts and how to fix it.
        Default: unsupported (the provider implements no operators).
        Called by: session/placement.py (through ``ProviderHandle.supports_op``), per node and
        provider in priority order until one accepts, at session creation; also before placement by
        the optimizer's passes (optimizer/context.py) and the ownership test of ``custom_passes``
        (session/inference_session.py).
        """

    @hookspec(firstresult=True)
    def get_kernel(
        self, node: Node, shapes: Sequence[tuple[int, ...] | None], opset: int, graph: Graph
    ) -> Kernel:
        """A kernel for ``node`` specialized to concrete input ``shapes`` (tuples of ints).

        ``shapes`` holds None for an omitted optional input, and for every input of a control-flow
        node, whose one kernel runs any shapes through its compiled subgraphs.
        ``graph`` is the :class:`onnx_runtime.ir.Graph` holding the node, for the rare operator
        defined over other nodes of its graph (``Gradient``), and for the values of constant inputs:
        an input named in ``graph.initializers`` holds that value on every run, so a device kernel can
        take its :meth:`host_inputs` from there instead of reading them back from the device.

        The kernel is a callable ``kernel(*inputs) -> tuple of outputs`` (see :class:`Kernel`).
        The session caches kernels per (node, input shapes). Raise :class:`InvalidGraphError` for
        an attribute combination the operator's spec forbids, naming the node and the attribute.
        Default: raises :class:`NotSupportedError` (the provider creates no kernels).
        Called by: session/executor.py, when it plans the session's runs (at session creation) for a
        node whose input shapes are all static, else at the first run with each new tuple of input
        shapes; also by constant folding (optimizer/context.py) on host providers.
        """

    @hookspec(firstresult=True)
    def host_inputs(self, node: Node, opset: int) -> tuple[int, ...] | None:
        """Positions of ``node``'s inputs whose *values* its kernel reads on the host, or None.

        Shape-like inputs (Reshape's shape, Slice's starts/ends/axes/steps, Expand's shape, Tile's
        repeats, a Reduce* axes input, ...) decide output shapes, which are host metadata, so a device
        kernel needs their values on the host when it runs. A kernel takes the value of a constant input
        from ``graph.initializers`` (see :meth:`get_kernel`); any other such input is read back from the
        device at every call, a host synchronization that device-graph capture cannot record.

        Answering a tuple (even an empty one) also states that the kernel reads every other input only
        on the device, so the node's output shapes follow from its input shapes, its attributes and the
        values of these inputs. The session relies on both: a capture region declines a node whose host
        input is not a constant (naming the input), and admits a node whose output shape inference could
        not resolve when its input shapes are resolved and its host inputs are constants.
        Default: None (not declared; nothing is assumed).
        Called by: session/device_graphs.py, once per node of a plan when a session with
        ``session.graph_capture`` enabled first runs that plan.
        """

    @hookspec(firstresult=True)
    def claim_nodes(self, graph: Graph) -> Iterable[str]:
        """Names of nodes this provider claims unconditionally, before cost-based placement.

        Default: none.
        Called by: session/placement.py, once per provider at session creation, before any
        ``supports_op``.
        """

    @hookspec(firstresult=True)
    def custom_passes(self) -> Sequence[GraphPass]:
        """Provider-specific graph passes run after the generic optimizer.

        A pass is a callable ``pass_(graph) -> bool`` or ``pass_(graph, owns) -> bool`` rewriting an
        :class:`onnx_runtime.ir.Graph` in place and returning whether it changed anything.
        ``owns(node)`` says whether placement would give the node to this provider (no provider
        listed before it accepts it): fuse only nodes you own, so a fusion never pulls work away from
        a provider the user listed first. A pass with a true ``before_optimizer`` attribute runs before
        the generic optimizer instead (a rewrite whose result the optimizer's fusions should see).
        Default: none.
        Called by: session/inference_session.py, once per provider in priority order at session
        creation, after the generic optimizer and before placement.
        """

    @hookspec(firstresult=True)
    def plan_capture_region(
        self, node: Node, shape_status: CaptureRegionShapeStatus
    ) -> StructuralCaptureDecline | str | None:
        """Why ``node`` must stay out of a device-graph capture region, or None to admit it.

        ``shape_status`` is a :class:`CaptureRegionShapeStatus`. The answer is a
        :class:`StructuralCaptureDecline` or a string (anything with a ``reason`` attribute is shown
        by it). An override must still decline whenever either shape is unresolved.
        Default: declines, in this order: control-flow and sequence operators, an unresolved output
        shape, an unresolved input shape.
        Called by: session/device_graphs.py, once per node of a plan when a session with
        ``session.graph_capture`` enabled first runs that plan.
        """

    # -- memory -------------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def allocate(self, size: int, alignment: int) -> DeviceBuffer:
        """A new owned :class:`DeviceBuffer` of ``size`` bytes aligned to ``alignment``.

        Default: aligned host memory when the device is host-accessible; else
        :class:`NotSupportedError`.
        Called by: provider_handle.py (``ProviderHandle.allocate``), for every tensor created on this
        provider's device (tensor.py: kernel outputs, uploads of feeds and weights), and once per
        captured signature for the capture arena (session/device_graphs.py).
        """

    @hookspec(firstresult=True)
    def allocate_committed(
        self, size: int, alignment: int, committed_ranges: Sequence[tuple[int, int]] | None
    ) -> DeviceBuffer:
        """Allocate address space, committing only ``committed_ranges`` (list of (start, stop)).

        Default: checks that the ranges lie inside the allocation, then allocates everything
        through ``allocate`` (for providers that cannot reserve without committing).
        Called by: session/device_io_binding.py, once per ``DeviceIoBinding.allocate``.
        """

    @hookspec(firstresult=True)
    def commit_allocation_range(self, buffer: DeviceBuffer, offset: int, nbytes: int) -> None:
        """Ensure ``buffer[offset:offset+nbytes]`` is backed by memory.

        Default: bounds check only (``allocate_committed``'s default commits everything).
        Called by: session/device_io_binding.py (``commit_range``); the default ``commit_allocation_ranges``.
        """

    @hookspec(firstresult=True)
    def commit_allocation_ranges(self, ranges: Sequence[tuple[DeviceBuffer, int, int]]) -> None:
        """Commit a list of ``(buffer, offset, nbytes)`` as one transaction.

        Default: ``commit_allocation_range`` for each, in order.
        Called by: session/device_io_binding.py (``DeviceIoBinding.commit_binding_ranges``).
        """

    @hookspec(firstresult=True)
    def decommit_allocation_range(self, buffer: DeviceBuffer, offset: int, nbytes: int) -> None:
        """Release the memory behind ``buffer[offset:offset+nbytes]``, keeping its addresses reserved.

        Default: :class:`NotSupportedError` (an eager allocation has nothing to decommit).
        Called by: session/device_io_binding.py (``DeviceIoBinding.decommit_range``).
        """

    @hookspec(firstresult=True)
    def allocation_committed_bytes(self, buffer: DeviceBuffer) -> int:
        """Bytes of ``buffer`` backed by memory.

        Default: all of it (``buffer.size``).
        Called by: session/device_io_binding.py (``DeviceIoBinding.committed_bytes``).
        """

    @hookspec(firstresult=True)
    def deallocate(self, buffer: DeviceBuffer) -> None:
        """Free an owned buffer this provider allocated.

        The core calls this at most once per buffer and never for borrowed buffers, so an
        implementation only releases memory.
        Default: nothing to release for host memory (the handle then drops the host backing);
        :class:`NotSupportedError` for a device buffer without one.
        Called by: provider_handle.py (``ProviderHandle.deallocate``), when a tensor on this device
        is closed or collected (tensor.py; intermediates right after their last consumer), and when
        a capture arena is freed (session/device_graphs.py).
        """

    @hookspec(firstresult=True)
    def device_allocation_counts(self) -> tuple[int, int] | None:
        """``(allocations, frees)`` made through this provider so far, or None when not counted.

        Default: the counts of the default ``allocate`` and ``deallocate``; None once the provider
        implements either (the counts would be partial).
        Called by: provider_handle.py (``ProviderHandle.allocation_counts``), on request only (tests
        and tools); no session calls it.
        """

    # -- copies and ordering ------------------------------------------------------------------
    @hookspec(firstresult=True)
    def copy(self, src: DeviceBuffer, dst: DeviceBuffer, size: int) -> None:
        """Synchronously copy ``size`` bytes from buffer ``src`` to buffer ``dst``.

        Default: host memcpy when both are host-accessible, with bounds checks.
        Called by: tensor.py (``Tensor.try_clone`` of a device tensor), and session/io_binding.py
        (``copy_on_device``) for the device-to-device copies of IO-bound and replayed runs when the
        provider does not implement ``copy_device_to_device``.
        """

    @hookspec(firstresult=True)
    def copy_async(self, src: DeviceBuffer, dst: DeviceBuffer, size: int) -> Fence:
        """Enqueue a copy on the transfer stream and return a :class:`Fence` for its completion.

        A consumer of ``dst`` must be ordered after it with ``wait_fence``.
        Default: ``copy`` synchronously and return an already-signalled fence.
        Called by: not by the core (providers' own kernels and tools).
        """

    @hookspec(firstresult=True)
    def wait_fence(self, fence: Fence) -> None:
        """Make the compute stream wait for ``fence`` (no host blocking).

        Default: no-op.
        Called by: not by the core (providers' own kernels and tools).
        """

    @hookspec(firstresult=True)
    def record_compute_fence(self) -> Fence:
        """A :class:`Fence` over all compute enqueued so far (for write-after-read ordering of a
        later transfer into a buffer that compute still reads).

        Default: an already-signalled fence.
        Called by: not by the core (providers' own kernels and tools).
        """

    @hookspec(firstresult=True)
    def copy_wait_fence(self, fence: Fence) -> None:
        """Make the transfer stream wait for a compute ``fence``.

        Default: no-op.
        Called by: not by the core (providers' own kernels and tools).
        """

    @hookspec(firstresult=True)
    def copy_from_host(self, src: HostBytes, dst: DeviceBuffer) -> None:
        """Synchronously upload host bytes ``src`` (bytes-like or C-contiguous array) into ``dst``.

        Default: bounds-checked memcpy into a host-accessible ``dst``; else :class:`NotSupportedError`.
        Called by: provider_handle.py (``ProviderHandle.copy_from_host``), for every upload: tensors
        created from host data (tensor.py: feeds and weights crossing to this device, ``OrtValue``),
        host values written into bound outputs (session/io_binding.py), and the feeds of each replayed
        device graph (session/device_graphs.py).
        """

    @hookspec(firstresult=True)
    def copy_from_host_at(self, src: HostBytes, dst: DeviceBuffer, byte_offset: int) -> None:
        """Upload ``src`` into ``dst`` starting at ``byte_offset``; overflow and bounds checked.

        Default: memcpy into a host-accessible ``dst``; else the provider's ``copy_from_host`` into an alias.
        Called by: session/device_io_binding.py (``DeviceIoBinding.write_bytes``).
        """

    @hookspec(firstresult=True)
    def copy_to_host(self, src: DeviceBuffer, dst: WritableHostBytes) -> None:
        """Synchronously download the first ``len(dst)`` bytes of buffer ``src`` into writable
        host memory ``dst`` (bytearray, memoryview or uint8 array).

        Default: bounds-checked memcpy from a host-accessible ``src``; else :class:`NotSupportedError`.
        Called by: provider_handle.py (``ProviderHandle.copy_to_host`` and ``download``), whenever a
        tensor on this device is read on the host (tensor.py ``Tensor.numpy``: outputs, values a host
        node consumes).
        """

    @hookspec(firstresult=True)
    def copy_device_to_device(
        self, src: DeviceBuffer, src_offset: int, dst: DeviceBuffer, dst_offset: int, nbytes: int
    ) -> None:
        """Stream-ordered device-to-device copy between two buffers of this provider.

        Default: host memmove on host-accessible devices, bounds checked; else
        :class:`NotSupportedError`.
        Called by: session/io_binding.py (``copy_on_device``), where the provider implements it, for a
        kernel's output written into a bound output buffer and for the copy of a replayed graph's output
        kept on the device (session/device_graphs.py): no host synchronization.
        """

    @hookspec(firstresult=True)
    def device_copy_rows(
        self, src: DeviceBuffer, src_offset: int, src_pitch: int, dst: DeviceBuffer, dst_offset: int,
        dst_pitch: int, row_bytes: int, rows: int,
    ) -> None:
        """Stream-ordered device-to-device copy of ``rows`` rows of ``row_bytes`` bytes: row ``i`` from byte
        ``src_offset + i * src_pitch`` of ``src`` to byte ``dst_offset + i * dst_pitch`` of ``dst`` (each pitch at
        least ``row_bytes``; the two regions must not overlap). It is for strided state, such as a KV cache whose
        heads each hold a run of rows at a fixed stride: one pitched (2-D) copy where the device has one, instead
        of a copy per row, and one node in a captured graph. Added in contract 1.2.

        Default: one ``copy_device_to_device`` per row (host buffers, and providers that implement it), else one
        synchronous ``copy`` per row over aliases of the rows; bounds, pitches and overlap checked.
        Called by: generate.py (``_CapacityBindings``), once per KV cache per decode step, to move the rows a
        run appended to their place in the cache.
        """

    @hookspec(firstresult=True)
    def sync(self) -> None:
        """Block until all work enqueued on this provider has completed.

        Default: no-op.
        Called by: provider_handle.py (``ProviderHandle.sync``), from ``Tensor.sync`` (tensor.py,
        before a DLPack export) and IO binding's ``synchronize_inputs`` / ``synchronize_outputs``
        (session/io_binding.py).
        """

    @hookspec(firstresult=True)
    def order_device_access(self, reads: Sequence[DeviceBuffer], writes: Sequence[DeviceBuffer]) -> None:
        """Order this provider's next work on its own stream after other streams' use of ``reads`` (buffers its
        next work reads) and ``writes`` (buffers it writes): a read waits for the buffer's last writer, a write
        for the last writer and every reader since, with no host blocking. For a provider that runs each
        instance (each session) on a stream of its own: a tensor one session produced and another reads (an
        output fed on, an IO binding's buffer, a ``DeviceIoBinding`` handed over) is ordered here, and a free
        waits for the readers the provider recorded. Buffers of another device or on the host are not passed.
        Called outside device graph captures, before every run and every replay, so a replay is ordered too; with
        device graphs on, before every run, with empty lists when it has no such buffers (since 1.5), so the
        buffers named last belong to the capture or replay that follows. Added in contract 1.4.

        Default: no-op (one stream per device orders everything in the order the host enqueued it).
        Called by: session/executor.py (``Executor.run_bound``: the run's device feeds and bound output buffers,
        one call per device provider per run), only for providers that implement it.
        """

    @hookspec(firstresult=True)
    def borrow_device_memory(self, buffer: DeviceBuffer) -> None:
        """A session borrowed ``buffer``: caller-owned memory on this provider's device (a ``DeviceIoBinding``
        made from an ``ExternalMemorySpec``) that the session never frees. The provider records this instance as
        the memory's owner for as long as the borrow lasts: its ordering attributes the memory's earlier work to
        this instance's stream (not to whichever instance happens to order it first, which may only read it), and
        every address inside it (an alias at an offset) is the one memory. Each call is paired with one
        ``return_device_memory``. Added in contract 1.5.

        Default: no-op (one stream per device needs no owner).
        Called by: session/device_io_binding.py (``DeviceIoBinding.from_external_memory``), for device memory.
        """

    @hookspec(firstresult=True)
    def return_device_memory(self, buffer: DeviceBuffer) -> None:
        """The borrow ``borrow_device_memory`` began has ended: the binding was released, after the session
        synchronized the provider, and the caller may free or reuse the memory at once. The provider forgets what
        it recorded of it, and a device graph of another instance that recorded its address is reset (that
        instance's next run captures afresh) rather than replayed on memory that is no longer lent. Added in
        contract 1.5.

        Default: no-op.
        Called by: session/device_io_binding.py (``DeviceIoBinding.close``), once per borrow that was not
        quarantined.
        """


HOOK_NAMES = tuple(
    name
    for spec in (ExecutionProviderSpec, DeviceExecutionSpec, MemoryGovernanceSpec, ResidencySpec)
    for name, value in vars(spec).items()
    if callable(value) and not name.startswith("_")
)
