"""LSTM time steps in one compiled loop, for the default activations (sigmoid, tanh, tanh) without clip or
peepholes: a streaming model's one-step call is then one call instead of a dozen numpy operations on
(batch, hidden) rows, and longer sequences step without Python between steps.
"""

from __future__ import annotations

import numpy as np

from . import compiler

_fast = compiler(fastmath={"reassoc", "contract"})


@_fast
def lstm_steps(xs, w, r, bias, h, c, y, backward, projected):
    """One direction over time. ``xs`` (T, B, I) with ``w`` (4H, I), or with ``projected`` xs already holds
    x @ W^T (T, B, 4H) and ``w`` is unused; ``r`` (4H, H), ``bias`` (4H) = Wb + Rb; gate order i, o, f, c.
    ``h``/``c`` (B, H) hold the initial states and are updated in place; ``y`` (T, B, H) gets every step's h."""
    steps, batch = xs.shape[0], xs.shape[1]
    hidden = h.shape[1]
    gates = 4 * hidden
    pre = np.empty(gates, dtype=h.dtype)
    zero, one = np.zeros(1, dtype=h.dtype)[0], np.ones(1, dtype=h.dtype)[0]
    for s in range(steps):
        t = steps - 1 - s if backward else s
        for b in range(batch):
            x = xs[t, b]
            state = h[b]
            for j in range(gates):
                total = bias[j]
                if projected:
                    total += x[j]
                else:
                    row = w[j]
                    acc = zero
                    for k in range(x.shape[0]):
                        acc += row[k] * x[k]
                    total += acc
                row = r[j]
                acc = zero
                for k in range(hidden):
                    acc += row[k] * state[k]
                pre[j] = total + acc
            for k in range(hidden):
                i = one / (one + np.exp(-pre[k]))
                o = one / (one + np.exp(-pre[hidden + k]))
                f = one / (one + np.exp(-pre[2 * hidden + k]))
                cell = f * c[b, k] + i * np.tanh(pre[3 * hidden + k])
                c[b, k] = cell
                h[b, k] = o * np.tanh(cell)
                y[t, b, k] = h[b, k]
