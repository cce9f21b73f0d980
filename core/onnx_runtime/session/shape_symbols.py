"""The symbolic values of :mod:`.shape_program` and the rules that evaluate operators over them.

Three kinds of value, each exact for every point of its class: :class:`Affine` (an integer array of fixed
shape, affine in the symbols), :class:`Linear` (a Range and what shifts, negates, scales or broadcasts it) and
:class:`Window` (a window, with affine bounds, of a base array that the step's own kernel computed once).
An operator these rules do not cover raises :class:`Unsupported`; its step then runs per call.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from onnx import helper

from ..ir import Node
from . import shape_rules
from .shape_fills import FILL_LAYOUT, gathered_shape, index_run
from .shape_layout import Unsupported, broadcast_forms, concat_shape, layout_shapes, matmul_shape

Step = Any  # a steps.Step (steps.py imports this package's shape_program)

# Lengths the base arrays cover on either side of the call they were built at.
MARGIN = 256
# Largest base array a program keeps.
BASE_BYTES = 4 << 20

_ELEMENTWISE = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "And", "Or", "Xor", "Not", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Tanh", "Sigmoid",
    "Relu", "Cast", "Floor", "Ceil", "Sign", "IsNaN", "IsInf", "Mod", "Identity", "Cos", "Sin",
})
# Output 0 has input 0's shape.
_SAME_SHAPE = frozenset({
    "Identity", "Cast", "Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Tanh", "Sigmoid", "Relu", "Gelu",
    "Softmax", "Not", "LayerNormalization", "RMSNormalization", "SkipRMSNormalization", "SkipLayerNormalization",
    "SimplifiedLayerNormalization", "DequantizeLinear", "QuantizeLinear", "Sin", "Cos", "Floor", "Ceil", "Round",
    "Sign",
})
# Elementwise where the scale and zero point are single values (per tensor).
_PER_TENSOR = frozenset({"DequantizeLinear", "QuantizeLinear"})
_BROADCAST = _ELEMENTWISE - {"Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Tanh", "Sigmoid", "Relu",
                             "Cast", "Floor", "Ceil", "Sign", "IsNaN", "IsInf", "Not", "Identity", "Cos", "Sin"}


# -- affine forms: int64 vectors (constant, coefficient of symbol 0, 1, ...) ----------------------------
def form_of(value: int, symbols: int) -> np.ndarray:
    """The constant ``value`` as an affine form over ``symbols`` symbols."""
    form = np.zeros(1 + symbols, np.int64)
    form[0] = value
    return form


def _is_const(form: np.ndarray, value: int | None = None) -> bool:
    return not form[1:].any() and (value is None or int(form[0]) == value)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(a, b))


class Affine:
    """An integer array of fixed shape whose entries are affine in the symbols: ``coef[0] + sum_k coef[1+k] s_k``."""

    __slots__ = ("coef", "dtype")

    def __init__(self, coef: np.ndarray, dtype: np.dtype | type):
        self.coef = coef  # (1 + symbols, *shape)
        self.dtype = np.dtype(dtype)

    @property
    def shape(self) -> tuple:
        return self.coef.shape[1:]

    def at(self, point: np.ndarray) -> np.ndarray:
        coef = self.coef  # (one product: tensordot's own Python costs several times it, at every new length)
        return (point @ coef.reshape(coef.shape[0], coef[0].size)).reshape(coef.shape[1:]).astype(self.dtype,
                                                                                                   copy=False)


class Linear:
    """``beta + sum_axis alpha[axis] * index[axis]`` over extents affine in the symbols (a Range and what
    shifts, negates, scales or broadcasts it); an axis of extent 1 has alpha 0."""

    __slots__ = ("alpha", "beta", "extents", "dtype")

    def __init__(self, alpha: tuple[int, ...], beta: np.ndarray, extents: tuple, dtype: np.dtype):
        self.alpha = tuple(0 if _is_const(ext, 1) else a for a, ext in zip(alpha, extents))
        self.beta = beta
        self.extents = extents
        self.dtype = np.dtype(dtype)


class Window:
    """``base[lo_0:lo_0 + ext_0, ...]`` per axis; an axis whose base length is 1 is broadcast to its extent."""

    __slots__ = ("base", "lows", "extents")

    def __init__(self, base: np.ndarray, lows: tuple, extents: tuple):
        self.base = base
        self.lows = lows
        self.extents = extents


def _const_window(array: np.ndarray, symbols: int) -> Window:
    return Window(array, tuple(form_of(0, symbols) for _ in array.shape),
                  tuple(form_of(n, symbols) for n in array.shape))


class Builder:
    """Evaluates the steps once over the symbols; ``point`` is where the call that builds it is, and the base
    arrays cover ``MARGIN`` lengths around it."""

    def __init__(self, symbols: int, point: np.ndarray, constants: dict, shapes: dict, static_shapes: dict):
        self.symbols = symbols
        self.point = point
        self.constants = constants  # slot -> array (initializers the steps read)
        self.shapes = shapes  # slot -> tuple of affine forms (feeds, and what propagation found)
        self.static = static_shapes  # slot -> tuple of ints: the plan's declared static shapes
        self.values: dict = {}
        self.guards: list[np.ndarray] = []

    # -- values ---------------------------------------------------------------------------------------
    def value(self, slot: int):
        if slot in self.values:
            return self.values[slot]
        if slot in self.constants:
            return self.constants[slot]
        raise Unsupported("a value computed per call")

    def shape_of(self, slot: int) -> tuple | None:
        if slot in self.values:
            return _shape_forms(self.values[slot], self.symbols)
        if slot in self.constants:
            return tuple(form_of(n, self.symbols) for n in np.shape(self.constants[slot]))
        if slot in self.shapes:
            return self.shapes[slot]
        static = self.static.get(slot)
        if static is not None:
            return tuple(form_of(n, self.symbols) for n in static)
        return None

    def ints(self, slot: int) -> list[int]:
        """A constant integer input (axes, a delta), as a list."""
        value = self.value(slot)
        if isinstance(value, Affine) and not value.coef[1:].any():
            return [int(v) for v in value.coef[0].reshape(-1)]
        if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
            return [int(v) for v in value.reshape(-1)]
        raise Unsupported("not a constant integer input")

    # -- steps ----------------------------------------------------------------------------------------
    def shape_only(self, step: Step) -> None:
        """Evaluate one shape-only step symbolically, or raise Unsupported."""
        node = step.node
        assert node is not None
        slots = [slot if name else None for slot, name in zip(step.inputs, node.inputs)]
        out = _evaluate(self, node, step, slots)
        self.values[step.outputs[0]] = out

    def propagate(self, step: Step) -> None:
        """Record the shape of a step the plan runs per call, where the rules give it from its inputs' shapes."""
        node = step.node
        if node is None or not step.outputs:
            return
        shapes = [self.shape_of(slot) if name else None for slot, name in zip(step.inputs, node.inputs)]
        rule = shape_rules.rule_of(node.domain, node.op_type)
        if rule is not None and rule.kind == shape_rules.SAME:  # output i has input i's shape
            self.shapes.update((slot, shape) for slot, shape in zip(step.outputs, shapes) if shape is not None)
            return
        try:
            shape = _propagated(node, shapes, self.symbols) or _declared_shape(node, shapes, self.symbols)
            if shape is None and node.domain in ("", "ai.onnx"):
                laid = layout_shapes(node, shapes, lambda i: self.sizes(step.inputs[i]), self.symbols)
                if laid is not None:
                    self.shapes.update((slot, out) for slot, out in zip(step.outputs, laid))
                    return
        except Unsupported:
            return
        if shape is not None:
            self.shapes[step.outputs[0]] = shape

    def sizes(self, slot: int) -> list[np.ndarray] | None:
        """A 1-D integer value (sizes, axes) as affine forms, or None where it is computed per call."""
        try:
            value = self.value(slot)
        except Unsupported:
            return None
        if isinstance(value, Affine) and len(value.shape) == 1:
            return [value.coef[:, i] for i in range(value.shape[0])]
        if isinstance(value, np.ndarray) and value.dtype.kind in "iu" and value.ndim == 1:
            return [form_of(int(v), self.symbols) for v in value]
        return None

    def guard(self, form: np.ndarray) -> None:
        """Record that ``form`` must be >= 0 at every instantiation."""
        if not _is_const(form):
            self.guards.append(form)
        elif form[0] < 0:
            raise Unsupported("a negative extent")


