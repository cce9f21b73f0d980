"""Every method of the seed's ExecutionProvider trait has a hook, and the memory-governance and residency
defaults answer as the seed's defaults do (nothing governed, nothing resident, workspace a plain allocation),
through ProviderHandle, for the CPU provider and for a minimal host provider."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from onnx_runtime import DeviceBuffer, DeviceId, DeviceType, KernelMatch, Ownership, ProviderHandle, hookimpl
from onnx_runtime.contract.executor_artifacts import (
    ExecutorArtifactGeneration,
    ExecutorArtifactPolicy,
    ExecutorArtifactProviderId,
    ExecutorArtifactReadinessEpoch,
    ExecutorArtifactStateKind,
    ExecutorInstanceId,
    ExecutorKernelScope,
    ExecutorRouteResidencyConfig,
)
from onnx_runtime.contract.hookspecs import HOOK_NAMES
from onnx_runtime.contract.ownership import (
    AllocationBinding,
    ManagedAllocation,
    bound_buffer,
    into_bound_owner,
    is_bound,
)
from onnx_runtime.contract.residency import (
    ExecutionProviderCapabilities,
    LazyWeight,
    MappedGrowthGrant,
    MemoryLease,
    MemoryRole,
    RoutedResidencyRequirement,
    Tier,
    WorkspaceAllocation,
    quarantined_workspace_leases,
)
from onnx_runtime.devices import TensorLayout
from onnx_runtime.discovery import registry
from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidArgumentError, NotSupportedError, ProviderError
from onnx_runtime.ir import Graph, Node, TypeInfo, ValueInfo

SEED = Path(__file__).resolve().parents[3] / "shared" / "seeds" / "ep_api_execution_provider.rs.txt"

# The seed trait's 100 methods, in the seed's order; kept literally so the check runs where the seed is absent.
SEED_METHODS = (
    "name", "device_type", "device_id", "memory_vendor_id", "host_to_device_copier", "capabilities",
    "runtime_identity", "provider_context_identity", "prepares_immutable_constant", "upload_sealed_constant",
    "page_lazy_weight", "page_lazy_weight_for_executor", "acquire_routed_residency",
    "acquire_routed_residency_for_executor", "prefetch_lazy_weight", "prefetch_lazy_weight_for_executor",
    "initialize", "shutdown", "supports_op", "supports_node", "get_kernel", "get_kernel_for_executor",
    "executor_kernel_scope", "plan_capture_region", "allocate", "allocate_with_mapped_growth", "allocate_workspace",
    "replace_workspace", "allocate_committed", "commit_allocation_range", "commit_allocation_ranges",
    "commit_allocation_ranges_with_mapped_growth", "mapped_bytes_for_allocation_ranges",
    "decommit_allocation_range", "allocation_committed_bytes", "deallocate", "wait_for_deferred_releases",
    "deallocate_workspace", "deallocate_with_unmapped", "copy", "copy_async", "wait_fence", "record_compute_fence",
    "copy_wait_fence", "device_argmax_supported", "device_argmax", "device_token_writer",
    "begin_device_graph_capture", "end_device_graph_capture", "abort_device_graph_capture", "replay_device_graph",
    "replay_device_graph_segment", "reset_device_graph", "begin_device_graph_capture_in",
    "end_device_graph_capture_in", "abort_device_graph_capture_in", "replay_device_graph_in",
    "replay_device_graph_segment_in", "reset_device_graph_in", "has_device_graph_in",
    "begin_owned_device_graph_capture", "end_owned_device_graph_capture", "abort_owned_device_graph_capture",
    "replay_owned_device_graph", "replay_owned_device_graph_segment", "reset_owned_device_graph",
    "retire_owned_device_graphs", "has_owned_device_graph", "register_device_validation_owner",
    "unregister_device_validation_owner", "begin_device_validation", "add_device_validation_recipient",
    "activate_device_validation", "abort_device_validation_submission", "defers_device_validation",
    "consume_device_validation_error", "consume_route_residency_at_boundary_for_executor",
    "executor_artifact_policy", "inspect_executor_artifacts", "drain_executor_artifacts",
    "executor_artifact_requirement", "device_allocation_counts", "raw_device_allocation_site_stats",
    "reserve_workspace", "prepare_mapped_growth", "mapped_bytes_for_allocation", "release_mapped_growth",
    "commits_on_demand", "set_weight_residency_budget", "adopt_memory_governor", "copy_from_host",
    "copy_from_host_at", "copy_to_host", "sync", "copy_device_to_device", "custom_passes", "claim_nodes",
    "context_source_keys", "save_context", "load_context",
)

# Seed method -> hook, where the Python name differs. None: every seed method keeps its snake_case name.
RENAMED: dict[str, str] = {}


def seed_trait_methods(source: str) -> list[str]:
    """The ``fn name(`` of every method inside ``pub trait ExecutionProvider { ... }`` (brace-matched)."""
    start = source.index("{", source.index("pub trait ExecutionProvider"))
    depth = 0
    for end in range(start, len(source)):
        depth += {"{": 1, "}": -1}.get(source[end], 0)
        if depth == 0:
            break
    return re.findall(r"\bfn\s+([a-z_][a-z0-9_]*)\s*[<(]", source[start:end])


def test_the_literal_list_is_the_seed_trait():
    if not SEED.is_file():
        pytest.skip(f"the seed is not here ({SEED}); the literal list below still checks the hooks")
    assert seed_trait_methods(SEED.read_text()) == list(SEED_METHODS)


def test_every_seed_method_has_a_hook():
    assert len(SEED_METHODS) == len(set(SEED_METHODS)) == 100
    missing = [m for m in SEED_METHODS if RENAMED.get(m, m) not in HOOK_NAMES]
    assert not missing, f"seed trait methods without a hook: {missing}"


def test_the_parser_finds_methods_of_the_trait_only():
    source = "fn outside() {}\npub trait ExecutionProvider: Send {\n fn a(&self) -> u8 { if x { 1 } else { 2 } }\n" \
             " fn b<T>(&self);\n}\nfn after() {}\n"
    assert seed_trait_methods(source) == ["a", "b"]


# -- the defaults, through ProviderHandle -----------------------------------------------------------------
class MinimalHost:
    @hookimpl
    def name(self):
        return "MinimalHostExecutionProvider"

    @hookimpl
    def supports_op(self, node, opset, shapes, dtypes, layouts):
        if shapes and shapes[0] == (2, 3) and dtypes[0] is DataType.FLOAT and opset == 17:
            return KernelMatch.supported(2.0)
        return KernelMatch.unsupported(f"{node.op_type} only on a float [2, 3] input at opset 17")

    @hookimpl
    def get_kernel(self, node, shapes, opset, graph):
        return lambda x: (x + 1,)


@pytest.fixture(params=["cpu", "minimal"])
def handle(request) -> ProviderHandle:
    if request.param == "cpu":
        return registry().require("CPUExecutionProvider").create()
    return ProviderHandle(MinimalHost())


def test_governance_defaults_govern_nothing(handle):
    hook = handle.hook
    assert hook.adopt_memory_governor(governor=object(), tier=Tier.DEVICE, holder=None) == 0
    assert hook.set_weight_residency_budget(budget_bytes=1 << 20) is None
    assert hook.commits_on_demand() is False
    assert hook.raw_device_allocation_site_stats() == []
    assert hook.reserve_workspace(nbytes=64, role=MemoryRole.WORKSPACE) is None
    assert hook.prepare_mapped_growth(nbytes=64, role=MemoryRole.KV_CACHE) is None
    assert hook.mapped_bytes_for_allocation(size=100, alignment=64) == 100
    assert hook.release_mapped_growth(nbytes=64, role=MemoryRole.KV_CACHE) is None
    assert hook.wait_for_deferred_releases() is None


def test_workspace_round_trip(handle):
    counts = handle.allocation_counts()
    work = handle.hook.allocate_workspace(size=256, alignment=64, role=MemoryRole.WORKSPACE)
    assert isinstance(work, WorkspaceAllocation) and work.lease is None
    assert work.size == 256 and work.buffer.ptr % 64 == 0
    work.buffer.host_view()[:] = 7  # host memory, usable
    bigger = handle.hook.replace_workspace(old=work, size=512, alignment=64, role=MemoryRole.WORKSPACE)
    assert work.buffer.released and bigger.size == 512
    handle.hook.deallocate_workspace(workspace=bigger)
    assert bigger.buffer.released
    with pytest.raises(InvalidArgumentError, match="already freed"):
        handle.hook.deallocate_workspace(workspace=bigger)
    if counts is not None:  # every allocation freed exactly once
        allocated, freed = handle.allocation_counts()
        assert allocated - counts[0] == freed - counts[1] == 2


class Governed(MinimalHost):
    """A host provider that charges workspace to a lease and whose ``deallocate`` can fail."""

    def __init__(self):
        self.released: list[MemoryLease] = []
        self.fail_free = False

    @hookimpl
    def reserve_workspace(self, nbytes, role):
        return MemoryLease(nbytes, Tier.DEVICE, role, on_release=self.released.append)

    @hookimpl
    def deallocate(self, buffer):
        if self.fail_free:
            raise ProviderError("MinimalHost: the release fence failed")


def test_workspace_lease_is_released_after_the_buffer_and_quarantined_when_the_release_fails():
    provider = Governed()
    handle = ProviderHandle(provider)
    work = handle.hook.allocate_workspace(size=128, alignment=64, role=MemoryRole.WORKSPACE)
    assert work.lease is not None and work.lease.nbytes == 128 and not work.lease.released
    handle.hook.deallocate_workspace(workspace=work)
    assert provider.released == [work.lease] and work.lease.released

    provider.fail_free = True
    failing = handle.hook.allocate_workspace(size=64, alignment=64, role=MemoryRole.WORKSPACE)
    with pytest.raises(ProviderError, match="release fence"):
        handle.hook.deallocate_workspace(workspace=failing)
    assert not failing.lease.released and failing.lease in quarantined_workspace_leases()
    assert provider.released == [work.lease]  # the quarantined bytes stay charged


def test_mapped_growth_defaults(handle):
    grant = MappedGrowthGrant(100, MemoryRole.KV_CACHE)
    buffer = handle.hook.allocate_with_mapped_growth(size=64, alignment=64, grant=grant)
    assert grant.committed == 64 and grant.remaining == 36
    ranges = [(buffer, 0, 16), (buffer, 32, 32)]
    assert handle.hook.mapped_bytes_for_allocation_ranges(ranges=ranges) == 48
    assert handle.hook.commit_allocation_ranges_with_mapped_growth(ranges=ranges, grant=grant) == 48
    with pytest.raises(InvalidArgumentError, match="60..68 exceeds the 64-byte buffer"):
        handle.hook.commit_allocation_ranges_with_mapped_growth(ranges=[(buffer, 60, 8)], grant=grant)
    assert handle.hook.deallocate_with_unmapped(buffer=buffer) == 0 and buffer.released
    # A grant too small for the allocation: the buffer is freed again and the error names the shortfall.
    small = MappedGrowthGrant(32, MemoryRole.KV_CACHE)
    counts = handle.allocation_counts()
    with pytest.raises(ProviderError, match="exceeds the mapped-growth grant"):
        handle.hook.allocate_with_mapped_growth(size=64, alignment=64, grant=small)
    if counts is not None:
        allocated, freed = handle.allocation_counts()
        assert allocated - counts[0] == freed - counts[1] == 1


def test_residency_defaults_have_nothing_resident(handle):
    hook = handle.hook
    weight = LazyWeight("w", 0, 24, "float32", (2, 3))
    executor = ExecutorInstanceId.new()
    assert hook.page_lazy_weight(key=1, weight=weight, source=None) is None
    assert hook.page_lazy_weight_for_executor(executor=executor, key=1, weight=weight, source=None) is None
    assert hook.prefetch_lazy_weight(key=1, weight=weight, source=None) is False
    assert hook.prefetch_lazy_weight_for_executor(executor=executor, key=1, weight=weight, source=None) is False
    requirement = RoutedResidencyRequirement.FUSED_ROUTING_UNKNOWN
    assert hook.acquire_routed_residency(key=1, requirement=requirement, catalog={}) is None
    assert hook.acquire_routed_residency_for_executor(
        executor=executor, key=1, requirement=requirement, catalog={}) is None
    assert hook.consume_route_residency_at_boundary_for_executor(executor=executor) is None
    node = Node("MatMul", ["x", "w"], ["y"])
    assert hook.prepares_immutable_constant(node=node, input_index=1) is False
    assert hook.runtime_identity() is None and hook.provider_context_identity() is None
    with pytest.raises(NotSupportedError, match=f"sealed constants are not supported by {handle.name}"):
        hook.upload_sealed_constant(data=b"\0" * 8, alignment=64)
    assert hook.memory_vendor_id() == 0 and hook.host_to_device_copier() is None
    assert hook.capabilities() == ExecutionProviderCapabilities.stock()
    assert not hook.capabilities().lazy_weight_inputs


def test_executor_artifact_defaults_are_empty(handle):
    hook = handle.hook
    policy = hook.executor_artifact_policy()
    assert policy == ExecutorArtifactPolicy(
        ExecutorArtifactProviderId.UNSCOPED, handle.device_id, ExecutorRouteResidencyConfig.DISABLED)
    executor, generation = ExecutorInstanceId.new(), ExecutorArtifactGeneration(3)
    assert executor != ExecutorInstanceId.UNSCOPED
    labels = dict(artifact_provider=policy.provider, executor=executor, generation=generation)
    report = hook.inspect_executor_artifacts(
        **labels, readiness=ExecutorArtifactReadinessEpoch.INITIAL, graph=None, banks=[])
    assert (report.provider, report.executor, report.generation, report.readiness) == (
        policy.provider, executor, generation, ExecutorArtifactReadinessEpoch.INITIAL)
    assert report.state.kind is ExecutorArtifactStateKind.DISABLED
    assert hook.drain_executor_artifacts(**labels) is None
    assert hook.executor_artifact_requirement(**labels) is None
    assert hook.executor_kernel_scope(node=Node("Relu", ["x"], ["y"])) is ExecutorKernelScope.UNSCOPED


def test_enabled_route_residency_is_declined_by_the_default_inspection():
    class Enabled(MinimalHost):
        @hookimpl
        def executor_artifact_policy(self):
            return ExecutorArtifactPolicy(ExecutorArtifactProviderId(9), DeviceId.cpu(),
                                          ExecutorRouteResidencyConfig.ENABLED)

    report = ProviderHandle(Enabled()).hook.inspect_executor_artifacts(
        artifact_provider=ExecutorArtifactProviderId(9), executor=ExecutorInstanceId.new(),
        generation=ExecutorArtifactGeneration(1), readiness=ExecutorArtifactReadinessEpoch(2), graph=None, banks=[])
    assert report.state.kind is ExecutorArtifactStateKind.DECLINED and report.provider.value == 9


def _relu_graph(shape, dtype) -> tuple[Graph, Node]:
    node = Node("Relu", ["x"], ["y"], opset=17)
    x = ValueInfo("x", TypeInfo(dtype=dtype, shape=shape))
    graph = Graph("g", [node], [x], [ValueInfo("y")], {}, {"x": x}, {"": 17})
    return graph, node


def test_supports_node_asks_supports_op_with_the_graphs_facts():
    handle = ProviderHandle(MinimalHost())
    graph, node = _relu_graph((2, 3), DataType.FLOAT)
    assert handle.hook.supports_node(graph=graph, node=node) == KernelMatch.supported(2.0)
    graph, node = _relu_graph((2, 4), DataType.FLOAT)
    match = handle.hook.supports_node(graph=graph, node=node)
    assert not match.is_supported and "float [2, 3]" in match.reason


def test_supports_node_on_the_cpu_provider_matches_supports_op():
    handle = registry().require("CPUExecutionProvider").create()
    for dtype in (DataType.FLOAT, DataType.STRING):
        graph, node = _relu_graph((2, 3), dtype)
        expected = handle.supports_op(node, 17, [(2, 3)], [dtype], [TensorLayout.default()])
        assert handle.hook.supports_node(graph=graph, node=node) == expected
    graph, node = _relu_graph((2, 3), DataType.FLOAT)
    assert handle.hook.supports_node(graph=graph, node=node).is_supported


def test_get_kernel_for_executor_defaults_to_get_kernel(handle):
    graph, node = _relu_graph((2, 3), DataType.FLOAT)
    kernel = handle.hook.get_kernel_for_executor(
        artifact_provider=ExecutorArtifactProviderId.UNSCOPED, executor=ExecutorInstanceId.UNSCOPED,
        generation=ExecutorArtifactGeneration(1), node=node, shapes=[(2, 3)], opset=17, graph=graph)
    x = np.array([[-1.0, 0.5, 2.0], [3.0, -4.0, 0.0]], np.float32)
    (y,) = kernel(x)
    expected = np.maximum(x, 0) if handle.name == "CPUExecutionProvider" else x + 1
    np.testing.assert_array_equal(np.asarray(y), expected)


def test_a_device_provider_without_memory_hooks_is_refused_a_workspace():
    class Device(MinimalHost):
        @hookimpl
        def device_type(self):
            return DeviceType.CUDA

    with pytest.raises(NotSupportedError, match="allocat"):
        ProviderHandle(Device()).hook.allocate_workspace(size=64, alignment=64, role=MemoryRole.WORKSPACE)


def test_value_types_check_their_sizes():
    with pytest.raises(InvalidArgumentError):
        MemoryLease(-1, Tier.DEVICE, MemoryRole.WEIGHTS)
    lease = MemoryLease(8, Tier.DEVICE, MemoryRole.WEIGHTS, on_release=lambda _: calls.append(1))
    calls: list[int] = []
    lease.release()
    lease.release()
    assert calls == [1]
    grant = MappedGrowthGrant(8, MemoryRole.KV_CACHE)
    grant.release()
    with pytest.raises(ProviderError, match="already released"):
        grant.commit_bytes(1)


def test_workspace_round_trip_on_the_sample_device_provider():
    """A device provider with its own allocate/deallocate: the composite workspace hooks go through them."""
    handle = registry().require("SampleDeviceExecutionProvider").create()
    before = handle.allocation_counts()
    work = handle.hook.allocate_workspace(size=256, alignment=64, role=MemoryRole.WORKSPACE)
    assert work.buffer.device == handle.device_id and not work.buffer.device.is_host_accessible
    handle.hook.deallocate_workspace(workspace=work)
    assert work.buffer.released
    allocated, freed = handle.allocation_counts()
    assert allocated - before[0] == freed - before[1] == 1


# -- bound and managed ownership ---------------------------------------------------------------------------
class BoundHost(MinimalHost):
    """A host provider whose buffers are bound: every free goes back through its allocation binding."""

    def __init__(self):
        self.binding = AllocationBinding("BoundHostExecutionProvider")
        self.arrays: dict[int, np.ndarray] = {}
        self.fail_free = False

    def free_owner(self, owner):
        if self.fail_free:
            raise ProviderError("BoundHost: the release did not complete")
        del self.arrays[owner.ptr]

    @hookimpl
    def allocate(self, size, alignment):
        raw = np.zeros(size + alignment, np.uint8)
        start = (-raw.ctypes.data) % alignment
        host = raw[start:start + size]
        owner = self.binding.issue(host.ctypes.data, size, alignment)
        self.arrays[owner.ptr] = raw
        return bound_buffer(owner, DeviceId.cpu(), host=host)

    @hookimpl
    def deallocate(self, buffer):
        owner = into_bound_owner(buffer)
        if owner is None:
            raise InvalidArgumentError("BoundHost frees only the bound buffers it allocated")
        self.binding.release(owner, self.free_owner)


def test_bound_buffers_release_through_their_binding_once():
    provider = BoundHost()
    handle = ProviderHandle(provider)
    work = handle.hook.allocate_workspace(size=128, alignment=64, role=MemoryRole.WORKSPACE)
    owner = into_bound_owner(work.buffer)
    assert is_bound(work.buffer) and provider.binding.is_live(owner)
    assert (owner.ptr, owner.size) == (work.buffer.ptr, 128)
    handle.hook.deallocate_workspace(workspace=work)
    assert not provider.binding.is_live(owner) and not provider.arrays
    # A stale owner (kept past its free) is refused without freeing anything.
    with pytest.raises(InvalidArgumentError, match="stale release"):
        provider.binding.release(owner, provider.free_owner)
    # A foreign owner is refused too.
    other = AllocationBinding("other").issue(0x1000, 8, 8)
    with pytest.raises(InvalidArgumentError, match="another binding"):
        provider.binding.release(other, provider.free_owner)
    # A raw buffer is not bound: the generation-checked path refuses it.
    raw = DeviceBuffer.from_host_array(np.zeros(4, np.uint8), DeviceId.cpu(), Ownership.OWNED)
    assert into_bound_owner(raw) is None and not is_bound(raw)


def test_a_failed_bound_release_is_quarantined_until_reclaimed():
    provider = BoundHost()
    handle = ProviderHandle(provider)
    buffer = handle.allocate(96, 32)
    provider.fail_free = True
    with pytest.raises(ProviderError, match="did not complete"):
        handle.deallocate(buffer)
    [record] = provider.binding.quarantined()
    assert record.retained_bytes == 96 and "did not complete" in record.reason
    assert provider.binding.quarantined_bytes() == 96 and len(provider.arrays) == 1  # still held, not reused
    assert provider.binding.reclaim_quarantined(provider.free_owner) == 0  # still failing: it stays
    provider.fail_free = False
    assert provider.binding.reclaim_quarantined(provider.free_owner) == 1
    assert provider.binding.quarantined() == [] and not provider.arrays


def test_managed_release_signals_its_settlement():
    binding = AllocationBinding("managed")
    managed = ManagedAllocation(binding.issue(0x2000, 64, 64))
    buffer = bound_buffer(managed, DeviceId.cpu())
    assert into_bound_owner(buffer) is managed and not managed.settlement_wait(0)
    binding.release(managed, lambda owner: None)
    assert managed.settlement_wait(0)
    # The address can be issued again, with a new generation; the old owner stays stale.
    again = binding.issue(0x2000, 64, 64)
    assert again.generation != managed.owner.generation
    with pytest.raises(InvalidArgumentError, match="stale release"):
        binding.release(managed.owner, lambda owner: None)
    binding.release(again, lambda owner: None)
