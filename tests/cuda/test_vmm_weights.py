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
        governor.reset_high_water("cuda:0")
        for f, w in zip(feeds, want):
            np.testing.assert_array_equal(paged.run(None, f)[0], w)
        (stats,) = paged.memory_report()["weights"]
        assert stats["paged"] and stats["high_water"] <= budget and stats["evictions"] > 0
        assert governor.high_water("cuda:0") <= limit
        with pytest.raises(MemoryBudgetError, match="on CUDAExecutionProvider.*short"):
            _session(path, memory_limit=limit).run(None, feeds[0])  # unbudgeted, it does not fit the limit
    finally:
        paged.close()
        gc.collect()
        set_device_memory_limit("cuda:0", None)
