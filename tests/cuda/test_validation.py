"""Deferred device validation on the CUDA provider: owners, generations, recipients, and the session's
DeviceValidationError at the next download.

Runs on the simulator (``ONNX_RUNTIME_CUDA_SIM=1``) by default; with ``ONNX_RUNTIME_CUDA_TESTS=real``
the same tests run against the real driver on a GPU machine. The flags are raised by test-only kernels
(``TEST_KERNELS``), and by the provider's Gather when it has one.
"""

from __future__ import annotations

import ctypes
import gc
import os

import numpy as np
import onnx_runtime as ort
import pytest
from cuda_op_harness import kernel_file
from onnx import TensorProto, helper
from onnx_runtime import DataType, DeviceValidationRegistration, DeviceValidationToken, ProviderHandle
from onnx_runtime.errors import DeviceValidationError, InvalidArgumentError

driver = pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
from onnx_runtime_ep_cuda import CudaDevice, CUDAExecutionProvider  # noqa: E402
from onnx_runtime_ep_cuda.ops.context import i64, ptr  # noqa: E402
from onnx_runtime_ep_cuda.ops.registry import lookup, register  # noqa: E402
from onnx_runtime_ep_cuda.validation import INDEX_OUT_OF_RANGE, INVALID_ARGUMENT, describe  # noqa: E402

REAL = os.environ.get("ONNX_RUNTIME_CUDA_TESTS", "").lower() == "real"
DOMAIN = "test.cuda_validation"
CUDA = "CUDAExecutionProvider"

TEST_KERNELS = r"""
// Raise `bits` in the flag word.
extern "C" __global__ void raise_flags(unsigned int* flags, unsigned int bits) {
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicOr(flags, bits);
}

// y = x, but a negative element is invalid: it becomes 0 and raises bit 0 (index out of range).
extern "C" __global__ void clamp_negative_f32(float* y, const float* x, long long n, unsigned int* flags) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = x[i];
        if (v < 0.0f) {
            atomicOr(flags, 1u);
            v = 0.0f;
        }
        y[i] = v;
    }
}
"""
_source = {}


@pytest.fixture(autouse=True)
def mode(cuda_driver_mode, tmp_path_factory):
    _source["path"] = kernel_file(tmp_path_factory, "validation_test_ops.cu", TEST_KERNELS)


@pytest.fixture
def handle(cuda_handle):
    return cuda_handle


def raise_flags(h: ProviderHandle, bits: int) -> None:
    """Launch a kernel that raises ``bits`` in the current flag word."""
    device = h.provider.cuda_device()
    function = device.function(device.load(_source["path"]), "raise_flags")
    flags = h.provider.device_validation().current_word()
    device.launch(function, 1, 1, [(flags, ctypes.c_void_p), (bits, ctypes.c_uint32)])


def submit(h: ProviderHandle, registration, bits: int = 0) -> DeviceValidationToken:
    token = h.hook.begin_device_validation(registration=registration)
    if bits:
        raise_flags(h, bits)
    return token


# -- hooks ------------------------------------------------------------------------------------------------------
def test_flags_are_consumed_once_per_generation_and_stick(handle):
    assert handle.hook.defers_device_validation() is True
    registration = handle.hook.register_device_validation_owner()
    assert isinstance(registration, DeviceValidationRegistration)
    token = submit(handle, registration, INDEX_OUT_OF_RANGE)
    assert token.owner == registration.owner
    handle.hook.activate_device_validation(submission=token)
    handle.sync()
    assert handle.hook.consume_device_validation_error(registration=registration, token=token) == INDEX_OUT_OF_RANGE
    # Every exact consumer sees the same result.
    assert handle.hook.consume_device_validation_error(registration=registration, token=token) == INDEX_OUT_OF_RANGE

    clean = submit(handle, registration)  # the next generation starts from a cleared word
    assert clean.generation > token.generation
    handle.hook.activate_device_validation(submission=clean)
    assert handle.hook.consume_device_validation_error(registration=registration, token=clean) == 0
    with pytest.raises(InvalidArgumentError, match="stale"):
        handle.hook.consume_device_validation_error(registration=registration, token=token)

    both = submit(handle, registration, INDEX_OUT_OF_RANGE)
    raise_flags(handle, INVALID_ARGUMENT)
    handle.hook.activate_device_validation(submission=both)
    assert handle.hook.consume_device_validation_error(registration=registration, token=both) == 3
    assert describe(3) == "index out of range, invalid argument"
    handle.hook.unregister_device_validation_owner(registration=registration)


