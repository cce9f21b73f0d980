"""Shape-only values of a decode loop, evaluated once symbolically and instantiated per step.

A decode step's plan computes positions, masks and relative-position biases from the feeds' shapes alone
(``Shape -> Gather -> Add -> Range -> Unsqueeze -> LessOrEqual -> Where ...``). Their values change with the
past length every step, so a cache per feed shapes serves only a later generation through the same lengths.
Here those steps are evaluated once over symbols (the feed dimensions that differ between two calls) and every
later call of the same class only instantiates them:

- an integer value of fixed shape whose entries are affine in the symbols (``Shape``, ``Gather``, ``Add``,
  ``Concat`` ... of shapes) is kept as its affine coefficients (:class:`Affine`);
- a ``Range`` with affine bounds is a value linear in its index and the symbols (:class:`Linear`);
- what an elementwise or layout operator makes of those is a window, with affine bounds, of one base array
  computed once by the step's own kernel over a margin of lengths around the current one (:class:`Window`).
  Elementwise kernels commute with taking a window, so a window of the base is what the kernel would compute
  on the window, bit for bit.

Steps the evaluation does not cover run per call as before (their inputs instantiated first). Every extent and
window bound is an affine form that must stay in range; a call outside it (a past length beyond the margin, an
empty range) falls back to running the steps. Nothing is assumed about a value's shape that the feeds, the
plan's declared static shapes or the rules below do not give.
"""
from __future__ import annotations

from itertools import chain
from operator import itemgetter, sub
from typing import Any

import numpy as np

from .shape_symbols import Affine, Builder, Linear, Unsupported, Window, form_of

__all__ = ["ONES", "POSITIONS", "Program", "Template", "build"]

ONES, POSITIONS = "ones", "positions"  # kinds of assumed feeds (build)

