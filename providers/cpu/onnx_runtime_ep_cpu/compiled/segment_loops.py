"""Loops for a segment's bound plan (algorithms/segment_steps.py): HardSigmoid and HardSwish in one compiled
pass each, where numpy takes four and five ufunc calls, each costing more than the arithmetic on a light CNN's
small tensors; float32 SiLU (Swish) and Sigmoid in one pass of 16-lane vectors (vector_math.py: transformer.py's
polynomial exp, where numba would call libm's scalar expf and numpy takes four passes); and a whole
squeeze-excitation block (algorithms/segment_blocks.py) in one call.
"""

from __future__ import annotations

import numpy as np

from . import compiler, jit
from .epilogue import activate
from .exp_float32 import sigmoid_float32
from .pooling import plane_means
from .vector_math import sigmoid_lanes

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
def _column_sums(weights, column, values, total):
    """total[n] = the sum over k, in order from 0, of weights[k, column] * values[k, n], for every column n of
    ``values`` at once, four terms of k a pass over ``total`` (each product and sum rounded as a one-column running
    sum's), where a running sum per column is one dependent chain of scalar adds."""
    depth, columns = values.shape[0], values.shape[1]
    for n in range(columns):
        total[n] = 0
    k = 0
    while k + 4 <= depth:
        a, b, c, d = weights[k, column], weights[k + 1, column], weights[k + 2, column], weights[k + 3, column]
        va, vb, vc, vd = values[k], values[k + 1], values[k + 2], values[k + 3]
        for n in range(columns):
            total[n] = (((total[n] + a * va[n]) + b * vb[n]) + c * vc[n]) + d * vd[n]
        k += 4
    while k < depth:
        weight, v = weights[k, column], values[k]
        for n in range(columns):
            total[n] += weight * v[n]
        k += 1


@jit
def _sums_across(weights, values, sums):
    """sums[j] = the sum over i, in order from 0, of weights[i, j] * values[i], every j at once: one weights' row a
    pass, vectorized across j, where a running sum per j is one dependent chain of scalar adds (the same bits)."""
    for j in range(weights.shape[1]):
        sums[j] = 0
    for i in range(weights.shape[0]):
        value = values[i]
        for j in range(weights.shape[1]):
            sums[j] += weights[i, j] * value


@jit
def squeeze_scale(pooled, w1, b1, bounds1, swish, w2, b2, bounds2, gate, alpha, beta, hidden, scale):
    """One image's gates: ``scale`` (C) of its planes' means ``pooled`` (C) through the transposed weights ``w1``
    (C, R) and ``w2`` (R, C) (_sums_across), ``hidden`` (R) scratch."""
    channels, reduced = w1.shape[0], w1.shape[1]
    zero = np.zeros(1, dtype=pooled.dtype)[0]
    one = np.ones(1, dtype=pooled.dtype)[0]
    _sums_across(w1, pooled, hidden)
    for r in range(reduced):
        v = activate(hidden[r] + b1[r], bounds1[0], bounds1[1], bounds1[2])
        hidden[r] = v / (one + np.exp(-v)) if swish else v
    _sums_across(w2, hidden, scale)
    for c in range(channels):
        scale[c] = squeeze_gate(activate(scale[c] + b2[c], bounds2[0], bounds2[1], bounds2[2]), gate, alpha, beta,
                                zero, one)


@jit
def squeeze_products(means, w1, b1, bounds1, swish, w2, b2, bounds2, gate, alpha, beta, gates):
    """The squeeze-excitation middle for every image at once: ``gates`` (C, N) = gate(act2(w2^T @ act1(w1^T @ means
    + b1) + b2)) of ``means`` (C, N), the planes' means of N images, channel-major, ``w1`` (C, R) and ``w2`` (R, C)
    the transposed weights (see squeeze_excite). Each sum
    runs over its channels (then its reduced values) in order, as a product per image would, but with the N images
    as the innermost loop: N independent sums a vector wide, where one image's product is one dependent chain of
    scalar adds (a (32, 1152) -> 48 -> 1152 block took 2.9 ms that way, most of an EfficientNet's batch-32 run)."""
    channels, reduced, images = w1.shape[0], w1.shape[1], means.shape[1]
    zero = np.zeros(1, dtype=means.dtype)[0]
    one = np.ones(1, dtype=means.dtype)[0]
    hidden = np.empty((reduced, images), dtype=means.dtype)
    total = np.empty(images, dtype=means.dtype)
    for r in range(reduced):
        _column_sums(w1, r, means, total)
        for n in range(images):
            v = activate(total[n] + b1[r], bounds1[0], bounds1[1], bounds1[2])
            hidden[r, n] = v / (one + np.exp(-v)) if swish else v
    logistic = gate != HARD_SIGMOID_GATE and means.itemsize == 4
    excited = np.empty((channels, images), dtype=means.dtype) if logistic else gates
    for c in range(channels):
        _column_sums(w2, c, hidden, total)
        for n in range(images):
            v = activate(total[n] + b2[c], bounds2[0], bounds2[1], bounds2[2])
            excited[c, n] = v if logistic else squeeze_gate(v, gate, alpha, beta, zero, one)
    if logistic:  # float32's sigmoid vectorized (the Sigmoid kernel's), where libm's exp per value cost most of it
        _sigmoid_float32_gates(excited.reshape(excited.size), gates.reshape(gates.size))