def test_foreign_and_unregistered_owners_are_refused(handle):
    mine, other = (handle.hook.register_device_validation_owner() for _ in range(2))
    token = submit(handle, mine, INDEX_OUT_OF_RANGE)
    handle.hook.activate_device_validation(submission=token)
    with pytest.raises(InvalidArgumentError, match="another owner"):
        handle.hook.consume_device_validation_error(registration=other, token=token)
    forged = DeviceValidationRegistration(mine.owner)  # the right owner id without this provider's state
    with pytest.raises(InvalidArgumentError, match="not a live validation registration"):
        handle.hook.consume_device_validation_error(registration=forged, token=token)
    assert handle.hook.consume_device_validation_error(registration=mine, token=token) == INDEX_OUT_OF_RANGE

    second = ProviderHandle(CUDAExecutionProvider())  # another provider instance on the same device
    second.initialize({})
    with pytest.raises(InvalidArgumentError, match="not a live validation registration"):
        second.hook.consume_device_validation_error(registration=mine, token=token)
    with pytest.raises(InvalidArgumentError, match="not a live validation registration"):
        second.hook.unregister_device_validation_owner(registration=mine)
    second.shutdown()

    handle.hook.unregister_device_validation_owner(registration=other)
    handle.hook.unregister_device_validation_owner(registration=other)  # retiring twice does nothing
    with pytest.raises(InvalidArgumentError, match="not a live validation registration"):
        handle.hook.begin_device_validation(registration=other)
    with pytest.raises(InvalidArgumentError):
        handle.hook.activate_device_validation(submission=DeviceValidationToken(other.owner, 1))
    handle.hook.unregister_device_validation_owner(registration=mine)


def test_consuming_needs_an_activated_submission(handle):
    registration = handle.hook.register_device_validation_owner()
    token = submit(handle, registration)
    with pytest.raises(InvalidArgumentError, match="not activated"):
        handle.hook.consume_device_validation_error(registration=registration, token=token)
    handle.hook.activate_device_validation(submission=token)
    assert handle.hook.consume_device_validation_error(registration=registration, token=token) == 0
    handle.hook.unregister_device_validation_owner(registration=registration)


def test_recipients_keep_the_result_of_their_submission(handle):
    executor, binding, late = (handle.hook.register_device_validation_owner() for _ in range(3))
    token = submit(handle, executor, INDEX_OUT_OF_RANGE)
    received = handle.hook.add_device_validation_recipient(submission=token, recipient=binding)
    assert received.owner == binding.owner
    handle.hook.activate_device_validation(submission=token)
    with pytest.raises(InvalidArgumentError, match="between begin and activate"):
        handle.hook.add_device_validation_recipient(submission=token, recipient=late)
    # The executor moves on without consuming; the binding's token still resolves to its submission.
    following = submit(handle, executor)
    handle.hook.activate_device_validation(submission=following)
    assert handle.hook.consume_device_validation_error(registration=executor, token=following) == 0
    assert handle.hook.consume_device_validation_error(registration=binding, token=received) == INDEX_OUT_OF_RANGE
    with pytest.raises(InvalidArgumentError, match="another owner"):
        handle.hook.consume_device_validation_error(registration=binding, token=token)

    # A recipient read before its submitter consumes settles the submission for both.
    again = submit(handle, executor, INVALID_ARGUMENT)
    fresh = handle.hook.add_device_validation_recipient(submission=again, recipient=binding)
    handle.hook.activate_device_validation(submission=again)
    with pytest.raises(InvalidArgumentError, match="stale"):  # the binding's earlier token
        handle.hook.consume_device_validation_error(registration=binding, token=received)
    assert handle.hook.consume_device_validation_error(registration=binding, token=fresh) == INVALID_ARGUMENT
    assert handle.hook.consume_device_validation_error(registration=executor, token=again) == INVALID_ARGUMENT
    for registration in (executor, binding, late):
        handle.hook.unregister_device_validation_owner(registration=registration)


def test_abort_recovers_the_flags_of_a_failed_submission(handle):
    registration = handle.hook.register_device_validation_owner()
    token = submit(handle, registration, INDEX_OUT_OF_RANGE)
    assert handle.hook.abort_device_validation_submission(submission=token) == INDEX_OUT_OF_RANGE
    assert handle.hook.abort_device_validation_submission(submission=token) == INDEX_OUT_OF_RANGE
    clean = submit(handle, registration)
    assert handle.hook.abort_device_validation_submission(submission=clean) == 0
    handle.hook.unregister_device_validation_owner(registration=registration)


