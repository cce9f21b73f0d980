"""Data-movement operators on kernels/data.cu: Transpose, Concat, Slice, Split, Expand, Tile, Gather,
GatherElements, GatherND, ScatterND, Reshape/Squeeze/Unsqueeze/Flatten, Shape, Range and ConstantOfShape.

Moving data ignores the values, so one kernel per element width serves every dtype of that size. Layout
changes (Reshape, Squeeze, Unsqueeze, Flatten) are device-to-device copies into a tensor of the new shape,
so every output owns its buffer. Shape-like inputs (Reshape's shape, Slice's starts/ends, Expand's shape,
Tile's repeats, Split's sizes, Range's scalars, ConstantOfShape's shape) are declared ``host_inputs``: output
shapes are host metadata, so their values are needed on the host. A constant one is read once, when the
kernel is made; one computed at run time is read back at every call, which waits for the compute stream.

Gather, GatherElements, GatherND and ScatterND clamp an out-of-range index and raise ``validation.INDEX_OUT_OF_RANGE``
in the context's validation flag word instead of touching memory outside the tensor; the session reports it
at the next download.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
from onnx_runtime import DataType, Tensor
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from .context import i32, i64, ptr
from .registry import ALL, FLOATS, register

MOVABLE = ALL | {DataType.UINT16}  # every fixed-width type the CUDA provider stores
MAX_RANK = 8  # the kernels take up to 8 dimensions as scalar arguments
WIDTH = {1: "u8", 2: "u16", 4: "u32", 8: "u64"}
INDEX_TYPES = {DataType.INT32: "i32", DataType.INT64: "i64"}
REDUCE_TYPES = {DataType.FLOAT: "f32", DataType.FLOAT16: "f16", DataType.BFLOAT16: "bf16", DataType.DOUBLE: "f64",
                DataType.INT32: "i32", DataType.INT64: "i64"}
RANGE_TYPES = {DataType.FLOAT: "f32", DataType.DOUBLE: "f64", DataType.INT16: "i16", DataType.INT32: "i32",
               DataType.INT64: "i64", DataType.FLOAT16: "f16", DataType.BFLOAT16: "bf16"}
REDUCTIONS = ("add", "mul", "max", "min")

# -- helpers -----------------------------------------------------------------------------------------


def flags_arg(ctx) -> tuple[int, type]:
    """The current validation flag word as a kernel pointer argument (asked for at every launch: the
    word follows the running submission)."""
    return (ctx.validation_flags(), ctypes.c_void_p)


def contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return strides[::-1]


def coalesce(sizes, strides) -> tuple[list[int], list[int]]:
    """Drop size-1 dimensions and merge neighbours that step through memory as one dimension."""
    out_n: list[int] = []
    out_s: list[int] = []
    for n, s in zip(sizes, strides):
        if n == 1:
            continue
        if out_n and out_s[-1] == s * n:
            out_n[-1] *= n
            out_s[-1] = s
        else:
            out_n.append(n)
            out_s.append(s)
    return out_n, out_s


def dims8(sizes, strides) -> list:
    """The kernels' DIMS8 arguments: sizes then strides, right-aligned in 8 slots."""
    pad = MAX_RANK - len(sizes)
    return [i64(v) for v in [1] * pad + list(sizes)] + [i64(v) for v in [0] * pad + list(strides)]


def _normalize_axis(node, axis: int, rank: int, name: str = "axis") -> int:
    if not -rank <= axis < rank:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): {name} {axis} is out of range for rank {rank}"
        )
    return axis + rank if axis < 0 else axis


