"""The executor's plain run and the bound run's cached layout keep every check they skip on the steps that
follow: wrong shapes, released bindings, outputs past a binding's capacity and failing nodes still raise their
typed errors after runs that passed, and results stay onnxruntime's."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime import DeviceBindingSpec
from onnx_runtime.errors import InvalidArgumentError, InvalidRunValueError

CPU = "CPUExecutionProvider"


def _sessions(model):
    data = model.SerializeToString()
    return ort.InferenceSession(data, providers=[CPU]), onnxruntime.InferenceSession(data, providers=[CPU])


@pytest.fixture
def gather_model():
    """y = Gather(table, ids) + x: a value read by index, so a bad index fails inside a node."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [5, 3], np.arange(15, dtype=np.float32).tolist())
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], name="lookup"),
             helper.make_node("Add", ["rows", "x"], ["y"], name="plus")]
    return make_model(nodes, [tensor_info("ids", TensorProto.INT64, ["n"]), tensor_info("x", shape=["n", 3])],
                      [tensor_info("y", shape=["n", 3])], initializers=[table])


@pytest.fixture
def kv_model():
    """present = Concat(past, new) on axis 2 and total = ReduceSum(present): a KV-cache step with a fixed axis 1."""
    nodes = [helper.make_node("Concat", ["past", "new"], ["present"], axis=2),
             helper.make_node("ReduceSum", ["present"], ["total"], keepdims=0)]
    return make_model(nodes, [tensor_info("past", shape=[1, 2, "past_len", 4]), tensor_info("new", shape=[1, 2, 1, 4])],
                      [tensor_info("present", shape=[1, 2, "len", 4]), tensor_info("total", shape=[])])


@pytest.fixture
def sum_model():
    """total = ReduceSum(x), out = x * 2 for x [2, n]: two outputs, one of them bound."""
    nodes = [helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
             helper.make_node("Add", ["x", "x"], ["twice"])]
    return make_model(nodes, [tensor_info("x", shape=[2, "n"])],
                      [tensor_info("total", shape=[]), tensor_info("twice", shape=[2, "n"])])


def test_plain_runs_match_onnxruntime_and_name_the_failing_node(gather_model):
    ours, theirs = _sessions(gather_model)
    rng = np.random.default_rng(0)
    for n in (1, 3, 3, 7):  # new shapes and repeated ones
        feeds = {"ids": rng.integers(0, 5, n).astype(np.int64), "x": rng.standard_normal((n, 3)).astype(np.float32)}
        np.testing.assert_array_equal(ours.run(None, feeds)[0], theirs.run(None, feeds)[0])
    with pytest.raises(InvalidRunValueError, match=r"node 'lookup' \(Gather\).*out of range"):
        ours.run(None, {"ids": np.array([0, 9], np.int64), "x": np.zeros((2, 3), np.float32)})
    good = {"ids": np.array([4], np.int64), "x": np.ones((1, 3), np.float32)}
    np.testing.assert_array_equal(ours.run(None, good)[0], theirs.run(None, good)[0])  # after the failure too


def test_profiled_runs_still_count_every_node(gather_model):
    options = ort.SessionOptions()
    options.enable_profiling = True
    sess = ort.InferenceSession(gather_model.SerializeToString(), options, providers=[CPU])
    feeds = {"ids": np.array([1, 2], np.int64), "x": np.zeros((2, 3), np.float32)}
    for _ in range(3):
        sess.run(None, feeds)
    summary = sess.profile_summary()
    assert summary["Gather"][1] == 3 and summary["Add"][1] == 3 and sess.profiled_runs == 3


def test_a_growing_input_is_checked_on_the_axes_the_model_fixes(kv_model):
    sess = ort.InferenceSession(kv_model.SerializeToString(), providers=[CPU])
    wide = sess.device_io_binding(DeviceBindingSpec.input("past", np.float32, (1, 3, 8, 4), (1, 2, 0, 4),
                                                          output_name="present", expose_logical_input_shape=True))
    new = {"new": np.ones((1, 2, 1, 4), np.float32)}
    for step in range(3):  # the past grows on axis 2: learnt free after two passing shapes
        (total,) = sess.run_with_device_bindings([wide], new)
        assert total == pytest.approx(8.0 * (step + 1))
    wide.set_logical_shape((1, 3, 3, 4))  # axis 1 is fixed at 2 by the model: refused after the passing runs
    with pytest.raises(InvalidArgumentError, match=r"input 'past' dimension 1 must be 2"):
        sess.run_with_device_bindings([wide], new)
    wide.set_logical_shape((1, 2, 3, 4))
    assert sess.run_with_device_bindings([wide], new)[0] == pytest.approx(32.0)


