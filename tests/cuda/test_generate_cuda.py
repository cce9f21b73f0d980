"""Greedy generation on the CUDA provider (the simulator by default): the same DeviceIoBinding loop as on the
CPU, argmax and the token writer on the device, tokens equal to onnxruntime's greedy loop on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from test_generate import PROMPT, _model, onnxruntime_greedy  # noqa: E402

CUDA = "CUDAExecutionProvider"


@pytest.fixture(autouse=True)
def mode(cuda_driver_mode):
    yield


@pytest.mark.parametrize("name", ["llama.torchscript.fp32", "gpt2.dynamo.fp32"])
def test_greedy_tokens_on_the_device_equal_onnxruntimes(name):
    from onnx_runtime.generate import Generator, logits_provider

    path = _model(name)
    generator = Generator(path, providers=[CUDA, "CPUExecutionProvider"])
    streamed = []
    result = generator.generate(PROMPT, 6, on_token=streamed.append)
    assert result.tokens == streamed == onnxruntime_greedy(path, PROMPT, 6)
    assert logits_provider(generator.session) == CUDA  # the bindings, argmax and token writer live on the device
