"""The CPU provider's intermediates and outputs charged to the host tier (core/onnx_runtime/memory/activations.py):
once per plan, at the peak its inferred shapes give, so a host memory limit refuses a model whose activations do
not fit at load (static shapes) or at the first run of a signature (symbolic ones), before its kernels allocate,
naming the holder and the shortfall; later runs touch no ledger."""

from __future__ import annotations

import gc
import tracemalloc
from types import SimpleNamespace

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.contract.residency import Tier
from onnx_runtime.dtypes import DataType
from onnx_runtime.ir import Graph, Node, TypeInfo, ValueInfo
from onnx_runtime.memory import MemoryBudgetError, process_governor, set_device_memory_limit
from onnx_runtime.memory.activations import plan_peak_bytes

N = 256  # features of every layer


@pytest.fixture
def host_limit():
    gc.collect()  # sessions earlier tests dropped give their charges back
    yield
    gc.collect()
    set_device_memory_limit("cpu:0", None, Tier.HOST)


def _mlp(path, batch) -> tuple[str, list[np.ndarray]]:
    """X[batch, N] -> MatMul -> Sigmoid -> MatMul -> Sigmoid -> Y, weights embedded (held in host memory)."""
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal((N, N)).astype(np.float32) / 16 for _ in range(2)]
    nodes = [helper.make_node("MatMul", ["X", "W0"], ["A"]), helper.make_node("Sigmoid", ["A"], ["B"]),
             helper.make_node("MatMul", ["B", "W1"], ["C"]), helper.make_node("Sigmoid", ["C"], ["Y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [batch, N])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [batch, N])],
                              [numpy_helper.from_array(w, f"W{i}") for i, w in enumerate(weights)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path), weights


def _reference(x: np.ndarray, weights) -> np.ndarray:
    y = x.astype(np.float64)
    for w in weights:
        y = 1 / (1 + np.exp(-(y @ w.astype(np.float64))))
    return y


def _session(path, **config):
    options = ort.SessionOptions()
    for key, value in config.items():
        options.add_session_config_entry(f"session.{key}", str(value))
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _activations(session) -> int:
    return session.memory_report()["host_activations"]["charged"]


def _host_role(role: str) -> int:
    return next((b["roles"].get(role, 0) for b in process_governor().snapshot()
                 if b["device"] == "cpu:0" and b["tier"] == "host"), 0)


def test_static_shapes_are_charged_at_load_and_a_limit_that_cannot_hold_them_fails_there(tmp_path, host_limit):
    path, weights = _mlp(tmp_path / "mlp.onnx", 64)
    governor = process_governor()
    before = governor.used("cpu:0", Tier.HOST)
    session = _session(path)
    value = 64 * N * 4  # one intermediate
    charged = _activations(session)
    # Two values are live at once at the peak (a layer's input until its output is made), at most every value.
    assert 2 * value <= charged <= 4 * value
    assert _host_role("activations") >= charged
    x = np.random.default_rng(1).standard_normal((64, N)).astype(np.float32)
    for _ in range(3):
        np.testing.assert_allclose(session.run(None, {"X": x})[0], _reference(x, weights), rtol=1e-4, atol=1e-5)
    assert _activations(session) == charged  # runs charge nothing more
    held = governor.used("cpu:0", Tier.HOST) - before
    session.close()
    assert governor.used("cpu:0", Tier.HOST) == before  # every charge given back
    with pytest.raises(MemoryBudgetError) as info:
        _session(path, host_memory_limit=before + held - charged + value // 2)  # the weights fit, not the peak
    message = str(info.value)
    assert "activations on host" in message and "bytes short" in message and "session.host_memory_limit" in message
    del info  # its traceback holds the session that failed: collected, it gives its weights back
    gc.collect()
    assert governor.used("cpu:0", Tier.HOST) == before
    fits = _session(path, host_memory_limit=before + held)
    np.testing.assert_allclose(fits.run(None, {"X": x})[0], _reference(x, weights), rtol=1e-4, atol=1e-5)
    fits.close()


def test_a_signature_whose_activations_do_not_fit_fails_at_its_first_run_before_the_kernels(tmp_path, host_limit):
    path, weights = _mlp(tmp_path / "dynamic.onnx", "batch")
    governor = process_governor()
    before = governor.used("cpu:0", Tier.HOST)
    limit = before + 2 * N * N * 4 + (4 << 20)  # the weights and 4 MiB of activations
    session = _session(path, host_memory_limit=limit)
    small = np.random.default_rng(2).standard_normal((8, N)).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"X": small})[0], _reference(small, weights), rtol=1e-4, atol=1e-5)
    big = np.zeros((8192, N), np.float32)  # 8 MiB per intermediate
    tracemalloc.start()
    try:
        with pytest.raises(MemoryBudgetError) as info:
            session.run(None, {"X": big})
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < big.nbytes  # refused before a kernel made one intermediate
    message = str(info.value)
    assert "activations on host" in message and "short" in message
    np.testing.assert_allclose(session.run(None, {"X": small})[0], _reference(small, weights), rtol=1e-4, atol=1e-5)
    session.close()
    assert governor.used("cpu:0", Tier.HOST) == before


def test_runs_touch_no_ledger(tmp_path, host_limit, monkeypatch):
    path, _ = _mlp(tmp_path / "mlp.onnx", 4)
    session = _session(path)
    x = np.ones((4, N), np.float32)
    session.run(None, {"X": x})
    calls = []
    governor = process_governor()
    monkeypatch.setattr(governor, "reserve", lambda *args, **kwargs: calls.append(args))
    for _ in range(20):
        session.run(None, {"X": x})
    assert calls == []
    session.close()


def _graph(values: dict[str, tuple]) -> Graph:
    info = {name: ValueInfo(name, TypeInfo(dtype=DataType.FLOAT, shape=shape)) for name, shape in values.items()}
    return Graph(name="g", nodes=[], inputs=[], outputs=[], initializers={}, value_info=info, opsets={"": 17})


def _step(op, outputs, slots, release=(), attrs=None, provider="CPUExecutionProvider"):
    node = Node(op, [], list(outputs), name=op, attrs=attrs or {})
    return SimpleNamespace(node=node, outputs=tuple(slots), release=tuple(release), provider=provider)


def test_peak_follows_releases_views_subgraphs_and_unsized_values():
    graph = _graph({"a": (10, 10), "b": (10, 10), "r": (100,), "c": (5,), "d": ("n", 4), "e": (20, 10)})
    body = _graph({"inner": (50, 10)})
    body.nodes = [Node("Relu", ["x"], ["inner"], name="inner")]
    steps = [
        _step("Exp", ["a"], [1]),  # 400 live
        _step("Exp", ["b"], [2], release=[1]),  # 800 at the peak, then 400
        _step("Reshape", ["r"], [3]),  # a view: nothing
        _step("Exp", ["c"], [4], release=[2]),  # 420, then 20
        _step("Exp", ["d"], [5]),  # unsized
        _step("FusedSegment", ["e"], [6], attrs={"body": body}),  # 820 live with its body's 2000 at the step
        _step("Exp", ["a"], [7], provider="OtherDevice"),  # not a host provider's
    ]
    peak, unknown = plan_peak_bytes(steps, graph, frozenset({"CPUExecutionProvider"}))
    assert (peak, unknown) == (20 + 800 + 2000, 1)
