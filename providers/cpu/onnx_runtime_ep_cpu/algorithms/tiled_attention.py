"""What compiled/attention.py's float32 attention loops are passed, worked out once per input shapes for
ops/transformer.py's Attention kernel: the tiles' layout; and the few-row loop's call over a 3-D Attention's
(B, S, H * D) inputs, read in place."""

from __future__ import annotations

import numpy as np

from ..threads import kernel_threads
from ..tuning import KNOBS
from .products import gemv_host


class TiledLayout:
    """What the Attention kernel's tiled path passes compiled/attention.py for one set of C-contiguous input
    shapes (``geo``: the kernel's head layout, ``total``: the keys' length): the query tiles, the element
    strides of Q, K, V and Y as (B, H, S, D) views of their flat memory, the scalars, the units' split across
    threads and the scratch each needs."""

    def __init__(self, geo, q, k, v, scale: float, total: int):
        from ..compiled import attention

        def strides(x, heads):
            return np.array([stride // 4 for stride in geo.to_heads(x, heads).strides[:3]], np.int64)

        batch, heads = q.shape[0], geo.q_heads
        self.y_shape = q.shape[:-1] + (heads * geo.v_head_size,) if geo.rank == 3 else\
            (batch, heads, geo.q_len, geo.v_head_size)
        self.q_strides, self.k_strides, self.v_strides = strides(q, heads), strides(k, geo.kv_heads),\
            strides(v, geo.kv_heads)
        self.y_strides = strides(np.empty(self.y_shape, np.float32), heads)
        self.sizes = (heads, geo.kv_heads, total, geo.head_size, geo.v_head_size)
        self.scale = np.array([scale], np.float32)
        self.plan = attention.tiles(geo.q_len)
        self.starts = np.ascontiguousarray(self.plan[:, 0])
        self.every_key = np.full(len(self.plan), total, np.int64)
        units = batch * heads
        work = units * geo.q_len * total * (geo.head_size + geo.v_head_size)
        threads = max(1, min(kernel_threads(), units, work // KNOBS.split_macs))
        self.bounds = np.array([units * t // threads for t in range(threads + 1)], np.int64)
        self.scratch = attention.scratch_size(geo.head_size, geo.v_head_size, total)


def few_in_place(geo, q, k, v, scale, bias, outputs: int = 3) -> tuple | None:
    """(Y, present_key, present_value)[:outputs] of a small attention over 3-D Q, K and V (``geo``: the
    kernel's head layout): Y (B, S, Hq * Dv) read and written in that layout by compiled/attention_lanes.py's
    loop where enough query rows share each KV head, else compiled/attention.few_rows_by_position; the keys and
    values as heads (made only when asked for: an encoder's node has one output). ``bias`` as decoder.py's
    few-row loop takes it. Q, K and V may be column views of one product (rows_readable): the 16-lane loop reads
    them in place, the scalar one a contiguous copy. None where a row has no finite score."""
    lanes, loop = FEW_ROWS[:2] if FEW_ROWS[1] is not None else few_rows_loops()
    batch, keys, heads, size = q.shape[0], k.shape[1], geo.q_heads, geo.head_size
    in_lanes = lanes is not None and geo.q_len * (heads // geo.kv_heads) >= LANES_ROWS
    if not in_lanes:
        q, k, v = np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)
    y = np.empty((batch, geo.q_len, heads * geo.v_head_size), np.float32)
    if in_lanes:  # (the 3-D operands as they are: the loop finds the heads and makes its scratch)
        if not lanes(q, k, v, heads, geo.kv_heads, scale, bias, y):
            return None
    elif not loop(q.reshape(batch, geo.q_len, heads, size), k.reshape(batch, keys, geo.kv_heads, size),
                  v.reshape(batch, keys, geo.kv_heads, geo.v_head_size), scale, bias,
                  y.reshape(batch, geo.q_len, heads, geo.v_head_size)):
        return None
    if outputs == 1:
        return (y,)
    return (y, geo.to_heads(k, geo.kv_heads), geo.to_heads(v, geo.kv_heads))[:outputs]


def few_by_head(geo, q, k, v, scale, bias, outputs: int = 3) -> tuple | None:
    """few_in_place's result for 4-D (B, H, S, D) Q, K and V (a decoder's heads, and its present keys and values)
    where enough query rows share each KV head (``lanes_take``): compiled/attention_lanes.py's loop reads them in
    place (a head split's transposed view too) and writes Y (B, H, S, Dv). None where a row has no finite score."""
    if not q.size or not k.size:
        return None
    if FEW_ROWS[3] is None:
        few_rows_loops()
    q, k, v = _heads_readable(q), _heads_readable(k), _heads_readable(v)
    y = np.empty((q.shape[0], geo.q_heads, geo.q_len, geo.v_head_size), np.float32)
    if not FEW_ROWS[3](q, k, v, scale, bias, y, np.empty(FEW_ROWS[2](geo.head_size, k.shape[2]), np.float32)):
        return None
    return (y, k, v)[:outputs]


def rows_readable(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> bool:
    """Whether few_in_place reads these float32 3-D (B, S, H * D) arrays as they are: C-contiguous, or rows at a
    larger stride (column views of one product) with contiguous components and no negative stride."""
    for x in (q, k, v):
        if not x.flags.c_contiguous:
            strides = x.strides
            if strides[2] != 4 or strides[0] < 0 or strides[1] < 0:
                return False
    return True


def _heads_readable(x: np.ndarray) -> np.ndarray:
    """x as the by-head loop reads it in place (each head's components contiguous, no negative stride), else a
    contiguous copy."""
    strides = x.strides
    return x if strides[3] == 4 and min(strides) >= 0 else np.ascontiguousarray(x)


def lanes_take(geo) -> bool:
    """Whether the 16-lane loop runs this head layout's few-row attention: an AVX-512 host, and enough query rows
    per KV head (query length x query heads sharing it) to repay packing each KV head's K^T."""
    return geo.q_len * (geo.q_heads // max(geo.kv_heads, 1)) >= LANES_ROWS and gemv_host()


# Query rows per KV head (query length x heads sharing it) from which the 16-lane loop runs: it packs each KV
# head's K^T once, which a decode step's one or two rows per head do not repay.
LANES_ROWS = 8
# How many times the few_query_macs knob's multiply-adds the 16-lane loop takes (it outran the batched products
# up to there on encoders' short sequences, heads of 16).
LANES_MACS = 16
# The same over (B, H, S, D) heads, whose loop reads K and V rows at a stride: with a bias per head it outran the
# compiled pass per head to about half of that.
BY_HEAD_MACS = 8
FEW_ROWS: list = [None, None, None, None]  # once imported: the 16-lane loop over 3-D (B, S, H * D) operands
# (attention_lanes.few_rows_of_tokens; None off AVX-512), the scalar one,
# the 16-lane loop's scratch_size, and its loop over (B, H, S, D) heads


def few_rows_loops() -> list:
    """The few-row loops for this host: AVX-512 hosts also run compiled/attention_lanes.py's (whole 16-lane
    vectors, which LLVM would split in two elsewhere); every host attention.py's."""
    from ..compiled import attention

    if gemv_host():
        from ..compiled import attention_lanes

        FEW_ROWS[0], FEW_ROWS[2], FEW_ROWS[3] = attention_lanes.few_rows_of_tokens, attention_lanes.scratch_size,\
            attention_lanes.few_rows_by_head
    FEW_ROWS[1] = attention.few_rows_by_position
    return FEW_ROWS[:2]


def few_macs(geo, limit: int) -> int:
    """The multiply-adds up to which a small attention of this head layout runs one few-row call, given the
    scalar loop's ``limit``: more where the 16-lane loop takes it (lanes_take)."""
    if lanes_take(geo):
        return limit * (LANES_MACS if geo.rank == 3 else BY_HEAD_MACS)
    return limit
