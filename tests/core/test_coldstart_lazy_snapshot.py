"""The specializer's copy of the session's graph (session/specialize.py ``snapshot``) is made when it is first
needed: a session whose specialized plans come from the plan cache makes none, and a session that places its
generic graph afterwards (placement(), which expands a model-local function in place) has it made before that
placement, so a signature specialized later starts from the graph as the passes left it."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
from model_helpers import make_model, tensor_info
from onnx import helper
from onnx_runtime.session import specialize

DOMAIN = "com.example.snapshot"


def _model() -> bytes:
    """y = Tanh(Scale(x)), Scale a model-local function (x * 2 + 1) no provider has a kernel for; x (batch, 4)."""
    two = helper.make_node("Constant", [], ["two"], value=helper.make_tensor("v2", 1, [], [2.0]))
    one = helper.make_node("Constant", [], ["one"], value=helper.make_tensor("v1", 1, [], [1.0]))
    body = [two, one, helper.make_node("Mul", ["X", "two"], ["T"]), helper.make_node("Add", ["T", "one"], ["Y"])]
    scale = helper.make_function(DOMAIN, "Scale", ["X"], ["Y"], body, [helper.make_opsetid("", 17)])
    nodes = [helper.make_node("Scale", ["x"], ["s"], domain=DOMAIN), helper.make_node("Tanh", ["s"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=["batch", 4])], [tensor_info("y", shape=["batch", 4])])
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    model.functions.append(scale)
    return model.SerializeToString()


def _session(model: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _feed(batch: int) -> dict:
    return {"x": np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)}


def _expected(feed: dict) -> np.ndarray:
    return np.tanh(feed["x"].astype(np.float64) * 2 + 1)


def _count_copies(monkeypatch) -> list:
    copies = []
    real = specialize.clone_graph

    def counting(graph):
        copies.append(graph)
        return real(graph)

    monkeypatch.setattr(specialize, "clone_graph", counting)
    return copies


def test_cached_specializations_copy_nothing_and_placement_snapshots_first(cache_dir, monkeypatch):
    model = _model()
    writer = _session(model)  # writes the graph's plan
    np.testing.assert_allclose(writer.run(None, _feed(2))[0], _expected(_feed(2)), rtol=1e-6, atol=1e-6)

    copies = _count_copies(monkeypatch)
    cached = _session(model)
    specializer = cached._specializer  # noqa: SLF001
    assert specializer is not None  # (a symbolic batch: the session specializes per signature)
    np.testing.assert_allclose(cached.run(None, _feed(2))[0], _expected(_feed(2)), rtol=1e-6, atol=1e-6)
    assert copies == []  # creation and the cached signature's run made no copy of the graph

    before = [node.op_type for node in cached.model.graph.nodes]
    assert "Scale" in before
    cached.placement()  # places the generic graph: the function call is expanded in place
    assert "Scale" not in [node.op_type for node in cached.model.graph.nodes]
    assert len(copies) == 1  # the snapshot, taken before that placement
    assert [node.op_type for node in specializer.snapshot().nodes] == before

    for batch in (3, 5):  # new signatures specialize from the snapshot
        np.testing.assert_allclose(cached.run(None, _feed(batch))[0], _expected(_feed(batch)), rtol=1e-6, atol=1e-6)


def test_an_uncached_session_specializes_as_before(monkeypatch):
    copies = _count_copies(monkeypatch)
    session = _session(_model())  # plan cache off (the suite's default): places its generic graph at creation
    assert len(copies) == 1
    for batch in (1, 2, 7):
        np.testing.assert_allclose(session.run(None, _feed(batch))[0], _expected(_feed(batch)), rtol=1e-6, atol=1e-6)
    specializer = session._specializer  # noqa: SLF001
    assert [node.op_type for node in specializer.snapshot().nodes] == ["Scale", "Tanh"]
