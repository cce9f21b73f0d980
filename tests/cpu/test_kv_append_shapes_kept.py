"""kv_append keeps, per window, which part shapes span its buffer on the other axes (checked once per shape), and a
bound run adopts an appended window's shape without set_logical_shape's checks. Checked: the kept answers never let
a part of another shape through (one that fitted before, then one that does not, and the other way round; a past
window narrower on another axis; a part of another rank), and after generations the cache bindings' logical shapes
are the valid rows, their contents the copying loop's."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime import generate, kv_append
from test_generate import PROMPT, _model

CPU = "CPUExecutionProvider"


def _append(window, fed, new):
    saved = kv_append.enter([window])
    try:
        return kv_append.append("present", (fed, new), 2)
    finally:
        kv_append.leave(saved)


def test_a_kept_answer_lets_through_only_the_shape_it_was_found_for():
    physical = np.zeros((1, 2, 8, 3), np.float32)
    fed = physical[:, :, :2]
    window = kv_append.Window(fed, physical, 2, "present")
    fits, wider, other_rank = (np.ones((1, 2, 1, 3), np.float32), np.ones((1, 1, 1, 3), np.float32),
                               np.ones((2, 1, 3), np.float32))
    grown = _append(window, fed, fits)
    assert grown is not None and grown.shape == (1, 2, 3, 3)
    for refused in (wider, other_rank):  # after a fitting shape was kept, others are still refused
        window.result = None
        before = physical.copy()
        assert _append(window, fed, refused) is None
        np.testing.assert_array_equal(physical, before)
    window.result = None
    assert _append(window, fed, fits) is not None  # and the fitting one still fits
    assert window.spans == {(1, 2, 1, 3): True, (1, 2, 2, 3): True, (1, 1, 1, 3): False, (2, 1, 3): False}


def test_a_past_window_narrower_on_another_axis_is_refused():
    physical = np.zeros((1, 2, 8, 3), np.float32)
    narrow = physical[:, :1, :2]  # one head of two: its rows are not the buffer's
    window = kv_append.Window(narrow, physical, 2, "present")
    before = physical.copy()
    assert _append(window, narrow, np.ones((1, 1, 1, 3), np.float32)) is None
    np.testing.assert_array_equal(physical, before)


@pytest.mark.parametrize("name", ["gpt2.dynamo.fp32", "llama.torchscript.fp32"])
def test_cache_bindings_hold_the_valid_rows_after_each_generation(name, monkeypatch):
    path = _model(name)
    monkeypatch.setattr(generate, "IN_PLACE_BYTES", 1 << 62)  # the copying loop: every output checked and copied
    copying = generate.Generator(path, providers=[CPU])
    monkeypatch.setattr(generate, "IN_PLACE_BYTES", 0)
    in_place = generate.Generator(path, providers=[CPU])
    for new in (6, 3, 6):  # a shorter generation on the kept state, then the longer one again
        expected = copying.generate(PROMPT, new).tokens
        assert in_place.generate(PROMPT, new).tokens == expected
        rows = len(PROMPT) + new - 1  # the last token chosen is never run
        for mine, theirs in zip(in_place._kept.caches, copying._kept.caches):  # noqa: SLF001
            _one, heads, _capacity, dim = mine.physical_shape
            assert mine.logical_shape == theirs.logical_shape == (1, heads, rows, dim)
            np.testing.assert_array_equal(mine.read_logical(), theirs.read_logical())
