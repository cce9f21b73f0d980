"""session.max_value_bytes holds on every run path: run(), run_with_iobinding and run_with_device_bindings
refuse a value sized from data over the budget, typed and before allocating."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx_runtime import DeviceBindingSpec, InferenceSession, SessionOptions
from onnx_runtime.errors import ShapeOverflowError

LIMIT = 4096


def _tile_session(limit=LIMIT):
    graph = helper.make_graph([helper.make_node("Tile", ["x", "r"], ["y"], name="tiler")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2]),
                               helper.make_tensor_value_info("r", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)])
    options = SessionOptions()
    options.add_session_config_entry("session.max_value_bytes", str(limit))
    return InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _iobinding_run(session, repeats):
    binding = session.io_binding()
    binding.bind_cpu_input("x", np.ones((2, 2), np.float32))
    binding.bind_cpu_input("r", np.array(repeats, np.int64))
    binding.bind_output("y")
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


def test_run_with_iobinding_enters_the_session_budget():
    session = _tile_session()
    assert _iobinding_run(session, [4, 8]).shape == (8, 16)  # 512 bytes: under the limit
    with pytest.raises(ShapeOverflowError, match=r"'tiler'.*16,384 bytes.*over the session's limit of 4,096"):
        _iobinding_run(session, [32, 32])


def test_run_with_device_bindings_enters_the_session_budget():
    session = _tile_session()
    x = session.device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 2)))
    assert session.run_with_device_bindings([x], {"r": np.array([4, 8])})[0].shape == (8, 16)
    with pytest.raises(ShapeOverflowError, match=r"'tiler'.*16,384 bytes.*over the session's limit of 4,096"):
        session.run_with_device_bindings([x], {"r": np.array([32, 32])})


def test_the_budget_is_left_after_a_bound_run():
    # A bound run's budget must not leak into the caller's later runs of another session.
    small, large = _tile_session(), _tile_session(limit=1 << 20)
    with pytest.raises(ShapeOverflowError):
        _iobinding_run(small, [32, 32])
    assert _iobinding_run(large, [32, 32]).shape == (64, 64)
    assert large.run(None, {"x": np.ones((2, 2), np.float32), "r": np.array([32, 32])})[0].shape == (64, 64)


def test_a_device_binding_is_allocated_within_the_session_budget():
    # One binding is one value: a physical shape past session.max_value_bytes is refused before the device is
    # asked (it allocated whatever the caller named), and the budget does not outlive the call.
    session = _tile_session()
    with pytest.raises(ShapeOverflowError, match=r"device binding .*x.* would take 16,384 bytes .*over the "
                                                 r"session's limit of 4,096"):
        session.device_io_binding(DeviceBindingSpec.input("x", np.float32, (64, 64)))
    fits = session.device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 2)))
    assert fits.nbytes == 16
    larger = _tile_session(limit=1 << 20).device_io_binding(DeviceBindingSpec.input("x", np.float32, (64, 64)))
    assert larger.nbytes == 16384
