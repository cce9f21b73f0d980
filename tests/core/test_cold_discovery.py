"""Cold start: the handle discovery builds to read a provider's name and hooks serves the first session that
asks for the provider (building a handle's plugin managers is a noticeable share of a fresh process's first
session); every later creation gets a fresh, distinct handle."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper
from onnx_runtime import InferenceSession
from onnx_runtime.discovery import registry


@pytest.fixture
def fresh_registry():
    registry().refresh()
    yield registry()
    registry().refresh()


def test_the_discovery_handle_serves_the_first_creation_only(fresh_registry):
    entry = fresh_registry.find("CPUExecutionProvider")
    assert entry is not None and len(entry.spares) == 1
    spare = entry.spares[0]
    first, second = entry.create(), entry.create()
    assert first is spare and second is not spare and entry.spares == []
    assert first.provider is not second.provider


def test_sessions_after_discovery_run_on_their_own_handles(fresh_registry):
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", shape=[2])],
                       [tensor_info("y", shape=[2])]).SerializeToString()
    sessions = [InferenceSession(model, providers=["CPUExecutionProvider"]) for _ in range(2)]
    handles = [s.provider_handle("cpu") for s in sessions]
    assert handles[0] is not handles[1]
    for sess in sessions:
        (y,) = sess.run(None, {"x": np.array([-1.0, 3.0], np.float32)})
        assert y.tolist() == [0.0, 3.0]
