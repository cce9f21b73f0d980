"""RoundToHalf (domain ai.onnx_runtime.cpu, see precision_fusions.py): a float value rounded to float16 or
bfloat16 (attribute ``to``) and kept in its own type, the Cast to the half type and back that a
half-precision model computed in float32 keeps where the model rounds. float32 takes one compiled pass."""

from __future__ import annotations

from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidArgumentError

from ..algorithms.precision import round_to
from ..fusions import FUSED_DOMAIN
from ..registry import register
from ._common import graph_error

_HALF = {int(DataType.FLOAT16): DataType.FLOAT16.numpy, int(DataType.BFLOAT16): DataType.BFLOAT16.numpy}


@register("RoundToHalf", domain=FUSED_DOMAIN, since=1)
def round_to_half(node, shapes, opset):
    to = int(node.attr("to", int(DataType.FLOAT16)))
    if to not in _HALF:
        raise graph_error(node, "to", f"is {to}; expected float16 (10) or bfloat16 (16)")
    dtype = _HALF[to]

    def kernel(x):
        if x.dtype.kind != "f":
            raise InvalidArgumentError(f"node {node.name!r} (RoundToHalf): input is {x.dtype}; expected a float tensor")
        return (round_to(x, dtype),)

    return kernel
