"""GRU time steps in one compiled loop, for the default activations (sigmoid, tanh) without clip: a streaming
keyword spotter's one-step call is then one call instead of a dozen numpy operations on (batch, hidden) rows.
Weights come transposed, as lstm.py's do (and for the same reason); the gate nonlinearities are gates.py's.
"""

from __future__ import annotations

import numpy as np

from . import compiler
from .gates import sigmoid_of, tanh_of
from .lstm import add_product

_fast = compiler(fastmath={"reassoc", "contract"})


@_fast
def _gru_step(x, w, r, w_bias, r_bias, state, out, projected, linear_before_reset, inputs, recur, gated, one,
              approximate):
    """One step of one batch entry: ``out`` gets h' from ``state`` (h) and ``x``; ``inputs`` (W x + Wb), ``recur``
    (R h + Rb, the candidate's third only with ``linear_before_reset``) and ``gated`` (r * h) are scratch."""
    hidden = state.shape[0]
    if projected:
        for j in range(3 * hidden):
            inputs[j] = x[j] + w_bias[j]
    else:
        inputs[:] = w_bias
        add_product(inputs, x, w, 0)
    width = 3 * hidden if linear_before_reset else 2 * hidden
    recur[:width] = r_bias[:width]
    add_product(recur[:width], state, r, 0)
    for j in range(hidden):
        gated[j] = sigmoid_of(inputs[hidden + j] + recur[hidden + j], one, approximate)  # the reset gate
    if linear_before_reset:
        for j in range(hidden):
            recur[2 * hidden + j] *= gated[j]
    else:  # the candidate's product reads r * h
        for j in range(hidden):
            gated[j] *= state[j]
        recur[2 * hidden:] = r_bias[2 * hidden:]
        add_product(recur[2 * hidden:], gated, r, 2 * hidden)
    for j in range(hidden):
        update = sigmoid_of(inputs[j] + recur[j], one, approximate)
        candidate = tanh_of(inputs[2 * hidden + j] + recur[2 * hidden + j], approximate)
        out[j] = (one - update) * candidate + update * state[j]


@_fast
def gru_steps(xs, w, r, w_bias, r_bias, h, y, backward, projected, linear_before_reset, approximate):
    """One direction over time. ``xs`` (T, B, I) with ``w`` W^T (I, 3H), or with ``projected`` xs already holds
    x @ W^T (T, B, 3H) and ``w`` is unused; ``r`` R^T (H, 3H); ``w_bias``/``r_bias`` (3H) Wb and Rb; gate order z,
    r, h (ONNX's). ``h`` (B, H) holds the initial state and is updated in place; ``y`` (T, B, H) gets every step's
    h. ``linear_before_reset``: the candidate reads r * (Rh h + Rbh) (torch's GRU), else Rh (r * h) + Rbh.
    ``approximate``: float32 gates by gates.py's vectorizing forms (else numpy's exact functions)."""
    steps, batch = xs.shape[0], xs.shape[1]
    hidden = h.shape[1]
    inputs = np.empty(3 * hidden, dtype=h.dtype)
    recur = np.empty(3 * hidden, dtype=h.dtype)
    gated = np.empty(hidden, dtype=h.dtype)
    one = np.ones(1, dtype=h.dtype)[0]
    for s in range(steps):
        t = steps - 1 - s if backward else s
        for b in range(batch):
            _gru_step(xs[t, b], w, r, w_bias, r_bias, h[b], y[t, b], projected, linear_before_reset, inputs, recur,
                      gated, one, approximate)
            h[b, :] = y[t, b]  # (every product of the step read the old state)
