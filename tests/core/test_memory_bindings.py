"""Every allocation a session makes is charged to the memory governor, DeviceIoBinding's included: eager
allocations and pool buffers by their size, committed-range allocations by what the provider committed (following
commits and decommits), and none twice when the provider charges its mapped growth itself."""

from __future__ import annotations

import gc
import itertools

import numpy as np
import onnx_runtime as ort
import pytest
from chain_models import external_chain
from onnx_runtime import DeviceBindingSpec, DeviceBuffer
from onnx_runtime.contract.residency import HolderId, MemoryRole, Tier
from onnx_runtime.memory import MemoryBudgetError, ProcessMemoryGovernor, process_governor, set_device_memory_limit
from onnx_runtime.memory.accounts import DeviceAccount

SAMPLE = "SampleDeviceExecutionProvider"
DEVICE = "other:7"  # the sample provider's device
D = 1024


@pytest.fixture
def sample_limit():
    gc.collect()  # sessions earlier tests dropped give their charges back
    yield lambda limit: set_device_memory_limit(DEVICE, limit)
    gc.collect()
    set_device_memory_limit(DEVICE, None)


def _session(path):
    return ort.InferenceSession(path, providers=[SAMPLE, "CPUExecutionProvider"])


def test_a_device_binding_is_charged_to_its_session_and_given_back_on_close(tmp_path, sample_limit):
    path = external_chain(tmp_path / "m.onnx", D)
    weights = 8 * D * 4
    sample_limit(weights + 64 * D * 4)
    session = _session(path)
    governor = process_governor()
    (activations,) = session.memory_report()["activations"]
    assert activations["charged"] == 0
    binding = session.device_io_binding(DeviceBindingSpec.input("X", np.float32, (16, D)))
    (activations,) = session.memory_report()["activations"]
    assert activations["charged"] == 16 * D * 4 and governor.used(DEVICE) >= weights + 16 * D * 4
    binding.close()
    (activations,) = session.memory_report()["activations"]
    assert activations["charged"] == 0 and governor.used(DEVICE) == weights
    session.close()
    assert governor.used(DEVICE) == 0


def test_a_device_binding_past_the_budget_fails_naming_the_holder_and_leaves_nothing_charged(tmp_path, sample_limit):
    path = external_chain(tmp_path / "m.onnx", D)
    weights = 8 * D * 4
    sample_limit(weights + 4 * D * 4)
    session = _session(path)
    handle = session.provider_handle(SAMPLE)
    allocations, frees = handle.allocation_counts()
    with pytest.raises(MemoryBudgetError, match=r"activations on SampleDeviceExecutionProvider.*bytes short"):
        session.device_io_binding(DeviceBindingSpec.input("X", np.float32, (8, D)))
    assert process_governor().used(DEVICE) == weights
    after_allocations, after_frees = handle.allocation_counts()
    assert after_allocations - allocations == after_frees - frees  # whatever was allocated was freed again
    small = session.device_io_binding(DeviceBindingSpec.input("X", np.float32, (2, D)))  # what fits still does
    assert session.memory_report()["activations"][0]["charged"] == 2 * D * 4
    small.close()
    session.close()


class _Reserving:
    """A sample device that reserves address space and commits byte ranges from the start on demand (no
    governor of its own): the core charges what ``allocation_committed_bytes`` says."""

    def __init__(self, charged_by_provider: bool = False):
        self.committed: dict[int, int] = {}
        self.addresses = itertools.count(1 << 40, 1 << 20)
        self.charged_by_provider = charged_by_provider

    @ort.hookimpl
    def allocate_committed(self, size, alignment, committed_ranges):
        buffer = DeviceBuffer(ort.DeviceId(ort.DeviceType.OTHER, 7), size, alignment, next(self.addresses))
        self.committed[buffer.ptr] = max((stop for _, stop in committed_ranges or ()), default=0)
        return buffer

    @ort.hookimpl
    def commit_allocation_range(self, buffer, offset, nbytes):
        self.committed[buffer.ptr] = max(self.committed[buffer.ptr], offset + nbytes)

    @ort.hookimpl
    def decommit_allocation_range(self, buffer, offset, nbytes):
        self.committed[buffer.ptr] = min(self.committed[buffer.ptr], offset)

    @ort.hookimpl
    def allocation_committed_bytes(self, buffer):
        return self.committed[buffer.ptr]

    @ort.hookimpl
    def allocation_charged_by_provider(self, buffer):
        return self.charged_by_provider

    @ort.hookimpl
    def deallocate(self, buffer):
        del self.committed[buffer.ptr]


