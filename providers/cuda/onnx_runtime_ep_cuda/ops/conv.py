"""Conv (implicit GEMM), MaxPool, AveragePool and GlobalAveragePool on kernels/conv.cu.

Conv and the windowed pools run on 2-D inputs (N, C, H, W) and 1-D ones (N, C, W), which the kernels see
as height-1 images; other spatial ranks are declined so they run on the CPU. The window geometry
(auto_pad, explicit pads, strides, dilations, ceil_mode) is resolved here per input shape, the way the ONNX
specification and the CPU provider define it.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx_runtime import DataType
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError
from onnx_runtime.windows import AUTO_PADS, WindowAttributes

from .context import MAX_GRID, i32, i64, ptr
from .linalg import SUFFIX, optional_ptr
from .registry import FLOATS, register

TYPE_SUFFIX = {**SUFFIX, DataType.INT8: "i8", DataType.UINT8: "u8"}  # 8-bit integers: MaxPool only
MAX_GRID_YZ = 65535
# conv.cu's implicit-GEMM launch shape: 64x64 output tiles (channels x pixels), 256 threads per block.
CONV_TILE = 64
CONV_THREADS = 256
POOL_THREADS = 256


def _graph_error(node, attribute: str, problem: str) -> InvalidGraphError:
    return InvalidGraphError(f"node {node.name!r} ({node.op_type}): attribute {attribute!r} {problem}")


def _known_rank(node, shapes) -> int | None:
    """Spatial rank from kernel_shape, else from the input (or Conv weight) shape, when known."""
    kernel = node.attr("kernel_shape")
    if kernel is not None:
        return len(kernel)
    for shape in shapes[:2]:
        if shape is not None:
            return len(shape) - 2
    return None


def _window_check(node, shapes, dtypes):
    rank = _known_rank(node, shapes)
    if rank is not None and rank not in (1, 2):
        return (f"CUDAExecutionProvider runs {node.op_type} on 1-D and 2-D windows (inputs of rank 3 or 4); "
                f"this node has {rank} spatial dimensions")
    auto_pad = node.attr("auto_pad", "NOTSET") or "NOTSET"
    if auto_pad not in AUTO_PADS:
        return f"{node.op_type} auto_pad={auto_pad!r} is not one of {', '.join(AUTO_PADS)}"
    return None


@dataclass(frozen=True)
class Window:
    """A 2-D window over an (h, w) input producing (oh, ow); pads are (top, left) and (bottom, right)."""

    h: int
    w: int
    oh: int
    ow: int
    kernel: tuple[int, int]
    strides: tuple[int, int]
    begin: tuple[int, int]
    end: tuple[int, int]
    dilations: tuple[int, int]

    def output_shape(self, lead: tuple[int, int], rank: int) -> tuple[int, ...]:
        """(N, C) ``lead`` followed by the output's ``rank`` spatial sizes."""
        return (*lead, self.oh, self.ow) if rank == 2 else (*lead, self.ow)

    def args(self) -> list:
        return [i64(self.h), i64(self.w), i64(self.oh), i64(self.ow), *map(i32, self.kernel), *map(i32, self.strides),
                *map(i32, self.begin), *map(i32, self.dilations)]


class WindowAttrs(WindowAttributes):
    """A node's window attributes; :meth:`resolve` applies them to a 1-D or 2-D input shape."""

    def resolve(self, spatial: tuple[int, ...], weight_kernel: tuple[int, ...] | None = None) -> Window:
        node, rank = self.node, len(spatial)
        if rank not in (1, 2):
            raise InvalidArgumentError(
                f"node {node.name!r} ({node.op_type}): the CUDA kernels take 1-D or 2-D windows, the input has "
                f"{rank} spatial dimensions"
            )
        kernel, strides, dilations, begin, end, out = self.geometry(spatial, weight_kernel)
        if rank == 1:  # a height-1 image
            spatial, kernel, strides, dilations = (1, *spatial), (1, *kernel), (1, *strides), (1, *dilations)
            begin, end, out = (0, *begin), (0, *end), (1, *out)
        return Window(spatial[0], spatial[1], out[0], out[1], tuple(kernel), tuple(strides), tuple(begin),
                      tuple(end), tuple(dilations))


def _functions(ctx, name: str):
    """Kernel ``name`` per dtype, looked up on first use."""
    cache = {}

    def get(dtype):
        function = cache.get(dtype)
        if function is None:
            function = cache[dtype] = ctx.function("conv.cu", f"{name}_{TYPE_SUFFIX[DataType.parse(dtype)]}")
        return function

    return get


# -- Conv --------------------------------------------------------------------------------------------


