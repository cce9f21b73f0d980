"""IO binding and OrtValue: host bindings on the CPU provider, device-resident runs on the sample device."""

from __future__ import annotations

import gc

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import CopyCounter, chain_reference, make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime.contract.markers import hookimpl
from onnx_runtime.errors import InvalidArgumentError, ProviderNotAvailableError

SAMPLE = "SampleDeviceExecutionProvider"
CPU = "CPUExecutionProvider"
SAMPLE_TYPE, SAMPLE_ID = "other", 7  # the sample provider's device: DeviceId(OTHER, 7)


def _x(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((2, 6)).astype(np.float32)


# The sample device's kernels compute on the host (each downloads its inputs and uploads its result), so
# its copy counts include the kernels' own traffic; the tests compare a bound run with run() on the same feeds.


def _device_reference(x: np.ndarray) -> np.ndarray:
    return np.maximum(x, 0) * x + np.linspace(-1, 1, 6, dtype=np.float32).reshape(1, 6)


# -- OrtValue -------------------------------------------------------------------------------------------
def test_cpu_ortvalue_describes_its_data():
    x = _x()
    value = ort.OrtValue.ortvalue_from_numpy(x)
    assert value.has_value() and value.is_tensor()
    assert (value.shape(), value.data_type(), value.element_type(), value.device_name()) == (
        [2, 6], "tensor(float)", TensorProto.FLOAT, "cpu")
    np.testing.assert_array_equal(value.numpy(), x)
    assert value.data_ptr() == value.numpy().ctypes.data != x.ctypes.data  # a copy, read in place
    empty = ort.OrtValue.ortvalue_from_shape_and_type([3, 4], np.int64)
    assert (empty.shape(), empty.data_type(), empty.element_type()) == ([3, 4], "tensor(int64)", TensorProto.INT64)
    address = empty.data_ptr()
    empty.update_inplace(np.arange(12).reshape(3, 4))
    assert empty.data_ptr() == address and empty.numpy().tolist()[2] == [8, 9, 10, 11]
    with pytest.raises(InvalidArgumentError, match=r"tensor\(int64\) array of shape \[3, 4\], got float32"):
        empty.update_inplace(np.zeros((3, 4), np.float32))


def test_an_unknown_device_type_names_the_device_and_the_fix():
    with pytest.raises(ProviderNotAvailableError, match=r"device type 'rocm'.*install a provider.*'cpu'"):
        ort.OrtValue.ortvalue_from_numpy(_x(), "rocm")
    with pytest.raises(InvalidArgumentError, match="element_type"):
        ort.OrtValue.ortvalue_from_shape_and_type([2], "not a type")


class AbsentRocmProvider:
    @hookimpl
    def name(self):
        return "AbsentRocmExecutionProvider"

    @hookimpl
    def device_id(self):
        return ort.DeviceId(ort.DeviceType.ROCM, 0)

    @hookimpl
    def availability(self):
        return ort.Availability.no("no ROCm runtime found; install ROCm")


def test_an_unavailable_device_gives_the_providers_reason():
    ort.register_provider(AbsentRocmProvider)
    try:
        with pytest.raises(ProviderNotAvailableError, match=r"device rocm:0 is not available here "
                                                             r"\(AbsentRocmExecutionProvider: no ROCm runtime found"):
            ort.OrtValue.ortvalue_from_numpy(_x(), "rocm")
    finally:
        ort.unregister_provider("AbsentRocmExecutionProvider")


def test_a_device_ortvalue_lives_on_the_device_and_is_freed_once():
    value = ort.OrtValue.ortvalue_from_numpy(_x(), SAMPLE_TYPE, SAMPLE_ID)
    handle = value.tensor.provider
    assert value.device_name() == SAMPLE_TYPE and value.tensor.buffer.host is None
    assert ort.OrtValue.ortvalue_from_numpy(_x(), SAMPLE_TYPE, SAMPLE_ID).tensor.provider is handle  # process-wide
    np.testing.assert_array_equal(value.numpy(), _x())
    allocations, frees = handle.allocation_counts()
    del value
    gc.collect()
    assert handle.allocation_counts() == (allocations, frees + 1)


# -- host bindings on the CPU provider ------------------------------------------------------------------
def test_cpu_binding_gives_what_run_gives(chain_model):
    sess = ort.InferenceSession(chain_model.SerializeToString(), providers=[CPU])
    binding = sess.io_binding()
    binding.bind_cpu_input("x", _x())
    binding.bind_output("y")
    binding.synchronize_inputs()
    sess.run_with_iobinding(binding)
    binding.synchronize_outputs()
    (want,) = sess.run(None, {"x": _x()})
    (got,) = binding.copy_outputs_to_cpu()
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, chain_reference(_x()), rtol=1e-5)
    (value,) = binding.get_outputs()
    assert value.device_name() == "cpu" and value.shape() == [2, 6]
    binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(_x(1)))
    sess.run_with_iobinding(binding)
    np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], chain_reference(_x(1)), rtol=1e-5)


