"""A decode step's attention mask and position ids as their shapes make them, in an unpadded generation.

A decoder export turns ``attention_mask`` into the additive attention bias and ``position_ids`` into rotary angles
or a position embedding with chains of small steps (:mod:`.mask_values`). Those read the feeds' values, so the
shape-only cache (:class:`.steps.ShapeValues`) cannot skip them, and a first generation, which meets a new length
at every step, runs them at every step. In an unpadded generation every mask entry is 1 and each row of the
positions counts up to the mask's length (``T - S .. T - 1`` for a mask of length ``T`` and ``S`` new tokens): the
feeds are then functions of their shapes. While a call's feeds are so (checked per call on their bytes), the plan
takes a second :class:`.ShapeValues` whose shape-only steps include those chains: their values are kept per feed
shapes and, for new lengths, instantiated by the shape program (a window of a base computed once over a margin
of lengths, :mod:`.shape_program`) instead of run. Any other call (a padded batch, positions that do not count up
to the mask's length) takes the plan's usual values and its mask chain.
"""

from __future__ import annotations

import numpy as np

from ..records import Record
from .mask_values import mask_feeds
from .shape_program import ONES, POSITIONS
from .steps import ShapeValues, Step, shape_only_steps

ENABLED = True  # (off: every call takes the usual values and mask chain; same-process A/B)

_BYTES = 1 << 16  # the ones and counts compared against are grown in steps of this many bytes


class CanonicalFeeds:
    """Runs ``canonical`` (its ``assumed`` feeds all ones, or positions counting up to their mask's length) when a
    call's feeds are so, else ``general``. Attribute reads other than these go to ``general``."""

    __slots__ = ("general", "canonical", "masks", "positions", "_ones", "_counts", "_check")

    canonical: ShapeValues | None  # None once its class had no program (see run)

    def __init__(self, general: ShapeValues, canonical: ShapeValues, masks: tuple[int, ...],
                 positions: tuple[tuple[int, int], ...]):
        self.general = general
        self.canonical = canonical
        self.masks = masks
        self.positions = positions  # (position slot, its mask's slot)
        self._ones: dict[np.dtype, bytes] = {}
        self._counts: dict[np.dtype, bytes] = {}
        self._check = _holds_code(masks, positions, self._ones, self._counts)

    def __getattr__(self, name: str):
        return getattr(self.general, name)

    def run(self, env: list, profile: dict | None) -> None:
        canonical = self.canonical
        if canonical is None or not self._check(env):
            self.general.run(env, profile)
            return
        canonical.run(env, profile)
        programs = canonical.programs
        if programs and programs[-1][1] is None:
            # No program for these feeds' class (a step it could not evaluate, or one that differed from the
            # kernels): every new length would run all the steps, so the usual values and chain serve from now
            # on, their program built from the lengths met so far.
            self.canonical = None
            if self.general.previous is None:
                self.general.previous = canonical.previous

    def holds(self, env: list) -> bool:
        """Whether the call's masks are all ones and its positions count up to their mask's length."""
        return self._check(env)


def _holds_code(masks: tuple[int, ...], positions: tuple[tuple[int, int], ...], ones: dict, counts: dict):
    """CanonicalFeeds.holds for these slots as one function of straight-line code (checked at every call: the
    loops' own costs were about half of it). A mask's bytes are compared as a prefix of the ones kept for the
    longest mask so far (whole ones: a prefix is all ones; one compare, no slice made)."""
    lines = ["def holds(env):"]
    for slot in masks:
        lines += [f"    mask = env[{int(slot)}]",
                  "    if type(mask) is not ndarray:", "        return False",
                  "    data = mask.tobytes()",
                  "    kept = ones.get(mask.dtype)",
                  "    if kept is None or len(kept) < len(data):", "        kept = grown_ones(ones, mask)",
                  "    if not kept.startswith(data):", "        return False"]
    for slot, mask_slot in positions:
        lines += [f"    positions = env[{int(slot)}]",
                  "    if type(positions) is not ndarray or positions.dtype.kind not in 'iu' or positions.ndim == 0:",
                  "        return False",
                  f"    end = env[{int(mask_slot)}].shape[-1]",
                  "    if positions.size == 1:  # (a decode step of one sequence)",
                  "        if positions.item() != end - 1:", "            return False",
                  "    elif not counting(counts, positions, end):", "        return False"]
    lines.append("    return True")
    scope: dict = {"ndarray": np.ndarray, "ones": ones, "counts": counts, "grown_ones": _grown_ones,
                   "counting": _counting}
    exec(compile("\n".join(lines) + "\n", "<canonical_feeds.holds>", "exec"), scope)  # noqa: S102 (ints and names)
    return scope.pop("holds")  # (out of its own globals: no reference cycle)


