"""Cold start: a fresh process's first pooling runs load no numba (b825f5c's one-part shortcut asked the compiled
window module which loop a pool takes before asking whether numpy serves first, so a ResNet's first run imported
numba on the run thread). Checked in a fresh interpreter, against a float64 evaluation of the pools."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

SCRIPT = r"""
import json, sys
import numpy as np
import onnx_runtime as ort

options = ort.SessionOptions()
options.intra_op_num_threads = int(sys.argv[3])
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
x = np.random.default_rng(1).standard_normal((1, 16, 40, 12)).astype(np.float32)
outputs = sess.run(None, {"x": x})
report = {"numba_after_first": "numba" in sys.modules}
np.savez(sys.argv[2], x=x, **{f"y{i}": y for i, y in enumerate(outputs)})
print(json.dumps(report))
"""

_POOLS = [("MaxPool", (2, 1), (2, 1)), ("MaxPool", (3, 3), (2, 2)), ("AveragePool", (2, 2), (2, 2))]


def _model(path) -> None:
    nodes, outputs = [], []
    for index, (op, kernel, strides) in enumerate(_POOLS):
        nodes.append(helper.make_node(op, ["x"], [f"y{index}"], kernel_shape=list(kernel), strides=list(strides)))
        outputs.append(helper.make_tensor_value_info(f"y{index}", TensorProto.FLOAT, None))
    graph = helper.make_graph(nodes, "pools", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16, 40, 12])],
                              outputs)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _pool(x: np.ndarray, op: str, kernel, strides) -> np.ndarray:
    n, c, h, w = x.shape
    oh, ow = (h - kernel[0]) // strides[0] + 1, (w - kernel[1]) // strides[1] + 1
    y = np.empty((n, c, oh, ow))
    for i in range(oh):
        for j in range(ow):
            window = x[:, :, i * strides[0]: i * strides[0] + kernel[0], j * strides[1]: j * strides[1] + kernel[1]]
            y[:, :, i, j] = window.max(axis=(2, 3)) if op == "MaxPool" else window.mean(axis=(2, 3))
    return y


@pytest.mark.parametrize("threads", [1, 2])
def test_first_pools_load_no_numba(tmp_path, threads):
    _model(tmp_path / "m.onnx")
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "m.onnx"), str(tmp_path / "y.npz"),
                           str(threads)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["numba_after_first"] is False
    saved = np.load(tmp_path / "y.npz")
    x = saved["x"].astype(np.float64)
    for index, (op, kernel, strides) in enumerate(_POOLS):
        np.testing.assert_allclose(saved[f"y{index}"], _pool(x, op, kernel, strides), rtol=1e-6, atol=1e-6)
