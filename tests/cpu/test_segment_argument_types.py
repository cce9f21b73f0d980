"""A segment plan types its loops' array arguments itself (algorithms/segment_steps._argument_type): the same numba
types as the dispatcher's typeof, without importing numpy.ma (numba's masked-array check), which a fresh
worker running a convolution segment then never loads."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("numba")

ARRAYS = {
    "c float32": np.zeros((2, 3, 4), np.float32),
    "f float64": np.asfortranarray(np.zeros((3, 5))),
    "strided": np.zeros((6, 8), np.float32)[:, ::2],
    "read-only": np.zeros(7, np.int64),
    "0-d": np.array(1.5),
    "int8 rows": np.zeros((4, 4), np.int8)[1:3],
    "bool": np.zeros(3, np.bool_),
    "float16": np.zeros(5, np.float16),
    "complex": np.zeros(2, np.complex64),
    "strings": np.zeros(2, "U3"),
    "objects": np.zeros(2, object),
    "void (numba takes no such dtype)": np.zeros(2, "V4"),
    "big-endian": np.zeros(3, ">f4"),
}
ARRAYS["read-only"].setflags(write=False)


@pytest.mark.parametrize("name", sorted(ARRAYS))
def test_an_arrays_type_is_the_dispatchers(name):
    from onnx_runtime_ep_cpu.algorithms.segment_steps import _argument_type
    from onnx_runtime_ep_cpu.compiled import jobs

    dispatcher = next(v for v in vars(jobs).values() if hasattr(v, "_build_dispatcher")).dispatcher()
    value = ARRAYS[name]
    assert _argument_type(dispatcher, value) == dispatcher.typeof_pyval(value)


def test_other_arguments_go_to_the_dispatcher():
    from onnx_runtime_ep_cpu.algorithms.segment_steps import _argument_type
    from onnx_runtime_ep_cpu.compiled import jobs

    dispatcher = next(v for v in vars(jobs).values() if hasattr(v, "_build_dispatcher")).dispatcher()
    for value in (3, 2.5, np.float32(1.0), (1, 2)):
        assert _argument_type(dispatcher, value) == dispatcher.typeof_pyval(value)
    masked = np.ma.masked_array(np.zeros(3), mask=[0, 1, 0])  # not a plain ndarray: numba's own refusal
    with pytest.raises(Exception, match="MaskedArray"):
        _argument_type(dispatcher, masked)


SCRIPT = r"""
import json, sys
import numpy as np
import onnx_runtime as ort
options = ort.SessionOptions()
options.add_session_config_entry("session.compile_in_background", "0")
options.intra_op_num_threads = 1
session = ort.InferenceSession(sys.argv[1], sess_options=options, providers=["CPUExecutionProvider"])
x = np.load(sys.argv[2])
y = session.run(None, {"x": x})[0]
y = session.run(None, {"x": x})[0]
np.save(sys.argv[3], y)
print(json.dumps({"numba": "numba" in sys.modules, "numpy.ma": "numpy.ma" in sys.modules}))
"""


def test_a_fresh_process_runs_a_convolution_segment_without_numpy_ma(tmp_path):
    rng = np.random.default_rng(3)
    w1 = rng.standard_normal((8, 3, 3, 3)).astype(np.float32)
    w2 = rng.standard_normal((8, 8, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Conv", ["b", "w2"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8, 12, 12])],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(tmp_path / "m.onnx"))
    x = rng.standard_normal((4, 3, 12, 12)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "m.onnx"), str(tmp_path / "x.npy"),
                           str(tmp_path / "y.npy")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert loaded == {"numba": True, "numpy.ma": False}

    def conv(v, w):
        padded = np.pad(v, ((0, 0), (0, 0), (1, 1), (1, 1)))
        out = np.zeros((len(v), w.shape[0], 12, 12))
        for i in range(3):
            for j in range(3):
                out += np.einsum("nchw,oc->nohw", padded[:, :, i:i + 12, j:j + 12], w[:, :, i, j].astype(np.float64))
        return np.maximum(out, 0.0)

    expected = conv(conv(x.astype(np.float64), w1), w2)
    np.testing.assert_allclose(np.load(tmp_path / "y.npy"), expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
