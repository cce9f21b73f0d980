"""A float model's first runs, served by numpy while numba loads (compiled/deferred.py), import neither the integer
loops' numpy twins (compiled/generic_int8.py: generic.twin imports them at the first key the float table does
not hold) nor the compile child's module (compiled/child_process.py: imported when the loader first sends a
child its misses). Each module is a few hundred microseconds of a new process's creation + first run
(docs/cold-start.md); the checks run in fresh interpreters, as that is what a new process loads."""

from __future__ import annotations

import os

import numpy as np
import onnx
from model_helpers import json_from_child, saved_for_child
from onnx import TensorProto, helper, numpy_helper
from reference64 import assert_within, run_float64

WATCHED = ("onnx_runtime_ep_cpu.compiled.generic_int8", "onnx_runtime_ep_cpu.compiled.child_process")

SCRIPT = r"""
import json, sys
import numpy as np
import onnx_runtime as ort
from onnx_runtime_ep_cpu.compiled import deferred

options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
first = sess.run(None, {"x": np.load(sys.argv[2])})[0]
print(json.dumps({"numpy_first": deferred.numpy_first(), "loaded": [m for m in WATCHED if m in sys.modules],
                  "y": first.tolist()}))
""".replace("WATCHED", repr(WATCHED))


def _cnn() -> onnx.ModelProto:
    rng = np.random.default_rng(5)
    w = numpy_helper.from_array((rng.standard_normal((6, 3, 3, 3)) * 0.3).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(6).astype(np.float32), "b")
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2])]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w, b])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_float_first_run_imports_neither_the_integer_twins_nor_the_compile_child(tmp_path):
    model = _cnn()
    x = np.random.default_rng(1).standard_normal((1, 3, 8, 8)).astype(np.float32)
    model_path, x_path = saved_for_child(tmp_path, model, x, "cnn")
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}  # (deferral on)
    report = json_from_child(SCRIPT, model_path, x_path, env=env)
    assert report["numpy_first"], "the first run ended after the loader switched: nothing left to check"
    assert report["loaded"] == [], f"the first run imported {report['loaded']}"
    exact = run_float64(model, {"x": x})[0]
    assert_within(np.array(report["y"], np.float32), exact, 1e-5 * max(1.0, float(np.max(np.abs(exact)))))


TWINS = r"""
import json, sys
from onnx_runtime_ep_cpu.compiled import generic
before = "onnx_runtime_ep_cpu.compiled.generic_int8" in sys.modules
float_twin = generic.twin("onnx_runtime_ep_cpu.compiled.im2col.fill_columns") is generic.fill_columns
after_float = "onnx_runtime_ep_cpu.compiled.generic_int8" in sys.modules
from onnx_runtime_ep_cpu.compiled.generic_int8 import GENERIC_INT8
key = "onnx_runtime_ep_cpu.compiled.quantize.quantize"
print(json.dumps({"before": before, "after_float": after_float, "float_twin": float_twin,
                  "int8_twin": generic.twin(key) is GENERIC_INT8[key], "missing": generic.twin("no.such.loop"),
                  "table": set(GENERIC_INT8) <= set(generic.GENERIC) and key in generic.GENERIC
                  and "onnx_runtime_ep_cpu.compiled.im2col.fill_columns" in generic.GENERIC}))
"""


def test_the_integer_twins_load_at_the_first_key_the_float_table_lacks():
    report = json_from_child(TWINS, timeout=300)
    assert report == {"before": False, "after_float": False, "float_twin": True, "int8_twin": True,
                      "missing": None, "table": True}
