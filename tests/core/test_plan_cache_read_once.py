"""A session created from a model file with the plan cache on reads the file once: the bytes the cache's key hashed
are the bytes the loader parses (loader.model_bytes), unless the file changed in between."""

from __future__ import annotations

import builtins
import os

import numpy as np
import onnx_runtime as ort
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime import loader, plan_cache

WEIGHTS = np.random.default_rng(0).standard_normal((8, 6)).astype(np.float32)
X = np.random.default_rng(1).standard_normal((2, 8)).astype(np.float32)


def _model_bytes(weights: np.ndarray = WEIGHTS) -> bytes:
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    model = make_model(nodes, [tensor_info("x", shape=["batch", 8])], [tensor_info("y", shape=["batch", 6])],
                       [numpy_helper.from_array(weights, "W")])
    return model.SerializeToString()


def _opens_of(path: str, monkeypatch) -> list[str]:
    """Every open of ``path`` by the loader or the plan cache from now on."""
    opened: list[str] = []

    def counting(file, *args, **kwargs):
        if os.fspath(file) == path:
            opened.append(path)
        return builtins.open(file, *args, **kwargs)

    for module in (loader, plan_cache):
        monkeypatch.setattr(module, "open", counting, raising=False)
    return opened


def _run(path: str) -> np.ndarray:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]


def test_a_session_whose_plans_are_cached_reads_its_model_file_once(cache_dir, tmp_path, monkeypatch):
    path = str(tmp_path / "m.onnx")
    with open(path, "wb") as handle:
        handle.write(_model_bytes())
    expected = np.maximum(X.astype(np.float64) @ WEIGHTS.astype(np.float64), 0)
    np.testing.assert_allclose(_run(path), expected, rtol=1e-5, atol=1e-5)  # plans and writes its plans
    assert loader._READ_AHEAD == {}  # nothing held past the creation  # noqa: SLF001
    opened = _opens_of(path, monkeypatch)
    np.testing.assert_allclose(_run(path), expected, rtol=1e-5, atol=1e-5)  # reads them
    assert len(opened) == 1, f"the model file was opened {len(opened)} times"
    assert loader._READ_AHEAD == {}  # noqa: SLF001


def test_a_file_changed_after_its_key_is_read_again(tmp_path):
    path = str(tmp_path / "m.onnx")
    with open(path, "wb") as handle:
        handle.write(_model_bytes())
    plan_cache.source_digest(path, keep=True)
    changed = _model_bytes(WEIGHTS * 2)  # the same size: only the file's times tell
    with open(path, "wb") as handle:
        handle.write(changed)
    os.utime(path, ns=(1, 1))
    assert loader.model_bytes(path) == changed
    assert loader._READ_AHEAD == {}  # noqa: SLF001


def test_the_kept_bytes_are_the_hashed_ones_and_large_files_are_not_kept(tmp_path, monkeypatch):
    path = str(tmp_path / "m.onnx")
    with open(path, "wb") as handle:
        handle.write(_model_bytes())
    plan_cache.source_digest(path, keep=True)
    kept = loader._READ_AHEAD[path][1]  # noqa: SLF001
    assert loader.model_bytes(path) is kept
    monkeypatch.setattr(loader, "READ_AHEAD_BYTES", 16)
    plan_cache.source_digest(path, keep=True)
    assert loader._READ_AHEAD == {}  # noqa: SLF001


def test_the_inference_model_is_parsed_only_for_a_signature_the_cache_misses(cache_dir, tmp_path):
    path = str(tmp_path / "m.onnx")
    with open(path, "wb") as handle:
        handle.write(_model_bytes())
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    ort.InferenceSession(path, options, providers=["CPUExecutionProvider"]).run(None, {"x": X})  # writes the plans
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    light = session._model.inference_proto  # noqa: SLF001
    assert isinstance(light, loader.SerializedModel)
    np.testing.assert_allclose(session.run(None, {"x": X})[0], np.maximum(X.astype(np.float64) @ WEIGHTS, 0),
                               rtol=1e-5, atol=1e-5)
    assert light._proto is None  # a cached signature: never parsed  # noqa: SLF001
    wider = np.concatenate([X, -X, X[:1]])  # a batch of 5: planned here, from the inference model
    np.testing.assert_allclose(session.run(None, {"x": wider})[0], np.maximum(wider.astype(np.float64) @ WEIGHTS, 0),
                               rtol=1e-5, atol=1e-5)
    assert light._proto is not None  # noqa: SLF001
    assert light.SerializeToString() == light.parsed().SerializeToString()
