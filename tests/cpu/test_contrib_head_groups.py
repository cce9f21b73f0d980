"""ContribPackedAttention's one-call route on more threads (algorithms/product_attention.py's split,
compiled/attention_groups.py): one job per group of heads, each computing its heads' own Q, K and V columns and
their attention into its heads' columns of the output. Checked against a float64 reference (within float32's
bound) and onnxruntime over head counts the threads do not divide, row counts off the tiles, key counts, no bias,
more groups than helpers, no helper and helpers held by another caller, over kept repeats."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx_runtime_ep_cpu import tuning
from onnx_runtime_ep_cpu.algorithms import helper_backoff, product_attention
from onnx_runtime_ep_cpu.algorithms.products import gemv_host
from onnx_runtime_ep_cpu.ops import contrib_transformer
from test_contrib_product_lanes import _model, _reference

RNG = np.random.default_rng(91)


@pytest.fixture
def splits(monkeypatch):
    """The split route's calls and the groups each ran with, counted; compiled from the first call; every call
    split (no back-off after a split its helper did not take part in)."""
    if not gemv_host():
        pytest.skip("the 16-lane loop runs on AVX-512 hosts only")
    from onnx_runtime_ep_cpu.compiled import attention_groups

    monkeypatch.setattr(contrib_transformer, "numpy_first", lambda: False)
    monkeypatch.setattr(helper_backoff, "IDLE_HELPER_CALLS", 0)
    calls: list[int] = []
    split = attention_groups.split_groups
    monkeypatch.setattr(attention_groups, "split_groups",
                        lambda *a: calls.append(a[1].size - 1) or split(*a))
    return calls


@pytest.mark.parametrize(("batch", "steps", "hidden", "heads", "bias", "masked", "threads"), [
    (1, 50, 64, 4, True, False, 2),  # Whisper's encoder: two groups of two heads
    (2, 16, 64, 4, True, True, 2),  # BERT's, with key counts (few_rows.py's tiles per group)
    (1, 33, 60, 3, False, True, 2),  # three heads of 20 over two threads: groups of one and two
    (2, 13, 40, 5, True, True, 2),  # five heads of 8, 26 rows: a padded row tile, partial panels
    (1, 21, 48, 3, True, False, 3),  # three groups, more than the helpers: the caller runs the rest
    (3, 9, 32, 2, False, False, 4),  # more threads than heads: one group per head
])
def test_head_groups_match_reference_and_onnxruntime(batch, steps, hidden, heads, bias, masked, threads, splits):
    import onnxruntime

    proto, weight, add = _model(hidden, heads, bias, masked)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    with tuning.override(attention_group_macs=1, threads=threads):
        for call in range(4):  # the first tried, the second kept, the rest repeats of the kept call
            x = RNG.standard_normal((batch, steps, hidden)).astype(np.float32)
            counts = RNG.integers(1, steps + 1, batch).astype(np.int32) if masked else None
            feeds = {"x": x} if counts is None else {"x": x, "mask": counts}
            got = session.run(None, feeds)[0]
            expected, bound = _reference(x, weight, add, heads, counts)
            assert np.abs(got - expected).max() <= bound, (call, np.abs(got - expected).max(), bound)
            np.testing.assert_allclose(got, oracle.run(None, feeds)[0], rtol=3e-5, atol=3e-5)
    assert len(splits) >= 3 and set(splits) == {min(threads, heads)}


@pytest.mark.parametrize("helpers", ["none", "held"])
def test_every_group_runs_on_the_caller_without_a_free_helper(helpers, splits, monkeypatch):
    """No helper thread (a platform without them) or helpers held by another caller: every group on the calling
    thread, the same results."""
    from onnx_runtime_ep_cpu.compiled import workers

    proto, weight, add = _model(64, 4, True, False)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    if helpers == "none":
        monkeypatch.setattr(product_attention, "helper_count", lambda: 0)
    with tuning.override(attention_group_macs=1, threads=2):
        session.run(None, {"x": RNG.standard_normal((1, 50, 64)).astype(np.float32)})  # (helpers started)
        pool = workers.helpers(1)
        if helpers == "held":
            pool._busy.acquire()  # noqa: SLF001  (another caller holds them)
        try:
            for _ in range(3):
                x = RNG.standard_normal((1, 50, 64)).astype(np.float32)
                expected, bound = _reference(x, weight, add, 4, None)
                assert np.abs(session.run(None, {"x": x})[0] - expected).max() <= bound
        finally:
            if helpers == "held":
                pool._busy.release()  # noqa: SLF001
    assert len(splits) >= 3


def test_a_row_without_a_finite_score_is_left_to_the_general_path(splits):
    """A mask row of -inf: a group's loop declines (status 0) and the split answers None, as the one-thread call."""
    heads, hidden, steps = 4, 64, 20
    weight = (RNG.standard_normal((hidden, 3 * hidden)) * 0.3).astype(np.float32)
    weight.flags.writeable = False
    x = RNG.standard_normal((1, steps, hidden)).astype(np.float32)
    mask = np.zeros((1, 1, steps, steps), np.float32)
    mask[0, 0, 5] = -np.inf
    attention = product_attention.ProductAttention(heads, np.float32(-10000))
    counts = np.empty(0, np.int32)
    with tuning.override(attention_group_macs=1, threads=2):
        assert attention(x, weight, None, counts, mask, np.float32(0.25)) is None
        mask[0, 0, 5] = 0
        y = attention(x, weight, None, counts, mask, np.float32(0.25))
    expected, bound = _reference(x, weight, None, heads, None)
    assert y is not None and np.abs(y - expected).max() <= bound
    assert len(splits) == 2


