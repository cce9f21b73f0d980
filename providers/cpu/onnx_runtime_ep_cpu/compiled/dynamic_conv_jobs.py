"""compiled/dynamic_conv.dynamic_conv_quads, quantized_conv_blocks.quantized_conv_blocks and
quantized_conv_grid.quantized_conv_grid shared with the helper
threads (workers.py): each phase (x's range, the padded codes, the patches, the products) one job whose tasks the
calling thread and the helpers claim. Apart from those modules, which a process's first runs import before numba
loads: this module imports workers, and numba with it."""

from __future__ import annotations

import numpy as np

from . import jit
from .dynamic_conv import CODES, PATCHES, PRODUCTS, RANGE, dynamic_phase, dynamic_plan
from .mailbox import byte_codes, doubles, floats, int32s, ints, scalar
from .quantize import range_parameters
from .quantized_conv_blocks import quantized_phase, quantized_plan
from .quantized_conv_grid import GEOMETRY, grid_phase, grid_plan
from .workers import Kind, claim_task, collect, offer, run_here


@jit
def _run_dynamic_conv(phase, x, codes, patches, weight, column_sums, weight_zeros, b_scales, bias, out,
                      extremes, parameters, geometry, ranges, claims, part):
    cursor = np.zeros(1, dtype=np.int64)
    while True:  # the part's own tasks, then those the other parts' threads have not claimed
        task = claim_task(claims, ranges, part, cursor)
        if task < 0:
            break
        dynamic_phase(phase, x, codes, patches, weight, column_sums, weight_zeros, b_scales, bias, out,
                       extremes, parameters, geometry, task, task + 1)


# dynamic_conv_quads' phases as claimed-task jobs (split_dynamic_conv): dynamic_phase's tasks, part p's tasks
# ranges[p] .. ranges[p + 1] claimed through claims[p].
DYNAMIC_CONV = Kind("dynamic_conv", (
    scalar("phase"), floats("x", 4), byte_codes("codes"), byte_codes("patches"),
    byte_codes("weight", 2, signed=True), ints("column_sums"), ints("weight_zeros"), doubles("b_scales"),
    floats("bias"), floats("out", 3), floats("extremes", 2), floats("parameters", shape=(2,)),
    ints("geometry", shape=(15,)), ints("ranges", shape=("claims.shape[0] + 1",)), ints("claims"), scalar("part"),
), _run_dynamic_conv, home=__name__)
_write_dynamic_conv = DYNAMIC_CONV.writer


@jit
def split_dynamic_conv(x, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, column_sums, weight_zeros,
                       b_scales, bias, out, ranges, claims, own, mailboxes, states, runner):
    """dynamic_conv_quads across the calling thread and the helpers, posted as jobs.split_conv's parts
    (DYNAMIC_CONV), one job per phase (each needs the one before whole): x's range (each task's value_range, their
    bounds combined here as value_range's: the same whatever the order), the padded codes, the patches, the
    products. ``ranges``: part p's tasks ranges[p] .. ranges[p + 1] of ranges[-1]; ``claims`` one per part.
    Returns workers.collect's results, or'ed."""
    parts = ranges.shape[0] - 1
    codes, patches, extremes, parameters, geometry = dynamic_plan(x, kh, kw, sh, sw, dh, dw, top, bottom, left,
                                                                        right, oh, ow, weight, ranges[parts])
    helpers = min(parts - 1, mailboxes.shape[0])
    result = 0
    for phase in (RANGE, CODES, PATCHES, PRODUCTS):
        if phase == CODES:
            low, high = np.float32(0), np.float32(0)
            for task in range(extremes.shape[1]):
                low = extremes[0, task] if extremes[0, task] < low else low
                high = extremes[1, task] if extremes[1, task] > high else high
            parameters[0], parameters[1] = range_parameters(low, high)
        claims[:] = 0
        for part in range(1, helpers + 1):
            _write_dynamic_conv(mailboxes[part - 1], phase, x, codes, patches, weight, column_sums,
                                weight_zeros, b_scales, bias, out, extremes, parameters, geometry, ranges, claims,
                                part)
            offer(mailboxes, states, part - 1, runner)
        _write_dynamic_conv(own, phase, x, codes, patches, weight, column_sums, weight_zeros, b_scales, bias,
                            out, extremes, parameters, geometry, ranges, claims, 0)
        run_here(runner, own)
        result |= collect(mailboxes, states, helpers)
    return result


@jit
def _run_quantized_conv(phase, x, x_codes, codes, patches, weight, terms, weight_zeros, factors, shifts, consts,
                        out, out_codes, geometry, ranges, claims, part):
    cursor = np.zeros(1, dtype=np.int64)
    tasks = ranges[ranges.shape[0] - 1]
    while True:
        task = claim_task(claims, ranges, part, cursor)
        if task < 0:
            break
        quantized_phase(phase, x, x_codes, codes, patches, weight, terms, weight_zeros, factors, shifts, consts, out,
                        out_codes, geometry, tasks, task, task + 1)


