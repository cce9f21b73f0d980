"""A bound plan's large elementwise steps and squeeze-excitation blocks shared with the helper threads
(segment_steps.build_plan).

The convolutions, pools and depthwise convolutions of a plan split across the kernel threads as their kernels do;
its SiLU, Sigmoid, HardSigmoid and HardSwish loops, residual sums and squeeze-excitation blocks ran on the calling
thread alone, so at two threads EfficientNet-B0 at 224x224 spent the time of a one-thread run in them (about a
quarter of its run). A float32 loop of segment_loops over at least KNOBS.split_elements values becomes one step of
jobs.ELEMENTWISE: its values cut into TASKS_PER_THREAD ranges per thread, claimed one by one (a helper that falls
behind, descheduled on a shared CPU, leaves its ranges to the others). A plain-layout squeeze-excitation block of
one image that large becomes three steps: its plane means as claimed spans of planes (jobs.ELEMENTWISE), its gates on
this thread (segment_loops.squeeze_scale), its scaling as claimed spans of planes. Each value is computed by the
same loops as before: the plan's outputs are the one-thread plan's, bit for bit. Steps a chain runs (blocked-layout
plans: segment_chain.py) stay in it, their values shared by the chain's split, which backs off from helpers that
fall behind: split out here they broke the chain into short ones and kept posting to a descheduled helper.
"""

from __future__ import annotations

import numpy as np

from ..threads import helper_count, kernel_threads
from ..tuning import KNOBS
from .split import LINE_FLOATS, claimed_tasks, run_claimed

TASKS_PER_THREAD = 4


def _loops() -> dict:
    from ..compiled import jobs, segment_loops

    return {segment_loops.swish_float32_into: jobs.SWISH, segment_loops.sigmoid_float32_into: jobs.SIGMOID,
            segment_loops.hard_sigmoid_into: jobs.HARD_SIGMOID, segment_loops.add_float32_into: jobs.ADD}


def split_elementwise(steps: list) -> list:
    """``steps`` (a plan's calls, its chains made: segment_chain shares a chain's elementwise rows itself) with each
    large float32 elementwise step and squeeze-excitation block outside a chain (see the module doc) as claimed
    splits; the same list where none is, or one thread runs the plan."""
    from ..compiled import segment_loops

    threads = min(kernel_threads(), 1 + helper_count())
    if threads < 2:
        return steps
    loops = _loops()
    found = []
    for function, arguments in steps:
        if function in loops and _large(arguments):
            found.append(_split(loops[function], arguments, threads))
        elif function is segment_loops.squeeze_excite and _large_block(arguments):
            found.extend(_split_block(arguments, threads))
        else:
            found.append((function, arguments))
    return found if len(found) != len(steps) or any(f is _claimed_ranges for f, _ in found) else steps


def _large(arguments) -> bool:
    x = arguments[0]
    return x.dtype == np.float32 and x.ndim == 1 and x.size >= KNOBS.split_elements \
        and all(a.dtype == np.float32 and a.ndim == 1 and a.size == x.size for a in arguments
                if isinstance(a, np.ndarray))


def _split(loop: int, arguments: tuple, threads: int):
    from ..compiled import jobs

    x = arguments[0]
    no_operand = np.empty(0, np.float32)
    params = np.zeros(2, np.float32)
    flag = False
    if loop == jobs.ADD:
        b, y = arguments[1], arguments[2]
    else:
        b, y = no_operand, arguments[1]
        if loop == jobs.SWISH:
            params[0] = arguments[2]
        elif loop == jobs.HARD_SIGMOID:
            params[:] = arguments[2], arguments[3]
            flag = bool(arguments[4])
    tasks = TASKS_PER_THREAD * threads
    cuts, ranges, claims = claimed_tasks(x.size, tasks, threads, LINE_FLOATS)
    parts = [(loop, x, b, y, params, flag, 1, cuts, ranges, claims, part) for part in range(threads)]
    return _claimed_ranges, (parts,)


def _claimed_ranges(parts) -> None:
    """A bound plan's step: jobs.ELEMENTWISE's parts, their claims (shared) zeroed first."""
    from ..compiled import jobs

    run_claimed(jobs.ELEMENTWISE, parts)


def _large_block(arguments) -> bool:
    """Whether a squeeze-excitation step (segment_loops.squeeze_excite's arguments) is one float32 image of at least
    KNOBS.split_elements values."""
    x, y = arguments[0], arguments[11]
    return x.dtype == np.float32 and y.dtype == np.float32 and x.shape[0] == 1 and x.size >= KNOBS.split_elements \
        and x.flags.c_contiguous and y.flags.c_contiguous


def _split_block(arguments, threads: int) -> list:
    """A squeeze-excitation block's three steps: its means, its gates, its scaling (see the module doc)."""
    from ..compiled import jobs, segment_loops

    x, y, pooled, hidden, scale = arguments[0][0], arguments[11][0], arguments[12], arguments[13], arguments[14]
    channels, width = x.shape
    flat_x, flat_y, params = x.reshape(-1), y.reshape(-1), np.zeros(2, np.float32)
    tasks = min(channels, TASKS_PER_THREAD * threads)
    cuts, ranges, claims = claimed_tasks(channels, tasks, threads)

    def parts(loop, values):
        return [(loop, flat_x, values, flat_y, params, False, width, cuts, ranges, claims, part)
                for part in range(threads)]

    return [(_claimed_ranges, (parts(jobs.MEANS, pooled),)),
            (segment_loops.squeeze_scale, (pooled, *arguments[1:11], hidden, scale)),
            (_claimed_ranges, (parts(jobs.SCALE, scale),))]
