"""Output shapes of layout operators that read sizes or axes from values (Reshape, Unsqueeze, Squeeze, Flatten,
Split, the reductions), for shape programs (shape_symbols.Builder.propagate): the sizes are constants or
values the program evaluated (affine in the symbols), so the output shape is affine too. A quantized (QDQ) graph
keeps such nodes where a float one fuses them away, and a Shape of their output is shape-only only if this
gives its shape.

Shapes are tuples of affine forms: int64 vectors (constant, coefficient of symbol 0, 1, ...). ``sizes(i)``
returns input i's value as a list of forms, or None where it is not known."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..ir import Node

Sizes = Callable[[int], "list[np.ndarray] | None"]


class Unsupported(Exception):
    """A step the symbolic evaluation does not cover: it runs per call (shape_symbols raises it too)."""


def _const(form: np.ndarray) -> int | None:
    return None if form[1:].any() else int(form[0])


def _unit(value: int, symbols: int) -> np.ndarray:
    form = np.zeros(1 + symbols, np.int64)
    form[0] = value
    return form


def _axes(node: Node, sizes: Sizes, rank: int, index: int = 1) -> list[int] | None:
    """Axes from input ``index`` (newer opsets) or the attribute, normalized to ``rank``; None where unknown."""
    if len(node.inputs) > index and node.inputs[index]:
        forms = sizes(index)
        values = [] if forms is None else [_const(f) for f in forms]
        if forms is None or None in values:
            return None
        return [int(a) % rank for a in values if a is not None]
    axes = node.attr("axes")
    return [] if axes is None else [int(a) % rank for a in axes]


def _product(dims: tuple, symbols: int) -> tuple[int, list[np.ndarray]] | None:
    """A product of forms as (constant factor, the non-constant forms); None where two are symbolic."""
    factor, symbolic = 1, []
    for d in dims:
        c = _const(d)
        if c is None:
            symbolic.append(d)
        else:
            factor *= c
    return (factor, symbolic) if len(symbolic) <= 1 else None


def _reshape(node: Node, shape: tuple, sizes: Sizes, symbols: int) -> tuple | None:
    target = sizes(1)
    if target is None:
        return None
    allow_zero = bool(node.attr("allowzero", 0))
    dims = [shape[i] if _const(t) == 0 and not allow_zero and i < len(shape) else t for i, t in enumerate(target)]
    free = [i for i, d in enumerate(dims) if _const(d) == -1]
    if not free:
        return tuple(dims)
    if len(free) > 1:
        return None
    whole = _product(shape, symbols)
    known = _product(tuple(d for i, d in enumerate(dims) if i != free[0]), symbols)
    if whole is None or known is None or known[0] == 0 or whole[0] % known[0]:
        return None
    ratio = whole[0] // known[0]
    if len(whole[1]) == len(known[1]) and all(np.array_equal(a, b) for a, b in zip(whole[1], known[1])):
        dims[free[0]] = _unit(ratio, symbols)
    elif len(whole[1]) == 1 and not known[1]:
        dims[free[0]] = whole[1][0] * ratio
    else:
        return None
    return tuple(dims)


def _flatten(node: Node, shape: tuple, sizes: Sizes, symbols: int) -> list[tuple] | None:
    axis = int(node.attr("axis", 1)) % (len(shape) + 1) if shape else 0
    head, tail = _product(shape[:axis], symbols), _product(shape[axis:], symbols)
    if head is None or tail is None:
        return None
    return [tuple(p[1][0] * p[0] if p[1] else _unit(p[0], symbols) for p in (head, tail))]


def _unsqueeze(node: Node, shape: tuple, sizes: Sizes, symbols: int) -> list[tuple] | None:
    raw = _axes(node, sizes, 1 << 30)  # (unnormalized: the output's rank counts them)
    if not raw:
        return None
    axes = [(a - (1 << 30) if a >= 1 << 29 else a) % (len(shape) + len(raw)) for a in raw]
    dims = list(shape)
    for axis in sorted(axes):
        dims.insert(axis, _unit(1, symbols))
    return [tuple(dims)]


def _squeeze(node: Node, shape: tuple, sizes: Sizes, symbols: int) -> list[tuple] | None:
    given = _axes(node, sizes, len(shape))
    if given is None:
        return None
    axes = given or [i for i, d in enumerate(shape) if _const(d) == 1]
    if any(_const(shape[a]) != 1 for a in axes):
        return None
    return [tuple(d for i, d in enumerate(shape) if i not in axes)]


def _reduce(node: Node, shape: tuple, sizes: Sizes, symbols: int) -> list[tuple] | None:
    given = _axes(node, sizes, len(shape))
    if given is None:
        return None
    if not given and node.attr("noop_with_empty_axes", 0):
        return [shape]
    axes = given or list(range(len(shape)))
    keep = node.attr("keepdims", 1)
    return [tuple(_unit(1, symbols) if i in axes else d for i, d in enumerate(shape) if keep or i not in axes)]


def _reshaped(node: Node, shape: tuple, sizes: Sizes, symbols: int) -> list[tuple] | None:
    out = _reshape(node, shape, sizes, symbols)
    return None if out is None else [out]


def layout_shapes(node: Node, shapes: list, sizes: Sizes, symbols: int) -> list[tuple] | None:
    """The output shapes of ``node`` (standard domain), or None where these rules do not give them."""
    rule = _RULES.get(node.op_type) or (_reduce if node.op_type.startswith("Reduce") else None)
    if rule is None or not shapes or shapes[0] is None:
        return None
    return rule(node, tuple(shapes[0]), sizes, symbols)


def _split(node: Node, shape: tuple, sizes: Sizes, symbols: int) -> list[tuple] | None:
    axis = int(node.attr("axis", 0)) % len(shape)
    count = len(node.outputs)
    if len(node.inputs) > 1 and node.inputs[1]:
        forms = sizes(1)
        parts = None if forms is None else [_const(f) for f in forms]
    else:
        parts = node.attr("split")
    length = _const(shape[axis])
    if parts is None:
        if length is None or count == 0 or length % count:
            return None  # (an uneven split by num_outputs: its last part is shorter)
        parts = [length // count] * count
    if any(p is None for p in parts) or len(parts) != count:
        return None
    return [shape[:axis] + (_unit(int(p), symbols),) + shape[axis + 1:] for p in parts]  # type: ignore[arg-type]


_RULES: dict[str, Callable[[Node, tuple, Sizes, int], list[tuple] | None]] = {
    "Reshape": _reshaped, "Flatten": _flatten, "Unsqueeze": _unsqueeze, "Squeeze": _squeeze, "Split": _split,
}


# -- shapes of broadcasting, concatenation and products (shape_symbols.Builder.propagate) -------------------------
def broadcast_forms(shapes: list[tuple], symbols: int) -> tuple:
    """The broadcast of ``shapes``; Unsupported where two dimensions are not known to agree."""
    rank = max(len(s) for s in shapes)
    out = []
    for axis in range(rank):
        dims = [s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0]
        wide = [d for d in dims if _const(d) != 1]
        if wide and any(not np.array_equal(d, wide[0]) for d in wide[1:]):
            raise Unsupported("dimensions not known to agree")
        out.append(wide[0] if wide else _unit(1, symbols))
    return tuple(out)


def concat_shape(node: Node, shapes: list, symbols: int) -> tuple | None:
    rank = len(shapes[0])
    axis = node.attr("axis", 0) % rank
    total = sum(s[axis] for s in shapes)
    rest = broadcast_forms([s[:axis] + s[axis + 1:] for s in shapes], symbols)  # must agree: no broadcast of 1s
    if any(not np.array_equal(a, b) for s in shapes for a, b in zip(s[:axis] + s[axis + 1:], rest)):
        return None
    return rest[:axis] + (total,) + rest[axis:]


def matmul_shape(shapes: list, symbols: int) -> tuple | None:
    if len(shapes[1]) == 1 and len(shapes[0]) >= 2:  # a product with a vector
        return shapes[0][:-1]
    if len(shapes[0]) >= 2 and len(shapes[1]) >= 2:
        batch = broadcast_forms([shapes[0][:-2], shapes[1][:-2]], symbols)
        return batch + (shapes[0][-2], shapes[1][-1])
    return None