def _shape_forms(value, symbols: int) -> tuple:
    if isinstance(value, Affine):
        return tuple(form_of(n, symbols) for n in value.shape)
    if isinstance(value, (Linear, Window)):
        return value.extents
    return tuple(form_of(n, symbols) for n in np.shape(value))


def _propagated(node: Node, shapes: list, symbols: int) -> tuple | None:
    op = node.op_type
    if node.domain not in ("", "ai.onnx", "com.microsoft") or not shapes or shapes[0] is None:
        return None
    if op in _SAME_SHAPE:
        return shapes[0]
    if any(s is None for s in shapes):
        return None
    if op in _BROADCAST:
        return broadcast_forms(shapes, symbols)
    if op == "Concat":
        return concat_shape(node, shapes, symbols)
    if op == "Transpose":
        perm = node.attr("perm") or list(range(len(shapes[0])))[::-1]
        return tuple(shapes[0][p] for p in perm)
    if op == "Gather":
        axis = node.attr("axis", 0) % len(shapes[0])
        return shapes[0][:axis] + shapes[1] + shapes[0][axis + 1:]
    if op in ("MatMul", "DynamicQuantizeMatMul"):
        return matmul_shape(shapes[:2], symbols)
    if op == "MatMulNBits" and node.attr("N") is not None:  # A (..., K) times a (K, N) weight
        return shapes[0][:-1] + (form_of(int(node.attr("N")), symbols),)
    return None


