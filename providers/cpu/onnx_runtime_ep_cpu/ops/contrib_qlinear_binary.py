"""QLinearAdd and QLinearMul (domain com.microsoft, docs/ContribOperators.md): C = A + B or A * B on the real
values, requantized. The zero points come off exactly (int64), the scales join in float64 and the result rounds
once, as QuantizeLinear rounds (ties to even, saturation)."""

from __future__ import annotations

from operator import is_

import numpy as np

from ..algorithms.qlinear_layout import binary_layout
from ..algorithms.quantize import integer_range, round_saturate, widen
from ..algorithms.repeat_call import RepeatCall
from ..registry import register
from ._common import CONTRIB_DOMAIN, argument_error
from .contrib_quantization import eight_bit, float_scale, same_type, scalar

_F64 = np.dtype(np.float64)

def _binary(node, combine):
    """C = combine(A, B) on the real values, requantized: the zero points come off exactly (int64), the scales
    join in float64, and the result rounds once (in one compiled pass for the common broadcasts). The checked
    parameters are kept while the same constant arrays come in, and the layout per pair of input shapes."""
    from ..compiled import quantize as compiled  # once here: an import statement costs each call microseconds

    multiply = combine is _mul
    last: list = [(), None]
    layouts: dict = {}
    # the last compiled call: A's shape and type, the six parameter arrays, and (B's shape, the output shape, the
    # loop's arguments after the operands)
    repeat = RepeatCall()

    def parameters(a, b, params):
        dtype = eight_bit(node, "A", a)
        same_type(node, ("A", "B"), a, b)
        a_scale, a_zero_point, b_scale, b_zero_point, c_scale, c_zero_point = params
        zeros = [scalar(node, n, z, dtype) for n, z in
                 (("A_zero_point", a_zero_point), ("B_zero_point", b_zero_point), ("C_zero_point", c_zero_point))]
        scales = [float_scale(node, n, s) for n, s in
                  (("A_scale", a_scale), ("B_scale", b_scale), ("C_scale", c_scale))]
        compiled = (np.array([0 if z is None else int(z) for z in zeros], np.int64),
                    np.array([float(s) for s in scales], np.float64), *integer_range(dtype))
        found = (dtype, zeros, scales, compiled)
        if all(p is None or not p.flags.writeable for p in params):
            last[:] = [params, found]
        return found

    def kernel(a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale, c_zero_point=None):
        params = (a_scale, a_zero_point, b_scale, b_zero_point, c_scale, c_zero_point)
        kept = repeat.match(a, params)  # a run repeats its shapes and constant parameters: one comparison each
        if kept is not None and b.shape == kept[0] and b.dtype is a.dtype:
            out = np.empty(kept[1], a.dtype)
            arguments = kept[2]
            compiled.requantize_binary(np.ascontiguousarray(a).reshape(-1), arguments[0],
                                       np.ascontiguousarray(b).reshape(-1), *arguments[1:-1],
                                       out.reshape(arguments[-1]))
            return (out,)
        seen, found = last
        if not (len(seen) == 6 and all(map(is_, seen, params)) and a.dtype is found[0] and b.dtype is found[0]):
            found = parameters(a, b, params)
        dtype, zeros, scales, compiled_params = found
        shape, steps = _layout_of(node, layouts, a.shape, b.shape)
        if steps is not None:
            out = np.empty(shape, dtype)
            arguments = (steps[1], steps[2], *compiled_params, multiply, (-1, steps[0]))
            compiled.requantize_binary(np.ascontiguousarray(a).reshape(-1), arguments[0],
                                       np.ascontiguousarray(b).reshape(-1), *arguments[1:-1],
                                       out.reshape(arguments[-1]))
            if last[1] is found:  # constant parameters: the next call with these arrays and shapes skips the checks
                repeat.keep(a, params, (b.shape, shape, arguments))
            return (out,)
        values = combine(widen(a, zeros[0]), widen(b, zeros[1]), *(s.astype(_F64) for s in scales))
        return (round_saturate(values, zeros[2], dtype),)

    return kernel


def _layout_of(node, layouts: dict, a_shape, b_shape) -> tuple:
    """(output shape, binary_layout's answer) for a pair of input shapes, remembered for up to 64 pairs."""
    key = (a_shape, b_shape)
    layout = layouts.get(key)
    if layout is None:
        try:
            shape = np.broadcast_shapes(a_shape, b_shape)
        except ValueError:
            raise argument_error(node, f"A {a_shape} and B {b_shape} do not broadcast") from None
        layout = (shape, binary_layout(a_shape, b_shape, shape))
        if len(layouts) < 64:
            layouts[key] = layout
    return layout


def _add(a, b, a_scale, b_scale, c_scale):
    return (a_scale * a + b_scale * b) / c_scale


def _mul(a, b, a_scale, b_scale, c_scale):
    return (a * b) * (a_scale * b_scale / c_scale)


@register("QLinearAdd", domain=CONTRIB_DOMAIN, since=1)
def qlinear_add(node, shapes, opset):
    return _binary(node, _add)


@register("QLinearMul", domain=CONTRIB_DOMAIN, since=1)
def qlinear_mul(node, shapes, opset):
    return _binary(node, _mul)
