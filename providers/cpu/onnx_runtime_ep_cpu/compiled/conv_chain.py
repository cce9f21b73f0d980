"""One compiled call for a run of a segment plan's consecutive blocked-layout steps (algorithms/segment_chain.py).

Each step of a bound plan (algorithms/segment_steps.py) is a compiled loop's entry point called with its prepared
arguments, and numba's wrapper unboxes every argument on every call: a direct convolution's 25 arguments cost
about half a microsecond before its loop starts, as much as the loop itself for a small layer. ``run_chain``
takes those calls as rows of one int64 table, each row a loop's number (its place in segment_chain.PATTERNS)
then its arguments in the order of that loop's pattern: an array its address and its dimensions, an integer or
a flag its value, a float32 its index in ``reals``; one call unboxes two arrays and runs every row's loop on
views of the plan's own buffers (which the plan keeps, with the arrays it binds, for as long as the table).

``CHAIN`` is the same call as a job of the helper threads (workers.py): a batch's images split into parts, each
part a plan of its own over its own buffers (algorithms/segment_split.py), one table per part.

``run_chain_split`` runs one image's table with the helper threads: a row that segment_chain marks in ``splits``
(a direct convolution, blocked or gathered tiles, or a SiLU, Sigmoid, HardSigmoid or residual sum, large enough) has
its tile rows or its values shared out as tasks (``ROW``: the
calling thread's part and the helpers', each claiming tasks until none is left, so a helper that is late or
descheduled leaves its tasks to the others), and the next row starts once all are done; the other rows run on the
calling thread as in run_chain. A helper that takes no part or falls behind (runs under half its share of a row, or
keeps the caller waiting longer than its own part ran: a CPU shared with another process) leaves the call's other
rows to the caller and is reported in ``status`` (segment_chain backs off on it).
"""

from __future__ import annotations

import numpy as np

from . import jit
from .blocked_ops import (
    average_pool_blocked,
    copy_channels_blocked,
    depthwise_blocked,
    max_pool_blocked,
    plane_means_blocked,
    squeeze_excite_blocked,
)
from .directconv import CHANNELS
from .directconv_blocked import conv_blocked, fill_blocked, fill_image, tile_rows
from .directconv_gathered import conv_gathered, gathered_rows
from .mailbox import floats, ints, scalar
from .segment_loops import add_float32_into, hard_sigmoid_into, sigmoid_float32_into, swish_float32_into
from .workers import Kind, claim_task, collect, cycles, finished, float_array, int_array, offer, run_here


@jit
def _f1(row, at):
    return float_array(row[at], (row[at + 1],))


@jit
def _f2(row, at):
    return float_array(row[at], (row[at + 1], row[at + 2]))


@jit
def _f4(row, at):
    return float_array(row[at], (row[at + 1], row[at + 2], row[at + 3], row[at + 4]))


@jit
def _i1(row, at):
    return int_array(row[at], (row[at + 1],))


@jit
def _convolution_row(row, kind):
    """Rows of kinds 0-2: a direct convolution (blocked or gathered tiles), a depthwise convolution."""
    if kind == 0:
        conv_blocked(_f1(row, 1), _f4(row, 3), _i1(row, 8), _f2(row, 10), _f1(row, 13), _f1(row, 15), row[17],
                     _f1(row, 18), _f1(row, 20), row[22], row[23], row[24], row[25], row[26], row[27],
                     row[28] != 0, row[29], row[30], row[31], row[32], row[33] != 0, row[34], row[35], row[36],
                     row[37] != 0, row[38])
    elif kind == 1:
        conv_gathered(_f1(row, 1), _f4(row, 3), _i1(row, 8), _f2(row, 10), _f1(row, 13), _f1(row, 15), row[17],
                      _f1(row, 18), _f1(row, 20), _i1(row, 22), _i1(row, 24), row[26], row[27], row[28],
                      row[29], row[30], row[31], row[32], row[33], row[34], row[35] != 0, row[36])
    else:
        depthwise_blocked(_f1(row, 1), _f1(row, 3), _i1(row, 5), _f1(row, 7), _f1(row, 9), row[11],
                          _f1(row, 12), row[14], row[15], row[16], row[17], row[18], row[19], row[20], row[21],
                          row[22], row[23], _f1(row, 24), row[26], row[27], _f1(row, 28))


