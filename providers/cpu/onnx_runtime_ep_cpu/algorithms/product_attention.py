"""com.microsoft Attention over a short sequence as one compiled call: the packed Q/K/V product by matmul.py's
tiles and attention_lanes.py's 16-lane loop reading its parts in place (compiled/packed_attention.py's
product_in_lanes_).

Run as BLAS's product, then a compiled pass copying Q, K and V out with the bias, then the loop, a Whisper- or
BERT-sized node (tens of tokens, a hidden size of 64) paid for a second pass over the product and for the Python
and dispatch between three calls, about what the product's tiles cost beyond BLAS's there. A repeat of a whole
call (same weights, x of the same shape, a count or no mask) calls the loop's linked overload directly.
"""

from __future__ import annotations

import numpy as np

from ..threads import kernel_threads
from ..tuning import KNOBS
from .prepared import Prepared
from .products import entry_point

_NO_COUNTS, _NO_MASK = np.empty(0, np.int32), np.empty((0, 1, 0, 0), np.float32)


class ProductAttention:
    """One contrib Attention node's product-and-loop calls (``heads`` heads, ``fill`` the mask's filter value)."""

    def __init__(self, heads: int, fill: np.float32):
        from ..compiled import gemm, matmul, packed_attention

        self.heads, self.fill = heads, fill
        self.loop = packed_attention.product_in_lanes_
        self.pack, self.pad, self.offsets, self.bias_flag = matmul.pack_columns, matmul.pad_bias, \
            gemm.packed_offsets, gemm.BIAS
        self.work_size = packed_attention.product_work
        self.panels = Prepared()  # the weights packed for the tiles, the bias padded, the rows' offsets
        self.work: dict[tuple, int] = {}  # per (B, S, K, head size): product_work's floats

    @staticmethod
    def takes(x: np.ndarray, weights: np.ndarray, bias: np.ndarray | None) -> bool:
        """Whether this call's product runs in the tiles: constant weights and bias (packed once), a C-contiguous
        x, and a product PackedProduct would not split across threads (below the split_macs knob, or on one
        thread), which BLAS's would otherwise run alone on this thread too."""
        return not weights.flags.writeable and (bias is None or not bias.flags.writeable) \
            and x.flags.c_contiguous and (x.size * weights.shape[1] < KNOBS.split_macs or kernel_threads() == 1)

    def __call__(self, x, weights, bias, counts, mask, scale: np.float32, keep: tuple | None = None):
        """Y (B, S, hidden) for x (B, S, K) float32, the float32 (K, 3 * hidden) weights and (3 * hidden,) bias or
        None, ``counts`` (B,) int32 valid keys or none, else ``mask`` an additive (B', 1, S', S) key bias (as
        packed_in_lanes_ reads them); None where a row has no finite score. With ``keep`` = (a KeptCall, the
        node's mask index), a call that ran whole is kept there as run(x, mask_index)."""
        batch, steps, depth = x.shape
        hidden = weights.shape[1] // 3
        size = hidden // self.heads
        packed, padded_bias, offsets = self.panels.get("panels", (weights, bias), lambda: (
            self.pack(weights), self.pad(bias, 3 * hidden), self.offsets(depth)))
        work = self.work.get((batch, steps, depth, size))
        if work is None:
            work = self.work[(batch, steps, depth, size)] = self.work_size(batch, steps, depth, hidden, size)
        flags, fill, heads, loop = (0 if bias is None else self.bias_flag), self.fill, self.heads, self.loop
        y = np.empty((batch, steps, hidden), np.float32)
        arguments = (x, heads, packed, offsets, padded_bias, flags, counts, mask, fill, scale, y,
                     np.empty(work, np.float32))
        if not loop(*arguments):
            return None
        if keep is not None:
            entry = entry_point(loop, arguments) or loop  # (numba's dispatcher types twelve arguments per call)

            def run(x, mask_index):
                y = np.empty((batch, steps, hidden), np.float32)
                if entry(x, heads, packed, offsets, padded_bias, flags, _NO_COUNTS if mask_index is None else
                         mask_index, _NO_MASK, fill, scale, y, np.empty(work, np.float32)):
                    return y
                return None

            keep[0].keep((weights, bias), (x, keep[1]), run)
        return y
