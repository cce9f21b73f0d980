"""Providers' per-run scopes: session settings that kernels read while they run.

A provider's kernels are shared by every session of the process, but some settings belong to one session:
``intra_op_num_threads`` is onnxruntime's per session. A provider that needs such a setting at run time
registers a scope at ``initialize`` (``handle.set_run_scope(enter, leave)``); every run of that session calls
``enter()`` on the running thread before its first step and ``leave(token)`` with what ``enter`` returned after
its last, also when the run fails. Subgraphs run inside their session's run, so they see the same scope; two
threads running two sessions each see their own (the provider keeps the value in a context variable).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Scope = tuple[Callable[[], object], Callable[[object], None]]  # (enter, leave)


def enter(scopes: Sequence[Scope]) -> list | None:
    """Enter each of a session's ``scopes``; the ``[(leave, token)]`` to pass to :func:`leave` (None: none)."""
    if not scopes:
        return None
    entered: list = []
    try:
        for begin, end in scopes:
            entered.append((end, begin()))
    except BaseException:
        leave(entered)
        raise
    return entered


def leave(entered: list | None) -> None:
    """Leave what :func:`enter` entered, last first."""
    if entered:
        for end, token in reversed(entered):
            end(token)
