"""Loops for a segment's bound plan (algorithms/segment_steps.py): HardSigmoid and HardSwish in one compiled
pass each, where numpy takes four and five ufunc calls, each costing more than the arithmetic on a light CNN's
small tensors (a squeeze-excitation gate of a few hundred values).
"""

from __future__ import annotations

import numpy as np

from . import jit


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