def _reserving_handle(charged_by_provider: bool = False):
    from onnx_runtime_sample_provider import SampleDeviceExecutionProvider

    class Provider(_Reserving, SampleDeviceExecutionProvider):
        def __init__(self):
            SampleDeviceExecutionProvider.__init__(self)
            _Reserving.__init__(self, charged_by_provider)

    handle = ort.ProviderHandle(Provider())
    handle.initialize({})
    return handle


def test_committed_ranges_are_charged_as_they_commit_and_decommit():
    governor = ProcessMemoryGovernor()
    governor.set_limit(DEVICE, 10_000)
    handle = _reserving_handle()
    account = DeviceAccount(handle, governor.device(DEVICE), HolderId("kv cache"))
    handle.memory_account = account
    try:
        buffer = handle.allocate_committed(8000, 64, [(0, 1000)])
        assert account.charged == 1000 and handle.provider.committed[buffer.ptr] == 1000
        handle.commit_allocation_range(buffer, 1000, 3000)
        assert account.charged == 4000
        handle.commit_allocation_ranges([(buffer, 0, 5000)])
        assert account.charged == 5000
        governor.reserve(DEVICE, 4500, Tier.DEVICE, MemoryRole.WEIGHTS, HolderId("another model"))
        with pytest.raises(MemoryBudgetError, match=r"kv cache.*short"):
            handle.commit_allocation_range(buffer, 0, 8000)  # 3000 more do not fit beside the other model
        assert handle.provider.committed[buffer.ptr] == 5000 and account.charged == 5000  # the growth was undone
        handle.decommit_allocation_range(buffer, 2000, 6000)
        assert account.charged == 2000
        handle.deallocate(buffer)
        assert account.charged == 0 and governor.used(DEVICE) == 4500
    finally:
        account.close()
        handle.shutdown()


def test_an_allocation_the_provider_charges_itself_is_not_charged_twice():
    governor = ProcessMemoryGovernor()
    handle = _reserving_handle(charged_by_provider=True)
    account = DeviceAccount(handle, governor.device(DEVICE), HolderId("kv cache"))
    handle.memory_account = account
    try:
        buffer = handle.allocate_committed(8000, 64, [(0, 3000)])
        handle.commit_allocation_range(buffer, 0, 6000)
        assert account.charged == 0 and governor.used(DEVICE) == 0
        handle.deallocate(buffer)
    finally:
        account.close()
        handle.shutdown()


def test_an_eager_committed_allocation_is_charged_whole_and_refused_before_it_is_kept():
    from onnx_runtime_sample_provider import SampleDeviceExecutionProvider

    governor = ProcessMemoryGovernor()
    governor.set_limit(DEVICE, 5000)
    handle = ort.ProviderHandle(SampleDeviceExecutionProvider())
    handle.initialize({})
    account = DeviceAccount(handle, governor.device(DEVICE), HolderId("bindings"))
    handle.memory_account = account
    try:
        # The contract's default allocate_committed commits everything, whatever the ranges say.
        buffer = handle.allocate_committed(4000, 64, [(0, 100)])
        assert account.charged == 4000
        with pytest.raises(MemoryBudgetError, match="bindings.*short"):
            handle.allocate_committed(2000, 64, None)
        assert handle.provider.allocations == handle.provider.frees + 1  # the refused one was freed
        handle.deallocate(buffer)
        assert account.charged == 0 and governor.used(DEVICE) == 0
    finally:
        account.close()
        handle.shutdown()


@pytest.fixture
def host_limit():
    gc.collect()
    yield
    gc.collect()
    set_device_memory_limit("cpu:0", None, Tier.HOST)


