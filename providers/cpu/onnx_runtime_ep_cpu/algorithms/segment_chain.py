"""Runs of a bound plan's blocked-layout steps as one compiled call (compiled/conv_chain.run_chain).

A bound plan (segment_steps.py) calls each step's compiled loop with its prepared arguments, and numba's wrapper
unboxes every argument again on each call (about half a microsecond for a direct convolution's 25). Where two or
more consecutive steps call loops of PATTERNS with arguments of their pattern's types, ``chained`` writes them
as rows of one table for ``run_chain``: one call, two arrays to unbox, the same loops on the same buffers in
the same order (the same values bit for bit). ``CHAIN`` turns it off (plans made after the change).

With more than one thread, a table of one image whose direct convolutions or elementwise loops are large enough
runs through ``run_chain_split`` instead: those rows' tile rows or values are shared with the helper threads, the
other rows run here (a
batch of several images splits by images instead: segment_split.py, whose parts are planned at one thread).
"""

from __future__ import annotations

import numpy as np

from ..compiled.directconv import PIXELS
from ..tuning import KNOBS
from .helper_backoff import HelperBackoff
from .segment_arena import arrays_in
from .split import LINE_FLOATS, task_cuts

CHAIN = True
# Each chained loop (by name: compiled/directconv_blocked.py, directconv_gathered.py, blocked_ops.py,
# segment_loops.py) and its arguments: "fN" a C-contiguous float32 array of N dimensions, "i1" a C-contiguous int64
# vector, "i" an integer, "b" a flag, "r" a float32 scalar. A loop's number in run_chain is its place here.
PATTERNS = {
    "conv_blocked": "f1 f4 i1 f2 f1 f1 i f1 f1 i i i i i i b i i i i b i i i b i",
    "conv_gathered": "f1 f4 i1 f2 f1 f1 i f1 f1 i1 i1 i i i i i i i i i b i",
    "depthwise_blocked": "f1 f1 i1 f1 f1 i f1 i i i i i i i i i i f1 i i f1",
    "max_pool_blocked": "f1 i1 f1 i i i i i i i i i i f1 i i f1",
    "squeeze_excite_blocked": "f1 f2 f1 f1 b f2 f1 f1 i r r f1 i i i f1 f1 f1",
    "plane_means_blocked": "f1 f1 i i i f1",
    # activations between them (compiled/segment_loops.py: a SiLU after a convolution), on blocked or plain values
    "swish_float32_into": "f1 f1 r",
    "sigmoid_float32_into": "f1 f1",
    "hard_sigmoid_into": "f1 f1 r r b",
    "average_pool_blocked": "f1 i1 f1 f1 i i i i i i i i i i f1 i i f1",
    # a residual sum and a channel Concat's copies between blocked values
    "add_float32_into": "f1 f1 f1",
    "copy_channels_blocked": "f1 f1 i i i i i",
}
_MODULES = ("onnx_runtime_ep_cpu.compiled.directconv_blocked", "onnx_runtime_ep_cpu.compiled.directconv_gathered",
            "onnx_runtime_ep_cpu.compiled.blocked_ops", "onnx_runtime_ep_cpu.compiled.segment_loops")
_KINDS = {name: (number, pattern.split()) for number, (name, pattern) in enumerate(PATTERNS.items())}
_WIDTH = 1 + max(sum({"f2": 3, "f4": 5}.get(c, 2 if c[0] in "fi" and len(c) == 2 else 1) for c in p)
                 for _, p in _KINDS.values())
_INT64 = (-(1 << 63), (1 << 63) - 1)
# A direct convolution row of one image shares its tile rows with the helper threads from this many multiply-adds
# (a split row costs a post and a collect, about a microsecond), in about TASKS_PER_THREAD tasks per thread.
SPLIT_ROW_MACS = 1 << 19
TASKS_PER_THREAD = 4
# A split row whose helper kept the caller waiting longer than its own part ran and than STALL_SECONDS (a descheduled
# helper holds it a time slice; quiet jitter is microseconds) is missed, as one the helper took no part in or ran
# under half its share of. Misses send the process's split chains to run alone for a while (one back-off for every
# chain: how busy the helpers' CPUs are is the process's), counted in rows: a miss costs MISSED_ROWS, tolerated up
# to TOLERATED_ROWS (helper_backoff.py).
STALL_SECONDS = 50e-6
MISSED_ROWS, TOLERATED_ROWS, RECOVERY_ROWS = 100, 300, 1000
_BACKOFF = HelperBackoff(MISSED_ROWS, TOLERATED_ROWS, RECOVERY_ROWS)


