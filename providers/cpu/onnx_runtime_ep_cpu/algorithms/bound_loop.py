"""A compiled loop's entry point for one call's argument types, for a kernel that repeats that call every run.

Calling a compiled loop goes through numba's dispatcher, which types every argument on every call; a small
kernel that runs on the same shapes each frame (a streaming model's closing Softmax, a classifier's few-row
Gemm) keeps the linked overload's entry point instead, as PackedProduct.bound does for the product tiles. Only
for a loop that already runs compiled (numba imported and the loop switched to its dispatcher by its first call
or by the background loader): binding never imports numba or compiles on a run's thread, and while the loop's
numpy twin serves, the kernel keeps calling the loop. The entry point does not check its arguments: the caller
passes arrays of the kept dtypes, dimensions and layouts only.
"""

from __future__ import annotations

from ..compiled import deferred
from .products import entry_point


def bound_entry(loop, arguments: tuple):
    """``loop``'s entry point for ``arguments``' types where the loop runs compiled and the overload is linked;
    None otherwise (the caller keeps calling ``loop``)."""
    if not isinstance(loop, deferred.Loop) or not loop.switched:
        return None
    return entry_point(loop, arguments)


class EntryOnce:
    """A compiled loop's entry point, bound once for a kernel whose loop calls keep their argument types while the
    shapes change (a decode step's growing past): binding types every argument and looks the overload up (tens of
    microseconds), so it is done at most once per kernel, and not again after the linked loop had no overload for
    those types. The caller passes only arguments of the types of the call it was bound with."""

    __slots__ = ("loop", "entry", "missed")

    def __init__(self, loop):
        self.loop = loop
        self.entry = None
        self.missed = False

    def __call__(self, arguments: tuple):
        """The entry point (bound now from ``arguments`` where not yet), or None."""
        entry = self.entry
        if entry is None and not self.missed:
            entry = self.entry = bound_entry(self.loop, arguments)
            self.missed = entry is None and getattr(self.loop, "switched", True)  # (a loop on numpy binds later)
        return entry

    def run(self, arguments: tuple):
        """The loop on ``arguments``: through the entry point once bound, else the dispatcher, then bound from
        them (the overload exists then)."""
        entry = self.entry
        if entry is not None:
            return entry(*arguments)
        result = self.loop(*arguments)
        self(arguments)
        return result
