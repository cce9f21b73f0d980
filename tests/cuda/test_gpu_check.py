"""scripts/gpu_check.sh and its prerequisite checker (scripts/gpu_prereqs.py), which cannot run on a GPU here:
the script's syntax, its dry run on the simulator, the refusal on a machine without a GPU (with the fix for
each missing prerequisite and nothing else run), and the driver-version rule."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def load_prereqs():
    spec = importlib.util.spec_from_file_location("gpu_prereqs", ROOT / "scripts" / "gpu_prereqs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(module)
    return module


def run_script(*args, env=None, tmp_path=None):
    environment = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    if tmp_path is not None:
        environment["OUT"] = str(tmp_path)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env=environment, cwd=ROOT)


def test_the_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_driver_branch_rule():
    prereqs = load_prereqs()
    assert prereqs.check_driver_version("580.65.06").ok
    assert prereqs.check_driver_version("590.1").ok
    old = prereqs.check_driver_version("575.57.08")
    assert not old.ok and "TOO OLD" in old.detail and ">= 580" in old.fix
    missing = prereqs.check_driver_version(None)
    assert not missing.ok and "install the NVIDIA driver" in missing.fix
    assert not prereqs.check_driver_version("garbage").ok


def test_the_dry_run_checks_every_prerequisite(tmp_path):
    result = run_script("--dry-run", "--prereqs-only", tmp_path=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for name in ("python", "numpy", "onnx", "pytest", "cuda.bindings", "NVRTC", "CUDA headers", "NVIDIA driver",
                 "driver API version", "GPU", "torch", "transformers", "model zoo decoders"):
        assert f"] {name} " in result.stdout, name
    assert "(simulated)" in result.stdout and "ready" in result.stdout
    assert (tmp_path / "prereqs.log").is_file()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver")
def test_without_a_gpu_the_check_stops_before_anything_else(tmp_path):
    result = run_script(tmp_path=tmp_path, env={"ONNX_RUNTIME_CUDA_SIM": "1"})  # the real mode ignores the switch
    assert result.returncode == 1
    assert "NOT READY" in result.stdout and "[ MISSING] NVIDIA driver" in result.stdout
    assert "fix: install the NVIDIA driver >= 580" in result.stdout
    assert "== install" not in result.stdout and "== tests" not in result.stdout


def test_unknown_arguments_are_refused():
    result = run_script("--gpu=7")
    assert result.returncode == 2 and "unknown argument '--gpu=7'" in result.stderr


def test_the_generate_rows_run_the_zoo_decoders_replayed(cuda_driver_mode):
    """scripts/gpu_generate.py's rows (the benchmark's generate loop against torch): on the simulator our side
    replays its decode step; without torch the torch column says n/a, and a missing export says how to get it."""
    if not (ROOT / "benchmarks/.models/zoo/gpt2.torchscript.fp32.onnx").exists():
        pytest.skip("the model zoo is not built: run scripts/build_zoo.sh")
    spec = importlib.util.spec_from_file_location("gpu_generate", ROOT / "scripts" / "gpu_generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (what, ours, theirs, note), (_, missing, _, why) = module.generate_rows(
        ["gpt2.torchscript.fp32", "gpt2.absent"], 4, "cuda", torch_ok=False)
    assert "gpt2.torchscript.fp32" in what and float(ours) > 0 and theirs == "n/a", note
    assert "replaying" in note and "first token" in note
    assert missing == "n/a" and "scripts/build_zoo.sh" in why
