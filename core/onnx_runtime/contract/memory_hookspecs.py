"""The memory half of the execution-provider contract: one memory budget per device shared by every provider
and session (governance, workspace leases, mapped growth), weights paged on demand, sealed constants,
executor-scoped artifacts, and the identity and staging hooks an executor asks before compiling.
:class:`onnx_runtime.contract.hookspecs.ExecutionProviderSpec` inherits these hooks; the module docstring of
:mod:`onnx_runtime.contract.hookspecs` says how every hook is called, defaulted and documented.

Every default here answers as a provider without a governor, a residency cache or executor artifacts: nothing
is governed, nothing is resident, workspace is a plain ``allocate`` (defaults in contract/memory_defaults.py,
value types in contract/residency.py and contract/executor_artifacts.py). The session calls the governance
and lazy-weight hooks through the core's memory package (onnx_runtime.memory, docs/memory.md); the rest are the
surface executors build on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .markers import hookspec

if TYPE_CHECKING:
    from ..ir import Graph, Node
    from .buffers import DeviceBuffer, HostBytes
    from .executor_artifacts import (
        ExecutorArtifactGeneration,
        ExecutorArtifactPolicy,
        ExecutorArtifactProviderId,
        ExecutorArtifactReadinessEpoch,
        ExecutorArtifactReport,
        ExecutorArtifactRequirementState,
        ExecutorInstanceId,
        ExecutorKernelScope,
    )
    from .kernels import Kernel, KernelMatch
    from .residency import (
        ExecutionProviderCapabilities,
        HolderId,
        HostToDeviceCopier,
        LazyWeight,
        MappedGrowthGrant,
        MemoryGovernor,
        MemoryLease,
        MemoryRole,
        MmapRegionSource,
        PagedWeight,
        ProviderContextIdentity,
        RawDeviceAllocationSiteStats,
        RoutedResidencyGuard,
        RoutedResidencyRequirement,
        SealedDeviceAllocation,
        Tier,
        WeightRegionCatalog,
        WorkspaceAllocation,
    )


class MemoryGovernanceSpec:
    """Hooks that put a provider's device memory under the process-wide governor: standing pools, workspace
    leases and mapped growth."""

    # -- governance ---------------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def adopt_memory_governor(self, governor: MemoryGovernor, tier: Tier, holder: HolderId) -> int:
        """Place the long-lived device memory this provider holds (a weight-residency cache, a KV pool) under
        ``governor``, charged to ``holder`` on ``tier``, and return the bytes now governed.

        A pool that sizes itself is a second claim on memory the governor is dividing; this hook ends that.
        Raise a :class:`ProviderError` when the tier cannot afford what the provider already holds: the model
        does not fit, and saying so now beats failing at an unrelated allocation later. The core's governor
        (``onnx_runtime.memory.DeviceGovernor``) also takes ``set_total(nbytes)``: a provider that knows the
        device's memory reports it here, so a limit can be given as a fraction of it.
        Default: 0 (no standing pool; not a failure).
        Called by: the session at creation, for each device provider its nodes run on, with the
        process governor's view of that device (memory/session.py), before it applies the session's limits.
        """

    @hookspec(firstresult=True)
    def set_weight_residency_budget(self, budget_bytes: int) -> int | None:
        """Resize the provider's weight-residency budget before it joins a governor, returning the budget it
        will adopt, so that load-time admission can subtract the non-weight claims (KV, workspace) first.

        Default: None (the provider keeps no weight-residency budget).
        Called by: the session at creation when ``session.weight_residency_budget`` is set; a
        returned budget replaces the configured one (memory/session.py).
        """

    @hookspec(firstresult=True)
    def commits_on_demand(self) -> bool:
        """Whether the memory this provider hands out commits physically as it is used rather than when it is
        requested (lazy mapping and governor charging both), forwarded from its allocator.

        Default: False, the safe answer: a caller that believes True under-reserves.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def allocation_charged_by_provider(self, buffer: DeviceBuffer) -> bool:
        """Whether the provider itself charges ``buffer``'s committed bytes to the governor it adopted (an
        allocation with committed ranges on reserved address space, mapped under growth grants as it commits).

        The core charges every other allocation's committed bytes (``allocation_committed_bytes``) to the session
        that made it; answering True for a buffer the provider does not charge leaves it outside every budget,
        answering False for one it does charges it twice.
        Default: False (the core charges the buffer).
        Called by: memory/accounts.py, for each ``allocate_committed`` a session's account makes.
        """

    @hookspec(firstresult=True)
    def raw_device_allocation_site_stats(self) -> list[RawDeviceAllocationSiteStats]:
        """Allocations made outside the ``allocate`` hook (driver calls, pools), attributed to their source
        site, for memory reports.

        Default: an empty list.
        Called by: not by the core.
        """

    # -- workspace ----------------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def reserve_workspace(self, nbytes: int, role: MemoryRole) -> MemoryLease | None:
        """Reserve governed bytes for executor-owned kernel workspace; the lease travels with the buffer.

        A provider whose allocator already charges committed bytes returns None.
        Default: None (no governor: nothing to reserve).
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def allocate_workspace(self, size: int, alignment: int, role: MemoryRole) -> WorkspaceAllocation:
        """Allocate executor workspace as one transaction: the mapped bytes it needs
        (``mapped_bytes_for_allocation``), a mapped-growth grant (``prepare_mapped_growth``), a lease
        (``reserve_workspace``), then the buffer, with the grant committed. A failed step releases what the
        earlier ones took.

        Default: that sequence through the provider's own hooks; with none of them implemented, a plain
        ``allocate`` charged by the session's memory account (``ProviderHandle.allocate``) and no lease.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def replace_workspace(
        self, old: WorkspaceAllocation | None, size: int, alignment: int, role: MemoryRole
    ) -> WorkspaceAllocation:
        """Replace executor workspace, granting the new one only once the old one's release is settled.

        A provider whose releases are deferred awaits the old release with a finite deadline.
        Default: ``deallocate_workspace(old)`` (when given), then ``allocate_workspace``.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def deallocate_workspace(self, workspace: WorkspaceAllocation) -> None:
        """Free a workspace buffer, then release its lease.

        When the buffer's release fails the lease is not released: it is kept in quarantine
        (:func:`onnx_runtime.contract.residency.quarantined_workspace_leases`) so the bytes, never proven
        free, stay charged, and the error propagates.
        Default: exactly that, for providers whose ``deallocate`` settles synchronously; a borrowed buffer is
        not freed, a freed one is refused.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def wait_for_deferred_releases(self) -> None:
        """Wait until every release ``deallocate`` accepted has settled (a lifecycle boundary, such as
        dropping an allocator, not a per-operation synchronization).

        Default: no-op (synchronous providers have nothing deferred).
        Called by: the governor, through the session's allocation account, before it gives back
        the bytes of a freed buffer of a provider that implements it (memory/accounts.py).
        """

    # -- mapped growth ------------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def prepare_mapped_growth(self, nbytes: int, role: MemoryRole) -> MappedGrowthGrant | None:
        """A grant to map up to ``nbytes`` more physical memory for ``role`` (a provider that suballocates
        shared granules canonicalizes ``role`` to the zone that owns the mapping).

        Default: None (no governor: growth is not granted separately).
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def mapped_bytes_for_allocation(self, size: int, alignment: int) -> int:
        """The physical bytes an allocation of ``size`` would newly map (granule rounding included, memory
        already mapped excluded), for sizing a grant before allocating.

        Default: ``size``.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def mapped_bytes_for_allocation_ranges(self, ranges: Sequence[tuple[DeviceBuffer, int, int]]) -> int:
        """The physical bytes committing ``ranges`` (``(buffer, offset, nbytes)``) would newly map.

        Default: the sum of the ranges' ``nbytes``.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def allocate_with_mapped_growth(self, size: int, alignment: int, grant: MappedGrowthGrant) -> DeviceBuffer:
        """Allocate ``size`` bytes and commit the bytes it mapped to ``grant``; when the grant cannot cover
        them the allocation is freed again and the error raised.

        Default: ``mapped_bytes_for_allocation``, ``allocate``, then ``grant.commit_bytes``.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def commit_allocation_ranges_with_mapped_growth(
        self, ranges: Sequence[tuple[DeviceBuffer, int, int]], grant: MappedGrowthGrant
    ) -> int:
        """Commit ``ranges`` as one transaction charged to ``grant`` and return the bytes newly mapped.

        Default: ``commit_allocation_ranges`` then ``mapped_bytes_for_allocation_ranges`` (an eager provider
        committed everything at allocation time).
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def release_mapped_growth(self, nbytes: int, role: MemoryRole) -> None:
        """Return ``nbytes`` of mapped growth for ``role`` (the same canonical zone as
        ``prepare_mapped_growth``: allocation lifetime is not map ownership).

        Default: no-op.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def deallocate_with_unmapped(self, buffer: DeviceBuffer) -> int:
        """Free ``buffer`` and return the mapped bytes actually unmapped (after shared mapping references).

        Default: ``deallocate`` with the core's ownership rules, then 0.
        Called by: not by the core.
        """


