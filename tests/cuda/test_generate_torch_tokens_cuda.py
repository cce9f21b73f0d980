"""Issue 21's first target: greedy tokens equal torch's greedy tokens for the same weights, on the CPU provider and
on the CUDA simulator (decode step captured and replayed). torch lives in the zoo's venv (.venv-zoo), so its side
runs there in a child process (scripts/gpu_generate.py's torch_side: the zoo model rebuilt in torch from its seed,
its own KV cache loop); skipped where that venv or the zoo is missing (a clean clone)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from test_generate import PROMPT, _model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ZOO_PYTHON = ROOT / ".venv-zoo/bin/python"
MODELS = ["llama.torchscript.fp32", "llama.dynamo.fp32", "gpt2.torchscript.fp32", "gpt2.dynamo.fp32"]
NEW = 12
TORCH_SIDE = """
import json, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, "scripts")
import gpu_generate
gpu_generate.PROMPT = json.loads(sys.argv[1])
print(json.dumps({name: gpu_generate.torch_side(name, int(sys.argv[2]), "cpu")[0] for name in sys.argv[3:]}))
"""


@pytest.fixture(scope="module")
def torch_tokens():
    if not ZOO_PYTHON.exists():
        pytest.skip(f"torch's side needs the zoo's venv ({ZOO_PYTHON} is missing): run scripts/build_zoo.sh")
    for name in MODELS:
        _model(name)
    done = subprocess.run([str(ZOO_PYTHON), "-c", TORCH_SIDE, json.dumps(PROMPT), str(NEW), *MODELS], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0 and "ModuleNotFoundError" in done.stderr:
        pytest.skip(f"torch's side cannot run in {ZOO_PYTHON}: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr[-2000:]
    tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert all(len(tokens[name]) == NEW for name in MODELS)
    assert len(set(tokens["llama.dynamo.fp32"])) > NEW // 2  # a discriminating sequence, not one repeated token
    return tokens


@pytest.mark.parametrize("name", MODELS)
def test_cpu_greedy_tokens_equal_torchs(torch_tokens, name):
    from onnx_runtime.generate import Generator

    result = Generator(_model(name), providers=["CPUExecutionProvider"]).generate(PROMPT, NEW)
    assert result.tokens == torch_tokens[name]


@pytest.mark.parametrize("name", MODELS)
def test_replayed_greedy_tokens_on_the_simulator_equal_torchs(torch_tokens, name, cuda_driver_mode):
    import onnx_runtime as ort
    from onnx_runtime.generate import Generator, logits_provider

    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    generator = Generator(_model(name), ["CUDAExecutionProvider", "CPUExecutionProvider"], options)
    result = generator.generate(PROMPT, NEW)
    assert result.tokens == torch_tokens[name]
    assert logits_provider(generator.session) == "CUDAExecutionProvider"
    assert generator.session.device_graph_status() == "replaying"
