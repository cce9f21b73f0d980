"""What a fresh process imports for a session whose plans are cached and its first runs (served by numpy while
numba loads, compiled/deferred.py): every module is a few hundred microseconds of a creation + first run that
onnxruntime does in about ten milliseconds (docs/cold-start.md). These stay out of it:

- the bound-plan builder of a FusedSegment (algorithms/segment_steps.py and the four segment_* modules it
  imports): a segment runs its nodes one by one until numba serves, and plans only then;
- the QDQ epilogue pass (qdq_epilogues.py and the three pass modules it imports): the provider declares the
  rounded producers' shape rules at import (fused_shapes.py), and a cached plan runs no pass;
- the in-place KV append (onnx_runtime/kv_append.py): the shape family imports it at its first two-input Concat,
  so a CNN's Flatten does not;
- dataclasses and named tuples: ``@dataclass`` and ``NamedTuple`` compile every class's methods in every new
  process, so the classes on this path are plain ones (onnx_runtime/records.py), planned anew or from the plan cache;
- logging: onnx_runtime/logs.py imports it at the first record a session lets through;
- pluggy: the contract's markers are the core's own (contract/markers.py), and its manager is built (and pluggy
  imported) only where a handle needs one (provider_handle.py), which a CPU session's direct hook table does not.

Once the loader is done the segment still plans, and every run's values stay within a float64 bound.
What matters is what a new process loads, so the checks run in fresh interpreters.
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
from reference64 import assert_within, run_float64

SEGMENT_BUILDER = ("onnx_runtime_ep_cpu.algorithms.segment_steps", "onnx_runtime_ep_cpu.algorithms.segment_layout",
                   "onnx_runtime_ep_cpu.algorithms.segment_chain", "onnx_runtime_ep_cpu.algorithms.segment_blocks",
                   "onnx_runtime_ep_cpu.algorithms.segment_arena")
EPILOGUE_PASS = ("onnx_runtime_ep_cpu.qdq_epilogues", "onnx_runtime_ep_cpu.qdq_norms",
                 "onnx_runtime_ep_cpu.qdq_groups", "onnx_runtime_ep_cpu.qdq_concat_inputs")
KV_APPEND = ("onnx_runtime.kv_append",)

SCRIPT = r"""
import json, sys
import numpy as np
import onnx_runtime as ort
from onnx_runtime.session import shape_rules
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN

WATCHED = NAMES
options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
x = np.load(sys.argv[2])
first = sess.run(None, {"x": x})
report = {"numpy_first": deferred.numpy_first(), "first_run": [m for m in WATCHED if m in sys.modules],
          "rounded_rules": sorted(op for op in shape_rules.declared(FUSED_DOMAIN) if op.endswith("Rounded"))}
