"""Elementwise operators on the device (kernels/elementwise.cu): unary math and activations, binary
arithmetic, comparison and logic with numpy broadcasting, Pow, variadic Max/Min/Sum/Mean, Where, Cast,
CastLike, Clip and Identity.

Factories parse attributes once; kernels pick the entry point by dtype at call time (the factory sees shapes,
not dtypes) and keep a :class:`LaunchSite` per (dtype, shapes): entry point, grid, broadcast layout and
scalar arguments are worked out once, and a call allocates its output and passes the pointers. Shared
helpers (dtype suffixes, kernel lookup, the per-shape memo) are used by the reduction and normalization
modules too.
"""

from __future__ import annotations

import ctypes
import math

from onnx_runtime import DataType
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError, NotSupportedError

from .context import BLOCK, MAX_GRID, f32, i32, i64, ptr
from .registry import register

NAME = "CUDAExecutionProvider"
SOURCE = "elementwise.cu"
MAX_RANK = 8
NULL = (0, ctypes.c_void_p)  # an omitted optional pointer argument
UNROLL = 4  # EW_UNROLL in kernels/elementwise.cuh: elements per thread per grid-stride step

# Kernel-name suffix of each element type the kernels are instantiated for.
SUFFIX = {
    DataType.FLOAT: "f32", DataType.FLOAT16: "f16", DataType.BFLOAT16: "bf16",
    DataType.INT8: "i8", DataType.UINT8: "u8", DataType.INT16: "i16", DataType.UINT16: "u16",
    DataType.INT32: "i32", DataType.UINT32: "u32", DataType.INT64: "i64", DataType.UINT64: "u64",
    DataType.BOOL: "b8",
}
FLOAT_TYPES = frozenset({DataType.FLOAT, DataType.FLOAT16, DataType.BFLOAT16})
SIGNED_TYPES = FLOAT_TYPES | {DataType.INT8, DataType.INT16, DataType.INT32, DataType.INT64}
NUMERIC_TYPES = SIGNED_TYPES | {DataType.UINT8, DataType.UINT16, DataType.UINT32, DataType.UINT64}
BOOL_TYPES = frozenset({DataType.BOOL})
# Types whose elements Where and Identity move without interpreting them.
MOVABLE_TYPES = frozenset(d for d in DataType if d not in (DataType.UNDEFINED, DataType.STRING)
                          and d.name not in ("COMPLEX64", "COMPLEX128"))
CAST_TYPES = frozenset({DataType.FLOAT, DataType.FLOAT16, DataType.BFLOAT16, DataType.INT32, DataType.INT64,
                        DataType.BOOL, DataType.UINT8, DataType.INT8})
POW_BASE_TYPES = frozenset({DataType.FLOAT, DataType.FLOAT16, DataType.BFLOAT16, DataType.INT32, DataType.INT64})
POW_EXPONENT_TYPES = NUMERIC_TYPES | {DataType.DOUBLE}

# The op codes of kernels/elementwise.cu (enum UnaryOp / BinaryOp), in order.
UNARY_OPS = (
    "exp", "log", "sqrt", "reciprocal", "sigmoid", "tanh", "erf", "gelu", "gelu_tanh", "softplus", "softsign",
    "mish", "floor", "ceil", "round", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh",
    "acosh", "atanh", "leaky_relu", "elu", "selu", "celu", "thresholded_relu", "hard_sigmoid", "hard_swish",
    "div_scalar",
    "abs", "neg", "relu", "sign", "not",
)
BINARY_OPS = (
    "add", "sub", "mul", "div", "max", "min",
    "equal", "less", "greater", "less_equal", "greater_equal", "and", "or", "xor",
)
_COMPARISONS = frozenset(BINARY_OPS[6:])


def type_names(types) -> str:
    return ", ".join(sorted(d.name.lower() for d in types))


def require_type(node, dtype: DataType, allowed, what: str = "input") -> str | None:
    """The kernel suffix of ``dtype`` (None for types only moved, never computed on); raises when a type
    unknown at placement turns out unsupported."""
    if dtype not in allowed:
        raise NotSupportedError(
            f"{NAME}: node {node.name!r} ({node.op_type}) got {what} of type {dtype.name.lower()}; its CUDA "
            f"kernel takes {type_names(allowed)} (place the node on CPUExecutionProvider)"
        )
    return SUFFIX.get(dtype)


