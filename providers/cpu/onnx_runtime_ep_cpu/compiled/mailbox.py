"""The layout of a job's arguments in a helper's mailbox (workers.py), described once per kind of job
(jobs.py) as a sequence of fields, from which the kind's writer and reader are generated.

A mailbox is an int64 array; a job's arguments fill the slots from workers.ARGS on, field after field:
an array its address, then those of its dimensions it stores (the others are constants, or expressions
over arrays read from slots, e.g. "claims.shape[0] + 1"); an integer or a flag one slot, a pair two.
``Layout`` turns the fields into the Python source of the writer, ``write(m, *fields)``, which the
posting thread runs compiled for every part (from compiled callers too: jobs.split_*), and of the reader,
``read(m) -> fields``, that the kind's runner calls on the helper; workers.Kind execs and compiles them
once, at import. Writer and reader hold slot numbers only in the generated text: nothing to keep in
step by hand.
"""

from __future__ import annotations

import ast
import keyword
from dataclasses import dataclass

STORED = None  # an array dimension written into the mailbox, after the array's address

# How the reader rebuilds an array of each element type from its address: workers.py's carray views.
ARRAY_READERS = {"float32": "float_array", "int64": "int_array", "uint64": "offset_array", "float64": "double_array",
                 "int32": "int32_array", "uint8": "byte_array", "int8": "signed_byte_array"}
SCALARS = ("int", "flag", "pair")
_RESERVED = frozenset({"m", *ARRAY_READERS.values()})  # the generated functions' own names


@dataclass(frozen=True)
class Field:
    """One argument of a job: ``kind`` "int" (an integer), "flag" (a bool, stored as 0 or 1), "pair" (a
    tuple of two integers) or an array's element type (a key of ARRAY_READERS) with its ``shape``: per
    dimension STORED, an int constant, or an expression (text) over fields whose whole shape is stored."""

    name: str
    kind: str
    shape: tuple = ()

    @property
    def is_array(self) -> bool:
        return self.kind in ARRAY_READERS

    @property
    def size(self) -> int:
        """The slots the field takes."""
        if self.is_array:
            return 1 + sum(dim is STORED for dim in self.shape)
        return 2 if self.kind == "pair" else 1

    @property
    def derived(self) -> bool:
        """Whether a dimension follows from other fields (read after them)."""
        return any(isinstance(dim, str) for dim in self.shape)


def scalar(name: str) -> Field:
    """An integer (int64 slot)."""
    return Field(name, "int")


def flag(name: str) -> Field:
    """A bool: 1 or 0 in the slot, read back as ``!= 0``."""
    return Field(name, "flag")


def pair(name: str) -> Field:
    """A tuple (or array) of two integers, read back as a tuple."""
    return Field(name, "pair")


def _array(kind: str, name: str, dims: int, shape) -> Field:
    return Field(name, kind, (STORED,) * dims if shape is None else tuple(shape))


def floats(name: str, dims: int = 1, *, shape=None) -> Field:
    """A float32 array: ``dims`` dimensions, all stored, or ``shape`` (see Field)."""
    return _array("float32", name, dims, shape)


def ints(name: str, dims: int = 1, *, shape=None) -> Field:
    """An int64 array (``dims``, ``shape``: as for floats)."""
    return _array("int64", name, dims, shape)


def offsets(name: str, dims: int = 1, *, shape=None) -> Field:
    """A uint64 array (``dims``, ``shape``: as for floats)."""
    return _array("uint64", name, dims, shape)


def doubles(name: str, dims: int = 1, *, shape=None) -> Field:
    """A float64 array (``dims``, ``shape``: as for floats)."""
    return _array("float64", name, dims, shape)


def int32s(name: str, dims: int = 1, *, shape=None) -> Field:
    """An int32 array (``dims``, ``shape``: as for floats)."""
    return _array("int32", name, dims, shape)


def byte_codes(name: str, dims: int = 1, *, shape=None, signed: bool = False) -> Field:
    """A uint8 array, or int8 where ``signed`` (``dims``, ``shape``: as for floats): 8-bit codes."""
    return _array("int8" if signed else "uint8", name, dims, shape)


def _problem(field: Field, names: list, plain: set) -> str:
    """What keeps ``field`` from its place among fields ``names`` ("" for nothing); ``plain``: the arrays
    whose dimensions are all stored or constant, the ones a dimension's expression may name."""
    if not field.name.isidentifier() or keyword.iskeyword(field.name) or field.name in _RESERVED:
        return f"field name {field.name!r}: not a Python name, or one the generated code uses"
    if names.count(field.name) > 1:
        return f"field {field.name!r} described twice"
    if field.kind not in ARRAY_READERS and field.kind not in SCALARS:
        return f"field {field.name!r}: unknown kind {field.kind!r}"
    if field.is_array and not field.shape:
        return f"array field {field.name!r} has no dimensions"
    for dim in field.shape:
        if isinstance(dim, str):
            used = {node.id for node in ast.walk(ast.parse(dim, mode="eval")) if isinstance(node, ast.Name)}
            if not used <= plain:
                return (f"field {field.name!r}: dimension {dim!r} names {sorted(used - plain)}, not arrays whose "
                        "dimensions are all stored or constant")
        elif dim is not STORED and not isinstance(dim, int):
            return f"field {field.name!r}: dimension {dim!r} is not STORED, an int or text"
    return ""


