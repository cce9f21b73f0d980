"""Runs whose values only check another's: served by numpy where a kernel has a numpy path.

A segment plans a signature from a node-by-node run of its nodes and checks the bound plan's outputs against
that run's (ops/segment.py). The plan binds its own calls (blocked convolutions, packed products), so the
per-node compiled code the node-by-node run would link (direct convolution tiles, product entries: ~100 ms of
CPU in a new worker process) is never called again. Inside ``with ReferenceRun():`` this thread's loops with a
numpy equivalent run that one (compiled/deferred.Loop) and ``deferred.numpy_first`` says True, as while a new
process's loader has not finished, but nothing is recorded and no loader starts: what the plan binds is linked
when it is bound. A kernel that chose numpy's path at such a call takes its compiled one at its next call or
bind (algorithms/conv_path.py).
"""

from __future__ import annotations

import threading

local = threading.local()  # depth: this thread runs inside a ReferenceRun


class ReferenceRun:
    """``with ReferenceRun():`` around a run whose values only check another's (see the module doc)."""

    __slots__ = ()

    def __enter__(self):
        local.depth = getattr(local, "depth", 0) + 1
        return self

    def __exit__(self, *exc):
        local.depth -= 1
        return False


def active() -> bool:
    """Whether this thread runs inside a ReferenceRun."""
    return getattr(local, "depth", 0) > 0
