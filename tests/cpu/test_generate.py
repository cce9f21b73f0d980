"""``onnx-runtime generate`` and onnx_runtime.generate: greedy decoding on DeviceIoBinding buffers, checked
token for token against an onnxruntime greedy loop over the zoo's decoder exports (GPT-2 and LLaMA, both
torch exporters), with text through a ``tokenizers`` tokenizer saved beside the model."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from model_helpers import CopyCounter, make_model, tensor_info
from onnx import helper
from onnx_runtime import cli
from onnx_runtime.contract.markers import hookimpl
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError
from onnx_runtime.generate import Generator, generate_text

ZOO = Path(os.environ.get("ONNX_RUNTIME_ZOO") or Path(__file__).resolve().parents[2] / "benchmarks/.models/zoo")
DECODERS = ["gpt2.torchscript.fp32", "llama.torchscript.fp32", "gpt2.dynamo.fp32", "llama.dynamo.fp32",
            "llama.torchscript.fp16", "llama.torchscript.int4", "llama.dynamo.int8_dynamic",
            "gpt2.torchscript.optimized"]
PROMPT = [5, 17, 300, 42, 7]
CPU = "CPUExecutionProvider"


def _model(name: str) -> str:
    path = ZOO / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"the model zoo is not built ({path} is missing): run scripts/build_zoo.sh")
    return str(path)


def onnxruntime_greedy(path: str, prompt: list[int], new: int) -> list[int]:
    """The oracle: onnxruntime fed the whole cache each step, argmax of the last logits row in numpy (the same
    first-maximum rule as device_argmax)."""
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(path, options, providers=[CPU])
    inputs = [i.name for i in session.get_inputs()]
    outputs = [o.name for o in session.get_outputs()]
    past = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float16 if "float16" in i.type else np.float32)
            for i in session.get_inputs() if "past" in i.name}
    ids, positions, tokens = np.array([prompt], np.int64), np.arange(len(prompt))[None], []
    for _ in range(new):
        total = positions[0, -1] + 1
        feeds = dict(past, input_ids=ids, attention_mask=np.ones((1, total), np.int64))
        if "position_ids" in inputs:
            feeds["position_ids"] = positions
        values = dict(zip(outputs, session.run(None, feeds)))
        tokens.append(int(np.argmax(values["logits"][0, -1].astype(np.float32))))
        past = {name: values[name.replace("past_key_values", "present")] for name in past}
        ids, positions = np.array([[tokens[-1]]], np.int64), np.array([[total]], np.int64)
    return tokens


@pytest.mark.parametrize("name", DECODERS)
def test_greedy_tokens_equal_onnxruntimes(name):
    path = _model(name)
    streamed = []
    result = Generator(path, providers=[CPU]).generate(PROMPT, 10, on_token=streamed.append)
    assert result.tokens == onnxruntime_greedy(path, PROMPT, 10) == streamed
    assert result.prompt_tokens == PROMPT and result.steps == 10
    assert 0 < result.time_to_first_token <= result.seconds and result.tokens_per_second > 0


class RangedUploads:
    def __init__(self, handle):
        self.calls = 0
        handle.pm.register(self, name=f"ranged-uploads-{id(self)}")

    @hookimpl(wrapper=True)
    def copy_from_host_at(self):
        self.calls += 1
        return (yield)


@pytest.mark.parametrize("host", [True, False])
def test_the_loop_reads_only_the_first_token_and_the_final_drain(host, monkeypatch):
    from onnx_runtime.session.device_io_binding import DeviceIoBinding

    path = _model("llama.torchscript.fp32")
    if not host:  # as on a device: no host arrays, argmax and token writes through the provider's hooks
        monkeypatch.setattr(DeviceIoBinding, "host_array", lambda self: None)
    generator = Generator(path, providers=[CPU])
    handle = generator.session.provider_handle(CPU)
    counter, ranged = CopyCounter(handle), RangedUploads(handle)
    for new in (3, 9):
        before = (counter.uploads + ranged.calls, counter.downloads)
        result = generator.generate(PROMPT, new)
        assert result.tokens == onnxruntime_greedy(path, PROMPT, new)
        # On a device: ids, positions, mask and token scratch written once, the first token and the drain read,
        # whatever `new`. A host state writes and reads its arrays in place: no transfer at all.
        expected = (0, 0) if host else (4, 2)
        assert (counter.uploads + ranged.calls - before[0], counter.downloads - before[1]) == expected


def test_a_provider_without_device_argmax_chooses_through_the_host(monkeypatch):
    from onnx_runtime.session.device_io_binding import DeviceIoBinding

    path = _model("gpt2.torchscript.fp32")
    monkeypatch.setattr(DeviceIoBinding, "host_array", lambda self: None)  # as on a device: no host arrays
    monkeypatch.setattr(DeviceIoBinding, "device_argmax_supported", lambda self: False)
    monkeypatch.setattr(DeviceIoBinding, "device_argmax", None)  # must not be reached
    result = Generator(path, providers=[CPU]).generate(PROMPT, 5)
    assert result.tokens == onnxruntime_greedy(path, PROMPT, 5)


@pytest.fixture
def model_with_tokenizer(tmp_path):
    """The LLaMA export beside a word-level tokenizer over its 1000 ids (w0 .. w999), built with tokenizers."""
    tokenizers = pytest.importorskip("tokenizers", reason="text generation needs the tokenizers library")
    path = _model("llama.torchscript.fp32")
    folder = tmp_path / "model"
    folder.mkdir()
    os.symlink(path, folder / "model.onnx")
    vocabulary = {f"w{i}": i for i in range(1000)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="w0"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.decoder = tokenizers.decoders.WordPiece()  # joins words with spaces
    tokenizer.save(str(folder / "tokenizer.json"))
    return str(folder / "model.onnx"), path


def test_text_goes_through_the_tokenizer_beside_the_model(model_with_tokenizer):
    model, original = model_with_tokenizer
    pieces = []
    result = generate_text(model, "w5 w17 w300 w42 w7", max_new_tokens=6, providers=[CPU], on_text=pieces.append)
    expected = onnxruntime_greedy(original, PROMPT, 6)
    assert result.prompt_tokens == PROMPT and result.tokens == expected
    assert result.text == " ".join(f"w{t}" for t in expected) and "".join(pieces).strip() == result.text


def test_the_command_streams_text_and_reports_speed(model_with_tokenizer, capsys):
    model, original = model_with_tokenizer
    assert cli.main(["generate", model, "--prompt", "w5 w17 w300 w42 w7", "--max-new-tokens", "4",
                     "--providers", "cpu"]) == 0
    out = capsys.readouterr().out
    words = " ".join(f"w{t}" for t in onnxruntime_greedy(original, PROMPT, 4))
    assert out.startswith("w5 w17 w300 w42 w7") and words in out
    assert "4 tokens; time to first token" in out and "tokens/s after it" in out
    assert cli.main(["generate", original, "--prompt-ids", "5,17,300,42,7", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.split("\n")[0].split() == [str(t) for t in onnxruntime_greedy(original, PROMPT, 2)]


def test_bad_requests_get_typed_errors(tmp_path, capsys):
    path = _model("gpt2.torchscript.fp32")
    generator = Generator(path, providers=[CPU])
    with pytest.raises(InvalidArgumentError, match=r"prompt token ids must lie in \[0, 1000\)"):
        generator.generate([5, 1000], 2)
    with pytest.raises(InvalidArgumentError, match="has no tokens"):
        generator.generate([], 2)
    with pytest.raises(InvalidArgumentError, match="max_new_tokens must be at least 1"):
        generator.generate([5], 0)
    plain = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", shape=[2])],
                       [tensor_info("y", shape=[2])])
    with pytest.raises(InvalidGraphError, match="an int64 input 'input_ids'"):
        Generator(plain.SerializeToString(), providers=[CPU])
    folder = tmp_path / "bare"
    folder.mkdir()
    os.symlink(path, folder / "model.onnx")
    assert cli.main(["generate", str(folder / "model.onnx"), "--prompt", "hello"]) == 2
    assert "no tokenizer.json beside" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["gpt2.torchscript.fp32", "llama.dynamo.fp32"])
def test_a_cache_shown_at_capacity_gives_the_same_tokens(name):
    """With device-graph capture asked for, generate shows the KV cache at its capacity (one feed signature per
    decode step), appends the new rows after it and moves them into place; the masked rows add exact zeros, so
    the tokens are onnxruntime's."""
    import onnx_runtime as ort

    path = _model(name)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    generator = Generator(path, providers=[CPU], sess_options=options)
    assert generator.at_capacity
    assert generator.generate(PROMPT, 8).tokens == onnxruntime_greedy(path, PROMPT, 8)