class Program:
    """The symbolic evaluation of a plan's shape-only steps for one class of feed shapes. Every number a call
    needs (guards, window bounds, extents) is a row of one matrix: a call is one product with the point."""

    def __init__(self, symbolic: dict, needed: tuple[int, ...], guards: list[np.ndarray], symbols: int):
        # slot -> Affine | Linear | Window, for the slots a call sets (intermediates' bases are not kept)
        self.symbolic = {slot: symbolic[slot] for slot in needed}
        self.needed = needed  # symbolic slots read by the steps left per call or by the plan's body
        rows = list(guards)
        self.guards = len(rows)  # the first rows: each must be >= 0
        self.recipes: list[tuple[int, Any, int | None]] = []  # (slot, value, its first row)
        # A first generation instantiates at every step: a window's sliced axes and whether it may broadcast are
        # worked out here, not per call.
        # row -> (base, rank, (axis, row of its low) per sliced axis, whether it broadcasts)
        self._windows: dict[int, tuple[np.ndarray, int, tuple, bool]] = {}
        for slot in needed:
            value = symbolic[slot]
            if isinstance(value, Affine):
                self.recipes.append((slot, value, None))
                continue
            forms = [value.beta] if isinstance(value, Linear) else list(value.lows)
            if not any(form[1:].any() for form in (*forms, *value.extents)):
                # The same at every point (an encoder's mask bias in a decoder step): made once, read-only, and
                # handed out as one array, which kernels that keep what they derive from it by identity reuse.
                local = [int(form[0]) for form in (*forms, *value.extents)]
                if isinstance(value, Linear):
                    fixed = _materialize(value, local, 0)
                else:
                    shape = value.base.shape
                    sliced = tuple((axis, axis) for axis, n in enumerate(shape) if n != 1)
                    fixed = _window(value.base, len(shape), sliced, 1 in shape, local, 0)
                fixed.flags.writeable = False
                self.recipes.append((slot, fixed, -1))
                continue
            row = len(rows)
            self.recipes.append((slot, value, row))
            if not isinstance(value, Linear):
                shape = value.base.shape
                self._windows[row] = (value.base, len(shape), tuple((axis, row + axis) for axis, n in enumerate(shape)
                                                                   if n != 1), 1 in shape)
            rows.extend(forms)
            rows.extend(value.extents)
        self.forms = np.array(rows, np.int64).reshape(-1, 1 + symbols)
        self._code = self._straight()

    def _straight(self):
        """:meth:`instantiate`'s work as one function of straight-line code for these recipes: the guards reduced to
        the distinct ones (with one symbol, to its lowest and highest value), each window's bounds spelled out as
        integer arithmetic on the symbols, constants bound by name. A first generation instantiates at every step,
        and the matrix product of every row with the point, the general loop's per-recipe dispatch and its index
        building cost several microseconds a step. None where the recipes are not all laid out here."""
        symbols = self.forms.shape[1] - 1
        names = [f"s{k}" for k in range(symbols)]
        lines = ["def instantiate(env, point):"]
        if symbols:
            lines.append(f"    {''.join(f'{n}, ' for n in names)}= point[1:]")
        failing = _failing_guards(self.forms[:self.guards].tolist(), names)
        if failing:
            lines += [f"    if {' or '.join(failing)}:", "        return False"]
        scope: dict = {"forms": self.forms, "broadcast_to": np.broadcast_to, "materialize": _materialize,
                       "asarray": np.asarray, "int64": np.int64}
        rows = self.forms.tolist()
        if any(row is None or (row >= 0 and row not in self._windows) for _, _, row in self.recipes):
            lines += ["    vector = asarray(point, int64)", "    numbers = forms.dot(vector).tolist()"]
        for index, (slot, value, row) in enumerate(self.recipes):
            name = f"v{index}"
            scope[name] = value
            if row is None:
                lines.append(f"    env[{slot}] = {name}.at(vector)")
            elif row < 0:
                lines.append(f"    env[{slot}] = {name}")
            elif row in self._windows:
                scope[name] = self._windows[row][0]
                lines += _window_lines(name, slot, self._windows[row], rows, row, names)
            elif isinstance(value, Linear):
                lines.append(f"    env[{slot}] = materialize({name}, numbers, {row})")
            else:
                return None
        lines.append("    return True")
        try:
            exec(compile("\n".join(lines) + "\n", "<shape_program.Program>", "exec"), scope)  # noqa: S102
        except (SyntaxError, RecursionError, MemoryError):  # (the compiler's limits): the loop serves
            return None
        return scope.pop("instantiate")  # (out of its own globals: no reference cycle)

    def instantiate(self, env: list, point) -> bool:
        """Set the needed slots of ``env`` for the symbols' values (``point``: 1, s_0, s_1, ... as a list of ints or
        an array); False where a guard fails (a length outside the bases' margin, an empty range: the caller runs
        the steps instead)."""
        code = self._code
        if code is not None:
            return code(env, point.tolist() if type(point) is np.ndarray else point)
        point = np.asarray(point, np.int64)
        numbers = self.forms.dot(point).tolist()  # (ndarray.dot: less dispatch than the matmul ufunc)
        if self.guards and min(numbers[:self.guards]) < 0:
            return False
        windows = self._windows
        for slot, value, row in self.recipes:
            if row is None:
                env[slot] = value.at(point)
            elif row < 0:
                env[slot] = value
            elif row in windows:
                env[slot] = _window(*windows[row], numbers, row)
            else:
                env[slot] = _materialize(value, numbers, row)
        return True


def _window_lines(name: str, slot: int, window: tuple, rows: list[list[int]], row: int, names: list[str]) -> list[str]:
    """Straight-line code setting ``env[slot]`` to a window of the base bound to ``name`` (``window``: as
    ``Program._windows`` holds it, its forms from ``row`` of ``rows``)."""
    base, rank, sliced, broadcasts = window
    # A base axis of length 1 broadcasts only where its extent is not always 1 (a mask's leading axes are).
    unit = [1] + [0] * len(names)
    broadcasts = broadcasts and any(n == 1 and rows[row + rank + axis] != unit for axis, n in enumerate(base.shape))
    cuts = [":"] * rank
    for axis, at in sliced:
        low, extent = rows[at], rows[at + rank]
        cuts[axis] = f"{_expression(low, names)}:{_expression(list(map(sum, zip(low, extent))), names)}"
    lines = [f"    part = {name}[{', '.join(cuts) if rank else '()'}]"]
    if not broadcasts:
        return lines + [f"    env[{slot}] = part.copy()"]
    extents = ", ".join(_expression(rows[row + rank + axis], names) for axis in range(rank))
    return lines + [f"    extents = ({extents},)",
                    f"    env[{slot}] = part.copy() if part.shape == extents else broadcast_to(part, extents).copy()"]


