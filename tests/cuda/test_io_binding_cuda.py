"""IO binding on the CUDA provider (the simulator by default): device-resident inputs and outputs, in-place
output buffers, device memory freed exactly once, and a greedy-decode loop that never touches the host."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import CopyCounter
from onnx import TensorProto, helper

CUDA = "CUDAExecutionProvider"
VOCAB, HIDDEN = 16, 8


@pytest.fixture(autouse=True)
def mode(cuda_driver_mode):
    yield


def _model(nodes, inputs, outputs, initializers) -> bytes:
    graph = helper.make_graph(nodes, "io_binding", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _weights():
    rng = np.random.default_rng(0)
    return (rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32),
            rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32))


@pytest.fixture
def affine_model():
    """y = Tanh(x @ W + b), x and y of shape [2, 8]."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((HIDDEN, HIDDEN)).astype(np.float32)
    b = rng.standard_normal((1, HIDDEN)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul"),
             helper.make_node("Add", ["h", "b"], ["a"], name="add"),
             helper.make_node("Tanh", ["a"], ["y"], name="tanh")]
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, HIDDEN]) for n in ("x", "y")]
    model = _model(nodes, info[:1], info[1:], [onnx.numpy_helper.from_array(w, "w"),
                                                onnx.numpy_helper.from_array(b, "b")])
    return model, lambda x: np.tanh(x @ w + b)


@pytest.fixture
def decode_model():
    """One greedy step: next = ArgMax(Gather(E, token) @ W), token and next int64 of shape [1]."""
    embedding, projection = _weights()
    nodes = [helper.make_node("Gather", ["embedding", "token"], ["hidden"], name="embed"),
             helper.make_node("MatMul", ["hidden", "projection"], ["logits"], name="project"),
             helper.make_node("ArgMax", ["logits"], ["next"], name="argmax", axis=-1, keepdims=0)]
    inputs = [helper.make_tensor_value_info("token", TensorProto.INT64, [1])]
    outputs = [helper.make_tensor_value_info("next", TensorProto.INT64, [1])]
    return _model(nodes, inputs, outputs, [onnx.numpy_helper.from_array(embedding, "embedding"),
                                            onnx.numpy_helper.from_array(projection, "projection")])


def _x(seed=0):
    return np.random.default_rng(seed).standard_normal((2, HIDDEN)).astype(np.float32)


def test_cuda_ortvalues_live_on_the_device():
    value = ort.OrtValue.ortvalue_from_numpy(_x(), "cuda", 0)
    assert value.device_name() == "cuda" and value.tensor.buffer.host is None and value.data_ptr()
    np.testing.assert_array_equal(value.numpy(), _x())
    empty = ort.OrtValue.ortvalue_from_shape_and_type([3], np.int64, "cuda")
    assert (empty.device_name(), empty.data_type(), empty.shape()) == ("cuda", "tensor(int64)", [3])
    with pytest.raises(ort.errors.InvalidArgumentError, match="device_id"):
        ort.OrtValue.ortvalue_from_numpy(_x(), "cuda", 5)


def test_device_inputs_and_outputs_never_cross_the_host(affine_model):
    model, reference = affine_model
    sess = ort.InferenceSession(model, providers=[CUDA])
    device = sess.provider_handle(CUDA)
    x = ort.OrtValue.ortvalue_from_numpy(_x(), "cuda")
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", x)
    binding.bind_output("y", "cuda")
    sess.run_with_iobinding(binding)
    counter = CopyCounter(device, x.tensor.provider)
    for _ in range(3):
        sess.run_with_iobinding(binding)
    binding.synchronize_outputs()
    assert counter.host_copies == 0
    (y,) = binding.get_outputs()
    assert y.device_name() == "cuda" and y.tensor.buffer.host is None
    np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], reference(_x()), rtol=1e-5, atol=1e-6)
    assert counter.host_copies == 1  # the download asked for
    sess.run(None, {"x": _x()})
    assert counter.host_copies == 3  # run() uploads x and downloads y


def test_a_bound_output_buffer_is_written_in_place(affine_model):
    model, reference = affine_model
    sess = ort.InferenceSession(model, providers=[CUDA])
    target = ort.OrtValue.ortvalue_from_shape_and_type([2, HIDDEN], np.float32, "cuda")
    address = target.data_ptr()
    binding = sess.io_binding()
    binding.bind_cpu_input("x", _x())
    binding.bind_ortvalue_output("y", target)
    sess.run_with_iobinding(binding)
    assert binding.get_outputs()[0] is target and target.data_ptr() == address
    np.testing.assert_allclose(target.numpy(), reference(_x()), rtol=1e-5, atol=1e-6)
    # The same buffer by address: borrowed, written, never freed by the session.
    binding.bind_output("y", "cuda", 0, np.float32, [2, HIDDEN], address)
    binding.bind_cpu_input("x", _x(1))
    sess.run_with_iobinding(binding)
    np.testing.assert_allclose(target.numpy(), reference(_x(1)), rtol=1e-5, atol=1e-6)


