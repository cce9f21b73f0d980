"""What compiled/attention.py's float32 attention loops are passed, worked out once per input shapes for
ops/transformer.py's Attention kernel: the tiles' layout; and the few-row loop's call over a 3-D Attention's
(B, S, H * D) inputs, read in place."""

from __future__ import annotations

import numpy as np

from ..threads import kernel_threads
from ..tuning import KNOBS


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
    """(Y, present_key, present_value)[:outputs] of a small attention over C-contiguous 3-D Q, K and V (``geo``: the
    kernel's head layout): Y (B, S, Hq * Dv) read and written in that layout by compiled/attention.few_rows_by_position,
    the keys and values as heads (made only when asked for: an encoder's node has one output). ``bias`` as
    decoder.py's few-row loop takes it. None where a row has no finite score."""
    loop = _FEW_ROWS[0]
    if loop is None:  # numba loads only for models that need it (an import statement per call costs a microsecond)
        from ..compiled import attention

        loop = _FEW_ROWS[0] = attention.few_rows_by_position
    batch, keys, heads, size = q.shape[0], k.shape[1], geo.q_heads, geo.head_size
    y = np.empty((batch, geo.q_len, heads * geo.v_head_size), np.float32)
    if not loop(q.reshape(batch, geo.q_len, heads, size), k.reshape(batch, keys, geo.kv_heads, size),
                v.reshape(batch, keys, geo.kv_heads, geo.v_head_size), scale, bias,
                y.reshape(batch, geo.q_len, heads, geo.v_head_size)):
        return None
    if outputs == 1:
        return (y,)
    return (y, geo.to_heads(k, geo.kv_heads), geo.to_heads(v, geo.kv_heads))[:outputs]


_FEW_ROWS: list = [None]  # compiled/attention.few_rows_by_position, once imported