def _declared_shape(node: Node, shapes: list, symbols: int) -> tuple | None:
    """Output 0's shape by the rule a provider declared for its own operator (shape_rules)."""
    rule = shape_rules.rule_of(node.domain, node.op_type)
    if rule is not None and rule.kind == shape_rules.CONCAT:
        parts = shapes[:len(shapes) - rule.operands[0]]
        return concat_shape(node, parts, symbols) if parts and all(s is not None for s in parts) else None
    if rule is None or any(i >= len(shapes) or shapes[i] is None for i in rule.operands):
        return None
    operands = [shapes[i] for i in rule.operands]
    if rule.kind == shape_rules.FIRST:
        return operands[0]
    if rule.kind == shape_rules.BROADCAST:
        return broadcast_forms(operands, symbols)
    if rule.kind == shape_rules.MATMUL and not node.attr("transA", 0) and not node.attr("transB", 0):
        return matmul_shape(operands, symbols)
    return None


def _evaluate(b: Builder, node: Node, step: Step, slots: list):
    op = node.op_type
    if node.domain not in ("", "ai.onnx"):
        raise Unsupported(op)
    if op in ("Shape", "Size"):
        return _shape_op(b, node, slots)
    inputs = [b.value(slot) if slot is not None else None for slot in slots]
    kinds = {type(v) for v in inputs if v is not None}
    if kinds <= {np.ndarray}:
        raise Unsupported("constant inputs only")  # (folding's work; nothing symbolic to do)
    return _dispatch(b, node, step, inputs, slots, kinds)


def _dispatch(b: Builder, node: Node, step: Step, inputs: list, slots: list, kinds: set):
    op = node.op_type
    if Linear not in kinds and Window not in kinds and op in _AFFINE_OPS:
        try:
            return _AFFINE_OPS[op](b, node, inputs, slots)
        except Unsupported:
            if op not in _ELEMENTWISE:
                raise
    if op == "Range":
        return _range(b, inputs)
    if op in ("ConstantOfShape", "Expand"):
        return _stretched(b, step, op, inputs)
    if op in _COMPARISONS and Window not in kinds:
        return _comparison(b, step, inputs)
    if Linear in kinds and op in _LINEAR_OPS:
        try:
            return _LINEAR_OPS[op](b, node, inputs, slots)
        except Unsupported:
            pass
    if op in FILL_LAYOUT and isinstance(inputs[0], Window) and inputs[0].base.size == 1:
        return _fill(b, node, inputs[0], slots)
    return _window_op(b, node, step, op, inputs, slots)


def _shape_op(b: Builder, node: Node, slots: list) -> Affine:
    shape = b.shape_of(slots[0])
    if shape is None:
        raise Unsupported("a shape the rules do not give")
    if node.op_type == "Size":
        consts = [d for d in shape if _is_const(d)]
        if len(shape) - len(consts) > 1:
            raise Unsupported("a product of symbols")
        size = int(np.prod([int(d[0]) for d in consts])) if consts else 1
        form = next((d for d in shape if not _is_const(d)), form_of(1, b.symbols)) * size
        return Affine(form.copy(), np.int64)
    rank = len(shape)
    start, end = node.attr("start", 0), node.attr("end", rank)
    start, end = (max(0, min(rank, v + rank if v < 0 else v)) for v in (start, end))
    if end <= start:
        return Affine(np.zeros((1 + b.symbols, 0), np.int64), np.int64)
    return Affine(np.stack(shape[start:end], axis=1), np.int64)


# -- affine ---------------------------------------------------------------------------------------------
def _as_affine(value, symbols: int) -> Affine:
    if isinstance(value, Affine):
        return value
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        coef = np.zeros((1 + symbols, *value.shape), np.int64)
        coef[0] = value
        return Affine(coef, value.dtype)
    raise Unsupported("not an integer")


