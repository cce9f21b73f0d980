"""A session's first runs served from numpy while numba loads in the background (compiled/deferred.py).

Each check runs in a fresh interpreter, since what matters is what a new process loads and when: the first
run of a transformer block and of a CNN loads no numba and agrees with onnxruntime; after the loader
switched the loops, runs are compiled and agree with the first ones within float32 rounding; runs from
several threads across the switch stay correct; the environment variable and the session config entry
turn the behaviour off (numba then loads inside the first run, as before).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx_runtime.ahead import transformer_block

SCRIPT = r"""
import json, sys, threading, time
import numpy as np
import onnxruntime
import onnx_runtime as ort

path, mode = sys.argv[1], sys.argv[2]
options = ort.SessionOptions()
options.intra_op_num_threads = 1
if mode == "config-off":
    options.add_session_config_entry("session.compile_in_background", "0")
sess = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(0)
feeds = {a.name: rng.standard_normal([d if isinstance(d, int) else 4 for d in a.shape]).astype(np.float32)
         for a in sess.get_inputs()}
oracle = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)
first = sess.run(None, feeds)
report = {"numba_after_first": "numba" in sys.modules}
from onnx_runtime_ep_cpu.compiled import deferred
errors, outputs = [], []

def keep_running(seconds):
    stop = time.monotonic() + seconds
    try:
        while time.monotonic() < stop:
            outputs.append(sess.run(None, feeds))
    except Exception as exc:
        errors.append(repr(exc))