def _grown_ones(ones: dict, mask: np.ndarray) -> bytes:
    size = mask.nbytes
    kept = ones[mask.dtype] = np.ones(-(-max(size, 1) // _BYTES) * _BYTES // mask.itemsize, mask.dtype).tobytes()
    return kept


def _counting(counts: dict, positions: np.ndarray, end: int) -> bool:
    count = positions.shape[-1]
    if count > end or count == 0:
        return False
    width = positions.itemsize
    kept = counts.get(positions.dtype)
    if kept is None or len(kept) < end * width:
        kept = counts[positions.dtype] = np.arange(-(-end * width // _BYTES) * _BYTES // width,
                                                   dtype=positions.dtype).tobytes()
    return positions.tobytes() == kept[(end - count) * width:end * width] * (positions.size // count)


def assumed_feeds(graph, feed_slots: dict[str, int]) -> dict[int, tuple]:
    """The integer mask feeds (all ones) and position feeds (counting up to ``attention_mask``'s length, where the
    graph has one) of ``graph``, by slot: ``shape_program.build``'s ``assumed``."""
    names = mask_feeds(graph)
    ranks = {info.name: len(info.type.shape) if info.type.shape is not None else None for info in graph.inputs}
    assumed: dict[int, tuple] = {}
    masks = {name for name in names if name.lower().endswith("mask")}
    for name in masks:
        assumed[feed_slots[name]] = (ONES, None)
    anchor = "attention_mask" if "attention_mask" in masks and ranks.get("attention_mask") == 2 else None
    for name in names - masks:
        if anchor is not None and ranks.get(name) == 2:
            assumed[feed_slots[name]] = (POSITIONS, feed_slots[anchor])
    return assumed


class Planned(Record):
    """A plan's canonical steps, found before its releases are assigned (the full steps keep ``kept`` to their
    end, as they keep the usual values)."""

    __match_args__ = ("assumed", "body", "kept")
    assumed: dict[int, tuple]
    body: list[Step]
    kept: tuple[int, ...]

    def __init__(self, assumed: dict[int, tuple], body: list[Step], kept: tuple[int, ...]) -> None:
        self.assumed = assumed
        self.body = body
        self.kept = kept

    def values(self, general: ShapeValues, declared: dict) -> CanonicalFeeds:
        """``general`` (the plan's usual values; its full steps are shared) with the canonical ShapeValues."""
        canonical = ShapeValues(general.full, self.body, general.keys, self.kept, declared)
        canonical.assumed = self.assumed
        masks = tuple(slot for slot, (kind, _) in self.assumed.items() if kind == ONES)
        positions = tuple((slot, mask) for slot, (kind, mask) in self.assumed.items() if kind == POSITIONS)
        return CanonicalFeeds(general, canonical, masks, positions)


def plan(graph, steps: list[Step], feed_slots: dict[str, int], tensor_feeds: set[int], constants: set[int],
         outputs: set[int], found: set[int]) -> Planned | None:
    """The canonical steps of a plan whose shape-only steps are ``found``: None where no feed's shape is symbolic
    (an exact plan meets one shape), the graph has no mask or position feed, or assuming them adds no step."""
    if all(vi.type.shape is not None and all(isinstance(d, int) for d in vi.type.shape)
           for vi in graph.inputs if vi.type.is_tensor):
        return None
    assumed = assumed_feeds(graph, feed_slots)
    if not assumed:
        return None
    more = shape_only_steps(steps, tensor_feeds, constants, outputs, frozenset(assumed))
    if len(more) <= len(found):
        return None
    body = [step.replace() for index, step in enumerate(steps) if index not in more]
    read = {slot for step in body for slot in step.inputs}
    kept = tuple(slot for index in sorted(more) for slot in steps[index].outputs if slot in read)
    return Planned(assumed, body, kept)