@register("Conv", since=1, dtypes=FLOATS, typed_inputs=(0, 1), check=_window_check)
def conv(node, shapes, opset, ctx):
    attrs = WindowAttrs(node, needs_kernel=False)
    group = int(node.attr("group", 1))
    if group < 1:
        raise _graph_error(node, "group", f"is {group}; expected a positive group count")
    igemm, direct = _functions(ctx, "conv2d_igemm"), _functions(ctx, "conv2d_direct")
    windows: dict[tuple, Window] = {}

    def kernel(x, w, b=None):
        n, c = x.shape[:2]
        m = w.shape[0]
        if c != w.shape[1] * group or m % group:
            raise InvalidArgumentError(
                f"node {node.name!r} (Conv): input has {c} channels but the weight {w.shape} with group={group} "
                f"expects {w.shape[1] * group}"
            )
        if b is not None and b.shape != (m,):
            raise InvalidArgumentError(f"node {node.name!r} (Conv): bias has shape {b.shape}, expected ({m},)")
        key = (x.shape, w.shape)
        window = windows.get(key)
        if window is None:
            window = windows[key] = attrs.resolve(x.shape[2:], w.shape[2:])
        y = ctx.empty(x.dtype, window.output_shape((n, m), len(x.shape) - 2))
        if y.numel == 0:
            return (y,)
        common = [ptr(x), ptr(w), optional_ptr(b), ptr(y), i64(n), i64(c), i64(m)]
        if c == group:  # one input channel per group (depthwise and single-channel convolutions)
            ctx.launch_1d(direct(x.dtype), y.numel, *common, *window.args())
        else:
            columns = n * window.oh * window.ow
            grid = (-(-columns // CONV_TILE), min(-(-(m // group) // CONV_TILE), MAX_GRID_YZ), min(group, MAX_GRID_YZ))
            ctx.launch(igemm(x.dtype), grid, CONV_THREADS, *common, i64(group), *window.args())
        return (y,)

    return kernel


# -- pooling -----------------------------------------------------------------------------------------


@register("MaxPool", since=1, dtypes=FLOATS | {DataType.INT8, DataType.UINT8}, check=_window_check)
def max_pool(node, shapes, opset, ctx):
    attrs = WindowAttrs(node, needs_kernel=True)
    storage_order = int(node.attr("storage_order", 0))
    if storage_order not in (0, 1):
        raise _graph_error(node, "storage_order", f"is {storage_order}; expected 0 (row major) or 1")
    with_indices = len(node.outputs) > 1 and bool(node.outputs[1])
    function = _functions(ctx, "max_pool2d")

    def kernel(x):
        window = attrs.resolve(x.shape[2:])
        shape = window.output_shape(x.shape[:2], len(x.shape) - 2)
        y = ctx.empty(x.dtype, shape)
        indices = ctx.empty(DataType.INT64, shape) if with_indices else None
        planes = x.shape[0] * x.shape[1]
        ctx.launch_1d(function(x.dtype), y.numel, ptr(x), ptr(y), optional_ptr(indices), i64(planes),
                      *window.args(), i32(storage_order))
        return (y, indices) if len(node.outputs) > 1 else (y,)

    return kernel


@register("AveragePool", since=1, dtypes=FLOATS, check=_window_check)
def average_pool(node, shapes, opset, ctx):
    attrs = WindowAttrs(node, needs_kernel=True)
    include_pad = int(bool(node.attr("count_include_pad", 0)))
    function = _functions(ctx, "average_pool2d")

    def kernel(x):
        window = attrs.resolve(x.shape[2:])
        y = ctx.empty(x.dtype, window.output_shape(x.shape[:2], len(x.shape) - 2))
        planes = x.shape[0] * x.shape[1]
        ctx.launch_1d(function(x.dtype), y.numel, ptr(x), ptr(y), i64(planes), *window.args(),
                      *map(i32, window.end), i32(include_pad))
        return (y,)

    return kernel


def _global_pool_check(node, shapes, dtypes):
    if shapes and shapes[0] is not None and len(shapes[0]) < 2:
        return f"GlobalAveragePool needs an (N, C, ...) input, this one has rank {len(shapes[0])}"
    return None


@register("GlobalAveragePool", since=1, dtypes=FLOATS, check=_global_pool_check)
def global_average_pool(node, shapes, opset, ctx):
    function = _functions(ctx, "global_average_pool")

    def kernel(x):
        if len(x.shape) < 2:
            raise InvalidArgumentError(
                f"node {node.name!r} (GlobalAveragePool): the input must be (N, C, ...), got shape {x.shape}"
            )
        planes = x.shape[0] * x.shape[1]
        size = x.numel // planes if planes else 0
        y = ctx.empty(x.dtype, (*x.shape[:2], *(1,) * (len(x.shape) - 2)))
        if planes:  # empty spatial dimensions average to NaN, as numpy's mean does
            ctx.launch(function(x.dtype), min(planes, MAX_GRID), POOL_THREADS, ptr(x), ptr(y), i64(planes), i64(size))
        return (y,)

    return kernel