class Layout:
    """Fields at their slots, from ``first``; ``end``: the mailbox's size. Raises ValueError where the
    description does not hold together (repeated or reserved names, too many slots, a dimension over a
    field that is not read before it)."""

    def __init__(self, fields, first: int, end: int):
        self.fields = tuple(fields)
        names = [field.name for field in self.fields]
        plain = {field.name for field in self.fields if field.is_array and not field.derived}
        for field in self.fields:
            problem = _problem(field, names, plain)
            if problem:
                raise ValueError(problem)
        self.slots = {}
        slot = first
        for field in self.fields:
            self.slots[field.name] = slot
            slot += field.size
        if slot > end:
            raise ValueError(f"the fields take slots {first} .. {slot - 1}, past the mailbox's {end}")
        self.end = slot

    def writer_source(self, function: str) -> str:
        """``def function(m, *fields)``: each field into its slots of the mailbox ``m``."""
        lines = [f"def {function}(m, {', '.join(field.name for field in self.fields)}):"]
        for field in self.fields:
            slot, name = self.slots[field.name], field.name
            if field.is_array:
                lines.append(f"    m[{slot}] = {name}.ctypes.data")
                stored = [axis for axis, dim in enumerate(field.shape) if dim is STORED]
                lines += [f"    m[{slot + 1 + i}] = {name}.shape[{axis}]" for i, axis in enumerate(stored)]
            elif field.kind == "flag":
                lines.append(f"    m[{slot}] = 1 if {name} else 0")
            elif field.kind == "pair":
                lines.append(f"    m[{slot}] = {name}[0]")
                lines.append(f"    m[{slot + 1}] = {name}[1]")
            else:
                lines.append(f"    m[{slot}] = {name}")
        return "\n".join(lines) + "\n"

    def reader_source(self, function: str) -> str:
        """``def function(m)``: the fields back from the mailbox ``m``, as a tuple in their order (arrays as
        views of the memory whose address was written)."""
        lines = [f"def {function}(m):"]
        # Arrays whose shape names other fields after those (Layout checked they are plain arrays).
        for field in sorted(self.fields, key=lambda field: field.derived):
            slot, name = self.slots[field.name], field.name
            if field.is_array:
                dims, stored = [], slot + 1
                for dim in field.shape:
                    if dim is STORED:
                        dims.append(f"m[{stored}]")
                        stored += 1
                    else:
                        dims.append(str(dim))
                shape = f"({', '.join(dims)},)"
                lines.append(f"    {name} = {ARRAY_READERS[field.kind]}(m[{slot}], {shape})")
            elif field.kind == "flag":
                lines.append(f"    {name} = m[{slot}] != 0")
            elif field.kind == "pair":
                lines.append(f"    {name} = (m[{slot}], m[{slot + 1}])")
            else:
                lines.append(f"    {name} = m[{slot}]")
        lines.append(f"    return ({', '.join(field.name for field in self.fields)},)")
        return "\n".join(lines) + "\n"

    def entry_source(self, function: str, reader: str, body: str, parameters, extras: dict) -> str:
        """``def function(pointer)``, a runner: the fields read by ``reader`` from the mailbox at ``pointer``,
        then ``body`` called with them by ``parameters``' names; a parameter that names no field takes the
        expression ``extras[name]`` (over the mailbox ``m``). Every field must be a parameter."""
        index = {field.name: i for i, field in enumerate(self.fields)}
        unknown = [name for name in parameters if name not in index and name not in extras]
        missing = [name for name in index if name not in parameters]
        if unknown or missing:
            raise ValueError(f"{body} does not take the fields as described: parameters {unknown} are no field, "
                             f"fields {missing} no parameter")
        values = [f"f[{index[name]}]" if name in index else extras[name] for name in parameters]
        return (f"def {function}(pointer):\n"
                f"    m = mailbox_view(pointer)\n"
                f"    f = {reader}(m)\n"
                f"    {body}({', '.join(values)})\n")


def define(source: str, name: str, namespace: dict, filename: str):
    """The function ``name`` that ``source`` defines, exec'd in ``namespace`` as code of ``filename`` (a
    real file: numba caches compiled code on disk only for functions it can tie to one, and keys the cache
    on that file's text: the describing module's, so a changed description recompiles. A change here that
    changes the generated text does not: clear numba's cache, as after any change to code that cached
    functions call)."""
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]
