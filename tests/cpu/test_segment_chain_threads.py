"""One image's chained plan shared with the helper threads (compiled/conv_chain.run_chain_split): at two threads a
segment of batch 1 runs its large direct convolutions' tile rows as tasks of the calling thread and a helper, the
other rows here. The outputs are the same bits as run_chain over the same table (each tile row's sums are the same
code in the same order, whichever thread runs them), within float32 rounding of float64 and onnxruntime, from several
Python threads at once (a caller that finds the helpers held runs every row itself), and only rows of one image
above the split size are shared."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from onnx_runtime_ep_cpu.algorithms import segment_chain
from onnx_runtime_ep_cpu.compiled import conv_chain, host, workers
from onnx_runtime_ep_cpu.tuning import override
from reference64 import run_float64
from test_cnn_blocked_layout import _chain_model
from test_segment_fusion import _segment_and_feeds, segment_matches_references
from test_segment_split import _fed, _planned, two_thread_session

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the chained loops (direct tiles) need AVX2")


def _threaded_call(plan):
    (call,) = [call for call in plan.calls if getattr(call[0], "__name__", "") == "run_chain_threads"]
    return call


def _split_segment(monkeypatch, size: int = 13):
    """The chain model's segment planned at two threads for one image, every direct convolution row split."""
    monkeypatch.setattr(segment_chain, "SPLIT_ROW_MACS", 0)
    model = _chain_model(size)
    x = np.random.default_rng(21).standard_normal((1, 3, size, size)).astype(np.float32)
    segment, feeds = _segment_and_feeds(model, x)
    return model, segment, feeds, _planned(segment, feeds)


def test_one_image_shares_its_convolution_rows_within_rounding_of_float64(monkeypatch):
    with override(threads=2):
        model, segment, feeds, plan = _split_segment(monkeypatch)
        _, (table, _, splits, bounds, _, _) = _threaded_call(plan)
        kinds = segment_chain._KINDS  # noqa: SLF001
        blocked, gathered = table[:, 0] == kinds["conv_blocked"][0], table[:, 0] == kinds["conv_gathered"][0]
        conv_rows = blocked | gathered
        assert blocked.sum() >= 3 and gathered.any(), "direct convolutions in blocked and in gathered tiles"
        assert (splits[conv_rows, 1] >= 2).all() and (splits[~conv_rows, 1] == 0).all()
        assert (table[blocked, 28] == 0).any() and (table[blocked, 28] != 0).any(), \
            "rows that copy their image into a padded source and rows that read it in place"
        segment_matches_references(model, segment, feeds, (1, 3, 13, 13), np.random.default_rng(22), runs=3)


def _run_plan(plan, inputs, chain) -> list:
    """``plan``'s outputs for ``inputs`` with its run_chain_threads call replaced by ``chain(table, reals, splits,
    bounds)``."""
    plan.stage(inputs)
    for function, arguments in plan._calls:  # noqa: SLF001
        if getattr(function, "__name__", "") == "run_chain_threads":
            chain(*arguments[:4])
        else:
            function(*arguments)
    return [r.copy() for r in plan._results]  # noqa: SLF001


