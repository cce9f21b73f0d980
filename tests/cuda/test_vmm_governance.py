"""The CUDA provider under the memory governor (providers/cuda governance.py, staging.py): it reports the device's
memory so a limit can be a fraction of it, its pinned staging ring is charged to the pinned host tier and stays
within that tier's budget, and its driver allocations outside ``allocate`` are reported by site."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

W = np.random.default_rng(5).standard_normal((64, 64)).astype(np.float32)


@pytest.fixture
def matmul_model(tmp_path) -> str:
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "mm",
                              [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", 64])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["N", 64])],
                              [numpy_helper.from_array(W, "W")])
    path = tmp_path / "mm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


@pytest.fixture
def clean_limits():
    from onnx_runtime.contract.residency import Tier
    from onnx_runtime.memory import set_device_memory_limit

    gc.collect()
    yield
    gc.collect()
    set_device_memory_limit("cuda:0", None)
    set_device_memory_limit("cuda:0", None, Tier.PINNED_HOST)


def _session(path, **config):
    import onnx_runtime as ort

    options = ort.SessionOptions()
    for key, value in config.items():
        options.add_session_config_entry(f"session.{key}", str(value))
    return ort.InferenceSession(path, options, providers=["CUDAExecutionProvider"])


def test_a_fractional_limit_is_that_share_of_the_devices_memory(cuda_driver_mode, matmul_model, clean_limits):
    from onnx_runtime.memory import process_governor, set_device_memory_limit
    from onnx_runtime_ep_cuda import CudaDevice

    device = CudaDevice.get(0)
    total = int(device.driver.cuDeviceTotalMem(device.device)[1])
    session = _session(matmul_model, memory_limit="0.5")
    governor = process_governor()
    assert governor.total("cuda:0") == total and governor.limit("cuda:0") == total // 2
    x = np.ones((3, 64), np.float32)
    np.testing.assert_allclose(session.run(None, {"X": x})[0], x.astype(np.float64) @ W, rtol=1e-5, atol=1e-4)
    set_device_memory_limit("cuda:0", 0.25)  # the device's total is known now: the Python call takes fractions
    assert governor.limit("cuda:0") == total // 4
    session.close()


def test_a_fraction_on_a_device_that_does_not_report_its_memory_is_a_typed_error(clean_limits):
    from onnx_runtime.errors import InvalidArgumentError
    from onnx_runtime.memory import set_device_memory_limit

    with pytest.raises(InvalidArgumentError, match=r"fraction '0.5'.*does not report its total memory.*512MiB"):
        set_device_memory_limit("other:99", "0.5")


def test_the_staging_ring_is_charged_to_the_pinned_tier_and_reported_by_site(cuda_driver_mode, matmul_model,
                                                                             clean_limits):
    from onnx_runtime.contract.residency import Tier
    from onnx_runtime.memory import process_governor
    from onnx_runtime_ep_cuda import CudaDevice
    from onnx_runtime_ep_cuda.staging import BLOCK_BYTES

    session = _session(matmul_model)
    session.run(None, {"X": np.ones((2, 64), np.float32)})
    ring = CudaDevice.get(0).staging
    blocks = ring.allocated - ring.freed
    assert blocks > 0
    assert ring.charged == blocks * BLOCK_BYTES  # every live block is charged, and nothing else is
    pinned = [b for b in process_governor().snapshot() if b["device"] == "cuda:0" and b["tier"] == "pinned_host"]
    assert pinned and pinned[0]["roles"] == {"staging": ring.charged}
    assert process_governor().used("cuda:0", Tier.PINNED_HOST) == ring.charged
    sites = session.memory_report()["provider_sites"]["CUDAExecutionProvider"]
    assert any(site["file"].endswith("staging.py") and site["requests"] == ring.allocated for site in sites)
    session.close()


def test_a_pinned_budget_of_one_block_keeps_the_ring_at_one_block_and_copies_stay_exact(cuda_driver_mode):
    from onnx_runtime.contract.residency import HolderId, Tier
    from onnx_runtime.memory import MemoryBudgetError, ProcessMemoryGovernor
    from onnx_runtime_ep_cuda import CudaDevice
    from onnx_runtime_ep_cuda.staging import BLOCK_BYTES, PinnedStaging

    device = CudaDevice.get(0)
    governor = ProcessMemoryGovernor()
    governor.set_limit("cuda:0", BLOCK_BYTES, Tier.PINNED_HOST)
    ring = PinnedStaging(device)
    assert ring.govern(governor.device("cuda:0"), HolderId("ring under test")) == 0
    data = np.random.default_rng(2).integers(0, 256, 3 * BLOCK_BYTES + 17, dtype=np.uint8)
    address, base = device.allocate(data.size)
    try:
        ring.upload(address, data, device.compute)
        back = np.zeros_like(data)
        ring.download(back, address, device.compute)
        np.testing.assert_array_equal(back, data)
        assert ring.allocated == 1 and governor.used("cuda:0", Tier.PINNED_HOST) == BLOCK_BYTES
        ring.close()
        assert governor.used("cuda:0", Tier.PINNED_HOST) == 0 and ring.freed == 1
        empty = ProcessMemoryGovernor()
        empty.set_limit("cuda:0", BLOCK_BYTES - 1, Tier.PINNED_HOST)
        starved = PinnedStaging(device)
        starved.govern(empty.device("cuda:0"), HolderId("starved ring"))
        with pytest.raises(MemoryBudgetError, match="starved ring.*short"):
            starved.upload(address, data[:16], device.compute)
        assert starved.allocated == 0
    finally:
        ring.close()
        device.free(base)


def test_generate_takes_a_memory_limit_and_a_weight_budget(cuda_driver_mode, clean_limits, monkeypatch, capsys):
    """``onnx-runtime generate --memory-limit 0.5 --weight-budget B``: the device's budget is half its memory,
    weights are paged under B (device graphs are not captured then), the tokens are onnxruntime's; a limit the
    weights do not fit is the governor's error, at load."""
    import sys
    from pathlib import Path

    from onnx_runtime import cli, generate
    from onnx_runtime.memory import process_governor

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
    from test_generate import PROMPT, onnxruntime_greedy

    path = Path(__file__).resolve().parents[2] / "benchmarks/.models/zoo/llama.torchscript.fp32.onnx"
    if not path.exists():
        pytest.skip(f"the model zoo is not built ({path} is missing): run scripts/build_zoo.sh")
    model = onnx.load(str(path))
    sizes = {t.name: numpy_helper.to_array(t).nbytes for t in model.graph.initializer}
    widest = max(sum(sizes.get(name, 0) for name in set(node.input)) for node in model.graph.node)
    budget = max(sum(sizes.values()) // 2, widest)
    made = []
    original = generate.Generator.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(generate.Generator, "__init__", recording)
    ids = ",".join(map(str, PROMPT))
    providers = "CUDAExecutionProvider,CPUExecutionProvider"
    assert cli.main(["generate", str(path), "--prompt-ids", ids, "--max-new-tokens", "4", "--providers", providers,
                     "--memory-limit", "0.5", "--weight-budget", str(budget)]) == 0
    assert capsys.readouterr().out.split("\n")[0].split() == [str(t) for t in onnxruntime_greedy(str(path), PROMPT, 4)]
    governor = process_governor()
    assert governor.limit("cuda:0") == governor.total("cuda:0") // 2
    (weights,) = made[0].session.memory_report()["weights"]
    assert weights["paged"] and weights["budget"] == budget and not made[0].at_capacity
    made.clear()  # the generator, its session and its bindings' buffers go, and their charges with them
    gc.collect()
    tight = governor.used("cuda:0") + (64 << 10)  # what earlier tests' live buffers hold, and 64 KiB
    assert cli.main(["generate", str(path), "--prompt-ids", ids, "--max-new-tokens", "2", "--providers", providers,
                     "--memory-limit", str(tight)]) == 2
    assert "weights on CUDAExecutionProvider" in capsys.readouterr().err


def test_committed_range_allocations_are_granted_by_the_adopted_governor_as_they_grow(cuda_driver_mode):
    """A KV-cache style allocation (capacity reserved, a prefix committed) on an adopted provider: each growth is
    charged as kv_cache before it is mapped, a growth past the budget is the governor's error and leaves the
    committed prefix, and unmapping gives the bytes back."""
    from onnx_runtime import ProviderHandle
    from onnx_runtime.contract.residency import HolderId, Tier
    from onnx_runtime.memory import MemoryBudgetError, ProcessMemoryGovernor
    from onnx_runtime_ep_cuda import CUDAExecutionProvider
    from onnx_runtime_ep_cuda.vmm import granularity

    handle = ProviderHandle(CUDAExecutionProvider())
    handle.initialize({})
    try:
        step = granularity(handle.provider.cuda_device())
        governor = ProcessMemoryGovernor()
        governor.set_limit("cuda:0", 3 * step)
        handle.hook.adopt_memory_governor(governor=governor.device("cuda:0"), tier=Tier.DEVICE,
                                          holder=HolderId("CUDAExecutionProvider pools"))
        buffer = handle.hook.allocate_committed(size=8 * step, alignment=256, committed_ranges=[(0, 1)])
        roles = governor.snapshot()[0]["roles"]
        assert governor.used("cuda:0") == step and roles == {"kv_cache": step}
        assert "CUDAExecutionProvider mapped growth" in next(iter(governor.snapshot()[0]["holders"]))
        handle.hook.commit_allocation_range(buffer=buffer, offset=0, nbytes=2 * step + 1)
        assert governor.used("cuda:0") == 3 * step == handle.hook.allocation_committed_bytes(buffer=buffer)
        with pytest.raises(MemoryBudgetError, match="mapped growth.*short"):
            handle.hook.commit_allocation_range(buffer=buffer, offset=0, nbytes=4 * step)
        assert handle.hook.allocation_committed_bytes(buffer=buffer) == 3 * step
        handle.hook.decommit_allocation_range(buffer=buffer, offset=step, nbytes=7 * step)
        assert governor.used("cuda:0") == step
        handle.hook.deallocate(buffer=buffer)
        assert governor.used("cuda:0") == 0
    finally:
        handle.shutdown()


def test_device_bindings_are_charged_once_from_the_pool_or_by_their_grants(cuda_driver_mode, matmul_model,
                                                                        clean_limits):
    """A DeviceIoBinding small enough for the stream pool is charged to its session's account; one on reserved
    address space is charged as kv_cache by its grants as it maps, and not again by the account."""
    from onnx_runtime import DeviceBindingSpec
    from onnx_runtime.memory import process_governor
    from onnx_runtime_ep_cuda.vmm import granularity

    session = _session(matmul_model)
    governor = process_governor()
    step = granularity(session.provider_handle("CUDAExecutionProvider").provider.cuda_device())
    before = governor.used("cuda:0")
    (activations,) = session.memory_report()["activations"]
    assert activations["charged"] == 0
    pooled = session.device_io_binding(DeviceBindingSpec.input("X", np.float32, (4, 64), committed_ranges=[(0, 64)]))
    assert session.memory_report()["activations"][0]["charged"] == 4 * 64 * 4
    kv_before = next(b for b in governor.snapshot() if b["device"] == "cuda:0" and b["tier"] == "device")["roles"]
    reserved = session.device_io_binding(DeviceBindingSpec.input(
        "X", np.float32, (4, 64), allocation_bytes=4 * step, committed_ranges=[(0, 1)]))
    assert reserved.committed_bytes() == step
    assert session.memory_report()["activations"][0]["charged"] == 4 * 64 * 4  # the account left it to the grants
    roles = next(b for b in governor.snapshot() if b["device"] == "cuda:0" and b["tier"] == "device")["roles"]
    assert roles.get("kv_cache", 0) - kv_before.get("kv_cache", 0) == step
    reserved.commit_range(0, 2 * step)
    assert session.memory_report()["activations"][0]["charged"] == 4 * 64 * 4
    reserved.close()
    pooled.close()
    assert session.memory_report()["activations"][0]["charged"] == 0
    session.close()
    gc.collect()
    assert governor.used("cuda:0") <= before


def test_a_simulator_reset_gives_back_the_pinned_charges_of_the_devices_it_dropped(cuda_driver_mode, matmul_model,
                                                                                  clean_limits, request):
    """The CUDA tests' reset helper forgets the devices a simulator reset dropped; their staging rings' pinned
    blocks went with the reset, and so do the governor's charges for them."""
    import os

    from onnx_runtime.contract.residency import Tier
    from onnx_runtime.memory import process_governor
    from onnx_runtime_ep_cuda import CudaDevice
    from onnx_runtime_ep_cuda.driver import SIM_ENV

    if not os.environ.get(SIM_ENV):
        pytest.skip("resets the simulator")
    from onnx_runtime_ep_cuda.sim import driver as sim

    helpers = next(plugin for plugin in request.config.pluginmanager.get_plugins()
                   if getattr(plugin, "__file__", "").endswith(os.path.join("cuda", "conftest.py")))
    session = _session(matmul_model)
    session.run(None, {"X": np.ones((2, 64), np.float32)})
    session.close()
    ring = CudaDevice.get(0).staging
    governor = process_governor()
    assert ring.charged > 0 and governor.used("cuda:0", Tier.PINNED_HOST) >= ring.charged
    sim.reset()
    helpers.survive_a_simulator_reset()
    assert ring.charged == 0 and governor.used("cuda:0", Tier.PINNED_HOST) == 0
    again = _session(matmul_model)  # a fresh device charges its own ring
    x = np.ones((2, 64), np.float32)
    np.testing.assert_allclose(again.run(None, {"X": x})[0], x.astype(np.float64) @ W, rtol=1e-5, atol=1e-4)
    assert governor.used("cuda:0", Tier.PINNED_HOST) == CudaDevice.get(0).staging.charged > 0
    again.close()
