"""The compiled LSTM called frame after frame with the same constant weights (a streaming model's loop): the
calls after the first skip the checks (ops/recurrent.py's recorded signature) and must still give the
operator's values for each call's own input and states, and a call with another signature must leave it."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.ops import recurrent
from onnx_runtime_ep_cpu.registry import lookup
from reference64 import assert_within, gamma
from test_small_paths import _lstm_reference

F32 = np.dtype(np.float32)


@pytest.fixture(autouse=True)
def loops_linked(monkeypatch):
    """As after the background loader's switch: the compiled loop serves (an earlier test's session may have left
    the loader running, when numpy would serve and no call would take the recorded-signature path)."""
    monkeypatch.setattr(deferred, "numpy_first", lambda *kinds: False)
    monkeypatch.setattr(deferred.state, "guarding", False)
    monkeypatch.setattr(deferred.state, "deferring", False)


def _lstm(direction: str, hidden: int):
    node = Node("LSTM", [f"in{i}" for i in range(7)], ["y", "yh", "yc"], name="rnn",
                attrs={"hidden_size": hidden, "direction": direction}, opset=14)
    kernel = lookup("LSTM", "", 14)(node, [None] * 7, 14)
    assert getattr(kernel, "shape_free", False), "the LSTM kernel reads no planned shape"
    return kernel


def _frozen(rng, *shape):
    a = (rng.standard_normal(shape) * 0.5).astype(F32)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("direction", ["forward", "reverse"])
def test_repeated_frames_follow_each_calls_input_and_states(monkeypatch, direction):
    fast_calls = []
    compiled = recurrent._CompiledLSTM  # noqa: SLF001 (a white-box count of the recorded-signature calls)
    original = compiled.one_direction

    def spy(self, *args):
        fast_calls.append(1)
        return original(self, *args)

    monkeypatch.setattr(compiled, "one_direction", spy)
    rng = np.random.default_rng(7)
    inputs, hidden = 24, 16
    w, r, b = _frozen(rng, 1, 4 * hidden, inputs), _frozen(rng, 1, 4 * hidden, hidden), _frozen(rng, 1, 8 * hidden)
    kernel = _lstm(direction, hidden)
    h = c = np.zeros((1, 1, hidden), F32)
    tol = gamma(inputs + hidden + 2, F32) * (inputs + hidden + 2) * 4
    for frame in range(6):
        seq = 2 if frame == 3 else 1  # another signature in between: the checked path, then back
        x = (rng.standard_normal((seq, 1, inputs))).astype(F32)
        previous, h_in, c_in = h, h.copy(), c.copy()
        y, h, c = kernel(x, w, r, b, None, h, c)
        assert np.array_equal(previous, h_in), "the states passed in were changed"
        for got, expected in zip((y, h, c), _lstm_reference(x, w, r, b, h_in, c_in, direction, 0)):
            assert got.dtype == F32 and got.shape == expected.shape
            assert_within(got, expected, np.full(expected.shape, tol * seq))
    assert len(fast_calls) == 3, "frames after the first of a signature skip the checks"


def test_omitted_states_and_a_wrong_state_after_the_fast_calls():
    rng = np.random.default_rng(8)
    inputs, hidden = 8, 4
    w, r, b = _frozen(rng, 1, 4 * hidden, inputs), _frozen(rng, 1, 4 * hidden, hidden), _frozen(rng, 1, 8 * hidden)
    kernel = _lstm("forward", hidden)
    x = rng.standard_normal((1, 1, inputs)).astype(F32)
    h0 = rng.standard_normal((1, 1, hidden)).astype(F32)
    tol = gamma(inputs + hidden + 2, F32) * (inputs + hidden + 2) * 4
    for _ in range(2):
        kernel(x, w, r, b, None, h0, h0)
    for got, expected in zip(kernel(x, w, r, b, None, None, None), _lstm_reference(x, w, r, b, None, None,
                                                                                    "forward", 0)):
        assert_within(got, expected, np.full(expected.shape, tol))
    with pytest.raises(InvalidArgumentError, match="initial state"):
        kernel(x, w, r, b, None, np.zeros((1, 2, hidden), F32), None)
