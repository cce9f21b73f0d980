"""RoundedRotary (qdq_rotary.fuse_rounded_rotary): a QDQ decoder's rotate-half rotary embedding with its roundings,
in one compiled pass per row (compiled/rounded_rotary.py).

Inputs (x, cos, sin, then scale and zero point of each rounding: the cos product, the negation, the
concatenation, the sin product, and optionally the sum): x * cos rounded, plus concat(-x[..., half:],
x[..., :half]) (the negation rounded, then the whole concatenation) times sin, rounded; the sum rounded where its
grid is given. Attributes ``half`` (where x's last axis is cut) and ``end`` (its size). cos and sin have one
shape that broadcasts onto x without enlarging it, with x's last axis; other shapes and non-float32 inputs are
typed errors.
"""

from __future__ import annotations

import numpy as np

from ..algorithms.bound_loop import EntryOnce
from ..algorithms.prepared import Prepared
from ..algorithms.quantize import integer_range
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import argument_error
from .fused import RotationPlan

_F32 = np.dtype(np.float32)
_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
_ROUNDINGS = ("cos product", "negation", "concatenation", "sin product", "sum")


def _grid(node, name: str, scale, zero) -> tuple:
    if scale.size != 1 or scale.dtype != _F32 or zero.size != 1 or zero.dtype not in _EIGHT_BIT:
        raise argument_error(node, f"the {name} grid is {scale.dtype}{scale.shape} scale and {zero.dtype}{zero.shape} "
                             "zero point; expected a float32 scalar and a uint8 or int8 scalar")
    return (scale.reshape(-1)[0], zero.reshape(-1)[0], *integer_range(zero.dtype))


@register("RoundedRotary", domain=FUSED_DOMAIN, since=1)
def rounded_rotary(node, shapes, opset):
    from ..compiled import rounded_rotary as loop  # once here: an import statement costs each call microseconds

    half, end = int(node.attr("half")), int(node.attr("end"))
    rounded_sum = len(node.inputs) > 11 and bool(node.inputs[11])
    prepared = Prepared()  # the roundings' params per set of constant grids
    plans = RotationPlan(half, end)
    # the loop's entry point once it runs compiled: a decode step's few rows cost less than the dispatcher's typing
    bind = EntryOnce(loop.rounded_rotary)

    def prepare(grids):
        params = np.zeros(loop.PARAMS, _F32)
        for k, (scale, zero) in enumerate(zip(grids[::2], grids[1::2])):
            params[4 * k:4 * k + 4] = _grid(node, _ROUNDINGS[k], scale, zero)
        return params

    def kernel(x, cos, sin, *grids):
        if len(grids) not in (8, 10):
            raise argument_error(node, f"{len(grids)} grid inputs; expected 8, or 10 with the sum's")
        for name, value in (("x", x), ("cos", cos), ("sin", sin)):
            if value.dtype != _F32:
                raise argument_error(node, f"input {name!r} is {value.dtype}; expected float32")
        params = prepared.get(None, grids, lambda: prepare(grids))
        plan = plans(x.shape, cos.shape) if cos.shape == sin.shape else None
        if plan is None:
            if x.ndim and x.shape[-1] == end and 0 in x.shape:
                return (np.empty(x.shape, _F32),)
            raise argument_error(node, f"inputs 'cos' {cos.shape} and 'sin' {sin.shape} for x {x.shape}; expected x's "
                                 f"last axis {end} and one table shape broadcasting onto x's, with that last axis")
        rows, x_2d, table_2d = plan
        out = np.empty(x.shape, _F32)
        bind.run((np.ascontiguousarray(x).reshape(x_2d), np.ascontiguousarray(cos).reshape(table_2d),
                  np.ascontiguousarray(sin).reshape(table_2d), rows, half, params, rounded_sum, out.reshape(x_2d)))
        return (out,)

    return kernel