def test_cpu_output_buffers_are_written_in_place(chain_model):
    sess = ort.InferenceSession(chain_model.SerializeToString(), providers=[CPU])
    binding = sess.io_binding()
    x = _x()
    binding.bind_input("x", "cpu", 0, np.float32, [2, 6], x.ctypes.data)  # the caller's memory, read in place
    out = np.zeros((2, 6), np.float32)
    binding.bind_output("y", "cpu", 0, np.float32, [2, 6], out.ctypes.data)
    sess.run_with_iobinding(binding)
    np.testing.assert_allclose(out, chain_reference(x), rtol=1e-5)
    target = ort.OrtValue.ortvalue_from_shape_and_type([2, 6], np.float32)
    binding.bind_ortvalue_output("y", target)
    x[:] = _x(2)  # the bound input aliases x: the next run reads the new contents
    sess.run_with_iobinding(binding)
    (value,) = binding.get_outputs()
    assert value is target
    np.testing.assert_allclose(target.numpy(), chain_reference(_x(2)), rtol=1e-5)


def test_binding_errors_name_the_name_and_the_valid_ones(chain_model):
    sess = ort.InferenceSession(chain_model.SerializeToString(), providers=[CPU])
    binding = sess.io_binding()
    with pytest.raises(InvalidArgumentError, match=r"unknown input 'z'.*\['x'\]"):
        binding.bind_cpu_input("z", _x())
    with pytest.raises(InvalidArgumentError, match=r"unknown output 'z'.*\['y'\]"):
        binding.bind_output("z")
    with pytest.raises(InvalidArgumentError, match=r"input 'x' expects tensor\(float\), got float64"):
        binding.bind_cpu_input("x", _x().astype(np.float64))
    with pytest.raises(InvalidArgumentError, match=r"input 'x' dimension 1 must be 6"):
        binding.bind_ortvalue_input("x", ort.OrtValue.ortvalue_from_numpy(np.zeros((2, 5), np.float32)))
    with pytest.raises(InvalidArgumentError, match=r"output 'y' expects tensor\(float\), got tensor\(int32\)"):
        binding.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_shape_and_type([2, 6], np.int32))
    with pytest.raises(ProviderNotAvailableError, match="device type 'metal'"):
        binding.bind_output("y", "metal")
    with pytest.raises(InvalidArgumentError, match="no output is bound"):
        sess.run_with_iobinding(binding)
    binding.bind_output("y")
    with pytest.raises(InvalidArgumentError, match=r"missing inputs 'x'"):
        sess.run_with_iobinding(binding)
    binding.bind_cpu_input("x", _x())
    binding.clear_binding_inputs()
    with pytest.raises(InvalidArgumentError, match=r"missing inputs 'x'"):
        sess.run_with_iobinding(binding)


# -- device-resident runs on the sample device ----------------------------------------------------------
def test_device_inputs_and_outputs_cross_no_host_boundary(device_model):
    sess = ort.InferenceSession(device_model, providers=[SAMPLE, CPU])
    device = sess.provider_handle(SAMPLE)
    x = ort.OrtValue(ort.Tensor.from_numpy(_x(), provider=device))
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", x)
    binding.bind_output("y", SAMPLE_TYPE, SAMPLE_ID)
    sess.run_with_iobinding(binding)  # plans the bound run
    counter = CopyCounter(device)
    up, down, _ = counter.per_call(lambda: sess.run(None, {"x": _x()}))
    # run() uploads x and downloads y; the bound run leaves both where they are.
    assert counter.per_call(lambda: sess.run_with_iobinding(binding)) == (up - 1, down - 1, 0)
    (y,) = binding.get_outputs()
    assert y.device_name() == SAMPLE_TYPE and y.tensor.buffer.host is None and y.tensor.provider is device
    assert counter.per_call(binding.copy_outputs_to_cpu) == (0, 1, 0)  # copied only when asked for
    np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], _device_reference(_x()), rtol=1e-6)


