"""recurrent_fusions: an LSTM cell written out as torch's exporters write nn.LSTMCell (two Gemms, Split, Sigmoid/Tanh
gates, Mul/Add) becomes one LSTMCell step; outputs against a float64 reference of torch's cell."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper

CPU = ["CPUExecutionProvider"]
HIDDEN, FEATURES, BATCH = 16, 12, 2


def _weights(seed: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"w_ih": rng.standard_normal((4 * HIDDEN, FEATURES)).astype(np.float32) * 0.3,
            "w_hh": rng.standard_normal((4 * HIDDEN, HIDDEN)).astype(np.float32) * 0.3,
            "b_ih": rng.standard_normal(4 * HIDDEN).astype(np.float32) * 0.1,
            "b_hh": rng.standard_normal(4 * HIDDEN).astype(np.float32) * 0.1}


def _cell_nodes(x: str = "x", h: str = "h", c: str = "c", prefix: str = "") -> list:
    p = prefix
    return [helper.make_node("Gemm", [h, "w_hh", "b_hh"], [f"{p}hh"], transB=1),
            helper.make_node("Gemm", [x, "w_ih", "b_ih"], [f"{p}ih"], transB=1),
            helper.make_node("Add", [f"{p}hh", f"{p}ih"], [f"{p}gates"]),
            helper.make_node("Split", [f"{p}gates"], [f"{p}i", f"{p}f", f"{p}g", f"{p}o"], axis=1, num_outputs=4),
            helper.make_node("Sigmoid", [f"{p}i"], [f"{p}si"]),
            helper.make_node("Sigmoid", [f"{p}f"], [f"{p}sf"]),
            helper.make_node("Tanh", [f"{p}g"], [f"{p}tg"]),
            helper.make_node("Sigmoid", [f"{p}o"], [f"{p}so"]),
            helper.make_node("Mul", [f"{p}sf", c], [f"{p}fc"]),
            helper.make_node("Mul", [f"{p}si", f"{p}tg"], [f"{p}ig"]),
            helper.make_node("Add", [f"{p}fc", f"{p}ig"], [f"{p}c_new"]),
            helper.make_node("Tanh", [f"{p}c_new"], [f"{p}tc"]),
            helper.make_node("Mul", [f"{p}so", f"{p}tc"], [f"{p}h_new"])]


def _reference(x, h, c, weights) -> tuple[np.ndarray, np.ndarray]:
    """torch.nn.LSTMCell in float64."""
    w = {k: v.astype(np.float64) for k, v in weights.items()}
    gates = x.astype(np.float64) @ w["w_ih"].T + w["b_ih"] + h.astype(np.float64) @ w["w_hh"].T + w["b_hh"]
    i, f, g, o = np.split(gates, 4, axis=1)
    sigmoid = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
    c_new = sigmoid(f) * c + sigmoid(i) * np.tanh(g)
    return sigmoid(o) * np.tanh(c_new), c_new


def _inputs():
    return [tensor_info("x", shape=[BATCH, FEATURES]), tensor_info("h", shape=[BATCH, HIDDEN]),
            tensor_info("c", shape=[BATCH, HIDDEN])]


def _feeds(seed: int = 5) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((BATCH, FEATURES)).astype(np.float32),
            "h": rng.standard_normal((BATCH, HIDDEN)).astype(np.float32) * 0.5,
            "c": rng.standard_normal((BATCH, HIDDEN)).astype(np.float32) * 0.5}


def _initializers(weights):
    return [numpy_helper.from_array(v, k) for k, v in weights.items()]


def _ops(graph) -> list[str]:
    return [node.op_type for node in graph.nodes]


@pytest.mark.parametrize("steps", [1, 3])
def test_an_lstm_cell_is_one_step_and_matches_torchs_cell(steps):
    weights = _weights()
    nodes, h, c = [], "h", "c"
    for step in range(steps):  # a chain of cells: each reads the state the one before wrote
        nodes += _cell_nodes("x", h, c, prefix=f"s{step}_")
        h, c = f"s{step}_h_new", f"s{step}_c_new"
    model = make_model(nodes, _inputs(), [tensor_info(h), tensor_info(c)], _initializers(weights), opset=18)
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    feeds = _feeds()
    got_h, got_c = session.run(None, feeds)
    want_h, want_c = feeds["h"], feeds["c"]
    for _ in range(steps):
        want_h, want_c = _reference(feeds["x"], want_h, want_c, weights)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_c, want_c, rtol=1e-4, atol=1e-5)
    assert _ops(session.graph_for(feeds)) == ["LSTMCell"] * steps
    assert any(name.endswith("fuse_lstm_cells") for name in session.applied_passes())


def test_a_cell_whose_gate_is_read_elsewhere_is_left_alone():
    weights = _weights()
    model = make_model(_cell_nodes(), _inputs(), [tensor_info("h_new"), tensor_info("c_new"), tensor_info("si")],
                       _initializers(weights), opset=18)
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    feeds = _feeds()
    got_h, got_c, _ = session.run(None, feeds)
    want_h, want_c = _reference(feeds["x"], feeds["h"], feeds["c"], weights)
    np.testing.assert_allclose(got_h, want_h, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_c, want_c, rtol=1e-4, atol=1e-5)
    assert "LSTMCell" not in _ops(session.graph_for(feeds))


def test_a_cell_in_a_branch_reading_outer_weights_is_fused():
    """silero-vad's op18 export: the cell sits in an If branch taken by data and reads the enclosing graph's
    weights."""
    weights = _weights()
    then_branch = helper.make_graph(_cell_nodes(prefix="t_"), "then", [], [tensor_info("t_h_new")])
    else_branch = helper.make_graph([helper.make_node("Identity", ["h"], ["same"])], "else", [],
                                    [tensor_info("same")])
    model = make_model([helper.make_node("If", ["cond"], ["y"], then_branch=then_branch, else_branch=else_branch)],
                       [*_inputs(), tensor_info("cond", TensorProto.BOOL, [])], [tensor_info("y")],
                       _initializers(weights), opset=18)
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    feeds = _feeds()
    (y,) = session.run(None, {**feeds, "cond": np.array(True)})
    np.testing.assert_allclose(y, _reference(feeds["x"], feeds["h"], feeds["c"], weights)[0], rtol=1e-4, atol=1e-5)
    (same,) = session.run(None, {**feeds, "cond": np.array(False)})
    np.testing.assert_array_equal(same, feeds["h"])
    (node,) = session.graph_for({**feeds, "cond": np.array(True)}).nodes
    assert _ops(node.attrs["then_branch"]) == ["LSTMCell"]


@pytest.mark.parametrize("deferring", [True, False])
def test_numpy_serves_the_cell_while_the_loop_must_not_compile_here(monkeypatch, deferring):
    """While numba loads in the background (deferring), or where the compiled loop misses numba's cache inside its
    Trial, the fused cell is computed by numpy: an empty cache never compiles the loop on the run's thread."""
    from onnx_runtime_ep_cpu.compiled import deferred
    from onnx_runtime_ep_cpu.ops import recurrent

    calls = []

    def missing(*arguments):
        calls.append(getattr(deferred._trial, "depth", 0))  # noqa: SLF001
        raise deferred.WouldCompile("simulated cache miss")

    if deferring:
        monkeypatch.setattr(deferred, "numpy_first", lambda *kinds: True)
    else:
        monkeypatch.setattr(deferred, "numpy_first", lambda *kinds: False)
        monkeypatch.setattr(recurrent, "stepped", lambda owner, steps, arguments: recurrent.deferred.tried(
            owner, "tried", lambda: missing()) is not None)
    weights = _weights()
    model = make_model(_cell_nodes(), _inputs(), [tensor_info("h_new"), tensor_info("c_new")],
                       _initializers(weights), opset=18)
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    feeds = _feeds()
    for _ in range(2):
        got_h, got_c = session.run(None, feeds)
        want_h, want_c = _reference(feeds["x"], feeds["h"], feeds["c"], weights)
        np.testing.assert_allclose(got_h, want_h, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(got_c, want_c, rtol=1e-4, atol=1e-5)
    assert _ops(session.graph_for(feeds)) == ["LSTMCell"]
    assert all(depth > 0 for depth in calls), calls  # (a miss met only inside a Trial)
    assert deferring or calls, calls
