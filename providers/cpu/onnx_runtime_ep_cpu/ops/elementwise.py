"""Elementwise kernels: arithmetic, math functions, the activations without attributes, comparison and
logic, bitwise ops, Clip, variadic Min/Max/Sum/Mean, Where, Cast/CastLike and Identity.

Inputs of one op share one dtype (the ONNX type constraints say so), so numpy keeps that dtype;
scalars taken from attributes are cast to the input dtype so they never promote float32 to float64.
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np
from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from ..algorithms.activations import hard_swish, mish, sigmoid, softplus, softsign
from ..algorithms.precision import scalar
from ..compiled import COMPILED_DTYPES
from ..registry import register
from ._common import quiet, shape_free

# op_type: (first opset, function). Later versions only added types, so one registration covers them.
# Up to this many elements a Sigmoid runs compiled/sigmoid.py's scalar loop; past it numpy's vectorized exp
# is faster than the per-call costs the loop saves.
SMALL_SIGMOID = 1024
_quiet_sigmoid = quiet(sigmoid)
_sigmoid_loop: list = [None]  # compiled/sigmoid.py's loop, imported (with numba) on the first small Sigmoid


def _sigmoid(x):
    if isinstance(x, np.ndarray) and x.dtype in COMPILED_DTYPES and x.size <= SMALL_SIGMOID \
            and x.flags.c_contiguous:
        loop = _sigmoid_loop[0]
        if loop is None:
            from ..compiled.sigmoid import sigmoid_into

            loop = _sigmoid_loop[0] = sigmoid_into
        y = np.empty_like(x)
        loop(x.reshape(-1), y.reshape(-1))
        return y
    return _quiet_sigmoid(x)


_UNARY = {
    "Neg": (1, np.negative),
    "Abs": (1, np.abs),
    "Sqrt": (1, np.sqrt),
    "Exp": (1, np.exp),
    "Log": (1, np.log),
    "Reciprocal": (1, np.reciprocal),
    "Floor": (1, np.floor),
    "Ceil": (1, np.ceil),
    "Round": (11, np.round),  # numpy rounds half to even, as ONNX requires
    "Sign": (9, np.sign),
    "Tanh": (1, np.tanh),
    "Sigmoid": (1, _sigmoid),
    "Softplus": (1, softplus),
    "Softsign": (1, softsign),
    "Mish": (18, mish),
    "HardSwish": (14, hard_swish),
    "Sin": (7, np.sin),
    "Cos": (7, np.cos),
    "Tan": (7, np.tan),
    "Asin": (7, np.arcsin),
    "Acos": (7, np.arccos),
    "Atan": (7, np.arctan),
    "Sinh": (9, np.sinh),
    "Cosh": (9, np.cosh),
    "Asinh": (9, np.arcsinh),
    "Acosh": (9, np.arccosh),
    "Atanh": (9, np.arctanh),
    "Not": (1, np.logical_not),
    "BitwiseNot": (18, np.invert),
    "IsNaN": (9, np.isnan),
}


# Ops that raise no floating-point warning for any input (inf and NaN included): they skip quiet's
# np.errstate, which costs more than the op itself on small tensors (measured in dfe35df).
NEVER_WARN = frozenset({"Neg", "Abs", "Floor", "Ceil", "Round", "Sign", "Tanh", "Atan", "Asinh", "IsNaN", "Not",
                        "BitwiseNot", "Sigmoid"})  # (_sigmoid silences numpy itself, where numpy computes it)



def _unary_factory(fn, silenced: bool):
    fn = quiet(fn) if silenced else fn

    def factory(node, shapes, opset):
        return shape_free(lambda x: (fn(x),))

    return factory


for _op, (_since, _fn) in _UNARY.items():
    register(_op, since=_since)(_unary_factory(_fn, silenced=_op not in NEVER_WARN))


@register("Erf", since=9)
def erf_kernel(node, shapes, opset):
    from ..algorithms.erf import erf  # (at the first Erf node: the family's other models skip erf.py)

    fn = quiet(erf)
    return shape_free(lambda x: (fn(x),))


@register("Identity", since=1)
def identity(node, shapes, opset):
    # Also passes sequences and optionals through unchanged (Identity-14+).
    return lambda x: (x,)


@register("IsInf", since=10)
def is_inf(node, shapes, opset):
    positive = node.attr("detect_positive", 1)
    negative = node.attr("detect_negative", 1)

    def kernel(x):
        inf = np.isinf(x)
        if not positive:
            inf &= x < 0
        if not negative:
            inf &= x > 0
        return (inf,)

    return kernel


def _nonzero_divisor(b, op: str) -> None:
    """Integer division by zero has no value (numpy warns and returns 0): refused, as the spec leaves it undefined."""
    if not b.all():
        raise InvalidArgumentError(f"{op}: integer division by zero (the divisor B has a zero element); guard the "
                                   "divisor in the model, or compute in floating point")


def _int_div(a, b):
    _nonzero_divisor(b, "Div")
    # floor_divide rounds toward -inf; ONNX integer Div truncates toward zero.
    quotient = np.floor_divide(a, b)
    inexact = (np.remainder(a, b) != 0) & ((a < 0) != (b < 0))
    return quotient + inexact.astype(quotient.dtype)


def _div(a, b):
    return _int_div(a, b) if a.dtype.kind in "iu" else np.divide(a, b)


def _pow(a, b):
    # Pow's output has the base's dtype; numpy refuses negative integer exponents on integer bases.
    if a.dtype.kind in "iu" and b.dtype.kind == "i" and (b < 0).any():
        return np.power(a.astype(np.float64), b).astype(a.dtype)
    if b.size == 1 and a.dtype.kind == "f" and b.dtype.kind in "fiu" and b.ndim <= a.ndim and b.reshape(-1)[0] == 2:
        return np.multiply(a, a)  # a square (a magnitude's): pow(x, 2) is x * x rounded once, without pow's loop
    return np.power(a, b).astype(a.dtype, copy=False)


# op_type: (function, first opset, whether opsets before 7 used the broadcast/axis attributes)
_BINARY = {
    "Add": (np.add, 1, True),
    "Sub": (np.subtract, 1, True),
    "Mul": (np.multiply, 1, True),
    "Div": (quiet(_div), 1, True),
    "Pow": (quiet(_pow), 1, True),
    "And": (np.logical_and, 1, True),
    "Or": (np.logical_or, 1, True),
    "Xor": (np.logical_xor, 1, True),
    "Equal": (np.equal, 1, True),
    "Less": (np.less, 1, True),
    "Greater": (np.greater, 1, True),
    "LessOrEqual": (np.less_equal, 12, False),
    "GreaterOrEqual": (np.greater_equal, 12, False),
    "BitwiseAnd": (np.bitwise_and, 18, False),
    "BitwiseOr": (np.bitwise_or, 18, False),
    "BitwiseXor": (np.bitwise_xor, 18, False),
}


def _binary_factory(fn):
    def factory(node, shapes, opset):
        return shape_free(lambda a, b: (fn(a, b),))

    return factory


def _legacy_binary_factory(fn):
    """Opsets < 7: with broadcast=1 and an axis, B's dims line up with A's starting at that axis."""

    def factory(node, shapes, opset):
        axis = node.attr("axis")
        if not node.attr("broadcast", 0) or axis is None:
            return lambda a, b: (fn(a, b),)

        def kernel(a, b):
            start = axis + a.ndim if axis < 0 else axis
            trailing = a.ndim - start - b.ndim
            return (fn(a, b.reshape(b.shape + (1,) * trailing)),)

        return kernel

    return factory


for _op, (_fn, _since, _legacy) in _BINARY.items():
    if _legacy:
        register(_op, since=1)(_legacy_binary_factory(_fn))
        register(_op, since=7)(_binary_factory(_fn))
    else:
        register(_op, since=_since)(_binary_factory(_fn))


@register("Mod", since=10)
def mod(node, shapes, opset):
    fmod = node.attr("fmod", 0)
    if fmod not in (0, 1):
        raise InvalidGraphError(f"node {node.name!r} (Mod): attribute 'fmod' is {fmod}; expected 0 or 1")
    # np.fmod truncates (C fmod, sign of A); np.mod floors (Python %, sign of B).
    fn = quiet(np.fmod if fmod else np.mod)

    def kernel(a, b):
        if b.dtype.kind in "iu":
            _nonzero_divisor(b, "Mod")
        return (fn(a, b),)

    return kernel


@register("BitShift", since=11)
def bit_shift(node, shapes, opset):
    direction = node.attr("direction")
    if direction not in ("LEFT", "RIGHT"):
        raise InvalidGraphError(
            f"node {node.name!r} (BitShift): attribute 'direction' is {direction!r}; expected 'LEFT' or 'RIGHT'"
        )
    # numpy yields 0 (or -1 for a negative value shifted right) once the shift reaches the bit
    # width, which is what BitShift-28 specifies for out-of-range shift amounts.
    fn = np.left_shift if direction == "LEFT" else np.right_shift
    return lambda x, y: (fn(x, y),)


@register("Where", since=9)
def where(node, shapes, opset):
    return shape_free(lambda condition, x, y: (np.where(condition, x, y),))


def _clip(x, low, high):
    # max-then-min gives `high` everywhere when low > high, as ONNX specifies; NaN propagates.
    if low is not None:
        x = np.maximum(x, np.asarray(low, dtype=x.dtype).reshape(()))
    if high is not None:
        x = np.minimum(x, np.asarray(high, dtype=x.dtype).reshape(()))
    return x


@register("Clip", since=1)
def clip_attrs(node, shapes, opset):
    low, high = node.attr("min"), node.attr("max")
    return lambda x: (_clip(x, low, high),)


@register("Clip", since=11)
def clip(node, shapes, opset):
    return lambda x, low=None, high=None: (_clip(x, low, high),)


def _variadic_factory(fn):
    def factory(node, shapes, opset):
        return shape_free(lambda *xs: (functools.reduce(fn, xs),))

    return factory


register("Max", since=1)(_variadic_factory(np.maximum))


register("Min", since=1)(_variadic_factory(np.minimum))


register("Sum", since=1)(_variadic_factory(np.add))


@register("Mean", since=1)
def mean(node, shapes, opset):
    def kernel(*xs):
        total = functools.reduce(np.add, xs)
        return (np.divide(total, scalar(len(xs), total.dtype)),)

    return kernel


_SATURATING_FLOAT8 = {
    DataType.FLOAT8E4M3FN,
    DataType.FLOAT8E4M3FNUZ,
    DataType.FLOAT8E5M2,
    DataType.FLOAT8E5M2FNUZ,
}


_ROUND_MODES = ("up", "down", "nearest")


def _saturate(x, dtype):
    """Clamp to the float8 type's finite range (infinities included) before the rounding cast."""
    limit = float(ml_dtypes.finfo(dtype).max)
    wide = x if x.dtype == np.float64 else x.astype(np.float32)
    return np.clip(wide, -limit, limit)