def _unsqueeze_axes(b: Builder, node: Node, slots: list, rank: int) -> list[int]:
    """Unsqueeze's axes, in the output's rank, ascending (inserting them in this order is exact)."""
    given = b.ints(slots[1]) if len(slots) > 1 and slots[1] is not None else list(node.attr("axes") or [])
    return sorted(a % (rank + len(given)) for a in given)


def _squeeze_axes(b: Builder, node: Node, slots: list, extents: list | tuple) -> list[int]:
    if (len(slots) > 1 and slots[1] is not None) or node.attr("axes"):
        return _axes(b, node, slots, len(extents))
    return [a for a, e in enumerate(extents) if _is_const(e, 1)]


def _axes(b: Builder, node: Node, slots: list, rank: int) -> list[int]:
    axes = b.ints(slots[1]) if len(slots) > 1 and slots[1] is not None else list(node.attr("axes") or [])
    return sorted(a % rank for a in axes)


def _affine_unsqueeze(b: Builder, node: Node, coef: np.ndarray, inputs: list, slots: list) -> np.ndarray:
    for axis in _unsqueeze_axes(b, node, slots, coef.ndim - 1):
        coef = np.expand_dims(coef, axis + 1)
    return coef


def _affine_squeeze(b: Builder, node: Node, coef: np.ndarray, inputs: list, slots: list) -> np.ndarray:
    axes = _squeeze_axes(b, node, slots, [form_of(d, b.symbols) for d in coef.shape[1:]])
    return np.squeeze(coef, axis=tuple(a + 1 for a in axes))


def _affine_reshape(b: Builder, node: Node, coef: np.ndarray, inputs: list, slots: list) -> np.ndarray:
    target = b.ints(slots[1])
    if any(t <= 0 for t in target):
        raise Unsupported("a reshape that infers or copies a dimension")
    return coef.reshape((1 + b.symbols, *target))


def _affine_gather(b: Builder, node: Node, coef: np.ndarray, inputs: list, slots: list) -> np.ndarray:
    indices = inputs[1]
    if not isinstance(indices, np.ndarray):
        raise Unsupported("symbolic indices")
    return np.take(coef, indices, axis=node.attr("axis", 0) % (coef.ndim - 1) + 1)


def _affine_slice(b: Builder, node: Node, coef: np.ndarray, inputs: list, slots: list) -> np.ndarray:
    starts, ends = b.ints(slots[1]), b.ints(slots[2])
    axes = b.ints(slots[3]) if len(slots) > 3 and slots[3] is not None else list(range(len(starts)))
    steps = b.ints(slots[4]) if len(slots) > 4 and slots[4] is not None else [1] * len(starts)
    index = [slice(None)] * coef.ndim
    for start, end, axis, stride in zip(starts, ends, axes, steps):
        index[axis % (coef.ndim - 1) + 1] = slice(start, end, stride)
    return coef[tuple(index)]


def _affine_concat(b: Builder, node: Node, coef: np.ndarray, inputs: list, slots: list) -> np.ndarray:
    parts = [_as_affine(v, b.symbols).coef for v in inputs if v is not None]
    return np.concatenate(parts, axis=node.attr("axis", 0) % (coef.ndim - 1) + 1)


def _affine_layout(transform):
    def apply(b: Builder, node: Node, inputs: list, slots: list) -> Affine:
        first = _as_affine(inputs[0], b.symbols)
        return Affine(np.ascontiguousarray(transform(b, node, first.coef, inputs, slots)), first.dtype)
    return apply


def _affine_arithmetic(b: Builder, node: Node, inputs: list, slots: list) -> Affine:
    op = node.op_type
    left, right = (_as_affine(v, b.symbols) for v in inputs[:2])
    lc, rc = _aligned(left.coef, right.coef)
    if op == "Mul":
        if left.coef[1:].any() and right.coef[1:].any():
            raise Unsupported("a product of symbols")
        coef = lc * rc[:1] if not right.coef[1:].any() else rc * lc[:1]
    else:
        coef = lc + rc if op == "Add" else lc - rc
    return Affine(np.ascontiguousarray(coef), left.dtype)


def _affine_cast(b: Builder, node: Node, inputs: list, slots: list) -> Affine:
    first = _as_affine(inputs[0], b.symbols)
    target = _cast_target(node)
    if target.kind not in "iu":
        raise Unsupported("a cast to a non-integer type")
    return Affine(first.coef, target)