def test_session_device_memory_is_freed_exactly_once(affine_model):
    model, _reference = affine_model
    sess = ort.InferenceSession(model, providers=[CUDA])
    device = sess.provider_handle(CUDA)
    owned = ort.OrtValue.ortvalue_from_numpy(_x(), "cuda")
    owner = owned.tensor.provider
    owner_counts = owner.allocation_counts()
    binding = sess.io_binding()
    binding.bind_input("x", "cuda", 0, np.float32, [2, HIDDEN], owned.data_ptr())  # borrowed
    binding.bind_output("y", "cuda")
    for _ in range(3):
        sess.run_with_iobinding(binding)
    binding.clear_binding_inputs()
    binding.clear_binding_outputs()
    sess.close()
    gc.collect()
    allocations, frees = device.allocation_counts()
    assert allocations == frees and allocations >= 3
    assert owner.allocation_counts() == owner_counts  # the borrowed buffer was not freed by the session
    np.testing.assert_array_equal(owned.numpy(), _x())
    del owned
    gc.collect()
    assert owner.allocation_counts() == (owner_counts[0], owner_counts[1] + 1)


def test_greedy_decode_feeds_each_step_its_previous_output_on_the_device(decode_model):
    embedding, projection = _weights()
    sess = ort.InferenceSession(decode_model, providers=[CUDA])
    device = sess.provider_handle(CUDA)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("token", ort.OrtValue.ortvalue_from_numpy(np.array([3], np.int64), "cuda"))
    binding.bind_output("next", "cuda")
    tokens, want = [], [3]
    counter = CopyCounter(device)
    for _ in range(6):
        sess.run_with_iobinding(binding)
        (step,) = binding.get_outputs()
        tokens.append(step)
        binding.bind_ortvalue_input("token", step)  # step n's output is step n+1's input
        want.append(int(np.argmax(embedding[want[-1]] @ projection)))
    assert counter.host_copies == 0
    assert [int(t.numpy()[0]) for t in tokens] == want[1:]
    assert len({t.data_ptr() for t in tokens}) == len(tokens)  # each step's token is its own device buffer


def test_capture_sessions_still_run_bound_inputs(affine_model):
    model, reference = affine_model
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    sess = ort.InferenceSession(model, options, providers=[CUDA])
    binding = sess.io_binding()
    binding.bind_cpu_input("x", _x())
    binding.bind_output("y")
    for _ in range(3):  # host bindings take the capture path: size, capture, replay
        sess.run_with_iobinding(binding)
        np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], reference(_x()), rtol=1e-5, atol=1e-6)
    assert sess.device_graph_status() == "replaying"
    x = ort.OrtValue.ortvalue_from_numpy(_x(2), "cuda")
    binding.bind_ortvalue_input("x", x)
    binding.bind_output("y", "cuda")
    sess.run_with_iobinding(binding)
    np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], reference(_x(2)), rtol=1e-5, atol=1e-6)


def test_captured_runs_read_bound_device_inputs_at_their_addresses(affine_model):
    model, reference = affine_model
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    sess = ort.InferenceSession(model, options, providers=[CUDA])
    x = ort.OrtValue.ortvalue_from_numpy(_x(), "cuda")
    y = ort.OrtValue.ortvalue_from_shape_and_type([2, HIDDEN], np.float32, "cuda")
    binding = sess.io_binding()
    binding.bind_ortvalue_input("x", x)
    binding.bind_ortvalue_output("y", y)
    counter = CopyCounter(sess.provider_handle(CUDA), x.tensor.provider)
    runner = sess._executor.graphs
    for seed in range(4):  # size, capture, then replays: each reads x where it is
        x.update_inplace(_x(seed))
        sess.run_with_iobinding(binding)
        np.testing.assert_allclose(y.numpy(), reference(_x(seed)), rtol=1e-5, atol=1e-6)
    assert sess.device_graph_status() == "replaying" and (runner.captures, runner.replays) == (1, 3)
    assert counter.host_copies == 4 + 4  # only the test's own update_inplace uploads and y.numpy() downloads
    other = ort.OrtValue.ortvalue_from_numpy(_x(9), "cuda")  # another address: another signature, eager first
    binding.bind_ortvalue_input("x", other)
    sess.run_with_iobinding(binding)
    assert sess.device_graph_status().startswith("eager")
    np.testing.assert_allclose(y.numpy(), reference(_x(9)), rtol=1e-5, atol=1e-6)


def test_a_captured_decode_loop_ping_pongs_two_device_buffers(decode_model):
    embedding, projection = _weights()
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    sess = ort.InferenceSession(decode_model, options, providers=[CUDA])
    buffers = [ort.OrtValue.ortvalue_from_numpy(np.array([3], np.int64), "cuda"),
               ort.OrtValue.ortvalue_from_shape_and_type([1], np.int64, "cuda")]
    counter = CopyCounter(sess.provider_handle(CUDA), buffers[0].tensor.provider)
    binding = sess.io_binding()
    want = [3]
    for step in range(8):
        binding.bind_ortvalue_input("token", buffers[step % 2])
        binding.bind_ortvalue_output("next", buffers[(step + 1) % 2])
        sess.run_with_iobinding(binding)
        want.append(int(np.argmax(embedding[want[-1]] @ projection)))
    assert counter.host_copies == 0
    runner = sess._executor.graphs
    assert sess.device_graph_status() == "replaying" and (runner.captures, runner.replays) == (2, 6)
    assert int(buffers[0].numpy()[0]) == want[-1]
    device = sess.provider_handle(CUDA)
    del binding
    sess.close()  # graphs, arenas and the device copies handed out: each freed once
    gc.collect()
    allocations, frees = device.allocation_counts()
    assert allocations == frees and allocations > 0
