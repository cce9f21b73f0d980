"""Cold start: what a fresh process imports and initializes before its first result.

Each check runs in its own interpreter, since what matters is what a new process loads: ``import
onnx_runtime`` loads no provider, no compiler and no device library; a session whose kernels are all numpy
loads no compiler either and imports no other provider's package; a device provider's availability probe
(cuda-python, the driver) runs only when that provider is asked about; and loops loaded from numba's disk
cache link without numba refreshing its typing and lowering registries, which was most of a warm process's
first run. ``onnx-runtime compile`` also writes the packages' bytecode, for processes that may not write it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper

# Heavy or device-specific packages a cold process should load only when it uses them.
LAZY = ("numba", "llvmlite", "cuda", "scipy", "onnx.reference", "onnx_runtime_ep_cpu", "onnx_runtime_ep_cuda")

LOADED = """
import json, sys
def loaded():
    return sorted(name for name in {LAZY!r} if name in sys.modules)
"""

IMPORT_ONLY = LOADED + """
import onnx_runtime
print(json.dumps(loaded()))
"""

# Creates a CPU session for the model at argv[1], runs it once on ones, and reports what got loaded.
SESSION = LOADED + """
import threading, traceback
numba_importers = []  # the threads that started importing numba: the run's own, or the background loader
main_import = []  # where the run's own thread started it (the failure message shows it)
class _Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "numba":
            numba_importers.append(threading.current_thread().name)
            if threading.current_thread() is threading.main_thread():
                main_import.extend(traceback.format_stack(limit=14)[:-1])
        return None
sys.meta_path.insert(0, _Watch())
import numpy as np, onnx_runtime as ort
sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
feeds = {a.name: np.ones(a.shape, np.float32) for a in sess.get_inputs()}
out = sess.run(None, feeds)[0]
report = {"loaded": loaded(), "sum": float(out.sum()), "numba_importers": numba_importers, "main_import": main_import}
report["all"] = ort.get_all_providers()  # full discovery still finds every provider, once asked
print(json.dumps(report))
"""

# Runs the softmax model once, counting numba's context refreshes and the CPU provider's cache hits.
COUNT_REFRESHES = """
import json, sys
import numpy as np
from numba.core import base
refreshes = []
original = base.BaseContext.refresh
def refresh(self):
    refreshes.append(type(self).__name__)
    return original(self)
base.BaseContext.refresh = refresh
import onnx_runtime as ort
sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
x = np.random.default_rng(0).standard_normal((3, 48)).astype(np.float32)
y = sess.run(None, {"x": x})[0]
import onnx_runtime_ep_cpu.compiled as compiled
hits = 0
for module in [m for name, m in sys.modules.items() if name.startswith(compiled.__name__ + ".")]:
    for value in vars(module).values():
        stats = getattr(value, "stats", None)
        if stats is not None and hasattr(stats, "cache_hits"):
            hits += sum(stats.cache_hits.values())
expected = np.exp(x - x.max(-1, keepdims=True))
expected /= expected.sum(-1, keepdims=True)
print(json.dumps({"refreshes": refreshes, "hits": hits, "error": float(np.abs(y - expected).max())}))
"""


# Builds argv[1]'s ``entry`` as a cached C callback (the helper threads' runners are built so), counting numba's
# context refreshes, then calls it on a two-number buffer.
COUNT_CALLBACK_REFRESHES = """
import ctypes, json, sys
import numpy as np
from numba import types
from numba.core import base
refreshes = []
original = base.BaseContext.refresh
def refresh(self):
    refreshes.append(type(self).__name__)
    return original(self)
base.BaseContext.refresh = refresh
sys.path.insert(0, sys.argv[1])
from toy import entry
from onnx_runtime_ep_cpu.compiled import cached_cfunc
callback = cached_cfunc(types.void(types.CPointer(types.int64)), entry)
buffer = np.array([7, 0], dtype=np.int64)
callback.ctypes(buffer.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)))
print(json.dumps({"refreshes": refreshes, "hits": callback.cache_hits, "result": int(buffer[1])}))
"""

TOY = """
from numba import carray


def entry(pointer):
    values = carray(pointer, 2)
    values[1] = values[0] * 3
"""

# Imports the package and the CPU provider, counting the modules of the project compiled from source.
COUNT_SOURCE_COMPILES = """
import json, sys
import importlib._bootstrap_external as external
compiled = []
original = external.SourceLoader.source_to_code
def source_to_code(self, data, path, *args, **kwargs):
    compiled.append(path)
    return original(self, data, path, *args, **kwargs)
