"""RoundedGelu (qdq_fusions.fuse_rounded_gelu): the erf form of GELU with the QDQ model's roundings between
its operators, in one compiled pass (compiled/rounded_gelu.py).

Inputs (x, divisor, scale1, zero1, one, scale2, zero2, scale3, zero3, half): Div(x, divisor) -> Erf ->
round1 -> Add(one) -> round2 -> Mul(x) -> round3 -> Mul(half), each rounding a per-tensor 8-bit
QuantizeLinear -> DequantizeLinear with a float32 scale.
"""

from __future__ import annotations

import numpy as np

from ..algorithms.erf import scaled_coefficients
from ..algorithms.prepared import Prepared
from ..algorithms.quantize import integer_range
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import argument_error

_F32 = np.dtype(np.float32)
_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
_NAMES = ("divisor", "scale1", "zero1", "one", "scale2", "zero2", "scale3", "zero3", "half")


def _scalar(node, name: str, value, dtypes) -> float:
    if value.size != 1 or value.dtype not in dtypes:
        raise argument_error(node, f"input {name!r} is {value.dtype}{value.shape}; expected a scalar of "
                             f"{' or '.join(np.dtype(t).name for t in dtypes)} (the fused nodes' constant)")
    return float(value.reshape(-1)[0])


def _params(node, constants: tuple) -> np.ndarray:
    """The float32 ``params`` array of compiled/rounded_gelu.py, checked."""
    from ..compiled import rounded_gelu as loop

    values = dict(zip(_NAMES, constants))
    params = np.zeros(loop.PARAMS, _F32)
    for slot, name in ((loop.DIVISOR, "divisor"), (loop.ONE, "one"), (loop.HALF, "half")):
        params[slot] = _scalar(node, name, values[name], (_F32,))
    params[loop.SERIES:loop.SERIES + 7] = scaled_coefficients(1.0)
    for i in range(3):
        scale, zero = values[f"scale{i + 1}"], values[f"zero{i + 1}"]
        at = loop.ROUNDINGS + 4 * i
        params[at] = _scalar(node, f"scale{i + 1}", scale, (_F32,))
        params[at + 1] = _scalar(node, f"zero{i + 1}", zero, _EIGHT_BIT)
        params[at + 2:at + 4] = integer_range(zero.dtype)
    return params


@register("RoundedGelu", domain=FUSED_DOMAIN, since=1)
def rounded_gelu(node, shapes, opset):
    from ..compiled import rounded_gelu as loop  # once here: an import statement costs each call microseconds

    prepared = Prepared()  # the params array per set of constant inputs

    def kernel(x, *constants):
        if len(constants) != len(_NAMES):
            raise argument_error(node, f"takes {len(_NAMES) + 1} inputs (x, {', '.join(_NAMES)}); got "
                                 f"{len(constants) + 1}")
        if x.dtype is not _F32:
            raise argument_error(node, f"input 'x' is {x.dtype}; expected float32 (the QDQ model's activations)")
        params = prepared.get(None, constants, lambda: _params(node, constants))
        y = np.empty(x.shape, _F32)
        if y.size:
            loop.rounded_gelu(np.ascontiguousarray(x).reshape(-1), params, y.reshape(-1))
        return (y,)

    return kernel
