"""The process-wide memory governor (core/onnx_runtime/memory): budgets per device shared by every session and
provider, leases and mapped-growth grants, deferred releases, workspace through the contract's hooks, and a
session's device allocations charged to it, with the error at load time when a model does not fit."""

from __future__ import annotations

import gc

import numpy as np
import onnx_runtime as ort
import pytest
from chain_models import external_chain
from onnx_runtime.contract.residency import HolderId, MemoryRole, Tier
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.memory import (
    MemoryBudgetError,
    ProcessMemoryGovernor,
    parse_byte_limit,
    process_governor,
    set_device_memory_limit,
)

SAMPLE = "SampleDeviceExecutionProvider"
DEVICE = "other:7"  # the sample provider's device
D = 1024  # elements per weight row


@pytest.fixture
def governor():
    return ProcessMemoryGovernor()


@pytest.fixture
def sample_limit():
    """The sample device's budget, set by a test and cleared after it (the governor is process-wide)."""
    gc.collect()  # sessions earlier tests dropped give their charges back
    yield lambda limit: set_device_memory_limit(DEVICE, limit)
    gc.collect()  # sessions a test dropped give their charges back
    set_device_memory_limit(DEVICE, None)


# -- the ledger -----------------------------------------------------------------------------------------------
def test_leases_charge_and_release_exactly_once(governor):
    governor.set_limit("dev:0", 1000)
    holder = HolderId("session A")
    lease = governor.reserve("dev:0", 600, Tier.DEVICE, MemoryRole.WEIGHTS, holder)
    assert governor.used("dev:0") == 600 and governor.device("dev:0").available(Tier.DEVICE) == 400
    lease.release()
    lease.release()  # a second release settles nothing twice
    assert governor.used("dev:0") == 0 and governor.high_water("dev:0") == 600
    assert governor.snapshot()[0]["holders"] == {}


def test_a_reservation_that_does_not_fit_names_holder_shortfall_and_who_holds_the_rest(governor):
    governor.set_limit("dev:0", 1000)
    first = governor.reserve("dev:0", 700, Tier.DEVICE, MemoryRole.WEIGHTS, HolderId("model one"))
    with pytest.raises(MemoryBudgetError) as info:
        governor.reserve("dev:0", 500, Tier.DEVICE, MemoryRole.WEIGHTS, HolderId("model two"))
    message = str(info.value)
    assert "model two" in message and "200 bytes short" in message and "model one" in message
    assert "session.memory_limit" in message
    assert governor.used("dev:0") == 700 and governor.snapshot()[0]["refused"] == 1
    first.release()
    governor.reserve("dev:0", 500, Tier.DEVICE, MemoryRole.WEIGHTS, HolderId("model two")).release()


def test_budgets_are_per_device_and_tier(governor):
    governor.set_limit("dev:0", 100)
    governor.reserve("dev:1", 10_000, Tier.DEVICE, MemoryRole.ACTIVATIONS, HolderId("x")).release()
    governor.reserve("dev:0", 10_000, Tier.PINNED_HOST, MemoryRole.STAGING, HolderId("x")).release()
    with pytest.raises(MemoryBudgetError):
        governor.reserve("dev:0", 101, Tier.DEVICE, MemoryRole.ACTIVATIONS, HolderId("x"))


def test_a_limit_below_what_is_held_is_refused(governor):
    lease = governor.reserve("dev:0", 500, Tier.DEVICE, MemoryRole.WEIGHTS, HolderId("held"))
    with pytest.raises(MemoryBudgetError, match="500 are already held"):
        governor.set_limit("dev:0", 100)
    lease.release()
    governor.set_limit("dev:0", 100)


