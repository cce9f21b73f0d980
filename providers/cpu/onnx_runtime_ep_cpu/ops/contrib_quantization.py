"""Shared checks of onnxruntime's quantized contrib operators (domain com.microsoft, docs/ContribOperators.md),
and the contrib QuantizeLinear/DequantizeLinear. The operators themselves live one family per module:
contrib_qlinear_binary (QLinearAdd, QLinearMul), contrib_qlinear_activation (QLinearSigmoid, QLinearLeakyRelu,
QLinearSoftmax), contrib_qlinear_concat (QLinearConcat, QLinearWhere), contrib_qlinear_pool (the average pools),
contrib_qlinear_gemm (QGemm) and contrib_integer_matmul (MatMulIntegerToFloat, DynamicQuantizeMatMul).

Operators defined as quantize(f(dequantize(x))) compute f on the float32 tensor DequantizeLinear gives and
quantize it as QuantizeLinear does (float32 division, ties to even, saturation). Products of integers
accumulate exactly (algorithms/quantize.py) and wrap as a 32-bit accumulator would; the float rescaling
that follows runs in float64 and rounds once.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.dtypes import DataType

from ..algorithms.quantize import dequantize, quantize
from ..registry import register
from ._common import CONTRIB_DOMAIN, argument_error, normalize_axis

_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
_F32 = np.dtype(np.float32)

# -- input checks ----------------------------------------------------------------------------------


def eight_bit(node, name: str, x: np.ndarray) -> np.dtype:
    if x.dtype not in _EIGHT_BIT:
        raise argument_error(node, f"input {name!r} is {x.dtype}; expected uint8 or int8")
    return x.dtype


def scalar(node, name: str, value: np.ndarray | None, dtype=None):
    """A per-tensor parameter: a scalar or one-element tensor (of ``dtype`` when given), or None."""
    if value is None:
        return None
    if value.size != 1:
        raise argument_error(node, f"input {name!r} has shape {value.shape}; expected a scalar (per-tensor)")
    if dtype is not None and value.dtype != dtype:
        raise argument_error(node, f"input {name!r} is {value.dtype}; expected {np.dtype(dtype)} like the data")
    return value.reshape(())


def float_scale(node, name: str, value: np.ndarray):
    if value.dtype != _F32:
        raise argument_error(node, f"input {name!r} is {value.dtype}; expected float32")
    return scalar(node, name, value)


def same_type(node, names: tuple[str, str], a: np.ndarray, b: np.ndarray) -> None:
    if a.dtype != b.dtype:
        raise argument_error(node, f"inputs {names[0]!r} ({a.dtype}) and {names[1]!r} ({b.dtype}) must have one type")



# -- QuantizeLinear, DequantizeLinear (com.microsoft) ----------------------------------------------

_QUANTIZED = {DataType.INT8, DataType.UINT8, DataType.INT16, DataType.UINT16, DataType.INT4, DataType.UINT4}
_HALF_OR_FLOAT = (_F32, np.dtype(np.float16))


def _axis_param(node, name: str, value, shape, axis, dtype=None):
    """A scale or zero point: per tensor (a single value), else 1-D along ``axis``."""
    if value is None or value.size == 1:
        return scalar(node, name, value, dtype)
    a = normalize_axis(node, axis, len(shape))
    if value.shape != (shape[a],):
        raise argument_error(node, f"input {name!r} has shape {value.shape}; expected ({shape[a]},) for axis {a} "
                             f"of the input {tuple(shape)}")
    if dtype is not None and value.dtype != dtype:
        raise argument_error(node, f"input {name!r} is {value.dtype}; expected {np.dtype(dtype)}")
    return value.reshape((-1,) + (1,) * (len(shape) - 1 - a))


def _axis(node) -> int:
    # The spec asks for scalars when 'axis' is absent; onnxruntime then takes 1-D parameters along axis 1,
    # as ONNX's QuantizeLinear does, and so does this runtime.
    return int(node.attr("axis", 1))


@register("QuantizeLinear", domain=CONTRIB_DOMAIN, since=1)
def contrib_quantize_linear(node, shapes, opset):
    axis = _axis(node)

    def kernel(x, y_scale, y_zero_point=None):
        if x.dtype not in _HALF_OR_FLOAT or y_scale.dtype != x.dtype:
            raise argument_error(node, f"x ({x.dtype}) and y_scale ({y_scale.dtype}) must both be float32 or float16")
        target = np.dtype(np.uint8) if y_zero_point is None else y_zero_point.dtype
        if DataType.from_numpy(target) not in _QUANTIZED:
            raise argument_error(node, f"y_zero_point is {target}; expected int8, uint8, int16, uint16, int4 or uint4")
        scale = _axis_param(node, "y_scale", y_scale, x.shape, axis)
        zero = _axis_param(node, "y_zero_point", y_zero_point, x.shape, axis, target)
        return (quantize(x, scale, zero, target),)

    return kernel


@register("DequantizeLinear", domain=CONTRIB_DOMAIN, since=1)
def contrib_dequantize_linear(node, shapes, opset):
    axis = _axis(node)

    def kernel(x, x_scale, x_zero_point=None):
        if DataType.from_numpy(x.dtype) not in _QUANTIZED | {DataType.INT32}:
            raise argument_error(node, f"x is {x.dtype}; expected int8, uint8, int16, uint16, int32, int4 or uint4")
        if x_scale.dtype not in _HALF_OR_FLOAT:
            raise argument_error(node, f"x_scale is {x_scale.dtype}; expected float32 or float16")
        scale = _axis_param(node, "x_scale", x_scale, x.shape, axis)
        zero = _axis_param(node, "x_zero_point", x_zero_point, x.shape, axis, x.dtype)
        # Exact difference, one float32 product, rounded once to the scale's type.
        return (dequantize(x, scale, zero).astype(x_scale.dtype, copy=False),)

    return kernel
