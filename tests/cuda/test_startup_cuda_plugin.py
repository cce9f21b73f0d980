"""Start-up cost: the CUDA entry point describes the provider without importing it, cuda-python is imported only
when a driver may exist, and the description says what the provider class says."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

driver = pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")

from onnx_runtime import ProviderHandle  # noqa: E402
from onnx_runtime_ep_cuda.plugin import PROVIDER  # noqa: E402
from onnx_runtime_ep_cuda.provider import CUDAExecutionProvider  # noqa: E402

_REPORT = """
import json, sys
import numpy as np
import onnx_runtime as ort
from onnx import TensorProto, helper
graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
mode = sys.argv[1]
if mode == "cpu":
    sess = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
elif mode == "default":
    sess = ort.InferenceSession(model)
else:
    sess = ort.InferenceSession(model, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
(y,) = sess.run(None, {"x": np.array([-1.0, 2.0], np.float32)})
assert y.tolist() == [0.0, 2.0]
loaded = sorted(m for m in sys.modules if m == "cuda" or m.startswith(("cuda.", "onnx_runtime_ep_cuda")))
print(json.dumps({"available": ort.get_available_providers(), "providers": sess.get_providers(), "modules": loaded}))
"""


def _report(mode: str, sim: bool) -> dict:
    env = {k: v for k, v in os.environ.items() if k != driver.SIM_ENV}
    if sim:
        env[driver.SIM_ENV] = "1"
    done = subprocess.run([sys.executable, "-c", _REPORT, mode], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("sim", [False, True])
def test_a_cpu_only_session_imports_neither_cuda_python_nor_the_provider(sim):
    report = _report("cpu", sim)
    assert report["providers"] == ["CPUExecutionProvider"]
    assert not [m for m in report["modules"] if m == "cuda" or m.startswith("cuda.")], report["modules"]
    assert "onnx_runtime_ep_cuda.provider" not in report["modules"]


def test_without_a_device_the_default_session_does_not_import_the_provider():
    if driver.simulated():
        pytest.skip("the simulator switch is on in this process; the subprocess below runs without it")
    real_reason = driver.probe()
    if not real_reason:
        pytest.skip("a CUDA driver is present: the default session uses the CUDA provider here")
    report = _report("default", sim=False)
    assert "CUDAExecutionProvider" not in report["available"] and "CUDAExecutionProvider" not in report["providers"]
    assert "onnx_runtime_ep_cuda.provider" not in report["modules"]
    if "libcuda" in real_reason:  # no driver: cuda-python is not worth importing either
        assert not [m for m in report["modules"] if m == "cuda" or m.startswith("cuda.")], report["modules"]


def test_on_the_simulator_cuda_is_still_listed_and_selected():
    report = _report("cuda", sim=True)
    assert report["available"][0] == "CUDAExecutionProvider"
    assert report["providers"][0] == "CUDAExecutionProvider"
    assert "onnx_runtime_ep_cuda.provider" in report["modules"]


@pytest.mark.parametrize("sim", [False, True])
def test_the_description_matches_the_provider_class(sim, monkeypatch):
    if sim:
        monkeypatch.setenv(driver.SIM_ENV, "1")
    else:
        monkeypatch.delenv(driver.SIM_ENV, raising=False)
    handle = ProviderHandle(CUDAExecutionProvider())
    assert (PROVIDER.name, PROVIDER.short_name, PROVIDER.contract_version, PROVIDER.device) == \
        (handle.name, handle.short_name, handle.contract_version, str(handle.device_id))
    assert PROVIDER.selected_by_default == bool(handle.hook.selected_by_default())
    assert PROVIDER.availability() == handle.availability()
    assert PROVIDER.load() is CUDAExecutionProvider


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the Linux search order")
def test_probe_without_a_driver_runs_no_library_search(monkeypatch):
    """Where neither libcuda soname loads (a CPU-only machine, a batch worker), the probe answers without
    ctypes.util.find_library, whose ldconfig and gcc subprocesses cost a new process ~40 ms and find nothing the
    loader did not; a soname that loads is found without it too."""
    searched, opened = [], []

    def search(name):
        searched.append(name)
        return "libcuda.so.1"

    def missing(name, *args, **kwargs):
        opened.append(name)
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(driver.ctypes.util, "find_library", search)
    monkeypatch.setattr(driver.ctypes, "CDLL", missing)
    assert driver._libcuda_present() is False  # noqa: SLF001
    assert searched == [] and opened == ["libcuda.so.1", "libcuda.so"]
    monkeypatch.setattr(driver.ctypes, "CDLL", lambda name, *args, **kwargs: opened.append(name))
    assert driver._libcuda_present() is True and searched == []  # noqa: SLF001