@jit
def _pooling_row(row, kind):
    """Rows of kinds 3, 5 and 9: a max pool, plane means, an average pool."""
    if kind == 3:
        max_pool_blocked(_f1(row, 1), _i1(row, 3), _f1(row, 5), row[7], row[8], row[9], row[10], row[11],
                         row[12], row[13], row[14], row[15], row[16], _f1(row, 17), row[19], row[20],
                         _f1(row, 21))
    elif kind == 5:
        plane_means_blocked(_f1(row, 1), _f1(row, 3), row[5], row[6], row[7], _f1(row, 8))
    else:
        average_pool_blocked(_f1(row, 1), _i1(row, 3), _f1(row, 5), _f1(row, 7), row[9], row[10], row[11],
                             row[12], row[13], row[14], row[15], row[16], row[17], row[18], _f1(row, 19), row[21],
                             row[22], _f1(row, 23))


@jit
def _gating_row(row, kind, reals):
    """Rows of kinds 4, 6-8, 10 and 11: a squeeze-excitation block, the activations, residual sums and channel
    concatenations between the other steps."""
    if kind == 4:
        squeeze_excite_blocked(_f1(row, 1), _f2(row, 3), _f1(row, 6), _f1(row, 8), row[10] != 0, _f2(row, 11),
                               _f1(row, 14), _f1(row, 16), row[18], np.float32(reals[row[19]]),
                               np.float32(reals[row[20]]), _f1(row, 21), row[23], row[24], row[25],
                               _f1(row, 26), _f1(row, 28), _f1(row, 30))
    elif kind == 6:
        swish_float32_into(_f1(row, 1), _f1(row, 3), np.float32(reals[row[5]]))
    elif kind == 7:
        sigmoid_float32_into(_f1(row, 1), _f1(row, 3))
    elif kind == 8:
        hard_sigmoid_into(_f1(row, 1), _f1(row, 3), np.float32(reals[row[5]]), np.float32(reals[row[6]]),
                          row[7] != 0)
    elif kind == 10:
        add_float32_into(_f1(row, 1), _f1(row, 3), _f1(row, 5))
    else:
        copy_channels_blocked(_f1(row, 1), _f1(row, 3), row[5], row[6], row[7], row[8], row[9])


@jit
def _run_row(row, reals):
    kind = row[0]
    if kind <= 2:
        _convolution_row(row, kind)
    elif kind in (3, 5, 9):
        _pooling_row(row, kind)
    else:
        _gating_row(row, kind, reals)


@jit
def run_chain(table, reals):
    """Each row of ``table`` (see the module doc): its loop over the arrays at the row's addresses."""
    for r in range(table.shape[0]):
        _run_row(table[r], reals)


@jit
def _in_place(row):
    """Whether a direct convolution row (kind 0 blocked tiles, 1 gathered) reads its input as its padded image."""
    return row[28] != 0 if row[0] == 0 else row[35] != 0


@jit
def _fill_row(row):
    """A direct convolution row's one image copied into its padded source (conv_blocked's or conv_gathered's copy),
    unless it reads its image in place (or the row is an elementwise loop's: nothing to fill)."""
    if row[0] > 1 or _in_place(row):
        return
    if row[0] == 0:
        fill_image(_f1(row, 1), 0, row[30], row[31], row[32], row[33] != 0, _f1(row, 20), row[24], row[25], row[26],
                   row[27])
    else:
        fill_blocked(_f1(row, 1), 0, row[28] // CHANNELS, CHANNELS, row[29], row[30], _f1(row, 20), row[31], row[32],
                     row[33], row[34])


@jit
def _elementwise_range(row, reals, first, end):
    """Values first .. end of an elementwise row (kinds 6-8 and 10: SiLU, Sigmoid, HardSigmoid, a residual sum)."""
    kind = row[0]
    if kind == 6:
        swish_float32_into(_f1(row, 1)[first:end], _f1(row, 3)[first:end], np.float32(reals[row[5]]))
    elif kind == 7:
        sigmoid_float32_into(_f1(row, 1)[first:end], _f1(row, 3)[first:end])
    elif kind == 8:
        hard_sigmoid_into(_f1(row, 1)[first:end], _f1(row, 3)[first:end], np.float32(reals[row[5]]),
                          np.float32(reals[row[6]]), row[7] != 0)
    else:
        add_float32_into(_f1(row, 1)[first:end], _f1(row, 3)[first:end], _f1(row, 5)[first:end])


