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


@pytest.mark.parametrize("name", ["llama.torchscript.fp32", "gpt2.torchscript.fp32", "llama.dynamo.fp32",
                                  "gpt2.dynamo.fp32"])
def test_a_growing_kv_cache_is_captured_once_and_replayed(name, monkeypatch):
    """The exports append to their KV cache by Concat, so a cache shown at its logical length is a new feed
    signature every step (the issue measured 0 captures and 0 replays over 16 tokens). With capture on, generate
    shows the cache at its capacity: one capture, then every decode step replays, tokens unchanged. The
    replayed steps of all four exports make no host synchronization and no host transfer at all (the dynamo exports'
    last-token GatherND runs on the device: before its CUDA kernel it was a CPU seam that read back), and each is one
    graph launch: the nodes whose reshape targets, ranges and slices the feed shapes fix are captured (they were
    eager seams splitting the step into 17-51 graphs)."""
    import onnx_runtime as ort
    from onnx_runtime.generate import Generator, _Bindings
    from test_device_graphs import CountingDriver

    path = _model(name)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    session = ort.InferenceSession(path, options, providers=[CUDA, "CPUExecutionProvider"])
    device = session.provider_handle(CUDA).provider.cuda_device()
    counting = CountingDriver(device.driver)
    monkeypatch.setattr(device, "driver", counting)
    per_step = []
    choose = _Bindings._choose  # noqa: SLF001  (wrapped to count each step's driver calls)

    def counted(self, *args):
        choose(self, *args)
        per_step.append((counting.syncs(), counting.host_transfers(), counting.calls.get("cuGraphLaunch", 0)))
        counting.calls.clear()

    monkeypatch.setattr(_Bindings, "_choose", counted)
    new = 16
    result = Generator(session).generate(PROMPT, new)
    assert result.tokens == onnxruntime_greedy(path, PROMPT, new)
    runner = session._executor.graphs  # noqa: SLF001  (the runner's counts: white box)
    assert (runner.captures, runner.replays) == (1, new - 2)  # prefill, warm-up step, capture, then replays
    assert all(step == (0, 0, 1) for step in per_step[3:]), per_step


def test_shape_values_computed_on_the_device_fall_back_to_seams(monkeypatch):
    """A provider that computes the shape values on the device (here: CUDA with its host shape nodes turned off)
    would synchronize inside the capture when a node reads one: the capture fails once, then every node reading
    one runs as a seam around captured segments, and the tokens stay onnxruntime's."""
    import onnx_runtime as ort
    import onnx_runtime_ep_cuda.provider as provider
    from onnx_runtime.generate import Generator

    monkeypatch.setattr(provider, "host_nodes", lambda graph, cache: {})
    path = _model("gpt2.torchscript.fp32")
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    session = ort.InferenceSession(path, options, providers=[CUDA, "CPUExecutionProvider"])
    assert Generator(session).generate(PROMPT, 8).tokens == onnxruntime_greedy(path, PROMPT, 8)
    runner = session._executor.graphs  # noqa: SLF001
    assert runner.captures == 1 and runner.replays >= 4 and "graph segments with eager seams" in runner.status


def test_the_command_replays_its_decode_step_on_a_device(monkeypatch, capsys):
    """``onnx-runtime generate --providers cuda,cpu`` turns capture on (the CPU alone does not: a cache shown at
    capacity only costs it work), and its tokens are onnxruntime's."""
    from onnx_runtime import cli, generate

    assert generate.device_capture_options(["cpu"]) is None and generate.device_capture_options(None) is None
    mine = generate.SessionOptions()
    mine.add_session_config_entry("session.memory_limit", "0.5")
    capturing = generate.device_capture_options(["cuda"], mine)
    assert capturing.config() == {"session.memory_limit": "0.5", generate.GRAPH_CAPTURE_KEY: "1"}
    assert mine.config() == {"session.memory_limit": "0.5"}  # the caller's options are not changed
    made = []
    original = generate.Generator.__init__

    def recording(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(generate.Generator, "__init__", recording)
    path = _model("llama.torchscript.fp32")
    assert cli.main(["generate", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "5",
                     "--providers", f"{CUDA},CPUExecutionProvider"]) == 0
    assert capsys.readouterr().out.split("\n")[0].split() == [str(t) for t in onnxruntime_greedy(path, PROMPT, 5)]
    assert made[0].at_capacity and made[0].session._executor.graphs.replays == 3  # noqa: SLF001


def test_generate_commits_its_kv_cache_as_it_grows(monkeypatch):
    """Eager generate asks for each KV cache at its capacity with only the prompt's rows committed, and commits a
    logarithmic number of times as the rows arrive; the tokens are onnxruntime's. (These caches fit in one granule,
    so the provider serves them from its pool: the reservation itself is tested in test_device_io_binding_cuda.)"""
    import onnx_runtime as ort
    from onnx_runtime.generate import Generator
    from onnx_runtime.session.device_io_binding import DeviceIoBinding

    commits = []
    original = DeviceIoBinding.commit_range

    def commit(self, offset, nbytes):
        commits.append((self.input_name, offset, nbytes))
        original(self, offset, nbytes)

    monkeypatch.setattr(DeviceIoBinding, "commit_range", commit)
    path = _model("llama.torchscript.fp32")
    tokens = Generator(ort.InferenceSession(path, providers=[CUDA, "CPUExecutionProvider"])).generate(PROMPT, 12).tokens
    assert tokens == onnxruntime_greedy(path, PROMPT, 12)
    caches = {name for name, _offset, _nbytes in commits}
    assert caches and all(name.startswith("past_key_values") for name in caches)
    assert len(commits) == 2 * len(caches)  # 5 prompt rows, doubled to 10, then capped at the capacity of 17