def _field(code: str, value, reals: list) -> list | None:
    """One argument's slots in a row (PATTERNS' codes), or None where ``value`` is not of that type."""
    if code[0] in "fi" and len(code) == 2:
        dtype, ndim = (np.float32, int(code[1])) if code[0] == "f" else (np.int64, 1)
        if type(value) is not np.ndarray or value.dtype != dtype or value.ndim != ndim or not value.flags.c_contiguous:
            return None
        return [value.__array_interface__["data"][0], *value.shape]
    if code == "i":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
                or not _INT64[0] <= int(value) <= _INT64[1]:
            return None
        return [int(value)]
    if code == "b":
        return [int(value)] if isinstance(value, (bool, np.bool_)) else None
    if type(value) is not np.float32:
        return None
    reals.append(float(value))
    return [len(reals) - 1]


def _row(function, arguments, reals: list) -> list | None:
    """The table row of one step, or None where it is not a chained loop called with its pattern's types."""
    from ..compiled.deferred import Loop

    if not isinstance(function, Loop) or function.__module__ not in _MODULES or function.__name__ not in _KINDS:
        return None
    number, pattern = _KINDS[function.__name__]
    if len(arguments) != len(pattern):
        return None
    row = [number]
    for code, value in zip(pattern, arguments):
        slots = _field(code, value, reals)
        if slots is None:
            return None
        row.extend(slots)
    return row + [0] * (_WIDTH - len(row))


def chained(steps: list, linked) -> list:
    """``steps`` with each run of two or more consecutive chainable steps replaced by one ``run_chain`` step (the
    caller keeps ``steps``: the arrays at the tables' addresses); ``steps`` itself where nothing chains, CHAIN is
    off, or ``linked(function, arguments)`` says run_chain is not linked yet (a background loader compiles it
    first: segment_steps._linked)."""
    if not CHAIN:
        return steps
    rows: list = []
    reals: list = []
    for function, arguments in steps:
        rows.append(_row(function, arguments, reals))
    if sum(r is not None for r in rows) < 2:
        return steps
    from ..compiled.conv_chain import run_chain

    out: list = []
    index = 0
    while index < len(steps):
        end = index
        while end < len(steps) and rows[end] is not None:
            end += 1
        if end - index >= 2:
            table = np.array(rows[index:end], dtype=np.int64)
            # (the "r" fields are float32 scalars, as conv_chain.CHAIN's mailbox posts them)
            values = np.array(reals if reals else [0.0], dtype=np.float32)
            if not linked(run_chain, (table, values)):
                return steps
            out.append(_threaded(table, values, linked) or (run_chain, (table, values)))
            index = end
        else:
            out.append(steps[index])
            index += 1
    return out if len(out) < len(steps) else steps


def _threaded(table: np.ndarray, values: np.ndarray, linked) -> tuple | None:
    """The step running ``table`` with the helper threads (compiled/conv_chain.run_chain_split), or None where the
    run has one thread, no row to split, or the split call is not linked yet."""
    from ..threads import helper_count, kernel_threads

    parts = min(kernel_threads(), 1 + helper_count())
    if parts < 2:
        return None
    splits, bounds = _splits(table, parts)
    if bounds is None:
        return None
    from ..compiled import workers
    from ..compiled.conv_chain import ROW, run_chain, run_chain_split

    ranges, claims, ran = np.zeros(parts + 1, dtype=np.int64), np.zeros(parts, dtype=np.int64), \
        np.zeros(parts, dtype=np.int64)
    status = np.zeros(2, dtype=np.int64)
    arguments = (table, values, splits, bounds, ranges, claims)
    if not linked(run_chain_split, (*arguments, ran, status, 0, np.zeros(workers.MAILBOX_SIZE, dtype=np.int64),
                                    *workers.NO_HELPERS, 0)):
        return None
    # (the helpers' runner compiled or loaded now: in a plan's trial, a cache miss leaves the plan for later)
    call, mailbox, helpers, runner = workers.call, workers.local_mailbox, helper_count(), ROW.address()
    pool = workers.helpers(helpers)
    first, stall = pool.mailboxes[:1], int(pool.cycles_per_second * STALL_SECONDS)
    sleeping, done, posted, wake = workers.SLEEPING, workers.DONE, workers.POSTED, workers.wake
    backoff = _BACKOFF

    def run_chain_threads(table, reals, splits, bounds, ranges, claims):
        # A helper asleep, or woken and not running yet (its last job taken back: a virtual CPU takes ~1 ms to run
        # a woken thread), would take no part: the chain runs here as run_chain, the helper woken for later calls.
        # After splits whose rows the helper missed, calls run here for a while (helper_backoff.py).
        if backoff.runs_alone() or not len(first) or first[0, sleeping] or first[0, done] != first[0, posted]:
            if len(first) and first[0, sleeping] and backoff.alone <= 0:  # (not backing off, or its last call)
                wake(first[0])
                backoff.woken()
            run_chain(table, reals)
            return
        call(run_chain_split, (table, reals, splits, bounds, ranges, claims, ran, status, stall, mailbox(0)), runner,
             0, helpers)
        if status[0]:
            backoff.took_part(int(status[0]))
        if status[1]:
            backoff.missed()

    return run_chain_threads, arguments


