"""LSTM time steps in one compiled loop, for the default activations (sigmoid, tanh, tanh) without clip or
peepholes: a streaming model's one-step call is then one call instead of a dozen numpy operations on
(batch, hidden) rows, and longer sequences step without Python between steps.

The weights come transposed, W^T (I, 4H) and R^T (H, 4H): each input or state element then adds its row times
itself into all the gates' pre-activations at once, a contiguous multiply-add LLVM vectorizes with no horizontal
sums (a dot product per gate row needs one per row). The gate nonlinearities are gates.py's.
"""

from __future__ import annotations

import numpy as np

from . import compiler
from .gates import sigmoid_of, tanh_of

_fast = compiler(fastmath={"reassoc", "contract"})


@_fast
def add_product(pre, v, weights, first):
    """pre += v @ weights[:, first:first + len(pre)], for a vector v (K) and C-contiguous weights (K, N)."""
    for k in range(v.shape[0]):
        vk = v[k]
        row = weights[k]
        for j in range(pre.shape[0]):
            pre[j] += row[first + j] * vk


@_fast
def lstm_steps(xs, w, r, bias, h, c, y, backward, projected, approximate):
    """One direction over time. ``xs`` (T, B, I) with ``w`` W^T (I, 4H), or with ``projected`` xs already holds
    x @ W^T (T, B, 4H) and ``w`` is unused; ``r`` R^T (H, 4H), ``bias`` (4H) = Wb + Rb; gate order i, o, f, c.
    ``h``/``c`` (B, H) hold the initial states and are updated in place; ``y`` (T, B, H) gets every step's h.
    ``approximate``: float32 gates by gates.py's vectorizing forms (else numpy's exact functions)."""
    steps, batch = xs.shape[0], xs.shape[1]
    hidden = h.shape[1]
    pre = np.empty(4 * hidden, dtype=h.dtype)
    one = np.ones(1, dtype=h.dtype)[0]
    for s in range(steps):
        t = steps - 1 - s if backward else s
        for b in range(batch):
            x = xs[t, b]
            if projected:
                for j in range(pre.shape[0]):
                    pre[j] = bias[j] + x[j]
            else:
                pre[:] = bias
                add_product(pre, x, w, 0)
            add_product(pre, h[b], r, 0)  # (reads every element of the old state before the loop below writes it)
            for k in range(hidden):
                i = sigmoid_of(pre[k], one, approximate)
                o = sigmoid_of(pre[hidden + k], one, approximate)
                f = sigmoid_of(pre[2 * hidden + k], one, approximate)
                cell = f * c[b, k] + i * tanh_of(pre[3 * hidden + k], approximate)
                c[b, k] = cell
                out = o * tanh_of(cell, approximate)
                h[b, k] = out
                y[t, b, k] = out