def test_a_released_binding_of_a_laid_out_set_is_refused(kv_model):
    sess = ort.InferenceSession(kv_model.SerializeToString(), providers=[CPU])
    cache = sess.device_io_binding(DeviceBindingSpec.input("past", np.float32, (1, 2, 8, 4), (1, 2, 0, 4),
                                                           output_name="present", expose_logical_input_shape=True))
    new = {"new": np.zeros((1, 2, 1, 4), np.float32)}
    sess.run_with_device_bindings([cache], new)
    sess.run_with_device_bindings([cache], new)
    cache.close()
    with pytest.raises(InvalidArgumentError, match="was released; create a new one"):
        sess.run_with_device_bindings([cache], new)


def test_outputs_are_all_checked_before_any_binding_is_written(sum_model):
    sess = ort.InferenceSession(sum_model.SerializeToString(), providers=[CPU])
    x = sess.device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 8), (2, 3),
                                                       expose_logical_input_shape=True))
    twice = sess.device_io_binding(DeviceBindingSpec.output("twice", np.float32, (2, 4)))
    data = np.arange(16, dtype=np.float32).reshape(2, 8)
    x.write_logical(data[:, :3])
    for step, n in enumerate((3, 4, 4)):  # the same shape twice: the same view, reading what the buffer holds now
        x.set_logical_shape((2, n))
        x.write_logical(data[:, :n] + step)
        (total,) = sess.run_with_device_bindings([x, twice])
        assert total == pytest.approx(float((data[:, :n] + step).sum()))
        np.testing.assert_array_equal(twice.read_logical(), 2 * (data[:, :n] + step))
    before = twice.read_bytes()
    x.set_logical_shape((2, 5))
    with pytest.raises(InvalidArgumentError, match=r"output 'twice' has shape \[2, 5\], beyond the capacity \[2, 4\]"):
        sess.run_with_device_bindings([x, twice])
    assert twice.read_bytes() == before and twice.logical_shape == (2, 4)


def test_a_laid_out_set_keeps_no_binding_alive(kv_model):
    sess = ort.InferenceSession(kv_model.SerializeToString(), providers=[CPU])
    cache = sess.device_io_binding(DeviceBindingSpec.input("past", np.float32, (1, 2, 8, 4), (1, 2, 0, 4),
                                                           output_name="present", expose_logical_input_shape=True))
    sess.run_with_device_bindings([cache], {"new": np.zeros((1, 2, 1, 4), np.float32)})
    gone = weakref.ref(cache)
    del cache
    gc.collect()
    assert gone() is None


def test_the_same_bindings_in_another_order_run_the_same(kv_model):
    sess = ort.InferenceSession(kv_model.SerializeToString(), providers=[CPU])
    cache = sess.device_io_binding(DeviceBindingSpec.input("past", np.float32, (1, 2, 8, 4), (1, 2, 0, 4),
                                                           output_name="present", expose_logical_input_shape=True))
    total = sess.device_io_binding(DeviceBindingSpec.output("total", np.float32, ()))
    new = np.ones((1, 2, 1, 4), np.float32)
    sess.run_with_device_bindings([cache, total], {"new": new})
    sess.run_with_device_bindings([total, cache], {"new": 2 * new})
    assert total.read_logical() == pytest.approx(8.0 + 16.0)
    assert cache.logical_shape == (1, 2, 2, 4)
    (again,) = sess.run_with_device_bindings([cache], {"new": new}, output_names=(n for n in ["total"]))
    assert again == pytest.approx(8.0 + 16.0 + 8.0)  # host outputs named by an iterator: read once


def test_plain_runs_hand_out_sequences_and_scalars_as_onnxruntime_does():
    nodes = [helper.make_node("SequenceConstruct", ["x", "x"], ["pair"]),
             helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0)]
    seq = helper.make_tensor_sequence_value_info("pair", TensorProto.FLOAT, ["n"])
    model = make_model(nodes, [tensor_info("x", shape=["n"])], [seq, tensor_info("total", shape=[])])
    ours, theirs = _sessions(model)
    feeds = {"x": np.arange(3, dtype=np.float32)}
    for _ in range(2):
        pair, total = ours.run(None, feeds)
        expected_pair, expected_total = theirs.run(None, feeds)
        assert isinstance(pair, list) and len(pair) == 2 and all(type(p) is np.ndarray for p in pair)
        np.testing.assert_array_equal(pair[1], expected_pair[1])
        assert type(total) is np.ndarray and total.shape == () and total == expected_total
