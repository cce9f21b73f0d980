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

from operator import is_

import numpy as np

from ..algorithms.quantize import integer_range
from ..compiled.deferred import numpy_first
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ..threads import helper_count, kernel_threads
from ..tuning import KNOBS
from .contrib_quantization import eight_bit, float_scale, same_type, scalar


@register("QuantizedAdd", domain=FUSED_DOMAIN, since=1)
def quantized_add(node, shapes, opset):
    relu = bool(node.attr("relu", 0))
    last: list = [(), None]  # the six parameter arrays of the last call, then their checked values (constants)

    def parameters(a, b, params) -> np.ndarray:
        """The checked parameters as dequantized_sum's float32 array (QLinearAdd's checks: one 8-bit type, per
        tensor)."""
        dtype = eight_bit(node, "a", a)
        same_type(node, ("a", "b"), a, b)
        a_scale, a_zero, b_scale, b_zero, y_scale, y_zero = params
        zeros = [scalar(node, n, z, dtype) for n, z in (("a_zero_point", a_zero), ("b_zero_point", b_zero),
                                                         ("y_zero_point", y_zero))]
        scales = [float_scale(node, n, v) for n, v in (("a_scale", a_scale), ("b_scale", b_scale),
                                                         ("y_scale", y_scale))]
        found = np.array([scales[0], zeros[0], scales[1], zeros[1], scales[2], zeros[2], *integer_range(dtype)],
                         np.float32)
        if not any(v.flags.writeable for v in params):
            last[:] = [params, found]
        return found

    def kernel(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero):
        params = (a_scale, a_zero, b_scale, b_zero, y_scale, y_zero)
        seen, found = last
        if not (len(seen) == 6 and all(map(is_, seen, params)) and a.dtype is y_zero.dtype is b.dtype):
            found = parameters(a, b, params)
        if a.shape == b.shape and not numpy_first("jobs.DEQUANTIZED_SUM"):  # (numpy while numba loads)
            out = np.empty(a.shape, a.dtype)
            _compiled_sum(np.ascontiguousarray(a).reshape(-1).view(np.uint8),
                          np.ascontiguousarray(b).reshape(-1).view(np.uint8), found, relu, a.dtype == np.int8,
                          out.reshape(-1).view(np.uint8))
            return (out,)
        return (_broadcast(a, b, found, relu, a.dtype),)

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


def _broadcast(a, b, params, relu: bool, dtype) -> np.ndarray:
    """The same operations through numpy (broadcasting)."""
    a_scale, a_zero, b_scale, b_zero, y_scale, y_zero, low, high = params
    total = (a.astype(np.float32) - a_zero) * a_scale + (b.astype(np.float32) - b_zero) * b_scale
    if relu:
        total = np.where(total < 0, np.float32(0), total)
    codes = np.clip(np.rint(total / y_scale) + y_zero, low, high)
    return np.where(np.isnan(codes), 0, codes).astype(dtype)