def _expression(form: list[int], names: list[str]) -> str:
    """Python source of the affine form ``form[0] + sum_k form[1 + k] * names[k]`` over ints."""
    terms = [str(form[0])] if form[0] or not any(form[1:]) else []
    for coefficient, name in zip(form[1:], names):
        if coefficient:
            sign = "-" if coefficient < 0 else "+"
            term = name if abs(coefficient) == 1 else f"{abs(coefficient)} * {name}"
            terms.append(f"{sign} {term}" if terms else (term if sign == "+" else f"-{term}"))
    return terms[0] if len(terms) == 1 else f"({' '.join(terms)})"


def _failing_guards(guards: list[list[int]], names: list[str]) -> list[str]:
    """Python tests, one true where a guard (``form >= 0``) fails, for the distinct ``guards``: a guard without
    symbols is decided here (kept only as ``True`` when it fails); with one symbol they are its bounds."""
    failing: list[str] = []
    distinct = list(dict.fromkeys(map(tuple, guards)))
    if any(not any(form[1:]) and form[0] < 0 for form in distinct):
        return ["True"]
    distinct = [form for form in distinct if any(form[1:])]
    if len(names) == 1 and distinct:
        lows = [-(constant // coefficient) for constant, coefficient in distinct if coefficient > 0]
        highs = [constant // -coefficient for constant, coefficient in distinct if coefficient < 0]
        if lows:
            failing.append(f"{names[0]} < {max(lows)}")
        if highs:
            failing.append(f"{names[0]} > {min(highs)}")
        return failing
    return [f"{_expression(list(form), names)} < 0" for form in distinct]


def _window(base: np.ndarray, rank: int, sliced: tuple, broadcasts: bool, numbers: list[int], row: int) -> np.ndarray:
    """A :class:`Window`'s value (see :func:`_materialize`), its sliced axes known."""
    index = [slice(None)] * rank
    for axis, at in sliced:
        low = numbers[at]
        index[axis] = slice(low, low + numbers[at + rank])
    part = base[tuple(index)]
    if broadcasts:
        extents = tuple(numbers[row + rank:row + 2 * rank])
        if part.shape != extents:
            return np.broadcast_to(part, extents).copy()
    return part.copy()  # a fresh array, as a kernel returns


_INT64 = np.dtype(np.int64)


def _materialize(value, numbers: list[int], row: int) -> np.ndarray:
    if isinstance(value, Linear):
        rank = len(value.alpha)
        extents = numbers[row + 1:row + 1 + rank]
        moving = [axis for axis, alpha in enumerate(value.alpha) if alpha]
        if len(moving) == 1:  # a Range and what shifts or broadcasts it: one arange, broadcast
            axis, beta = moving[0], numbers[row]
            alpha, shape = value.alpha[axis], [1] * rank
            shape[axis] = extents[axis]
            if shape == extents and value.dtype == _INT64:  # nothing to broadcast or cast (a position Range)
                return np.arange(beta, beta + alpha * extents[axis], alpha, dtype=np.int64).reshape(extents)
            line = np.arange(beta, beta + alpha * extents[axis], alpha, dtype=np.int64).reshape(shape)
            return np.broadcast_to(line, extents).astype(value.dtype, order="C")
        out = np.full(extents, numbers[row], np.int64)
        for axis, (alpha, ext) in enumerate(zip(value.alpha, extents)):
            if alpha:
                shape = [1] * rank
                shape[axis] = ext
                out += (alpha * np.arange(ext, dtype=np.int64)).reshape(shape)
        return out.astype(value.dtype)
    rank = value.base.ndim
    lows, extents = numbers[row:row + rank], numbers[row + rank:row + 2 * rank]
    part = value.base[tuple(slice(None) if n == 1 else slice(lo, lo + ext)
                            for n, lo, ext in zip(value.base.shape, lows, extents))]
    if part.shape != tuple(extents):
        part = np.broadcast_to(part, extents)
    return np.array(part)  # a fresh array, as a kernel returns


# -- classes of feed shapes, and building ---------------------------------------------------------------
class Template:
    """Feed shapes with some dimensions symbolic: per feed, per axis, an int or ``(symbol, offset)`` for the
    symbol's value plus an offset (a decode step's attention mask is one longer than its past). A decode loop
    tests every step's shapes against it, so the tests are laid out once over the shapes flattened into one
    tuple: the fixed dimensions read by one getter, each symbol's dimensions by another."""

    __slots__ = ("dims", "symbols", "_ranks", "_fixed", "_want", "_groups", "_test")

    def __init__(self, dims: tuple, symbols: int):
        self.dims = dims
        self.symbols = symbols
        self._ranks = tuple(len(shape) for shape in dims)
        flat = [want for shape in dims for want in shape]
        fixed = [index for index, want in enumerate(flat) if isinstance(want, int)]
        self._fixed = _getter(fixed)
        self._want = tuple(flat[index] for index in fixed)
        # Per symbol: (a getter of its dimensions, their offsets; None where all are 0).
        groups = []
        for symbol in range(symbols):
            at = [index for index, want in enumerate(flat) if not isinstance(want, int) and want[0] == symbol]
            offsets = tuple(flat[index][1] for index in at)
            groups.append((_getter(at), offsets if any(offsets) else None))
        self._groups = tuple(groups)
        self._test = _compiled_test(dims)

    @classmethod
    def between(cls, reference: tuple, signature: tuple) -> Template | None:
        """The template that makes symbolic the dimensions where ``signature`` differs from ``reference``; those
        that grew by the same amount share a symbol (at offsets from the first). None where the ranks differ.
        A dimension that is 1 in ``signature`` stays 1: broadcasting depends on it (a decode step's one token)."""
        if len(reference) != len(signature) or any(len(a) != len(b) for a, b in zip(reference, signature)):
            return None
        first: dict[int, tuple[int, int]] = {}  # growth -> (symbol, its dimension in signature)
        dims = []
        for ref_shape, shape in zip(reference, signature):
            row: list = []
            for ref, got in zip(ref_shape, shape):
                if ref == got or got == 1:
                    row.append(got)
                    continue
                symbol, at = first.setdefault(got - ref, (len(first), got))
                row.append((symbol, got - at))
            dims.append(tuple(row))
        return cls(tuple(dims), len(first))

    def _values(self, signature: tuple) -> list[int] | None:
        """The symbols' values in ``signature``, or None for one outside this class."""
        test = self._test
        if test is not None:
            try:
                return test(signature)
            except (TypeError, ValueError):  # another rank or number of feeds (the unpacking), or no shape
                return None
        if tuple(map(len, signature)) != self._ranks:
            return None
        flat = tuple(chain.from_iterable(signature))
        if self._fixed(flat) != self._want:
            return None
        values = []
        for get, offsets in self._groups:
            seen = get(flat)
            if offsets is not None:
                seen = tuple(map(sub, seen, offsets))
            if seen.count(seen[0]) != len(seen):
                return None
            values.append(seen[0])
        return values

    def matches(self, signature: tuple) -> bool:
        return self._values(signature) is not None

    def point(self, signature: tuple) -> np.ndarray | None:
        """(1, s_0, s_1, ...) for a signature of this class; None for one outside it."""
        values = self._values(signature)
        return None if values is None else np.array([1, *values], np.int64)

    def coordinates(self, signature: tuple) -> list[int] | None:
        """:meth:`point` as a list of ints (what :meth:`Program.instantiate` reads fastest)."""
        values = self._values(signature)
        return None if values is None else [1, *values]


def _compiled_test(dims: tuple):
    """Template._values for ``dims`` as one function of straight-line code (unpack the shapes, compare each fixed
    dimension, read each symbol once and compare its other dimensions): a decode loop tests every step's feed
    shapes, and the general loop over the flattened shapes costs several times this. None where a dimension is
    neither an int nor (symbol, offset) of ints."""
    names: list[str] = []
    checks: list[str] = []
    values: dict[int, str] = {}
    for feed, shape in enumerate(dims):
        row = []
        for axis, want in enumerate(shape):
            name = f"d{feed}_{axis}"
            row.append(name)
            if type(want) is int:
                checks.append(f"{name} != {want}")
            elif type(want) is tuple and len(want) == 2 and all(type(part) is int for part in want):
                symbol, offset = want
                seen = f"({name} - {offset})" if offset else name
                if symbol in values:
                    checks.append(f"{seen} != {values[symbol]}")
                else:
                    values[symbol] = f"v{symbol}"
                    checks.insert(0, f"(v{symbol} := {seen}) is None")  # (binds it before any comparison)
            else:
                return None
        names.append("(" + "".join(f"{n}, " for n in row) + ")")
    if sorted(values) != list(range(len(values))):
        return None
    source = (f"def test(signature):\n    ({''.join(f'{n}, ' for n in names)}) = signature\n"
              f"    if {' or '.join(checks) or 'False'}:\n        return None\n"
              f"    return [{', '.join(values[symbol] for symbol in range(len(values)))}]\n")
    scope: dict = {}
    exec(compile(source, "<shape_program.Template>", "exec"), scope)  # noqa: S102 (ints and names only)
    return scope.pop("test")  # (out of its own globals: no reference cycle)


def _getter(indices: list[int]):
    """A function of a tuple giving the tuple of its items at ``indices`` (a tuple even for one or none)."""
    if len(indices) > 1:
        return itemgetter(*indices)
    return itemgetter(slice(indices[0], indices[0] + 1) if indices else slice(0, 0))


def build(steps: list, shape_only: set[int], feeds: tuple[int, ...], template: Template, point: np.ndarray,
          env: list, static_shapes: dict, read_later: set[int],
          assumed: dict | None = None) -> tuple[Program, list[int]] | None:
    """The program of ``steps`` (a plan's steps in order; ``shape_only``: the indices of those the feeds' shapes
    decide) for ``template``'s class, built at ``point``; and the indices of the steps it leaves to run per call.
    ``feeds``: the feed slots in the template's order; ``env``: a run's slots (constants set); ``read_later``: the
    slots the other steps read. None where a step left per call would read a value only the other steps make.
    ``assumed``: feed slots whose values the caller checks are what their shapes make them (see
    :mod:`.canonical_feeds`): ``(ONES, None)`` all ones, ``(POSITIONS, mask slot)`` each row counting up to the
    mask's length."""
    n = template.symbols
    shapes = {}
    for slot, dims in zip(feeds, template.dims):
        shapes[slot] = tuple(form_of(d, n) if isinstance(d, int) else _unit(d[0], n) + form_of(d[1], n) for d in dims)
    produced = {slot for step in steps for slot in step.outputs}
    constants = {slot: env[slot] for step in steps for slot in step.inputs
                 if slot not in produced and slot not in shapes and isinstance(env[slot], np.ndarray)}
    builder = Builder(n, point, constants, shapes, static_shapes)
    for slot, (kind, mask) in (assumed or {}).items():
        dims, dtype = shapes[slot], env[slot].dtype
        if kind == ONES:
            builder.values[slot] = Window(np.ones((1,) * len(dims), dtype), tuple(form_of(0, n) for _ in dims), dims)
        else:  # positions (..., S): mask length - S + index along the last axis
            alpha = (0,) * (len(dims) - 1) + (1,)
            builder.values[slot] = Linear(alpha, shapes[mask][-1] - dims[-1], dims, dtype)
    residual: list[int] = []
    available = set(feeds) | set(constants)
    for index, step in enumerate(steps):
        if index not in shape_only:
            builder.propagate(step)
            continue
        reads = [slot for slot, name in zip(step.inputs, step.node.inputs) if name]
        try:
            if len(step.outputs) != 1:
                raise Unsupported("several outputs")
            if any(slot not in builder.values and slot not in constants for slot in reads) \
                    and step.node.op_type not in ("Shape", "Size"):
                raise Unsupported("reads a value computed per call")
            builder.shape_only(step)
            continue
        except Exception:  # noqa: BLE001 (any failure of the evaluation leaves the step to its kernel)
            pass
        if any(slot not in available and slot not in builder.values for slot in reads):
            return None  # it reads what only the plan's other steps compute
        residual.append(index)
        available.update(step.outputs)
    wanted = read_later | {slot for index in residual for slot in steps[index].inputs}
    needed = tuple(sorted(slot for slot in builder.values if slot in wanted and slot not in (assumed or {})))
    return Program(builder.values, needed, builder.guards, n), residual


def _unit(symbol: int, n: int) -> np.ndarray:
    form = np.zeros(1 + n, np.int64)
    form[1 + symbol] = 1
    return form
