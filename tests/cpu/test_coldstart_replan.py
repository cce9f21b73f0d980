"""Plans made while a loop was served by a fallback are made again once the loader has linked it
(onnx_runtime_ep_cpu/provisional.py), and the packed product serves BLAS while its loop compiles.

Each check runs in a fresh interpreter with its own empty NUMBA_CACHE_DIR (never the tree's ``__pycache__``), on
a copy of the CPU provider's package (numba's cache entries are stamped with its compiled modules' sources: an
edit in the tree while the loader's child compiles would make the parent miss what the child wrote):
after the loader's switch the compiled convolutions' loops miss the cache, so the segment planned at the next
run binds those nodes' kernel steps and is provisional; after ``deferred.wait_ready`` (loops linked, plans
final) it binds every node. numba's compiler is counted per thread: nothing compiles on the main thread, and
every run agrees with a float64 reference.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
from compile_probe import COUNT_COMPILES
from onnx import TensorProto, helper, numpy_helper
from reference64 import run_float64

SCRIPT = r"""
import gc, json, sys, threading
import numpy as np
import onnx_runtime as ort
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.ops import segment as segment_module

""" + COUNT_COMPILES + r"""
builds = [0]
real_build = segment_module.build_plan
def counted_build(*args):
    builds[0] += 1
    return real_build(*args)
segment_module.build_plan = counted_build

def plans():
    found = [p for s in gc.get_objects() if isinstance(s, segment_module.Segment) for ps in s.plans.values()
             for p in ps or [None]]
    return [None if p is None else p.describe() for p in found]

model, feeds, saved = sys.argv[1], dict(np.load(sys.argv[2])), sys.argv[3]
options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
outputs = [sess.run(None, feeds)[0]]  # numpy-served; starts the loader
report = {"ready": deferred.wait_ready(900)}  # the switch: the compiled paths are tried from the next run
outputs.append(sess.run(None, feeds)[0])  # the window: misses go to the loader's child, fallbacks serve
report["window"] = plans()
outputs.append(sess.run(None, feeds)[0])
report["settled"] = deferred.wait_ready(900)  # loops linked and plans final
report["after"] = plans()
report["builds_after"] = builds[0]
outputs += [sess.run(None, feeds)[0] for _ in range(3)]
report.update(final=plans(), builds_final=builds[0], main_compiles=compiles["main"],
              other_compiles=compiles["other"], child_rounds=deferred.state.compiled_in_child,
              child_errors=deferred.state.child_errors)
np.save(saved, np.stack(outputs))
report["package"] = segment_module.__file__
print(json.dumps(report))
"""


def _run_fresh(tmp_path, model: onnx.ModelProto, feeds: dict) -> tuple[dict, np.ndarray]:
    """SCRIPT in a fresh interpreter on an empty numba cache: its report and the outputs of its six runs."""
    path = str(tmp_path / "model.onnx")
    onnx.save(model, path)
    np.savez(tmp_path / "feeds.npz", **feeds)
    saved = str(tmp_path / "outputs.npy")
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    import onnx_runtime_ep_cpu

    package = os.path.dirname(os.path.abspath(onnx_runtime_ep_cpu.__file__))
    shutil.copytree(package, tmp_path / "package" / "onnx_runtime_ep_cpu", ignore=shutil.ignore_patterns("__pycache__"))
    env.update(NUMBA_CACHE_DIR=str(tmp_path / "numba"), ONNX_RUNTIME_PLAN_CACHE="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path / "package"), env.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", SCRIPT, path, str(tmp_path / "feeds.npz"), saved],
                          capture_output=True, text=True, timeout=2400, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["ready"] and report["settled"] and report["child_rounds"] >= 1, report
    assert report["package"].startswith(str(tmp_path)), report["package"]  # the copy
    counts = {k: report[k] for k in ("main_compiles", "other_compiles", "child_rounds", "child_errors")}
    assert report["main_compiles"] == 0 and report["other_compiles"] == 0, counts  # the child compiled
    return report, np.load(saved)


def _block_model(rng) -> onnx.ModelProto:
    """float32: a dense 3x3 convolution with bias and ReLU, a depthwise 3x3 one, HardSwish, a pointwise one and a
    global average pool: one FusedSegment whose convolutions take compiled paths (direct tiles, depthwise loops)
    that no numpy-served call names, so their loops miss the cache after the loader's switch."""
    inits = []

    def weight(name, *shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name))
        return name

    nodes = [helper.make_node("Conv", ["x", weight("w1", 16, 8, 3, 3), weight("b1", 16)], ["c1"], pads=[1] * 4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", weight("w2", 16, 1, 3, 3)], ["c2"], pads=[1] * 4, group=16),
             helper.make_node("HardSwish", ["c2"], ["h2"]),
             helper.make_node("Conv", ["h2", weight("w3", 8, 16, 1, 1)], ["c3"]),
             helper.make_node("GlobalAveragePool", ["c3"], ["y"])]
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_segment_planned_while_its_loops_compile_binds_them_after_wait_ready(tmp_path):
    rng = np.random.default_rng(0)
    model = _block_model(rng)
    x = rng.standard_normal((1, 8, 12, 12)).astype(np.float32)
    report, outputs = _run_fresh(tmp_path, model, {"x": x})
    window = [p for p in report["window"] if p is not None]
    # planned in the window: provisional, its convolutions' kernel steps kept (or left to the nodes meanwhile)
    assert all(p["provisional"] for p in window) and (not window or any(p["kernels"] for p in window)), report
    assert report["window"], report
    (after,) = report["after"]
    assert after is not None and after == {**after, "kernels": 0, "provisional": False}, report
    assert report["final"] == report["after"] and report["builds_final"] == report["builds_after"], report
    exact = run_float64(model, {"x": x})[0]
    error = np.max(np.abs(outputs - exact[None])) / np.max(np.abs(exact))
    assert error <= 1e-5, f"runs disagree with the float64 reference: relative error {error:.2e}"


def _packed_model(rng) -> onnx.ModelProto:
    """A GPT-2 block's MLP as the TorchScript exporter writes it: MatMul, bias Add, Gelu (erf form), MatMul,
    bias Add and the residual Add, over 64 rows: FusedMatMul nodes that take the packed product
    (compiled/matmul.py through jobs.split_matmul)."""
    def tensor(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) * 0.1).astype(np.float32), name)

    constants = [numpy_helper.from_array(np.array(v, np.float32), n)
                 for n, v in (("sqrt2", np.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"]), helper.make_node("Add", ["m1", "b1"], ["a1"]),
             helper.make_node("Div", ["a1", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["a1", "e1"], ["g0"]),
             helper.make_node("Mul", ["g0", "half"], ["g"]), helper.make_node("MatMul", ["g", "w2"], ["m2"]),
             helper.make_node("Add", ["m2", "b2"], ["a2"]), helper.make_node("Add", ["a2", "x"], ["y"])]
    inits = [tensor("w1", 128, 512), tensor("b1", 512), tensor("w2", 512, 128), tensor("b2", 128), *constants]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 64, 128])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_the_packed_product_serves_blas_while_its_loop_compiles(tmp_path):
    rng = np.random.default_rng(1)
    model = _packed_model(rng)
    x = rng.standard_normal((1, 64, 128)).astype(np.float32)
    _, outputs = _run_fresh(tmp_path, model, {"x": x})  # (no main-thread compile: asserted there)
    exact = run_float64(model, {"x": x})[0]
    error = np.max(np.abs(outputs - exact[None])) / np.max(np.abs(exact))
    assert error <= 1e-5, f"runs disagree with the float64 reference: relative error {error:.2e}"