_AFFINE_OPS = {
    "Identity": _affine_layout(lambda b, node, coef, inputs, slots: coef),
    "Neg": _affine_layout(lambda b, node, coef, inputs, slots: -coef),
    "Unsqueeze": _affine_layout(_affine_unsqueeze), "Squeeze": _affine_layout(_affine_squeeze),
    "Reshape": _affine_layout(_affine_reshape), "Gather": _affine_layout(_affine_gather),
    "Slice": _affine_layout(_affine_slice), "Concat": _affine_layout(_affine_concat),
    "Add": _affine_arithmetic, "Sub": _affine_arithmetic, "Mul": _affine_arithmetic, "Cast": _affine_cast,
}


def _cast_target(node: Node) -> np.dtype:
    """The element type a Cast gives (its ``to`` attribute)."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(int(node.attr("to"))))


def _aligned(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coefficient arrays with their element ranks right-aligned for broadcasting."""
    rank = max(a.ndim, b.ndim)
    return (a.reshape(a.shape[:1] + (1,) * (rank - a.ndim) + a.shape[1:]),
            b.reshape(b.shape[:1] + (1,) * (rank - b.ndim) + b.shape[1:]))


# -- linear ---------------------------------------------------------------------------------------------
def _scalar_form(value, symbols: int) -> np.ndarray:
    affine = _as_affine(value, symbols)
    if affine.coef[0].size != 1:
        raise Unsupported("not a scalar")
    return affine.coef.reshape(1 + symbols)


def _range(b: Builder, inputs: list) -> Linear:
    start, limit = (_scalar_form(v, b.symbols) for v in inputs[:2])
    delta = inputs[2]
    if not isinstance(delta, np.ndarray) or delta.size != 1 or delta.dtype.kind not in "iu" \
            or abs(int(delta.reshape(-1)[0])) != 1:
        raise Unsupported("a range of step other than 1 or -1")
    step = int(delta.reshape(-1)[0])
    extent = (limit - start) * step
    b.guard(extent)
    return Linear((step,), start, (extent,), _as_affine(inputs[0], b.symbols).dtype)


def _as_linear(value, symbols: int) -> Linear:
    if isinstance(value, Linear):
        return value
    affine = _as_affine(value, symbols)
    if any(d != 1 for d in affine.shape):
        raise Unsupported("not a broadcast scalar")
    rank = len(affine.shape)
    return Linear((0,) * rank, affine.coef.reshape(1 + symbols), (form_of(1, symbols),) * rank, affine.dtype)


def _linear_layout(b: Builder, node: Node, inputs: list, slots: list) -> Linear:
    first, op = inputs[0], node.op_type
    if not isinstance(first, Linear):
        raise Unsupported("not a linear value")
    alpha, extents, beta, dtype = list(first.alpha), list(first.extents), first.beta, first.dtype
    if op == "Unsqueeze":
        for axis in _unsqueeze_axes(b, node, slots, len(alpha)):
            alpha.insert(axis, 0)
            extents.insert(axis, form_of(1, b.symbols))
    elif op == "Squeeze":
        axes = _squeeze_axes(b, node, slots, extents)
        if any(not _is_const(extents[a], 1) for a in axes):
            raise Unsupported("squeezing a symbolic axis")
        alpha = [x for a, x in enumerate(alpha) if a not in axes]
        extents = [x for a, x in enumerate(extents) if a not in axes]
    elif op == "Transpose":
        perm = node.attr("perm") or list(range(len(alpha)))[::-1]
        alpha, extents = [alpha[p] for p in perm], [extents[p] for p in perm]
    elif op == "Neg":
        alpha, beta = [-x for x in alpha], -beta
    elif op == "Cast":
        dtype = _cast_target(node)
        if dtype.kind not in "iu":
            raise Unsupported("a cast to a non-integer type")
    return Linear(tuple(alpha), beta, tuple(extents), dtype)


def _linear_arithmetic(b: Builder, node: Node, inputs: list, slots: list) -> Linear:
    left, right = (_as_linear(v, b.symbols) for v in inputs[:2])
    if node.op_type == "Mul":
        return _linear_scaled(b, left, right)
    return _linear_sum(b, left, right, 1 if node.op_type == "Add" else -1)


def _linear_sum(b: Builder, left: Linear, right: Linear, sign: int) -> Linear:
    extents = broadcast_forms([left.extents, right.extents], b.symbols)
    rank = len(extents)
    la = (0,) * (rank - len(left.alpha)) + left.alpha
    ra = (0,) * (rank - len(right.alpha)) + right.alpha
    return Linear(tuple(x + sign * y for x, y in zip(la, ra)), left.beta + sign * right.beta, extents, left.dtype)