def test_mixed_placement_copies_only_at_inner_boundaries(chain_model):
    sess = ort.InferenceSession(chain_model.SerializeToString(), providers=[SAMPLE, CPU])
    device = sess.provider_handle(SAMPLE)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue(ort.Tensor.from_numpy(_x(), provider=device)))
    binding.bind_output("y", SAMPLE_TYPE, SAMPLE_ID)
    sess.run_with_iobinding(binding)
    counter = CopyCounter(device)
    up, down, _ = counter.per_call(lambda: sess.run(None, {"x": _x()}))
    # Softmax runs on the CPU, so a still goes down and s up; x and y no longer cross.
    assert counter.per_call(lambda: sess.run_with_iobinding(binding)) == (up - 1, down - 1, 0)
    np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], chain_reference(_x()), rtol=1e-5)
    binding.bind_output("y")  # now to the host: the run downloads y
    assert counter.per_call(lambda: sess.run_with_iobinding(binding)) == (up - 1, down, 0)
    assert binding.get_outputs()[0].device_name() == "cpu"


def test_a_bound_device_buffer_is_written_in_place_and_never_freed(device_model):
    sess = ort.InferenceSession(device_model, providers=[SAMPLE])
    device = sess.provider_handle(SAMPLE)
    owned_x = ort.Tensor.from_numpy(_x(), provider=device)
    owned_y = ort.Tensor.zeros(ort.DataType.FLOAT, (2, 6), provider=device)
    binding = sess.io_binding()
    binding.bind_input("x", SAMPLE_TYPE, SAMPLE_ID, np.float32, [2, 6], owned_x.device_ptr)
    binding.bind_output("y", SAMPLE_TYPE, SAMPLE_ID, np.float32, [2, 6], owned_y.device_ptr)
    counter = CopyCounter(device)
    up, down, _ = counter.per_call(lambda: sess.run(None, {"x": _x()}))
    # No upload of x nor download of y; one device copy of the kernel's result into the bound buffer.
    assert counter.per_call(lambda: sess.run_with_iobinding(binding)) == (up - 1, down - 1, 1)
    (y,) = binding.get_outputs()
    assert y.data_ptr() == owned_y.device_ptr and y.tensor.is_borrowed
    np.testing.assert_allclose(owned_y.numpy(), _device_reference(_x()), rtol=1e-6)
    binding.clear_binding_inputs()
    binding.clear_binding_outputs()
    del y
    sess.close()
    gc.collect()
    allocations, frees = device.allocation_counts()
    assert allocations - frees == 2  # the caller's two buffers, still alive after the borrowed views went
    owned_x.close()
    owned_y.close()  # would raise on a second free
    assert device.allocation_counts()[0] == device.allocation_counts()[1]
    assert device.provider.memory == {}


def test_every_session_allocated_device_buffer_is_freed_once(device_model):
    sess = ort.InferenceSession(device_model, providers=[SAMPLE])
    device = sess.provider_handle(SAMPLE)
    binding = sess.io_binding()
    binding.bind_cpu_input("x", _x())
    binding.bind_output("y", SAMPLE_TYPE, SAMPLE_ID)
    for _ in range(3):
        sess.run_with_iobinding(binding)
    (y,) = binding.get_outputs()
    binding.bind_ortvalue_input("x", y)  # a device output fed back as the next input
    sess.run_with_iobinding(binding)
    np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], _device_reference(_device_reference(_x())),
                               rtol=1e-5)
    del y
    binding.clear_binding_inputs()
    binding.clear_binding_outputs()
    sess.close()
    gc.collect()
    allocations, frees = device.allocation_counts()
    assert allocations == frees and allocations >= 1 + 4 * 3
    assert device.provider.memory == {}


def test_a_wrongly_shaped_output_buffer_is_refused_before_writing(device_model):
    sess = ort.InferenceSession(device_model, providers=[SAMPLE])
    binding = sess.io_binding()
    with pytest.raises(InvalidArgumentError, match=r"output 'y' dimension 1 must be 6"):
        binding.bind_output("y", SAMPLE_TYPE, SAMPLE_ID, np.float32, [2, 5], 0x1000)
    with pytest.raises(ProviderNotAvailableError, match="device type 'cuda'|cuda:3"):
        binding.bind_output("y", "cuda", 3)


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT])
def test_dynamic_output_shapes_are_checked_against_the_bound_buffer(dtype):
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                       [tensor_info("x", dtype, ["n"])], [tensor_info("y", dtype, ["n"])]).SerializeToString()
    sess = ort.InferenceSession(model, providers=[CPU])
    binding = sess.io_binding()
    binding.bind_cpu_input("x", np.ones(3, np.float32))
    binding.bind_ortvalue_output("y", ort.OrtValue.ortvalue_from_shape_and_type([4], np.float32))
    with pytest.raises(InvalidArgumentError, match=r"output 'y' is tensor\(float\) of shape \[3\].*\[4\]"):
        sess.run_with_iobinding(binding)
