"""BatchNormalization (inference) and LRN on the device (kernels/channel_norm.cu): the per-channel
normalizations CNNs keep between convolutions when the optimizer cannot fold them (a BatchNormalization
after a Concat in DenseNet, LRN in AlexNet/GoogLeNet). Tensors are viewed as (n, channels, spatial)."""

from __future__ import annotations

import math

from .context import f32, i32, i64, ptr
from .elementwise import FLOAT_TYPES, Kernels, require_type
from .registry import register

SOURCE = "channel_norm.cu"


def _layout(shape) -> tuple[int, int, int]:
    """(element count, channels, spatial size) of an (N, C, ...) tensor."""
    channels = shape[1] if len(shape) > 1 else 1
    return math.prod(shape), channels, math.prod(shape[2:])


def _batch_norm_check(node, shapes, dtypes):
    if int(node.attr("training_mode", 0)):
        return ("CUDAExecutionProvider runs BatchNormalization in inference mode only (training_mode=0); "
                "training_mode=1 runs on CPUExecutionProvider")
    if int(node.attr("spatial", 1)) != 1:
        return "CUDAExecutionProvider runs BatchNormalization with spatial=1 only (per-channel statistics)"
    if any(node.outputs[1:]):
        return ("CUDAExecutionProvider's BatchNormalization produces Y only; the statistics outputs exist in "
                "training, which runs on CPUExecutionProvider")
    if any(d is not None and d != dtypes[0] for d in dtypes[1:5]):
        return (f"CUDAExecutionProvider runs BatchNormalization with X, scale, B, mean and var of one type, got "
                f"{[d.name.lower() if d is not None else None for d in dtypes[:5]]}")
    if shapes and shapes[0] is not None and len(shapes[0]) < 2:
        return f"BatchNormalization needs X of rank >= 2 (N, C, ...), got rank {len(shapes[0])}"
    return None


def batch_norm(node, shapes, opset, ctx):
    kernels = Kernels(ctx, SOURCE)
    epsilon = float(node.attr("epsilon", 1e-5))

    def kernel(x, scale, bias, mean, var):
        fn = kernels["batch_norm_" + require_type(node, x.dtype, FLOAT_TYPES)]
        y = ctx.empty_like(x)
        count, channels, spatial = _layout(x.shape)
        ctx.launch_1d(fn, count, ptr(x), ptr(scale), ptr(bias), ptr(mean), ptr(var), ptr(y), i64(count),
                      i64(channels), i64(spatial), f32(epsilon))
        return (y,)

    return kernel


for _since in (7, 9, 14, 15):  # 7: spatial attribute; 9: per-channel only; 14: training_mode; 15: T1/T2 types
    register("BatchNormalization", since=_since, dtypes=FLOAT_TYPES, check=_batch_norm_check)(batch_norm)


def _lrn_check(node, shapes, dtypes):
    if shapes and shapes[0] is not None and len(shapes[0]) < 3:
        return f"LRN needs X of rank >= 3 (N, C, spatial...), got rank {len(shapes[0])}"
    return None


def lrn(node, shapes, opset, ctx):
    kernels = Kernels(ctx, SOURCE)
    size = int(node.attr("size"))
    alpha, beta, bias = (float(node.attr(name, default)) for name, default in
                         (("alpha", 1e-4), ("beta", 0.75), ("bias", 1.0)))

    def kernel(x):
        fn = kernels["lrn_" + require_type(node, x.dtype, FLOAT_TYPES)]
        y = ctx.empty_like(x)
        count, channels, spatial = _layout(x.shape)
        ctx.launch_1d(fn, count, ptr(x), ptr(y), i64(count), i64(channels), i64(spatial), i32(size), f32(alpha),
                      f32(beta), f32(bias))
        return (y,)

    return kernel


for _since in (1, 13):  # 13 adds bfloat16
    register("LRN", since=_since, dtypes=FLOAT_TYPES, check=_lrn_check)(lrn)
