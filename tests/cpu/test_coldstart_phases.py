"""benchmarks/cold_start.py --phases: a fresh process's creation and first run split into the session's steps, with
the CPU time its main thread spent importing modules and in the cyclic collector (the split that shows where a
warm start's time goes). Run in a child process: the diagnostic wraps session functions and importlib for good."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

CHILD = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from onnx import TensorProto, helper
import onnx_runtime as ort
import cold_start
spent = cold_start.timed_phases()
x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 5, 5])
y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
w = helper.make_tensor("w", TensorProto.FLOAT, [3, 2, 3, 3], np.linspace(-1, 1, 54).astype(np.float32))
node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1])
graph = helper.make_graph([node], "g", [x], [y], [w])
model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 13)])
options = ort.SessionOptions()
options.intra_op_num_threads = 1
import time
began = time.thread_time()
sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
out = sess.run(None, {"x": np.ones((1, 2, 5, 5), np.float32)})[0]
total = time.thread_time() - began
print(json.dumps({"spent": spent, "total": total, "shape": list(out.shape),
                  "loaded": "onnx_runtime_ep_cpu.ops.conv" in sys.modules}))
"""


def test_phases_count_the_imports_and_the_steps_they_nest_in():
    done = subprocess.run([sys.executable, "-c", CHILD, str(BENCHMARKS)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, ONNX_RUNTIME_PLAN_CACHE="0"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    spent = result["spent"]
    assert result["shape"] == [1, 3, 5, 5] and result["loaded"]
    # The CPU provider and the conv family are imported during creation and the first run: their imports are
    # counted once (outermost imports only), within the main thread's time for both. Not within the timed steps'
    # sum: some imports run in creation outside them (the optimizer's passes), far more on a fresh checkout whose
    # modules have no bytecode yet (a CI clone's 0.16 s against 0.06 s of steps).
    assert spent["imports"] > 0 and spent["providers"] > 0 and spent["executor runs"] >= 0
    assert spent["imports"] <= result["total"] + 1e-3
    assert spent["providers"] + spent.get("executor runs", 0.0) <= result["total"] + 1e-3
    assert spent.get("collector", 0.0) >= 0.0


def test_compile_packages_writes_stale_bytecode(tmp_path, monkeypatch):
    """The measured processes must not compile our modules from source (PYTHONDONTWRITEBYTECODE, a fresh archive
    copy): cold_start writes the packages' bytecode caches first, as an install has them."""
    import importlib.machinery
    import importlib.util

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import cold_start

    package = tmp_path / "pkg"
    package.mkdir()
    source = package / "module.py"
    source.write_text("VALUE = 1\n")
    spec = importlib.machinery.ModuleSpec("onnx_runtime", None, is_package=True)
    spec.submodule_search_locations = [str(package)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    cold_start.compile_packages()
    cached = Path(importlib.util.cache_from_source(str(source)))
    assert cached.is_file() and cached.stat().st_mtime >= source.stat().st_mtime
