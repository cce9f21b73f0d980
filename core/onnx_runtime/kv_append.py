"""A KV cache grown in place: ``present = Concat(past, new)`` written into the buffer ``past`` is a window of.

A decoder exported with past computes each layer's ``present`` by concatenating the step's keys (or values) to
the ``past`` it was fed. When the caller keeps the cache in a host buffer at its capacity and feeds ``past`` as
the window of the rows already valid there (a :class:`DeviceIoBinding` with ``fixed_physical_strides``), the
first rows of ``present`` are those rows, in place: the step writes only its new rows after them, and its result
is the window one step longer. That saves the Concat's copy of the whole cache and the bound run's copy of
``present`` back into the buffer, every step, so a step's cache traffic no longer grows with the context.

A bound run names its windows for the duration of the run on its thread (:func:`appending`); a Concat kernel
asks :func:`append` first. Only the Concat that gives the binding's own output from the window as first of two
inputs appends, once per run, along the axis the window grows on, within the capacity and in the buffer's dtype;
anything else (another thread's run, another value fed, another node) concatenates as before. A kernel reading
the grown windows (a decode step's attention) asks :func:`contiguous_rows` for the whole buffers, to read the
valid rows where they lie instead of copying each window (strided across heads) out every step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np


class Window:
    """``fed`` (the view a run feeds as ``past``) of ``physical`` (the whole buffer at its capacity), growing on
    ``axis``, to be appended into by the Concat giving ``output``; ``result`` is the longer window an append
    made (None until one does)."""

    __slots__ = ("fed", "physical", "axis", "output", "result", "before", "across", "spans", "steps", "contiguous")

    def __init__(self, fed: np.ndarray, physical: np.ndarray, axis: int, output: str):
        self.fed, self.physical, self.axis, self.output = fed, physical, axis, output
        # (read once: a kernel reading the buffer in place asks every step, and a window keeps its buffer)
        self.contiguous = bool(physical.flags.c_contiguous)
        self.result: np.ndarray | None = None
        self.before = (slice(None),) * axis  # the index of the axes before the growing one
        self.across = physical.shape[:axis] + physical.shape[axis + 1:]  # what both parts must span elsewhere
        # Shape -> whether it spans ``across`` on the other axes (a decode loop's parts have a few shapes: the step's
        # rows, and the past at each length), so a step compares each shape once, not two slices of it per call.
        self.spans: dict[tuple, bool] = {}
        # Past length -> (the row a one-row append writes, the window one row longer): a decode loop's views made
        # once per length, not twice per step (indexing makes them at several times the row copy's cost).
        self.steps: dict[int, tuple[np.ndarray, np.ndarray]] = {}


_LOCAL = threading.local()  # .windows: output name -> Window, during a bound run on this thread
# (.grown: id(an append's result) -> Window, filled as this run's Concats append)


@contextmanager
def appending(windows: Sequence[Window]) -> Iterator[None]:
    """Within the block, Concats on this thread may append into ``windows`` (nested runs see only their own)."""
    saved = enter(windows)
    try:
        yield
    finally:
        leave(saved)


def append(output: str, xs: tuple, axis: int) -> np.ndarray | None:
    """``Concat(*xs)`` along ``axis`` (normalized) as a longer window of the buffer ``xs[0]`` views, with
    ``xs[1]`` written after its rows; None where no window of this run allows it (the caller concatenates)."""
    window = append_window(output, xs, axis)
    return None if window is None else window.result


def append_window(output: str, xs: tuple, axis: int) -> Window | None:
    """:func:`append`'s window (its ``result`` the longer window, its ``physical`` the buffer), or None: for a
    kernel that reads the buffer itself (a decode step's attention over the cache it appends to)."""
    found = admitted(output, xs, axis)
    if found is None:
        return None
    window, length = found
    grown = length + xs[1].shape[axis]
    row, result = _views(window, length, grown)
    row[...] = xs[1]
    _LOCAL.grown[id(result)] = window
    window.result = result
    return window


def admitted(output: str, xs: tuple, axis: int) -> tuple[Window, int] | None:
    """The window :func:`append_window` would append ``xs[1]`` into, and the past's length in it, with nothing
    written or marked yet: for a kernel that writes the rows itself (:func:`claim`); None where no window of this
    run allows the append."""
    windows = getattr(_LOCAL, "windows", None)
    if not windows or len(xs) != 2:
        return None
    past, new = xs
    window = windows.get(output)
    if window is None or window.fed is not past or not _fits(window, past, new, axis):
        return None
    return window, past.shape[axis]


def admitted_pair(outputs: tuple[str, str], pasts: tuple, news: tuple, axis: int) -> tuple[Window, Window, int] | None:
    """:func:`admitted` for a layer's key and value caches (``outputs``, ``pasts`` and ``news`` in that order) appended
    at one length: (the key window, the value window, the pasts' length), or None where either would not be admitted.
    One call for both, as a decode step's attention asks for them on every step (nothing written or marked)."""
    windows = getattr(_LOCAL, "windows", None)
    if not windows:
        return None
    key_window, value_window = windows.get(outputs[0]), windows.get(outputs[1])
    if key_window is None or value_window is None or key_window is value_window:
        return None
    past_key, past_value = pasts
    if key_window.fed is not past_key or value_window.fed is not past_value:
        return None
    length = past_key.shape[axis]
    if past_value.shape[axis] != length or not _fits(key_window, past_key, news[0], axis) \
            or not _fits(value_window, past_value, news[1], axis):
        return None
    return key_window, value_window, length


def _fits(window: Window, past: np.ndarray, new, axis: int) -> bool:
    """admitted's checks of one window fed ``past`` (its ``fed``, checked by the caller) taking ``new``."""
    physical = window.physical
    if window.result is not None or window.axis != axis or type(new) is not np.ndarray or new.dtype != physical.dtype:
        return False
    spans = window.spans
    new_shape, past_shape = new.shape, past.shape
    fits = spans.get(new_shape)
    if fits is None:
        fits = _spans(window, new_shape)
    if fits:
        fits = spans.get(past_shape)
        if fits is None:
            fits = _spans(window, past_shape)
    return fits and past_shape[axis] + new_shape[axis] <= physical.shape[axis]


def claim_pair(key_window: Window, value_window: Window, length: int, grown: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`claim` of an :func:`admitted_pair`'s two windows, for a caller that has written both windows' rows
    ``length:grown`` already: (the key window's ``result``, the value window's)."""
    marked = _LOCAL.grown
    keys = _views(key_window, length, grown)[1]
    values = _views(value_window, length, grown)[1]
    marked[id(keys)], marked[id(values)] = key_window, value_window
    key_window.result, value_window.result = keys, values
    return keys, values


def claim(window: Window, length: int, grown: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``length:grown`` of an :func:`admitted` window taken as this run's append: (those rows of the buffer,
    which the caller writes before anything reads the result, the window's ``result``, rows ``:grown``)."""
    row, result = _views(window, length, grown)
    _LOCAL.grown[id(result)] = window
    window.result = result
    return row, result


def _views(window: Window, length: int, grown: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows ``length:grown`` of the window's buffer, rows ``:grown``): a one-row append's kept per length."""
    if grown == length + 1:
        views = window.steps.get(length)
        if views is None:
            before, physical = window.before, window.physical
            views = window.steps[length] = (physical[before + (slice(length, grown),)],
                                            physical[before + (slice(0, grown),)])
        return views
    before, physical = window.before, window.physical
    return physical[before + (slice(length, grown),)], physical[before + (slice(0, grown),)]


def _spans(window: Window, shape: tuple) -> bool:
    """Whether an array of ``shape`` spans ``window``'s buffer on every axis but the growing one (kept per shape)."""
    axis = window.axis
    fits = len(shape) == window.physical.ndim and shape[:axis] + shape[axis + 1:] == window.across
    if len(window.spans) >= 4096:  # (shapes without bound: start over)
        window.spans.clear()
    window.spans[shape] = fits
    return fits


def contiguous_rows(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """C-contiguous arrays whose first rows along the second-to-last axis are ``keys`` and ``values``: the buffers
    this thread's bound run appended them into, at their capacity, where it did for both at one length (read where
    they lie); else contiguous copies."""
    grown = getattr(_LOCAL, "grown", None)
    if grown:
        key_window, value_window = grown.get(id(keys)), grown.get(id(values))
        if key_window is not None and value_window is not None and key_window.result is keys \
                and value_window.result is values and key_window.axis == keys.ndim - 2 == value_window.axis \
                and keys.shape[-2] == values.shape[-2] and key_window.physical.flags.c_contiguous \
                and value_window.physical.flags.c_contiguous:
            return key_window.physical, value_window.physical
    return np.ascontiguousarray(keys), np.ascontiguousarray(values)


def fed_window(past) -> Window | None:
    """The window of this thread's bound run fed as ``past`` (that very array), or None: for a kernel that rewrites
    a cache's valid rows in place before they are read (a half-precision model's rounding of its past inputs),
    which the run's present then holds anyway, as the binding is both."""
    windows = getattr(_LOCAL, "windows", None)
    if windows:
        for window in windows.values():
            if window.fed is past:
                return window
    return None


def by_output(windows: Sequence[Window]) -> dict[str, Window]:
    """``windows`` keyed as :func:`enter` takes them: a loop of runs over the same windows builds this once."""
    return {window.output: window for window in windows}


def enter(windows: Sequence[Window] | dict[str, Window]) -> tuple:
    """:func:`appending` without the context manager, for a run's hot path: returns what :func:`leave` restores.
    ``windows`` may come keyed by their outputs already (:func:`by_output`, made once for many runs)."""
    saved = (getattr(_LOCAL, "windows", None), getattr(_LOCAL, "grown", None))
    _LOCAL.windows = windows if isinstance(windows, dict) else by_output(windows)
    _LOCAL.grown = {}
    return saved


def leave(saved: tuple | None) -> None:
    _LOCAL.windows, _LOCAL.grown = saved if saved is not None else (None, None)
