"""Weights paged to the CUDA device under a residency budget (core/onnx_runtime/memory/weights.py): a zoo model
whose weights are about 4x the budget gives the outputs of the unbudgeted run, and the device budget's
high-water mark stays within the limit the session set."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx_runtime.memory import MemoryBudgetError, process_governor, set_device_memory_limit

ZOO = Path(__file__).resolve().parents[2] / "benchmarks/.models/zoo"
MODEL = ZOO / "resnet.torchscript.fp32.onnx"


@pytest.fixture
def external_resnet(tmp_path):
    if not MODEL.exists():
        pytest.skip(f"the model zoo is not built ({MODEL} is missing): run scripts/build_zoo.sh")
    model = onnx.load(str(MODEL))
    sizes = {t.name: onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer}
    widest = max(sum(sizes.get(name, 0) for name in set(node.input)) for node in model.graph.node)
    path = tmp_path / "resnet.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="resnet.data", size_threshold=0)
    return str(path), sum(sizes.values()), widest


def _session(path, **config):
    import onnx_runtime as ort

    options = ort.SessionOptions()
    for key, value in config.items():
        options.add_session_config_entry(f"session.{key}", str(value))
    return ort.InferenceSession(path, options, providers=["CUDAExecutionProvider"])


def test_weights_four_times_the_budget_give_the_unbudgeted_outputs(cuda_driver_mode, external_resnet):
    path, total, widest = external_resnet
    budget = max(total // 4, widest)
    assert total >= 3.8 * budget
    feeds = [{"pixel_values": np.random.default_rng(seed).standard_normal((1, 3, 64, 64)).astype(np.float32)}
             for seed in range(2)]
    governor = process_governor()
    gc.collect()
    held = governor.used("cuda:0")
    unbudgeted = _session(path)
    governor.reset_high_water("cuda:0")
    want = [unbudgeted.run(None, f)[0] for f in feeds]
    (activations,) = unbudgeted.memory_report()["activations"]
    needed = total + activations["peak"]  # all the weights and the run's peak activations
    unbudgeted.close()
    gc.collect()
    limit = held + needed - (total - budget) + (16 << 10)  # less than the unbudgeted run took
    assert limit < held + needed
    paged = _session(path, weight_residency_budget=budget, memory_limit=limit)
    try:
        _paged_runs_match(paged, governor, feeds, want, budget, limit)
        with pytest.raises(MemoryBudgetError, match="on CUDAExecutionProvider.*short"):
            _session(path, memory_limit=limit).run(None, feeds[0])  # unbudgeted, it does not fit the limit
    finally:
        paged.close()
        gc.collect()
        set_device_memory_limit("cuda:0", None)


def _paged_runs_match(paged, governor, feeds, want, budget: int, limit: int) -> dict:
    """Run ``paged`` on ``feeds``: the unbudgeted outputs ``want`` exactly, weights paged and evicted within
    ``budget``, the device's high-water within ``limit``; returns the weights' stats."""
    governor.reset_high_water("cuda:0")
    for f, w in zip(feeds, want):
        np.testing.assert_array_equal(paged.run(None, f)[0], w)
    (stats,) = paged.memory_report()["weights"]
    assert stats["paged"] and stats["high_water"] <= budget and stats["evictions"] > 0
    assert governor.high_water("cuda:0") <= limit
    return stats


def _deep_mlp(path, width: int = 256, layers: int = 16) -> tuple[str, int, int]:
    """A stack of ``layers`` MatMul + Add + Relu layers of one [width, width] weight and bias each, weights in
    external data; returns the path, the weights' bytes and the widest node's."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    nodes, inits, prev = [], [], "X"
    for i in range(layers):
        weight = (rng.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
        inits += [numpy_helper.from_array(weight, f"W{i}"),
                  numpy_helper.from_array(rng.standard_normal(width).astype(np.float32) * 0.1, f"B{i}")]
        nodes += [helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"B{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"h{i}"])]
        prev = f"h{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["N", width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(path), save_as_external_data=True, location="mlp.data", size_threshold=0)
    return str(path), sum(numpy_helper.to_array(t).nbytes for t in inits), width * width * 4


def test_deep_mlp_weights_four_times_the_budget_give_the_unbudgeted_outputs(cuda_driver_mode, tmp_path):
    path, total, widest = _deep_mlp(tmp_path / "mlp.onnx")
    budget = total // 4
    assert budget >= widest and total >= 4 * budget  # the widest node fits, so the full 4x holds
    feeds = [{"X": np.random.default_rng(seed).standard_normal((4, 256)).astype(np.float32)} for seed in range(2)]
    governor = process_governor()
    gc.collect()
    held = governor.used("cuda:0")
    unbudgeted = _session(path)
    want = [unbudgeted.run(None, f)[0] for f in feeds]
    (activations,) = unbudgeted.memory_report()["activations"]
    unbudgeted.close()
    gc.collect()
    limit = held + budget + activations["peak"] + (1 << 20) + (16 << 10)  # one account step of slack
    assert limit < held + total
    paged = _session(path, weight_residency_budget=budget, memory_limit=limit)
    try:
        assert _paged_runs_match(paged, governor, feeds, want, budget, limit)["weight_bytes"] >= 4 * budget
    finally:
        paged.close()
        gc.collect()
        set_device_memory_limit("cuda:0", None)