class ResidencySpec:
    """Hooks for weights paged on demand, sealed constants, executor-scoped artifacts, and what an executor
    asks a provider before compiling (capabilities, staging, node support through the graph)."""

    # -- identity and staging -----------------------------------------------------------------------
    @hookspec(firstresult=True)
    def memory_vendor_id(self) -> int:
        """The PCI vendor id of this provider's device memory (0 for generic or host memory), for naming the
        device memory to a host framework that registered an allocator against it.

        Default: 0.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def host_to_device_copier(self) -> HostToDeviceCopier | None:
        """A small synchronous uploader an executor keeps (without holding the provider) to stage
        host-resident inputs into device scratch before a device kernel.

        Default: None (host providers: inputs are used as they are).
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def capabilities(self) -> ExecutionProviderCapabilities:
        """What the executor may hand this provider's kernels beyond resident tensors (e.g. paged weights).

        Default: ``ExecutionProviderCapabilities.stock()``: nothing beyond resident tensors.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def supports_node(self, graph: Graph, node: Node) -> KernelMatch:
        """``supports_op`` asked through the graph holding ``node``: a provider can answer from the graph's
        own metadata instead of per-input lists.

        Default: ``supports_op`` with the node's opset and each input's shape, dtype and default layout as
        ``graph`` knows them (as placement does).
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def runtime_identity(self) -> int | None:
        """Identity of the runtime/context this provider's kernels use; a kernel rejects a sealed constant of
        another runtime.

        Default: None (the provider takes no part in sealed constants).
        Called by: the session at creation, to decide whether the provider takes part in sealed
        constants (memory/sealed.py).
        """

    @hookspec(firstresult=True)
    def provider_context_identity(self) -> ProviderContextIdentity | None:
        """Identity of the provider memory context that owns sealed constants.

        Default: None.
        Called by: the sealed-constant registry, as part of each constant's key.
        """

    # -- sealed constants ---------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def prepares_immutable_constant(self, node: Node, input_index: int) -> bool:
        """Whether this provider replaces constant input ``input_index`` of ``node`` with immutable
        provider-owned storage while preparing the kernel; the session may skip the ordinary resident
        initializer only when every consumer says True.

        Default: False (the resident initializer is kept).
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def upload_sealed_constant(self, data: HostBytes, alignment: int) -> SealedDeviceAllocation:
        """Validate and upload graph-constant ``data`` once into immutable device memory shared by every
        session of the model on this context. The memory belongs to the context, not to this provider instance:
        it outlives the session that uploaded it, and the allocation's ``release()`` frees it.

        Default: :class:`NotSupportedError` (fails closed: a provider opts in to sealed constants).
        Called by: the sealed-constant registry when an unpaged session's weight is not sealed on
        this context yet (memory/sealed.py).
        """

    # -- lazy weights -------------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def page_lazy_weight(self, key: int, weight: LazyWeight, source: MmapRegionSource) -> PagedWeight | None:
        """Make a memory-mapped weight resident for a kernel; ``key`` is a stable per-weight identity the
        provider may cache and evict by across runs. The executor keeps the :class:`PagedWeight` for the
        kernel's lifetime.

        Default: None (no residency cache: the executor materializes the weight on the host).
        Called by: the session's page step before each node that reads a weight, when the provider
        implements it (memory/weights.py); the core then keeps no residency cache of its own.
        """

    @hookspec(firstresult=True)
    def page_lazy_weight_for_executor(
        self, executor: ExecutorInstanceId, key: int, weight: LazyWeight, source: MmapRegionSource
    ) -> PagedWeight | None:
        """``page_lazy_weight`` scoped to one executor, for providers with executor-owned reservations.

        Default: ``page_lazy_weight`` (unscoped).
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def prefetch_lazy_weight(self, key: int, weight: LazyWeight, source: MmapRegionSource) -> bool:
        """Best-effort lookahead page-in of a weight a later node needs; True only when a transfer was
        actually enqueued.

        Default: False (no-op).
        Called by: the session after paging a node's weights, for the next page step's weight
        (memory/weights.py).
        """

    @hookspec(firstresult=True)
    def prefetch_lazy_weight_for_executor(
        self, executor: ExecutorInstanceId, key: int, weight: LazyWeight, source: MmapRegionSource
    ) -> bool:
        """``prefetch_lazy_weight`` scoped to one executor.

        Default: ``prefetch_lazy_weight`` (unscoped).
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def acquire_routed_residency(
        self, key: int, requirement: RoutedResidencyRequirement, catalog: WeightRegionCatalog
    ) -> RoutedResidencyGuard | None:
        """Prove residency of a mixture-of-experts weight bank for one dispatch and return a guard the
        executor keeps for the kernel's lifetime; ``catalog`` lists the expert regions per weight.

        Default: None (no guard; the executor does not gate on one).
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def acquire_routed_residency_for_executor(
        self, executor: ExecutorInstanceId, key: int, requirement: RoutedResidencyRequirement,
        catalog: WeightRegionCatalog,
    ) -> RoutedResidencyGuard | None:
        """``acquire_routed_residency`` scoped to one executor.

        Default: ``acquire_routed_residency`` (unscoped).
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def consume_route_residency_at_boundary_for_executor(self, executor: ExecutorInstanceId) -> None:
        """Consume this executor's completed route-telemetry window, after the session synchronized the
        device; only that executor's state may be consulted.

        Default: no-op (no route lifecycle).
        Called by: not by the core.
        """

    # -- executor-scoped artifacts -------------------------------------------------------------------
    @hookspec(firstresult=True)
    def executor_kernel_scope(self, node: Node) -> ExecutorKernelScope:
        """Whether ``node``'s kernel publishes executor-owned artifacts and so must be built through
        ``get_kernel_for_executor`` (REQUIRED) rather than ``get_kernel``.

        Default: ``ExecutorKernelScope.UNSCOPED``.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def get_kernel_for_executor(
        self, artifact_provider: ExecutorArtifactProviderId, executor: ExecutorInstanceId,
        generation: ExecutorArtifactGeneration, node: Node, shapes: Sequence[tuple[int, ...] | None], opset: int,
        graph: Graph,
    ) -> Kernel:
        """``get_kernel`` attributed to one executor generation, so compiled artifacts belong to it rather
        than to a node id shared by sibling executors; foreign provider labels and stale generations are
        rejected before anything is published.

        Default: ``get_kernel`` (the labels are ignored: the provider owns no executor artifacts).
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def executor_artifact_policy(self) -> ExecutorArtifactPolicy:
        """Immutable policy data the session snapshots before compiling an executor (no authority in it).

        Default: unscoped provider label, this provider's device, route residency disabled.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def inspect_executor_artifacts(
        self, artifact_provider: ExecutorArtifactProviderId, executor: ExecutorInstanceId,
        generation: ExecutorArtifactGeneration, readiness: ExecutorArtifactReadinessEpoch, graph: Graph,
        banks: Sequence[object],
    ) -> ExecutorArtifactReport:
        """Report which provider artifacts one executor generation needs, after its kernels are built and
        before any run; idempotent, asked at most once per readiness epoch. ``banks`` are the model's
        finalized expert banks.

        Default: a report echoing the labels, DISABLED when the policy disables route residency, else
        DECLINED.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def drain_executor_artifacts(
        self, artifact_provider: ExecutorArtifactProviderId, executor: ExecutorInstanceId,
        generation: ExecutorArtifactGeneration,
    ) -> None:
        """Drop exactly the artifacts owned by ``executor`` (idempotent; a sibling executor's are untouched,
        a foreign or stale scope fails without consuming anything).

        Default: no-op.
        Called by: not by the core.
        """

    @hookspec(firstresult=True)
    def executor_artifact_requirement(
        self, artifact_provider: ExecutorArtifactProviderId, executor: ExecutorInstanceId,
        generation: ExecutorArtifactGeneration,
    ) -> ExecutorArtifactRequirementState | None:
        """The retained requirement behind a REQUIRED report, kept by the session and by every graph baked
        from it; the same state answers after teardown so a stale graph fails closed.

        Default: None (nothing required).
        Called by: not by the core.
        """
