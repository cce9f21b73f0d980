"""Value classes without dataclasses' code generation.

``@dataclass`` writes and compiles its ``__init__``, ``__repr__``, ``__eq__`` (and a frozen class's
``__hash__``, ``__setattr__``, ``__delattr__``) with ``exec`` in every process that imports the class, about
half a millisecond per class: dozens of them were a fifth of ``import onnx_runtime``. A class here writes its
``__init__`` by hand (compiled once, into its module's bytecode) and names its fields in ``__match_args__``,
as a dataclass does; the bases give the rest with a dataclass's meaning: field-wise ``repr`` and ``==``
between instances of the same class, unhashable when mutable, hashable and read-only when frozen.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any, ClassVar, TypeVar

R = TypeVar("R", bound="Record")


def _no_fields(record: object) -> tuple:
    return ()


class FrozenFieldError(AttributeError):
    """An assignment to (or deletion of) a field of a frozen record: build a new record instead."""


class Record:
    """A mutable record: subclasses list their fields in ``__match_args__`` and set them in ``__init__``."""

    __slots__ = ()
    __match_args__: ClassVar[tuple[str, ...]] = ()
    _key: ClassVar[Callable[..., Any]]  # the fields' values (one field's alone), read in C for == and hash

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._key = attrgetter(*cls.__match_args__) if cls.__match_args__ else staticmethod(_no_fields)

    def field_values(self) -> tuple[Any, ...]:
        """The fields' values, in ``__match_args__`` order."""
        return tuple([getattr(self, name) for name in self.__match_args__])

    def replace(self: R, **changes: Any) -> R:
        """A new record of the same class with these fields changed, the others as here (``dataclasses.replace``)."""
        values = dict(zip(self.__match_args__, self.field_values()))
        values.update(changes)
        return type(self)(**values)

    def __repr__(self) -> str:
        fields = ", ".join([f"{name}={getattr(self, name)!r}" for name in self.__match_args__])
        return f"{type(self).__qualname__}({fields})"

    def __eq__(self, other: object) -> bool:  # (defining it leaves the class unhashable, as a mutable dataclass)
        if other.__class__ is self.__class__:
            key = self._key
            return key(self) == key(other)
        return NotImplemented


class FrozenRecord(Record):
    """A read-only, hashable record. ``__init__`` sets its fields with ``object.__setattr__``; copies and
    pickles are rebuilt through ``__init__`` from the fields (positional, in ``__match_args__`` order)."""

    __slots__ = ()

    def __hash__(self) -> int:
        return hash(self._key(self))

    def __setattr__(self, name: str, value: Any) -> None:
        raise FrozenFieldError(f"cannot assign to field {name!r} of a frozen {type(self).__qualname__}")

    def __delattr__(self, name: str) -> None:
        raise FrozenFieldError(f"cannot delete field {name!r} of a frozen {type(self).__qualname__}")

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), self.field_values()