class Kernels:
    """The functions of one kernel file, looked up once per name."""

    def __init__(self, ctx, source: str):
        self.ctx = ctx
        self.source = source
        self._functions: dict[str, object] = {}

    def __getitem__(self, name: str):
        function = self._functions.get(name)
        if function is None:
            function = self._functions[name] = self.ctx.function(self.source, name)
        return function


def memo(compute):
    """``compute(*key)`` cached per key (the shapes, or the dtypes and shapes, of a call: kernels see a
    handful at most); also how launch sites (a call's function, grid and fixed arguments) are built once."""
    cache: dict = {}

    def lookup(*shapes):
        found = cache.get(shapes)
        if found is None:
            found = cache[shapes] = compute(*shapes)
        return found

    return lookup


def grid(n: int) -> int:
    """Blocks of an elementwise.cu grid-stride kernel over ``n`` outputs (0 for none: nothing to launch)."""
    return min(-(-n // (BLOCK * UNROLL)), MAX_GRID) if n > 0 else 0


def launch(ctx, fn, n: int, *args) -> None:
    """Launch an elementwise.cu grid-stride kernel over ``n`` outputs (nothing for none)."""
    if n > 0:
        ctx.launch(fn, grid(n), BLOCK, *args)


def copy(ctx, x):
    """A device copy of ``x`` (Identity, Cast to the same type, single-input variadic ops)."""
    y = ctx.empty_like(x)
    if x.nbytes:
        ctx.device.copy_device(y.device_ptr, x.device_ptr, x.nbytes)
    return y


def normalize_axis(node, axis: int, rank: int) -> int:
    if not -rank <= axis < max(rank, 1):
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): axis {axis} is out of range for a rank-{rank} input; "
            f"expected a value in [{-rank}, {max(rank - 1, 0)}]"
        )
    return axis % rank if rank else 0


# -- broadcasting -----------------------------------------------------------------------------------------


def broadcast_shape(node, *shapes) -> tuple[int, ...]:
    rank = max(len(s) for s in shapes)
    out = []
    for k in range(rank):
        dims = {s[k - rank + len(s)] for s in shapes if k - rank + len(s) >= 0} - {1}
        if len(dims) > 1:
            raise InvalidArgumentError(
                f"node {node.name!r} ({node.op_type}): input shapes {[tuple(s) for s in shapes]} do not broadcast "
                f"(dimension {k} of the result is {sorted(dims)})"
            )
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def broadcast_args(out_shape, *shapes) -> list:
    """Kernel arguments describing the broadcast of ``shapes`` to ``out_shape``: the rank, 8 dims and 8
    strides per input, innermost first, after dropping size-1 dims and merging dims that are contiguous
    in every input (equal shapes become rank 1)."""
    rank = len(out_shape)
    strides = []
    for shape in shapes:
        padded = (1,) * (rank - len(shape)) + tuple(shape)
        step, own = 1, [0] * rank
        for k in range(rank - 1, -1, -1):
            own[k] = step if padded[k] != 1 else 0
            step *= padded[k]
        strides.append(own)
    dims: list[int] = []
    merged: list[list[int]] = [[] for _ in shapes]
    for k, size in enumerate(out_shape):
        if size == 1:
            continue
        if dims and all(m[-1] == s[k] * size for m, s in zip(merged, strides)):
            dims[-1] *= size
            for m, s in zip(merged, strides):
                m[-1] = s[k]
        else:
            dims.append(size)
            for m, s in zip(merged, strides):
                m.append(s[k])
    if not dims:  # every dim is 1: a single element
        dims = [1]
        merged = [[0] for _ in shapes]
    if len(dims) > MAX_RANK:
        raise NotSupportedError(f"{NAME} broadcasts up to {MAX_RANK} dims; {list(out_shape)} needs {len(dims)}")
    pad = [0] * (MAX_RANK - len(dims))
    args = [i32(len(dims))]
    args += [i64(d) for d in dims[::-1] + [1] * len(pad)]
    for m in merged:
        args += [i64(s) for s in m[::-1] + pad]
    return args


def _rank_check(node, shapes, dtypes):
    for shape in shapes:
        if shape is not None and len(shape) > MAX_RANK:
            return f"CUDAExecutionProvider broadcasts tensors of rank up to {MAX_RANK}, got rank {len(shape)}"
    return None


# -- unary ------------------------------------------------------------------------------------------------


