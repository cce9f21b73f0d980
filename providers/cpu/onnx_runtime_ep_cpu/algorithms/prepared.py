"""Transforms of constant inputs (rearranged weights, folded normalization parameters) kept per kernel.
"""

from __future__ import annotations

import numpy as np

# Square blocks a large transpose copies one at a time: a whole-matrix copy of a transposed view walks one
# side a column at a time, each element a cache line apart; blocks that fit in cache copy it several times faster.
TRANSPOSE_BLOCK = 128


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


def transposed(matrix: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of a 2-D ``matrix``'s transpose, copied block by block when large."""
    rows, columns = matrix.shape
    if rows * columns <= TRANSPOSE_BLOCK * TRANSPOSE_BLOCK * 4:
        return np.array(matrix.T, order="C")
    out = np.empty((columns, rows), dtype=matrix.dtype)
    for i in range(0, rows, TRANSPOSE_BLOCK):
        for j in range(0, columns, TRANSPOSE_BLOCK):
            out[j:j + TRANSPOSE_BLOCK, i:i + TRANSPOSE_BLOCK] = matrix[i:i + TRANSPOSE_BLOCK, j:j + TRANSPOSE_BLOCK].T
    return out