def _linear_scaled(b: Builder, left: Linear, right: Linear) -> Linear:
    scale, other = (right, left) if not any(right.alpha) and _is_const(right.beta) else (left, right)
    if any(scale.alpha) or not _is_const(scale.beta):
        raise Unsupported("a product of symbolic values")
    c = int(scale.beta[0])
    extents = broadcast_forms([other.extents, scale.extents], b.symbols)
    alpha = (0,) * (len(extents) - len(other.alpha)) + tuple(c * a for a in other.alpha)
    return Linear(alpha, other.beta * c, extents, other.dtype)


_LINEAR_OPS = {op: _linear_layout for op in ("Unsqueeze", "Squeeze", "Transpose", "Identity", "Neg", "Cast")}
_LINEAR_OPS.update({op: _linear_arithmetic for op in ("Add", "Sub", "Mul")})
_COMPARISONS = frozenset({"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"})


def _comparison(b: Builder, step: Step, inputs: list) -> Window:
    """An integer comparison of linear or affine values, as the same comparison of their difference with 0
    (exact for integers): the difference is linear, so a window of one base holds it."""
    left, right = (_as_linear(v, b.symbols) for v in inputs[:2])
    if left.dtype.kind not in "iu" or right.dtype.kind not in "iu":
        raise Unsupported("not integers")
    difference = _to_window(b, _linear_sum(b, left, right, -1))
    (base,) = step.run(difference.base, np.zeros((), difference.base.dtype))[:1]
    window = Window(np.asarray(base), difference.lows, difference.extents)
    _check_window(b, window)
    return window


def _to_window(b: Builder, value: Linear) -> Window:
    """The window of a base array that holds ``value`` at every point within ``MARGIN`` of the builder's."""
    n, point = b.symbols, b.point
    absorbing = next((a for a, x in enumerate(value.alpha) if abs(x) == 1), None)
    if absorbing is None and not _is_const(value.beta):  # (one position, say): an axis of extent 1 carries it
        absorbing = next((a for a, ext in enumerate(value.extents) if _is_const(ext, 1)), None)
    alphas = value.alpha if absorbing is None or value.alpha[absorbing] else \
        value.alpha[:absorbing] + (1,) + value.alpha[absorbing + 1:]
    shape, lows = [], []
    beta_now = int(value.beta @ point)
    grids = []
    for axis, (alpha, ext) in enumerate(zip(alphas, value.extents)):
        if alpha == 0:
            shape.append(1)
            lows.append(form_of(0, n))
            grids.append(np.zeros(1, np.int64))
            continue
        now = int(ext @ point)
        if axis == absorbing:
            origin = MARGIN - alpha * beta_now  # base index j holds alpha * (j - origin): the window starts at lo
            low = form_of(origin, n) + alpha * value.beta
            length = 2 * MARGIN + now
            grids.append(alpha * (np.arange(length, dtype=np.int64) - origin))
        else:
            low = form_of(0, n)
            length = now + (MARGIN if not _is_const(ext) else 0)
            grids.append(alpha * np.arange(length, dtype=np.int64))
        shape.append(length)
        lows.append(low)
    base = np.zeros(shape, np.int64) + (0 if absorbing is not None else beta_now)
    if absorbing is None and not _is_const(value.beta):
        raise Unsupported("a symbolic offset with no unit step to carry it")
    for axis, grid in enumerate(grids):
        view = [1] * len(shape)
        view[axis] = len(grid)
        base = base + grid.reshape(view)
    window = Window(base.astype(value.dtype), tuple(lows), value.extents)
    _check_window(b, window)
    return window


def _check_window(b: Builder, window: Window) -> None:
    if window.base.nbytes > BASE_BYTES:
        raise Unsupported("a base array past the size bound")
    for n, lo, ext in zip(window.base.shape, window.lows, window.extents):
        b.guard(ext)
        if n != 1:
            b.guard(lo)
            b.guard(form_of(n, b.symbols) - lo - ext)


def _stretched(b: Builder, step: Step, op: str, inputs: list) -> Window:
    """ConstantOfShape / Expand to an affine shape: a base of length 1 broadcast along each symbolic axis."""
    n = b.symbols
    target = _as_affine(inputs[0] if op == "ConstantOfShape" else inputs[1], n)
    if len(target.shape) != 1:
        raise Unsupported("a shape that is not a vector")
    dims = [target.coef[:, i] for i in range(target.shape[0])]
    if op == "ConstantOfShape":
        (base,) = step.run(np.ones(len(dims), np.int64))[:1]
        window = Window(np.asarray(base), tuple(form_of(0, n) for _ in dims), tuple(dims))
        _check_window(b, window)
        return window
    source = _as_window(b, inputs[0])
    rank = max(len(dims), len(source.extents))
    dims = [form_of(1, n)] * (rank - len(dims)) + dims
    pad = rank - len(source.extents)
    base = source.base.reshape((1,) * pad + source.base.shape)
    lows = (form_of(0, n),) * pad + source.lows
    extents = (form_of(1, n),) * pad + source.extents
    out_ext = []
    for dim, ext in zip(dims, extents):
        if _is_const(dim, 1) or _same(dim, ext):
            out_ext.append(ext)
        elif _is_const(ext, 1):
            out_ext.append(dim)
        else:
            raise Unsupported("an expand not known to broadcast")
    window = Window(base, lows, tuple(out_ext))
    _check_window(b, window)
    return window