def _unary_factory(op: str, allowed, attrs=lambda node: (0.0, 0.0)):
    code = UNARY_OPS.index(op)

    def factory(node, shapes, opset, ctx):
        kernels = Kernels(ctx, SOURCE)
        a, b = attrs(node)

        @memo
        def site(dtype, shape):
            n = math.prod(shape)
            return ctx.site(kernels["unary_" + require_type(node, dtype, allowed)], grid(n), BLOCK, 2,
                            i32(code), i64(n), f32(a), f32(b))

        def kernel(x):
            y = ctx.empty(x.dtype, x.shape)
            site(x.dtype, x.shape)(x.device_ptr, y.device_ptr)
            return (y,)

        return kernel

    return factory


def _attr(name, default):
    return lambda node: (float(node.attr(name, default)), 0.0)


# op_type: (first opset, kernel op, accepted types, attributes -> (a, b))
_UNARY = {
    "Exp": (1, "exp", FLOAT_TYPES, None),
    "Log": (1, "log", FLOAT_TYPES, None),
    "Sqrt": (1, "sqrt", FLOAT_TYPES, None),
    "Reciprocal": (1, "reciprocal", FLOAT_TYPES, None),
    "Sigmoid": (1, "sigmoid", FLOAT_TYPES, None),
    "Tanh": (1, "tanh", FLOAT_TYPES, None),
    "Erf": (9, "erf", FLOAT_TYPES, None),
    "Softplus": (1, "softplus", FLOAT_TYPES, None),
    "Softsign": (1, "softsign", FLOAT_TYPES, None),
    "Mish": (18, "mish", FLOAT_TYPES, None),
    "Floor": (1, "floor", FLOAT_TYPES, None),
    "Ceil": (1, "ceil", FLOAT_TYPES, None),
    "Round": (11, "round", FLOAT_TYPES, None),
    "Sin": (7, "sin", FLOAT_TYPES, None),
    "Cos": (7, "cos", FLOAT_TYPES, None),
    "Tan": (7, "tan", FLOAT_TYPES, None),
    "Asin": (7, "asin", FLOAT_TYPES, None),
    "Acos": (7, "acos", FLOAT_TYPES, None),
    "Atan": (7, "atan", FLOAT_TYPES, None),
    "Sinh": (9, "sinh", FLOAT_TYPES, None),
    "Cosh": (9, "cosh", FLOAT_TYPES, None),
    "Asinh": (9, "asinh", FLOAT_TYPES, None),
    "Acosh": (9, "acosh", FLOAT_TYPES, None),
    "Atanh": (9, "atanh", FLOAT_TYPES, None),
    "LeakyRelu": (1, "leaky_relu", FLOAT_TYPES, _attr("alpha", 0.01)),
    "Elu": (1, "elu", FLOAT_TYPES, _attr("alpha", 1.0)),
    "Selu": (1, "selu", FLOAT_TYPES,
             lambda node: (float(node.attr("alpha", 1.6732632423543772848170429916717)),
                           float(node.attr("gamma", 1.0507009873554804934193349852946)))),
    "Celu": (12, "celu", FLOAT_TYPES, _attr("alpha", 1.0)),
    "ThresholdedRelu": (10, "thresholded_relu", FLOAT_TYPES, _attr("alpha", 1.0)),
    "HardSigmoid": (1, "hard_sigmoid", FLOAT_TYPES,
                    lambda node: (float(node.attr("alpha", 0.2)), float(node.attr("beta", 0.5)))),
    "HardSwish": (14, "hard_swish", FLOAT_TYPES, None),
    "Abs": (1, "abs", NUMERIC_TYPES, None),
    "Neg": (1, "neg", SIGNED_TYPES, None),
    "Relu": (1, "relu", SIGNED_TYPES, None),
    "Sign": (9, "sign", NUMERIC_TYPES, None),
    "Not": (1, "not", BOOL_TYPES, None),
}

for _op, (_since, _code, _types, _attrs) in _UNARY.items():
    register(_op, since=_since, dtypes=_types)(
        _unary_factory(_code, _types, _attrs) if _attrs else _unary_factory(_code, _types))


def _gelu_check(node, shapes, dtypes):
    approximate = node.attr("approximate", "none")
    if approximate not in ("none", "tanh"):
        return f"CUDAExecutionProvider implements Gelu approximate='none' or 'tanh', not {approximate!r}"
    return None


