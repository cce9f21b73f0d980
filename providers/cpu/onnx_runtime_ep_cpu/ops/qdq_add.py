"""QuantizedAdd (qdq_fusions.fuse_quantized_add): a QDQ residual addition on the codes,
QuantizeLinear([Relu](DequantizeLinear(a) + DequantizeLinear(b))), with the nodes' own float32 arithmetic: each
code less its zero point times its scale, the sum, Relu's max with 0 (NaN passes), then x / y_scale rounded half
to even plus the zero point, saturated (NaN gives code 0). Equal shapes run one compiled pass
(compiled/quantize.dequantized_sum, in spans across the helper threads); others, and every call while numba loads,
through numpy with the same operations.

Inputs: a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point (8-bit codes, per-tensor float32
scales); attribute ``relu``.
"""

from __future__ import annotations

import numpy as np

from ..algorithms.quantize import integer_range
from ..compiled.deferred import numpy_first
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ..threads import helper_count, kernel_threads
from ..tuning import KNOBS
from ._common import argument_error

_F32 = np.dtype(np.float32)
_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))


@register("QuantizedAdd", domain=FUSED_DOMAIN, since=1)
def quantized_add(node, shapes, opset):
    relu = bool(node.attr("relu", 0))

    def kernel(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero):
        for name, codes, zero in (("a", a, a_zero), ("b", b, b_zero), ("y", None, y_zero)):
            if zero.dtype not in _EIGHT_BIT or zero.size != 1 or (codes is not None and codes.dtype != zero.dtype):
                raise argument_error(node, f"input {name!r} and its zero point must be 8-bit codes of one type, "
                                           f"one zero point; got {None if codes is None else codes.dtype} and "
                                           f"{zero.dtype}{zero.shape}")
        for name, scale in (("a_scale", a_scale), ("b_scale", b_scale), ("y_scale", y_scale)):
            if scale.dtype != _F32 or scale.size != 1:
                raise argument_error(node, f"input {name!r} is {scale.dtype}{scale.shape}; expected one float32")
        low, high = integer_range(y_zero.dtype)
        values = (np.float32(a_scale.reshape(())), np.float32(a_zero.reshape(())), np.float32(b_scale.reshape(())),
                  np.float32(b_zero.reshape(())), np.float32(y_scale.reshape(())), np.float32(y_zero.reshape(())),
                  np.float32(low), np.float32(high))
        if a.shape == b.shape and not numpy_first("jobs.DEQUANTIZED_SUM"):  # (numpy while numba loads)
            out = np.empty(a.shape, y_zero.dtype)
            _compiled_sum(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                          np.ascontiguousarray(b).reshape(-1).view(np.uint8), np.array(values, np.float32), relu,
                          a.dtype == np.int8, out.reshape(-1).view(np.uint8))
            return (out,)
        return (_broadcast(a, b, values, relu, y_zero.dtype),)

    return kernel


def _compiled_sum(a, b, params, relu: bool, signed: bool, out) -> None:
    """compiled/quantize.dequantized_sum over the flat bytes, in spans across the helper threads from
    KNOBS.split_elements values a thread (compiled/jobs.DEQUANTIZED_SUM)."""
    from ..compiled import jobs, quantize, workers

    threads = max(1, min(kernel_threads(), a.shape[0] // KNOBS.split_elements))
    if threads == 1:
        quantize.dequantized_sum(a, b, params, relu, signed, out)
        return
    bounds = [a.shape[0] * t // threads for t in range(threads + 1)]
    workers.run(jobs.DEQUANTIZED_SUM, [(a[p:q], b[p:q], params, relu, signed, out[p:q])
                                       for p, q in zip(bounds, bounds[1:])], helper_count())


def _broadcast(a, b, values, relu: bool, dtype) -> np.ndarray:
    """The same operations through numpy (broadcasting)."""
    a_scale, a_zero, b_scale, b_zero, y_scale, y_zero, low, high = values
    total = (a.astype(_F32) - a_zero) * a_scale + (b.astype(_F32) - b_zero) * b_scale
    if relu:
        total = np.where(total < 0, np.float32(0), total)
    codes = np.clip(np.rint(total / y_scale) + y_zero, low, high)
    return np.where(np.isnan(codes), 0, codes).astype(dtype)
