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
