"""A new input signature's specialization is built with the cyclic collector paused (as session creation is), and
the collector runs as before afterwards: enabled again where the caller had it enabled, left off where not. The
specialized runs still agree with a float64 reference."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx_runtime import InferenceSession


def _model() -> bytes:
    """Y = Relu(X * W) with X of a symbolic batch: each batch size is its own signature."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["X", "W"], ["Z"]), helper.make_node("Relu", ["Z"], ["Y"])], "g",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor("W", TensorProto.FLOAT, [4], [0.5, -1.0, 2.0, 3.0])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _recording_session(states: list) -> InferenceSession:
    session = InferenceSession(_model(), providers=["CPUExecutionProvider"])
    specializer = session._specializer  # noqa: SLF001  (the build the test watches)
    assert specializer is not None, "a symbolic batch should specialize per signature"
    prepare = specializer._prepare  # noqa: SLF001

    def recorded(graph):
        states.append(gc.isenabled())
        return prepare(graph)

    specializer._prepare = recorded  # noqa: SLF001
    return session


def _reference(x: np.ndarray) -> np.ndarray:
    return np.maximum(x.astype(np.float64) * np.array([0.5, -1.0, 2.0, 3.0]), 0.0)


@pytest.mark.parametrize("enabled", (True, False))
def test_specialization_builds_with_the_collector_paused_and_restores_it(enabled):
    was = gc.isenabled()
    states: list[bool] = []
    try:
        if enabled:
            gc.enable()
        else:
            gc.disable()
        session = _recording_session(states)
        rng = np.random.default_rng(3)
        for batch in (2, 5, 2):
            x = rng.standard_normal((batch, 4)).astype(np.float32)
            (y,) = session.run(None, {"X": x})
            np.testing.assert_allclose(y, _reference(x), rtol=1e-6, atol=1e-7)
            assert gc.isenabled() is enabled
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()
    assert states and not any(states), f"the collector ran during a specialization's build: {states}"


class _Stop(BaseException):
    """Not an Exception: the specializer's own fallback (the generic plan) does not catch it."""


def test_an_interrupted_build_still_restores_the_collector():
    was = gc.isenabled()
    gc.enable()
    try:
        session = InferenceSession(_model(), providers=["CPUExecutionProvider"])
        specializer = session._specializer  # noqa: SLF001

        def failing(graph):
            raise _Stop("a build interrupted")

        specializer._prepare = failing  # noqa: SLF001
        with pytest.raises(_Stop):
            session.run(None, {"X": np.ones((3, 4), np.float32)})
        assert gc.isenabled()
    finally:
        if not was:
            gc.disable()


def test_model_is_valid_onnx():
    onnx.checker.check_model(onnx.load_from_string(_model()))
