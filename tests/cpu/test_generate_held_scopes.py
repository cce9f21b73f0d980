"""The host generate loop's per-step glue (issue 21): its steps run inside the session's per-run scopes entered once
per generation (PreparedRun.held), not once per step; a session closed between steps is a typed error at the next
step; the KV windows are named to the Concats by output, keyed once per layout; a logical shape is still checked as
before (ints within the capacity, anything else through the full check and its typed error). Tokens equal
onnxruntime's greedy tokens on both exporters' decoders."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import logical_shape_checks, make_model, tensor_info
from onnx import helper
from onnx_runtime import InferenceSession, generate, kv_append
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.session import device_binding_run
from onnx_runtime.session.device_io_binding import DeviceBindingSpec
from test_generate import PROMPT, _model, onnxruntime_greedy

CPU = "CPUExecutionProvider"


def _count_scopes(monkeypatch) -> list:
    entered: list = []
    enter = device_binding_run.run_scope.enter

    def counting(scopes):
        entered.append(len(scopes))
        return enter(scopes)

    monkeypatch.setattr(device_binding_run.run_scope, "enter", counting)
    return entered


@pytest.mark.parametrize("name", ["gpt2.dynamo.fp32", "llama.torchscript.fp32"])
def test_a_generation_enters_the_run_scopes_once(monkeypatch, name):
    path = _model(name)
    generator = generate.Generator(path, providers=[CPU])
    entered = _count_scopes(monkeypatch)
    windows: list = []
    kv_enter = kv_append.enter

    def watching(named):
        windows.append(named)
        return kv_enter(named)

    monkeypatch.setattr(kv_append, "enter", watching)
    for _ in range(2):
        tokens = generator.generate(PROMPT, 8).tokens
        assert tokens == onnxruntime_greedy(path, PROMPT, 8)
    # One entry per generation (the CPU provider's thread count scope), where each of the 8 steps entered them.
    assert entered == [1, 1]
    # The cache windows come keyed by output, the same mapping at every step of a generation's state.
    assert len(windows) == 16 and len({id(named) for named in windows}) == 1
    assert all(isinstance(named, dict) and all(key == w.output for key, w in named.items()) for named in windows)


def test_a_callback_between_steps_sees_the_scope_and_a_closed_session_stops_the_loop(monkeypatch):
    path = _model("gpt2.torchscript.fp32")
    generator = generate.Generator(path, providers=[CPU])
    threads = pytest.importorskip("onnx_runtime_ep_cpu.threads")
    seen: list[int] = []

    def on_token(token: int) -> None:
        seen.append(threads.kernel_threads())
        if len(seen) == 3:
            generator.session._closed = True  # noqa: SLF001 (what close() sets first; its release follows the loop)

    with pytest.raises(InvalidArgumentError, match="session was closed"):
        generator.generate(PROMPT, 8, on_token)
    assert len(seen) == 3 and all(count == seen[0] for count in seen)


def _window_model() -> bytes:
    nodes = [helper.make_node("Concat", ["past", "new"], ["present"], axis=2),
             helper.make_node("Concat", ["past", "new"], ["other"], axis=2)]
    return make_model(nodes, [tensor_info("past", shape=[1, 2, "n", 4]), tensor_info("new", shape=[1, 2, 1, 4])],
                      [tensor_info("present", shape=[1, 2, "m", 4]), tensor_info("other", shape=[1, 2, "m", 4])]
                      ).SerializeToString()


def _window_run():
    """(session, past's window binding appending present in place, new's binding, the prepared run giving other)."""
    session = InferenceSession(_window_model(), providers=[CPU])
    past = session.device_io_binding(DeviceBindingSpec.input(
        "past", np.float32, (1, 2, 8, 4), (1, 2, 0, 4), output_name="present", expose_logical_input_shape=True,
        fixed_physical_strides=True))
    new = session.device_io_binding(DeviceBindingSpec.input("new", np.float32, (1, 2, 1, 4)))
    run = session.prepare_device_binding_run([past, new], output_names=["other"])
    return session, past, new, run


def test_only_the_concat_giving_the_windows_output_appends_in_place():
    session, past, new, run = _window_run()
    rng = np.random.default_rng(0)
    rows = []
    with run.held() as step:
        for _ in range(5):
            row = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
            new.write_logical(row)
            (other,) = step(False)
            rows.append(row)
            expected = np.concatenate(rows, axis=2)
            np.testing.assert_array_equal(past.read_logical(), expected)  # appended in place, once per step
            np.testing.assert_array_equal(other, expected)  # the other Concat concatenated: a copy, not the window
            assert not np.shares_memory(other, past.host_array())


@pytest.mark.parametrize("shape", [(1, 2, 9, 4), (1, 2, -1, 4), (1, 2, 3), (1, 2, "x", 4), (1, 2, None, 4)])
def test_a_logical_shape_outside_the_capacity_or_not_of_ints_is_refused(shape):
    session = InferenceSession(_window_model(), providers=[CPU])
    past = session.device_io_binding(DeviceBindingSpec.input("past", np.float32, (1, 2, 8, 4), (1, 2, 0, 4)))
    with pytest.raises(InvalidArgumentError):
        past.set_logical_shape(shape)
    assert past.logical_shape == (1, 2, 0, 4)


def test_a_logical_shape_of_ints_within_the_capacity_is_taken_as_a_tuple():
    session = InferenceSession(_window_model(), providers=[CPU])
    past = session.device_io_binding(DeviceBindingSpec.input("past", np.float32, (1, 2, 8, 4), (1, 2, 0, 4)))
    # (what is not a plain int goes through the full check, which takes int(n) as before)
    for shape in ([1, 2, 8, 4], (0, 0, 0, 0), (1, 2, np.int64(3), 4), (1, 2, True, 4), (1, 2, 2.0, 4)):
        past.set_logical_shape(shape)
        assert past.logical_shape == tuple(int(n) for n in shape)
        assert all(type(n) is int for n in past.logical_shape)


def test_appended_windows_adopt_their_shape_without_the_logical_shape_check(monkeypatch):
    """Each step's grown cache windows are taken as they are (within the capacity by construction); only the mask's
    next shape goes through set_logical_shape, and the caches' logical shapes are the valid rows after the loop."""

    path = _model("gpt2.dynamo.fp32")
    generator = generate.Generator(path, providers=[CPU])
    generator.generate(PROMPT, 4)
    checked = logical_shape_checks(monkeypatch)
    assert generator.generate(PROMPT, 6).tokens == onnxruntime_greedy(path, PROMPT, 6)
    assert not [label for label in checked if "past" in label], checked
    state = generator._kept  # noqa: SLF001 (the generation's kept state)
    assert {cache.logical_shape[2] for cache in state.caches} == {len(PROMPT) + 5}


def test_a_prepared_run_refuses_a_released_binding():
    session, past, new, run = _window_run()
    run(False)
    new.close()
    with pytest.raises(InvalidArgumentError, match="released"):
        run(False)
    with pytest.raises(InvalidArgumentError, match="released"), run.held() as step:
        step(False)