external.SourceLoader.source_to_code = source_to_code
import onnx_runtime, onnx_runtime_ep_cpu.plugin
from onnx_runtime.ahead import package_folders
print(json.dumps([p for p in compiled if any(p.startswith(folder) for folder in package_folders())]))
"""


def _model(path, op: str, **attrs) -> str:
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "x"] if op == "Add" else ["x"], ["y"], **attrs)], op.lower(),
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 48])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 48])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)]), path)
    return str(path)


def _run(code: str, *argv: str, env: dict | None = None):
    out = subprocess.run([sys.executable, "-c", code.replace("{LAZY!r}", repr(LAZY)), *argv], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_package_loads_no_provider_compiler_or_device_library():
    assert _run(IMPORT_ONLY) == []


def test_a_session_of_numpy_kernels_loads_no_compiler_and_probes_no_device(tmp_path):
    report = _run(SESSION, _model(tmp_path / "add.onnx", "Add"))
    assert report["sum"] == 2 * 3 * 48
    # Only the CPU provider's package is imported: the session named it, so its entry point alone is loaded.
    assert report["loaded"] == ["onnx_runtime_ep_cpu"], report
    assert "CPUExecutionProvider" in report["all"]
    if importlib.util.find_spec("onnx_runtime_ep_cuda") is not None:
        assert "CUDAExecutionProvider" in report["all"]


def test_the_control_a_model_with_compiled_loops_does_load_numba(tmp_path):
    # With background loading off: by default the first run is served by the loop's numpy equivalent
    # (test_background_compile.py).
    # A numba cache of the test's own, and the default stated rather than inherited (a benchmark module a test
    # imports once turned background loading off for the rest of the run: tests/conftest.py now refuses that).
    private = {name: value for name, value in os.environ.items() if name != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    private["NUMBA_CACHE_DIR"] = str(tmp_path / "numba-cache")
    env = dict(private, ONNX_RUNTIME_COMPILE_IN_BACKGROUND="0")
    report = _run(SESSION, _model(tmp_path / "softmax.onnx", "Softmax", axis=-1), env=env)
    assert "numba" in report["loaded"], "the softmax model should use a compiled loop, or the check proves nothing"
    assert np.isclose(report["sum"], 3.0)
    assert report["numba_importers"] == ["MainThread"], report
    # By default the run's thread never imports numba; the background loader may start its import as soon as the
    # run pauses, so whether numba is in sys.modules when the run returns is a race, not the property.
    default = _run(SESSION, _model(tmp_path / "softmax.onnx", "Softmax", axis=-1), env=private)
    where = "".join(default["main_import"])  # a string: pytest prints it whole (a dict's repr it shortens)
    assert "MainThread" not in default["numba_importers"], f"the run's thread imported numba:\n{where}"
    assert np.isclose(default["sum"], 3.0), default
    assert set(default["numba_importers"]) <= {"onnx-runtime-compiled-loops"}, default


def test_cached_loops_load_without_refreshing_numba_contexts(tmp_path):
    model = _model(tmp_path / "softmax.onnx", "Softmax", axis=-1)
    first = _run(COUNT_REFRESHES, model)  # compiles into the package's cache if nothing there yet
    assert first["error"] < 1e-6
    warm = _run(COUNT_REFRESHES, model)
    assert warm["hits"] > 0, "the second process should have loaded its loops from the cache"
    assert warm["refreshes"] == [] and warm["error"] < 1e-6, warm


def test_compile_writes_the_bytecode_a_process_that_cannot_write_it_reads(tmp_path):
    # Bytecode goes to an empty prefix folder, so the control compiles from source whatever the checkout holds.
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", PYTHONPYCACHEPREFIX=str(tmp_path / "bytecode"))
    control = _run(COUNT_SOURCE_COMPILES, env=env)
    assert any(path.endswith("inference_session.py") for path in control), control
    done = subprocess.run([sys.executable, "-c", "from onnx_runtime.ahead import compile_bytecode as c; "
                           "raise SystemExit(0 if c() else 1)"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _run(COUNT_SOURCE_COMPILES, env=env) == []


def test_cached_callbacks_load_without_refreshing_numba_contexts(tmp_path):
    (tmp_path / "toy.py").write_text(TOY)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    cold = _run(COUNT_CALLBACK_REFRESHES, str(tmp_path), env=env)
    assert cold["refreshes"] and cold["hits"] == 0 and cold["result"] == 21
    warm = _run(COUNT_CALLBACK_REFRESHES, str(tmp_path), env=env)
    assert warm["hits"] == 1 and warm["refreshes"] == [] and warm["result"] == 21, warm
