"""What the tiled float32 attention (compiled/attention.py) is passed for one set of input shapes, worked out once
per shapes by ops/transformer.py's Attention kernel."""

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
