"""Sub-byte weight formats: unpacking 2-, 4- and 8-bit values from uint8 blobs (lowest bits first), and
dequantizing the blockwise weights of MatMulNBits and GatherBlockQuantized.
"""

from __future__ import annotations

import numpy as np


def unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """The ``8 // bits`` values of every byte along the last axis, lowest bits first, as uint8.

    A (..., n) uint8 array gives (..., n * 8 // bits).
    """
    packed = np.asarray(packed, dtype=np.uint8)
    if bits == 8:
        return packed
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * np.uint8(bits)
    values = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return values.reshape(packed.shape[:-1] + (packed.shape[-1] * per_byte,))


def block_weights(quantized, scales, zero_points, group) -> np.ndarray:
    """Dequantized (N, K) weights in float64: ``(q - zero_point) * scale`` per element, each column k of
    row n taking block ``group[k]``'s scale and zero point from row n of (N, blocks) ``scales`` and
    ``zero_points`` (None: no offset). ``quantized`` is (N, K) integers.

    float64 keeps every product exact for float16/float32 scales and zero points.
    """
    scale = np.asarray(scales, dtype=np.float64)[:, group]
    centered = np.asarray(quantized, dtype=np.float64)
    if zero_points is not None:
        centered = centered - np.asarray(zero_points, dtype=np.float64)[:, group]
    return centered * scale
