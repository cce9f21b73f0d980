"""The onnx-runtime command line: providers, info, run (with the embedded default)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from model_helpers import LIGHT_DIR, make_model, tensor_info
from onnx import helper
from onnx_runtime.cli import main


def test_providers_lists_cpu_and_cuda_with_its_reason(capsys):
    assert main(["providers"]) == 0
    out = capsys.readouterr().out
    assert "CPUExecutionProvider (cpu)  onnx-runtime-ep-cpu 0.1.0  device cpu:0  available" in out
    driver = pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
    cuda_line = next(line for line in out.splitlines() if line.startswith("CUDAExecutionProvider"))

    if driver.probe():
        assert "unavailable: no NVIDIA driver found (libcuda)" in cuda_line or driver.probe() in cuda_line


def test_run_without_a_model_checks_the_embedded_resnet50(capsys):
    assert main(["run", "--providers", "cpu", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    assert "light_resnet50" in out
    assert "MATCH: output equals the shipped reference" in out
    assert "time per run: median" in out


def test_run_a_model_with_inputs_from_npy_files(tmp_path, capsys):
    model = make_model(
        [helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", shape=[4])], [tensor_info("y", shape=[4])]
    )
    onnx.save(model, tmp_path / "relu.onnx")
    np.save(tmp_path / "x.npy", np.array([-1, 2, -3, 4], np.float32))
    code = main(["run", str(tmp_path / "relu.onnx"), "--input", f"x={tmp_path / 'x.npy'}", "--providers", "cpu"])
    assert code == 0
    out = capsys.readouterr().out
    assert "output y: float32 [4] [0. 2. 0. 4.]" in out


def test_info_shows_io_opsets_and_placement(capsys):
    assert main(["info", os.path.join(LIGHT_DIR, "light_squeezenet.onnx"), "--providers", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "input: data_0 tensor(float) [1, 3, 224, 224]" in out
    assert "opsets: ai.onnx 9" in out
    import onnx_runtime as ort

    placed = len(ort.InferenceSession(os.path.join(LIGHT_DIR, "light_squeezenet.onnx"), providers=["cpu"]).placement())
    assert 0 < placed < 105  # the optimizer folds the ConstantOfShape weights away
    assert f"CPUExecutionProvider: {placed} nodes" in out


def test_errors_are_reported_not_raised(tmp_path, capsys):
    (tmp_path / "bad.onnx").write_bytes(b"\x08\x07garbage")
    assert main(["info", str(tmp_path / "bad.onnx")]) == 2
    assert "error:" in capsys.readouterr().err


def test_the_console_script_is_installed():
    result = subprocess.run([sys.executable, "-m", "onnx_runtime.cli", "providers"], capture_output=True, text=True)
    assert result.returncode == 0 and "CPUExecutionProvider" in result.stdout


def test_run_profile_prints_time_per_operator(tmp_path, capsys):
    model = make_model(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Neg", ["r"], ["y"])],
        [tensor_info("x", shape=[4])],
        [tensor_info("y", shape=[4])],
    )
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["run", str(tmp_path / "m.onnx"), "--providers", "cpu", "--repeat", "2", "--profile"]) == 0
    out = capsys.readouterr().out
    assert "operator" in out and "ms/run" in out
    rows = {line.split()[0]: line.split()[-1] for line in out.splitlines() if line.startswith(("Relu", "Neg"))}
    assert rows == {"Relu": "1", "Neg": "1"}  # one call per run of each


def test_run_trace_writes_onnxruntimes_chrome_trace(tmp_path, monkeypatch):
    import json

    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [tensor_info("x", shape=[4])],
                       [tensor_info("y", shape=[4])])
    onnx.save(model, tmp_path / "m.onnx")
    monkeypatch.chdir(tmp_path)  # the profile is first written under the session's prefix in the working folder
    trace = tmp_path / "trace.json"
    assert main(["run", str(tmp_path / "m.onnx"), "--providers", "cpu", "--repeat", "2", "--trace", str(trace)]) == 0
    events = json.loads(trace.read_text())
    relu = [e for e in events if e["cat"] == "Node"]
    assert [e["name"] for e in relu] == ["relu_kernel_time"] * 3  # the first run, then the two timed ones
    assert relu[0]["args"]["output_type_shape"] == [{"float": [4]}]
