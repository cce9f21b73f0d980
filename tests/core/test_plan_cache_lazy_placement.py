"""A session whose optimized graph comes from the plan cache and that specializes per input signature places its
generic graph only when something asks for it (a signature the specializer misses, placement(), IO binding):
the answers are those of an uncached session, and a creation that fails writes no plan a later one could skip."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime.errors import UnsupportedOperatorError
from onnx_runtime.session import inference_session, specialize


def _model(extra_op: str | None = None) -> bytes:
    """y = Reshape(Tanh(x @ W + b), [batch, -1]), the batch read by Shape: a symbolic batch the specializer
    folds; ``extra_op``: a node of an unknown domain after it (no provider places it)."""
    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((8, 5)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "b")
    consts = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("zero", 0), ("one", 1),
                                                                                ("minus_one", -1))]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Tanh", ["a"], ["t"]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "one"], ["batch"]),
        helper.make_node("Concat", ["batch", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["t", "target"], ["r"]),
    ]
    out = "r"
    if extra_op is not None:
        nodes.append(helper.make_node(extra_op, ["r"], ["y"], domain="com.example.lazy"))
        out = "y"
    model = make_model(nodes, [tensor_info("x", shape=["batch", 3, 8])], [tensor_info(out, shape=None)],
                       [w, b, *consts])
    model.opset_import.append(helper.make_opsetid("com.example.lazy", 1))
    return model.SerializeToString()


def _session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _feed(batch: int) -> dict:
    return {"x": np.random.default_rng(batch).standard_normal((batch, 3, 8)).astype(np.float32)}


def _reference(model: bytes, feed: dict) -> np.ndarray:
    import onnxruntime

    return onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feed)[0]


def _count_placements(monkeypatch) -> list:
    """The graphs placed from now on (the session's generic graph and each specialization's)."""
    placed = []
    real = inference_session.place

    def counting(graph, *args, **kwargs):
        placed.append(graph)
        return real(graph, *args, **kwargs)

    monkeypatch.setattr(inference_session, "place", counting)
    return placed


def test_placement_after_a_cached_creation_equals_the_uncached_one(cache_dir, monkeypatch):
    model = _model()
    first = _session(model)  # writes the graph's plan
    first.run(None, _feed(2))  # and the signature's
    placed = _count_placements(monkeypatch)
    cached = _session(model)
    assert placed == []  # nothing placed at creation
    got = cached.run(None, _feed(2))[0]
    assert [graph is cached.model.graph for graph in placed] == [False]  # only the specialization's placement
    np.testing.assert_allclose(got, _reference(model, _feed(2)), rtol=1e-5, atol=1e-6)
    assert cached.placement().as_dict() == first.placement().as_dict()  # made now, as the uncached session's
    assert str(cached.placement()) == str(first.placement())
    assert [graph is cached.model.graph for graph in placed] == [False, True]
    cached.placement()
    assert len(placed) == 2  # made once


def test_a_signature_miss_after_a_cached_creation_runs_the_generic_plan(cache_dir, monkeypatch):
    model = _model()
    _session(model).run(None, _feed(2))
    cached = _session(model)
    np.testing.assert_allclose(cached.run(None, _feed(2))[0], _reference(model, _feed(2)), rtol=1e-5, atol=1e-6)
    placed = _count_placements(monkeypatch)
    monkeypatch.setattr(specialize, "LIMIT", 1)  # the next new signature misses: the generic plan serves it
    for batch in (4, 7, 4):
        feed = _feed(batch)
        np.testing.assert_allclose(cached.run(None, feed)[0], _reference(model, feed), rtol=1e-5, atol=1e-6)
        assert cached.graph_for(feed) is cached.model.graph
    assert [graph is cached.model.graph for graph in placed] == [True]  # placed once, at the first miss
    cached.close()


def test_a_creation_that_fails_to_place_writes_no_plan(cache_dir):
    model = _model(extra_op="NoSuchOp")
    for _ in range(2):  # the second creation fails the same way: no plan let it skip placement
        with pytest.raises(UnsupportedOperatorError, match="NoSuchOp"):
            _session(model)
    assert not list(cache_dir.glob("*-graph.plan"))