def _in_two_shares(table, reals, splits, bounds):
    """Each split row as two parts would run it, one after the other on this thread: part 1's share of tasks (part
    0's marked claimed), then part 0's (part 1's marked claimed), each counted in its ``ran``; the other rows whole."""
    for r, row in enumerate(table):
        first, count = splits[r]
        if count < 2:
            conv_chain._run_row(row, reals)  # noqa: SLF001
            continue
        conv_chain._fill_row(row)  # noqa: SLF001
        task_bounds = bounds[first:first + count + 1].copy()
        ranges = np.array([0, count // 2, count], dtype=np.int64)
        for part, claims in ((1, [count // 2, 0]), (0, [0, count - count // 2])):
            ran = np.zeros(2, dtype=np.int64)
            conv_chain.ROW.here((table, reals, task_bounds, ranges, np.array(claims, dtype=np.int64), ran, r, part))
            assert ran[part] == ranges[part + 1] - ranges[part] and ran[1 - part] == 0, "the tasks each part ran"


def test_the_shared_rows_give_run_chains_bits(monkeypatch):
    """The session's runs (with the helper or not, as it comes) and each split row run in its two shares give the
    bits run_chain gives over the same table: the shares cover every tile row once, each as one thread does it."""
    with override(threads=2):
        _, segment, feeds, plan = _split_segment(monkeypatch)
        rng = np.random.default_rng(23)
        for _ in range(3):
            x = rng.standard_normal((1, 3, 13, 13)).astype(np.float32)
            inputs = _fed(feeds, x)
            alone = _run_plan(plan, inputs, lambda table, reals, *_: conv_chain.run_chain(table, reals))
            for got in ([a.copy() for a in segment(*inputs)], _run_plan(plan, inputs, _in_two_shares)):
                for a, b in zip(got, alone):
                    assert np.array_equal(a, b)


def test_shared_elementwise_rows_give_run_chains_bits(knobs):
    """A chain's elementwise rows (SiLU, Sigmoid, HardSigmoid, a residual sum) from split_elements values up are
    shared too, as tasks of values starting on cache lines: run in two shares, and by the session, the bits run_chain
    gives."""
    from test_segment_thread_steps import _activations

    knobs(split_elements=1)
    with override(threads=2):
        x = np.random.default_rng(28).standard_normal((1, 24, 20, 20)).astype(np.float32)
        segment, feeds = _segment_and_feeds(_activations(False), x)
        plan = _planned(segment, feeds)
        _, (table, _, splits, bounds, _, _) = _threaded_call(plan)
        shared = [r for r in range(len(table)) if table[r, 0] in segment_chain._ELEMENTWISE_KINDS]  # noqa: SLF001
        assert len(shared) >= 3 and all(splits[r, 1] >= 2 for r in shared)
        for r in shared:
            first, count = splits[r]
            edges = bounds[first:first + count + 1]
            assert edges[0] == 0 and edges[-1] == table[r, 2] and (np.diff(edges) >= 0).all()
            assert (edges[:-1] % 16 == 0).all()
        inputs = _fed(feeds, x)
        alone = _run_plan(plan, inputs, lambda table, reals, *_: conv_chain.run_chain(table, reals))
        for got in ([a.copy() for a in segment(*inputs)], _run_plan(plan, inputs, _in_two_shares)):
            for a, b in zip(got, alone):
                assert np.array_equal(a, b)


def test_a_caller_finding_the_helpers_held_runs_every_row_itself(monkeypatch):
    with override(threads=2):
        model, segment, feeds, plan = _split_segment(monkeypatch)
        pool = workers.helpers(1)
        pool._busy.acquire()  # noqa: SLF001  (another caller holds them)
        try:
            segment_matches_references(model, segment, feeds, (1, 3, 13, 13), np.random.default_rng(24))
        finally:
            pool._busy.release()  # noqa: SLF001


def test_sessions_sharing_rows_from_several_python_threads(monkeypatch):
    monkeypatch.setattr(segment_chain, "SPLIT_ROW_MACS", 0)
    model = _chain_model(13)
    sess = two_thread_session(model)
    rng = np.random.default_rng(25)
    inputs = [rng.standard_normal((1, 3, 13, 13)).astype(np.float32) for _ in range(4)]
    exact = [run_float64(model, {"x": x}) for x in inputs]
    failures: list = []

    def work(index):
        try:
            for _ in range(20):
                got = sess.run(None, {"x": inputs[index]})
                for g, e in zip(got, exact[index]):
                    assert np.abs(g - e).max() <= 2e-5 * (1 + np.abs(e).max())
        except BaseException as exc:  # noqa: BLE001  (reported below, with the thread's index)
            failures.append((index, exc))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures


def test_only_large_rows_of_one_image_split():
    """_splits' choice from the rows themselves: a conv_blocked row of one image at or above SPLIT_ROW_MACS gets
    tasks evenly covering its tiles' rows; a smaller one, one of two images or another loop's row gets none, and so
    does an elementwise row under split_elements values."""
    kind = segment_chain._KINDS["conv_blocked"][0]  # noqa: SLF001
    width = segment_chain._WIDTH  # noqa: SLF001

    def row(images, tiles, depth, oh, ow, number=kind):
        r = np.zeros(width, dtype=np.int64)
        r[0], r[29], r[35], r[36] = number, images, oh, ow
        r[4:8] = (1, tiles, depth, 16)
        return r

    big = segment_chain.SPLIT_ROW_MACS // (16 * 32 * 32) + 1
    swish = np.zeros(width, dtype=np.int64)
    swish[0], swish[2] = segment_chain._KINDS["swish_float32_into"][0], 1000  # noqa: SLF001  (x's length)
    table = np.array([row(1, 2, big, 32, 32), row(1, 1, 1, 32, 32), row(2, 2, big, 32, 32),
                      row(1, 2, big, 32, 32, number=kind + 3), row(1, 1, big, 1, 1), swish])
    splits, bounds = segment_chain._splits(table, 2)  # noqa: SLF001
    assert splits[1:, 1].tolist() == [0, 0, 0, 0, 0]
    first, count = splits[0]
    assert count == 2 * segment_chain.TASKS_PER_THREAD
    edges = bounds[first:first + count + 1]
    assert edges[0] == 0 and edges[-1] == 2 * 32 and (np.diff(edges) > 0).all()
    assert segment_chain._splits(table[1:], 2)[1] is None  # noqa: SLF001


@pytest.mark.skipif(not host.HELPER_THREADS, reason="no helper threads on this platform")
def test_a_sleeping_helper_is_woken_and_the_chain_runs_here_meanwhile(monkeypatch):
    """A call that finds the helper asleep (idle past its spin) runs the chain on its own thread, within the float64
    bound, and wakes the helper for the calls after it (not backing off: see the next test)."""
    from onnx_runtime_ep_cpu.algorithms.helper_backoff import HelperBackoff

    backoff = HelperBackoff()
    monkeypatch.setattr(segment_chain, "_BACKOFF", backoff)
    with override(threads=2):
        model, segment, feeds, plan = _split_segment(monkeypatch)
        mailbox = workers.helpers(1).mailboxes[0]
        deadline = time.monotonic() + 5
        while not mailbox[workers.SLEEPING] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mailbox[workers.SLEEPING], "an idle helper sleeps after its spin"
        backoff.alone = 0  # (the planning's calls may have missed the helper they woke)
        x = np.random.default_rng(26).standard_normal((1, 3, 13, 13)).astype(np.float32)
        got = segment(*_fed(feeds, x))
        assert not mailbox[workers.SLEEPING]
    names = [o.name for o in model.graph.output]
    for name, exact in zip(names, run_float64(model, {"x": x})):
        value = dict(zip(segment.output_names, got))[name]
        assert np.abs(value - exact).max() <= 2e-5 * (1 + np.abs(exact).max())


def test_helpers_that_fell_behind_are_told_from_the_tasks_they_ran_and_the_callers_wait():
    """conv_chain.lagged: the helpers fell behind where they ran under half their share of a row's tasks, or the
    caller waited for them longer than its own part ran and than the stall cycles; not otherwise."""
    lagged = conv_chain.lagged
    assert not lagged(8, 4, 2, 1000, 100, 500)  # an even split, a short wait
    assert not lagged(8, 6, 2, 1000, 100, 500)  # the helper ran half its share
    assert lagged(8, 7, 2, 1000, 100, 500)  # one task of its four
    assert lagged(8, 8, 2, 1000, 0, 500)  # none
    assert lagged(8, 4, 2, 1000, 1001, 500)  # waited longer than its own part ran
    assert not lagged(8, 4, 2, 300, 400, 500)  # longer than its own part, within the stall cycles
    assert lagged(8, 4, 2, 300, 501, 500)
    assert not lagged(9, 6, 3, 1000, 0, 500) and lagged(9, 7, 3, 1000, 0, 500)  # two helpers: six tasks theirs


def test_a_split_whose_helper_took_no_part_backs_off(monkeypatch):
    """An awake helper that does not run (its mailbox served by no thread: each part it was offered is taken back
    and run here) makes the split chain run alone for IDLE_HELPER_CALLS calls, twice as many after each such split
    up to IDLE_HELPER_MOST; every call within the float64 bound."""
    from onnx_runtime_ep_cpu.algorithms import helper_backoff

    unserved = np.zeros((1, workers.MAILBOX_SIZE), dtype=np.int64)  # awake: SLEEPING, DONE and POSTED all 0

    class Pool:
        mailboxes, states, cycles_per_second = unserved, np.zeros(1, dtype=np.int64), 1e9

    splits: list[int] = []
    calls = [0]

    def call(function, arguments, runner, scratch, count):
        splits.append(calls[0])
        function(*arguments, Pool.mailboxes, Pool.states, runner)
        assert arguments[7][1] == 1, "status: the helper took no part"
        unserved[0, workers.DONE] = unserved[0, workers.POSTED]  # (as the helper marks a job it finds taken back)

    monkeypatch.setattr(workers, "helpers", lambda count: Pool)
    monkeypatch.setattr(workers, "call", call)
    monkeypatch.setattr(helper_backoff, "IDLE_HELPER_CALLS", 2)
    monkeypatch.setattr(helper_backoff, "IDLE_HELPER_MOST", 4)
    backoff = helper_backoff.HelperBackoff()
    monkeypatch.setattr(segment_chain, "_BACKOFF", backoff)
    with override(threads=2):
        model, segment, feeds, plan = _split_segment(monkeypatch)
        _threaded_call(plan)
        backoff.alone, backoff.backoff, backoff.grace = 0, 2, 0
        splits.clear()
        x = np.random.default_rng(27).standard_normal((1, 3, 13, 13)).astype(np.float32)
        names = [o.name for o in model.graph.output]
        exact = dict(zip(names, run_float64(model, {"x": x})))
        for calls[0] in range(14):
            got = dict(zip(segment.output_names, segment(*_fed(feeds, x))))
            for name, value in exact.items():
                assert np.abs(got[name] - value).max() <= 2e-5 * (1 + np.abs(value).max())
    # missed: 2 calls alone; again: 4; again: 4 (the most)
    assert splits == [0, 3, 8, 13]


def test_a_convolution_that_would_split_alone_stays_in_the_chain(monkeypatch, knobs):
    """A direct convolution binds as claimed tasks where it splits on its own (conv_direct.DirectConv's group tasks,
    or row tasks where it reads its input in place); inside a blocked segment the chain takes it whole and shares
    its rows itself, so the chain is not broken into pieces around it (every split taken here, whatever this
    host's thresholds)."""
    knobs(split_macs=1, threads=2)
    model, segment, feeds, plan = _split_segment(monkeypatch)
    names = [getattr(function, "__name__", "") for function, _ in plan.calls]
    assert "_claimed_rows" not in names and "run_chain_threads" in names, names
    tables = [arguments[0] for function, arguments in plan.calls if function.__name__ == "run_chain_threads"]
    blocked = segment_chain._KINDS["conv_blocked"][0]  # noqa: SLF001
    assert len(tables) == 1 and (tables[0][:, 0] == blocked).sum() >= 3, [len(table) for table in tables]
    segment_matches_references(model, segment, feeds, (1, 3, 13, 13), np.random.default_rng(23), runs=3)