deferred.wait_ready()
sess.run(None, {"x": x})  # (the segment plans at this run, and checks its plan against its nodes)
planned = sess.run(None, {"x": x})
report["after_loader"] = [m for m in WATCHED if m in sys.modules]
report["outputs"] = [[o.tolist() for o in first], [o.tolist() for o in planned]]
print(json.dumps(report))
""".replace("NAMES", repr(SEGMENT_BUILDER + EPILOGUE_PASS + KV_APPEND))


def _residual_cnn(channels: int = 8, size: int = 10) -> onnx.ModelProto:
    """Conv-Relu, MaxPool, a residual block (two convolutions and an Add), global pooling and a Gemm head: one
    FusedSegment after the CPU passes (as the zoo's ResNets), batch symbolic (specialized per signature)."""
    rng = np.random.default_rng(11)
    inits, nodes = [], []

    def weight(name, *shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name))
        return name

    def conv(x, y, cin, cout, k):
        nodes.append(helper.make_node("Conv", [x, weight(f"{y}_w", cout, cin, k, k), weight(f"{y}_b", cout)], [y],
                                      kernel_shape=[k, k], pads=[k // 2] * 4))

    conv("x", "c1", 3, channels, 3)
    nodes.append(helper.make_node("Relu", ["c1"], ["r1"]))
    nodes.append(helper.make_node("MaxPool", ["r1"], ["m1"], kernel_shape=[2, 2], strides=[2, 2]))
    conv("m1", "c2", channels, channels, 3)
    nodes.append(helper.make_node("Relu", ["c2"], ["r2"]))
    conv("r2", "c3", channels, channels, 3)
    nodes.append(helper.make_node("Add", ["c3", "m1"], ["s"]))
    nodes.append(helper.make_node("Relu", ["s"], ["r3"]))
    nodes.append(helper.make_node("GlobalAveragePool", ["r3"], ["p"]))
    nodes.append(helper.make_node("Flatten", ["p"], ["f"]))
    nodes.append(helper.make_node("Gemm", ["f", weight("fc_w", 5, channels), weight("fc_b", 5)], ["y"], transB=1))
    graph = helper.make_graph(nodes, "residual_cnn",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, size, size])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _fresh_process(model_path, x_path, plans) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}  # (deferral on)
    env.update(ONNX_RUNTIME_PLAN_CACHE="1", ONNX_RUNTIME_PLAN_CACHE_DIR=str(plans))
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(model_path), str(x_path)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("batch", [1, 3])
def test_cached_first_runs_import_neither_the_segment_builder_nor_the_epilogue_pass(tmp_path, batch):
    model = _residual_cnn()
    model_path, x_path = tmp_path / "cnn.onnx", tmp_path / "x.npy"
    onnx.save(model, model_path)
    x = np.random.default_rng(batch).standard_normal((batch, 3, 10, 10)).astype(np.float32)
    np.save(x_path, x)
    exact = run_float64(model, {"x": x})[0]
    # float32 convolutions of at most 3*3*8 terms, three deep, then a mean and a product of 8: a loose bound
    bound = 1e-4 * max(1.0, float(np.max(np.abs(exact))))

    plans = tmp_path / "plans"
    for _ in range(3):  # (an edit of the installed code between the two processes changes the plans' key)
        _fresh_process(model_path, x_path, plans)  # plans anew and writes them
        written = set(os.listdir(plans))
        assert any(name.endswith("-graph.plan") for name in written)
        report = _fresh_process(model_path, x_path, plans)  # reads them, as later processes do
        if set(os.listdir(plans)) == written:
            break
    assert set(os.listdir(plans)) == written, "the second process wrote plans of its own: it read none"

    assert report["numpy_first"], "the first run ended after the loader switched: nothing left to check"
    assert report["first_run"] == [], f"the first run imported {report['first_run']}"
    assert "AddRounded" in report["rounded_rules"] and "ConcatRounded" in report["rounded_rules"]
    assert set(SEGMENT_BUILDER) <= set(report["after_loader"]), "the segment did not plan after the loader"
    for outputs in report["outputs"]:
        assert_within(np.array(outputs[0], np.float32), exact, bound)


DATACLASS_SCRIPT = r"""
import json, sys, threading
import numpy as np
import onnx
main, imported = threading.get_ident(), []
# (the main thread's imports only: the background loader may import numba, which imports dataclasses)
sys.addaudithook(lambda event, args: event == "import" and threading.get_ident() == main and imported.append(args[0]))
import onnx_runtime as ort
options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
y = sess.run(None, {"x": np.load(sys.argv[2])})[0]
made = sorted({f"{name}.{value.__qualname__}" for name in set(imported) if name.startswith("onnx_runtime")
               for value in vars(sys.modules.get(name, sys)).values()
               if isinstance(value, type) and value.__module__ == name
               and ("__dataclass_fields__" in vars(value) or (issubclass(value, tuple) and "_fields" in vars(value)))})
unwanted = [name for name in ("dataclasses", "logging", "pluggy") if name in imported]
print(json.dumps({"unwanted": unwanted, "made": made, "y": y.tolist()}))
"""


@pytest.mark.parametrize("plans", ["planned anew", "from the plan cache"])
def test_a_convolution_session_defines_no_dataclass_and_loads_neither_logging_nor_pluggy(tmp_path, plans):
    """Importing the runtime, creating a CNN session and its first run import no module that defines a dataclass
    or a named tuple (each costs a new process the code it generates for its methods), nor the dataclasses module,
    nor logging (a session of the default severity logs nothing here), nor pluggy (no plugin manager is built)."""
    model = _residual_cnn()
    model_path, x_path = tmp_path / "cnn.onnx", tmp_path / "x.npy"
    onnx.save(model, model_path)
    x = np.random.default_rng(5).standard_normal((2, 3, 10, 10)).astype(np.float32)
    np.save(x_path, x)
    exact = run_float64(model, {"x": x})[0]
    env = dict(os.environ, ONNX_RUNTIME_PLAN_CACHE_DIR=str(tmp_path / "plans"),
               ONNX_RUNTIME_PLAN_CACHE="0" if plans == "planned anew" else "1")
    for _ in range(1 if plans == "planned anew" else 2):  # (the second process reads the first one's plans)
        done = subprocess.run([sys.executable, "-c", DATACLASS_SCRIPT, str(model_path), str(x_path)],
                              capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["made"] == [], f"dataclasses or named tuples defined on the way: {report['made']}"
    assert report["unwanted"] == [], f"imported on the way: {report['unwanted']}"
    assert_within(np.array(report["y"], np.float32), exact, 1e-4 * max(1.0, float(np.max(np.abs(exact)))))


HOST_SCRIPT = r"""
import json, sys
before = "encodings.ascii" in sys.modules
from onnx_runtime_ep_cpu.compiled import host
print(json.dumps({"before": before, "after": "encodings.ascii" in sys.modules, "avx2": host.AVX2,
                  "avx512": host.AVX512, "flags": sorted(host._FEATURES)}))
"""


@pytest.mark.skipif(not os.path.isfile("/proc/cpuinfo"), reason="reads Linux's /proc/cpuinfo")
def test_the_host_flags_are_read_without_the_ascii_codec():
    """compiled/host.py reads /proc/cpuinfo (ASCII) as UTF-8, a codec every interpreter has loaded: the ASCII
    codec's module would cost a new process its import."""
    done = subprocess.run([sys.executable, "-c", HOST_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["before"] and not report["after"]
    with open("/proc/cpuinfo", "rb") as info:
        line = next((row for row in info.read().decode("ascii", "replace").splitlines()
                     if row.startswith("flags") and ":" in row), "")
    assert report["flags"] == sorted(set(line.split(":", 1)[1].split())) if line else report["flags"] == []


FLAGS_ONCE_SCRIPT = r"""
import builtins, json, sys
import numpy as np
opened = []
real_open = builtins.open


def counting_open(file, *args, **kwargs):
    if file == "/proc/cpuinfo":
        opened.append(file)
    return real_open(file, *args, **kwargs)


builtins.open = counting_open
import onnx_runtime as ort
from onnx_runtime_ep_cpu.compiled import host
options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
y = sess.run(None, {"x": np.load(sys.argv[2])})[0]
print(json.dumps({"opened": len(opened), "avx512": host.AVX512, "y": y.tolist()}))
"""


@pytest.mark.skipif(not os.path.isfile("/proc/cpuinfo"), reason="reads Linux's /proc/cpuinfo")
def test_the_cpu_flags_are_read_once_per_process(tmp_path):
    """The plan cache's key and the CPU provider's kernels both need the host's CPU flags: one read of /proc/cpuinfo
    per process serves both (onnx_runtime/cpus.py), a session planned anew and one whose plans are cached alike."""
    model = _residual_cnn()
    model_path, x_path = tmp_path / "cnn.onnx", tmp_path / "x.npy"
    onnx.save(model, model_path)
    x = np.random.default_rng(9).standard_normal((2, 3, 10, 10)).astype(np.float32)
    np.save(x_path, x)
    exact = run_float64(model, {"x": x})[0]
    env = dict(os.environ, ONNX_RUNTIME_PLAN_CACHE_DIR=str(tmp_path / "plans"), ONNX_RUNTIME_PLAN_CACHE="1")
    for _ in range(2):  # (the second process reads the first one's plans)
        done = subprocess.run([sys.executable, "-c", FLAGS_ONCE_SCRIPT, str(model_path), str(x_path)],
                              capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["opened"] == 1, f"/proc/cpuinfo opened {report['opened']} times"
        assert_within(np.array(report["y"], np.float32), exact, 1e-4 * max(1.0, float(np.max(np.abs(exact)))))
    assert os.listdir(tmp_path / "plans"), "no plan written: the plan cache's key was not made"
