"""A streaming GRU/LSTM frame whose signature has run whole calls the compiled loop's overload directly
(ops/recurrent.py direct_entry), without numba's dispatcher: the same states as a float64 reference frame after
frame, and a malformed frame still refused at the feeds with the input named."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime_ep_cpu.compiled import deferred

CPU = ["CPUExecutionProvider"]
RNG = np.random.default_rng(23)


def _sigmoid(v):
    return 1.0 / (1.0 + np.exp(-v))


def _model(op: str, hidden: int, features: int):
    gates = 3 if op == "GRU" else 4
    w = (RNG.standard_normal((1, gates * hidden, features)) * 0.3).astype(np.float32)
    r = (RNG.standard_normal((1, gates * hidden, hidden)) * 0.3).astype(np.float32)
    b = (RNG.standard_normal((1, 2 * gates * hidden)) * 0.1).astype(np.float32)
    states = ["h0"] if op == "GRU" else ["h0", "c0"]
    outs = ["y", "h_out"] if op == "GRU" else ["y", "h_out", "c_out"]
    node = helper.make_node(op, ["x", "w", "r", "b", "", *states], outs, hidden_size=hidden)
    model = make_model([node], [tensor_info("x", shape=[1, 1, features])]
                       + [tensor_info(s, shape=[1, 1, hidden]) for s in states],
                       [tensor_info(o) for o in outs],
                       [numpy_helper.from_array(a, n) for a, n in ((w, "w"), (r, "r"), (b, "b"))], opset=14)
    return model, [a[0].astype(np.float64) for a in (w, r, b)]


def _step(op, x, h, c, w, r, b):
    """One float64 frame as ONNX defines it (GRU gates z, r, h; LSTM gates i, o, f, c)."""
    x, h = x.astype(np.float64)[0], h.astype(np.float64)[0]
    gates = 3 if op == "GRU" else 4
    wb, rb = b[: gates * len(r[0])], b[gates * len(r[0]):]
    if op == "GRU":
        (wz, wr, wh), (rz, rr, rh) = np.split(w, 3), np.split(r, 3)
        (bz, br, bh), (cz, cr, ch) = np.split(wb, 3), np.split(rb, 3)
        z = _sigmoid(x @ wz.T + h @ rz.T + bz + cz)
        reset = _sigmoid(x @ wr.T + h @ rr.T + br + cr)
        h = (1 - z) * np.tanh(x @ wh.T + bh + (reset * h) @ rh.T + ch) + z * h
        return h[None], None
    pre = x @ w.T + h @ r.T + wb + rb
    i, o, f, g = np.split(pre, 4, axis=-1)
    c = _sigmoid(f) * c.astype(np.float64)[0] + _sigmoid(i) * np.tanh(g)
    return (_sigmoid(o) * np.tanh(c))[None], c[None]


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_frames_through_the_direct_overload_match_float64(op):
    hidden, features = 32, 10
    model, (w, r, b) = _model(op, hidden, features)
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    h = np.zeros((1, 1, hidden), np.float32)
    c = np.zeros((1, 1, hidden), np.float32)
    h_ref, c_ref = h.astype(np.float64), c.astype(np.float64)
    for frame in range(12):
        if frame == 1:
            assert deferred.wait_ready(600)  # numba loaded: the compiled loop from here (numpy may serve before)
        x = RNG.standard_normal((1, 1, features)).astype(np.float32)
        feeds = {"x": x, "h0": h} if op == "GRU" else {"x": x, "h0": h, "c0": c}
        outs = session.run(None, feeds)
        h_ref, c_next = _step(op, x[0], h_ref, c_ref, w, r, b)
        np.testing.assert_allclose(outs[1], h_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(outs[0][0], h_ref, rtol=1e-5, atol=1e-5)
        h = outs[1]
        if op == "LSTM":
            np.testing.assert_allclose(outs[2], c_next, rtol=1e-5, atol=1e-5)
            c, c_ref = outs[2], c_next
    executor = session._executor_for(feeds)  # noqa: SLF001 (the plan these frames ran)
    kernel = next(step.run for step in executor.plan(tuple(o.name for o in session.get_outputs())).steps
                  if step.node is not None and step.node.op_type == op)
    compiled = next(cell.cell_contents for cell in kernel.__closure__
                    if type(cell.cell_contents).__name__.startswith("_Compiled"))
    entry = compiled.fast[-1] if compiled.fast is not None else None
    assert callable(entry) and entry is not compiled.steps and not isinstance(entry, deferred.Loop)  # the overload
    with pytest.raises(InvalidArgumentError, match=r"input 'h0' expects tensor\(float\)"):
        session.run(None, {**feeds, "h0": h.astype(np.float64)})
    with pytest.raises(InvalidArgumentError, match=r"input 'x'.*dimension 2 must be 10"):
        session.run(None, {**feeds, "x": np.zeros((1, 1, 11), np.float32)})
