"""GRU time steps in one compiled loop, for the default activations (sigmoid, tanh) without clip: a streaming
keyword spotter's one-step call is then one call instead of a dozen numpy operations on (batch, hidden) rows.
"""

from __future__ import annotations

import numpy as np

from . import compiler

_fast = compiler(fastmath={"reassoc", "contract"})


@_fast
def _row_dot(row, v, zero):
    acc = zero
    for k in range(v.shape[0]):
        acc += row[k] * v[k]
    return acc


@_fast
def _gru_step(x, w, r, w_bias, r_bias, state, out, projected, linear_before_reset, inputs, reset, update, gated,
              zero, one):
    """One step of one batch entry: ``out`` gets h' from ``state`` (h) and ``x``; the scratch rows are the gates'."""
    hidden = state.shape[0]
    for j in range(3 * hidden):
        inputs[j] = (x[j] if projected else _row_dot(w[j], x, zero)) + w_bias[j]
    for j in range(hidden):
        update[j] = one / (one + np.exp(-(inputs[j] + _row_dot(r[j], state, zero) + r_bias[j])))
        k = hidden + j
        reset[j] = one / (one + np.exp(-(inputs[k] + _row_dot(r[k], state, zero) + r_bias[k])))
    for k in range(hidden):
        gated[k] = reset[k] * state[k]  # (read without linear_before_reset)
    for j in range(hidden):
        if linear_before_reset:
            recur = reset[j] * (_row_dot(r[2 * hidden + j], state, zero) + r_bias[2 * hidden + j])
        else:
            recur = _row_dot(r[2 * hidden + j], gated, zero) + r_bias[2 * hidden + j]
        candidate = np.tanh(inputs[2 * hidden + j] + recur)
        out[j] = (one - update[j]) * candidate + update[j] * state[j]


@_fast
def gru_steps(xs, w, r, w_bias, r_bias, h, y, backward, projected, linear_before_reset):
    """One direction over time. ``xs`` (T, B, I) with ``w`` (3H, I), or with ``projected`` xs already holds
    x @ W^T (T, B, 3H) and ``w`` is unused; ``r`` (3H, H); ``w_bias``/``r_bias`` (3H) Wb and Rb; gate order z, r, h
    (ONNX's). ``h`` (B, H) holds the initial state and is updated in place; ``y`` (T, B, H) gets every step's h.
    ``linear_before_reset``: the candidate reads r * (Rh h + Rbh) (torch's GRU), else Rh (r * h) + Rbh."""
    steps, batch = xs.shape[0], xs.shape[1]
    hidden = h.shape[1]
    inputs = np.empty(3 * hidden, dtype=h.dtype)  # W x + Wb
    reset = np.empty(hidden, dtype=h.dtype)
    update = np.empty(hidden, dtype=h.dtype)
    gated = np.empty(hidden, dtype=h.dtype)
    zero, one = np.zeros(1, dtype=h.dtype)[0], np.ones(1, dtype=h.dtype)[0]
    for s in range(steps):
        t = steps - 1 - s if backward else s
        for b in range(batch):
            _gru_step(xs[t, b], w, r, w_bias, r_bias, h[b], y[t, b], projected, linear_before_reset, inputs, reset,
                      update, gated, zero, one)
            h[b, :] = y[t, b]  # (every dot of the step read the old state)
