"""A predictor built with ``prepare=True`` in a fresh process (a Ray worker's) creates its session and loads its
kernels at construction: numba's import and the linking of the plan's cached loops happen there, and its first
batch loads nothing (counted by numba's Dispatcher.compile, through which a cached loop is linked too)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

SCRIPT = r"""
import json, sys
import numpy as np
from onnx_runtime.batch.predictor import Predictor
model, prepare = sys.argv[1], sys.argv[2] == "1"
before = "numba" in sys.modules
predictor = Predictor(model, intra_op_threads=1, batch_size=8, prepare=prepare)
import numba.core.dispatcher as dispatcher
calls = [0]
original = dispatcher.Dispatcher.compile
def counted(self, sig):
    calls[0] += 1
    return original(self, sig)
dispatcher.Dispatcher.compile = counted
x = np.load(sys.argv[3])
x.setflags(write=False)
y = predictor({"x": x})["y"]
np.save(sys.argv[4], y)
print(json.dumps({"numba_before": before, "first_batch_links": calls[0]}))
"""


@pytest.fixture(scope="module")
def conv_model(tmp_path_factory) -> str:
    """y = relu(conv3x3(x, w)), x: [N, 3, 8, 8] float32, dynamic batch: a plan with compiled conv loops."""
    w = np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("prepare") / "conv.onnx"
    onnx.save(model, str(path))
    return str(path)


def _reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    padded = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    out = np.zeros((len(x), w.shape[0], 8, 8))
    for i in range(3):
        for j in range(3):
            out += np.einsum("nchw,oc->nohw", padded[:, :, i:i + 8, j:j + 8], w[:, :, i, j].astype(np.float64))
    return np.maximum(out, 0.0)


def _first_batch(model: str, prepare: bool, tmp_path) -> tuple[dict, np.ndarray, np.ndarray]:
    import json

    x = np.random.default_rng(2).standard_normal((20, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    done = subprocess.run([sys.executable, "-c", SCRIPT, model, "1" if prepare else "0", str(tmp_path / "x.npy"),
                           str(tmp_path / "y.npy")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), x, np.load(tmp_path / "y.npy")


def test_prepared_predictor_loads_its_kernels_at_construction(conv_model, tmp_path):
    counts, x, y = _first_batch(conv_model, True, tmp_path)
    assert counts == {"numba_before": False, "first_batch_links": 0}
    w = numpy_helper.to_array(onnx.load(conv_model).graph.initializer[0])
    np.testing.assert_allclose(y, _reference(x, w), rtol=1e-4, atol=1e-4)


def test_unprepared_predictor_loads_them_in_its_first_batch(conv_model, tmp_path):
    """The counter's control: the same first batch without prepare links the plan's loops there."""
    counts, x, y = _first_batch(conv_model, False, tmp_path)
    assert counts["first_batch_links"] > 0
    w = numpy_helper.to_array(onnx.load(conv_model).graph.initializer[0])
    np.testing.assert_allclose(y, _reference(x, w), rtol=1e-4, atol=1e-4)
