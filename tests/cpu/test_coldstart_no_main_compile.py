"""On an empty numba cache, no run compiles: the background loader has its misses compiled by its child process
(compiled/compile_child.py) and links them before deferral closes (compiled/deferred.py).

Each check runs in a fresh interpreter with its own empty NUMBA_CACHE_DIR. The loader's compile process is held
until the main thread has run on (a slow compile, made deterministic), numba's compiler is counted per thread,
and the runs before, during and after the loader's work must compile nothing on the main thread and agree with a
float64 reference. The model is a float64 max pool: its loop has a numpy equivalent and compiles in seconds
(a float32 one runs as a job kind, whose runner takes a minute of CPU to compile).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

SCRIPT = r"""
import json, sys, threading
import numpy as np
import onnx_runtime as ort
from onnx_runtime_ep_cpu.compiled import deferred

main = threading.get_ident()
compiles = {"main": 0, "other": 0}

def count_compiles():  # every real compile in this process (cache loads are not compiles)
    from numba.core import compiler
    original = compiler.compile_extra

    def counted(*args, **kwargs):
        compiles["main" if threading.get_ident() == main else "other"] += 1
        return original(*args, **kwargs)
    compiler.compile_extra = counted

real_ensure = deferred.ensure_numba
def ensure():
    real_ensure()
    if not ensure.done:
        ensure.done = True
        count_compiles()
ensure.done = False
deferred.ensure_numba = ensure

entered, release = threading.Event(), threading.Event()
real_child = deferred._compile_in_child
def slow_child(misses, kinds):  # the compile process held until the runs below went on without it
    entered.set()
    release.wait(120)
    return real_child(misses, kinds)
deferred._compile_in_child = slow_child

options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
x = np.random.default_rng(0).standard_normal((1, 4, 17, 19))
outputs = [sess.run(None, {"x": x})[0]]  # numpy-served; starts the loader once the runs pause
report = {"numba_after_first": "numba" in sys.modules, "loader_compiling": entered.wait(120)}
outputs += [sess.run(None, {"x": x})[0] for _ in range(3)]  # while the loader's compile is pending
report["main_before_release"] = compiles["main"]
release.set()
report["ready"] = deferred.wait_ready(540)
outputs += [sess.run(None, {"x": x})[0] for _ in range(3)]  # after the switch: linked, never compiled here
pool = [loop for loop in deferred._loops if loop.key.endswith("pooling.pool_2d")]
report.update(main_compiles=compiles["main"], other_compiles=compiles["other"],
              child_rounds=deferred.state.compiled_in_child, pool_switched=bool(pool) and pool[0].switched)
np.save(sys.argv[2], np.stack(outputs))
print(json.dumps(report))
"""


def _max_pool_model(path: str) -> None:
    node = helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    graph = helper.make_graph([node], "pool", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [1, 4, 17, 19])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [1, 4, 9, 10])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _reference(x: np.ndarray) -> np.ndarray:
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)), constant_values=-np.inf)
    out = np.full((1, 4, 9, 10), -np.inf)
    for i in range(3):
        for j in range(3):
            out = np.maximum(out, padded[:, :, i:i + 17:2, j:j + 19:2])
    return out


def test_no_run_compiles_on_an_empty_cache_while_the_loader_compiles_or_after(tmp_path):
    model, saved = str(tmp_path / "pool.onnx"), str(tmp_path / "outputs.npy")
    _max_pool_model(model)
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "numba"), ONNX_RUNTIME_PLAN_CACHE="0")
    done = subprocess.run([sys.executable, "-c", SCRIPT, model, saved], capture_output=True, text=True, timeout=900,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["numba_after_first"] and report["loader_compiling"], report
    assert report["main_before_release"] == 0 and report["main_compiles"] == 0, report
    assert report["other_compiles"] == 0, report  # the loader thread links only: the child compiled
    assert report["ready"] and report["child_rounds"] >= 1 and report["pool_switched"], report
    x = np.random.default_rng(0).standard_normal((1, 4, 17, 19))
    outputs = np.load(saved)
    assert np.max(np.abs(outputs - _reference(x)[None])) <= 1e-12, "runs disagree with the float64 reference"
