"""com.microsoft Attention over a short sequence split across threads by groups of heads, each thread computing its
group's own Q, K and V columns (the node's weights' columns for those heads, packed once per group) and then its
heads' attention, writing its heads' columns of the output in place.

The product shared by every head and the attention split after it lost (whisper's node 42 -> 58-64 us on two
threads): each thread's heads then read Q, K and V rows another core had just written. Here the projection of a
group stays in its thread's cache from the product to the attention; only the node's input (read by every group)
and each group's output columns cross cores.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .attention_lanes import few_rows_into
from .attention_lanes import scratch_size as lanes_scratch_size
from .few_rows import PANEL_ROWS, few_row_panels
from .mailbox import floats, ints, scalar
from .matmul import matmul_panels
from .matmul import scratch_size as product_scratch_size
from .workers import Kind, collect, current_cpu, offer, run_here


def group_work(rows: int, steps: int, depth: int, heads: int, size: int) -> int:
    """Floats one group's part needs (its thread's scratch): the group's packed product (rows, 3 * heads * size),
    then the scratch of the product's tiles or of the 16-lane loop (used one after the other)."""
    return 3 * heads * size * rows + max(product_scratch_size(depth), lanes_scratch_size(size, steps))


@jit
def head_group(x, first, heads, size, packed, offsets, padded_bias, flags, key_bias, scale, y, status, part,
               scratch):
    """Heads first .. first + heads of the node: x (B, S, K) C-contiguous times the group's packed weights (its
    heads' Q, then K, then V columns, matmul.pack_columns'd; ``padded_bias`` likewise with gemm.BIAS in
    ``flags``) into ``scratch`` (group_work's floats), then attention_lanes' 16-lane loop over those parts in
    place with ``key_bias`` (B', 1, S', S) additive (no elements: none) and scale[0], into the heads' columns of
    y (B, S, hidden). status[0, part] = 1 where the loop ran whole, else 0 (a row without a finite score);
    status[1, part] = the CPU the part ran on (parts on one CPU: no helper took any)."""
    batch, steps, depth = x.shape
    hidden = y.shape[2]
    rows = batch * steps
    n = 3 * heads * size
    product = scratch[:rows * n]
    rest = scratch[rows * n:]
    none = np.empty(0, np.float32)
    if rows <= PANEL_ROWS:
        few_row_panels(x.reshape(-1), depth, rows, depth, packed, offsets, padded_bias, product, n, none, flags, none,
                       0, packed.shape[0], rest)
    else:
        matmul_panels(x.reshape(-1), depth, rows, depth, packed, offsets, padded_bias, product, n, none, flags, none,
                      0, packed.shape[0], rest)
    qkv = product.reshape(batch, steps, 3, heads, size)
    whole = few_rows_into(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], scale[0], key_bias,
                          y.reshape(-1)[first * size:], (steps * hidden, hidden, size), rest)
    status[0, part] = 1 if whole else 0
    status[1, part] = current_cpu()


# head_group, one part: one group of heads.
GROUP = Kind("attention_group", (
    floats("x", 3), scalar("first"), scalar("heads"), scalar("size"), floats("packed", 2), ints("offsets"),
    floats("padded_bias"), scalar("flags"), floats("key_bias", 4), floats("scale", shape=(1,)), floats("y", 3),
    ints("status", 2), scalar("part"),
), head_group, scratch=lambda x, heads, size: group_work(x.shape[0] * x.shape[1], x.shape[1], x.shape[2], heads, size),
    home=__name__)
_write_group = GROUP.writer


@jit
def split_groups(x, firsts, size, packs, panels, offsets, biases, flags, counts, mask, fill, key_work, scale, y, status,
                 own, mailboxes, states, runner):
    """Every head group of the node, group g's heads firsts[g] .. firsts[g + 1] with its packed weights packs[g]
    (its first panels[g] panels: the groups' packs padded to the largest) and biases[g]: group g > 0
    posted to helper g - 1 (a sleeping or missing helper's group runs here), group 0 and those on the calling
    thread through ``own`` (workers.local_mailbox), then collected. The key bias is ``fill`` at keys at or after
    counts[b] where ``counts`` has elements (written into key_work, (B, 1, 1, S)), else ``mask``. Returns
    workers.collect's result; status (3, groups) as head_group writes it, status[2, 1] = 1 where every group ran
    whole, and status[2, 0]: 2 where a helper slept (offer woke it), else 1 where no group ran on another CPU than
    group 0 (the awake helpers descheduled, their groups taken back; or no helpers), else 0."""
    key_bias = mask
    if counts.size:
        batch, steps = x.shape[0], x.shape[1]
        key_bias = key_work
        for b in range(batch):
            for t in range(steps):
                key_bias[b, 0, 0, t] = fill if t >= counts[b] else np.float32(0)
    parts = firsts.shape[0] - 1
    helpers = min(parts - 1, mailboxes.shape[0])
    here = np.ones(parts, dtype=np.bool_)
    for part in range(1, helpers + 1):
        _write_group(mailboxes[part - 1], x, firsts[part], firsts[part + 1] - firsts[part], size,
                     packs[part, :panels[part]], offsets, biases[part], flags, key_bias, scale, y, status, part)
        here[part] = not offer(mailboxes, states, part - 1, runner)
    for part in range(parts):
        if here[part]:
            _write_group(own, x, firsts[part], firsts[part + 1] - firsts[part], size, packs[part, :panels[part]],
                         offsets, biases[part], flags, key_bias, scale, y, status, part)
            run_here(runner, own)
    result = collect(mailboxes, states, helpers)
    _verdicts(here, helpers, status)
    return result


@jit
def _verdicts(here, helpers, status):
    """split_groups' status[2] from its groups' (status[0], status[1]) and ``here`` (the groups not offered)."""
    parts = here.shape[0]
    taken = asleep = False
    for part in range(1, parts):
        if not here[part]:
            taken = taken or status[1, part] != status[1, 0]
        elif part <= helpers:
            asleep = True
    status[2, 0] = 2 if asleep else (1 if not taken else 0)
    whole = 1
    for part in range(parts):
        whole = min(whole, status[0, part])
    status[2, 1] = whole
