"""Reshape, Flatten, Transpose, Squeeze and Unsqueeze are a family of their own (ops/view.py): a model whose only
shape operators are these (a CNN's Flatten, as TorchScript exports it, or Reshape, as dynamo does, before its
classifier) imports view.py and not shape.py's other kernels, while a model with another shape operator (Concat)
still finds its kernel. What matters is what a new process loads, so the checks run in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

SCRIPT = r"""
import json, sys
import numpy as np
import onnx_runtime as ort

sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
y = sess.run(None, {"x": np.load(sys.argv[2])})[0]
families = [f for f in ("view", "shape") if "onnx_runtime_ep_cpu.ops." + f in sys.modules]
print(json.dumps({"families": families, "y": y.tolist()}))
"""


def _model(path, spelling: str):
    """x (2, 3, 4, 5) -> Relu -> the spelling's shape operators -> y."""
    inits = [numpy_helper.from_array(np.array([2, -1], np.int64), "flat"),
             numpy_helper.from_array(np.array([0], np.int64), "front")]
    nodes = [helper.make_node("Relu", ["x"], ["r"])]
    if spelling == "torchscript":  # Flatten, then Unsqueeze and Squeeze of a front axis
        nodes += [helper.make_node("Flatten", ["r"], ["f"], axis=1),
                  helper.make_node("Unsqueeze", ["f", "front"], ["u"]),
                  helper.make_node("Squeeze", ["u", "front"], ["y"])]
    elif spelling == "dynamo":  # Reshape by a constant shape, and a Transpose
        nodes += [helper.make_node("Transpose", ["r"], ["t"], perm=[0, 1, 3, 2]),
                  helper.make_node("Reshape", ["t", "flat"], ["y"])]
    else:  # a Concat: shape.py's
        nodes += [helper.make_node("Flatten", ["r"], ["f"], axis=1),
                  helper.make_node("Concat", ["f", "f"], ["y"], axis=1)]
    graph = helper.make_graph(nodes, "views", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 5])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)


def _expected(x, spelling: str):
    r = np.maximum(x, 0)
    if spelling == "torchscript":
        return r.reshape(2, -1)
    if spelling == "dynamo":
        return r.transpose(0, 1, 3, 2).reshape(2, -1)
    return np.concatenate([r.reshape(2, -1)] * 2, axis=1)


@pytest.mark.parametrize("spelling,families", [("torchscript", ["view"]), ("dynamo", ["view"]),
                                               ("concat", ["view", "shape"])])
def test_view_operators_import_their_own_family(tmp_path, spelling, families):
    _model(tmp_path / "m.onnx", spelling)
    x = np.random.default_rng(5).standard_normal((2, 3, 4, 5)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "m.onnx"), str(tmp_path / "x.npy")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["families"] == families
    np.testing.assert_array_equal(np.asarray(report["y"], np.float32), _expected(x, spelling))


def test_unsqueeze_1_without_axes_names_the_attribute():
    from onnx_runtime.errors import InvalidGraphError
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.ops import view

    with pytest.raises(InvalidGraphError, match="Unsqueeze.*attribute 'axes' is missing; expected a list of axes"):
        view.unsqueeze_v1(Node("Unsqueeze", ["x"], ["y"], name="u"), [None], 1)