def test_host_allocations_share_the_host_tier_with_the_weights(tmp_path, host_limit):
    """On the CPU provider a DeviceIoBinding (a KV cache kept in host memory) is charged to the host tier of
    cpu:0, as the seed's host allocator charges Tier::Host, under the same limit (session.host_memory_limit) as
    the weights the session holds in memory; one that does not fit is the governor's error naming the holder."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "mm",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 64])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 64])],
                              [numpy_helper.from_array(w, "W")])
    path = tmp_path / "mm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    governor = process_governor()
    held = governor.used("cpu:0", Tier.HOST)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    weights = governor.used("cpu:0", Tier.HOST) - held
    assert weights >= w.nbytes
    rows = session.device_io_binding(DeviceBindingSpec.input("X", np.float32, (16, 64)))
    accounts = [a for a in session.memory_report()["activations"] if a["device"] == "cpu:0"]
    assert [a["charged"] for a in accounts] == [16 * 64 * 4]
    assert "host allocations on CPUExecutionProvider" in accounts[0]["holder"]
    assert governor.used("cpu:0", Tier.HOST) > held + weights
    set_device_memory_limit("cpu:0", governor.used("cpu:0", Tier.HOST) + 1000, Tier.HOST)
    with pytest.raises(MemoryBudgetError, match=r"host allocations on CPUExecutionProvider.*short"):
        session.device_io_binding(DeviceBindingSpec.input("X", np.float32, (4096, 64)))  # 1 MiB more
    rows.close()
    assert [a["charged"] for a in session.memory_report()["activations"] if a["device"] == "cpu:0"] == [0]
    assert governor.used("cpu:0", Tier.HOST) == held + weights
    session.close()
    assert governor.used("cpu:0", Tier.HOST) == held


def test_workspace_no_lease_governs_is_charged_by_the_account_and_a_leased_one_is_not(tmp_path, sample_limit):
    """The contract's default allocate_workspace on a provider with no reserve_workspace: the session's account
    charges the buffer and deallocate_workspace gives it back; a provider whose reserve_workspace leases it is
    charged by the lease alone."""
    from onnx_runtime.contract.residency import WorkspaceAllocation

    path = external_chain(tmp_path / "m.onnx", D)
    weights = 8 * D * 4
    sample_limit(weights + 8 * D * 4)
    session = _session(path)
    handle = session.provider_handle(SAMPLE)
    workspace = handle.hook.allocate_workspace(size=4 * D * 4, alignment=64, role=MemoryRole.WORKSPACE)
    assert isinstance(workspace, WorkspaceAllocation) and workspace.lease is None
    assert session.memory_report()["activations"][0]["charged"] == 4 * D * 4
    with pytest.raises(MemoryBudgetError, match="activations on SampleDeviceExecutionProvider.*short"):
        handle.hook.allocate_workspace(size=8 * D * 4, alignment=64, role=MemoryRole.WORKSPACE)
    handle.hook.deallocate_workspace(workspace=workspace)
    assert session.memory_report()["activations"][0]["charged"] == 0
    assert process_governor().used(DEVICE) == weights
    session.close()

    from onnx_runtime_sample_provider import SampleDeviceExecutionProvider

    class Leasing(SampleDeviceExecutionProvider):
        @ort.hookimpl
        def reserve_workspace(self, nbytes, role):
            return self.governor.reserve(nbytes, Tier.DEVICE, role, HolderId("leased workspace"))

    governor = ProcessMemoryGovernor()
    provider = Leasing()
    provider.governor = governor.device(DEVICE)
    leasing = ort.ProviderHandle(provider)
    leasing.initialize({})
    account = DeviceAccount(leasing, governor.device(DEVICE), HolderId("account"))
    leasing.memory_account = account
    try:
        workspace = leasing.hook.allocate_workspace(size=3000, alignment=64, role=MemoryRole.WORKSPACE)
        assert workspace.lease is not None and governor.used(DEVICE) == 3000 and account.charged == 0
        leasing.hook.deallocate_workspace(workspace=workspace)
        assert governor.used(DEVICE) == 0
    finally:
        account.close()
        leasing.shutdown()


def test_a_captured_device_graph_charges_its_arena_once(tmp_path, sample_limit):
    """The buffers a capture carves from its arena are paid for by the arena's backing allocation: the account
    charges the backing (and the captured uploads) and not each block again, during the capture or after it."""
    path = external_chain(tmp_path / "m.onnx", D)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    x = np.ones((1, D), np.float32)
    want = _session(path).run(None, {"X": x})[0]
    session = ort.InferenceSession(path, options, providers=[SAMPLE, "CPUExecutionProvider"])
    session.run(None, {"X": x})  # sizes the arena
    np.testing.assert_array_equal(session.run(None, {"X": x})[0], want)  # captured
    assert session.device_graph_status().startswith("replaying")
    (activations,) = session.memory_report()["activations"]
    arena_and_uploads = activations["charged"]
    assert arena_and_uploads > 0 and activations["peak"] == arena_and_uploads  # no block was charged twice
    np.testing.assert_array_equal(session.run(None, {"X": x})[0], want)  # replayed
    assert session.memory_report()["activations"][0]["charged"] == arena_and_uploads
    session.close()