class DataKernels:
    """data.cu functions looked up on first use; launches shared by the operators below."""

    def __init__(self, ctx):
        self.ctx = ctx
        self._functions: dict[str, object] = {}

    def function(self, name: str):
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = self.ctx.function("data.cu", name)
        return function

    def copy(self, x: Tensor, shape) -> Tensor:
        """A new tensor of ``shape`` holding ``x``'s bytes (the layout-only operators)."""
        y = self.ctx.empty(x.dtype, shape)
        self.ctx.device.copy_device(y.device_ptr, x.device_ptr, x.nbytes)
        return y

    def strided_copy(self, y: Tensor, src_address: int, strides, sizes=None) -> None:
        """y[idx] = src[sum(idx * strides)] over y's shape (or over ``sizes``, a finer view of y's contiguous
        elements); ``src_address`` is the element at idx 0."""
        if y.numel == 0:
            return
        sizes, steps = coalesce(y.shape if sizes is None else sizes, strides)
        if not sizes or (len(sizes) == 1 and steps[0] == 1):
            self.ctx.device.copy_device(y.device_ptr, src_address, y.nbytes)
            return
        itemsize = y.dtype.numpy.itemsize
        function = self.function(f"strided_copy_{WIDTH[itemsize]}")
        # The kernel takes 8 dimensions; the leading ones beyond that are walked here, one launch per index.
        lead, inner, inner_steps = sizes[:-MAX_RANK], sizes[-MAX_RANK:], steps[-MAX_RANK:]
        count = math.prod(inner)
        args = (i64(count), i32(len(inner)), *dims8(inner, inner_steps))
        for index in np.ndindex(*lead):
            source = sum(i * s for i, s in zip(index, steps))
            target = sum(i * math.prod(sizes[k + 1:]) for k, i in enumerate(index))
            self.ctx.launch_1d(function, count, (y.device_ptr + target * itemsize, ctypes.c_void_p),
                               (src_address + source * itemsize, ctypes.c_void_p), *args)

    def copy_rows(self, dst: int, dst_pitch: int, src: int, src_pitch: int, cols: int, rows: int,
                  itemsize: int) -> None:
        """``rows`` rows of ``cols`` elements between pitched layouts (pitches in elements)."""
        if rows * cols == 0:
            return
        if rows == 1 or (dst_pitch == cols and src_pitch == cols):
            self.ctx.device.copy_device(dst, src, rows * cols * itemsize)
            return
        self.ctx.launch_1d(self.function(f"copy_2d_{WIDTH[itemsize]}"), rows * cols, (dst, ctypes.c_void_p),
                           i64(dst_pitch), (src, ctypes.c_void_p), i64(src_pitch), i64(cols), i64(rows))


def _rank_check(limit_input: int = 0):
    def check(node, shapes, dtypes):
        shape = shapes[limit_input] if len(shapes) > limit_input else None
        if shape is not None and len(shape) > MAX_RANK:
            return (f"CUDAExecutionProvider runs {node.op_type} on tensors of rank {MAX_RANK} or less, input "
                    f"{limit_input} has rank {len(shape)}")
        return None

    return check


# -- layout-only operators: Reshape, Squeeze, Unsqueeze, Flatten -----------------------------------


def reshape_target(node, in_shape: tuple, requested, allowzero: bool) -> tuple[int, ...]:
    requested = list(requested)
    out = []
    for i, d in enumerate(requested):
        if d == 0 and not allowzero:
            if i >= len(in_shape):
                raise InvalidArgumentError(
                    f"node {node.name!r} (Reshape): shape {requested} copies dimension {i} (a 0) but the input "
                    f"{in_shape} has rank {len(in_shape)}"
                )
            d = in_shape[i]
        out.append(d)
    numel = math.prod(in_shape)
    if out.count(-1) > 1 or any(d < -1 for d in out):
        raise InvalidArgumentError(f"node {node.name!r} (Reshape): shape {requested} is not a valid target shape")
    if -1 in out:
        known = math.prod(d for d in out if d != -1)
        if known == 0 or numel % known:
            raise InvalidArgumentError(
                f"node {node.name!r} (Reshape): cannot infer the -1 of {requested} for {numel} elements"
            )
        out[out.index(-1)] = numel // known
    if math.prod(out) != numel:
        raise InvalidArgumentError(
            f"node {node.name!r} (Reshape): the input {in_shape} has {numel} elements, shape {requested} "
            f"needs {math.prod(out)}"
        )
    return tuple(out)


@register("Reshape", since=5, dtypes=MOVABLE, host_inputs=(1,))
def reshape(node, shapes, opset, ctx, host):
    kernels = DataKernels(ctx)
    allowzero = opset >= 14 and bool(node.attr("allowzero", 0))
    targets: dict[tuple, tuple[int, ...]] = {}

    def kernel(x, shape):
        key = (x.shape, host.ints(1, shape))
        target = targets.get(key)
        if target is None:
            target = targets[key] = reshape_target(node, x.shape, key[1], allowzero)
        return (kernels.copy(x, target),)

    return kernel


