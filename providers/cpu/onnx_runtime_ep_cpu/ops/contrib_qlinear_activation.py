"""QLinearSigmoid, QLinearLeakyRelu and QLinearSoftmax (domain com.microsoft, docs/ContribOperators.md):
quantize(f(dequantize(x))), f computed on the float32 values DequantizeLinear gives and quantized as
QuantizeLinear does. The elementwise ones are one 256-entry table per set of quantization parameters."""

from __future__ import annotations

import functools
import math

import numpy as np

from ..algorithms.activations import sigmoid
from ..algorithms.quantize import apply_table, integer_range, lookup_table, quantize, widen
from ..algorithms.repeat_call import RepeatCall
from ..registry import register
from ._common import CONTRIB_DOMAIN, argument_error, normalize_axis, required_attr
from .contrib_quantization import eight_bit, float_scale, scalar

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)

# -- QLinearSigmoid, QLinearLeakyRelu: one 256-entry table per set of quantization parameters ------


def _table_op(node, fn):
    last = (None, None)  # (parameters, table): constant parameters build the table once

    def kernel(x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        dtype = eight_bit(node, "X", x)
        if y_scale is None:
            raise argument_error(node, "input 'Y_scale' is missing; expected a float32 scalar")
        params = (float_scale(node, "X_scale", x_scale), scalar(node, "X_zero_point", x_zero_point, dtype),
                  float_scale(node, "Y_scale", y_scale), scalar(node, "Y_zero_point", y_zero_point, dtype))
        nonlocal last
        key = (dtype.str,) + tuple(None if p is None else p.item() for p in params)
        table = last[1] if last[0] == key else None
        if table is None:
            table = lookup_table(dtype, params[0], params[1], fn, params[2], params[3])
            last = (key, table)
        return (apply_table(table, x),)

    return kernel


def _sigmoid_f32(x):
    # In float64, rounded once to float32: the exact sigmoid of each float32 input.
    return sigmoid(x.astype(_F64)).astype(_F32)


@register("QLinearSigmoid", domain=CONTRIB_DOMAIN, since=1)
def qlinear_sigmoid(node, shapes, opset):
    return _table_op(node, _sigmoid_f32)


@register("QLinearLeakyRelu", domain=CONTRIB_DOMAIN, since=1)
def qlinear_leaky_relu(node, shapes, opset):
    alpha = _F32.type(node.attr("alpha", 0.01))
    return _table_op(node, lambda x: np.where(x >= 0, x, alpha * x))


# -- QLinearSoftmax --------------------------------------------------------------------------------


@register("QLinearSoftmax", domain=CONTRIB_DOMAIN, since=1)
def qlinear_softmax(node, shapes, opset):
    from ..compiled import quantize as compiled

    version = int(required_attr(node, "opset", "the opset of the Softmax it replaces (e.g. 13)"))
    axis = int(node.attr("axis", 1 if version < 13 else -1))
    repeat = RepeatCall()  # the last call over rows: X's shape and type, the constant parameters, the loop's arguments

    def kernel(x, x_scale, x_zero_point=None, y_scale=None, y_zero_point=None):
        kept = repeat.match(x, (x_scale, x_zero_point, y_scale, y_zero_point))
        if kept is not None:  # a run repeats its shapes and constant parameters: the checks held last time
            out = np.empty(x.shape, x.dtype)
            compiled.softmax_codes(np.ascontiguousarray(x).reshape(kept[0]), *kept[1:], out.reshape(kept[0]))
            return (out,)
        dtype = eight_bit(node, "X", x)
        if y_scale is None:
            raise argument_error(node, "input 'y_scale' is missing; expected a float32 scalar")
        scale = float_scale(node, "X_scale", x_scale).astype(_F64)
        scalar(node, "x_zero_point", x_zero_point, dtype)  # softmax is shift-invariant: checked, then unused
        y_zero = scalar(node, "y_zero_point", y_zero_point, dtype)
        if x.size == 0:
            return (x.copy(),)
        a = normalize_axis(node, axis, x.ndim)
        y_scale_value = float_scale(node, "y_scale", y_scale)
        if a == x.ndim - 1 and y_zero is not None:  # rows along the last axis (either opset): one compiled pass
            arguments = ((-1, x.shape[-1]), _exp_table(float(scale)), y_scale_value, int(y_zero),
                         *integer_range(dtype))
            out = np.empty(x.shape, dtype)
            compiled.softmax_codes(np.ascontiguousarray(x).reshape(arguments[0]), *arguments[1:],
                                   out.reshape(arguments[0]))
            repeat.keep(x, (x_scale, x_zero_point, y_scale, y_zero_point), arguments)
            return (out,)
        # Before opset 13 softmax runs over the input flattened to 2-D at the axis.
        rows = x.reshape(math.prod(x.shape[:a]), -1) if version < 13 else x
        along = 1 if version < 13 else a
        centered = widen(rows) - widen(rows).max(axis=along, keepdims=True)
        e = np.exp(centered * scale)
        p = (e / e.sum(axis=along, keepdims=True)).astype(_F32)
        return (quantize(p, y_scale_value, y_zero, dtype).reshape(x.shape),)

    return kernel


@functools.lru_cache(maxsize=64)
def _exp_table(x_scale: float) -> np.ndarray:
    """exp(-d * x_scale) for every difference d = max - x of 8-bit codes (0..255), in float64: the values
    exp((x - max) * x_scale) takes."""
    table = np.exp(np.arange(0, -256, -1, dtype=np.int64) * x_scale)
    table.flags.writeable = False
    return table
