"""Device work that follows a bound run inside the run's captured graph: a decode step's epilogue.

A decode loop on the device does more per step than the model's run: it moves the KV rows the run appended,
sets their mask bits, takes the argmax of the logits and folds the chosen token into the next step's inputs.
Launched after each replay, those are a dozen driver calls per step; captured with the run, the step is one
graph launch. ``InferenceSession.run_with_device_bindings(..., epilogue=StepEpilogue(...))`` asks for that.

An epilogue's launches are baked into the graph with their arguments, so everything that changes from step to
step must be read from device memory (the contract's ``device_token_writer_at`` and ``device_copy_rows_at``
read the step and the position from a device counter and advance it). Its ``key`` names what its launches
bake (buffer addresses and sizes): a run with another key is another graph signature. It must launch only,
on the provider of its bindings: no allocation, no host read, no host synchronization.

How a run executes it: the device-graph runner (session/device_graphs.py) captures it after the last captured
segment when that segment ends the run and produces every delivered output, together with the copies that
write the outputs into their bindings, and sets ``captured`` on the run's :class:`CapturedTail`; every other
run (eager, warming up, ending in a seam, no capture at all) delivers its outputs and then calls ``launch``
itself, so the epilogue runs exactly once per run either way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, eq=False)
class StepEpilogue:
    """Launches that follow a bound run (see the module docstring). ``bindings``: the DeviceIoBindings they
    touch, so releasing one resets the graph that recorded its address."""

    launch: Callable[[], None]
    key: tuple
    bindings: tuple[Any, ...] = ()


@dataclass(eq=False)
class CapturedTail:
    """A bound run's tail as the device-graph runner sees it: ``run(values)`` writes the run's outputs (the
    values of the plan's output slots) into their bindings and launches the epilogue. ``captured`` is set by
    the runner when the graph that ran holds it."""

    run: Callable[[list], None]
    key: tuple
    captured: bool = False


_PENDING = threading.local()


def hand_over(tail: CapturedTail | None) -> None:
    """Offer ``tail`` to the next device-graph run on this thread (None withdraws an offer not taken)."""
    _PENDING.tail = tail


def take() -> CapturedTail | None:
    """The tail offered to this run, if any; taken once, so no later run sees it."""
    tail = getattr(_PENDING, "tail", None)
    if tail is not None:
        _PENDING.tail = None
    return tail