# -- windows --------------------------------------------------------------------------------------------
def _as_window(b: Builder, value) -> Window:
    if isinstance(value, Window):
        return value
    if isinstance(value, Linear):
        return _to_window(b, value)
    if isinstance(value, Affine):
        if value.coef[1:].any():
            raise Unsupported("an affine value in an elementwise operator")
        return _const_window(value.at(b.point), b.symbols)
    return _const_window(np.asarray(value), b.symbols)


def _window_op(b: Builder, node: Node, step: Step, op: str, inputs: list, slots: list) -> Window:
    n = b.symbols
    if op == "Concat":
        return _window_concat(b, node, inputs)
    if op in _PER_TENSOR and all(v is None or (type(v) is np.ndarray and v.size == 1) for v in inputs[1:]):
        # one scale and zero point: elementwise, with them passed as they are (aligned to the input's rank
        # they would read as per-axis parameters)
        return _window_elementwise(b, step, inputs[:1], [v for v in inputs[1:] if v is not None])
    if op in _ELEMENTWISE:
        return _window_elementwise(b, step, inputs)
    source = _as_window(b, inputs[0])
    base = source.base
    lows: list = list(source.lows)
    extents: list = list(source.extents)
    if op == "Unsqueeze":
        for axis in _unsqueeze_axes(b, node, slots, len(lows)):
            base = np.expand_dims(base, axis)
            lows.insert(axis, form_of(0, n))
            extents.insert(axis, form_of(1, n))
    elif op == "Squeeze":
        axes = _squeeze_axes(b, node, slots, extents)
        if any(not _is_const(extents[a], 1) or (base.shape[a] != 1 and not _is_const(lows[a])) for a in axes):
            raise Unsupported("squeezing a symbolic or moving axis")
        # A squeezed axis keeps the one element its window holds.
        base = base[tuple(slice(int(lows[a][0]), int(lows[a][0]) + 1) if a in axes else slice(None)
                          for a in range(base.ndim))]
        base = np.squeeze(base, axis=tuple(axes))
        lows = [x for a, x in enumerate(lows) if a not in axes]
        extents = [x for a, x in enumerate(extents) if a not in axes]
    elif op == "Transpose":
        perm = node.attr("perm") or list(range(len(lows)))[::-1]
        base, lows, extents = base.transpose(perm), [lows[p] for p in perm], [extents[p] for p in perm]
    elif op == "Gather" and isinstance(inputs[0], np.ndarray):
        axis = node.attr("axis", 0) % inputs[0].ndim
        indices = _trimmed(_as_window(b, inputs[1]), inputs[0].shape[axis])
        (base,) = step.run(inputs[0], indices.base)[:1]
        base = np.asarray(base)
        fixed = [(form_of(0, n), form_of(d, n)) for d in inputs[0].shape]
        layout = fixed[:axis] + list(zip(indices.lows, indices.extents)) + fixed[axis + 1:]
        lows, extents = [lo for lo, _ in layout], [ext for _, ext in layout]
    else:
        raise Unsupported(op)
    window = Window(np.ascontiguousarray(base), tuple(lows), tuple(extents))
    _check_window(b, window)
    return window


def _fill(b: Builder, node: Node, source: Window, slots: list) -> Window:
    """``source``, a fill (an all-ones mask), gathered or moved: the gathers' indices are shape-only values made
    from the same feed shapes (the program is checked against the kernels where it is built)."""
    if node.op_type.startswith("Gather"):
        indices = b.shape_of(slots[1]) if len(slots) > 1 and slots[1] is not None else None
        shape = None if indices is None else gathered_shape(node, tuple(source.extents), tuple(indices))
    else:
        laid = layout_shapes(node, [source.extents], lambda i: b.sizes(slots[i]) if slots[i] is not None else None,
                             b.symbols)
        shape = None if laid is None else tuple(laid[0])
    if shape is None:
        raise Unsupported(f"{node.op_type}'s shape")
    window = Window(source.base.reshape((1,) * len(shape)), tuple(form_of(0, b.symbols) for _ in shape), shape)
    _check_window(b, window)
    return window


