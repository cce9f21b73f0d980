"""Loops for a segment's bound plan (algorithms/segment_steps.py): HardSigmoid and HardSwish in one compiled
pass each, where numpy takes four and five ufunc calls, each costing more than the arithmetic on a light CNN's
small tensors; float32 SiLU (Swish) and Sigmoid in one vectorized pass (transformer.sigmoid_float32's
polynomial exp, where numba would call libm's scalar expf and numpy takes four passes); and a whole
squeeze-excitation block (algorithms/segment_blocks.py) in one call.
"""

from __future__ import annotations

import numpy as np

from . import compiler, jit
from .epilogue import activate
from .transformer import sigmoid_float32

_contracting = compiler(fastmath={"contract"})  # (sigmoid_float32's own flags, so LLVM inlines and vectorizes it)


@jit
def hard_sigmoid_into(x, y, alpha, beta, swish):
    """y = max(0, min(1, alpha * x + beta)), times x where ``swish`` (HardSwish with alpha 1/6, beta 1/2),
    elementwise over flat arrays of one dtype, ``alpha`` and ``beta`` in that dtype: numpy's operations in
    their order (the product rounded before the sum; NaN passes through)."""
    zero = np.zeros(1, dtype=x.dtype)[0]
    one = np.ones(1, dtype=x.dtype)[0]
    for i in range(x.size):
        gate = alpha * x[i]
        gate = gate + beta
        if gate < zero:
            gate = zero
        if gate > one:
            gate = one
        y[i] = x[i] * gate if swish else gate


HARD_SIGMOID_GATE, SIGMOID_GATE = 1, 2  # squeeze_excite's gates


@jit
def squeeze_gate(v, gate, alpha, beta, zero, one):
    """The squeeze-excitation gate of v (here and in blocked_ops.squeeze_excite_blocked): HARD_SIGMOID_GATE's
    max(0, min(1, alpha * v + beta)) (NaN passes), or the logistic sigmoid; ``zero`` and ``one`` in v's dtype."""
    if gate != HARD_SIGMOID_GATE:
        return one / (one + np.exp(-v))
    v = alpha * v
    v = v + beta
    if v < zero:
        v = zero
    return one if v > one else v


@jit
def squeeze_excite(x, w1, b1, bounds1, swish, w2, b2, bounds2, gate, alpha, beta, y, pooled, hidden, scale):
    """A squeeze-excitation block in one pass per image: y (N, C, P) = x * gate(act2(w2 @ act1(w1 @ mean(x) +
    b1) + b2)), the means over each plane's P pixels, ``w1`` (R, C) and ``w2`` (C, R) the two 1x1
    convolutions' weights, ``b1``/``b2`` their biases, ``bounds1``/``bounds2`` their activations
    (epilogue.activation_bounds; where ``swish``, SiLU v / (1 + exp(-v)) follows act1), ``gate``
    HARD_SIGMOID_GATE (max(0, min(1, alpha * v + beta))) or SIGMOID_GATE; ``pooled`` (C), ``hidden`` (R) and
    ``scale`` (C) scratch."""
    channels, reduced, pixels = w1.shape[1], w1.shape[0], x.shape[2]
    zero = np.zeros(1, dtype=x.dtype)[0]
    one = np.ones(1, dtype=x.dtype)[0]
    divisor = x.dtype.type(pixels)
    for n in range(x.shape[0]):
        for c in range(channels):
            total = zero
            for p in range(pixels):
                total += x[n, c, p]
            pooled[c] = total / divisor
        for r in range(reduced):
            total = zero
            for c in range(channels):
                total += w1[r, c] * pooled[c]
            v = activate(total + b1[r], bounds1[0], bounds1[1], bounds1[2])
            hidden[r] = v / (one + np.exp(-v)) if swish else v
        for c in range(channels):
            total = zero
            for r in range(reduced):
                total += w2[c, r] * hidden[r]
            scale[c] = squeeze_gate(activate(total + b2[c], bounds2[0], bounds2[1], bounds2[2]), gate, alpha, beta,
                                    zero, one)
        for c in range(channels):
            for p in range(pixels):
                y[n, c, p] = x[n, c, p] * scale[c]


@_contracting
def swish_float32_into(x, y, alpha):
    """y = x * sigmoid(alpha * x) over flat float32 arrays (Swish; SiLU where ``alpha`` is 1), ``alpha`` float32:
    within a few ulp of the Swish kernel's x / (1 + exp(-alpha * x)), without its overflow to inf."""
    for i in range(x.size):
        v = x[i]
        y[i] = v * sigmoid_float32(alpha * v)


@_contracting
def sigmoid_float32_into(x, y):
    """y = 1 / (1 + exp(-x)) over flat float32 arrays, by transformer.sigmoid_float32."""
    for i in range(x.size):
        y[i] = sigmoid_float32(x[i])