def _squeezed(node, shape: tuple, axes: list[int] | None) -> tuple[int, ...]:
    if axes is None:
        return tuple(d for d in shape if d != 1)
    axes = {_normalize_axis(node, a, len(shape), "axes entry") for a in axes}
    for a in axes:
        if shape[a] != 1:
            raise InvalidArgumentError(
                f"node {node.name!r} (Squeeze): dimension {a} of {shape} has size {shape[a]}, only size-1 "
                f"dimensions can be squeezed"
            )
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _unsqueezed(node, shape: tuple, axes) -> tuple[int, ...]:
    axes = list(axes)
    rank = len(shape) + len(axes)
    normalized = sorted(_normalize_axis(node, a, rank, "axes entry") for a in axes)
    if len(set(normalized)) != len(normalized):
        raise InvalidArgumentError(f"node {node.name!r} (Unsqueeze): axes {axes} repeat an axis")
    out, rest = [], iter(shape)
    for i in range(rank):
        out.append(1 if i in normalized else next(rest))
    return tuple(out)


@register("Squeeze", since=1, dtypes=MOVABLE, host_inputs=(1,))
def squeeze(node, shapes, opset, ctx, host):
    kernels = DataKernels(ctx)
    attr_axes = node.attr("axes")

    def kernel(x, axes=None):
        requested = host.ints(1, axes) if opset >= 13 else (list(attr_axes) if attr_axes is not None else None)
        return (kernels.copy(x, _squeezed(node, x.shape, requested)),)

    return kernel


@register("Unsqueeze", since=1, dtypes=MOVABLE, host_inputs=(1,))
def unsqueeze(node, shapes, opset, ctx, host):
    kernels = DataKernels(ctx)
    attr_axes = node.attr("axes")
    if opset < 13 and attr_axes is None:
        raise InvalidGraphError(f"node {node.name!r} (Unsqueeze): attribute 'axes' is required before opset 13")

    def kernel(x, axes=None):
        requested = host.ints(1, axes) if opset >= 13 else list(attr_axes)
        if requested is None:
            raise InvalidArgumentError(f"node {node.name!r} (Unsqueeze): the axes input is required")
        return (kernels.copy(x, _unsqueezed(node, x.shape, requested)),)

    return kernel


@register("Flatten", since=1, dtypes=MOVABLE)
def flatten(node, shapes, opset, ctx):
    kernels = DataKernels(ctx)
    axis = int(node.attr("axis", 1))

    def kernel(x):
        rank = len(x.shape)
        at = axis + rank if axis < 0 else axis
        if not 0 <= at <= rank:
            raise InvalidArgumentError(f"node {node.name!r} (Flatten): axis {axis} is out of range for rank {rank}")
        return (kernels.copy(x, (math.prod(x.shape[:at]), math.prod(x.shape[at:]))),)

    return kernel


# -- Transpose, Expand, Slice --------------------------------------------------------------------------


@register("Transpose", since=1, dtypes=MOVABLE, check=_rank_check())
def transpose(node, shapes, opset, ctx):
    kernels = DataKernels(ctx)
    perm_attr = node.attr("perm")

    def kernel(x):
        rank = len(x.shape)
        perm = list(range(rank))[::-1] if perm_attr is None else [int(p) for p in perm_attr]
        if sorted(perm) != list(range(rank)):
            raise InvalidArgumentError(
                f"node {node.name!r} (Transpose): perm {perm} is not a permutation of the {rank} input axes"
            )
        strides = contiguous_strides(x.shape)
        y = ctx.empty(x.dtype, tuple(x.shape[p] for p in perm))
        kernels.strided_copy(y, x.device_ptr, [strides[p] for p in perm])
        return (y,)

    return kernel


