"""``onnx-runtime compile``: kernels compiled and cached ahead, so that a later process compiles nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx_runtime.ahead import compile_ahead, transformer_block

# Creates a session for the model and runs it at the sizes `onnx-runtime compile` uses, counting the
# numba compilations of the CPU provider's loops that this process has to do.
COUNT_COMPILES = """
import json, sys
from numba.core import event
compiled = []
class Listener(event.Listener):
    def on_start(self, ev):
        if ev.data["dispatcher"].py_func.__module__.startswith("onnx_runtime_ep_cpu"):
            compiled.append(ev.data["dispatcher"].py_func.__name__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
from onnx_runtime.ahead import run_model
result = run_model("model", sys.argv[1], ["CPUExecutionProvider"])
print(json.dumps({"error": result.error, "compiled": compiled}))
"""


def softmax_model(path) -> str:
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "softmax",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 48])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 48])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)]), path)
    return str(path)


def _compiles(model: str, cache: str) -> list[str]:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", COUNT_COMPILES, model], env=env, capture_output=True, text=True,
                         timeout=300, check=True)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["error"] is None, report["error"]
    return report["compiled"]


def test_a_process_after_compile_compiles_nothing(tmp_path):
    model = softmax_model(tmp_path / "softmax.onnx")
    cold = _compiles(model, str(tmp_path / "cold"))
    assert cold, "the softmax model is expected to need compiled loops; the control would prove nothing"
    warm = str(tmp_path / "warm")
    env = dict(os.environ, NUMBA_CACHE_DIR=warm)
    done = subprocess.run([sys.executable, "-m", "onnx_runtime.cli", "compile", model, "--providers", "cpu",
                           "--jobs", "1"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "softmax.onnx" in done.stdout
    assert _compiles(model, warm) == []


def test_a_failing_model_is_reported_and_the_others_still_run(tmp_path):
    bad = helper.make_model(helper.make_graph(
        [helper.make_node("NoSuchOperator", ["x"], ["y"])], "bad",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]))
    good = softmax_model(tmp_path / "good.onnx")
    results = compile_ahead([("bad", bad.SerializeToString()), ("good", good)], ["CPUExecutionProvider"], jobs=1)
    assert [r.name for r in results] == ["bad", "good"]
    assert results[0].error is not None and "NoSuchOperator" in results[0].error
    assert results[1].error is None


def test_compile_rejects_a_missing_model(tmp_path):
    done = subprocess.run([sys.executable, "-m", "onnx_runtime.cli", "compile", str(tmp_path / "missing.onnx")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "does not exist" in done.stderr


@pytest.mark.parametrize("past", [False, True])
def test_the_corpus_transformer_block_matches_a_float64_reference(past):
    """The default corpus's block computes a pre-norm decoder layer (so the kernels it compiles are the
    ones real decoders reach): checked against the same layer in float64 numpy."""
    import onnx_runtime

    model = transformer_block(past)
    weights = {t.name: onnx.numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 3, 64)).astype(np.float32)
    feeds = {"x": x}
    if past:
        feeds["past_key"] = rng.standard_normal((2, 4, 5, 16)).astype(np.float32)
        feeds["past_value"] = rng.standard_normal((2, 4, 5, 16)).astype(np.float32)
    sess = onnx_runtime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)

    def norm(v, name):
        mean = v.mean(-1, keepdims=True)
        var = ((v - mean) ** 2).mean(-1, keepdims=True)
        return (v - mean) / np.sqrt(var + 1e-5) * weights[f"{name}.g"] + weights[f"{name}.beta"]

    def linear(v, name):
        return v @ weights[f"{name}.w"] + weights[f"{name}.b"]

    def split(v):
        return v.reshape(2, 3, 4, 16).transpose(0, 2, 1, 3)

    x64 = x.astype(np.float64)
    h = norm(x64, "ln1")
    q, k, v = (split(linear(h, n)) for n in "qkv")
    if past:
        k = np.concatenate([feeds["past_key"].astype(np.float64), k], axis=2)
        v = np.concatenate([feeds["past_value"].astype(np.float64), v], axis=2)
    scores = q @ k.transpose(0, 1, 3, 2) / 4.0
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    x1 = x64 + linear((probs @ v).transpose(0, 2, 1, 3).reshape(2, 3, 64), "o")
    up = linear(norm(x1, "ln2"), "up")
    from math import erf, sqrt
    gelu = up * 0.5 * (1 + np.vectorize(erf)(up / sqrt(2)))
    expected = [x1 + linear(gelu, "down")] + ([k, v] if past else [])
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        assert np.abs(a - b).max() <= 1e-4 * max(1.0, np.abs(b).max())


def _run_counting(model: str, cache: str) -> tuple[list[str], str]:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache)
    out = subprocess.run([sys.executable, "-c", COUNT_COMPILES, model], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["error"] is None, report["error"]
    return report["compiled"], out.stderr


@pytest.mark.parametrize("damage", ["truncated data", "garbage index"])
def test_a_damaged_cache_entry_is_dropped_recompiled_and_rewritten(tmp_path, damage):
    model = softmax_model(tmp_path / "softmax.onnx")
    cache = str(tmp_path / "cache")
    first, _ = _run_counting(model, cache)
    assert first
    suffix = ".nbc" if damage == "truncated data" else ".nbi"
    damaged = [os.path.join(folder, name) for folder, _, names in os.walk(cache) for name in names
               if name.endswith(suffix)]
    assert damaged
    for path in damaged:
        with open(path, "r+b") as f:
            if damage == "truncated data":
                f.truncate(os.path.getsize(path) // 2)
            else:
                f.write(b"\x80\x04not a pickle at all")
    again, stderr = _run_counting(model, cache)
    assert again and "is damaged" in stderr
    assert _run_counting(model, cache)[0] == []  # the recompiled entries were written back
