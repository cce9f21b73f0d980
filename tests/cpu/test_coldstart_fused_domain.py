"""The provider's fused domain lives in fused_domain.py, so the kernel families and the fused operators' shape
rules (fused_shapes.py, declared at the provider's import) name it without importing fusions.py, the fusion
passes' module: a fresh process whose plans are cached runs no pass, and that module was a few hundred
microseconds of its creation + first run (docs/cold-start.md). The check runs in fresh interpreters."""

from __future__ import annotations

import os

import numpy as np
import onnx
from model_helpers import json_from_child, saved_for_child
from onnx import TensorProto, helper, numpy_helper
from reference64 import assert_within, run_float64

SCRIPT = r"""
import json, sys
import numpy as np
import onnx_runtime as ort
from onnx_runtime.session import shape_rules
from onnx_runtime_ep_cpu.fused_domain import FUSED_DOMAIN

options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
y = sess.run(None, {"x": np.load(sys.argv[2])})[0]
print(json.dumps({"fusions": "onnx_runtime_ep_cpu.fusions" in sys.modules, "y": y.tolist(),
                  "rules": len(shape_rules.declared(FUSED_DOMAIN))}))
"""


def _model() -> onnx.ModelProto:
    """Conv-Relu, global pooling, Flatten and a Gemm head: the CPU passes fuse the convolution's epilogue."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in (("w", (4, 3, 3, 3)), ("b", (4,)), ("fw", (5, 4)), ("fb", (5,)))]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]), helper.make_node("Gemm", ["f", "fw", "fb"], ["y"], transB=1)]
    graph = helper.make_graph(nodes, "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _fresh(model_path, x_path, plans) -> dict:
    env = dict(os.environ, ONNX_RUNTIME_PLAN_CACHE="1", ONNX_RUNTIME_PLAN_CACHE_DIR=str(plans))
    return json_from_child(SCRIPT, model_path, x_path, env=env)


def test_a_cached_creation_and_first_run_import_no_fusion_pass(tmp_path):
    model = _model()
    x = np.random.default_rng(2).standard_normal((2, 3, 6, 6)).astype(np.float32)
    model_path, x_path = saved_for_child(tmp_path, model, x, "head")
    plans = tmp_path / "plans"
    for _ in range(3):  # (an edit of the installed code between the two processes changes the plans' key)
        planned = _fresh(model_path, x_path, plans)  # plans anew (its passes import fusions.py) and writes
        written = set(os.listdir(plans))
        cached = _fresh(model_path, x_path, plans)
        if set(os.listdir(plans)) == written:
            break
    assert set(os.listdir(plans)) == written, "the second process wrote plans of its own: it read none"
    assert planned["fusions"], "the planning process ran no pass: nothing to compare"
    assert not cached["fusions"], "a cached creation and first run imported the fusion passes' module"
    assert cached["rules"] == planned["rules"] > 0  # the fused operators' shape rules are declared all the same
    exact = run_float64(model, {"x": x})[0]
    for report in (planned, cached):
        assert_within(np.array(report["y"], np.float32), exact, 1e-5 * max(1.0, float(np.max(np.abs(exact)))))
