"""DynamicQuantizeConv (dynamic_conv_fusions.py): onnxruntime's dynamic quantization of a Conv,
DynamicQuantizeLinear(x) -> ConvInteger(codes, W) -> Cast to float -> Mul by Mul(x_scale, w_scale) (-> Add of
a per-channel bias), as one node. A ViT's patch embedding and a Whisper encoder's two Conv1d paid six steps,
the codes as a uint8 tensor and the exact float convolution of the centred codes; here one compiled call
(compiled/dynamic_conv.py) quantizes, gathers patch rows and multiplies them by the packed weight in int32;
from KNOBS.split_macs of multiply-adds a thread, across the helper threads (threaded_call).

Inputs: X (float32, N x C x D1 [x D2]), W (8-bit, M x C x K1 [x K2], constant), w_scale (float32, one value),
w_zero_point (W's type, one value or one per output channel, or ""), B (float32, M values, or absent).
Attributes: Conv's (kernel_shape, strides, pads, dilations; group 1, explicit pads); activation "relu" where the
Relu that read it is folded in (dynamic_epilogues.fold_dynamic_conv_relu): np.maximum(y, 0) in place, the Relu
kernel's arithmetic.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import InvalidGraphError

from ..algorithms.patch_geometry import patch_geometry
from ..algorithms.quantize import IntegerProduct, dynamic_uint8
from ..compiled.deferred import numpy_first
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ..threads import helper_count, kernel_threads
from ..tuning import KNOBS
from ._common import argument_error
from .contrib_integer_matmul import WeightSide
from .quantization import integer_conv

_F32 = np.dtype(np.float32)
_NO_BIAS = np.zeros(0, _F32)


@register("DynamicQuantizeConv", domain=FUSED_DOMAIN, since=1)
def dynamic_quantize_conv(node, shapes, opset):
    activation = node.attr("activation", "none")
    if activation not in ("none", "relu"):
        raise InvalidGraphError(f"node {node.name!r} (DynamicQuantizeConv): unknown activation {activation!r}")
    relu = activation == "relu"
    convolution = _convolution(node, shapes, opset)
    if not relu:
        return convolution

    def kernel(x, w, w_scale, w_zero_point=None, bias=None):
        (y,) = convolution(x, w, w_scale, w_zero_point, bias)  # a fresh float32 array
        return (np.maximum(y, np.float32(0), out=y),)

    return kernel


def _convolution(node, shapes, opset):
    exact = integer_conv(node, shapes, opset)  # the unfused arithmetic, for every input the compiled call does not take
    product = IntegerProduct()
    last: list = [None] * 5  # the constant inputs of the last call, then their WeightSide (or None)

    def side_of(w, w_scale, w_zero_point, bias):
        if last[0] is w and last[1] is w_scale and last[2] is w_zero_point and last[3] is bias:
            return last[4]
        side = None
        if w.ndim in (3, 4) and w.dtype in (np.uint8, np.int8) and w_scale.size == 1 \
                and (bias is None or bias.size == w.shape[0]):
            # The weight's rows (output channels) as B's columns: taps (c, i, j) in ConvInteger's order.
            b = w.reshape(w.shape[0], -1).T
            zero = None if w_zero_point is None else w_zero_point.reshape(-1)
            flat_bias = None if bias is None else bias.reshape(-1)
            side = QuadWeight.of(b, w_scale, zero, flat_bias) if quads_available() else \
                WeightSide.of(product, np.empty((1, b.shape[0]), _F32), b, w_scale.reshape(()), zero, flat_bias)
        if all(v is None or not v.flags.writeable for v in (w, w_scale, w_zero_point, bias)):
            last[:] = [w, w_scale, w_zero_point, bias, side]
        return side

    geometries: dict = {}  # per (X's shape, W's shape): patch_geometry's answer (a run repeats its shapes)

    def kernel(x, w, w_scale, w_zero_point=None, bias=None):
        # numba loads in the background: the unfused arithmetic on numpy meanwhile (the threaded call's runner
        # linked by the loader too)
        if numpy_first("dynamic_conv_jobs.DYNAMIC_CONV"):
            _check(node, x, w, w_scale, bias)
            return (_unfused(exact, x, w, w_scale, w_zero_point, bias),)
        side = side_of(w, w_scale, w_zero_point, bias) if x.dtype is _F32 else None
        key = (x.shape, w.shape)
        geometry = geometries.get(key) if side is not None else None
        if geometry is None and side is not None:
            _check(node, x, w, w_scale, bias)
            geometry = patch_geometry(node, x.shape, w.shape)
            if len(geometries) < 16:
                geometries[key] = geometry
        if geometry is None:
            _check(node, x, w, w_scale, bias)
            return (_unfused(exact, x, w, w_scale, w_zero_point, bias),)
        return (compiled_call(x, geometry, side),)

    return kernel


class QuadWeight:
    """compiled/dynamic_conv.dynamic_conv_quads' side of a constant weight (hosts with AVX-512 VNNI): its codes
    as signed bytes (uint8 codes less 128, their zero points with them), one row of whole quads of k per output
    channel (qgemm_quads.weight_rows), the sum of each output channel's codes, the signed zero points (M,) int64,
    the scale as float64 (1,), the float32 bias or an empty one."""

    __slots__ = ("weight", "column_sums", "zeros", "scales", "bias")

    @classmethod
    def of(cls, b: np.ndarray, w_scale: np.ndarray, zero: np.ndarray | None, bias: np.ndarray | None):
        """None where the compiled call does not apply (WeightSide's conditions); ``b`` the weight as (K, M)."""
        from ..compiled import qgemm_quads

        columns = b.shape[1]
        if w_scale.dtype != _F32 or (zero is not None and (zero.dtype != b.dtype or zero.size not in (1, columns))) \
                or (bias is not None and (bias.dtype != _F32 or bias.size != columns)):
            return None
        side = cls()
        quads, side.column_sums, side.zeros = qgemm_quads.signed_quads(
            b, np.zeros(1, b.dtype) if zero is None else zero)
        side.weight = qgemm_quads.weight_rows(quads, columns)
        side.scales = w_scale.reshape(-1).astype(np.float64)
        side.bias = _NO_BIAS if bias is None else bias
        return side


def quads_available() -> bool:
    """Whether the byte products run here (AVX-512 VNNI): QuadWeight sides, else WeightSide's int16 pairs."""
    from ..compiled import qgemm_quads  # (imports neither numba nor llvmlite)

    return qgemm_quads.AVAILABLE


_COMPILED: list = []  # compiled/dynamic_conv, imported at the first call numba serves (it imports numba)


def compiled_call(x, geometry, side) -> np.ndarray:
    """The compiled convolution of float32 ``x`` by a kept weight side (QuadWeight or WeightSide)."""
    if not _COMPILED:
        from ..compiled import dynamic_conv

        _COMPILED.append(dynamic_conv)
    shape4, steps, out_shape, (oh, ow) = geometry
    out = np.empty(out_shape, _F32)
    x4, out3 = np.ascontiguousarray(x).reshape(shape4), out.reshape(out_shape[0], out_shape[1], oh * ow)
    if isinstance(side, QuadWeight):
        threads = split_threads(out_shape[0] * oh * ow * side.weight.size)
        if threads > 1:
            threaded_call(x4, steps, oh, ow, side, out3, threads)
        else:
            _COMPILED[0].dynamic_conv_quads(x4, *steps, oh, ow, side.weight, side.column_sums, side.zeros,
                                            side.scales, side.bias, out3)
    else:
        _COMPILED[0].dynamic_conv(x4, *steps, oh, ow, side.packed, side.pairs, side.scales, side.bias, out3)
    return out


TASKS_PER_THREAD = 4  # each phase's tasks: a helper that falls behind leaves some to the others


def split_threads(macs: int) -> int:
    """The threads a call of the byte products splits across (this convolution's and a QDQ group's,
    ops/qdq_linear._conv_blocks): KNOBS.split_macs of multiply-adds a thread at least."""
    return max(1, min(kernel_threads(), macs // KNOBS.split_macs))


def task_ranges(threads: int) -> np.ndarray:
    """Each part's claimed tasks, TASKS_PER_THREAD a thread: part p's ranges[p] .. ranges[p + 1] (kept per count)."""
    ranges = _ranges.get(threads)
    if ranges is None:
        tasks = TASKS_PER_THREAD * threads
        ranges = _ranges[threads] = np.array([tasks * p // threads for p in range(threads + 1)], dtype=np.int64)
    return ranges


def threaded_call(x4, steps, oh, ow, side, out3, threads: int) -> None:
    """dynamic_conv_quads with its phases (x's range, the padded codes, the patches, the products) shared with the
    helper threads as claimed tasks (compiled/dynamic_conv_jobs.split_dynamic_conv)."""
    from ..compiled import dynamic_conv_jobs, workers

    arguments = (x4, *steps, oh, ow, side.weight, side.column_sums, side.zeros, side.scales, side.bias, out3,
                 task_ranges(threads),
                 np.zeros(threads, np.int64), workers.local_mailbox(0))  # (claims per call: callers on threads)
    workers.call(dynamic_conv_jobs.split_dynamic_conv, arguments, dynamic_conv_jobs.DYNAMIC_CONV.address(), 0,
                 helper_count())


_ranges: dict[int, np.ndarray] = {}  # per thread count: each part's tasks


def _check(node, x, w, w_scale, bias) -> None:
    if x.dtype != _F32:
        raise argument_error(node, f"input 'X' is {x.dtype}; expected float32 (DynamicQuantizeLinear's input)")
    if w_scale.dtype != _F32 or w_scale.size != 1:
        raise argument_error(node, f"w_scale is {w_scale.dtype}{w_scale.shape}; expected one float32 value")
    if bias is not None and (bias.dtype != _F32 or bias.size != w.shape[0]):
        raise argument_error(node, f"bias is {bias.dtype}{bias.shape}; expected {w.shape[0]} float32 values, one "
                                   "per output channel")


def _unfused(exact, x, w, w_scale, w_zero_point, bias) -> np.ndarray:
    """The nodes it replaces, one by one: the codes, the exact integer convolution, its float32 value times the
    float32 product of the scales, the bias added in float32."""
    x_scale, x_zero, codes = dynamic_uint8(x)
    acc = exact(codes, w, np.asarray(x_zero), w_zero_point).astype(np.int64).astype(np.int32)
    y = acc.astype(_F32) * (x_scale * w_scale.reshape(()).astype(_F32))
    if bias is not None:
        y = y + bias.reshape((-1,) + (1,) * (y.ndim - 2))
    return y.astype(_F32, copy=False)
