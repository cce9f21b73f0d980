"""Shape rules that providers declare for their own operators (those their fusions write into a graph).

A fused node replaces nodes whose output shapes followed from their inputs' shapes; unless its own rule says
so too, everything downstream of it looks value-dependent: a ``Shape`` of it stops being shape-only
(steps.shape_only_steps) and shape programs cannot propagate through it (shape_symbols), so a decode step's
masks and positions run on every call. A provider declares each such operator here, once, beside its fusions.

Kinds:

- ``SAME``: output i has input i's shape (conversions).
- ``FIRST``: output 0 has input ``operands[0]``'s shape (elementwise maps, normalizations, rounding).
- ``BROADCAST``: output 0 is the broadcast of the ``operands`` inputs' shapes.
- ``MATMUL``: output 0 is MatMul's shape over inputs ``operands`` (refused where ``transA``/``transB`` is set).
- ``CONCAT``: output 0 is Concat's shape (attribute ``axis``) over every input but the last ``operands[0]`` (a
  rounded Concat: its parts, then its grid's scale and zero point).
- ``SHAPES``: the outputs' shapes follow from the inputs' shapes and attributes by a rule not given here:
  a Shape of them is shape-only, but shape programs do not propagate through them.
- ``VALUES``: the outputs' shapes depend on input values (declared so that a walk over a provider's
  operators can tell a considered operator from a forgotten one).
"""
from __future__ import annotations

from ..records import FrozenRecord

SAME, FIRST, BROADCAST, MATMUL, SHAPES, VALUES = "same", "first", "broadcast", "matmul", "shapes", "values"
CONCAT = "concat"
KINDS = (SAME, FIRST, BROADCAST, MATMUL, CONCAT, SHAPES, VALUES)


class ShapeRule(FrozenRecord):
    """An operator's declared rule: its kind and the inputs it reads. A record (onnx_runtime/records.py): a
    NamedTuple generates its methods in every process that imports it, here each new process's first session."""

    __slots__ = __match_args__ = ("kind", "operands")
    kind: str
    operands: tuple[int, ...]

    def __init__(self, kind: str, operands: tuple[int, ...]) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "operands", operands)


_RULES: dict[tuple[str, str], ShapeRule] = {}
_OPERAND_COUNTS = {FIRST: 1, MATMUL: 2, CONCAT: 1}  # the kinds that read a fixed number of inputs


def declare(domain: str, op_type: str, kind: str, operands: tuple[int, ...] = ()) -> None:
    """Declare how ``op_type`` of ``domain`` gives its output shapes; a second, different declaration is an
    error (two providers may not disagree on one operator)."""
    if kind not in KINDS:
        raise ValueError(f"shape rule of {domain}:{op_type}: kind {kind!r}; expected one of {KINDS}")
    wanted = _OPERAND_COUNTS.get(kind)
    operands = tuple(operands) or ((0,) if kind == FIRST else (0, 1) if kind == MATMUL else ())
    if wanted is not None and len(operands) != wanted or kind == BROADCAST and len(operands) < 2:
        raise ValueError(f"shape rule of {domain}:{op_type}: {kind} takes {wanted or 'two or more'} operand "
                         f"indices, not {operands}")
    rule = ShapeRule(kind, operands)
    known = _RULES.setdefault((domain, op_type), rule)
    if known is not rule and known != rule:  # (a first declaration, the usual case, compares nothing)
        raise ValueError(f"shape rule of {domain}:{op_type} declared as {known} and as {rule}")


def rule_of(domain: str, op_type: str) -> ShapeRule | None:
    """The declared rule of an operator, or None."""
    return _RULES.get((domain, op_type))


def from_shapes(domain: str, op_type: str) -> bool:
    """Whether a declared operator's output shapes follow from its inputs' shapes alone."""
    rule = _RULES.get((domain, op_type))
    return rule is not None and rule.kind != VALUES


def declared(domain: str) -> dict[str, ShapeRule]:
    """Every rule declared for ``domain``, by operator."""
    return {op: rule for (d, op), rule in _RULES.items() if d == domain}
