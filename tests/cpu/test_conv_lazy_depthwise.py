"""The conv family loads its depthwise modules (algorithms/conv_depthwise.py, conv_depthwise_small.py) at a model's
first depthwise convolution only: a network without one never imports them, one with them still computes them
within a float64 bound (whether numba stays off the first run's thread is test_zoo_first_run_no_numba's check: the
background kernel loader may import it on its own thread while these runs go on).

What matters is what a new process loads, so the import checks run in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.compiled import deferred

DEPTHWISE = ("onnx_runtime_ep_cpu.algorithms.conv_depthwise", "onnx_runtime_ep_cpu.algorithms.conv_depthwise_small")
ZOO = Path(__file__).resolve().parents[2] / "benchmarks" / ".models" / "zoo"

SCRIPT = r"""
import json, sys
import numpy as np
import onnx_runtime as ort

DEPTHWISE = NAMES
options = ort.SessionOptions()
options.intra_op_num_threads = 1
report = []
for path in sys.argv[1:]:
    sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feeds = {i.name: np.random.default_rng(0).standard_normal([d if isinstance(d, int) else 1 for d in i.shape])
             .astype(np.float32) for i in sess.get_inputs()}
    sess.run(None, feeds)
    report.append({"depthwise": [m for m in DEPTHWISE if m in sys.modules]})  # (numba: test_zoo_first_run_no_numba)
print(json.dumps(report))
""".replace("NAMES", repr(DEPTHWISE))


def _conv_model(path: Path, channels: int, group: int, kernel: int, stride: int, multiplier: int = 1,
                side: int = 12) -> tuple[np.ndarray, np.ndarray]:
    """x (1, C, side, side) -> Conv(group) -> Relu; returns the weight and bias written."""
    rng = np.random.default_rng(channels * 31 + kernel)
    m = channels * multiplier if group == channels else channels
    w = rng.standard_normal((m, channels // group, kernel, kernel)).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    pad = kernel // 2
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w", "b"], ["c"], group=group, kernel_shape=[kernel, kernel],
                          strides=[stride, stride], pads=[pad] * 4),
         helper.make_node("Relu", ["c"], ["y"])],
        "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, channels, side, side])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return w, b


def _reference(x, w, b, group, stride, pad):
    """Grouped convolution + Relu in float64, tap by tap."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    n, c, h, wd = x.shape
    m, cg, k, _ = w.shape
    xp = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    oh, ow = (h + 2 * pad - k) // stride + 1, (wd + 2 * pad - k) // stride + 1
    y = np.zeros((n, m, oh, ow))
    mg = m // group
    for o in range(m):
        g = o // mg
        for i in range(cg):
            for r in range(k):
                for s in range(k):
                    y[:, o] += w[o, i, r, s] * xp[:, g * cg + i, r:r + stride * oh:stride, s:s + stride * ow:stride]
    return np.maximum(y + b.astype(np.float64)[None, :, None, None], 0)


def _fresh(*paths) -> list[dict]:
    done = subprocess.run([sys.executable, "-c", SCRIPT, *map(str, paths)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_network_without_depthwise_convolutions_never_loads_their_modules(tmp_path):
    plain = tmp_path / "plain.onnx"
    depthwise = tmp_path / "depthwise.onnx"
    _conv_model(plain, 8, 1, 3, 1)
    _conv_model(depthwise, 8, 8, 3, 1)
    before, after = _fresh(plain, depthwise)
    assert before == {"depthwise": []}
    # the first depthwise convolution loads them, still on numpy's path for this first run
    assert after == {"depthwise": list(DEPTHWISE)}


@pytest.mark.skipif(not (ZOO / "resnet.dynamo.fp32.onnx").exists(), reason="the zoo is not built")
def test_zoo_resnet_loads_no_depthwise_module_and_mobilenet_does():
    resnet, mobilenet = _fresh(ZOO / "resnet.dynamo.fp32.onnx", ZOO / "mobilenetv3.torchscript.fp32.onnx")
    assert resnet == {"depthwise": []}
    assert mobilenet["depthwise"]


@pytest.mark.parametrize("channels,kernel,stride,multiplier,side", [
    (8, 3, 1, 1, 12),   # the plane loops
    (24, 3, 2, 1, 16),  # strided: the plane loops
    (32, 5, 2, 1, 8),   # small plane, 5x5: the pair sums
    (16, 3, 1, 1, 6),   # small stride-1 plane: the flat planes
    (6, 3, 1, 2, 9),    # two outputs per channel: the plane loops
])
def test_depthwise_convolutions_still_match_a_float64_reference(tmp_path, channels, kernel, stride, multiplier,
                                                                 side):
    path = tmp_path / "dw.onnx"
    w, b = _conv_model(path, channels, channels, kernel, stride, multiplier, side)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    expected = None
    for seed in range(3):  # the numpy path first, then (loader ready) the compiled loop this geometry takes
        if seed == 1:
            deferred.wait_ready(240)
        x = np.random.default_rng(seed).standard_normal((1, channels, side, side)).astype(np.float32)
        expected = _reference(x, w, b, channels, stride, kernel // 2)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)
    assert expected is not None and np.abs(expected).max() > 0
