"""A kernel's last checked call kept for the calls that repeat it, when several of its inputs are fed.

A run calls a node with the same constant arrays and fed arrays of the same shapes and dtypes every time, so
the checks a kernel makes of its inputs, and the arguments it derives from them, hold for the next call.
``RepeatCall`` (repeat_call.py) keeps one fed operand; ``KeptCall`` any number, each of which may be omitted.
``match`` answers the kept arguments when the constants are the kept arrays (by identity: initializers are the
same read-only arrays every run) and every fed array has the kept shape and dtype and is C-contiguous and
writeable (None where None was kept). A change of any tuning knob drops every kept call (a kernel may have
chosen its path with the knobs).
"""

from __future__ import annotations

from operator import is_

import numpy as np

from ..tuning import knobs_epoch


def fed_kind(a: np.ndarray | None):
    """(shape, dtype) of a fed array; None for None."""
    return None if a is None else (a.shape, a.dtype)


def plain(a: np.ndarray | None) -> bool:
    """A fed array that is C-contiguous and writeable (a kernel's fresh output), or None."""
    if a is None:
        return True
    flags = a.flags
    return flags.c_contiguous and flags.writeable


class KeptCall:
    """The constants, the fed arrays' kinds and the prepared arguments of one checked call; ``match`` is None
    for any other call."""

    __slots__ = ("_entry",)

    def __init__(self):
        self._entry = None

    def match(self, constants: tuple, fed: tuple):
        entry = self._entry  # one read: another thread may keep another call meanwhile
        if entry is None or entry[3] != knobs_epoch[0] or not all(map(is_, constants, entry[0])):
            return None
        for a, kind in zip(fed, entry[1]):
            if a is None:
                if kind is not None:
                    return None
            elif kind is None or a.shape != kind[0] or a.dtype is not kind[1] or not plain(a):
                return None
        return entry[2]

    def keep(self, constants: tuple, fed: tuple, arguments) -> bool:
        """Keeps ``arguments`` for calls with these constants (read-only arrays or None) and fed arrays of these
        kinds (each C-contiguous and writeable, or None); False, keeping nothing, for other calls."""
        if not all(c is None or not c.flags.writeable for c in constants) or not all(map(plain, fed)):
            return False
        self._entry = (constants, tuple(map(fed_kind, fed)), arguments, knobs_epoch[0])
        return True

    def clear(self) -> None:
        self._entry = None