@register("Gelu", since=20, dtypes=FLOAT_TYPES, check=_gelu_check)
def gelu(node, shapes, opset, ctx):
    op = "gelu_tanh" if node.attr("approximate", "none") == "tanh" else "gelu"
    return _unary_factory(op, FLOAT_TYPES)(node, shapes, opset, ctx)


def _tensor_check(node, shapes, dtypes):
    if not dtypes or dtypes[0] is None:  # sequences and optionals have no element type here
        return "CUDAExecutionProvider copies tensors only; this input is not a tensor of a known element type"
    return None


@register("Identity", since=1, dtypes=MOVABLE_TYPES, check=_tensor_check)
def identity(node, shapes, opset, ctx):
    return lambda x: (copy(ctx, x),)


# -- binary -----------------------------------------------------------------------------------------------


def _legacy_shape(node, opset, a_shape, b_shape):
    """Opsets < 7: with broadcast=1 and an axis, B's dims line up with A's starting at that axis."""
    axis = node.attr("axis")
    if opset >= 7 or not node.attr("broadcast", 0) or axis is None:
        return b_shape
    start = axis + len(a_shape) if axis < 0 else axis
    return tuple(b_shape) + (1,) * (len(a_shape) - start - len(b_shape))


def _binary_factory(op: str, allowed):
    code = BINARY_OPS.index(op)
    to_bool = op in _COMPARISONS

    def factory(node, shapes, opset, ctx):
        kernels = Kernels(ctx, SOURCE)

        @memo
        def site(a_dtype, b_dtype, a_shape, b_shape):
            if a_dtype != b_dtype:
                raise InvalidArgumentError(
                    f"node {node.name!r} ({node.op_type}): inputs are {a_dtype.name.lower()} and "
                    f"{b_dtype.name.lower()}; both must have the same type"
                )
            b_shape = _legacy_shape(node, opset, a_shape, b_shape)
            out = broadcast_shape(node, a_shape, b_shape)
            n = math.prod(out)
            launch_site = ctx.site(kernels["binary_" + require_type(node, a_dtype, allowed)], grid(n), BLOCK, 3,
                                   i32(code), i64(n), *broadcast_args(out, a_shape, b_shape))
            return out, DataType.BOOL if to_bool else a_dtype, launch_site

        def kernel(a, b):
            out, dtype, launch_site = site(a.dtype, b.dtype, a.shape, b.shape)
            y = ctx.empty(dtype, out)
            launch_site(a.device_ptr, b.device_ptr, y.device_ptr)
            return (y,)

        return kernel

    return factory


# op_type: (kernel op, accepted types, first opset without the legacy broadcast attributes or None)
_BINARY = {
    "Add": ("add", NUMERIC_TYPES, 1),
    "Sub": ("sub", NUMERIC_TYPES, 1),
    "Mul": ("mul", NUMERIC_TYPES, 1),
    "Div": ("div", NUMERIC_TYPES, 1),
    "Equal": ("equal", NUMERIC_TYPES | BOOL_TYPES, 1),
    "Less": ("less", NUMERIC_TYPES, 1),
    "Greater": ("greater", NUMERIC_TYPES, 1),
    "LessOrEqual": ("less_equal", NUMERIC_TYPES, 12),
    "GreaterOrEqual": ("greater_equal", NUMERIC_TYPES, 12),
    "And": ("and", BOOL_TYPES, 1),
    "Or": ("or", BOOL_TYPES, 1),
    "Xor": ("xor", BOOL_TYPES, 1),
}

for _op, (_code, _types, _since) in _BINARY.items():
    register(_op, since=_since, dtypes=_types, typed_inputs=(0, 1), check=_rank_check)(_binary_factory(_code, _types))


def _pow_check(node, shapes, dtypes):
    if len(dtypes) > 1 and dtypes[1] is not None and dtypes[1] not in POW_EXPONENT_TYPES:
        return (f"CUDAExecutionProvider runs Pow with exponents of type {type_names(POW_EXPONENT_TYPES)}, "
                f"not {dtypes[1].name.lower()}")
    return _rank_check(node, shapes, dtypes)