@register("Expand", since=8, dtypes=MOVABLE, host_inputs=(1,))
def expand(node, shapes, opset, ctx, host):
    kernels = DataKernels(ctx)

    def kernel(x, shape):
        requested = list(host.ints(1, shape))
        try:
            out_shape = tuple(np.broadcast_shapes(tuple(x.shape), tuple(requested)))
        except ValueError:
            raise InvalidArgumentError(
                f"node {node.name!r} (Expand): input {x.shape} does not broadcast with shape {requested}"
            ) from None
        pad = len(out_shape) - len(x.shape)
        strides = [0] * pad + [0 if d == 1 else s for d, s in zip(x.shape, contiguous_strides(x.shape))]
        y = ctx.empty(x.dtype, out_shape)
        kernels.strided_copy(y, x.device_ptr, strides)
        return (y,)

    return kernel


@register("Tile", since=6, dtypes=MOVABLE, check=_rank_check(), host_inputs=(1,))
def tile(node, shapes, opset, ctx, host):
    kernels = DataKernels(ctx)

    def kernel(x, repeats):
        counts = host.ints(1, repeats)
        if len(counts) != len(x.shape) or any(r < 0 for r in counts):
            raise InvalidArgumentError(
                f"node {node.name!r} (Tile): repeats {list(counts)} must hold one non-negative count per dimension "
                f"of the input {x.shape}"
            )
        y = ctx.empty(x.dtype, tuple(d * r for d, r in zip(x.shape, counts)))
        # Viewed as (r0, d0, r1, d1, ...), the output reads the input at (d0, d1, ...): the repeat indices step
        # through nothing, so the copy is one strided copy with stride 0 for them.
        sizes, strides = [], []
        for dim, count, stride in zip(x.shape, counts, contiguous_strides(x.shape)):
            sizes += [count, dim]
            strides += [0, stride]
        kernels.strided_copy(y, x.device_ptr, strides, sizes)
        return (y,)

    return kernel


