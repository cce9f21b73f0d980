"""A faulting kernel on the CUDA provider: reported with the kernel's name as a typed error, and the device
recovered (its context reset) so that new sessions work, while what lived on the faulted context is refused
with the same error. Runs on the simulator with sticky errors on, as a GPU has them, and with deferred
execution, where the fault surfaces at the next synchronization rather than at the launch.

Also the pinned staging of host copies (staging.py): uploads return without waiting for the device, a
reused source array does not change what was uploaded, and every page-locked block is freed exactly once.
"""

from __future__ import annotations

import ctypes

import numpy as np
import onnx_runtime as ort
import pytest
from cuda_op_harness import kernel_file
from onnx import TensorProto, helper
from onnx_runtime.errors import ProviderError

pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
from onnx_runtime_ep_cuda import CudaDevice  # noqa: E402
from onnx_runtime_ep_cuda.driver import CudaDeviceFaultError  # noqa: E402

FAULTS = r"""
extern "C" __global__ void scribble(float* p, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = 1.0f;
}
"""


@pytest.fixture
def sim(cuda_driver_mode):
    from onnx_runtime_ep_cuda.driver import simulated

    if not simulated():
        pytest.skip("provoking a fault resets the context: simulator only")
    from onnx_runtime_ep_cuda.sim import driver as cu

    yield cu
    cu.configure(deferred=False, sticky_errors=False)


def relu_session() -> ort.InferenceSession:
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    return ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])


def scribble(device: CudaDevice, path: str, address: int, stream=None) -> None:
    function = device.function(device.load(path), "scribble")
    device.launch(function, 1, 32, [(address, ctypes.c_void_p), (8, ctypes.c_int)], stream=stream)


@pytest.mark.parametrize("deferred", [False, True])
def test_a_fault_names_the_kernel_and_the_device_recovers(sim, deferred, tmp_path_factory):
    path = kernel_file(tmp_path_factory, "faults.cu", FAULTS)
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    before = relu_session()
    np.testing.assert_array_equal(before.run(None, {"x": x})[0], np.maximum(x, 0))
    sim.configure(deferred=deferred, sticky_errors=True)
    device = CudaDevice.get(0)
    with pytest.raises(CudaDeviceFaultError) as info:
        scribble(device, path, 64)  # an address no allocation maps
        device.sync()  # deferred: the fault surfaces here
    message = str(info.value)
    assert "faults.cu:scribble" in message and "CUDA_ERROR_ILLEGAL_ADDRESS" in message
    assert ("cuStreamSynchronize" in message) == deferred  # deferred: named among the kernels launched last
    assert "create the session again" in message
    assert device.closed and device.fault
    # Anything on the faulted context is refused with the same typed error, never run on a dead context.
    with pytest.raises(CudaDeviceFaultError):
        device.allocate(16)
    with pytest.raises(ProviderError, match="faulted"):
        before.run(None, {"x": x})
    # The index hands out a fresh device on a reset context: new sessions work.
    fresh = CudaDevice.get(0)
    assert fresh is not device and not fresh.closed
    after = relu_session()
    np.testing.assert_array_equal(after.run(None, {"x": x})[0], np.maximum(x, 0))


def test_uploads_are_staged_through_pinned_blocks(sim):
    sim.configure(deferred=True)  # a missing wait for a staging block would show as a wrong result here
    device = CudaDevice.get(0)
    count = 3 * device.staging.block_bytes // 4 + 5  # several blocks, and a partial one
    address, base = device.allocate(4 * count)
    source = np.arange(count, dtype=np.float32)
    expected = source.copy()
    for round_ in range(3):  # the ring is reused: each block is rewritten only after its copy ran
        device.upload(address, source.view(np.uint8))
        source += 1  # reusing the source at once does not change what was uploaded
        out = np.empty(count, np.float32)
        device.download(out.view(np.uint8), address)
        np.testing.assert_array_equal(out, expected + round_)
        expected_next = expected + round_ + 1
        np.testing.assert_array_equal(source, expected_next)
    # copy_async through the staging ring in both directions: the host reads the result after sync().
    small = np.full(100, 7.0, np.float32)
    fence = device.copy_async(address, small.view(np.uint8), small.nbytes)
    small[:] = 0
    device.wait_fence(fence)
    back = np.zeros(100, np.float32)
    device.copy_async(back.view(np.uint8), address, back.nbytes)
    device.sync()
    assert (back == 7.0).all()
    assert device.staging.allocated > 0
    assert len(sim.live_host_allocations()) == device.staging.allocated  # the device's ring is all there is
    device.free(base)
    device.close()
    assert device.staging.freed == device.staging.allocated
    assert sim.live_host_allocations() == {}  # every block freed, once (a second free is an error there)
