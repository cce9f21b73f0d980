"""The cyclic garbage collector around session creation: paused while a session is built, and run first only where
a dropped session's objects are still alive (a session frees its objects as its last reference goes; a reference
cycle, a provider's own say, holds them until a full collection)."""

from __future__ import annotations

import gc
import weakref
from collections import deque
from contextlib import contextmanager

import numpy as np

from .specialize import promote_built


@contextmanager
def creation_paused():
    """Session creation builds tens of thousands of long-lived objects (IR, plans, kernels); the cyclic
    garbage collector would rescan them generation after generation (measured in eb68128). It is
    paused meanwhile and runs as usual afterwards; a collection already disabled stays disabled.

    A dropped session's objects are freed as its last reference goes, unless a reference cycle holds them (a
    provider's own, say) until a collection: paused, the next creation would build beside them (two sessions'
    memory at the high-water of create/destroy loops). So when sessions holding at least COLLECT_AFTER_BYTES of
    weights were dropped and their objects are still alive (held_dropped_bytes), one full collection runs
    first. Small ones are left to the collector's own schedule: a full collection scans every object of the
    process (10 ms in a process that ran one small CNN), more than creating a small session."""
    was_enabled = gc.isenabled()
    if was_enabled and _dropped and held_dropped_bytes() >= COLLECT_AFTER_BYTES:
        gc.collect()
        _dropped.clear()  # (what a full collection left is held from outside: the user's arrays, a live session)
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            promote_built()  # what creation made, to the oldest generation unscanned
            gc.enable()


COLLECT_AFTER_BYTES = 1 << 20
# (weight bytes, weak references to its witnesses) of each session dropped and not yet seen freed whole. A deque,
# no lock: a session is dropped wherever its last reference goes, a collection inside held_dropped_bytes included
# (its finalizer appending to what that function is walking).
_dropped: deque[tuple[int, list]] = deque()
WITNESS_ARRAYS = 4  # a session's largest weights among its witnesses


def witness(refs: list, *held) -> None:
    """Add weak references to ``held`` to a session's witnesses: what a reference cycle among its objects would
    keep alive after it is dropped: its specializer, executors and largest weights, which hold its kernels, plans
    and buffers (not its provider handles, which refer to themselves through their defaults and hook table: small
    objects the collector's own schedule frees)."""
    for value in held:
        try:
            refs.append(weakref.ref(value))
        except TypeError:  # (an object without weak references: not a witness)
            pass


def largest_weights(graph) -> list:
    """The graph's WITNESS_ARRAYS largest weights (numpy arrays), largest first."""
    arrays = [value for value in graph.initializers.values() if isinstance(value, np.ndarray)]
    return sorted(arrays, key=lambda value: value.nbytes, reverse=True)[:WITNESS_ARRAYS]


def session_dropped(weight_bytes: int, witnesses: list) -> None:
    """A session object was freed (its internals may still sit in reference cycles)."""
    _dropped.append((weight_bytes, witnesses))


def held_dropped_bytes() -> int:
    """The weights of dropped sessions some of whose objects are still alive (forgetting those freed whole)."""
    alive = []
    for _ in range(len(_dropped)):  # (appended meanwhile: looked at next time)
        try:
            entry = _dropped.popleft()
        except IndexError:  # (another thread took it)
            break
        if any(ref() is not None for ref in entry[1]):
            alive.append(entry)
    _dropped.extend(alive)
    return sum(size for size, _ in alive)
