"""Cold start: a convolution of few output positions whose compiled algorithm waits for numba (compiled/deferred.py)
is served by numpy's im2col meanwhile (algorithms/conv_path.numpy_compute, ``interim``): the gathered direct loop's
offset table, which only that loop's steady use repays, is not built for those first runs. Checked in a fresh
interpreter (deferral opens only where numba is not loaded yet), against a float64 convolution; a convolution no
compiled algorithm takes keeps the direct loop and its table."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
from onnx import helper, numpy_helper

SCRIPT = r"""
import json, sys
import numpy as np
import onnx_runtime as ort
from onnx_runtime_ep_cpu.algorithms import conv_path
from onnx_runtime_ep_cpu.compiled import smallconv

tables, served = [], []
real_table, real_numpy = smallconv.gather_table, conv_path.numpy_compute

def table(*args):
    tables.append(args[-1])
    return real_table(*args)

def numpy_compute(*args, interim=False):
    served.append(interim)
    return real_numpy(*args, interim=interim)

smallconv.gather_table, conv_path.numpy_compute = table, numpy_compute
options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
x = np.random.default_rng(1).standard_normal((2, 16, 4, 4)).astype(sys.argv[4])
y = [sess.run(None, {"x": x})[0] for _ in range(2)]
np.save(sys.argv[2], np.stack(y))
np.save(sys.argv[3], x)
print(json.dumps({"tables": len(tables), "served": served, "numba": "numba" in sys.modules}))
"""


def _model(path, w: np.ndarray, b: np.ndarray, group: int) -> None:
    elem = helper.np_dtype_to_tensor_dtype(w.dtype)
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], strides=[2, 2], pads=[1, 1, 1, 1], group=group),
             helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "few_positions", [helper.make_tensor_value_info("x", elem,
                                                                                      ["n", 16, 4, 4])],
                              [helper.make_tensor_value_info("y", elem, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def _reference(x: np.ndarray, w: np.ndarray, b: np.ndarray, group: int) -> np.ndarray:
    """Conv (stride 2, pads 1) then Relu in float64."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, c, h, width = x.shape
    m, cg, kh, kw = w.shape
    padded = np.zeros((n, c, h + 2, width + 2))
    padded[:, :, 1:-1, 1:-1] = x
    oh, ow = (h + 2 - kh) // 2 + 1, (width + 2 - kw) // 2 + 1
    y = np.zeros((n, m, oh, ow))
    mg = m // group
    for i in range(oh):
        for j in range(ow):
            patch = padded[:, :, 2 * i:2 * i + kh, 2 * j:2 * j + kw]
            for g in range(group):
                part = patch[:, g * cg:(g + 1) * cg].reshape(n, -1)
                y[:, g * mg:(g + 1) * mg, i, j] = part @ w[g * mg:(g + 1) * mg].reshape(mg, -1).T
    return np.maximum(y + b.reshape(1, -1, 1, 1), 0)


def _run(tmp_path, group: int, out_channels: int, dtype=np.float32):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((out_channels, 16 // group, 3, 3)).astype(dtype)
    b = rng.standard_normal(out_channels).astype(dtype)
    _model(tmp_path / "m.onnx", w, b, group)
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "m.onnx"), str(tmp_path / "y.npy"),
                           str(tmp_path / "x.npy"), np.dtype(dtype).name],
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    y, x = np.load(tmp_path / "y.npy"), np.load(tmp_path / "x.npy")
    expected = _reference(x, w, b, group)
    for got in y:
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    return report


def test_first_runs_of_a_pending_compiled_conv_build_no_gather_table(tmp_path):
    # 32 outputs of 2x2 positions: the compiled direct tiles take it on AVX2 hosts, the gathered loop elsewhere
    report = _run(tmp_path, group=1, out_channels=32)
    assert not report["numba"]  # the first runs were numpy's
    if True in report["served"]:  # a compiled algorithm was pending (an AVX2 host): im2col served
        assert report["tables"] == 0
    else:  # none takes it here: numpy's own algorithm is the direct loop, with its table
        assert report["served"] and report["tables"] >= 1


def test_a_conv_no_compiled_path_takes_keeps_the_direct_loop(tmp_path):
    # float64: no compiled convolution (the packed one and the direct tiles are float32) takes it
    report = _run(tmp_path, group=1, out_channels=32, dtype=np.float64)
    assert report["served"] == [False]
    assert report["tables"] == 1
