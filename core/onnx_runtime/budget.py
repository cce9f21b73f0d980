"""The run-time size budget: the most bytes one value computed from data may take.

Operators that size their output from input values (Expand, Tile, ConstantOfShape, Range, OneHot, Pad,
Resize, ...) check the size against the budget before allocating, so a hostile or mistaken value fails
fast with the size asked instead of running the process out of memory. A session sets its budget with
``SessionOptions.add_session_config_entry("session.max_value_bytes", "<bytes>")``; the default is the
machine's physical memory (or the process's address-space limit, when lower): a single value larger
than that cannot be held anyway.

The run's ``RunOptions`` travel with the budget: work whose length comes from data (Loop and Scan iterations)
calls ``check_cancelled`` between steps, so ``run_options.terminate`` set from another thread stops a run that a
model made endless (onnxruntime checks its terminate flag at the same places).
"""

from __future__ import annotations

import contextvars
import functools
import os
import resource

from .errors import InvalidArgumentError, RunCancelledError, ShapeOverflowError

MAX_VALUE_BYTES_KEY = "session.max_value_bytes"


@functools.lru_cache(maxsize=1)
def physical_memory() -> int | None:
    """The host's memory in bytes; None where the platform does not say."""
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


@functools.lru_cache(maxsize=1)
def default_budget() -> int:
    physical = physical_memory() or 1 << 40
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    return min(physical, soft) if soft != resource.RLIM_INFINITY else physical


_budget: contextvars.ContextVar[int | None] = contextvars.ContextVar("max_value_bytes", default=None)


def parse_budget(config: dict[str, str]) -> int | None:
    """The budget a session's config entries ask for (None: the default)."""
    text = config.get(MAX_VALUE_BYTES_KEY)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise InvalidArgumentError(f"session config entry {MAX_VALUE_BYTES_KEY!r} must be a positive number of "
                                   f"bytes, got {text!r}")
    return value


_run_options: contextvars.ContextVar[object | None] = contextvars.ContextVar("run_options", default=None)


def enter(budget: int | None, run_options=None) -> tuple | None:
    """Make ``budget`` the one checked by this thread's (context's) run (None keeps the default), and
    ``run_options`` the ones whose ``terminate`` flag ``check_cancelled`` reads."""
    if budget is None and run_options is None:
        return None
    return (_budget.set(budget) if budget is not None else None,
            _run_options.set(run_options) if run_options is not None else None)


def leave(token: tuple | None) -> None:
    if token is None:
        return
    budget_token, options_token = token
    if options_token is not None:
        _run_options.reset(options_token)
    if budget_token is not None:
        _budget.reset(budget_token)


def check_cancelled(what: str) -> None:
    """Raise ``RunCancelledError`` when the current run's ``RunOptions.terminate`` has been set."""
    options = _run_options.get()
    if options is not None and getattr(options, "terminate", False):
        raise RunCancelledError(f"{what} stopped: run_options.terminate was set while the run was in progress; "
                                f"clear it (run_options.terminate = False) before the next run")


def check(elements: int, itemsize: int, what: str) -> None:
    """Raise ``ShapeOverflowError`` when ``elements`` of ``itemsize`` bytes exceed the budget. ``what`` names the
    value (the node's name is added by the executor)."""
    size = int(elements) * int(itemsize)
    budget = _budget.get()
    if budget is None:
        budget = default_budget()
    if size > budget:
        raise ShapeOverflowError(
            f"{what} would take {size:,} bytes ({int(elements):,} elements), over the session's limit of "
            f"{budget:,} bytes for one value; check the input values that size it, or raise the limit with "
            f"SessionOptions.add_session_config_entry({MAX_VALUE_BYTES_KEY!r}, ...)")


def check_shape(shape, itemsize: int, what: str) -> None:
    """``check`` for an output of ``shape`` (negative dims are the kernel's to report)."""
    elements = 1
    for dim in shape:
        elements *= max(int(dim), 0)
    check(elements, itemsize, what)
