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
from compile_probe import COUNT_COMPILES
from onnx import TensorProto, helper

SCRIPT = r"""
import json, sys, threading
import numpy as np
import onnx_runtime as ort
from onnx_runtime_ep_cpu.compiled import deferred

""" + COUNT_COMPILES + r"""
entered, release = threading.Event(), threading.Event()
real_child = deferred._compile_in_child
def slow_child(*request):  # the compile process held until the runs below went on without it
    entered.set()
    release.wait(120)
    return real_child(*request)
deferred._compile_in_child = slow_child

model, feeds, saved, threads, wanted = sys.argv[1], dict(np.load(sys.argv[2])), sys.argv[3], int(sys.argv[4]), \
    sys.argv[5].split(",")
options = ort.SessionOptions()
options.intra_op_num_threads = threads
sess = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
outputs = [sess.run(None, feeds)[0]]  # numpy-served; starts the loader once the runs pause
report = {"numba_after_first": "numba" in sys.modules, "loader_compiling": entered.wait(120)}
outputs += [sess.run(None, feeds)[0] for _ in range(3)]  # while the loader's compile is pending
report["main_before_release"] = compiles["main"]
release.set()
report["ready"] = deferred.wait_ready(600)
# after the switch: the compiled paths are tried; what they call that the cache missed goes to the loader's child
# (numpy serves meanwhile), never compiled here
outputs += [sess.run(None, feeds)[0] for _ in range(3)]
report["settled"] = deferred.wait_ready(600)
outputs += [sess.run(None, feeds)[0] for _ in range(3)]  # compiled, linked
linked = {key: any(loop.key.endswith(key) and loop._dispatcher is not None and loop._dispatcher.overloads
                   for loop in deferred._loops) for key in wanted}
report.update(main_compiles=compiles["main"], other_compiles=compiles["other"], linked=linked,
              child_rounds=deferred.state.compiled_in_child, child_errors=deferred.state.child_errors)
np.save(saved, np.stack(outputs))
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


def _run_fresh(tmp_path, model: str, feeds: dict, threads: int, wanted: tuple) -> tuple[dict, np.ndarray]:
    """SCRIPT in a fresh interpreter on an empty numba cache: its report and the outputs of its nine runs."""
    np.savez(tmp_path / "feeds.npz", **feeds)
    saved = str(tmp_path / "outputs.npy")
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "numba"), ONNX_RUNTIME_PLAN_CACHE="0")
    done = subprocess.run([sys.executable, "-c", SCRIPT, model, str(tmp_path / "feeds.npz"), saved, str(threads),
                           ",".join(wanted)], capture_output=True, text=True, timeout=1500, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["numba_after_first"] and report["loader_compiling"], report
    assert report["main_before_release"] == 0 and report["main_compiles"] == 0, report
    assert report["other_compiles"] == 0, report  # the loader thread links only: the child compiled
    assert report["ready"] and report["settled"] and report["child_rounds"] >= 1, report
    assert all(report["linked"].values()), report
    return report, np.load(saved)


def test_no_run_compiles_on_an_empty_cache_while_the_loader_compiles_or_after(tmp_path):
    model = str(tmp_path / "pool.onnx")
    _max_pool_model(model)
    x = np.random.default_rng(0).standard_normal((1, 4, 17, 19))
    _, outputs = _run_fresh(tmp_path, model, {"x": x}, 1, ("pooling.pool_2d",))
    assert np.max(np.abs(outputs - _reference(x)[None])) <= 1e-12, "runs disagree with the float64 reference"


def _conv_product_model(path: str, w: np.ndarray, d: np.ndarray, p: np.ndarray) -> None:
    """float32: a dense 3x3 convolution (the direct tiles), ReLU, a depthwise 3x3 one (the small-plane loops), a
    global average pool and a one-row product by constant weights (the few-row product, split across two threads):
    compiled paths whose loops have no numpy equivalent, which only the compiled convolution and product call."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["a"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["a"], ["r"]),
             helper.make_node("Conv", ["r", "d"], ["c"], pads=[1, 1, 1, 1], group=d.shape[0]),
             helper.make_node("GlobalAveragePool", ["c"], ["g"]), helper.make_node("Flatten", ["g"], ["f"]),
             helper.make_node("MatMul", ["f", "p"], ["y"])]
    inits = [onnx.numpy_helper.from_array(v, n) for n, v in (("w", w), ("d", d), ("p", p))]
    graph = helper.make_graph(nodes, "conv_product", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                     [1, w.shape[1], 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, p.shape[1]])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _conv_product_reference(x, w, d, p) -> np.ndarray:
    def conv(x, w, groups):
        n, c, h, wd = x.shape
        padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
        per = c // groups
        out = np.zeros((n, w.shape[0], h, wd))
        for m in range(w.shape[0]):
            first = (m // (w.shape[0] // groups)) * per
            for i in range(3):
                for j in range(3):
                    window = padded[:, first:first + per, i:i + h, j:j + wd]
                    out[:, m] += np.einsum("nchw,c->nhw", window, w[m, :, i, j])
        return out

    r = np.maximum(conv(x.astype(np.float64), w.astype(np.float64), 1), 0)
    c = conv(r, d.astype(np.float64), d.shape[0])
    return c.mean(axis=(2, 3)) @ p.astype(np.float64)


def test_no_run_compiles_when_the_compiled_convolutions_and_products_take_over(tmp_path):
    """After the switch the convolutions' and the product's compiled paths are tried (deferred.Trial): the loops
    they call that the cache misses are compiled by the loader's child while numpy and BLAS serve, never on the
    run's thread; the helper threads' own loops are linked before the switch (Loop.expect)."""
    rng = np.random.default_rng(1)
    x, w, d, p = (rng.standard_normal(shape).astype(np.float32)
                  for shape in ((1, 16, 12, 12), (32, 16, 3, 3), (32, 1, 3, 3), (32, 1024)))
    model = str(tmp_path / "conv_product.onnx")
    _conv_product_model(model, w, d, p)
    report, outputs = _run_fresh(tmp_path, model, {"x": x}, 2, ("workers._serve", "workers._read_cycles"))
    reference = _conv_product_reference(x, w, d, p)
    error = np.max(np.abs(outputs - reference[None])) / np.max(np.abs(reference))
    assert error <= 1e-4, f"runs disagree with the float64 reference: relative error {error:.2e}"
