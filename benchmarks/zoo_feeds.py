"""The zoo's inputs, made from benchmarks/.models/zoo/manifest.json: the feed descriptions that zoo.py writes
(``zoo_models.Feed.describe``) turned into numpy arrays. Shared by tests/cpu/test_zoo.py and zoo_bench.py, so
that the benchmark times exactly the calls the test checks. Needs numpy only (zoo_models.py needs torch).
"""

from __future__ import annotations

import numpy as np

FILLS = ("ids", "positions", "normal", "ones", "zeros")


class InconsistentFeeds(ValueError):
    """A decoder call whose attention mask, position ids and past lengths do not describe one sequence."""


def make_feed(feed: dict, rng: np.random.Generator) -> np.ndarray:
    """One input from its manifest description."""
    shape, dtype, fill = feed["shape"], np.dtype(feed["dtype"]), feed["fill"]
    if fill == "ids":
        return rng.integers(0, feed["high"], size=shape).astype(dtype)
    if fill == "positions":
        return np.ascontiguousarray(np.broadcast_to(np.arange(feed["start"], feed["start"] + shape[-1]), shape),
                                    dtype=dtype)
    if fill == "normal":
        return rng.standard_normal(shape).astype(dtype)
    if fill not in FILLS:
        raise ValueError(f"feed {feed['name']!r}: unknown fill {fill!r} (known: {', '.join(FILLS)})")
    return (np.ones if fill == "ones" else np.zeros)(shape, dtype)


def batched(call: dict, batch: int) -> dict:
    """``call`` with each input ``batch`` times as long along its first axis (the exports' batch axis)."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, not {batch}")
    feeds = [{**feed, "shape": [feed["shape"][0] * batch, *feed["shape"][1:]]} if feed["shape"] else feed
             for feed in call["feeds"]]
    return {**call, "feeds": feeds}


def make_feeds(call: dict) -> dict[str, np.ndarray]:
    """All inputs of one manifest call, random values seeded the same for every call."""
    rng = np.random.default_rng(0)
    return {feed["name"]: make_feed(feed, rng) for feed in call["feeds"]}


def past_length(call: dict) -> int | None:
    """The self-attention past length of a decoder call (None for a model without past inputs). Cross-attention
    caches (``.encoder.`` in the name) have the encoder's length instead."""
    lengths = {feed["shape"][2] for feed in call["feeds"]
               if feed["name"].startswith("past_key_values.") and ".encoder." not in feed["name"]}
    if len(lengths) > 1:
        raise InconsistentFeeds(f"past inputs of different lengths {sorted(lengths)}")
    return lengths.pop() if lengths else None


def is_decode_step(call: dict) -> bool:
    """Whether a call continues a cached past (a decode step). A prefill has past inputs of length 0: it is timed
    as it is, not as a chunk over a growing past."""
    return bool(past_length(call))


def check_consistent(call: dict) -> None:
    """Raise InconsistentFeeds unless the call's inputs describe one sequence: a causal attention mask covers
    past + new tokens, position ids start after the past, and all self-attention pasts have one length."""
    past = past_length(call)
    if past is None:
        return
    feeds = {feed["name"]: feed for feed in call["feeds"]}
    new = feeds["input_ids"]["shape"][-1] if "input_ids" in feeds else None
    if new is None:
        raise InconsistentFeeds("a call with past inputs but no input_ids")
    mask = feeds.get("attention_mask")
    if mask is not None and mask["shape"][-1] != past + new:
        raise InconsistentFeeds(f"attention_mask covers {mask['shape'][-1]} tokens, past {past} + new {new}")
    positions = feeds.get("position_ids")
    if positions is not None:
        if positions["fill"] != "positions" or positions["start"] != past or positions["shape"][-1] != new:
            raise InconsistentFeeds(f"position_ids {positions} do not continue a past of {past}")


def grown(call: dict, extra: int) -> dict:
    """A decoder call ``extra`` tokens further into its sequence: self-attention pasts, the attention mask and the
    position ids all ``extra`` longer or later (cross-attention caches keep the encoder's length). A call without
    past inputs comes back unchanged."""
    if extra < 0:
        raise ValueError(f"extra must be >= 0, not {extra}")
    if past_length(call) is None or extra == 0:
        return call
    feeds = []
    for feed in call["feeds"]:
        feed = {**feed, "shape": list(feed["shape"])}
        name = feed["name"]
        if name.startswith("past_key_values.") and ".encoder." not in name:
            feed["shape"][2] += extra
        elif name == "attention_mask":
            feed["shape"][-1] += extra
        elif name == "position_ids":
            feed["start"] += extra
        feeds.append(feed)
    return {**call, "feeds": feeds}


# Decode steps per generation: the zoo decoders hold 128 positions, their decode call starts after 16 cached tokens.
GENERATION_STEPS = 96


class GrowingDecode:
    """A decode call as a generation loop makes it: each call one token further than the last, for
    ``GENERATION_STEPS`` calls, then the next generation through the same lengths (as a server answering many
    prompts does), so consecutive timed calls never share input shapes. ``advance()`` makes the next call's
    inputs outside any timing; every runtime timed with its own instance walks the same lengths in the same
    order."""

    def __init__(self, call: dict, run, steps: int = GENERATION_STEPS):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, not {steps}")
        self.call, self.run, self.steps, self.extra = call, run, steps, 0
        self.feed = make_feeds(call)

    def advance(self) -> None:
        self.extra = (self.extra + 1) % self.steps
        self.feed = make_feeds(grown(self.call, self.extra))

    def __call__(self):
        return self.run(self.feed)
