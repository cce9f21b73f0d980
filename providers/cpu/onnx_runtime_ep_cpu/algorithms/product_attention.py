"""com.microsoft Attention over a short sequence as one compiled call: the packed Q/K/V product by matmul.py's
tiles and attention_lanes.py's 16-lane loop reading its parts in place (compiled/packed_attention.py's
product_in_lanes_).

Run as BLAS's product, then a compiled pass copying Q, K and V out with the bias, then the loop, a Whisper- or
BERT-sized node (tens of tokens, a hidden size of 64) paid for a second pass over the product and for the Python
and dispatch between three calls, about what the product's tiles cost beyond BLAS's there. A repeat of a whole
call (same weights, x of the same shape, a count or no mask) calls the loop's linked overload directly.

On more threads, a node with enough work runs as one job per group of heads (compiled/attention_groups.py): each
thread computes its heads' own Q, K and V columns and their attention, so what one core wrote is read there.
"""

from __future__ import annotations

import numpy as np

from ..threads import helper_count, kernel_threads
from ..tuning import KNOBS
from .helper_backoff import HelperBackoff
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
        self.groups = Prepared()  # per thread count: each head group's weights and bias packed (group_plan)
        self.helpers = HelperBackoff()  # splits' back-off after one no awake helper took part in

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
        parts = min(kernel_threads(), heads)
        splits = parts > 1 and mask.flags.c_contiguous and batch * steps * (3 * depth + 2 * steps) * hidden \
            >= KNOBS.attention_group_macs
        if splits and not self.helpers.runs_alone():
            return self.split(x, weights, bias, counts, mask, scale, parts, flags, offsets, keep)
        y = np.empty((batch, steps, hidden), np.float32)
        arguments = (x, heads, packed, offsets, padded_bias, flags, counts, mask, fill, scale, y,
                     np.empty(work, np.float32))
        if not loop(*arguments):
            return None
        if keep is not None:
            entry = entry_point(loop, arguments) or loop  # (numba's dispatcher types twelve arguments per call)

            def run(x, mask_index):
                if splits and not self.helpers.runs_alone():
                    return None  # (a split node backing off: __call__ splits it again once the calls are spent)
                y = np.empty((batch, steps, hidden), np.float32)
                if entry(x, heads, packed, offsets, padded_bias, flags, _NO_COUNTS if mask_index is None else
                         mask_index, _NO_MASK, fill, scale, y, np.empty(work, np.float32)):
                    return y
                return None

            keep[0].keep((weights, bias), (x, keep[1]), run)
        return y

    def group_plan(self, weights: np.ndarray, bias: np.ndarray | None, parts: int) -> tuple:
        """(firsts, packs, panels, biases) for ``parts`` groups of heads as split_groups reads them: group g's heads
        firsts[g] .. firsts[g + 1] (counts differing by at most one), its Q, K and V columns packed by
        matmul.pack_columns into packs[g] (panels[g] panels, zeros past them), its bias padded into biases[g]."""
        hidden = weights.shape[1] // 3
        size = hidden // self.heads
        firsts = np.array([self.heads * g // parts for g in range(parts + 1)], np.int64)
        columns = [np.concatenate([np.arange(j * hidden + firsts[g] * size, j * hidden + firsts[g + 1] * size)
                                   for j in range(3)]) for g in range(parts)]
        packs = [self.pack(np.ascontiguousarray(weights[:, c])) for c in columns]
        panels = np.array([p.shape[0] for p in packs], np.int64)
        stacked = np.zeros((parts, int(panels.max()), packs[0].shape[1]), np.float32)
        biases = np.zeros((parts, stacked.shape[1] * (packs[0].shape[1] // weights.shape[0])), np.float32)
        for g in range(parts):
            stacked[g, :panels[g]] = packs[g]
            if bias is not None:
                biases[g, :columns[g].size] = bias[columns[g]]
        return firsts, stacked, panels, biases

    def split(self, x, weights, bias, counts, mask, scale: np.float32, parts: int, flags: int, offsets, keep):
        """__call__'s result as one job per group of heads on ``parts`` threads (compiled/attention_groups.py);
        None where a row has no finite score. A call that ran whole is kept as __call__ keeps its own; after a
        call whose awake helpers took none of the groups, the next calls run on this thread alone (the back-off of
        helper_backoff.py)."""
        from ..compiled import attention_groups, workers

        batch, steps, depth = x.shape
        hidden = weights.shape[1] // 3
        size = hidden // self.heads
        firsts, packs, panels, biases = self.groups.get(parts, (weights, bias),
                                                        lambda: self.group_plan(weights, bias, parts))
        work = attention_groups.group_work(batch * steps, steps, depth, int(np.max(np.diff(firsts))), size)
        runner, helpers, split = attention_groups.GROUP.address(), helper_count(), attention_groups.split_groups
        scales = np.array([scale], np.float32)
        fill = self.fill

        def run(x, counts, mask, split=split):
            if self.helpers.alone > 0:  # (a kept split backing off: __call__ runs the node alone)
                return None
            y = np.empty((batch, steps, hidden), np.float32)
            status = np.zeros((3, parts), np.int64)  # per group: ran whole, its CPU; the call's verdicts
            arguments = (x, firsts, size, packs, panels, offsets, biases, flags, counts, mask, fill,
                         np.empty((batch, 1, 1, steps), np.float32), scales, y, status, workers.local_mailbox(work))
            workers.call(split, arguments, runner, work, helpers)
            verdict = status[2, 0]
            if verdict == 2:  # (a helper woken)
                self.helpers.woken()
            elif verdict == 0:  # (a helper took part)
                self.helpers.took_part()
            else:
                self.helpers.missed()
            return (y, arguments) if status[2, 1] else None

        ran = run(x, counts, mask)
        if ran is None:
            return None
        y, arguments = ran
        if keep is not None:  # repeats call split_groups' linked overload (numba's dispatcher types 19 arguments)
            entry = entry_point(split, (*arguments, np.zeros((0, workers.MAILBOX_SIZE), np.int64),
                                        np.zeros(0, np.int64), runner)) or split

            def repeat(x, mask_index):
                ran = run(x, _NO_COUNTS if mask_index is None else mask_index, _NO_MASK, entry)
                return None if ran is None else ran[0]

            keep[0].keep((weights, bias), (x, keep[1]), repeat)
        return y