def slice_ranges(node, shape: tuple, starts, ends, axes, steps) -> tuple[list[int], list[int], list[int]]:
    """Per dimension of ``shape``: (first index, count, step) after ONNX's clamping rules."""
    rank = len(shape)
    if axes is None:
        axes = list(range(len(starts)))
    if steps is None:
        steps = [1] * len(starts)
    if not len(starts) == len(ends) == len(axes) == len(steps):
        raise InvalidArgumentError(
            f"node {node.name!r} (Slice): starts, ends, axes and steps have different lengths "
            f"({len(starts)}, {len(ends)}, {len(axes)}, {len(steps)})"
        )
    first, count, step_of = [0] * rank, list(shape), [1] * rank
    seen = set()
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = _normalize_axis(node, axis, rank, "axes entry")
        if axis in seen:
            raise InvalidArgumentError(f"node {node.name!r} (Slice): axis {axis} is sliced twice")
        seen.add(axis)
        if step == 0:
            raise InvalidArgumentError(f"node {node.name!r} (Slice): steps must be non-zero")
        dim = shape[axis]
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        first[axis], count[axis], step_of[axis] = start, max(0, -(-(end - start) // step)), step
    return first, count, step_of


def _slice_kernel(node, ctx, read_args):
    kernels = DataKernels(ctx)

    def kernel(x, *args):
        first, count, steps = slice_ranges(node, x.shape, *read_args(args))
        strides = contiguous_strides(x.shape)
        y = ctx.empty(x.dtype, count)
        if y.numel:
            offset = sum(f * s for f, s in zip(first, strides)) * x.dtype.numpy.itemsize
            kernels.strided_copy(y, x.device_ptr + offset, [st * s for st, s in zip(steps, strides)])
        return (y,)

    return kernel


@register("Slice", since=1, dtypes=MOVABLE, check=_rank_check())
def slice_1(node, shapes, opset, ctx):
    starts, ends, axes = (node.attr(name) for name in ("starts", "ends", "axes"))
    if starts is None or ends is None:
        raise InvalidGraphError(f"node {node.name!r} (Slice): attributes 'starts' and 'ends' are required")
    values = (list(starts), list(ends), list(axes) if axes is not None else None, None)
    return _slice_kernel(node, ctx, lambda args: values)


@register("Slice", since=10, dtypes=MOVABLE, check=_rank_check(), host_inputs=(1, 2, 3, 4))
def slice_10(node, shapes, opset, ctx, host):
    def read(args):
        tensors = (list(args) + [None] * 4)[:4]
        return tuple(host.ints(position, tensor) for position, tensor in enumerate(tensors, start=1))

    return _slice_kernel(node, ctx, read)


# -- Concat and Split ---------------------------------------------------------------------------------


@register("Concat", since=1, dtypes=MOVABLE)
def concat(node, shapes, opset, ctx):
    kernels = DataKernels(ctx)
    axis_attr = node.attr("axis", 1 if opset < 4 else None)
    if axis_attr is None:
        raise InvalidGraphError(f"node {node.name!r} (Concat): attribute 'axis' is required")

    def kernel(*inputs):
        first = inputs[0]
        rank = len(first.shape)
        axis = _normalize_axis(node, int(axis_attr), rank)
        for x in inputs[1:]:
            if len(x.shape) != rank or x.shape[:axis] != first.shape[:axis] or x.shape[axis + 1:] != \
                    first.shape[axis + 1:] or x.dtype != first.dtype:
                raise InvalidArgumentError(
                    f"node {node.name!r} (Concat): input shapes {[t.shape for t in inputs]} differ outside axis "
                    f"{axis}"
                )
        total = sum(x.shape[axis] for x in inputs)
        y = ctx.empty(first.dtype, (*first.shape[:axis], total, *first.shape[axis + 1:]))
        outer, inner = math.prod(first.shape[:axis]), math.prod(first.shape[axis + 1:])
        itemsize = first.dtype.numpy.itemsize
        at = 0
        for x in inputs:
            cols = x.shape[axis] * inner
            kernels.copy_rows(y.device_ptr + at * itemsize, total * inner, x.device_ptr, cols, cols, outer,
                              itemsize)
            at += cols
        return (y,)

    return kernel


def split_sizes(node, dim: int, outputs: int, split, num_outputs: int | None) -> list[int]:
    if split is not None:
        split = list(split)
        if len(split) != outputs or sum(split) != dim or any(s < 0 for s in split):
            raise InvalidArgumentError(
                f"node {node.name!r} (Split): split {split} must have {outputs} non-negative sizes summing to {dim}"
            )
        return list(split)
    if num_outputs is not None:  # opset 18: equal chunks, the last one smaller
        chunk = -(-dim // num_outputs)
        return [min(chunk, max(0, dim - i * chunk)) for i in range(num_outputs)]
    if dim % outputs:
        raise InvalidArgumentError(
            f"node {node.name!r} (Split): dimension {dim} does not split evenly into {outputs} outputs; give split"
        )
    return [dim // outputs] * outputs


@register("Split", since=1, dtypes=MOVABLE, host_inputs=(1,))
def split(node, shapes, opset, ctx, host):
    kernels = DataKernels(ctx)
    axis_attr = int(node.attr("axis", 0))
    split_attr = node.attr("split")
    num_outputs = node.attr("num_outputs") if opset >= 18 else None
    if num_outputs is not None and int(num_outputs) != len(node.outputs):
        raise InvalidGraphError(
            f"node {node.name!r} (Split): attribute 'num_outputs' is {num_outputs} but the node has "
            f"{len(node.outputs)} outputs"
        )

    def kernel(x, split_input=None):
        axis = _normalize_axis(node, axis_attr, len(x.shape))
        requested = host.ints(1, split_input) if split_input is not None else (
            [int(s) for s in split_attr] if split_attr is not None and opset < 13 else None)
        sizes = split_sizes(node, x.shape[axis], len(node.outputs), requested,
                            int(num_outputs) if num_outputs is not None and requested is None else None)
        outer, inner = math.prod(x.shape[:axis]), math.prod(x.shape[axis + 1:])
        itemsize = x.dtype.numpy.itemsize
        results, at = [], 0
        for size in sizes:
            y = ctx.empty(x.dtype, (*x.shape[:axis], size, *x.shape[axis + 1:]))
            kernels.copy_rows(y.device_ptr, size * inner, x.device_ptr + at * itemsize, x.shape[axis] * inner,
                              size * inner, outer, itemsize)
            results.append(y)
            at += size * inner
        return tuple(results)

    return kernel


# -- Gather, GatherElements, ScatterND ----------------------------------------------------------------


def _index_check(position: int, name: str):
    def check(node, shapes, dtypes):
        reason = _rank_check()(node, shapes, dtypes)
        if reason:
            return reason
        index_type = dtypes[position] if len(dtypes) > position else None
        if index_type is not None and index_type not in INDEX_TYPES:
            return f"{node.op_type} {name} must be int32 or int64, got {index_type.name.lower()}"
        return None

    return check


@register("Gather", since=1, dtypes=MOVABLE, check=_index_check(1, "indices"))
def gather(node, shapes, opset, ctx):
    kernels = DataKernels(ctx)
    axis_attr = int(node.attr("axis", 0))

    def kernel(data, indices):
        axis = _normalize_axis(node, axis_attr, len(data.shape))
        out_shape = (*data.shape[:axis], *indices.shape, *data.shape[axis + 1:])
        y = ctx.empty(data.dtype, out_shape)
        if y.numel:
            name = f"gather_{WIDTH[data.dtype.numpy.itemsize]}_{INDEX_TYPES[indices.dtype]}"
            ctx.launch_1d(kernels.function(name), y.numel, ptr(y), ptr(data), ptr(indices), i64(y.numel),
                          i64(math.prod(data.shape[axis + 1:])), i64(indices.numel), i64(data.shape[axis]),
                          flags_arg(ctx))
        return (y,)

    return kernel


@register("GatherElements", since=11, dtypes=MOVABLE, check=_index_check(1, "indices"))
def gather_elements(node, shapes, opset, ctx):
    kernels = DataKernels(ctx)
    axis_attr = int(node.attr("axis", 0))

    def kernel(data, indices):
        rank = len(data.shape)
        axis = _normalize_axis(node, axis_attr, rank)
        if len(indices.shape) != rank or any(i > d for k, (i, d) in enumerate(zip(indices.shape, data.shape))
                                             if k != axis):
            raise InvalidArgumentError(
                f"node {node.name!r} (GatherElements): indices {indices.shape} must have the data's rank and no "
                f"larger dimension than data {data.shape} outside axis {axis}"
            )
        y = ctx.empty(data.dtype, indices.shape)
        if y.numel:
            name = f"gather_elements_{WIDTH[data.dtype.numpy.itemsize]}_{INDEX_TYPES[indices.dtype]}"
            ctx.launch_1d(kernels.function(name), y.numel, ptr(y), ptr(data), ptr(indices), i64(y.numel),
                          i32(rank), i32(MAX_RANK - rank + axis), i64(data.shape[axis]),
                          *dims8(indices.shape, contiguous_strides(data.shape)), flags_arg(ctx))
        return (y,)

    return kernel


def _gather_nd_check(node, shapes, dtypes):
    reason = _rank_check()(node, shapes, dtypes)
    if reason:
        return reason
    if dtypes and len(dtypes) > 1 and dtypes[1] is not None and dtypes[1] != DataType.INT64:
        return f"GatherND indices must be int64, got {dtypes[1].name.lower()}"
    return None


@register("GatherND", since=11, dtypes=MOVABLE, check=_gather_nd_check)
def gather_nd(node, shapes, opset, ctx):
    kernels = DataKernels(ctx)
    batch_dims = int(node.attr("batch_dims", 0))

    def kernel(data, indices):
        rank, b = len(data.shape), batch_dims
        k = indices.shape[-1] if indices.shape else 0
        if not 0 <= b < min(rank, len(indices.shape)) or not 1 <= k <= rank - b \
                or tuple(indices.shape[:b]) != tuple(data.shape[:b]):
            raise InvalidArgumentError(
                f"node {node.name!r} (GatherND): indices {list(indices.shape)} must end in a tuple length between 1 "
                f"and the data's rank less batch_dims={b} ({rank - b}), and lead with the data's batch dimensions "
                f"{list(data.shape[:b])}; data is {list(data.shape)}"
            )
        y = ctx.empty(data.dtype, (*indices.shape[:-1], *data.shape[b + k:]))
        if not y.numel:
            return (y,)
        if 0 in data.shape[b: b + k]:  # every index is out of range of an empty axis: nothing to clamp to
            raise InvalidArgumentError(
                f"node {node.name!r} (GatherND): indices address axes of size 0 of data {list(data.shape)}; no "
                f"index is in range"
            )
        strides = contiguous_strides(data.shape)
        ctx.launch_1d(kernels.function(f"gather_nd_{WIDTH[data.dtype.numpy.itemsize]}"), y.numel, ptr(y),
                      ptr(data), ptr(indices), i64(y.numel), i64(math.prod(data.shape[b + k:])), i32(k),
                      i64(math.prod(indices.shape[b:-1])), i64(math.prod(data.shape[b:])),
                      *dims8(data.shape[b: b + k], strides[b: b + k]), flags_arg(ctx))
        return (y,)

    return kernel


def _scatter_check(node, shapes, dtypes):
    reason = _rank_check()(node, shapes, dtypes)
    if reason:
        return reason
    if dtypes and len(dtypes) > 1 and dtypes[1] is not None and dtypes[1] != DataType.INT64:
        return f"ScatterND indices must be int64, got {dtypes[1].name.lower()}"
    reduction = node.attr("reduction", "none") or "none"
    if reduction != "none":
        if reduction not in REDUCTIONS:
            return f"ScatterND reduction {reduction!r} is not one of none, add, mul, max, min"
        if dtypes and dtypes[0] is not None and dtypes[0] not in REDUCE_TYPES:
            accepted = ", ".join(sorted(d.name.lower() for d in REDUCE_TYPES))
            return f"CUDAExecutionProvider runs ScatterND reduction={reduction} on {accepted}, not " \
                   f"{dtypes[0].name.lower()}"
    return None


@register("ScatterND", since=11, dtypes=MOVABLE, check=_scatter_check)
def scatter_nd(node, shapes, opset, ctx):
    kernels = DataKernels(ctx)
    reduction = node.attr("reduction", "none") or "none"

    def kernel(data, indices, updates):
        rank = len(data.shape)
        k = indices.shape[-1] if indices.shape else 0
        if not indices.shape or not 1 <= k <= rank:
            raise InvalidArgumentError(
                f"node {node.name!r} (ScatterND): indices {indices.shape} must end in a tuple length between 1 and "
                f"the data's rank {rank}"
            )
        expected = (*indices.shape[:-1], *data.shape[k:])
        if tuple(updates.shape) != expected or updates.dtype != data.dtype:
            raise InvalidArgumentError(
                f"node {node.name!r} (ScatterND): updates {updates.shape} must have shape {expected} and the data's "
                f"type"
            )
        y = kernels.copy(data, data.shape)
        slice_size, tuples = math.prod(data.shape[k:]), math.prod(indices.shape[:-1])
        dims = dims8(data.shape[:k], contiguous_strides(data.shape)[:k])
        if updates.numel == 0:
            return (y,)
        if reduction == "none":
            function = kernels.function(f"scatter_nd_{WIDTH[data.dtype.numpy.itemsize]}")
            ctx.launch_1d(function, updates.numel, ptr(y), ptr(updates), ptr(indices), i64(updates.numel),
                          i64(slice_size), i32(k), *dims, flags_arg(ctx))
        else:
            function = kernels.function(f"scatter_nd_{reduction}_{REDUCE_TYPES[data.dtype]}")
            ctx.launch_1d(function, slice_size, ptr(y), ptr(updates), ptr(indices), i64(tuples), i64(slice_size),
                          i32(k), *dims, flags_arg(ctx))
        return (y,)

    return kernel


# -- Shape, ConstantOfShape, Range ---------------------------------------------------------------------


@register("Shape", since=1, dtypes=MOVABLE)
def shape(node, shapes, opset, ctx):
    start_attr = int(node.attr("start", 0)) if opset >= 15 else 0
    end_attr = node.attr("end") if opset >= 15 else None
    constants: dict[tuple, Tensor] = {}  # uploaded once per input shape; every run copies from it

    def kernel(x):
        rank = len(x.shape)
        start = min(max(start_attr + rank if start_attr < 0 else start_attr, 0), rank)
        end = rank if end_attr is None else int(end_attr)
        end = min(max(end + rank if end < 0 else end, 0), rank)
        dims = tuple(x.shape[start:end]) if end > start else ()
        source = constants.get(dims)
        if source is None:
            source = constants[dims] = Tensor.from_numpy(np.array(dims, dtype=np.int64), provider=ctx.handle)
        y = ctx.empty(DataType.INT64, (len(dims),))
        ctx.device.copy_device(y.device_ptr, source.device_ptr, y.nbytes)
        return (y,)

    return kernel


def _constant_of_shape_check(node, shapes, dtypes):
    value = node.attr("value")
    if value is not None and DataType.from_numpy(np.asarray(value).dtype) not in MOVABLE:
        return f"ConstantOfShape value type {np.asarray(value).dtype} is not stored by CUDAExecutionProvider"
    return None


@register("ConstantOfShape", since=9, dtypes={DataType.INT64}, check=_constant_of_shape_check, host_inputs=(0,))
def constant_of_shape(node, shapes, opset, ctx, host):
    kernels = DataKernels(ctx)
    value = np.zeros(1, np.float32) if node.attr("value") is None else np.asarray(node.attr("value"))
    if value.size != 1:
        raise InvalidGraphError(
            f"node {node.name!r} (ConstantOfShape): attribute 'value' has {value.size} elements; expected one"
        )
    dtype = DataType.from_numpy(value.dtype)
    if dtype not in MOVABLE:
        raise InvalidGraphError(f"node {node.name!r} (ConstantOfShape): value type {dtype.name.lower()} is not "
                                f"supported by CUDAExecutionProvider")
    itemsize = value.dtype.itemsize
    bits = int(value.reshape(-1)[:1].view(np.dtype(f"u{itemsize}"))[0])

    def kernel(shape):
        dims = list(host.ints(0, shape))
        if any(d < 0 for d in dims):
            raise InvalidArgumentError(f"node {node.name!r} (ConstantOfShape): shape {dims} has a negative size")
        y = ctx.empty(dtype, dims)
        ctx.launch_1d(kernels.function(f"fill_{WIDTH[itemsize]}"), y.numel, ptr(y),
                      (bits, ctypes.c_uint64), i64(y.numel))
        return (y,)

    return kernel


def _range_kernel(node, ctx, host, stash: bool):
    kernels = DataKernels(ctx)

    def kernel(start, limit, delta):
        dtype = start.dtype
        narrow = dtype in (DataType.FLOAT16, DataType.BFLOAT16)
        compute = np.float32 if narrow and stash else dtype.numpy
        values = [np.asarray(host.array(position, tensor)).reshape(-1)[0].astype(compute)
                  for position, tensor in enumerate((start, limit, delta))]
        first, last, step = values
        if step == 0:
            raise InvalidArgumentError(f"node {node.name!r} (Range): delta must be non-zero")
        if np.dtype(compute).kind in "iu":
            count = -((int(first) - int(last)) // int(step))
        else:
            count = math.ceil(float(np.asarray((last - first) / step, dtype=compute)))
        y = ctx.empty(dtype, (max(count, 0),))
        name = f"range_{'narrow_' if narrow and not stash else ''}{RANGE_TYPES[dtype]}"
        kind = ctypes.c_int64 if np.dtype(compute).kind in "iu" else \
            (ctypes.c_double if dtype == DataType.DOUBLE else ctypes.c_float)
        cast = int if kind is ctypes.c_int64 else float
        ctx.launch_1d(kernels.function(name), y.numel, ptr(y), i64(y.numel), (cast(first), kind), (cast(step), kind))
        return (y,)

    return kernel


@register("Range", since=11, dtypes=(frozenset(RANGE_TYPES) - FLOATS) | {DataType.FLOAT}, host_inputs=(0, 1, 2))
def range_11(node, shapes, opset, ctx, host):
    return _range_kernel(node, ctx, host, stash=True)


@register("Range", since=27, dtypes=frozenset(RANGE_TYPES), host_inputs=(0, 1, 2))
def range_27(node, shapes, opset, ctx, host):
    return _range_kernel(node, ctx, host, stash=bool(node.attr("stash_type", 1)))

