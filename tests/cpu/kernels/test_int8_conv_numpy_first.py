"""Cold start: a fresh process's first int8 convolutions load no numba. DynamicQuantizeConv (48b33f7) and
QLinearConv's patch rows (3511d81) imported their compiled modules when the kernel was built, so a quantized
ResNet's or ViT's first run loaded numba on the run thread; while numba loads in the background they now take
the general numpy path. Checked in a fresh interpreter, against float64 evaluations of the quantized math."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

SCRIPT = r"""
import json, sys
import numpy as np
import onnx_runtime as ort

options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
feeds = dict(np.load(sys.argv[2]))
outputs = sess.run(None, feeds)
print(json.dumps({"numba_after_first": "numba" in sys.modules}))
np.savez(sys.argv[3], *outputs)
"""


def _first_run(tmp_path, model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    onnx.save(model, str(tmp_path / "m.onnx"))
    np.savez(tmp_path / "x.npz", **feeds)
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path / "m.onnx"), str(tmp_path / "x.npz"),
                           str(tmp_path / "y.npz")], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1])["numba_after_first"] is False
    saved = np.load(tmp_path / "y.npz")
    return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def _conv64(x: np.ndarray, w: np.ndarray, stride: int) -> np.ndarray:
    n, c, h, wd = x.shape
    m, _, kh, kw = w.shape
    oh, ow = (h - kh) // stride + 1, (wd - kw) // stride + 1
    y = np.zeros((n, m, oh, ow))
    for i in range(oh):
        for j in range(ow):
            patch = x[:, :, i * stride: i * stride + kh, j * stride: j * stride + kw]
            y[:, :, i, j] = np.einsum("nchw,mchw->nm", patch, w)
    return y


def test_first_qlinear_conv_loads_no_numba(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.integers(0, 256, (1, 3, 16, 16), dtype=np.uint8)
    w = rng.integers(-127, 128, (8, 3, 4, 4), dtype=np.int8)
    x_scale, x_zero, w_scale, y_scale, y_zero = 0.02, 128, 0.01, 0.05, 120
    inits = [numpy_helper.from_array(np.array(x_scale, np.float32), "xs"),
             numpy_helper.from_array(np.array(x_zero, np.uint8), "xz"), numpy_helper.from_array(w, "w"),
             numpy_helper.from_array(np.array(w_scale, np.float32), "ws"),
             numpy_helper.from_array(np.array(0, np.int8), "wz"),
             numpy_helper.from_array(np.array(y_scale, np.float32), "ys"),
             numpy_helper.from_array(np.array(y_zero, np.uint8), "yz")]
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz"], ["y"],
                            kernel_shape=[4, 4], strides=[4, 4])  # a patch embedding's convolution
    graph = helper.make_graph([node], "qconv", [helper.make_tensor_value_info("x", TensorProto.UINT8, [1, 3, 16, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.UINT8, None)], inits)
    (y,) = _first_run(tmp_path, helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), {"x": x})
    real = _conv64((x.astype(np.float64) - x_zero), w.astype(np.float64), 4) * (x_scale * w_scale)
    expected = np.clip(np.rint(real / y_scale) + y_zero, 0, 255)
    assert np.abs(y.astype(np.int64) - expected).max() <= 1  # float32 scale products may round a code apart


def test_first_dynamic_quantize_conv_loads_no_numba(tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(6)
    w = rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3
    b = rng.standard_normal(8).astype(np.float32)
    graph = helper.make_graph([helper.make_node("Conv", ["x", "w", "b"], ["y"], kernel_shape=[3, 3])], "conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 12, 12])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "f.onnx"))
    quantize_dynamic(str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx"), op_types_to_quantize=["Conv"],
                     weight_type=QuantType.QUInt8)
    model = onnx.load(str(tmp_path / "q.onnx"))
    assert any(n.op_type == "ConvInteger" for n in model.graph.node)
    x = rng.standard_normal((1, 3, 12, 12)).astype(np.float32)
    (y,) = _first_run(tmp_path, model, {"x": x})
    # the float convolution, within what 8-bit codes of x and w lose
    expected = _conv64(x.astype(np.float64), w.astype(np.float64), 1) + b.reshape(1, -1, 1, 1)
    bound = 27 * (np.abs(x).max() / 255 * np.abs(w).max() + np.abs(w).max() / 127 * np.abs(x).max())
    assert np.abs(y - expected).max() <= bound
