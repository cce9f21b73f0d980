"""The split kernels' back-off (algorithms/helper_backoff.py): misses are a debt in pieces that kept pieces pay back;
calls run alone once the debt passes what is tolerated, twice as many at each back-off up to the most, the least
again after enough kept pieces; the splits just after a wake are forgiven."""

from __future__ import annotations

from onnx_runtime_ep_cpu.algorithms import helper_backoff
from onnx_runtime_ep_cpu.algorithms.helper_backoff import HelperBackoff


def _alone_calls(backoff: HelperBackoff) -> int:
    count = 0
    while backoff.runs_alone():
        count += 1
    return count


def test_by_default_each_miss_backs_off_and_a_kept_split_restores_the_least(monkeypatch):
    monkeypatch.setattr(helper_backoff, "IDLE_HELPER_CALLS", 2)
    monkeypatch.setattr(helper_backoff, "IDLE_HELPER_MOST", 8)
    backoff = HelperBackoff()
    assert _alone_calls(backoff) == 0
    lengths = []
    for _ in range(5):
        backoff.missed()
        lengths.append(_alone_calls(backoff))
    assert lengths == [2, 4, 8, 8, 8]
    backoff.took_part()
    backoff.missed()
    assert _alone_calls(backoff) == 2


def test_misses_are_tolerated_while_kept_rows_pay_them_back(monkeypatch):
    monkeypatch.setattr(helper_backoff, "IDLE_HELPER_CALLS", 2)
    monkeypatch.setattr(helper_backoff, "IDLE_HELPER_MOST", 8)
    backoff = HelperBackoff(100, 300, 1000)
    for _ in range(3):
        backoff.missed()
    assert _alone_calls(backoff) == 0, "three misses: a debt of 300 rows, tolerated"
    backoff.took_part(250)
    backoff.missed()
    backoff.missed()
    assert _alone_calls(backoff) == 0, "paid back to 50, then 250"
    backoff.missed()
    assert _alone_calls(backoff) == 2, "350: past what is tolerated"
    for _ in range(4):
        backoff.missed()
    assert _alone_calls(backoff) == 4, "the next back-off after too few kept rows is twice as long"
    backoff.took_part(1000)
    for _ in range(4):
        backoff.missed()
    assert _alone_calls(backoff) == 2, "the least again after RECOVERY rows kept"


def test_the_splits_after_a_wake_are_forgiven(monkeypatch):
    monkeypatch.setattr(helper_backoff, "IDLE_HELPER_GRACE", 2)
    backoff = HelperBackoff()
    backoff.woken()
    backoff.missed()
    backoff.missed()
    assert _alone_calls(backoff) == 0
    backoff.missed()
    assert _alone_calls(backoff) > 0
