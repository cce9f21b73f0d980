"""A session whose optimized graph comes from the plan cache converts that graph's nodes only at their first use
(loader.PlanGraph): a run whose signature plan is cached too never reads them, and what a later use reads is the
graph an eager decode makes."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime.loader import PlanGraph


def _model() -> bytes:
    """y = Reshape(Relu(x @ W + b), [batch, -1]) with the batch read by Shape (a symbolic batch: specialized)."""
    rng = np.random.default_rng(5)
    w = numpy_helper.from_array(rng.standard_normal((6, 4)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(4).astype(np.float32), "b")
    consts = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("zero", 0), ("one", 1),
                                                                                ("minus_one", -1))]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["m"]),
        helper.make_node("Add", ["m", "b"], ["a"]),
        helper.make_node("Relu", ["a"], ["t"]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "one"], ["batch"]),
        helper.make_node("Concat", ["batch", "minus_one"], ["target"], axis=0),
        helper.make_node("Reshape", ["t", "target"], ["y"]),
    ]
    return make_model(nodes, [tensor_info("x", shape=["batch", 2, 6])], [tensor_info("y", shape=None)],
                      [w, b, *consts]).SerializeToString()


def _session(model: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _expected(model: bytes, x: np.ndarray) -> np.ndarray:
    import onnx

    graph = onnx.load_from_string(model).graph
    weights = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in graph.initializer}
    return np.maximum(x.astype(np.float64) @ weights["W"] + weights["b"], 0).reshape(x.shape[0], -1)


def test_cached_runs_leave_the_generic_graph_unconverted(cache_dir):
    model = _model()
    x = np.random.default_rng(1).standard_normal((3, 2, 6)).astype(np.float32)
    eager = _session(model)  # writes the optimized graph's plan and the signature's
    eager.run(None, {"x": x})
    cached = _session(model)
    graph = cached.model.graph
    assert isinstance(graph, PlanGraph) and not graph.converted
    assert [vi.name for vi in cached.get_inputs()] == ["x"] and [vi.name for vi in cached.get_outputs()] == ["y"]
    got = cached.run(None, {"x": x})[0]
    assert not graph.converted  # the signature's plan came from the cache: no generic node was read
    np.testing.assert_allclose(got, _expected(model, x), rtol=1e-5, atol=1e-5)
    # A read converts it: the same graph as the eager session's (which decoded nothing, it made the graph)
    assert [(n.op_type, n.inputs, n.outputs) for n in graph.nodes] == \
        [(n.op_type, n.inputs, n.outputs) for n in eager.model.graph.nodes]
    assert graph.converted and set(graph.value_info) == set(eager.model.graph.value_info)
    assert set(graph.initializers) == set(eager.model.graph.initializers)


def test_a_new_signature_after_a_cached_creation_converts_and_runs(cache_dir):
    model = _model()
    first = np.random.default_rng(2).standard_normal((2, 2, 6)).astype(np.float32)
    _session(model).run(None, {"x": first})
    cached = _session(model)
    other = np.random.default_rng(3).standard_normal((5, 2, 6)).astype(np.float32)  # a signature not cached
    np.testing.assert_allclose(cached.run(None, {"x": other})[0], _expected(model, other), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cached.run(None, {"x": first})[0], _expected(model, first), rtol=1e-5, atol=1e-5)
    graph = cached.model.graph
    graph.nodes = list(graph.nodes)  # a write after conversion keeps the converted value types
    assert graph.converted and "m" in graph.value_info


def test_threads_reading_at_once_convert_once(cache_dir):
    import threading

    model = _model()
    _session(model).run(None, {"x": np.zeros((1, 2, 6), np.float32)})
    graph = _session(model).model.graph
    seen, start = [], threading.Barrier(4)

    def read():
        start.wait()
        seen.append(id(graph.nodes))

    threads = [threading.Thread(target=read) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(seen)) == 1
