"""Cold start: a fresh process's first runs of products against constant weights load no numba.

On AVX-512 hosts MatMul, Gemm and FusedMatMul of float32 activations against constant weights run the packed
products of compiled/matmul.py and gemv.py, which import numba; while numba loads in the background
(compiled/deferred.py) those calls take BLAS instead (deferred.numpy_first), and after the loader finished they
take the packed products again. Checked in a fresh interpreter (what matters is what a new process loads),
against float64 products.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SCRIPT = r"""
import json, sys
import numpy as np
import onnx_runtime as ort
from onnx_runtime_ep_cpu.compiled import deferred, host

options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(1)
feeds = [{"x": rng.standard_normal((rows, 64)).astype(np.float32)} for rows in (32, 2)]
first = [sess.run(None, f)[0] for f in feeds]
report = {"numba_after_first": "numba" in sys.modules, "avx512": host.AVX512}
report["ready"] = deferred.wait_ready(480)  # an empty cache: the loader's child compiles first
report["numpy_first_after"] = deferred.numpy_first()
later = [sess.run(None, f)[0] for f in feeds]
report["numba_after_later"] = "numba" in sys.modules
np.save(sys.argv[2], np.concatenate([np.concatenate([a, b]) for a, b in zip(first, later)]))
np.save(sys.argv[3], np.concatenate([f["x"] for f in feeds]))
print(json.dumps(report))
"""


def _model(path, weights: np.ndarray, bias: np.ndarray) -> None:
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Gemm", ["h", "w2", "b"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "products", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 48])],
                              [numpy_helper.from_array(weights, "w"),
                               numpy_helper.from_array(weights[:, :48].T.copy(), "w2"),
                               numpy_helper.from_array(bias, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


def test_first_products_load_no_numba_and_later_ones_are_compiled(tmp_path):
    rng = np.random.default_rng(0)
    weights, bias = rng.standard_normal((64, 64)).astype(np.float32), rng.standard_normal(48).astype(np.float32)
    _model(tmp_path / "m.onnx", weights, bias)
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "m.onnx"), str(tmp_path / "y.npy"),
                           str(tmp_path / "x.npy")], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["numba_after_first"] is False, report
    assert report["ready"] is True and report["numpy_first_after"] is False, report
    if report["avx512"]:  # the packed products import numba once the loader has finished
        assert report["numba_after_later"] is True, report
    x = np.load(tmp_path / "x.npy").astype(np.float64)
    w = weights.astype(np.float64)
    expected = (x @ w) @ w[:, :48] + bias
    expected = np.concatenate([expected[:32], expected[32:]])
    y = np.load(tmp_path / "y.npy")
    # first runs (32 rows, then 2) followed by the later runs, each against float64
    got_first = np.concatenate([y[:32], y[64:66]])
    got_later = np.concatenate([y[32:64], y[66:68]])
    scale = 1 + np.abs(expected).max()
    assert np.abs(got_first - expected).max() / scale < 1e-5
    assert np.abs(got_later - expected).max() / scale < 1e-5


BLOCK = r"""
import json, sys
import numpy as np
import onnxruntime
import onnx_runtime as ort
from onnx_runtime_ep_cpu.compiled import deferred

options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
feeds = {"x": np.random.default_rng(2).standard_normal((1, 64, 128)).astype(np.float32)}
oracle = onnxruntime.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"]).run(None, feeds)[0]
first = sess.run(None, feeds)[0]
report = {"numba_after_first": "numba" in sys.modules, "deferring": deferred.state.deferring}
report["first"] = float(np.abs(first - oracle).max()) / (1 + float(np.abs(oracle).max()))
print(json.dumps(report))
"""


def test_a_prefill_with_64_wide_heads_loads_no_numba_in_its_first_run(tmp_path):
    # 64-wide heads over 64 positions: on AVX-512 hosts the attention's compiled tiles (which import numba) once
    # the loader has finished, numpy's attention before (the switch itself is checked above)
    from onnx_runtime.ahead import transformer_block

    model = transformer_block(past=False, hidden=128, heads=2)
    for value in model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:
                dim.dim_value = {"batch": 1, "sequence": 64}[dim.dim_param]
    onnx.save(model, str(tmp_path / "block.onnx"))
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    done = subprocess.run([sys.executable, "-c", BLOCK, str(tmp_path / "block.onnx")], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["numba_after_first"] is False and report["deferring"] is True, report
    assert report["first"] < 1e-4, report  # float32 sums of a few hundred terms
