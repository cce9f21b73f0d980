"""Planned steps run as straight-line code (session/step_code.py) from a plan's second run: the same values,
releases and errors as the loop, built once per plan however many frames follow."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime.errors import InvalidArgumentError, InvalidRunValueError, KernelError
from onnx_runtime.session import step_code
from onnx_runtime.session.steps import Step, Steps, run_steps

CPU = "CPUExecutionProvider"


@pytest.fixture
def streaming_model():
    """A frame step with a carried state: h_out = tanh(x @ w + h) split in two halves, one of them unused; the
    logits Gather a row by a fed index (a bad index fails inside a node)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    table = rng.standard_normal((3, 6)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"], name="proj"),
        helper.make_node("Add", ["xw", "h"], ["pre"], name="carry"),
        helper.make_node("Tanh", ["pre"], ["h_out"], name="act"),
        helper.make_node("Split", ["h_out"], ["left", "right"], name="halves", axis=1, num_outputs=2),
        helper.make_node("Gather", ["table", "ids"], ["rows"], name="lookup"),
        helper.make_node("Mul", ["rows", "h_out"], ["scaled"], name="scale"),
        helper.make_node("LogSoftmax", ["scaled"], ["logits"], name="classes", axis=-1),
    ]
    inits = [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel().tolist()),
             helper.make_tensor("table", TensorProto.FLOAT, table.shape, table.ravel().tolist())]
    model = make_model(nodes, [tensor_info("x", shape=[1, 4]), tensor_info("h", shape=[1, 6]),
                               tensor_info("ids", TensorProto.INT64, [1])],
                       [tensor_info("logits", shape=[1, 6]), tensor_info("h_out", shape=[1, 6]),
                        tensor_info("left", shape=[1, 3])], initializers=inits, opset=18)
    return model, w.astype(np.float64), table.astype(np.float64)


def _reference(x, h, ids, w, table):
    h_out = np.tanh(x.astype(np.float64) @ w + h)
    scaled = table[ids] * h_out
    shifted = scaled - scaled.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True)), h_out


def test_a_stream_of_frames_matches_float64_and_onnxruntime_and_builds_once(streaming_model):
    model, w, table = streaming_model
    data = model.SerializeToString()
    ours = ort.InferenceSession(data, providers=[CPU])
    theirs = onnxruntime.InferenceSession(data, providers=[CPU])
    rng = np.random.default_rng(0)
    h = h_ref = np.zeros((1, 6), np.float32)
    built = None
    for frame in range(40):
        x = rng.standard_normal((1, 4)).astype(np.float32)
        ids = np.array([frame % 3], np.int64)
        logits, h_out, left = ours.run(None, {"x": x, "h": h, "ids": ids})
        expected, h_expected = _reference(x, h, ids, w, table)
        np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(h_out, h_expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(left, h_out[:, :3])
        their_logits, h_ref = theirs.run(None, {"x": x, "h": h_ref, "ids": ids})[:2]
        np.testing.assert_allclose(logits, their_logits, rtol=1e-5, atol=1e-5)
        h = h_out
        if frame == 2:  # the plan's second run built its code; none after
            built = step_code.BUILT[0]
    assert built is not None and step_code.BUILT[0] == built


def test_errors_after_the_build_name_the_node_and_the_input(streaming_model):
    model, _, _ = streaming_model
    sess = ort.InferenceSession(model.SerializeToString(), providers=[CPU])
    good = {"x": np.ones((1, 4), np.float32), "h": np.zeros((1, 6), np.float32), "ids": np.array([1], np.int64)}
    first = [value.copy() for value in sess.run(None, good)]
    for _ in range(3):
        sess.run(None, good)
    with pytest.raises(InvalidRunValueError, match=r"node 'lookup' \(Gather\).*out of range"):
        sess.run(None, {**good, "ids": np.array([7], np.int64)})
    with pytest.raises(InvalidArgumentError, match=r"input 'x'.*dimension 1 must be 4"):
        sess.run(None, {**good, "x": np.ones((1, 5), np.float32)})
    with pytest.raises(InvalidArgumentError, match=r"input 'h' expects tensor\(float\)"):
        sess.run(None, {**good, "h": np.zeros((1, 6), np.float64)})
    for value, again in zip(first, sess.run(None, good)):  # the failures left nothing behind
        np.testing.assert_array_equal(value, again)


def _steps(*steps):
    return Steps([Step(run, inputs, outputs, release, None, "test") for run, inputs, outputs, release in steps])


def test_the_code_keeps_the_loops_values_and_releases():
    def add(a, b):
        return (a + b,)

    def pair(a):
        return (a * 2, a * 3)

    steps = _steps((add, (1, 2), (3,), (1,)), (pair, (3,), (4, 5), (3,)), (add, (4, 2), (6,), (4, 2)))
    runs = []
    for _ in range(3):  # the loop, then the code it builds, then the code again
        env = [None, 1.0, 10.0, None, None, None, None]
        run_steps(steps, env)
        runs.append(env)
    assert steps.code is not None
    assert runs[0] == runs[1] == runs[2] == [None, None, None, None, None, 33.0, 32.0]


def test_a_kernel_that_returns_too_few_outputs_is_a_kernel_error():
    steps = _steps((lambda a: (a,), (1,), (2, 3), ()))
    for _ in range(3):
        with pytest.raises(KernelError, match=r"kernel returned .*outputs"):
            run_steps(steps, [None, 1.0, None, None])
    assert steps.code is not None


def test_a_kernels_own_unpacking_error_keeps_its_message_after_the_build():
    def unpacks(a):
        first, second = (a,)  # the kernel's own failure, not a short result
        return (first, second)

    steps = _steps((unpacks, (1,), (2, 3), ()))
    for _ in range(3):  # the loop, then the code it builds, then the code again
        with pytest.raises(KernelError, match=r"not enough values to unpack") as caught:
            run_steps(steps, [None, 1.0, None, None])
        assert "fewer outputs" not in str(caught.value)
    assert steps.code is not None
