"""Planned steps as one straight-line Python function, built once per step list.

The generic run loop (:func:`.steps.run_steps`) pays per step for what the plan already fixed: unpacking the
step's tuple, a getter over the slot list, a branch on the output count and a loop over the releases. Here each
step is one line of code over local variables: ``v7 = k2(v3, env[5])[0]``, with the kernels bound as closure
cells, a value that a step of this list produced held in a local, and a value that arrived in ``env`` (a feed, a
weight, a kept shape value) read from its slot. A release is ``v7 = None`` (``env[5] = None`` for an arrived
value), at the same step as the loop's, so values live exactly as long; what is still live at the end is stored
into ``env``, where the caller reads outputs and kept values. A failing step is found from the traceback's line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

BUILT = [0]  # functions built in this process (tests assert that a stream of frames builds none)


class StepCode:
    """Built from steps with ``run``, ``inputs``, ``outputs`` and ``release`` (:class:`.steps.Step`).
    ``run(env)``: the steps in order over ``env``; ``step_at(exc)``: the index of the step whose line raised
    ``exc`` (None when the failure is not in a step's line), and whether the line itself raised it (taking
    apart the kernel's results) rather than the kernel it called."""

    __slots__ = ("run", "_code", "_lines")

    def __init__(self, steps: Sequence[Any]):
        source, kernels, self._lines = _source(steps)
        cells = ", ".join(kernels)
        text = f"def _bind({cells}):\n" + "".join(f"    {line}\n" for line in source) + "    return run\n"
        namespace: dict[str, Any] = {}
        exec(compile(text, "<planned steps>", "exec"), namespace)  # noqa: S102 (code made from slot numbers only)
        # (popped: a function in its own globals is a reference cycle, freed only by a cyclic collection)
        self.run = namespace.pop("_bind")(*(step.run for step in steps))
        self._code = self.run.__code__
        BUILT[0] += 1

    def step_at(self, exc: BaseException) -> tuple[int | None, bool]:
        tb = exc.__traceback__
        line, own = None, False
        while tb is not None:
            if tb.tb_frame.f_code is self._code:
                line, own = tb.tb_lineno, tb.tb_next is None
            tb = tb.tb_next
        return (self._lines.get(line) if line is not None else None), own


def _source(steps: Sequence[Any]) -> tuple[list[str], list[str], dict[int, int]]:
    """The lines of ``run`` (inside ``_bind``, whose first line is line 1), the kernels' cell names, and each
    step's line number -> its index."""
    produced: set[int] = set()
    lines = ["def run(env):"]
    where: dict[int, int] = {}
    kernels = []

    def read(slot: int) -> str:
        return f"v{slot}" if slot in produced else f"env[{slot}]"

    for index, step in enumerate(steps):
        kernel = f"k{index}"
        kernels.append(kernel)
        call = f"{kernel}({', '.join(read(slot) for slot in step.inputs)})"
        outs = step.outputs
        if len(outs) == 1:
            text = f"v{outs[0]} = {call}[0]"
        else:
            text = f"r = {call}"
            if outs:
                text += f"; {', '.join(f'v{slot}' for slot in outs)} = r[:{len(outs)}]"
        produced.update(outs)
        released = [f"v{slot} = None" if slot in produced else f"env[{slot}] = None" for slot in step.release]
        if released:
            text += "; " + "; ".join(released)
            produced.difference_update(step.release)
        where[len(lines) + 2] = index  # (+1: _bind's line; +1: numbered from 1)
        lines.append("    " + text)
    for slot in sorted(produced):
        lines.append(f"    env[{slot}] = v{slot}")
    if len(lines) == 1:
        lines.append("    pass")
    return lines, kernels, where
