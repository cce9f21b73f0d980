"""The conv family weighs the packed convolution, the direct tiles and the product over a batch's pixels
(algorithms/conv_choice.py) without importing their modules (conv_packed.py, conv_direct.py,
conv_pointwise_batch.py): a first run, served by numpy while numba loads (compiled/deferred.py), imports none of
them, and each loads with its builder when it is the one chosen: the tiles once the loader is done, the pixel
product (a numpy algorithm) at its first run. The choice itself is conv_path's as before (the zoo's CNNs chose
the same algorithm for every convolution, at batch 1 and 32, on one and two threads, when this moved), and every
run stays within a float64 bound.

What matters is what a new process loads, so the checks run in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.compiled import host

TILES = {"packed": "onnx_runtime_ep_cpu.algorithms.conv_packed", "direct": "onnx_runtime_ep_cpu.algorithms.conv_direct",
         "pixels": "onnx_runtime_ep_cpu.algorithms.conv_pointwise_batch"}

SCRIPT = r"""
import json, sys
import numpy as np
import onnx_runtime as ort
from onnx_runtime_ep_cpu.compiled import deferred

TILES = NAMES
options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
x = np.load(sys.argv[2])
first = sess.run(None, {"x": x})[0]
report = {"numpy_first": deferred.numpy_first(), "first_run": sorted(k for k, m in TILES.items() if m in sys.modules)}
deferred.wait_ready()
later = [sess.run(None, {"x": x})[0] for _ in range(2)]
report["after_loader"] = sorted(k for k, m in TILES.items() if m in sys.modules)
report["outputs"] = [y.tolist() for y in [first, *later]]
print(json.dumps(report))
""".replace("NAMES", repr(TILES))


def _conv_model(path, channels: int, outputs: int, kernel: int, side: int, images: int):
    """x (images, C, side, side) -> Conv (pads kernel // 2) -> Relu; returns the weight and bias written."""
    rng = np.random.default_rng(channels * 7 + kernel)
    w = (rng.standard_normal((outputs, channels, kernel, kernel)) / np.sqrt(channels * kernel * kernel)).astype(
        np.float32)
    b = rng.standard_normal(outputs).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[kernel, kernel], pads=[kernel // 2] * 4),
         helper.make_node("Relu", ["c"], ["y"])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [images, channels, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return w, b


def _reference(x, w, b):
    """Conv (stride 1, pads k // 2) + Relu in float64, tap by tap."""
    k, pad = w.shape[2], w.shape[2] // 2
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    h, wd = x.shape[2], x.shape[3]
    y = sum(np.einsum("nchw,mc->nmhw", xp[:, :, r:r + h, s:s + wd], w[:, :, r, s].astype(np.float64))
            for r in range(k) for s in range(k))
    return np.maximum(y + b.astype(np.float64)[None, :, None, None], 0)


# (name, channels, outputs, kernel, side, images, the module that loads with the loader, at the first run)
CASES = [
    ("direct tiles", 8, 16, 3, 12, 1, "direct" if host.AVX2 else None, None),
    ("packed", 64, 64, 3, 28, 1, "packed" if host.AVX512 else ("direct" if host.AVX2 else None), None),
    ("pixel product over a batch", 32, 48, 1, 1, 32, "pixels", "pixels"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_a_convolutions_first_run_imports_no_tiles_module_and_its_choice_loads_with_its_builder(tmp_path, case):
    _, channels, outputs, kernel, side, images, later, first = case
    model = tmp_path / "conv.onnx"
    w, b = _conv_model(model, channels, outputs, kernel, side, images)
    x = np.random.default_rng(3).standard_normal((images, channels, side, side)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model), str(tmp_path / "x.npy")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if report["numpy_first"]:
        assert report["first_run"] == ([first] if first else [])
    assert report["after_loader"] == sorted({later, first} - {None})
    expected = _reference(x, w, b)
    bound = 1e-5 * max(1.0, float(np.abs(expected).max()))
    for y in report["outputs"]:
        assert np.abs(np.asarray(y) - expected).max() <= bound
