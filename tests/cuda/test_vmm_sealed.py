"""Sealed constants on CUDA (core memory/sealed.py, providers/cuda sealed.py): two sessions of one model on the
device hold its weights once, each gives the outputs of a session alone, and the memory and its charge go when
the last session does."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import onnx
import pytest

ZOO = Path(__file__).resolve().parents[2] / "benchmarks/.models/zoo"
MODEL = ZOO / "resnet.torchscript.fp32.onnx"


@pytest.fixture
def resnet(tmp_path):
    if not MODEL.exists():
        pytest.skip(f"the model zoo is not built ({MODEL} is missing): run scripts/build_zoo.sh")
    model = onnx.load(str(MODEL))
    total = sum(onnx.numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    path = tmp_path / "resnet.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="resnet.data", size_threshold=0)
    return str(path), total


def _weights_held(governor) -> int:
    return sum(b["roles"].get("weights", 0) for b in governor.snapshot() if b["device"] == "cuda:0")


@pytest.mark.parametrize("source", ["external data", "bytes"])
def test_two_sessions_of_one_model_hold_its_weights_once(cuda_driver_mode, resnet, source):
    import onnx_runtime as ort
    from onnx_runtime.memory import process_governor
    from onnx_runtime.memory.sealed import live_sealed_constants

    path, total = resnet
    model = path if source == "external data" else onnx.load(path).SerializeToString()
    x = np.random.default_rng(0).standard_normal((1, 3, 64, 64)).astype(np.float32)
    gc.collect()
    governor = process_governor()
    before, sealed_before = _weights_held(governor), live_sealed_constants()
    first = ort.InferenceSession(model, providers=["CUDAExecutionProvider"])
    want = first.run(None, {"pixel_values": x})[0]
    assert _weights_held(governor) - before >= total
    once = _weights_held(governor)
    second = ort.InferenceSession(model, providers=["CUDAExecutionProvider"])
    assert _weights_held(governor) == once  # the second session's weights are the first's
    (stats,) = second.memory_report()["weights"]
    assert stats["sealed"] and stats["shared"] == live_sealed_constants() - sealed_before > 0
    np.testing.assert_array_equal(second.run(None, {"pixel_values": x})[0], want)
    first.close()
    gc.collect()
    np.testing.assert_array_equal(second.run(None, {"pixel_values": x})[0], want)  # still held by the second
    assert _weights_held(governor) == once
    second.close()
    gc.collect()
    assert _weights_held(governor) == before and live_sealed_constants() == sealed_before


def test_a_paged_session_reads_the_weights_an_unpaged_one_sealed(cuda_driver_mode, resnet):
    """Under a weight budget a session seals nothing, but reads the constants an unpaged session of the model
    sealed on the device rather than paging copies; its outputs are the unpaged session's."""
    import onnx_runtime as ort
    from onnx_runtime.memory.sealed import live_sealed_constants

    path, total = resnet
    x = np.random.default_rng(1).standard_normal((2, 3, 64, 64)).astype(np.float32)
    gc.collect()
    sealed_before = live_sealed_constants()
    first = ort.InferenceSession(path, providers=["CUDAExecutionProvider"])
    want = first.run(None, {"pixel_values": x})[0]
    options = ort.SessionOptions()
    options.add_session_config_entry("session.weight_residency_budget", str(total // 2))
    paged = ort.InferenceSession(path, options, providers=["CUDAExecutionProvider"])
    np.testing.assert_array_equal(paged.run(None, {"pixel_values": x})[0], want)
    (stats,) = paged.memory_report()["weights"]
    assert stats["paged"] and stats["pages"] == 0 and stats["shared"] == live_sealed_constants() - sealed_before > 0
    first.close()
    paged.close()
    gc.collect()
    assert live_sealed_constants() == sealed_before
