"""Reductions on the device (kernels/reduce.cu): the Reduce* family and ArgMax/ArgMin.

Any set of axes works. After dropping size-1 dims and merging neighbours, the input is a sequence of
kept and reduced dim groups; each reduced group is one kernel pass over an (outer, extent, inner) view,
its partials kept in float (narrow floats) or the input type (integers) between passes. A pass with too
few output columns to fill the GPU splits its extent over blockIdx.y and adds a pass over the partials.

Axes come from an attribute until opset 13 (ReduceSum) or 18 (the rest), then from an optional input, a
declared host input: a constant one is read when the kernel is made, one computed at run time is read
back at every call (a small download, so such a node syncs the stream once per run).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx_runtime import DataType
from onnx_runtime.errors import InvalidArgumentError

from .context import MAX_GRID, f32, i32, i64, ptr
from .elementwise import FLOAT_TYPES, SUFFIX, Kernels, memo, normalize_axis, require_type
from .registry import register

SOURCE = "reduce.cu"
THREADS = 256  # REDUCE_THREADS in reduce.cu
# Split a pass's extent over blockIdx.y while it has fewer tiles than this, in chunks of at least MIN_CHUNK.
TARGET_BLOCKS = 1024
MIN_CHUNK = 1024

COMBINES = ("sum", "prod", "max", "min", "log_sum_exp")  # enum Combine in reduce.cu
PRE_NONE, PRE_ABS, PRE_SQUARE = 0, 1, 2
POST_NONE, POST_DIVIDE, POST_SQRT, POST_LOG = 0, 1, 2, 3

INT_TYPES = frozenset({DataType.INT32, DataType.INT64})
SUM_TYPES = FLOAT_TYPES | INT_TYPES
MAX_MIN_TYPES = SUM_TYPES | {DataType.UINT8, DataType.INT8, DataType.BOOL}
ARG_TYPES = SUM_TYPES | {DataType.UINT8, DataType.INT8}

# op_type: (combine, pre, post, first opset with axes as an input, accepted types)
_REDUCERS = {
    "ReduceSum": ("sum", PRE_NONE, POST_NONE, 13, SUM_TYPES),
    "ReduceMean": ("sum", PRE_NONE, POST_DIVIDE, 18, FLOAT_TYPES),
    "ReduceProd": ("prod", PRE_NONE, POST_NONE, 18, SUM_TYPES),
    "ReduceMax": ("max", PRE_NONE, POST_NONE, 18, MAX_MIN_TYPES),
    "ReduceMin": ("min", PRE_NONE, POST_NONE, 18, MAX_MIN_TYPES),
    "ReduceL1": ("sum", PRE_ABS, POST_NONE, 18, SUM_TYPES),
    "ReduceL2": ("sum", PRE_SQUARE, POST_SQRT, 18, FLOAT_TYPES),
    "ReduceSumSquare": ("sum", PRE_SQUARE, POST_NONE, 18, SUM_TYPES),
    "ReduceLogSum": ("sum", PRE_NONE, POST_LOG, 18, FLOAT_TYPES),
    "ReduceLogSumExp": ("log_sum_exp", PRE_NONE, POST_NONE, 18, FLOAT_TYPES),
}


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def block_shape(inner: int, extent: int, threads: int = THREADS) -> tuple[int, int]:
    """(blockDim.x, blockDim.y) for reduce.cuh's column tiles: up to 32 inner columns per block, up to
    ``threads`` in all, enough rows of y for the extent, and always whole warps."""
    tx = 1 if inner <= 1 else min(32, _pow2_at_least(inner))
    ty = max(32 // tx, min(threads // tx, _pow2_at_least(extent)))
    return tx, ty


@dataclass(frozen=True)
class Launch:
    """One kernel pass over an (outer, extent, inner) view, ``splits`` chunks of ``chunk`` along the extent
    (blockIdx.y). It reads the input (source None) or temporary ``source`` and writes the output (target
    None) or temporary ``target``; temporaries hold float partials for float inputs, else the input type."""

    source: int | None
    target: int | None
    outer: int
    extent: int
    inner: int
    chunk: int
    splits: int
    pre: int
    post: int
    grid: int
    block: tuple[int, int]


@dataclass(frozen=True)
class Plan:
    out_shape: tuple[int, ...]
    launches: tuple[Launch, ...]
    temps: tuple[int, ...]  # element counts of the temporaries
    count: int  # how many input elements each output reduces (Mean's divisor)


def reduction_plan(shape, axes, keepdims: bool, pre: int, post: int) -> Plan:
    """The passes reducing a contiguous ``shape`` over ``axes`` (normalized, no duplicates)."""
    reduced = set(axes)
    out_shape = tuple(1 if k in reduced else d for k, d in enumerate(shape)) if keepdims else \
        tuple(d for k, d in enumerate(shape) if k not in reduced)
    count = math.prod(shape[k] for k in reduced)
    if math.prod(out_shape) == 0:
        return Plan(out_shape, (), (), count)
    sizes: list[int] = []  # dim groups: size-1 dims dropped, neighbours of one kind (reduced or kept) merged
    kinds: list[bool] = []
    for k, size in enumerate(shape):
        if size == 1:
            continue
        if kinds and kinds[-1] == (k in reduced):
            sizes[-1] *= size
        else:
            sizes.append(size)
            kinds.append(k in reduced)
    views = []  # (outer, extent, inner) of each pass; a reduced group is size 1 for the passes after it
    for j, is_reduced in enumerate(kinds):
        if is_reduced:
            views.append((math.prod(sizes[:j]), sizes[j], math.prod(sizes[j + 1:])))
            sizes[j] = 1
    if not views:  # nothing to combine (size-1 or no axes): each element is reduced alone, pre and post apply
        views = [(math.prod(shape), 1, 1)]
    launches: list[Launch] = []
    temps: list[int] = []
    source = None
    for index, (outer, extent, inner) in enumerate(views):
        # Too few tiles to fill the GPU: split the extent over blockIdx.y, then reduce the partials.
        tiles = outer * -(-inner // block_shape(inner, extent)[0])
        splits = 1
        if tiles < TARGET_BLOCKS and extent >= 2 * MIN_CHUNK:
            splits = min(-(-extent // MIN_CHUNK), max(1, TARGET_BLOCKS // tiles), 65535)
        chunk = -(-extent // splits)
        splits = -(-extent // chunk) if extent else 1
        passes = [(extent, chunk, splits)] + ([(splits, splits, 1)] if splits > 1 else [])
        for number, (pass_extent, pass_chunk, pass_splits) in enumerate(passes):
            final = index == len(views) - 1 and number == len(passes) - 1
            target = None if final else len(temps)
            if not final:
                temps.append(outer * pass_splits * inner)
            block = block_shape(inner, pass_chunk)
            grid = min(outer * -(-inner // block[0]), MAX_GRID)
            launches.append(Launch(source, target, outer, pass_extent, inner, pass_chunk, pass_splits,
                                   pre if index == 0 and number == 0 else PRE_NONE, post if final else POST_NONE,
                                   grid, block))
            source = target
    return Plan(out_shape, tuple(launches), tuple(temps), count)


def _axes(node, values, rank: int) -> tuple[int, ...]:
    axes = tuple(normalize_axis(node, int(a), rank) for a in values)
    if len(set(axes)) != len(axes):
        raise InvalidArgumentError(f"node {node.name!r} ({node.op_type}): axes {list(values)} contain a duplicate")
    return tuple(sorted(axes))


def _reduce_factory(combine: str, pre: int, post: int, allowed, axes_input: bool):
    code = COMBINES.index(combine)

    def factory(node, shapes, opset, ctx, host=None):
        kernels = Kernels(ctx, SOURCE)
        keepdims = bool(node.attr("keepdims", 1))
        noop = bool(node.attr("noop_with_empty_axes", 0)) if axes_input else False
        attribute_axes = None if axes_input else node.attr("axes")

        @memo
        def plan(shape, requested):
            if requested is None or len(requested) == 0:  # no axes: every axis, or none with noop_with_empty_axes
                axes = () if noop else tuple(range(len(shape)))
            else:
                axes = _axes(node, requested, len(shape))
            return reduction_plan(shape, axes, keepdims, pre, post)

        def kernel(x, axes=None):
            dtype = x.dtype
            suffix = require_type(node, dtype, allowed)
            partial = SUFFIX[DataType.FLOAT] if dtype in FLOAT_TYPES else suffix
            requested = host.ints(1, axes) if axes_input else attribute_axes
            p = plan(x.shape, None if requested is None else tuple(requested))
            y = ctx.empty(dtype, p.out_shape)
            temps = [ctx.empty(DataType.FLOAT if dtype in FLOAT_TYPES else dtype, (n,)) for n in p.temps]
            for launch in p.launches:
                source = x if launch.source is None else temps[launch.source]
                target = y if launch.target is None else temps[launch.target]
                fn = kernels[f"reduce_{suffix if launch.source is None else partial}_"
                             f"{suffix if launch.target is None else partial}"]
                ctx.launch(fn, (launch.grid, launch.splits), launch.block, ptr(source), ptr(target), i32(code),
                           i64(launch.outer), i64(launch.extent), i64(launch.inner), i64(launch.chunk),
                           i32(launch.pre), i32(launch.post), f32(p.count))
            return (y,)

        return kernel

    return factory


for _op, (_combine, _pre, _post, _since, _types) in _REDUCERS.items():
    register(_op, since=1, dtypes=_types)(_reduce_factory(_combine, _pre, _post, _types, axes_input=False))
    register(_op, since=_since, dtypes=_types, host_inputs=(1,))(
        _reduce_factory(_combine, _pre, _post, _types, axes_input=True))


def _arg_factory(is_max: bool):
    def factory(node, shapes, opset, ctx):
        kernels = Kernels(ctx, SOURCE)
        axis, keepdims = int(node.attr("axis", 0)), bool(node.attr("keepdims", 1))
        last = int(bool(node.attr("select_last_index", 0)))  # attribute added in opset 12

        @memo
        def plan(shape):
            a = normalize_axis(node, axis, len(shape))
            if shape[a] == 0:
                raise InvalidArgumentError(
                    f"node {node.name!r} ({node.op_type}): axis {axis} has size 0; there is no element to pick"
                )
            outer, extent, inner = math.prod(shape[:a]), shape[a], math.prod(shape[a + 1:])
            out_shape = shape[:a] + ((1,) if keepdims else ()) + shape[a + 1:]
            block = block_shape(inner, extent)
            return out_shape, outer, extent, inner, block, min(outer * -(-inner // block[0]), MAX_GRID)

        def kernel(x):
            fn = kernels["arg_" + require_type(node, x.dtype, ARG_TYPES)]
            out_shape, outer, extent, inner, block, grid = plan(x.shape)
            y = ctx.empty(DataType.INT64, out_shape)
            if grid:
                ctx.launch(fn, grid, block, ptr(x), ptr(y), i64(outer), i64(extent), i64(inner), i32(is_max),
                           i32(last))
            return (y,)

        return kernel

    return factory


register("ArgMax", since=1, dtypes=ARG_TYPES)(_arg_factory(True))
register("ArgMin", since=1, dtypes=ARG_TYPES)(_arg_factory(False))