# quantized_conv_blocks' phases as claimed-task jobs (split_quantized_conv), as DYNAMIC_CONV's.
QUANTIZED_CONV = Kind("quantized_conv", (
    scalar("phase"), floats("x", 4), byte_codes("x_codes", 4), byte_codes("codes"), byte_codes("patches"),
    byte_codes("weight", 2, signed=True), int32s("terms"), int32s("weight_zeros"), doubles("factors"),
    doubles("shifts"), doubles("consts"), floats("out", 3), byte_codes("out_codes", 3), ints("geometry", shape=(15,)),
    ints("ranges", shape=("claims.shape[0] + 1",)), ints("claims"), scalar("part"),
), _run_quantized_conv, home=__name__)
_write_quantized_conv = QUANTIZED_CONV.writer


@jit
def split_quantized_conv(x, x_codes, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, terms,
                         weight_zeros, factors, shifts, consts, out, out_codes, ranges, claims, own, mailboxes,
                         states, runner):
    """quantized_conv_blocks across the calling thread and the helpers, one job per phase (the codes, the patches,
    the products), as split_dynamic_conv. Returns workers.collect's results, or'ed."""
    parts = ranges.shape[0] - 1
    codes, patches, _, _, geometry = quantized_plan(x, x_codes, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh,
                                                    ow, weight, ranges[parts])
    helpers = min(parts - 1, mailboxes.shape[0])
    result = 0
    for phase in (CODES, PATCHES, PRODUCTS):
        claims[:] = 0
        for part in range(1, helpers + 1):
            _write_quantized_conv(mailboxes[part - 1], phase, x, x_codes, codes, patches, weight, terms,
                                  weight_zeros, factors, shifts, consts, out, out_codes, geometry, ranges, claims, part)
            offer(mailboxes, states, part - 1, runner)
        _write_quantized_conv(own, phase, x, x_codes, codes, patches, weight, terms, weight_zeros, factors, shifts,
                              consts, out, out_codes, geometry, ranges, claims, 0)
        run_here(runner, own)
        result |= collect(mailboxes, states, helpers)
    return result


@jit
def _run_quantized_grid(phase, x, x_codes, codes, offsets, starts, lanes, weight, terms, factors, shifts, singles,
                        consts, out, out_codes, geometry, ranges, claims, part):
    cursor = np.zeros(1, dtype=np.int64)
    tasks = ranges[ranges.shape[0] - 1]
    while True:
        task = claim_task(claims, ranges, part, cursor)
        if task < 0:
            break
        grid_phase(phase, x, x_codes, codes, offsets, starts, lanes, weight, terms, factors, shifts, singles, consts,
                   out, out_codes, geometry, tasks, task, task + 1)


# quantized_conv_grid's phases as claimed-task jobs (split_quantized_grid), as DYNAMIC_CONV's.
QUANTIZED_GRID = Kind("quantized_grid", (
    scalar("phase"), floats("x", 4), byte_codes("x_codes", 4), byte_codes("codes"), ints("offsets"), ints("starts"),
    ints("lanes"), byte_codes("weight", 2, signed=True), int32s("terms"), doubles("factors"), doubles("shifts"),
    floats("singles"), doubles("consts"), floats("out", 3), byte_codes("out_codes", 3),
    ints("geometry", shape=(GEOMETRY,)),
    ints("ranges", shape=("claims.shape[0] + 1",)), ints("claims"), scalar("part"),
), _run_quantized_grid, home=__name__)
_write_quantized_grid = QUANTIZED_GRID.writer


@jit
def split_quantized_grid(x, x_codes, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight, terms, factors,
                         shifts, singles, consts, offsets, starts, lanes, out, out_codes, ranges, claims, own,
                         mailboxes, states, runner):
    """quantized_conv_grid across the calling thread and the helpers, one job per phase (the grid's codes, the
    products), as split_dynamic_conv. Returns workers.collect's results, or'ed."""
    parts = ranges.shape[0] - 1
    codes, geometry = grid_plan(x, x_codes, kh, kw, sh, sw, dh, dw, top, bottom, left, right, oh, ow, weight,
                                ranges[parts])
    helpers = min(parts - 1, mailboxes.shape[0])
    result = 0
    for phase in (CODES, PRODUCTS):
        claims[:] = 0
        for part in range(1, helpers + 1):
            _write_quantized_grid(mailboxes[part - 1], phase, x, x_codes, codes, offsets, starts, lanes, weight, terms,
                                  factors, shifts, singles, consts, out, out_codes, geometry, ranges, claims, part)
            offer(mailboxes, states, part - 1, runner)
        _write_quantized_grid(own, phase, x, x_codes, codes, offsets, starts, lanes, weight, terms, factors, shifts,
                              singles, consts, out, out_codes, geometry, ranges, claims, 0)
        run_here(runner, own)
        result |= collect(mailboxes, states, helpers)
    return result
