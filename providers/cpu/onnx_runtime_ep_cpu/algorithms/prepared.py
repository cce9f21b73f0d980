"""Transforms of constant inputs (rearranged weights, folded normalization parameters) kept per kernel.
"""

from __future__ import annotations


class Prepared:
    """A kernel's transform of constant inputs (rearranged weights, folded normalization
    parameters), kept while the same arrays come in.

    Initializers reach kernels as the same read-only array objects on every run, so identity marks
    unchanged constants; writeable (fed) arrays are transformed afresh on every call.
    """

    __slots__ = ("_entry",)

    def __init__(self):
        self._entry = None

    def get(self, key, arrays: tuple, build):
        entry = self._entry  # one read: another thread may swap in a new entry meanwhile
        if entry is not None and entry[0] == key and all(a is b for a, b in zip(entry[1], arrays)):
            return entry[2]
        value = build()
        if all(a is None or not a.flags.writeable for a in arrays):
            self._entry = (key, arrays, value)
        return value
