"""A new input signature's specialization is built with the cyclic collector paused (as session creation is), and
the collector runs as before afterwards: enabled again where the caller had it enabled, left off where not. The
specialized runs still agree with a float64 reference."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import pytest
from model_helpers import mul_relu_batch_model
from onnx_runtime import InferenceSession
from onnx_runtime.session import specialize


def _recording_session(states: list) -> InferenceSession:
    session = InferenceSession(mul_relu_batch_model(), providers=["CPUExecutionProvider"])
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
        session = InferenceSession(mul_relu_batch_model(), providers=["CPUExecutionProvider"])
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
    onnx.checker.check_model(onnx.load_from_string(mul_relu_batch_model()))


@pytest.fixture
def promotions(monkeypatch):
    """A fresh process's budget of promoted builds (earlier tests in this process may have spent it)."""
    monkeypatch.setattr(specialize, "_promotions", [specialize.PROMOTIONS])
    return specialize._promotions  # noqa: SLF001


def test_creation_and_specialization_put_what_they_built_in_the_oldest_generation(promotions):
    """What a paused build made goes to the oldest generation unscanned (the collector would otherwise scan all of
    it at the next allocation, then again as it ages): right after creation, and after a new signature's first run,
    the session's graph and the specialization's executor are in generation 2."""
    was = gc.isenabled()
    gc.enable()
    try:
        session = InferenceSession(mul_relu_batch_model(), providers=["CPUExecutionProvider"])
        graph = session._model.graph  # noqa: SLF001
        assert any(found is graph for found in gc.get_objects(generation=2))
        (y,) = session.run(None, {"X": np.ones((3, 4), np.float32)})
        np.testing.assert_allclose(y, _reference(np.ones((3, 4))), rtol=1e-6)
        executor = session._specializer._last[1]  # noqa: SLF001
        assert executor is not None
        assert any(found is executor for found in gc.get_objects(generation=2))
    finally:
        if not was:
            gc.disable()


def test_promotion_stops_after_the_process_budget(promotions):
    """Each promoted build counts (a creation, then each new signature); past the budget builds leave what they made
    to the collector, so a loop creating and dropping sessions keeps collecting their cycles."""
    promotions[0] = 2
    session = InferenceSession(mul_relu_batch_model(), providers=["CPUExecutionProvider"])
    assert promotions[0] == 1
    session.run(None, {"X": np.ones((2, 4), np.float32)})
    assert promotions[0] == 0
    for batch in (1, 3):
        (y,) = InferenceSession(mul_relu_batch_model(), providers=["CPUExecutionProvider"]).run(
            None, {"X": np.ones((batch, 4), np.float32)})
        np.testing.assert_allclose(y, _reference(np.ones((batch, 4))), rtol=1e-6)
    assert promotions[0] == 0


def test_a_process_with_frozen_objects_keeps_them_frozen(promotions):
    """unfreeze would release a process's own frozen objects (a pre-fork server's) into collections: where any are
    frozen, the build's objects are left to the collector as before."""
    was = gc.isenabled()
    gc.enable()
    kept = [[i] for i in range(100)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        session = InferenceSession(mul_relu_batch_model(), providers=["CPUExecutionProvider"])
        session.run(None, {"X": np.ones((2, 4), np.float32)})
        assert gc.get_freeze_count() > frozen // 2  # (frozen objects freed meanwhile leave the count; unfreeze: 0)
    finally:
        gc.unfreeze()
        if not was:
            gc.disable()
    assert kept
