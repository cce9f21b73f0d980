"""The background loader's thread (compiled/deferred.py) costs a first run nothing it can avoid: the run does not wait
for the OS to schedule the new thread (threading.Thread.start would block it until then: milliseconds on a loaded
host), and a process that exits before its runs paused never imports numba (the loader, woken by the exit, used to
import it then: a tenth of a second or more of every short process). Checked in fresh interpreters whose thread
starts are delayed, as an overloaded host delays them."""

from __future__ import annotations

import os
import threading
import time
import types

import numpy as np
import pytest
from model_helpers import json_from_child, saved_for_child
from onnx_runtime_ep_cpu.compiled import deferred
from reference64 import assert_within, run_float64
from test_coldstart_float_twins import _cnn

DELAY_S = 2.0  # how late each new thread of the child runs
LATE_THREADS = r"""
import atexit, json, sys, time
report = {}


def at_exit():  # registered before the runtime's own exit handlers, so it runs after them
    report["numba_at_exit"] = "numba" in sys.modules
    print(json.dumps(report), flush=True)


atexit.register(at_exit)
import _thread, queue, threading

real, asked = _thread.start_new_thread, queue.Queue()


def late():  # starts each asked thread DELAY_S after it was asked for
    while True:
        function, args = asked.get()
        time.sleep(DELAY_S)
        real(function, args)


real(late, ())


def start_late(function, args, kwargs=None):
    asked.put((function, args))
    return 0


_thread.start_new_thread = threading._start_new_thread = start_late
import numpy as np
import onnx_runtime as ort
from onnx_runtime_ep_cpu.compiled import deferred

options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
x = np.load(sys.argv[2])
began = time.perf_counter()
y = sess.run(None, {"x": x})[0]
report.update(first_run_s=time.perf_counter() - began, loader=deferred.state.thread is not None,
              numpy_first=deferred.numpy_first(), y=y.tolist())
""".replace("DELAY_S", repr(DELAY_S))


def test_a_first_run_neither_waits_for_the_loader_thread_nor_leaves_it_numba_to_import_at_exit(tmp_path):
    model = _cnn()
    x = np.random.default_rng(3).standard_normal((1, 3, 8, 8)).astype(np.float32)
    model_path, x_path = saved_for_child(tmp_path, model, x, "cnn")
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}  # (deferral on)
    began = time.perf_counter()
    report = json_from_child(LATE_THREADS, model_path, x_path, env=env, timeout=120)
    assert report["loader"] and report["numpy_first"], "no numpy-served call started the loader: nothing checked"
    assert report["first_run_s"] < DELAY_S * 0.75, f"the first run waited for the loader's thread: {report}"
    assert not report["numba_at_exit"], "the loader imported numba while the process exited"
    assert time.perf_counter() - began < 60
    exact = run_float64(model, {"x": x})[0]
    assert_within(np.array(report["y"], np.float32), exact, 1e-5 * max(1.0, float(np.max(np.abs(exact)))))


def test_the_loader_thread_takes_its_name_and_joins_as_threadings_do():
    seen, release = [], threading.Event()
    thread = deferred._Thread(lambda: (seen.append(threading.current_thread().name), release.wait(30)))  # noqa: SLF001
    thread.start()
    deadline = time.monotonic() + 30
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen == [deferred.LOADER_NAME] and thread.is_alive()
    thread.join(0.01)
    assert thread.is_alive()
    release.set()
    thread.join(30)
    assert not thread.is_alive()


def test_a_loader_thread_that_could_not_start_is_not_waited_for(monkeypatch):
    def refused(function, args):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(deferred, "_thread", types.SimpleNamespace(start_new_thread=refused))
    thread = deferred._Thread(lambda: None)  # noqa: SLF001
    with pytest.raises(RuntimeError, match="can't start new thread"):
        thread.start()
    assert not thread.is_alive()
    began = time.monotonic()
    thread.join(30)  # (at exit, _stop_at_exit joins the loader with this limit)
    assert time.monotonic() - began < 5