@register("Pow", since=1, dtypes=POW_BASE_TYPES, check=_pow_check)
def pow_(node, shapes, opset, ctx):
    kernels = Kernels(ctx, SOURCE)

    @memo
    def site(a_dtype, b_dtype, a_shape, b_shape):
        fn = kernels["pow_" + require_type(node, a_dtype, POW_BASE_TYPES)]
        if b_dtype not in POW_EXPONENT_TYPES:  # the kernel reads the exponent by its ONNX type code
            raise NotSupportedError(f"{NAME}: node {node.name!r} (Pow) got an exponent of type {b_dtype.name.lower()}; "
                                    f"the CUDA kernel takes {type_names(POW_EXPONENT_TYPES)}")
        b_shape = _legacy_shape(node, opset, a_shape, b_shape)
        out = broadcast_shape(node, a_shape, b_shape)
        n = math.prod(out)
        return out, ctx.site(fn, grid(n), BLOCK, 3, i32(int(b_dtype)), i64(n), *broadcast_args(out, a_shape, b_shape))

    def kernel(a, b):
        out, launch_site = site(a.dtype, b.dtype, a.shape, b.shape)
        y = ctx.empty(a.dtype, out)
        launch_site(a.device_ptr, b.device_ptr, y.device_ptr)
        return (y,)

    return kernel


# -- variadic Max/Min/Sum/Mean ----------------------------------------------------------------------------


def _variadic_factory(op: str, allowed, mean: bool = False):
    code = BINARY_OPS.index(op)

    def factory(node, shapes, opset, ctx):
        kernels = Kernels(ctx, SOURCE)

        @memo
        def plan(*in_shapes):
            """Pairwise steps: (output shape, element count, broadcast args) for inputs 0..k folded with k+1."""
            steps, acc = [], in_shapes[0]
            for shape in in_shapes[1:]:
                out = broadcast_shape(node, acc, shape)
                steps.append((out, math.prod(out), broadcast_args(out, acc, shape)))
                acc = out
            return steps

        def kernel(*xs):
            dtype = xs[0].dtype
            if any(x.dtype != dtype for x in xs):
                raise InvalidArgumentError(f"node {node.name!r} ({node.op_type}): all inputs must have one type")
            suffix = require_type(node, dtype, allowed)
            if len(xs) == 1:
                return (copy(ctx, xs[0]),)
            fn = kernels["binary_" + suffix]
            acc = xs[0]
            for x, (out, n, args) in zip(xs[1:], plan(*(x.shape for x in xs))):
                y = ctx.empty(dtype, out)
                launch(ctx, fn, n, ptr(acc), ptr(x), ptr(y), i32(code), i64(n), *args)
                acc = y
            if mean:
                y = ctx.empty_like(acc)
                launch(ctx, kernels["unary_" + suffix], acc.numel, ptr(acc), ptr(y), i32(UNARY_OPS.index("div_scalar")),
                       i64(acc.numel), f32(len(xs)), f32(0.0))
                acc = y
            return (acc,)

        return kernel

    return factory


register("Max", since=1, dtypes=NUMERIC_TYPES, typed_inputs=None, check=_rank_check)(
    _variadic_factory("max", NUMERIC_TYPES))
register("Min", since=1, dtypes=NUMERIC_TYPES, typed_inputs=None, check=_rank_check)(
    _variadic_factory("min", NUMERIC_TYPES))
register("Sum", since=1, dtypes=FLOAT_TYPES, typed_inputs=None, check=_rank_check)(
    _variadic_factory("add", FLOAT_TYPES))
register("Mean", since=1, dtypes=FLOAT_TYPES, typed_inputs=None, check=_rank_check)(
    _variadic_factory("add", FLOAT_TYPES, mean=True))


# -- Where ------------------------------------------------------------------------------------------------


def _where_check(node, shapes, dtypes):
    if dtypes and dtypes[0] is not None and dtypes[0] != DataType.BOOL:
        return f"Where's condition must be bool, got {dtypes[0].name.lower()}"
    return _rank_check(node, shapes, dtypes)


