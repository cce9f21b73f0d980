"""Shared setup for the CUDA tests: the simulator by default, the real driver with
``ONNX_RUNTIME_CUDA_TESTS=real`` (scripts/gpu_check.sh), and a provider handle on it."""

from __future__ import annotations

import gc
import os

import pytest

REAL = os.environ.get("ONNX_RUNTIME_CUDA_TESTS", "").lower() == "real"


def survive_a_simulator_reset() -> None:
    """test_simulator.py resets the simulator when it ends, under any CudaDevice an earlier test cached:
    forget those devices and initialize the driver again, as a fresh process would."""
    from onnx_runtime_ep_cuda import CudaDevice
    from onnx_runtime_ep_cuda.sim import driver as sim

    if int(sim.cuDeviceGetCount()[0]) != 0:
        sim.cuInit(0)
        for device in CudaDevice._instances.values():
            if not device.closed:
                device.staging.abandon()  # the reset freed its pinned blocks; their governor charges go back too
            device.closed = True


@pytest.fixture
def cuda_driver_mode(monkeypatch):
    """Select the simulator (or the real driver) for one test; skip when it is not usable. The provider
    registry caches availability at discovery, so it is refreshed on the way in and out."""
    driver = pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
    from onnx_runtime.discovery import registry

    if REAL:
        monkeypatch.delenv(driver.SIM_ENV, raising=False)
    else:
        monkeypatch.setenv(driver.SIM_ENV, "1")
        survive_a_simulator_reset()
    reason = driver.probe()
    if reason:
        pytest.skip(f"the CUDA {'driver' if REAL else 'simulator'} is not usable: {reason}")
    registry().refresh()
    yield
    monkeypatch.undo()
    registry().refresh()


@pytest.fixture
def cuda_handle(cuda_driver_mode):
    """An initialized CUDAExecutionProvider behind its ProviderHandle."""
    from onnx_runtime import ProviderHandle
    from onnx_runtime_ep_cuda import CUDAExecutionProvider

    handle = ProviderHandle(CUDAExecutionProvider())
    handle.initialize({})
    yield handle
    handle.shutdown()


@pytest.fixture
def kernel_context(cuda_handle):
    """The KernelContext kernel factories get, on an initialized provider: for launching kernels directly."""
    from onnx_runtime_ep_cuda.ops.context import KernelContext

    return KernelContext(cuda_handle.provider.cuda_device(), cuda_handle)


@pytest.fixture(autouse=True)
def _no_stale_simulated_devices():
    """Whatever order the tests run in, none inherits devices cached before a simulator reset."""
    if REAL:
        return
    try:
        import onnx_runtime_ep_cuda.sim.driver  # noqa: F401
    except ImportError:
        return
    survive_a_simulator_reset()


@pytest.fixture
def deferred():
    """The simulator in deferred mode with a stream trace (what ordering tests read); both restored after."""
    import onnx_runtime_ep_cuda.sim.driver as cu

    previous = cu.configure(deferred=True, trace=True)
    yield
    cu.configure(**previous)


@pytest.fixture
def collector_off():
    """No automatic collection finds a test's reference cycles before the test's own collection does (the finalizer
    tests: a collection run inside the device's locks)."""
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()
