"""MatMulNBits' product on the packed weight, without a float32 copy of it.

The weight is repacked once (ops/contrib_weights.py) along K instead of N: byte [p, n] holds the
``per_byte = 8 // bits`` values w[p * per_byte + t, n], t = 0.., lowest bits first, and the scales and zero
points are (blocks, N). A step takes one packed row: its ``per_byte`` weight rows are dequantized into a
(per_byte, N) float32 buffer that stays in cache, then added into every output row, y[m, :] += a[m, k] * w[k, :].
Both loops run along N, contiguous, which the compiler vectorizes; each weight value is read once per call.

A weight value is float32((q - zero) * scale), the difference exact and the product rounded once (float32
arithmetic for integer zero points, ``wide`` float64 for float ones): the value the dequantized weight would
hold. Sums run in k order, each product added with one rounding (a fused multiply-add where the CPU has one).
"""

from __future__ import annotations

import numpy as np

from . import compiler, jit

_fused = compiler(fastmath={"contract"})


@jit
def _dequantize_row(packed, shift, mask, zero, scale, wide, out):
    """out[n] = float32((((packed[n] >> shift) & mask) - zero[n]) * scale[n])."""
    if wide:
        for n in range(out.shape[0]):
            q = np.float64((np.int32(packed[n]) >> shift) & mask)
            out[n] = np.float32((q - zero[n]) * scale[n])
    else:
        for n in range(out.shape[0]):
            q = np.float32((np.int32(packed[n]) >> shift) & mask)
            out[n] = (q - np.float32(zero[n])) * np.float32(scale[n])


@jit
def dequantize_columns(packed, scales, zeros, wide, bits, block, first, out):
    """Columns first .. first + out.shape[1] of the (K, N) weight as float32 into (K, cols) ``out``."""
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    end = first + out.shape[1]
    for k in range(out.shape[0]):
        j = k // block
        _dequantize_row(packed[k // per_byte, first:end], (k % per_byte) * bits, mask, zeros[j, first:end],
                        scales[j, first:end], wide, out[k])


@_fused
def product(a, packed, scales, zeros, wide, bits, block, out):
    """out = a @ w for float32 (M, K) ``a`` and the repacked (K, N) weight (packed (ceil(K / per_byte), N)
    uint8, scales and zeros (blocks, N): float32 for integer zero points, float64 for float ones with
    ``wide``); out (M, N) float32."""
    rows, depth = a.shape
    columns = out.shape[1]
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    w = np.empty((per_byte, columns), np.float32)
    out[:] = 0
    for p in range(packed.shape[0]):
        k = p * per_byte
        count = min(per_byte, depth - k)
        for t in range(count):
            j = (k + t) // block
            _dequantize_row(packed[p], t * bits, mask, zeros[j], scales[j], wide, w[t])
        for m in range(rows):
            y = out[m]
            if count == 2:  # 4-bit: both rows of the byte in one pass over y
                a0, a1 = a[m, k], a[m, k + 1]
                w0, w1 = w[0], w[1]
                for n in range(columns):
                    y[n] += a0 * w0[n] + a1 * w1[n]
            else:
                for t in range(count):
                    at = a[m, k + t]
                    wt = w[t]
                    for n in range(columns):
                        y[n] += at * wt[n]