@jit
def _row_tasks(table, reals, bounds, ranges, claims, ran, row_index, part):
    """One part of a split row: a direct convolution's (kind 0 or 1, one image, its source filled), task i its
    tiles' rows bounds[i] .. bounds[i + 1] (directconv_blocked.tile_rows, directconv_gathered.gathered_rows), or an
    elementwise loop's, task i its values bounds[i] .. bounds[i + 1]; part p's tasks ranges[p] .. ranges[p + 1],
    claimed one by one through claims[p], then the other parts' unclaimed ones (workers.claim_task); ran[p]: the
    tasks part p ran."""
    row = table[row_index]
    image = _f1(row, 1) if row[0] > 1 or _in_place(row) else _f1(row, 20)  # (an elementwise row reads its own)
    cursor = np.zeros(1, dtype=np.int64)
    while True:
        i = claim_task(claims, ranges, part, cursor)
        if i < 0:
            break
        ran[part] += 1
        if row[0] > 1:
            _elementwise_range(row, reals, bounds[i], bounds[i + 1])
        elif row[0] == 1:
            gathered_rows(image, _f4(row, 3), _i1(row, 8), _f2(row, 10), _f1(row, 13), _f1(row, 15), row[17],
                          _f1(row, 18), _i1(row, 22), _i1(row, 24), row[26], row[36], bounds[i], bounds[i + 1])
        else:
            tile_rows(image, 0, _f4(row, 3), _i1(row, 8), _f2(row, 10), _f1(row, 13), _f1(row, 15), row[17],
                      _f1(row, 18), row[22], row[23], row[27], row[33] != 0, row[34], row[35], row[36], row[37] != 0,
                      row[38], bounds[i], bounds[i + 1])


# _row_tasks, one part: a split row's tasks (see run_chain_split).
ROW = Kind("chain_row", (
    ints("table", 2), floats("reals"), ints("bounds"), ints("ranges", shape=("claims.shape[0] + 1",)), ints("claims"),
    ints("ran", shape=("claims.shape[0]",)), scalar("row_index"), scalar("part"),
), _row_tasks, home=__name__)
_write_row = ROW.writer


@jit
def lagged(count, ran_here, parts, own, waited, stall):
    """Whether the helpers of a row split into ``count`` tasks over ``parts`` threads fell behind: they ran under
    half their share (the caller ran ``ran_here`` tasks: their CPU given to another process or virtual machine), or
    the caller waited for them longer than its own part ran and than ``stall`` (time-stamp cycles ``own``,
    ``waited``: a helper descheduled while it held a task holds the caller up to a time slice)."""
    return 2 * (count - ran_here) * parts < count * (parts - 1) or waited > max(own, stall)


@jit
def run_chain_split(table, reals, splits, bounds, ranges, claims, ran, status, stall, own, mailboxes, states, runner):
    """run_chain over one image's ``table`` with the helper threads (``mailboxes``, ``states``: workers.Helpers';
    none where another caller holds them): row r with ``splits[r, 1]`` > 1 tasks, their tile-row bounds at
    ``bounds[splits[r, 0]:]``, is filled here, then shared as ROW parts (part 0 on this thread through ``own``, its
    mailbox; ``ranges``, ``claims`` and ``ran``, one more and one per part, rewritten for each row), collected
    before the next row. Once the first helper has not run its part (asleep, or woken and not yet running) or fell
    behind (``lagged``, ``stall`` its cycles), the call's other rows run here. ``status`` (two int64, zeroed here):
    the rows the helpers kept up with, and 1 where they did not. Returns workers.collect's results or-ed (for
    Helpers.settle)."""
    parts = ranges.shape[0] - 1
    helpers = min(parts - 1, mailboxes.shape[0])
    status[0], status[1] = 0, 0
    result = 0
    for r in range(table.shape[0]):
        row = table[r]
        count = splits[r, 1]
        if helpers < 1 or count < 2:
            _run_row(row, reals)
            continue
        _fill_row(row)
        first = splits[r, 0]
        task_bounds = bounds[first:first + count + 1]
        for p in range(parts + 1):
            ranges[p] = count * p // parts
        for p in range(parts):
            claims[p] = 0
            ran[p] = 0
        for part in range(1, helpers + 1):
            _write_row(mailboxes[part - 1], table, reals, task_bounds, ranges, claims, ran, r, part)
            offer(mailboxes, states, part - 1, runner)
        _write_row(own, table, reals, task_bounds, ranges, claims, ran, r, 0)
        start = cycles()
        run_here(runner, own)
        ended = cycles()
        posted = states[0]
        result |= collect(mailboxes, states, helpers)
        if posted == 0 or finished(mailboxes[0]) < posted or lagged(count, ran[0], parts, ended - start,
                                                                    cycles() - ended, stall):
            status[1] = 1
            helpers = 0  # asleep, not running yet (~1 ms on a virtual machine), or slowed: the rest here
        else:
            status[0] += 1
    return result


# run_chain, one part: a sub-batch's plan (its table and float32 scalars).
CHAIN = Kind("conv_chain", (ints("table", 2), floats("reals")), run_chain, home=__name__)
