"""Where a segment's bound plan (segment_steps.py) keeps its values: one arena, shared by liveness.

A plan is bound twice. The first binding gives every value its own buffer (``Lifetimes``) and notes when each
is written and read for the last time, by node index (a reshape's view lives as long as its last reader, a
segment output to the end); buffers the finished steps never reference (a value the blocked layout keeps in
another buffer) are left out. The values are then placed in one arena by interval colouring (``place``:
largest first, each at the lowest offset no value live at the same time holds), and the second binding
(``Arena``) hands out views of the arena at those places. A value's interval runs from the node that writes it
to the last node that reads it, both included, so a value written by a node never shares memory with one that
node reads: no in-place reuse.

The arena starts filled with NaN bits, so a step that reads memory no earlier step of the run wrote shows up
in the plan's first run, which is checked against the node-by-node run (ops/segment.py) before the plan is
kept. Scratch that must keep its contents between runs (zero or -inf padding) stays in its own buffers.
"""

from __future__ import annotations

import numpy as np

from ..compiled.aligned import LINE, aligned_empty

_ALIGN = LINE  # bytes: each value's place in the arena starts on a cache line
_END = 1 << 62  # the interval end of a segment output: live to the end of the run


def _root(array: np.ndarray) -> np.ndarray:
    return array if array.base is None or not isinstance(array.base, np.ndarray) else array.base


class Lifetimes:
    """The first binding's allocator: ``take(slot, shape, dtype, blocked)`` gives a buffer of its own and
    notes the value's interval; ``at(index)`` says which node is being bound. ``aliases(inner, env)``: the position
    of the input whose buffer a node's output is (a reshape's view, a concatenation's part), or None."""

    def __init__(self, segment, env, aliases):
        self.index = 0
        self.arrays: dict[tuple, np.ndarray] = {}
        self.intervals: dict[tuple, tuple[int, int]] = {}
        root: dict[int, int] = {}  # an alias's slot -> the slot whose buffer it shares
        for inner in segment.inner:
            position = aliases(inner, env)
            if position is not None:
                root[inner.outputs[0]] = root.get(inner.inputs[position], inner.inputs[position])
        self.last: dict[int, int] = {}
        for index, inner in enumerate(segment.inner):
            for slot in inner.inputs:
                base = root.get(slot, slot)
                self.last[base] = max(self.last.get(base, -1), index)
        for slot in segment.results:
            self.last[root.get(slot, slot)] = _END
        self.born: dict[int, int] = {}

    def at(self, index: int) -> None:
        self.index = index

    def take(self, slot: int, shape, dtype, blocked: bool = False) -> np.ndarray:
        born = self.born.setdefault(slot, self.index)  # (a blocked copy of a value: its plain value's interval)
        key = (slot, blocked)
        self.intervals[key] = (born, max(self.last.get(slot, born), born))
        array = self.arrays[key] = np.empty(shape, dtype)
        return array

    def arena(self, steps, results) -> Arena:
        """The second binding's allocator: the buffers that ``steps`` (or the plan's ``results``) reference,
        placed in one arena."""
        used = {id(_root(a)) for a in arrays_in(steps)} | {id(_root(a)) for a in results}
        sizes = {key: array.nbytes for key, array in self.arrays.items() if id(array) in used and array.nbytes}
        offsets, total = place({key: (*self.intervals[key], size) for key, size in sizes.items()})
        return Arena(offsets, total, {key: (self.arrays[key].shape, self.arrays[key].dtype) for key in offsets},
                     {key: self.intervals[key] for key in offsets})


class Arena:
    """The second binding's allocator: ``take`` gives the value's view of the arena where it was placed, or a
    buffer of its own for a value the first binding's steps did not reference."""

    def __init__(self, offsets: dict, nbytes: int, kinds: dict, intervals: dict):
        self.offsets, self.nbytes, self.kinds, self.intervals = offsets, nbytes, kinds, intervals
        self.memory = aligned_empty((nbytes,), np.uint8)
        self.memory.fill(0xFF)  # NaN in every float type: a read before any write reaches the checked outputs
        self.views: dict[tuple, np.ndarray] = {}
        self.private = 0  # bytes handed out outside the arena (buffers the finished steps drop)

    def at(self, index: int) -> None:
        pass

    def take(self, slot: int, shape, dtype, blocked: bool = False) -> np.ndarray:
        key = (slot, blocked)
        dtype = np.dtype(dtype)
        offset = self.offsets.get(key)
        if offset is None or self.kinds[key] != (tuple(shape), dtype):
            array = np.empty(shape, dtype)
            self.private += array.nbytes
            return array
        view = self.memory[offset:offset + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
        self.views[key] = view
        return view


def place(items: dict) -> tuple[dict, int]:
    """Offsets for ``items`` (key -> (first, last, bytes), intervals inclusive) such that two items live at
    the same time never overlap, and the arena's size: largest first, each at the lowest aligned offset that
    fits between the items already placed whose intervals meet its own."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    offsets: dict = {}
    total = 0
    for key, (first, last, size) in sorted(items.items(), key=lambda kv: (-kv[1][2], kv[1][0], str(kv[0]))):
        busy = sorted((o, e) for o, e, f, l in placed if f <= last and first <= l)
        offset = 0
        for start, end in busy:
            if offset + size <= start:
                break
            offset = max(offset, -(-end // _ALIGN) * _ALIGN)
        offsets[key] = offset
        placed.append((offset, offset + size, first, last))
        total = max(total, offset + size)
    return offsets, total


def arrays_in(value):
    """The arrays in a step list's arguments (tuples and lists of them, nested)."""
    if isinstance(value, np.ndarray):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from arrays_in(item)
