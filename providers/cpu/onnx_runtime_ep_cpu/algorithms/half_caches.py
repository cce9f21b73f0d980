"""A half-precision decoder's KV caches rounded where they lie (ops/precision.py's RoundToHalf of the past inputs
a bound run feeds as its caches' windows, kv_append.py)."""

from __future__ import annotations

import math

import numpy as np

from ..compiled import precision as compiled
from ..compiled.deferred import numpy_first
from .bound_loop import EntryOnce
from .precision import FLOAT16, FLOAT32

# From how many elements the compiled rounding beats numpy's two conversions (as algorithms/precision.py's round_to)
ROUNDING_COMPILED_FROM = 512


class CacheRowRounding:
    """Rounds the valid rows of KV cache buffers to float16 where they lie (a half-precision decoder's past inputs,
    bound at their capacity): each buffer's geometry worked out once, and the compiled loop called through its
    entry point (bound_loop.EntryOnce: its arguments are always a flat float32 array and three integers), as a
    decode step calls it for every cache."""

    LIMIT = 64  # buffers whose geometry is kept (a new generation may bind new ones: start over past it)

    def __init__(self):
        self.entry = EntryOnce(compiled.round_rows_to_float16)
        self.geometry: dict[int, tuple] = {}

    def __call__(self, caches: list[tuple[np.ndarray, int, int]]) -> None:
        """Per (physical, axis, rows): the first ``rows`` along ``axis`` of ``physical`` (C-contiguous float32,
        at the cache's capacity) rounded to float16 in place."""
        use_compiled = not numpy_first()
        for physical, axis, rows in caches:
            if not rows:
                continue
            kept = self.geometry.get(id(physical))
            if kept is None or kept[0] is not physical or kept[1] != axis:
                kept = self._geometry(physical, axis)
            _physical, _axis, flat, blocks, stride, row = kept
            length = rows * row
            if use_compiled and blocks * length >= ROUNDING_COMPILED_FROM:
                entry = self.entry.entry or self.entry((flat, blocks, stride, length)) or compiled.round_rows_to_float16
                entry(flat, blocks, stride, length)
                continue
            valid = physical[(slice(None),) * axis + (slice(0, rows),)]
            with np.errstate(over="ignore", invalid="ignore"):
                valid[...] = valid.astype(FLOAT16).astype(FLOAT32)

    def _geometry(self, physical: np.ndarray, axis: int) -> tuple:
        if len(self.geometry) >= self.LIMIT:
            self.geometry.clear()
        stride = math.prod(physical.shape[axis:])
        kept = self.geometry[id(physical)] = (physical, axis, physical.reshape(-1), math.prod(physical.shape[:axis]),
                                              stride, stride // physical.shape[axis] if physical.shape[axis] else 0)
        return kept
