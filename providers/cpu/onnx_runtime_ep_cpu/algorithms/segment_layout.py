"""Channel-blocked values inside a segment's bound plan (segment_steps.py).

A value that one direct convolution writes and only direct convolutions read (as their input or their
residual) is kept blocked, (N, ceil(C / 16), H, W, 16) as onnxruntime's NCHWc, between them
(compiled/directconv_blocked.py): its writer stores each tile as its accumulators hold it, without the
transposes the plain layout needs. The layout changes only at such a run's edges, inside the convolutions
that read a plain value or write one; every other step (pools, squeeze-excitation blocks, the head, a
node's own kernel) and the segment's outputs see the plain layout. The values are those of the plain plan:
the same sums in the same order, stored elsewhere.
"""

from __future__ import annotations

import numpy as np

_RESIDUAL_INPUT = 3  # FusedConv's z


def _direct_call(steps, span):
    """The arguments of a node's steps where they are one direct-tiles call of one group, else None."""
    from ..compiled import directconv

    start, end = span
    if end - start != 1:
        return None
    function, arguments = steps[start]
    if function is not directconv.conv_direct or arguments[1].shape[0] != 1:
        return None
    return arguments


def _blocked_slots(segment, calls: dict) -> set:
    """The slots written by a direct call and read only by direct calls, as input or residual, with a residual
    in the layout of the output it is added to; never a segment input or output."""
    readers: dict[int, list[tuple[int, int]]] = {}
    for index, inner in enumerate(segment.inner):
        for position, slot in enumerate(inner.inputs):
            readers.setdefault(slot, []).append((index, position))
    results = set(segment.results)
    chosen = set()
    for index in calls:
        slot = segment.inner[index].outputs[0]
        uses = readers.get(slot, [])
        if slot in results or slot < segment.feeds or not uses:
            continue
        if all(r in calls and p in (0, _RESIDUAL_INPUT) for r, p in uses):
            chosen.add(slot)
    changed = True
    while changed:  # an output and the residual added to it share a layout
        changed = False
        for index in calls:
            inner = segment.inner[index]
            if len(inner.inputs) <= _RESIDUAL_INPUT or inner.inputs[_RESIDUAL_INPUT] < 0:
                continue
            residual, output = inner.inputs[_RESIDUAL_INPUT], inner.outputs[0]
            if (residual in chosen) != (output in chosen):
                chosen.discard(residual)
                chosen.discard(output)
                changed = True
    return chosen


def block_direct_runs(segment, steps: list, spans: dict) -> tuple[list, int]:
    """``steps`` with the runs of direct convolutions over blocked values (see the module doc), and the bytes of
    the blocked buffers they add; ``spans``: node index -> (first, end) of its steps."""
    from ..compiled import directconv_blocked as kernel

    calls = {}
    for index, span in spans.items():
        arguments = _direct_call(steps, span)
        if arguments is not None:
            calls[index] = arguments
    chosen = _blocked_slots(segment, calls)
    if not chosen:
        return steps, 0
    blocked: dict[int, np.ndarray] = {}
    for index, arguments in calls.items():
        slot = segment.inner[index].outputs[0]
        if slot in chosen:
            n, m, oh, ow = arguments[7].shape
            blocked[slot] = np.zeros(n * -(-m // kernel.CHANNELS) * kernel.CHANNELS * oh * ow, np.float32)
    steps = list(steps)
    for index, arguments in calls.items():
        inner = segment.inner[index]
        x_slot, y_slot = inner.inputs[0], inner.outputs[0]
        residual_slot = inner.inputs[_RESIDUAL_INPUT] if len(inner.inputs) > _RESIDUAL_INPUT else -1
        if x_slot not in chosen and y_slot not in chosen:
            continue
        x, weights, offsets, bias, residual, bounds, flags, y, sh, sw, top, left, height, width, in_place = arguments
        if x_slot in chosen:
            offsets = kernel.blocked_taps(offsets, int(height) * int(width))
        flat_x = blocked[x_slot] if x_slot in chosen else x.reshape(-1)
        flat_y = blocked[y_slot] if y_slot in chosen else y.reshape(-1)
        if residual.size and residual_slot in chosen:
            residual = blocked[residual_slot]
        steps[spans[index][0]] = (kernel.conv_blocked, (
            flat_x, weights, offsets, bias, residual, bounds, flags, flat_y, sh, sw, top, left, height, width,
            in_place, *x.shape, x_slot in chosen, *y.shape[1:], y_slot in chosen))
    return steps, sum(b.nbytes for b in blocked.values())
