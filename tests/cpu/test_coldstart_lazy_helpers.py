"""Helpers a float32 CNN's first runs do not need stay out of a fresh process (each module is find, read, unmarshal
and exec of a creation + first run that onnxruntime does in a few milliseconds): the activations module (only a
HardSwish convolution's epilogue and a FusedMatMul's Gelu load it), the half-precision conversion loops (only a
compiled conversion loads them), FusedMatMul's normalization in front (only a FusedMatMul loads it) and the patch
convolution (conv_choice answers whether a convolution takes it; its module loads with the first that does).
Where they are needed they still load, and the outputs stay within a float64 bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from reference64 import assert_within, run_float64

LAZY = ("onnx_runtime_ep_cpu.algorithms.activations", "onnx_runtime_ep_cpu.compiled.precision",
        "onnx_runtime_ep_cpu.ops.norm_in_front", "onnx_runtime_ep_cpu.algorithms.conv_patches")

SCRIPT = r"""
import json, sys
import numpy as np
import onnx_runtime as ort

options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
y = sess.run(None, {"x": np.load(sys.argv[2])})[0]
print(json.dumps({"loaded": [m for m in LAZY if m in sys.modules], "y": y.tolist()}))
""".replace("LAZY", repr(LAZY))


def _cnn(activation: str) -> onnx.ModelProto:
    """Conv -> ``activation`` -> MaxPool -> Conv -> ``activation`` -> GlobalAveragePool -> Flatten -> Gemm."""
    rng = np.random.default_rng(3)
    inits, nodes = [], []

    def weight(name, *shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name))
        return name

    nodes.append(helper.make_node("Conv", ["x", weight("w1", 8, 3, 3, 3), weight("b1", 8)], ["c1"], pads=[1] * 4))
    nodes.append(helper.make_node(activation, ["c1"], ["a1"]))
    nodes.append(helper.make_node("MaxPool", ["a1"], ["m1"], kernel_shape=[2, 2], strides=[2, 2]))
    nodes.append(helper.make_node("Conv", ["m1", weight("w2", 8, 8, 3, 3), weight("b2", 8)], ["c2"], pads=[1] * 4))
    nodes.append(helper.make_node(activation, ["c2"], ["a2"]))
    nodes.append(helper.make_node("GlobalAveragePool", ["a2"], ["p"]))
    nodes.append(helper.make_node("Flatten", ["p"], ["f"]))
    nodes.append(helper.make_node("Gemm", ["f", weight("fc_w", 5, 8), weight("fc_b", 5)], ["y"], transB=1))
    graph = helper.make_graph(nodes, "cnn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("activation", ["Relu", "HardSwish"])
def test_a_float_cnn_first_run_loads_only_the_helpers_it_uses(tmp_path, activation):
    model = _cnn(activation)
    model_path, x_path = tmp_path / "cnn.onnx", tmp_path / "x.npy"
    onnx.save(model, model_path)
    x = np.random.default_rng(1).standard_normal((2, 3, 12, 12)).astype(np.float32)
    np.save(x_path, x)
    exact = run_float64(model, {"x": x})[0]
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}  # (deferral on)
    env.update(ONNX_RUNTIME_PLAN_CACHE="1", ONNX_RUNTIME_PLAN_CACHE_DIR=str(tmp_path / "plans"))
    for _ in range(2):  # planned anew (the passes may load them), then read from the plan cache as later processes
        done = subprocess.run([sys.executable, "-c", SCRIPT, str(model_path), str(x_path)], capture_output=True,
                              text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert_within(np.array(report["y"], np.float32), exact, 1e-4 * max(1.0, float(np.max(np.abs(exact)))))
    expected = [LAZY[0]] if activation == "HardSwish" else []  # (the convolutions' HardSwish epilogue)
    assert report["loaded"] == expected


def test_a_patch_convolution_still_takes_the_patch_product(monkeypatch):
    """A 2x2 stride-2 convolution onto a 4x4 map (conv_choice.patches_apply) loads conv_patches with its first
    build and runs PatchConv, within a float64 bound, before and after the compiled loops switch in."""
    import onnx_runtime as ort
    from onnx_runtime_ep_cpu.algorithms import conv_patches
    from onnx_runtime_ep_cpu.compiled import deferred

    rng = np.random.default_rng(7)
    w = (rng.standard_normal((64, 32, 2, 2)) * 0.3).astype(np.float32)
    b = rng.standard_normal(64).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w", "b"], ["c"], kernel_shape=[2, 2], strides=[2, 2]),
                               helper.make_node("Relu", ["c"], ["y"])], "patches",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    taken, calls = [], conv_patches.PatchConv.calls

    def counted(self, *args):
        taken.append(self)
        return calls(self, *args)

    monkeypatch.setattr(conv_patches.PatchConv, "calls", counted)
    x = rng.standard_normal((1, 32, 8, 8)).astype(np.float32)
    exact = run_float64(model, {"x": x})[0]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    for run in range(3):
        assert_within(sess.run(None, {"x": x})[0], exact, 1e-4 * max(1.0, float(np.max(np.abs(exact)))))
        if run == 0:
            deferred.wait_ready(240)
    assert taken