@register("Where", since=9, dtypes=MOVABLE_TYPES, typed_inputs=(1, 2), check=_where_check)
def where(node, shapes, opset, ctx):
    kernels = Kernels(ctx, SOURCE)

    @memo
    def site(c_dtype, x_dtype, y_dtype, c_shape, x_shape, y_shape):
        if x_dtype != y_dtype or c_dtype != DataType.BOOL:
            raise InvalidArgumentError(
                f"node {node.name!r} (Where): expected a bool condition and two inputs of one type, got "
                f"{c_dtype.name.lower()}, {x_dtype.name.lower()}, {y_dtype.name.lower()}"
            )
        require_type(node, x_dtype, MOVABLE_TYPES)
        out = broadcast_shape(node, c_shape, x_shape, y_shape)
        n = math.prod(out)
        return out, ctx.site(kernels[f"where_{x_dtype.numpy.itemsize}"], grid(n), BLOCK, 4, i64(n),
                             *broadcast_args(out, c_shape, x_shape, y_shape))

    def kernel(condition, x, y):
        out, launch_site = site(condition.dtype, x.dtype, y.dtype, condition.shape, x.shape, y.shape)
        result = ctx.empty(x.dtype, out)
        launch_site(condition.device_ptr, x.device_ptr, y.device_ptr, result.device_ptr)
        return (result,)

    return kernel


# -- Cast -------------------------------------------------------------------------------------------------


def _target(node):
    try:
        return DataType.parse(node.attr("to"))
    except Exception as exc:  # the parse error says what was wrong; the node name says where
        raise InvalidGraphError(
            f"node {node.name!r} ({node.op_type}): attribute 'to' is {node.attr('to')!r}; expected an ONNX tensor "
            f"data type"
        ) from exc


def _cast_check(node, shapes, dtypes):
    try:
        to = _target(node)
    except InvalidGraphError as exc:
        return str(exc)
    if to not in CAST_TYPES:
        return f"CUDAExecutionProvider casts to {type_names(CAST_TYPES)}, not {to.name.lower()}"
    return None


def _caster(ctx, node):
    """``cast(x, to)``: a copy for the same type, else the cast kernel (a launch site per types and shape)."""
    kernels = Kernels(ctx, SOURCE)

    @memo
    def site(source, to, shape):
        n = math.prod(shape)
        name = f"cast_{require_type(node, source, CAST_TYPES)}_{require_type(node, to, CAST_TYPES, 'a target')}"
        return ctx.site(kernels[name], grid(n), BLOCK, 2, i64(n))

    def cast(x, to):
        if x.dtype == to:
            return copy(ctx, x)
        y = ctx.empty(to, x.shape)
        site(x.dtype, to, x.shape)(x.device_ptr, y.device_ptr)
        return y

    return cast


@register("Cast", since=1, dtypes=CAST_TYPES, check=_cast_check)
def cast(node, shapes, opset, ctx):
    to, convert = _target(node), _caster(ctx, node)
    return lambda x: (convert(x, to),)


@register("CastLike", since=15, dtypes=CAST_TYPES, typed_inputs=(0, 1))
def cast_like(node, shapes, opset, ctx):
    convert = _caster(ctx, node)
    return lambda x, like: (convert(x, like.dtype),)


# -- Clip -------------------------------------------------------------------------------------------------


@register("Clip", since=1, dtypes=FLOAT_TYPES)
def clip_attributes(node, shapes, opset, ctx):
    kernels = Kernels(ctx, SOURCE)
    low, high = node.attr("min"), node.attr("max")
    has = (low is not None) | (high is not None) << 1
    low, high = float(low or 0.0), float(high or 0.0)

    def kernel(x):
        fn = kernels["clip_" + require_type(node, x.dtype, FLOAT_TYPES)]
        y = ctx.empty_like(x)
        launch(ctx, fn, x.numel, ptr(x), ptr(y), i64(x.numel), NULL, NULL, f32(low), f32(high), i32(has))
        return (y,)

    return kernel


@register("Clip", since=11, dtypes=NUMERIC_TYPES, typed_inputs=None)
def clip(node, shapes, opset, ctx):
    kernels = Kernels(ctx, SOURCE)

    def kernel(x, low=None, high=None):
        fn = kernels["clip_" + require_type(node, x.dtype, NUMERIC_TYPES)]
        for bound in (low, high):
            if bound is not None and (bound.dtype != x.dtype or bound.numel != 1):
                raise InvalidArgumentError(
                    f"node {node.name!r} (Clip): min and max must be one-element tensors of the input's type "
                    f"{x.dtype.name.lower()}, got {bound.dtype.name.lower()} of shape {list(bound.shape)}"
                )
        y = ctx.empty_like(x)
        bounds = [ptr(b) if b is not None else NULL for b in (low, high)]
        launch(ctx, fn, x.numel, ptr(x), ptr(y), i64(x.numel), *bounds, f32(0.0), f32(0.0), i32(0))
        return (y,)

    return kernel
