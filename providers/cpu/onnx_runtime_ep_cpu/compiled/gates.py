"""The gate nonlinearities of the compiled recurrences (lstm.py, gru.py), in operations LLVM vectorizes.

numba without Intel's SVML calls libm's scalar expf and tanhf per element; a recurrent step applies three or four
of them to every hidden unit, which cost as much as the step's two matrix-vector products. In float32 the loops
call these instead: tanh as a clamped rational function (the odd/even polynomial pair Eigen and TensorFlow use
for float32 tanh; past |x| = 9 float32 tanh is +-1), the sigmoid as exp_float32.sigmoid_float32 (a polynomial exp
of -|x|: no overflow, and the small values of a negative x keep their relative accuracy). Neither needs fastmath:
they are plain multiplies, adds, one division and selects. Their error against a float64 reference is measured by
tests/cpu/test_recurrent_gates.py over the float32 range, saturating and non-finite inputs included. Float64 loops
keep numpy's exact functions (``exact_*``).
"""

from __future__ import annotations

import numpy as np

from . import compiler
from .exp_float32 import sigmoid_float32

_contracting = compiler(fastmath={"contract"})  # a fused multiply-add rounds once: never less accurate

_LIMIT = np.float32(9.0)
_ONE, _MINUS_ONE = np.float32(1.0), np.float32(-1.0)
_A1, _A3, _A5 = np.float32(4.89352455891786e-03), np.float32(6.37261928875436e-04), np.float32(1.48572235717979e-05)
_A7, _A9 = np.float32(5.12229709037114e-08), np.float32(-8.60467152213735e-11)
_A11, _A13 = np.float32(2.00018790482477e-13), np.float32(-2.76076847742355e-16)
_B0, _B2 = np.float32(4.89352518554385e-03), np.float32(2.26843463243900e-03)
_B4, _B6 = np.float32(1.18534705686654e-04), np.float32(1.19825839466702e-06)


@_contracting
def tanh_float32(x):
    """tanh of a float32 x: p(x) / q(x) on x clamped to [-9, 9], the quotient kept within [-1, 1] (it rounds a
    little past 1 near the clamp); a NaN passes both clamps and stays NaN."""
    c = -_LIMIT if x < -_LIMIT else (_LIMIT if x > _LIMIT else x)
    s = c * c
    p = ((((((_A13 * s + _A11) * s + _A9) * s + _A7) * s + _A5) * s + _A3) * s + _A1) * c
    q = ((_B6 * s + _B4) * s + _B2) * s + _B0
    t = p / q
    return _MINUS_ONE if t < _MINUS_ONE else (_ONE if t > _ONE else t)


@_contracting
def sigmoid_of(x, one, approximate):
    """The logistic sigmoid: the vectorizing float32 form where ``approximate``, else numpy's formula (``one`` in
    x's type keeps a float32 loop in float32)."""
    if approximate:
        return sigmoid_float32(x)
    return one / (one + np.exp(-x))


@_contracting
def tanh_of(x, approximate):
    """tanh: the vectorizing float32 form where ``approximate``, else numpy's."""
    if approximate:
        return tanh_float32(x)
    return np.tanh(x)
