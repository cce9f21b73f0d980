"""Cold start of convolution networks: a fresh process's first runs load no numba, later runs take the compiled
convolutions.

While numba loads in the background (compiled/deferred.py), a convolution whose algorithm is compiled (the
packed convolution on AVX-512 hosts, the direct tiles and depthwise lanes on AVX2 ones, the depthwise loop)
takes numpy and BLAS (algorithms/conv_path.numpy_compute), and pooling runs its numpy equivalent; once the
loader has finished the same session switches to the compiled ones. Checked in a fresh interpreter (what
matters is what a new process loads), against onnxruntime, on the host's paths and, on AVX-512 hosts, on the
AVX2 ones too.
"""

from __future__ import annotations

import json
import os
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
from onnx_runtime_ep_cpu.compiled import deferred, host

if sys.argv[3] == "avx2":  # the AVX2 kernels (direct tiles, depthwise lanes) run on AVX-512 hosts too
    host.AVX512 = False
options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
x = np.load(sys.argv[2])


def outputs():
    return np.concatenate([output.reshape(-1) for output in sess.run(None, {"x": x})])


first = outputs()
report = {"numba_after_first": "numba" in sys.modules, "avx2": host.AVX2, "avx512": host.AVX512}
report["ready"] = deferred.wait_ready(240)
later = [outputs() for _ in range(2)]
report["numba_after_later"] = "numba" in sys.modules
np.save(sys.argv[2].replace("x.npy", "y.npy"), np.stack([first, *later]))
print(json.dumps(report))
"""


def _conv(name, source, weights, bias=True, **attributes):
    inputs = [source, f"{name}_w"] + ([f"{name}_b"] if bias else [])
    return helper.make_node("Conv", inputs, [name], name=name, **attributes)


def _model(path) -> None:
    """A small CNN through every path conv_path chooses between: a 3x3 convolution with ReLU, a depthwise one
    with HardSwish, pointwise ones with a residual, a wide-input 3x3 with ReLU (per-tap products while
    deferring), a strided one, MaxPool, AveragePool and GlobalAveragePool."""
    rng = np.random.default_rng(3)
    shapes = {"c1": (16, 8, 3, 3), "dw": (16, 1, 3, 3), "pw": (16, 16, 1, 1), "up": (64, 16, 1, 1),
              "wide": (16, 64, 3, 3), "s2": (24, 16, 3, 3)}
    inits = []
    for name, shape in shapes.items():
        scale = 1 / np.sqrt(np.prod(shape[1:]))
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), f"{name}_w"))
        inits.append(numpy_helper.from_array(rng.standard_normal(shape[0]).astype(np.float32) * 0.1, f"{name}_b"))
    nodes = [
        _conv("c1", "x", "c1", pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c1"], ["a"]),
        _conv("dw", "a", "dw", group=16, pads=[1, 1, 1, 1]), helper.make_node("HardSwish", ["dw"], ["h"]),
        _conv("pw", "h", "pw"), helper.make_node("Add", ["pw", "a"], ["r"]),
        _conv("up", "r", "up"),
        _conv("wide", "up", "wide", pads=[1, 1, 1, 1]), helper.make_node("Relu", ["wide"], ["v"]),
        helper.make_node("MaxPool", ["v"], ["m"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        _conv("s2", "m", "s2", strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("AveragePool", ["s2"], ["p"], kernel_shape=[2, 2], strides=[1, 1]),
        helper.make_node("GlobalAveragePool", ["p"], ["g"]),
        helper.make_node("Flatten", ["g"], ["f"]), helper.make_node("Concat", ["f", "f"], ["y"], axis=1),
    ]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8, 20, 20])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 48])], inits)
    # y alone would hide the early layers' errors behind the pooling: every layer's output is compared too
    for value in ("a", "h", "r", "v", "m", "s2"):
        graph.output.append(helper.make_tensor_value_info(value, TensorProto.FLOAT, None))
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))


@pytest.mark.parametrize("kernels", ["host", "avx2"])
def test_first_runs_load_no_numba_and_later_runs_are_compiled(tmp_path, kernels):
    import onnxruntime

    _model(tmp_path / "m.onnx")
    x = np.random.default_rng(4).standard_normal((2, 8, 20, 20)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "m.onnx"), str(tmp_path / "x.npy"), kernels],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if kernels == "avx2" and not (report["avx2"] or report["avx512"]):
        pytest.skip("the AVX2 kernels need an x86-64 host with AVX2 and FMA")
    assert report["numba_after_first"] is False, report
    assert report["ready"] is True, report
    if report["avx2"] or report["avx512"]:  # the compiled convolutions import numba once the loader finished
        assert report["numba_after_later"] is True, report
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    oracle = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), options, providers=["CPUExecutionProvider"])
    expected = np.concatenate([o.reshape(-1) for o in oracle.run(None, {"x": x})]).astype(np.float64)
    scale = 1 + np.abs(expected).max()
    for got in np.load(tmp_path / "y.npy"):  # the first (numpy) run, then the compiled ones
        assert np.abs(got - expected).max() / scale < 2e-5
