"""Arrays whose data starts on a cache line, for packed weights that the kernels read as whole vectors.

numpy's allocator aligns an array's data to 16 bytes only, so a packed weight's 64-byte vectors (k * 32 float32
at a time, say) would each span two cache lines wherever the array happens to start off a line: every such load
is a split load, which costs the core two. The packers write their layouts into these arrays instead.
"""

from __future__ import annotations

import math

import numpy as np

LINE = 64  # bytes of a cache line, and of an AVX-512 vector


def aligned_empty(shape, dtype=np.float32) -> np.ndarray:
    """An uninitialized C-contiguous array of ``shape`` and ``dtype`` whose data starts on a cache line."""
    dtype = np.dtype(dtype)
    size = math.prod(shape) * dtype.itemsize
    raw = np.empty(size + LINE, dtype=np.uint8)
    skip = -raw.ctypes.data % LINE
    return raw[skip:skip + size].view(dtype).reshape(shape)


def aligned_zeros(shape, dtype=np.float32) -> np.ndarray:
    """aligned_empty, zero-filled."""
    out = aligned_empty(shape, dtype)
    out.fill(0)
    return out


def aligned_copy(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``a`` (any layout, a transposed view say) whose data starts on a cache line."""
    out = aligned_empty(a.shape, a.dtype)
    np.copyto(out, a)
    return out