@_contracting
def _sigmoid_float32_gates(x, y):
    """y = sigmoid_float32(x) over flat arrays (float32 in use; the cast types the loop for float64 too)."""
    for i in range(x.size):
        y[i] = sigmoid_float32(np.float32(x[i]))


@jit
def _plane_means(x, n, means):
    """means[c] = the mean of image ``n``'s plane c of x (N, C, P), as the GlobalAveragePool kernel sums it
    (pooling.plane_means: eight running sums, where one chain of dependent adds took a 56x56 block's mean pass at
    twice its scaling pass)."""
    plane_means(x[n], means, x.dtype.type(x.shape[2]))


@jit
def squeeze_excite(x, w1, b1, bounds1, swish, w2, b2, bounds2, gate, alpha, beta, y, pooled, hidden, scale):
    """A squeeze-excitation block in one call: y (N, C, P) = x * gate(act2(w2^T @ act1(w1^T @ mean(x) + b1) + b2)),
    the means over each plane's P pixels, ``w1`` (C, R) and ``w2`` (R, C) the two 1x1 convolutions' weights
    transposed (segment_blocks._binder: the sums of one image run across the outputs, see squeeze_scale),
    ``b1``/``b2`` their biases, ``bounds1``/``bounds2`` their activations (epilogue.activation_bounds; where
    ``swish``, SiLU v / (1 + exp(-v)) follows act1), ``gate`` HARD_SIGMOID_GATE (max(0, min(1, alpha * v + beta)))
    or SIGMOID_GATE; ``pooled`` (C), ``hidden`` (R) and ``scale`` (C) scratch. One image by squeeze_scale, more
    by squeeze_products over all of them at once."""
    images, channels, pixels = x.shape[0], w1.shape[0], x.shape[2]
    if images == 1:
        _plane_means(x, 0, pooled)
        squeeze_scale(pooled, w1, b1, bounds1, swish, w2, b2, bounds2, gate, alpha, beta, hidden, scale)
        for c in range(channels):
            for p in range(pixels):
                y[0, c, p] = x[0, c, p] * scale[c]
        return
    means = np.empty((channels, images), dtype=x.dtype)
    for n in range(images):
        _plane_means(x, n, pooled)
        for c in range(channels):
            means[c, n] = pooled[c]
    gates = np.empty((channels, images), dtype=x.dtype)
    squeeze_products(means, w1, b1, bounds1, swish, w2, b2, bounds2, gate, alpha, beta, gates)
    for n in range(images):
        for c in range(channels):
            factor = gates[c, n]
            for p in range(pixels):
                y[n, c, p] = x[n, c, p] * factor


@jit
def swish_float32_into(x, y, alpha):
    """y = x * sigmoid(alpha * x) over flat float32 arrays (Swish; SiLU where ``alpha`` is 1), ``alpha`` float32:
    within a few ulp of the Swish kernel's x / (1 + exp(-alpha * x)), without its overflow to inf; 16 lanes at a
    time (vector_math.sigmoid_lanes)."""
    sigmoid_lanes(x, y, alpha, True)


@jit
def sigmoid_float32_into(x, y):
    """y = 1 / (1 + exp(-x)) over flat float32 arrays, exp_float32.sigmoid_float32 16 lanes at a time."""
    sigmoid_lanes(x, y, np.float32(1), False)


@jit
def add_float32_into(a, b, y):
    """y = a + b over flat float32 arrays of one size (a residual sum of two blocked values: their padded lanes
    too, which nothing reads)."""
    for i in range(y.size):
        y[i] = a[i] + b[i]