def test_deferred_releases_stay_charged_until_settled(governor):
    governor.set_limit("dev:0", 1000)
    view = governor.device("dev:0")
    lease = view.reserve(800, Tier.DEVICE, MemoryRole.ACTIVATIONS, HolderId("stream"))
    settled = []
    view.defer_release(lease, lambda: settled.append(True))
    assert governor.used("dev:0") == 800 and governor.snapshot()[0]["deferred"] == 800
    # A reservation that would not fit settles the deferred releases first, then succeeds.
    again = view.reserve(900, Tier.DEVICE, MemoryRole.ACTIVATIONS, HolderId("next"))
    assert settled == [True] and governor.used("dev:0") == 900
    again.release()
    lease2 = view.reserve(100, Tier.DEVICE, MemoryRole.ACTIVATIONS, HolderId("stream"))
    view.defer_release(lease2, lambda: settled.append(True))
    assert view.wait_for_deferred_releases() == 100 and governor.used("dev:0") == 0


def test_a_failing_settle_keeps_the_bytes_charged(governor):
    view = governor.device("dev:0")
    lease = view.reserve(64, Tier.DEVICE, MemoryRole.ACTIVATIONS, HolderId("stream"))

    def broken():
        raise RuntimeError("stream faulted")
    view.defer_release(lease, broken)
    with pytest.raises(RuntimeError):
        view.wait_for_deferred_releases()
    assert governor.used("dev:0") == 64  # never proven free: still charged


def test_mapped_growth_grants_commit_and_return(governor):
    governor.set_limit("dev:0", 1 << 20)
    view = governor.device("dev:0")
    holder = HolderId("kv cache")
    grant = view.grant(256 << 10, MemoryRole.KV_CACHE, holder)
    assert governor.used("dev:0") == 256 << 10
    grant.commit_bytes(64 << 10)
    with pytest.raises(ort.errors.ProviderError, match="exceeds the mapped-growth grant"):
        grant.commit_bytes(256 << 10)
    grant.release()  # the unused rest goes back, the mapped bytes stay charged
    assert governor.used("dev:0") == 64 << 10
    view.release_mapped(16 << 10, MemoryRole.KV_CACHE, holder)
    assert governor.used("dev:0") == 48 << 10
    with pytest.raises(InvalidArgumentError, match="only 49152 were committed"):
        view.release_mapped(1 << 20, MemoryRole.KV_CACHE, holder)
    view.release_mapped(48 << 10, MemoryRole.KV_CACHE, holder)
    assert governor.used("dev:0") == 0


@pytest.mark.parametrize(("text", "total", "expected"), [
    ("1048576", None, 1 << 20), ("512MiB", None, 512 << 20), ("2GB", None, 2_000_000_000), ("0.5", 1000, 500),
    ("", None, None), ("0", None, None),
])
def test_limits_parse_bytes_units_and_fractions(text, total, expected):
    assert parse_byte_limit(text, "session.memory_limit", total) == expected


@pytest.mark.parametrize("text", ["lots", "12 parsecs", "1.5", "-3"])
def test_a_bad_limit_names_the_key_and_the_forms(text):
    with pytest.raises(InvalidArgumentError, match="session.memory_limit.*512MiB"):
        parse_byte_limit(text, "session.memory_limit", 1000)


def test_a_fraction_needs_the_device_total():
    with pytest.raises(InvalidArgumentError, match="does not report its total memory"):
        parse_byte_limit("0.25", "session.memory_limit")


# -- sessions on the sample device ----------------------------------------------------------------------------
def _chain(path, layers: int = 8, seed: int = 0):
    """Add/Mul by a [1, D] weight per layer, then Relu: every node on the sample device. Returns the path and the
    weights' bytes."""
    return external_chain(path, D, layers, seed), layers * D * 4


def _session(path, **config):
    options = ort.SessionOptions()
    for key, value in config.items():
        options.add_session_config_entry(f"session.{key}", str(value))
    return ort.InferenceSession(path, options, providers=[SAMPLE, "CPUExecutionProvider"])


def test_a_model_that_does_not_fit_fails_at_load_naming_the_session_and_the_shortfall(tmp_path, sample_limit):
    path, weights = _chain(tmp_path / "m.onnx")
    sample_limit(weights - 100)
    with pytest.raises(MemoryBudgetError, match=r"weights on SampleDeviceExecutionProvider.*100 bytes short"):
        _session(path)


