"""The conversions a half-precision model computed in float32 keeps (domain ai.onnx_runtime.cpu, see
precision_fusions.py), each over any number of tensors (input i to output i), so that a model's edges convert in
one node:

- RoundToHalf: float values rounded to float16 or bfloat16 (attribute ``to``) and kept in their own type, the
  Cast to the half type and back where the model rounds;
- HalfToFloat: float16 or bfloat16 values widened to float32 (a half-precision graph input);
- FloatToHalf: float32 values narrowed to float16 or bfloat16 (attribute ``to``; a half-precision graph output).

float32 and float16 convert in compiled passes (algorithms/precision.py)."""

from __future__ import annotations

from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidArgumentError

from ..algorithms.precision import FLOAT32, HALF_FLOATS, narrow, round_all, widen
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import graph_error

_HALF = {int(DataType.FLOAT16): DataType.FLOAT16.numpy, int(DataType.BFLOAT16): DataType.BFLOAT16.numpy}


def _half_attr(node):
    to = int(node.attr("to", int(DataType.FLOAT16)))
    if to not in _HALF:
        raise graph_error(node, "to", f"is {to}; expected float16 (10) or bfloat16 (16)")
    return _HALF[to]


def _check(node, inputs, accepts, expected: str) -> None:
    for index, x in enumerate(inputs):
        if not accepts(x.dtype):
            raise InvalidArgumentError(f"node {node.name!r} ({node.op_type}): input {index} "
                                       f"({node.inputs[index]!r}) is {x.dtype}; expected {expected}")


@register("RoundToHalf", domain=FUSED_DOMAIN, since=1)
def round_to_half(node, shapes, opset):
    dtype = _half_attr(node)

    def kernel(*inputs):
        _check(node, inputs, lambda d: d.kind == "f", "a float tensor")
        return round_all(inputs, dtype)

    return kernel


@register("HalfToFloat", domain=FUSED_DOMAIN, since=1)
def half_to_float(node, shapes, opset):
    def kernel(*inputs):
        _check(node, inputs, lambda d: d in HALF_FLOATS, "a float16 or bfloat16 tensor")
        return tuple(widen(x) for x in inputs)

    return kernel


@register("FloatToHalf", domain=FUSED_DOMAIN, since=1)
def float_to_half(node, shapes, opset):
    dtype = _half_attr(node)

    def kernel(*inputs):
        _check(node, inputs, lambda d: d == FLOAT32, "a float32 tensor")
        return tuple(narrow(x, dtype) for x in inputs)

    return kernel
