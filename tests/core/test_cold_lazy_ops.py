"""Cold start: the CPU provider imports an operator family's kernel module at the first lookup of one of its
operators (ops.FAMILIES, registry.declare_families), so a session imports only the families its model uses.

Checked in fresh interpreters: the table names exactly what each module registers (an operator added to a
module without its entry here would cost every session the import of all families); a session of a small
model imports its families and not the others, and a lookup of an operator the table does not name still
finds its kernel (all modules imported).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

TABLE = r"""
import importlib, json, pkgutil
from onnx_runtime_ep_cpu import ops, registry
declared = {(module, op) for module, names in ops.FAMILIES.items() for op in names.split()}
for info in pkgutil.iter_modules(ops.__path__):
    importlib.import_module(f"onnx_runtime_ep_cpu.ops.{info.name}")
actual = {(module.rsplit(".", 1)[1], f"{domain}:{op}" if domain else op)
          for (domain, op, since), module in registry.REGISTERED_IN.items()}
print(json.dumps({"missing": sorted(actual - declared), "extra": sorted(declared - actual)}))
"""

SESSION = r"""
import json, sys
import numpy as np
import onnx_runtime as ort
from onnx_runtime_ep_cpu import registry
sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
y = sess.run(None, {"x": np.array([[-1.0, 2.0]], np.float32)})[0]
loaded = sorted(name.rsplit(".", 1)[1] for name in sys.modules if name.startswith("onnx_runtime_ep_cpu.ops."))
undeclared = [name for name in ("onnx_runtime_ep_cpu.ops.signal", "onnx_runtime_ep_cpu.ops.text")
              if name in sys.modules]
found = registry.lookup("NoSuchOperatorAnywhere", "", 17) is None and registry.lookup("STFT", "", 17) is not None
print(json.dumps({"y": y.tolist(), "loaded": loaded, "undeclared_before": undeclared, "found": found,
                  "everything": sorted(name.rsplit(".", 1)[1] for name in sys.modules
                                       if name.startswith("onnx_runtime_ep_cpu.ops."))}))
"""


def _json(*argv: str) -> dict:
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_families_table_names_every_registration_exactly():
    report = _json("-c", TABLE)
    hint = "update providers/cpu/onnx_runtime_ep_cpu/ops/__init__.py's FAMILIES: (module, operator) pairs"
    assert report["missing"] == [], f"{hint} missing {report['missing']}"
    assert report["extra"] == [], f"{hint} not registered {report['extra']}"


def test_a_session_imports_its_families_and_a_miss_imports_all(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Softmax", ["r"], ["y"], axis=-1)]
    graph = helper.make_graph(nodes, "small", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])])
    path = tmp_path / "small.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    report = _json("-c", SESSION, str(path))
    expected = np.exp([0.0, 2.0]) / np.exp([0.0, 2.0]).sum()
    assert np.abs(np.array(report["y"][0]) - expected).max() < 1e-6
    assert {"activation", "softmax"} <= set(report["loaded"]), report
    assert report["undeclared_before"] == [], report  # families the model does not use stay unimported
    assert report["found"] is True, report
    assert {"signal", "text", "ml", "training"} <= set(report["everything"]), report


ATTENTION = r"""
import json, sys
import numpy as np
import onnx_runtime as ort
sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 3, 8)).astype(np.float32) for _ in range(3))
y = sess.run(None, {"q": q, "k": k, "v": v})[0]
print(json.dumps({"q": q.tolist(), "k": k.tolist(), "v": v.tolist(), "y": y.tolist(),
                  "modules": sorted(name for name in sys.modules if name.startswith("onnx_runtime"))}))
"""


def test_an_attention_session_imports_neither_flex_nor_linear_attention(tmp_path):
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], q_num_heads=2, kv_num_heads=2)
    graph = helper.make_graph([node], "attention",
                              [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 3, 8]) for name in "qkv"],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 8])])
    path = tmp_path / "attention.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)]), str(path))
    report = _json("-c", ATTENTION, str(path))
    q, k, v = (np.array(report[name], np.float64).reshape(1, 3, 2, 4).transpose(0, 2, 1, 3) for name in "qkv")
    scores = q @ k.transpose(0, 1, 3, 2) / 2.0
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = (weights / weights.sum(axis=-1, keepdims=True) @ v).transpose(0, 2, 1, 3).reshape(1, 3, 8)
    assert np.abs(np.array(report["y"]) - expected).max() < 1e-5
    modules = set(report["modules"])
    assert "onnx_runtime_ep_cpu.ops.transformer" in modules
    # FlexAttention's modifier subgraphs and the linear-attention recurrences are families of their own; the
    # general path's products (contrib_attention.py) load where a call takes it, not with the kernel
    assert not {"onnx_runtime.session.subgraph", "onnx_runtime_ep_cpu.ops.flex_attention",
                "onnx_runtime_ep_cpu.ops.linear_attention", "onnx_runtime_ep_cpu.algorithms.contrib_attention"} & \
        modules, sorted(modules)


CONV = r"""
import json, sys
import numpy as np
import onnx_runtime as ort
sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
x = np.linspace(-2, 2, 2 * 6 * 6, dtype=np.float32).reshape(1, 2, 6, 6)
y = sess.run(None, {"x": x})[0]
print(json.dumps({"x": x.tolist(), "y": y.tolist(), "erf": "onnx_runtime_ep_cpu.algorithms.erf" in sys.modules}))
"""


def test_a_convolution_session_leaves_erf_unimported(tmp_path):
    w = np.linspace(-1, 1, 3 * 2 * 3 * 3).astype(np.float32).reshape(3, 2, 3, 3)
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("Add", ["r", "r"], ["y"])]  # (the elementwise family: Erf's too)
    graph = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 6, 6])],
                              [onnx.numpy_helper.from_array(w, "w")])
    path = tmp_path / "conv.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    report = _json("-c", CONV, str(path))
    x = np.pad(np.array(report["x"], np.float64), ((0, 0), (0, 0), (1, 1), (1, 1)))
    expected = np.zeros((1, 3, 6, 6))
    for i in range(6):
        for j in range(6):
            expected[0, :, i, j] = np.tensordot(w.astype(np.float64), x[0, :, i:i + 3, j:j + 3], axes=3)
    assert np.abs(np.array(report["y"]) - 2 * np.maximum(expected, 0)).max() < 1e-5
    assert report["erf"] is False  # Erf and Gelu's series load it at their first use


LAYER_NORM = r"""
import json, sys
import numpy as np
import onnx_runtime as ort
sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
x = np.linspace(-3, 5, 4 * 16, dtype=np.float32).reshape(4, 16) ** 2
y = sess.run(None, {"x": x})[0]
print(json.dumps({"x": x.tolist(), "y": y.tolist(), "split": "onnx_runtime_ep_cpu.algorithms.split" in sys.modules}))
"""


def test_a_layer_normalization_session_leaves_the_thread_split_unimported(tmp_path):
    scale = np.linspace(0.5, 1.5, 16).astype(np.float32)
    bias = np.linspace(-1, 1, 16).astype(np.float32)
    node = helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=-1, epsilon=1e-5)
    graph = helper.make_graph([node], "norm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
                              [onnx.numpy_helper.from_array(a, name) for a, name in ((scale, "scale"), (bias, "bias"))])
    path = tmp_path / "norm.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    report = _json("-c", LAYER_NORM, str(path))
    x = np.array(report["x"], np.float64)
    expected = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * scale + bias
    assert np.abs(np.array(report["y"]) - expected).max() < 1e-4
    assert report["split"] is False  # BatchNormalization's channel split loads it at its first call
