"""GRU with the default activations runs as one compiled loop (compiled/gru.py) per direction: a streaming keyword
spotter's one-step call. Outputs against a float64 GRU written from the ONNX definition, in every layout, direction
and reset form, for one step and for sequences long enough that the input projection is one product ahead."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.ops import recurrent

CPU = ["CPUExecutionProvider"]
RNG = np.random.default_rng(5)


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _reference(x, w, r, b, h0, direction: str, linear_before_reset: bool, layout: int):
    """Y, Y_h in float64, as ONNX defines GRU (gate order z, r, h)."""
    x, w, r, b = (a.astype(np.float64) for a in (x, w, r, b))
    if layout:
        x = x.swapaxes(0, 1)
        h0 = None if h0 is None else h0.swapaxes(0, 1)
    seq, batch = x.shape[:2]
    dirs, hidden = w.shape[0], r.shape[-1]
    y = np.zeros((seq, dirs, batch, hidden))
    finals = []
    for d in range(dirs):
        h = np.zeros((batch, hidden)) if h0 is None else h0[d].astype(np.float64)
        wz, wr, wh = np.split(w[d], 3)
        rz, rr, rh = np.split(r[d], 3)
        wbz, wbr, wbh, rbz, rbr, rbh = np.split(b[d], 6)
        backward = direction == "reverse" or d == 1
        for t in range(seq - 1, -1, -1) if backward else range(seq):
            z = _sigmoid(x[t] @ wz.T + h @ rz.T + wbz + rbz)
            reset = _sigmoid(x[t] @ wr.T + h @ rr.T + wbr + rbr)
            recur = reset * (h @ rh.T + rbh) if linear_before_reset else (reset * h) @ rh.T + rbh
            h = (1 - z) * np.tanh(x[t] @ wh.T + wbh + recur) + z * h
            y[t, d] = h
        finals.append(h)
    y_h = np.stack(finals)
    if layout:
        return y.transpose(2, 0, 1, 3), y_h.swapaxes(0, 1)
    return y, y_h


def _model(direction: str, linear_before_reset: int, layout: int, hidden: int, features: int, with_h0: bool):
    dirs = 2 if direction == "bidirectional" else 1
    w = (RNG.standard_normal((dirs, 3 * hidden, features)) * 0.3).astype(np.float32)
    r = (RNG.standard_normal((dirs, 3 * hidden, hidden)) * 0.3).astype(np.float32)
    b = (RNG.standard_normal((dirs, 6 * hidden)) * 0.1).astype(np.float32)
    inputs = ["x", "w", "r", "b", "", "h0" if with_h0 else ""]
    node = helper.make_node("GRU", inputs, ["y", "y_h"], hidden_size=hidden, direction=direction,
                            linear_before_reset=linear_before_reset, layout=layout)
    graph_inputs = [tensor_info("x")] + ([tensor_info("h0")] if with_h0 else [])
    model = make_model([node], graph_inputs, [tensor_info("y"), tensor_info("y_h")],
                       [numpy_helper.from_array(a, n) for a, n in ((w, "w"), (r, "r"), (b, "b"))], opset=14)
    return model, (w, r, b)


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("linear_before_reset", [0, 1])
@pytest.mark.parametrize("layout", [0, 1])
@pytest.mark.parametrize("seq, batch", [(1, 1), (3, 2), (24, 1)])
def test_the_compiled_gru_agrees_with_float64(monkeypatch, direction, linear_before_reset, layout, seq, batch):
    compiled = []
    real = recurrent.stepped

    def stepped(owner, steps, calls):
        ran = real(owner, steps, calls)
        compiled.append(ran)
        return ran

    monkeypatch.setattr(recurrent, "stepped", stepped)
    hidden, features = 16, 12
    dirs = 2 if direction == "bidirectional" else 1
    model, (w, r, b) = _model(direction, linear_before_reset, layout, hidden, features, with_h0=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    for frame in range(4):  # repeated frames: the kept weights and the compiled loop's state handling
        if frame == 1:
            assert deferred.wait_ready(600)  # numba loaded: the compiled loop from here (numpy may serve before)
        x = RNG.standard_normal((batch, seq, features) if layout else (seq, batch, features)).astype(np.float32)
        h0 = RNG.standard_normal((batch, dirs, hidden) if layout else (dirs, batch, hidden)).astype(np.float32)
        h0_copy = h0.copy()
        y, y_h = session.run(None, {"x": x, "h0": h0})
        exact_y, exact_h = _reference(x, w, r, b, h0, direction, bool(linear_before_reset), layout)
        np.testing.assert_allclose(y, exact_y, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(y_h, exact_h, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(h0, h0_copy)  # the state fed in is not updated in place
    assert compiled[-1], compiled  # the last frames ran the compiled loop


def test_an_omitted_initial_state_starts_from_zeros():
    model, (w, r, b) = _model("forward", 1, 0, 8, 5, with_h0=False)
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    x = RNG.standard_normal((2, 1, 5)).astype(np.float32)
    y, y_h = session.run(None, {"x": x})
    exact_y, exact_h = _reference(x, w, r, b, None, "forward", True, 0)
    np.testing.assert_allclose(y, exact_y, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y_h, exact_h, rtol=1e-5, atol=1e-5)


def test_a_wrong_initial_state_is_a_typed_error():
    model, _ = _model("forward", 1, 0, 8, 5, with_h0=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    x = RNG.standard_normal((1, 1, 5)).astype(np.float32)
    with pytest.raises(ort.OnnxRuntimeError) as raised:
        session.run(None, {"x": x, "h0": np.zeros((1, 1, 7), np.float32)})
    assert "initial_h" in str(raised.value) and "(1, 1, 8)" in str(raised.value), str(raised.value)