def test_small_nodes_and_one_thread_keep_the_single_call(splits):
    """Below attention_group_macs, or on one thread, the node stays one call on the calling thread."""
    proto, weight, add = _model(64, 4, True, True)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    feeds = {"x": RNG.standard_normal((1, 16, 64)).astype(np.float32), "mask": np.array([16], np.int32)}
    with tuning.override(threads=2):  # BERT's 16 rows: under the knob
        session.run(None, feeds)
    with tuning.override(attention_group_macs=1, threads=1):
        session.run(None, feeds)
    assert not splits


def test_a_split_its_awake_helper_took_no_part_in_backs_off(monkeypatch):
    """A split whose groups offered to awake helpers all ran on the calling thread (the helper descheduled) has the
    next calls run on the calling thread (kept calls too), IDLE_HELPER_CALLS of them, twice as many after each such
    split up to IDLE_HELPER_MOST, back to the least after a split a helper took part in; the IDLE_HELPER_GRACE splits
    after one that woke a sleeping helper may miss it. Results within the float64 bound throughout."""
    if not gemv_host():
        pytest.skip("the 16-lane loop runs on AVX-512 hosts only")
    from onnx_runtime_ep_cpu.compiled import attention_groups

    monkeypatch.setattr(contrib_transformer, "numpy_first", lambda: False)
    monkeypatch.setattr(helper_backoff, "IDLE_HELPER_CALLS", 2)
    monkeypatch.setattr(helper_backoff, "IDLE_HELPER_MOST", 4)
    monkeypatch.setattr(helper_backoff, "IDLE_HELPER_GRACE", 2)
    # per split, the verdict split_groups reports: 1 taken back, 0 a helper took part, 2 a helper woken
    verdicts = [1, 1, 1, 0, 2, 1, 1, 1, 1]
    splits: list[int] = []
    split = attention_groups.split_groups

    def reported(*a):
        result = split(*a)
        a[14][2, 0] = verdicts[len(splits)]  # (status: as split_groups reports such a split)
        splits.append(calls[0])
        return result

    monkeypatch.setattr(attention_groups, "split_groups", reported)
    proto, weight, add = _model(64, 4, True, False)
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    calls = [0]
    with tuning.override(attention_group_macs=1, threads=2):
        while len(splits) < len(verdicts):
            x = RNG.standard_normal((1, 50, 64)).astype(np.float32)
            expected, bound = _reference(x, weight, add, 4, None)
            assert np.abs(session.run(None, {"x": x})[0] - expected).max() <= bound
            calls[0] += 1
    # taken back: 2 calls alone; again: 4; again: 4 (the most); a helper took part: the next splits at once; a woken
    # helper: two misses in grace, the third backs off 2 calls
    assert splits == [0, 3, 8, 13, 14, 15, 16, 17, 20]