def _trimmed(indices: Window, size: int) -> Window:
    """``indices`` cut to the entries in ``[0, size)`` (a table ends before the margin does): the guards keep a call
    inside the cut, and one past it runs the Gather, which reports it."""
    try:
        run = index_run(indices.base, size)
    except ValueError as exc:
        raise Unsupported(str(exc)) from None
    if run is None:
        return indices
    axis, start, stop = run
    lows = list(indices.lows)
    lows[axis] = lows[axis] - form_of(start, len(lows[axis]) - 1)
    cut = tuple(slice(start, stop) if a == axis else slice(None) for a in range(indices.base.ndim))
    return Window(indices.base[cut], tuple(lows), indices.extents)


def _window_elementwise(b: Builder, step: Step, inputs: list, params: tuple | list = ()) -> Window:
    """The step's kernel over the aligned bases: elementwise, so its window is the kernel's result on the window.
    ``params``: constant inputs after those, passed unaligned."""
    windows = [_as_window(b, v) for v in inputs if v is not None]
    bases, lows, extents = _align(windows, b.symbols)
    (base,) = step.run(*bases, *params)[:1]
    base = np.asarray(base)
    if base.shape != np.broadcast_shapes(*(x.shape for x in bases)):
        raise Unsupported("a kernel whose output is not its inputs' broadcast")
    window = Window(base, lows, extents)
    _check_window(b, window)
    return window


def _window_concat(b: Builder, node: Node, inputs: list) -> Window:
    """Concat along an axis every input holds whole (fixed extents): the other axes line up as broadcasting
    would, then the bases are joined."""
    n = b.symbols
    windows = [_as_window(b, v) for v in inputs if v is not None]
    rank = len(windows[0].extents)
    axis = node.attr("axis", 0) % rank
    if any(len(w.extents) != rank or not _is_const(w.lows[axis], 0) or not _is_const(w.extents[axis])
           or w.base.shape[axis] != int(w.extents[axis][0]) for w in windows):
        raise Unsupported("a concat along a windowed axis")
    bases, lows, extents = _align(windows, n, skip=axis)
    shape = np.broadcast_shapes(*(x.shape[:axis] + (1,) + x.shape[axis + 1:] for x in bases))
    bases = [np.broadcast_to(x, shape[:axis] + x.shape[axis:axis + 1] + shape[axis + 1:]) for x in bases]
    extents = extents[:axis] + (form_of(sum(x.shape[axis] for x in bases), n),) + extents[axis + 1:]
    window = Window(np.concatenate(bases, axis=axis), lows, extents)
    _check_window(b, window)
    return window


def _align(windows: list[Window], n: int, skip: int | None = None) -> tuple[list[np.ndarray], tuple, tuple]:
    """Bases cut so that numpy broadcasting lines their windows up, and the result's lows and extents; axis
    ``skip`` is left as it is (a concat's)."""
    rank = max(len(w.extents) for w in windows)
    padded = []
    for w in windows:
        pad = rank - len(w.extents)
        padded.append((w.base.reshape((1,) * pad + w.base.shape), (form_of(0, n),) * pad + w.lows,
                       (form_of(1, n),) * pad + w.extents))
    cuts = [[slice(None)] * rank for _ in padded]
    lows, extents = [], []
    for axis in range(rank):
        if axis == skip:
            lows.append(form_of(0, n))
            extents.append(form_of(0, n))
            continue
        wide = [(i, base.shape[axis], lo[axis], ext[axis]) for i, (base, lo, ext) in enumerate(padded)
                if base.shape[axis] != 1]
        exts = [ext[axis] for _, lo, ext in padded if not _is_const(ext[axis], 1)]
        if exts and any(not _same(e, exts[0]) for e in exts[1:]):
            raise Unsupported("extents not known to agree")
        extent = exts[0] if exts else form_of(1, n)
        if not wide:
            lows.append(form_of(0, n))
            extents.append(extent)
            continue
        first_lo = wide[0][2]
        offsets = []
        for _, _, lo, _ in wide:
            shift = lo - first_lo
            if not _is_const(shift):
                raise Unsupported("windows that move apart")
            offsets.append(int(shift[0]))
        start = max(-c for c in offsets)
        stop = min(size - c for (_, size, _, _), c in zip(wide, offsets))
        if stop <= start:
            raise Unsupported("windows that do not overlap")
        for (i, _, _, _), c in zip(wide, offsets):
            cuts[i][axis] = slice(start + c, stop + c)
        lows.append(first_lo - start)
        extents.append(extent)
    bases = [base[tuple(cut)] for (base, _, _), cut in zip(padded, cuts)]
    return bases, tuple(lows), tuple(extents)
