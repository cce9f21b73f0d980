"""Softmax, LogSoftmax, LayerNormalization and RMSNormalization on the device (kernels/softmax.cu).

Softmax-13+ works along any axis as an (outer, n, inner) view; before opset 13 the input is coerced to
2-D at the axis, so the "row" is everything from the axis on. The normalizations work on the trailing
dims from ``axis`` as rows of n elements, one block per row; float16/bfloat16 compute in float32, which
is also the only stash_type implemented (the default). Rows of up to ROW_CACHE * THREADS (8,192)
elements are read once into registers; longer ones are streamed once per pass.
"""

from __future__ import annotations

import math

from onnx_runtime import DataType
from onnx_runtime.errors import InvalidArgumentError

from .context import MAX_GRID, f32, i32, i64, ptr
from .elementwise import FLOAT_TYPES, NULL, Kernels, memo, normalize_axis, require_type
from .reduce import block_shape
from .registry import register

SOURCE = "softmax.cu"
THREADS = 512  # NORM_THREADS in softmax.cu
ROW_CACHE = 16  # ROW_CACHE in softmax.cu: values per thread of a row held in registers


def row_block(n: int) -> tuple[int, int]:
    """Block of one-row-per-block kernels: enough threads to hold the row in registers (whole warps, at most
    THREADS); a longer row is streamed by THREADS threads."""
    return 1, min(THREADS, max(32, 1 << max(-(-n // ROW_CACHE) - 1, 0).bit_length()))


def _softmax_factory(log: bool, coerce_2d: bool):
    def factory(node, shapes, opset, ctx):
        kernels = Kernels(ctx, SOURCE)
        axis = int(node.attr("axis", 1 if coerce_2d else -1))

        @memo
        def plan(shape):
            a = normalize_axis(node, axis, len(shape))
            outer, n, inner = math.prod(shape[:a]), shape[a], math.prod(shape[a + 1:])
            if coerce_2d:
                n, inner = n * inner, 1
            block = row_block(n) if inner == 1 else block_shape(inner, n, THREADS)
            return outer, n, inner, block, min(outer * -(-inner // block[0]), MAX_GRID)

        def kernel(x):
            fn = kernels["softmax_" + require_type(node, x.dtype, FLOAT_TYPES)]
            y = ctx.empty_like(x)
            if x.numel:
                outer, n, inner, block, grid = plan(x.shape)
                ctx.launch(fn, grid, block, ptr(x), ptr(y), i64(outer), i64(n), i64(inner), i32(log))
            return (y,)

        return kernel

    return factory


register("Softmax", since=1, dtypes=FLOAT_TYPES)(_softmax_factory(log=False, coerce_2d=True))
register("Softmax", since=13, dtypes=FLOAT_TYPES)(_softmax_factory(log=False, coerce_2d=False))
register("LogSoftmax", since=1, dtypes=FLOAT_TYPES)(_softmax_factory(log=True, coerce_2d=True))
register("LogSoftmax", since=13, dtypes=FLOAT_TYPES)(_softmax_factory(log=True, coerce_2d=False))


# -- LayerNormalization / RMSNormalization -----------------------------------------------------------------


def _param_step(node, what: str, param_shape, normalized) -> int:
    """1 when the parameter holds one value per normalized element, 0 for a single value."""
    n = math.prod(normalized)
    if math.prod(param_shape) == 1:
        return 0
    significant = tuple(d for d in param_shape if d != 1)
    if math.prod(param_shape) == n and significant == tuple(d for d in normalized if d != 1):
        return 1
    raise InvalidArgumentError(
        f"node {node.name!r} ({node.op_type}): {what} of shape {list(param_shape)} does not match the normalized "
        f"shape {list(normalized)}; the CUDA kernel takes one value per normalized element or a single value"
    )


def _norm_check(node, shapes, dtypes):
    stash_type = int(node.attr("stash_type", 1))
    if stash_type != DataType.FLOAT:
        return f"CUDAExecutionProvider normalizes with stash_type=1 (float32), not {stash_type}"
    if any(d is not None and d != dtypes[0] for d in dtypes[1:]):
        return (f"CUDAExecutionProvider runs {node.op_type} with X, scale and bias of one type, got "
                f"{[d.name.lower() if d is not None else None for d in dtypes]}")
    x = shapes[0] if shapes else None
    if x is not None and all(isinstance(d, int) for d in x):
        try:
            normalized = x[normalize_axis(node, int(node.attr("axis", -1)), len(x)):]
        except InvalidArgumentError as exc:
            return str(exc)
        for what, shape in zip(("scale", "bias"), shapes[1:]):
            if shape is not None and all(isinstance(d, int) for d in shape):
                try:
                    _param_step(node, what, shape, normalized)
                except InvalidArgumentError as exc:
                    return str(exc)
    return None


def _norm_factory(rms: bool):
    def factory(node, shapes, opset, ctx):
        kernels = Kernels(ctx, SOURCE)
        axis, epsilon = int(node.attr("axis", -1)), float(node.attr("epsilon", 1e-5))
        wants = [i < len(node.outputs) and bool(node.outputs[i]) for i in range(3)]

        @memo
        def plan(x_shape, scale_shape, bias_shape):
            a = normalize_axis(node, axis, len(x_shape))
            normalized = x_shape[a:]
            steps = (_param_step(node, "scale", scale_shape, normalized),
                     0 if bias_shape is None else _param_step(node, "bias", bias_shape, normalized))
            rows, n = math.prod(x_shape[:a]), math.prod(normalized)
            stats_shape = x_shape[:a] + (1,) * len(normalized)
            return rows, n, steps, stats_shape, min(rows, MAX_GRID), row_block(n)

        def kernel(x, scale, bias=None):
            fn = kernels["normalize_" + require_type(node, x.dtype, FLOAT_TYPES)]
            if scale.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
                raise InvalidArgumentError(f"node {node.name!r} ({node.op_type}): X, scale and bias need one type")
            rows, n, (scale_step, bias_step), stats_shape, grid, block = plan(
                x.shape, scale.shape, None if bias is None else bias.shape)
            y = ctx.empty_like(x)
            stats = [ctx.empty(DataType.FLOAT, stats_shape) if wanted else None for wanted in wants[1:]]
            if rows:
                ctx.launch(fn, grid, block, ptr(x), ptr(scale), NULL if bias is None else ptr(bias), ptr(y),
                           *(NULL if s is None else ptr(s) for s in stats), i64(rows), i64(n), i64(scale_step),
                           i64(bias_step), f32(epsilon), i32(rms))
            return (y, *stats)[:len(node.outputs)]  # None for an output the node does not use

        return kernel

    return factory


register("LayerNormalization", since=17, dtypes=FLOAT_TYPES, check=_norm_check)(_norm_factory(rms=False))
register("RMSNormalization", since=23, dtypes=FLOAT_TYPES, check=_norm_check)(_norm_factory(rms=True))
