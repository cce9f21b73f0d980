"""Plans made while a loop they call was served by a fallback, made again once the loader has linked it.

After deferral closes, a run's cache miss is compiled by the loader's child while the loop's numpy equivalent
or its caller's fallback serves (deferred.py). A plan built in that window (a segment's bound plan, ops/segment.py)
would keep what served: a node's kernel step instead of its prepared calls, a loop called through its dispatcher
instead of its overload. So the builder watches the window (``watching()``): the misses served on its thread
meanwhile make the plan *provisional* (``ticket(seen)``), and the owner holds it here. The owner makes the plan
again once every miss it met is settled (linked, or given up by the child): at its next run after that (one
integer compared per run of a provisional plan; final plans pay nothing), or in ``deferred.wait_ready``, which
calls ``settle_held()`` after the loader's rounds, so that wait_ready means "loops linked and plans final".

This module holds no loop and imports none: compiled/deferred.py reports what was served (``note``) and what a round
settled (``advance``).
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

_local = threading.local()  # seen: the misses served on this thread while a plan is built (or None)
_generation = [0]  # rounds of the loader that settled misses
_missing: set = set()  # deferred's set of misses the loader has not settled (bound by deferred at import)
_held: weakref.WeakSet = weakref.WeakSet()  # owners of provisional plans: their settle() makes them again
_held_lock = threading.Lock()


def bind_missing(missing: set) -> None:
    """deferred.py's set of outstanding misses (mutated in place, never rebound)."""
    global _missing
    _missing = missing


def note(key) -> None:
    """A miss served by a fallback on this thread (deferred._guard, runner_missed, overload)."""
    seen = getattr(_local, "seen", None)
    if seen is not None:
        seen.add(key)


def advance() -> None:
    """A loader round settled misses: provisional plans look again at their next run."""
    _generation[0] += 1


@contextmanager
def watching():
    """``with watching() as seen:`` collects the misses served on this thread inside (nested: the outer
    window sees the inner one's too)."""
    outer = getattr(_local, "seen", None)
    seen: set = set()
    _local.seen = seen
    try:
        yield seen
    finally:
        _local.seen = outer
        if outer is not None:
            outer.update(seen)


class Ticket:
    """What a provisional plan waits for: ``settled()`` once none of its misses is outstanding. ``inputs``: what
    its owner needs to make it again without a run (set by the owner)."""

    __slots__ = ("keys", "looked", "inputs")

    def __init__(self, keys: frozenset):
        self.keys = keys
        self.looked = -1  # the generation last looked at: the set is compared once per loader round
        self.inputs: tuple = ()

    def settled(self) -> bool:
        generation = _generation[0]
        if generation == self.looked:
            return False
        self.looked = generation
        return not any(key in _missing for key in self.keys)


def ticket(seen: set) -> Ticket | None:
    """A Ticket for a plan built while ``seen`` were served by fallbacks; None (a final plan) where none was."""
    return Ticket(frozenset(seen)) if seen else None


def hold(owner) -> None:
    """``owner`` has provisional plans: its ``settle()`` is called by settle_held (weakly held)."""
    with _held_lock:
        _held.add(owner)


def settle_held() -> bool:
    """Make again every held owner's plans whose misses are settled (owner.settle() -> whether it still holds
    provisional plans); True where one was made again."""
    with _held_lock:
        owners = list(_held)
    remade = False
    for owner in owners:
        again, still = owner.settle()
        remade = remade or again
        if not still:
            with _held_lock:
                _held.discard(owner)
    return remade