if mode == "threads":  # the loader waits for its patience (the runs never pause), then switches under them
    workers = [threading.Thread(target=keep_running, args=(deferred.PATIENCE_S + 2.5,)) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
deferred.wait_ready(480)  # an empty cache: the loader's child compiles at low priority first
later = sess.run(None, feeds)
loops = [l for l in deferred._loops if l._dispatcher is not None]
report.update(
    errors=errors, runs=len(outputs), ready=deferred.state.ready,
    switched=sum(l.switched for l in loops),
    first_vs_oracle=max(float(np.max(np.abs(a - b)) / (1 + np.max(np.abs(b)))) for a, b in zip(first, oracle)),
    later_vs_first=max(float(np.max(np.abs(a - b)) / (1 + np.max(np.abs(b)))) for a, b in zip(later, first)),
    threads_vs_first=max([float(np.max(np.abs(a - b)) / (1 + np.max(np.abs(b))))
                          for out in outputs for a, b in zip(out, first)] or [0.0]))
print(json.dumps(report))
"""


def _block(folder, past: bool) -> str:
    path = folder / f"block_{past}.onnx"
    model = transformer_block(past=past)
    for value in model.graph.input:
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param:  # fixed shapes: the run's feeds (a decode step: one token over 15 cached)
                dim.dim_value = {"batch": 1, "sequence": 1 if past else 16}.get(dim.dim_param, 15)
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture(scope="module")
def block(tmp_path_factory) -> str:
    return _block(tmp_path_factory.mktemp("block"), past=False)


@pytest.fixture(scope="module")
def decode_step(tmp_path_factory) -> str:
    return _block(tmp_path_factory.mktemp("step"), past=True)


def _run(model: str, mode: str, env_off: bool = False) -> dict:
    env = dict(os.environ)
    env.pop("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", None)
    if env_off:
        env["ONNX_RUNTIME_COMPILE_IN_BACKGROUND"] = "0"
    done = subprocess.run([sys.executable, "-c", SCRIPT, model, mode], capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


TOLERANCE = 1e-4  # float32 rounding of a few hundred sums, relative to the output's magnitude


@pytest.mark.parametrize("name", ["block", "decode_step"])
def test_first_run_loads_no_numba_and_later_runs_are_compiled(name, block, decode_step):
    # (The light CNNs' convolutions run compiled/directconv.py's loop, which has no numpy equivalent yet: their
    # first run loads numba, as before.)
    model = block if name == "block" else decode_step
    report = _run(model, "plain")
    assert report["numba_after_first"] is False, report
    assert report["first_vs_oracle"] < TOLERANCE, report
    assert report["ready"] and report["switched"] > 0, report
    assert report["later_vs_first"] < TOLERANCE, report


def test_runs_from_several_threads_across_the_switch_agree(block):
    report = _run(block, "threads")
    assert report["errors"] == [], report
    assert report["runs"] > 3 and report["switched"] > 0, report
    assert report["threads_vs_first"] < TOLERANCE and report["later_vs_first"] < TOLERANCE, report


@pytest.mark.parametrize("how", ["env", "config"])
def test_the_background_loading_can_be_turned_off(how, block):
    report = _run(block, "config-off" if how == "config" else "plain", env_off=how == "env")
    assert report["numba_after_first"] is True, report
    assert report["first_vs_oracle"] < TOLERANCE and report["later_vs_first"] < TOLERANCE, report


def test_loops_outside_sessions_are_compiled_at_once():
    code = ("import sys, numpy as np\n"
            "from onnx_runtime_ep_cpu.compiled import transformer\n"
            "y = np.ones((2, 8), np.float32)\n"
            "transformer.add_bias_residual(y, np.ones(8, np.float32))\n"
            "print('numba' in sys.modules, float(y.sum()))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", str(float(np.full((2, 8), 2.0).sum()))]


RACE = """
import sys, time, numpy as np
from onnx_runtime_ep_cpu.compiled import deferred, transformer
deferred.PATIENCE_S = 0.0  # the loader starts at once
deferred.open_session({})
y = np.ones((2, 8), np.float32)
transformer.add_bias_residual(y, np.ones(8, np.float32))  # served by numpy; starts the loader
time.sleep(float(sys.argv[1]))
from onnx_runtime_ep_cpu.compiled import depthwise, workers  # import numba at their top, racing the loader
deferred.wait_ready(240)
transformer.add_bias_residual(y, np.ones(8, np.float32))
print(float(y.sum()), deferred.state.ready)
"""


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.1, 0.2])
def test_modules_importing_numba_while_the_loader_does_neither_break_nor_hang(delay):
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    done = subprocess.run([sys.executable, "-c", RACE, str(delay)], capture_output=True, text=True, timeout=600,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["48.0", "True"], done.stdout


ZOO = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", ".models", "zoo")
ZOO_SCRIPT = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from zoo_feeds import make_feeds
import onnx_runtime as ort
from onnx_runtime_ep_cpu.compiled import deferred

model = json.loads(sys.argv[3])
options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[2], options, providers=["CPUExecutionProvider"])
calls = [make_feeds(call) for call in model["calls"].values()]
first = [sess.run(None, feeds) for feeds in calls]
served = sorted(loop.key.rsplit(".", 1)[1] for loop in deferred._loops if loop.pending())
without_numba = "numba" not in sys.modules
deferred.wait_ready(480)
later = [sess.run(None, feeds) for feeds in calls]
worst = max(float(np.max(np.abs(b.astype(np.float64) - a)) / (1 + np.max(np.abs(a))))
            for outs_a, outs_b in zip(first, later) for a, b in zip(outs_a, outs_b) if a.size and a.dtype.kind == "f")
print(json.dumps({"served": served, "without_numba": without_numba, "worst": worst,
                  "switched": sum(loop.switched for loop in deferred._loops)}))
"""


@pytest.mark.parametrize("name", ["bert.torchscript.fp32", "gpt2.dynamo.fp32", "whisper_encoder.torchscript.fp32",
                                  "t5_decoder.torchscript.fp32", "llama.dynamo.fp32", "vit.dynamo.fp32"])
def test_zoo_models_first_runs_agree_with_the_compiled_runs_after_the_switch(name):
    manifest = os.path.join(ZOO, "manifest.json")
    if not os.path.isfile(manifest):
        pytest.skip("the model zoo is not built (scripts/build_zoo.sh)")
    found = [m for m in json.load(open(manifest))["models"] if m["name"] == name]
    if not found:
        pytest.skip(f"{name} is not in the zoo")
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    benchmarks = os.path.join(ZOO, "..", "..")
    done = subprocess.run([sys.executable, "-c", ZOO_SCRIPT, benchmarks, os.path.join(ZOO, found[0]["file"]),
                           json.dumps(found[0])], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["served"], report  # some loop ran its numpy equivalent first
    assert report["switched"] > 0, report
    assert report["worst"] < TOLERANCE, report