def test_two_sessions_share_one_device_budget(tmp_path, sample_limit):
    path, weights = _chain(tmp_path / "m.onnx")
    sample_limit(weights + weights // 2)  # room for one model's weights and its run, not for two models
    x = np.ones((1, D), np.float32)
    first = _session(path)
    first.run(None, {"X": x})
    governor = process_governor()
    assert governor.used(DEVICE) >= weights
    with pytest.raises(MemoryBudgetError) as info:  # the second does not fit beside the first ...
        _session(path)
    assert "weights on SampleDeviceExecutionProvider" in str(info.value) and "short" in str(info.value)
    holders = governor.snapshot()
    assert any("weights" in h for b in holders if b["device"] == DEVICE for h in b["holders"])
    first.close()  # ... and fits once the first gives its budget back
    assert governor.used(DEVICE) == 0
    second = _session(path)
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    np.testing.assert_array_equal(second.run(None, {"X": x})[0], want)
    second.close()
    assert governor.used(DEVICE) == 0


def test_run_allocations_are_charged_and_given_back(tmp_path, sample_limit):
    path, weights = _chain(tmp_path / "m.onnx")
    sample_limit(weights + 64 * D * 4)
    session = _session(path)
    governor = process_governor()
    governor.reset_high_water(DEVICE)
    session.run(None, {"X": np.ones((1, D), np.float32)})
    assert governor.used(DEVICE) == weights  # the run's values were freed and their charges returned
    assert governor.high_water(DEVICE) > weights  # while it ran, they were charged
    report = session.memory_report()
    (activations,) = report["activations"]
    assert activations["charged"] == 0 and activations["sites"]
    assert all(site["requests"] > 0 and site["bytes"] > 0 for site in activations["sites"])
    session.close()


def test_a_run_past_the_budget_fails_with_the_governors_error_and_recovers(tmp_path, sample_limit):
    path, weights = _chain(tmp_path / "m.onnx")
    sample_limit(weights + 1)  # weights fit, the run's values do not
    session = _session(path)
    with pytest.raises(Exception, match="activations on SampleDeviceExecutionProvider.*short"):
        session.run(None, {"X": np.ones((1, D), np.float32)})
    assert process_governor().used(DEVICE) == weights  # what the failed run took went back
    session.close()


def test_a_dropped_session_gives_its_charges_back(tmp_path):
    path, weights = _chain(tmp_path / "m.onnx")
    gc.collect()
    before = process_governor().used(DEVICE)
    session = _session(path)
    session.run(None, {"X": np.ones((1, D), np.float32)})
    assert process_governor().used(DEVICE) - before == weights
    del session
    gc.collect()
    assert process_governor().used(DEVICE) == before


# -- the contract's workspace hooks through a governor --------------------------------------------------------
class _GovernedWorkspace:
    """Implements reserve_workspace against an adopted governor: the contract's default allocate_workspace then
    takes the lease before allocating and deallocate_workspace releases it after the free."""

    def __init__(self):
        self.governor = None
        self.holder = None

    @ort.hookimpl
    def adopt_memory_governor(self, governor, tier, holder):
        self.governor, self.holder = governor, holder
        return 0

    @ort.hookimpl
    def reserve_workspace(self, nbytes, role):
        return self.governor.reserve(nbytes, Tier.DEVICE, role, self.holder)


def test_workspace_is_a_lease_taken_before_the_buffer_and_released_after_it(governor):
    from onnx_runtime_sample_provider import SampleDeviceExecutionProvider

    class Provider(SampleDeviceExecutionProvider, _GovernedWorkspace):
        def __init__(self):
            SampleDeviceExecutionProvider.__init__(self)
            _GovernedWorkspace.__init__(self)

    handle = ort.ProviderHandle(Provider())
    handle.initialize({})
    governor.set_limit("other:7", 4096)
    view = governor.device("other:7")
    handle.hook.adopt_memory_governor(governor=view, tier=Tier.DEVICE, holder=HolderId("sample workspace"))
    workspace = handle.hook.allocate_workspace(size=3000, alignment=64, role=MemoryRole.WORKSPACE)
    assert workspace.lease is not None and governor.used("other:7") == 3000
    with pytest.raises(MemoryBudgetError, match="sample workspace.*short"):
        handle.hook.allocate_workspace(size=2000, alignment=64, role=MemoryRole.WORKSPACE)
    allocations = handle.provider.allocations
    replaced = handle.hook.replace_workspace(old=workspace, size=3500, alignment=64, role=MemoryRole.WORKSPACE)
    assert handle.provider.allocations == allocations + 1 and governor.used("other:7") == 3500
    handle.hook.deallocate_workspace(workspace=replaced)
    assert governor.used("other:7") == 0 and replaced.buffer.released
    handle.shutdown()


def test_allocation_sites_count_large_allocations_exactly_and_sample_small_ones(governor):
    from onnx_runtime.memory.accounts import SITE_EXACT_BYTES, SITE_SAMPLE, DeviceAccount
    from onnx_runtime_sample_provider import SampleDeviceExecutionProvider

    handle = ort.ProviderHandle(SampleDeviceExecutionProvider())
    handle.initialize({})
    account = DeviceAccount(handle, governor.device("other:7"), HolderId("sites"))
    handle.memory_account = account
    try:
        small = [handle.allocate(64) for _ in range(2 * SITE_SAMPLE)]  # this line: the small site
        large = [handle.allocate(SITE_EXACT_BYTES) for _ in range(3)]  # this line: the large site
        sites = {stats.line: stats for stats in account.site_stats()}
        assert all(stats.file == __file__ for stats in sites.values()) and len(sites) == 2
        small_site, large_site = (sites[line] for line in sorted(sites))
        assert (small_site.requests, small_site.requested_bytes) == (2 * SITE_SAMPLE, 2 * SITE_SAMPLE * 64)
        assert (large_site.requests, large_site.requested_bytes) == (3, 3 * SITE_EXACT_BYTES)
        for buffer in small + large:
            handle.deallocate(buffer)
        assert account.charged == 0 and governor.used("other:7") == 0
    finally:
        account.close()
        handle.shutdown()


@pytest.fixture
def host_limit():
    gc.collect()
    yield
    gc.collect()
    set_device_memory_limit("cpu:0", None, Tier.HOST)


def _host_weights() -> int:
    """The weights charged to the host tier (sessions also charge their activations there)."""
    return next((b["roles"].get("weights", 0) for b in process_governor().snapshot()
                 if b["device"] == "cpu:0" and b["tier"] == "host"), 0)


def _cpu_session(path, **config):
    options = ort.SessionOptions()
    for key, value in config.items():
        options.add_session_config_entry(f"session.{key}", str(value))
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def test_weights_held_in_host_memory_are_charged_to_the_host_tier_and_bounded(tmp_path, host_limit):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "mm",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 256])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 256])],
                              [numpy_helper.from_array(w, "W")])
    embedded = tmp_path / "embedded.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(embedded))
    mapped = external_chain(tmp_path / "mapped.onnx", 4096)  # weights above 1,024 elements: mapped
    governor = process_governor()
    held, weights = governor.used("cpu:0", Tier.HOST), _host_weights()
    session = _cpu_session(str(embedded))
    charged = _host_weights() - weights
    assert w.nbytes <= charged < 2 * w.nbytes  # read into memory: charged (with what the session derived from it)
    x = np.ones((1, 256), np.float32)
    np.testing.assert_allclose(session.run(None, {"X": x})[0], x.astype(np.float64) @ w, rtol=1e-4, atol=1e-3)
    other = _cpu_session(mapped)
    assert _host_weights() == weights + charged  # mapped from its file: the page cache's
    other.close()
    with pytest.raises(MemoryBudgetError, match=r"weights in host memory.*short"):
        # the first one holds them (and its activations, the output's 1 KiB)
        _cpu_session(str(embedded), host_memory_limit=governor.used("cpu:0", Tier.HOST) + 100)
    session.close()
    assert governor.used("cpu:0", Tier.HOST) == held
    bounded = _cpu_session(str(embedded), host_memory_limit="0.5")
    assert governor.limit("cpu:0", Tier.HOST) == governor.total("cpu:0", Tier.HOST) // 2
    bounded.close()
