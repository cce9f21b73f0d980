"""Defaults of the memory-governance and residency hooks (contract/memory_hookspecs.py), mirroring the seed
trait's default methods: nothing governed, nothing resident, no executor artifacts, workspace as a plain
allocation, and the composite hooks (workspace transactions, mapped growth, executor-scoped variants) built
from the provider's own simpler hooks, so a provider that implements ``allocate`` or ``page_lazy_weight``
gets the composites for free.

:class:`MemoryDefaults` is a mixin of :class:`onnx_runtime.contract.defaults.DefaultFallbacks`; it calls the
provider's hooks through the handle, so an override of any step is honoured by the composites.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..errors import InvalidArgumentError, NotSupportedError
from .buffers import DeviceBuffer
from .executor_artifacts import (
    ExecutorArtifactPolicy,
    ExecutorArtifactProviderId,
    ExecutorArtifactReport,
    ExecutorArtifactState,
    ExecutorArtifactStateKind,
    ExecutorKernelScope,
    ExecutorRouteResidencyConfig,
)
from .kernels import input_facts
from .markers import hookimpl
from .residency import (
    ExecutionProviderCapabilities,
    MappedGrowthGrant,
    MemoryLease,
    WorkspaceAllocation,
    quarantine_failed_workspace_lease,
)

if TYPE_CHECKING:
    from ..ir import Graph, Node
    from .buffers import HostBytes
    from .executor_artifacts import (
        ExecutorArtifactGeneration,
        ExecutorArtifactReadinessEpoch,
        ExecutorArtifactRequirementState,
        ExecutorInstanceId,
    )
    from .handle import ContractHandle
    from .kernels import Kernel, KernelMatch
    from .residency import (
        HolderId,
        HostToDeviceCopier,
        LazyWeight,
        MemoryGovernor,
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
    )


def release_buffer(handle: ContractHandle, buffer: DeviceBuffer) -> None:
    """Free ``buffer`` through ``handle`` with the core's ownership rules (ProviderHandle.deallocate's):
    a freed buffer is refused, a borrowed one is only marked released, an owned one is freed exactly once;
    the memory governor's charge for it is released with it."""
    if buffer.released:
        raise InvalidArgumentError(
            f"{handle.name}: buffer at {buffer.ptr:#x} was already freed; every buffer is freed exactly once")
    if not buffer.is_borrowed:
        device = handle.hook.device_id()
        if buffer.device != device:
            raise InvalidArgumentError(
                f"{handle.name} cannot free a buffer of device {buffer.device}; return it to the provider that "
                f"allocated it ({device} is this provider's device)")
        handle.hook.deallocate(buffer=buffer)
    buffer.mark_released()
    account = getattr(handle, "memory_account", None)
    if account is not None:  # the governor's charge for it (memory/accounts.py) goes back
        account.released(buffer)