def _to_float8e8m0(x, saturate, round_mode):
    """FLOAT8E8M0 holds only an exponent: it is float32's biased exponent field, rounded."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32)
    field = ((bits >> 23) & 0xFF).astype(np.int32)
    mantissa = bits & 0x7FFFFF
    if round_mode == "up":
        exponent = field + (mantissa != 0)
    elif round_mode == "nearest":  # the midpoint between 2^e and 2^(e+1) is mantissa 0.5; ties up
        exponent = field + (mantissa >= 0x400000)
    else:
        exponent = field
    exponent = np.where(exponent > 254, 254 if saturate else 255, exponent)
    special = field == 0xFF  # NaN stays NaN; infinity saturates to the largest value
    exponent = np.where(special, np.where((mantissa == 0) & saturate, 254, 255), exponent)
    return exponent.astype(np.uint8).view(ml_dtypes.float8_e8m0fnu)


def _parse_strings(x, dtype):
    # Integers parse exactly when they can; "2.5"-style or "INF"/"NaN" literals go through float64.
    if dtype.kind in "iu":
        try:
            return x.astype(dtype)
        except (ValueError, OverflowError):
            pass
    return x.astype(np.float64).astype(dtype)


@quiet
def cast_to(x, to, saturate=True, round_mode="up"):
    if to is DataType.STRING:
        return x if x.dtype == object else x.astype(str).astype(object)
    dtype = to.numpy
    if x.dtype == object:
        return _parse_strings(x, dtype)
    if to is DataType.FLOAT8E8M0:
        return _to_float8e8m0(x, saturate, round_mode)
    if saturate and to in _SATURATING_FLOAT8:
        x = _saturate(x, dtype)
    return x.astype(dtype, copy=False)


def _target_type(node, value):
    try:
        return DataType.parse(value)
    except (ValueError, KeyError) as exc:
        raise InvalidGraphError(
            f"node {node.name!r} ({node.op_type}): attribute 'to' is {value!r}; expected an ONNX tensor data type"
        ) from exc


def _cast_options(node):
    saturate = bool(node.attr("saturate", 1))
    round_mode = node.attr("round_mode", "up")
    if round_mode not in _ROUND_MODES:
        raise InvalidGraphError(
            f"node {node.name!r} ({node.op_type}): attribute 'round_mode' is {round_mode!r}; expected one "
            f"of {_ROUND_MODES}"
        )
    return saturate, round_mode


def _cast_kernel(to, saturate=True, round_mode="up"):
    if to is DataType.STRING or to is DataType.FLOAT8E8M0 or to in _SATURATING_FLOAT8:
        return shape_free(lambda x: (cast_to(x, to, saturate, round_mode),))
    dtype = to.numpy

    def kernel(x):
        # Integers and booleans convert to a numeric type without floating-point warnings: no errstate
        # (its context costs more than casting a decoder's position ids).
        if x.dtype.kind in "biu":
            return (x.astype(dtype, copy=False),)
        return (cast_to(x, to, saturate, round_mode),)

    return shape_free(kernel)


@register("Cast", since=1)
def cast_v1(node, shapes, opset):
    # Cast-1 spells 'to' as a type name ("FLOAT"); later versions use the enum value.
    return _cast_kernel(_target_type(node, node.attr("to")))


@register("Cast", since=19)
def cast(node, shapes, opset):
    return _cast_kernel(_target_type(node, node.attr("to")), *_cast_options(node))


@register("CastLike", since=15)
def cast_like(node, shapes, opset):
    saturate, round_mode = _cast_options(node)
    return lambda x, like: (cast_to(x, DataType.from_numpy(like.dtype), saturate, round_mode),)
