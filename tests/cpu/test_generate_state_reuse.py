"""A Generator keeps its last generation's host state (the DeviceIoBindings of the KV cache, ids, positions, mask and
tokens) and runs the next generation that fits on it: no binding is made again, the cache starts empty, and the
tokens are onnxruntime's whatever ran before (a longer generation's rows left past the window included)."""

from __future__ import annotations

import threading

import pytest
from onnx_runtime import generate
from onnx_runtime.generate import Generator
from test_generate import PROMPT, _model, onnxruntime_greedy

CPU = "CPUExecutionProvider"
LONG = [9, 400, 3, 77, 250, 61, 812, 5, 17, 300]


def _counting_bindings(generator: Generator) -> list:
    """The bindings the generator's session makes from now on."""
    made: list = []
    session = generator.session
    bind = session.device_io_binding

    def counted(spec, provider=None):
        binding = bind(spec, provider)
        made.append(binding)
        return binding

    session.device_io_binding = counted  # (the instance's attribute: this generator's session only)
    return made


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("name", ["gpt2.dynamo.fp32", "llama.torchscript.fp32"])
def test_generations_that_fit_run_on_the_kept_state(name, in_place, monkeypatch):
    path = _model(name)
    # In place: the cache at fixed strides, appended in place (kv_append.py); else copied at every step.
    monkeypatch.setattr(generate, "IN_PLACE_BYTES", 0 if in_place else 1 << 62)
    generator = Generator(path, providers=[CPU])
    made = _counting_bindings(generator)
    expected = {(tuple(prompt), new): onnxruntime_greedy(path, prompt, new)
                for prompt, new in ((LONG, 14), (PROMPT, 9), (PROMPT[:2], 3), (LONG + PROMPT, 14))}
    assert generator.generate(LONG, 14).tokens == expected[(tuple(LONG), 14)]
    first = len(made)
    assert first > 0
    # Shorter prompts and fewer tokens on the same buffers, after a longer generation left its rows there.
    assert generator.generate(PROMPT, 9).tokens == expected[(tuple(PROMPT), 9)]
    assert generator.generate(PROMPT[:2], 3).tokens == expected[(tuple(PROMPT[:2]), 3)]
    assert generator.generate(LONG, 14).tokens == expected[(tuple(LONG), 14)]
    assert len(made) == first
    # A longer prompt does not fit: one new state, at least as large, and the old one released.
    kept = list(made)
    assert generator.generate(LONG + PROMPT, 14).tokens == expected[(tuple(LONG + PROMPT), 14)]
    assert len(made) == 2 * first and all(binding.closed for binding in kept)
    assert generator.generate(PROMPT, 9).tokens == expected[(tuple(PROMPT), 9)]
    assert len(made) == 2 * first
    generator.close()
    assert all(binding.closed for binding in made)
    assert generator.generate(PROMPT, 9).tokens == expected[(tuple(PROMPT), 9)]  # (a new state after close)


def test_a_failed_generation_releases_its_state():
    path = _model("gpt2.torchscript.fp32")
    generator = Generator(path, providers=[CPU])
    made = _counting_bindings(generator)

    def stop(token: int) -> None:
        raise RuntimeError("the caller's stream broke")

    with pytest.raises(RuntimeError, match="stream broke"):
        generator.generate(PROMPT, 6, on_token=stop)
    assert made and all(binding.closed for binding in made)
    count = len(made)
    assert generator.generate(PROMPT, 6).tokens == onnxruntime_greedy(path, PROMPT, 6)
    assert len(made) == 2 * count


def test_generations_on_several_threads_each_get_their_own_state():
    path = _model("llama.dynamo.fp32")
    generator = Generator(path, providers=[CPU])
    expected = {new: onnxruntime_greedy(path, PROMPT, new) for new in (4, 7)}
    got: dict[int, list] = {4: [], 7: []}

    def work(new: int) -> None:
        for _ in range(6):
            got[new].append(generator.generate(PROMPT, new).tokens)

    threads = [threading.Thread(target=work, args=(new,)) for new in (4, 7)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(tokens == expected[new] for new, runs in got.items() for tokens in runs)
    assert all(len(runs) == 6 for runs in got.values())


def test_the_host_loop_lays_its_bindings_out_once_and_refuses_a_released_one(monkeypatch):
    from onnx_runtime.errors import InvalidArgumentError
    from onnx_runtime.session import device_binding_run

    path = _model("gpt2.dynamo.fp32")
    generator = Generator(path, providers=[CPU])
    laid: list = []
    layout = device_binding_run._layout  # noqa: SLF001  (wrapped to count the layouts made or looked up)

    def counted(*args):
        laid.append(args[1])
        return layout(*args)

    monkeypatch.setattr(device_binding_run, "_layout", counted)
    expected = onnxruntime_greedy(path, PROMPT, 20)
    assert generator.generate(PROMPT, 20).tokens == expected
    assert generator.generate(PROMPT, 20).tokens == expected
    assert len(laid) == 1  # one state, prepared once: no per-step lookup
    state = generator._kept  # noqa: SLF001
    assert state is not None and state.prepared is not None
    state.caches[0].close()
    with pytest.raises(InvalidArgumentError, match="was released; prepare the run again"):
        state.prepared(True)
    generator.close()