class MemoryDefaults:
    """Default implementations of the memory and residency hooks for one provider handle."""

    _handle: ContractHandle

    # -- governance ---------------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def adopt_memory_governor(self, governor: MemoryGovernor, tier: Tier, holder: HolderId) -> int:
        return 0

    @hookimpl(trylast=True)
    def set_weight_residency_budget(self, budget_bytes: int) -> int | None:
        return None

    @hookimpl(trylast=True)
    def commits_on_demand(self) -> bool:
        return False

    @hookimpl(trylast=True)
    def allocation_charged_by_provider(self, buffer: DeviceBuffer) -> bool:
        return False

    @hookimpl(trylast=True)
    def raw_device_allocation_site_stats(self) -> list[RawDeviceAllocationSiteStats]:
        return []

    # -- workspace ----------------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def reserve_workspace(self, nbytes: int, role: MemoryRole) -> MemoryLease | None:
        return None

    @hookimpl(trylast=True)
    def allocate_workspace(self, size: int, alignment: int, role: MemoryRole) -> WorkspaceAllocation:
        hook = self._handle.hook
        target = hook.mapped_bytes_for_allocation(size=size, alignment=alignment)
        grant: MappedGrowthGrant | None = hook.prepare_mapped_growth(nbytes=target, role=role)
        try:
            lease: MemoryLease | None = hook.reserve_workspace(nbytes=size, role=role)
        except BaseException:
            if grant is not None:
                grant.release()
            raise
        try:
            account = getattr(self._handle, "memory_account", None)
            if grant is not None:
                buffer = hook.allocate_with_mapped_growth(size=size, alignment=alignment, grant=grant)
            elif lease is None and account is not None:
                # Neither a grant nor a lease governs it: the session's account charges it like any buffer it
                # allocates (memory/accounts.py), and release_buffer gives the charge back.
                buffer = account.allocate(size, alignment)
            else:
                buffer = hook.allocate(size=size, alignment=alignment)
        except BaseException:
            # Nothing was allocated, so the lease and the unused grant go back.
            if lease is not None:
                lease.release()
            if grant is not None:
                grant.release()
            raise
        return WorkspaceAllocation(buffer, lease)

    @hookimpl(trylast=True)
    def replace_workspace(
        self, old: WorkspaceAllocation | None, size: int, alignment: int, role: MemoryRole
    ) -> WorkspaceAllocation:
        if old is not None:
            self._handle.hook.deallocate_workspace(workspace=old)
        return self._handle.hook.allocate_workspace(size=size, alignment=alignment, role=role)

    @hookimpl(trylast=True)
    def deallocate_workspace(self, workspace: WorkspaceAllocation) -> None:
        buffer, lease = workspace.into_parts()
        try:
            release_buffer(self._handle, buffer)
        except BaseException:
            if lease is not None and not lease.released:
                quarantine_failed_workspace_lease(lease, self._handle.name)
            raise
        if lease is not None:
            lease.release()

    @hookimpl(trylast=True)
    def wait_for_deferred_releases(self) -> None:
        return None

    # -- mapped growth ------------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def prepare_mapped_growth(self, nbytes: int, role: MemoryRole) -> MappedGrowthGrant | None:
        return None

    @hookimpl(trylast=True)
    def mapped_bytes_for_allocation(self, size: int, alignment: int) -> int:
        if size < 0:
            raise InvalidArgumentError(f"{self._handle.name}: allocation size must be non-negative, got {size}")
        return size

    @hookimpl(trylast=True)
    def mapped_bytes_for_allocation_ranges(self, ranges: Sequence[tuple[DeviceBuffer, int, int]]) -> int:
        return sum(nbytes for _, _, nbytes in ranges)

    @hookimpl(trylast=True)
    def allocate_with_mapped_growth(self, size: int, alignment: int, grant: MappedGrowthGrant) -> DeviceBuffer:
        hook = self._handle.hook
        newly_mapped = hook.mapped_bytes_for_allocation(size=size, alignment=alignment)
        buffer: DeviceBuffer = hook.allocate(size=size, alignment=alignment)
        try:
            grant.commit_bytes(newly_mapped)
        except BaseException:
            release_buffer(self._handle, buffer)
            raise
        return buffer

    @hookimpl(trylast=True)
    def commit_allocation_ranges_with_mapped_growth(
        self, ranges: Sequence[tuple[DeviceBuffer, int, int]], grant: MappedGrowthGrant
    ) -> int:
        self._handle.hook.commit_allocation_ranges(ranges=ranges)
        mapped: int = self._handle.hook.mapped_bytes_for_allocation_ranges(ranges=ranges)
        return mapped

    @hookimpl(trylast=True)
    def release_mapped_growth(self, nbytes: int, role: MemoryRole) -> None:
        return None

    @hookimpl(trylast=True)
    def deallocate_with_unmapped(self, buffer: DeviceBuffer) -> int:
        release_buffer(self._handle, buffer)
        return 0

    # -- identity and staging -----------------------------------------------------------------------
    @hookimpl(trylast=True)
    def memory_vendor_id(self) -> int:
        return 0

    @hookimpl(trylast=True)
    def host_to_device_copier(self) -> HostToDeviceCopier | None:
        return None

    @hookimpl(trylast=True)
    def capabilities(self) -> ExecutionProviderCapabilities:
        return ExecutionProviderCapabilities.stock()

    @hookimpl(trylast=True)
    def supports_node(self, graph: Graph, node: Node) -> KernelMatch:
        shapes, dtypes, layouts = input_facts(graph, node)
        match: KernelMatch = self._handle.hook.supports_op(
            node=node, opset=node.opset, shapes=shapes, dtypes=dtypes, layouts=layouts)
        return match

    @hookimpl(trylast=True)
    def runtime_identity(self) -> int | None:
        return None

    @hookimpl(trylast=True)
    def provider_context_identity(self) -> ProviderContextIdentity | None:
        return None

    # -- sealed constants ---------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def prepares_immutable_constant(self, node: Node, input_index: int) -> bool:
        return False

    @hookimpl(trylast=True)
    def upload_sealed_constant(self, data: HostBytes, alignment: int) -> SealedDeviceAllocation:
        raise NotSupportedError(
            f"sealed constants are not supported by {self._handle.name}; a provider opts in by implementing "
            f"the upload_sealed_constant hook (with runtime_identity and provider_context_identity)")

    # -- lazy weights -------------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def page_lazy_weight(self, key: int, weight: LazyWeight, source: MmapRegionSource) -> PagedWeight | None:
        return None

    @hookimpl(trylast=True)
    def page_lazy_weight_for_executor(
        self, executor: ExecutorInstanceId, key: int, weight: LazyWeight, source: MmapRegionSource
    ) -> PagedWeight | None:
        paged: PagedWeight | None = self._handle.hook.page_lazy_weight(key=key, weight=weight, source=source)
        return paged

    @hookimpl(trylast=True)
    def prefetch_lazy_weight(self, key: int, weight: LazyWeight, source: MmapRegionSource) -> bool:
        return False

    @hookimpl(trylast=True)
    def prefetch_lazy_weight_for_executor(
        self, executor: ExecutorInstanceId, key: int, weight: LazyWeight, source: MmapRegionSource
    ) -> bool:
        return bool(self._handle.hook.prefetch_lazy_weight(key=key, weight=weight, source=source))

    @hookimpl(trylast=True)
    def acquire_routed_residency(
        self, key: int, requirement: RoutedResidencyRequirement, catalog: WeightRegionCatalog
    ) -> RoutedResidencyGuard | None:
        return None

    @hookimpl(trylast=True)
    def acquire_routed_residency_for_executor(
        self, executor: ExecutorInstanceId, key: int, requirement: RoutedResidencyRequirement,
        catalog: WeightRegionCatalog,
    ) -> RoutedResidencyGuard | None:
        guard: RoutedResidencyGuard | None = self._handle.hook.acquire_routed_residency(
            key=key, requirement=requirement, catalog=catalog)
        return guard

    @hookimpl(trylast=True)
    def consume_route_residency_at_boundary_for_executor(self, executor: ExecutorInstanceId) -> None:
        return None

    # -- executor-scoped artifacts -------------------------------------------------------------------
    @hookimpl(trylast=True)
    def executor_kernel_scope(self, node: Node) -> ExecutorKernelScope:
        return ExecutorKernelScope.UNSCOPED

    @hookimpl(trylast=True)
    def get_kernel_for_executor(
        self, artifact_provider: ExecutorArtifactProviderId, executor: ExecutorInstanceId,
        generation: ExecutorArtifactGeneration, node: Node, shapes: Sequence[tuple[int, ...] | None], opset: int,
        graph: Graph,
    ) -> Kernel:
        kernel: Kernel = self._handle.hook.get_kernel(node=node, shapes=shapes, opset=opset, graph=graph)
        return kernel

    @hookimpl(trylast=True)
    def executor_artifact_policy(self) -> ExecutorArtifactPolicy:
        return ExecutorArtifactPolicy(
            ExecutorArtifactProviderId.UNSCOPED, self._handle.hook.device_id(), ExecutorRouteResidencyConfig.DISABLED)

    @hookimpl(trylast=True)
    def inspect_executor_artifacts(
        self, artifact_provider: ExecutorArtifactProviderId, executor: ExecutorInstanceId,
        generation: ExecutorArtifactGeneration, readiness: ExecutorArtifactReadinessEpoch, graph: Graph,
        banks: Sequence[object],
    ) -> ExecutorArtifactReport:
        policy: ExecutorArtifactPolicy = self._handle.hook.executor_artifact_policy()
        kind = (ExecutorArtifactStateKind.DISABLED if policy.route_residency is ExecutorRouteResidencyConfig.DISABLED
                else ExecutorArtifactStateKind.DECLINED)
        return ExecutorArtifactReport(policy.provider, executor, generation, readiness, ExecutorArtifactState(kind))

    @hookimpl(trylast=True)
    def drain_executor_artifacts(
        self, artifact_provider: ExecutorArtifactProviderId, executor: ExecutorInstanceId,
        generation: ExecutorArtifactGeneration,
    ) -> None:
        return None

    @hookimpl(trylast=True)
    def executor_artifact_requirement(
        self, artifact_provider: ExecutorArtifactProviderId, executor: ExecutorInstanceId,
        generation: ExecutorArtifactGeneration,
    ) -> ExecutorArtifactRequirementState | None:
        return None