def _splits(table: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray | None]:
    """run_chain_split's ``splits`` and ``bounds`` for ``table`` at ``parts`` threads (bounds None: no row splits):
    a direct convolution row (blocked or gathered tiles) of one image of at least SPLIT_ROW_MACS multiply-adds, its
    tiles' rows cut evenly into tasks; an elementwise row of at least KNOBS.split_elements values, its values cut
    into tasks starting on cache lines (no two threads write one)."""
    splits = np.zeros((len(table), 2), dtype=np.int64)
    bounds: list[int] = []
    for r, row in enumerate(table):
        if row[0] in _ELEMENTWISE_KINDS:
            values = int(row[_X_AT + 1])
            if values >= KNOBS.split_elements:
                splits[r] = (len(bounds), parts * TASKS_PER_THREAD)
                bounds.extend(task_cuts(values, parts * TASKS_PER_THREAD, LINE_FLOATS))
            continue
        shape = _tile_rows(row)
        if shape is None:
            continue
        rows, macs = shape
        count = min(rows, parts * TASKS_PER_THREAD)
        if macs < SPLIT_ROW_MACS or count < 2:
            continue
        splits[r] = (len(bounds), count)
        bounds.extend(task_cuts(rows, count))
    return splits, (np.array(bounds, dtype=np.int64) if bounds else None)


def _tile_rows(row: np.ndarray) -> tuple[int, int] | None:
    """(tile rows, multiply-adds) of a direct convolution row of one image (run_chain_split's tasks cut its tile
    rows); None for another row."""
    tiles, depth = int(row[_WEIGHTS_AT + 2]), int(row[_WEIGHTS_AT + 3])
    if row[0] == _KINDS["conv_blocked"][0] and row[_IMAGES_AT] == 1:
        oh, ow = int(row[_OH_AT]), int(row[_OH_AT + 1])
        return tiles * oh, tiles * 16 * depth * oh * ow
    if row[0] == _KINDS["conv_gathered"][0] and row[_GATHERED_IMAGES_AT] == 1:
        groups = int(row[_STARTS_AT + 1]) // PIXELS
        return tiles * groups, tiles * 16 * depth * int(row[_GATHERED_IMAGES_AT - 1])
    return None


# conv_blocked's row: x's address and length, then the in_place and x_blocked flags (run_chain's unpacking)
_X_AT, _IN_PLACE_AT, _X_BLOCKED_AT = 1, 28, 33
_WEIGHTS_AT, _IMAGES_AT, _OH_AT = 3, 29, 35  # the weights' address and dims (1, tiles, depth, 16); images; oh, ow
_STARTS_AT, _GATHERED_IMAGES_AT = 22, 27  # conv_gathered's row: its pixel starts (address, length); count, images


# the elementwise rows run_chain_split can share (compiled/conv_chain._elementwise_range), x's length at _X_AT + 1
_ELEMENTWISE_KINDS = tuple(_KINDS[name][0] for name in ("swish_float32_into", "sigmoid_float32_into",
                                                        "hard_sigmoid_into", "add_float32_into"))

_CHAIN_CALLS = ("run_chain", "run_chain_threads")


def read_in_place(feeds, steps, calls, results) -> tuple:
    """``(slot, buffer, table, row)`` for each feed whose only reader is a chained conv_blocked row that copies
    its plain input image by image into its own padded source (not in place): that row can read the caller's
    array itself, C-contiguous as the buffer is, instead of the feed being copied into the buffer first (a
    batch of 32 3x64x64 images: 1.5 MB, ~100 us of a 2.6 ms run). A feed that any other step or a result
    touches (a view of it, a residual, an output) keeps its copy."""
    if calls is steps:
        return ()
    found = []
    for slot, buffer in feeds:
        if buffer.dtype != np.float32 or not buffer.flags.c_contiguous:
            continue
        touching = sum(np.may_share_memory(a, buffer) for _, arguments in steps for a in arrays_in(arguments))
        if touching != 1 or any(np.may_share_memory(r, buffer) for r in results):
            continue
        address = buffer.__array_interface__["data"][0]
        for function, arguments in calls:
            table = arguments[0] if getattr(function, "__name__", "") in _CHAIN_CALLS else None
            if table is None:
                continue
            rows = [r for r in range(len(table)) if table[r, 0] == _KINDS["conv_blocked"][0]
                    and table[r, _X_AT] == address and table[r, _X_AT + 1] == buffer.size
                    and table[r, _IN_PLACE_AT] == 0 and table[r, _X_BLOCKED_AT] == 0]
            if len(rows) == 1:
                found.append((slot, buffer, table, rows[0]))
    return tuple(found)
