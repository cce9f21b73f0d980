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
from .directconv_blocked import conv_blocked
from .directconv_gathered import conv_gathered
from .mailbox import floats, ints
from .segment_loops import add_float32_into, hard_sigmoid_into, sigmoid_float32_into, swish_float32_into
from .workers import Kind, float_array, int_array


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
def run_chain(table, reals):
    """Each row of ``table`` (see the module doc): its loop over the arrays at the row's addresses."""
    for r in range(table.shape[0]):
        row = table[r]
        kind = row[0]
        if kind <= 2:
            _convolution_row(row, kind)
        elif kind in (3, 5, 9):
            _pooling_row(row, kind)
        else:
            _gating_row(row, kind, reals)


# run_chain, one part: a sub-batch's plan (its table and float32 scalars).
CHAIN = Kind("conv_chain", (ints("table", 2), floats("reals")), run_chain, home=__name__)