def test_nested_generations_raise_into_the_innermost(handle):
    outer, inner = (handle.hook.register_device_validation_owner() for _ in range(2))
    outer_token = submit(handle, outer)
    inner_token = submit(handle, inner, INVALID_ARGUMENT)  # e.g. a subgraph run inside a control-flow kernel
    handle.hook.activate_device_validation(submission=inner_token)
    assert handle.hook.consume_device_validation_error(registration=inner, token=inner_token) == INVALID_ARGUMENT
    raise_flags(handle, INDEX_OUT_OF_RANGE)  # back in the outer generation
    handle.hook.activate_device_validation(submission=outer_token)
    assert handle.hook.consume_device_validation_error(registration=outer, token=outer_token) == INDEX_OUT_OF_RANGE
    raise_flags(handle, INVALID_ARGUMENT)  # outside every submission
    assert handle.provider.device_validation().unscoped_flags() == INVALID_ARGUMENT
    assert handle.provider.device_validation().unscoped_flags() == 0
    for registration in (outer, inner):
        handle.hook.unregister_device_validation_owner(registration=registration)


# -- sessions ---------------------------------------------------------------------------------------------------
@register("ClampNegative", domain=DOMAIN, dtypes={DataType.FLOAT})
def _clamp_negative(node, shapes, opset, ctx):
    function = ctx.function(_source["path"], "clamp_negative_f32")

    def kernel(x):
        y = ctx.empty_like(x)
        ctx.launch_1d(function, x.numel, ptr(y), ptr(x), i64(x.numel), (ctx.validation_flags(), ctypes.c_void_p))
        return (y,)
    return kernel


def clamp_model(n=8):
    graph = helper.make_graph(
        [helper.make_node("ClampNegative", ["x"], ["y"], name="clamp", domain=DOMAIN)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "graph-replay"])
def test_invalid_data_raises_at_the_download(capture):
    device = CudaDevice.get(0)
    gc.collect()  # earlier tests' garbage freed during this one would read as frees of its own
    live = device.allocations - device.frees
    options = ort.SessionOptions()
    if capture:
        options.add_session_config_entry("session.graph_capture", "1")
    session = ort.InferenceSession(clamp_model(), options, providers=[CUDA])
    good = np.arange(8, dtype=np.float32)
    bad = good - 3
    for _ in range(3):  # eager, or warm-up, capture and replay
        (y,) = session.run(None, {"x": good})
        np.testing.assert_array_equal(y, good)
    if capture:
        assert session.device_graph_status() == "replaying"
    with pytest.raises(DeviceValidationError, match=r"CUDAExecutionProvider: device validation failed \(flags=0x1\)"):
        session.run(None, {"x": bad})
    (y,) = session.run(None, {"x": good})  # the next run starts from a cleared word
    np.testing.assert_array_equal(y, good)
    if capture:
        assert session.device_graph_status() == "replaying"
        assert session._executor.graphs.captures == 1
    session.close()
    assert device.allocations - device.frees == live  # flag words, arena and persistent buffers all freed


def test_an_out_of_range_gather_index_raises_at_the_download():
    if lookup("Gather", "", 13) is None:
        pytest.skip("the CUDA provider has no Gather kernel yet")
    graph = helper.make_graph(
        [helper.make_node("Gather", ["data", "indices"], ["y"], name="gather", axis=0)], "g",
        [helper.make_tensor_value_info("data", TensorProto.FLOAT, [4, 3]),
         helper.make_tensor_value_info("indices", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=9)
    session = ort.InferenceSession(model.SerializeToString(), providers=[CUDA, "CPUExecutionProvider"])
    assert session.placement()["gather"].provider == CUDA
    data = np.arange(12, dtype=np.float32).reshape(4, 3)
    (y,) = session.run(None, {"data": data, "indices": np.array([3, -4], np.int64)})
    np.testing.assert_array_equal(y, data[[3, 0]])
    with pytest.raises(DeviceValidationError, match="CUDAExecutionProvider: device validation failed"):
        session.run(None, {"data": data, "indices": np.array([1, 4], np.int64)})
    (y,) = session.run(None, {"data": data, "indices": np.array([2, 1], np.int64)})
    np.testing.assert_array_equal(y, data[[2, 1]])
    session.close()
