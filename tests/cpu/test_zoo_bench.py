"""benchmarks/zoo_bench.py: its feeds describe one sequence per decoder call, and a --quick run over one small
zoo model reports every number the issue's targets need, finite and positive. Skipped when the zoo is not built.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from model_helpers import zoo_manifest

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = zoo_manifest()
ZOO = MANIFEST.parent
pytest.importorskip("onnxruntime", reason="the benchmark compares with onnxruntime: install the test extra")

sys.path.insert(0, str(ROOT / "benchmarks"))
from zoo_feeds import (  # noqa: E402
    GrowingDecode,
    InconsistentFeeds,
    batched,
    check_consistent,
    grown,
    is_decode_step,
    make_feeds,
    past_length,
)

MODELS = [m for m in json.loads(MANIFEST.read_text())["models"] if m["status"] == "ok"]
DECODERS = [m for m in MODELS if "decode" in m["calls"]]
SMALL = "bert.torchscript.fp32"  # few nodes, one call: the quickest model to create and run


def test_manifest_calls_are_consistent():
    for model in MODELS:
        for call in model["calls"].values():
            check_consistent(call)


@pytest.mark.skipif(not DECODERS, reason="no decoder with past in the zoo")
def test_a_batched_call_repeats_every_input_along_its_first_axis():
    for model in MODELS:
        for call in model["calls"].values():
            single, four = make_feeds(call), make_feeds(batched(call, 4))
            for name, value in single.items():
                assert four[name].shape == (4 * value.shape[0], *value.shape[1:]) and four[name].dtype == value.dtype
            if past_length(call) is not None:
                check_consistent(batched(call, 4))  # (one sequence per row: lengths unchanged)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        batched(MODELS[0]["calls"][next(iter(MODELS[0]["calls"]))], 0)


def test_inconsistent_decoder_feeds_are_refused():
    call = DECODERS[0]["calls"]["decode"]
    feeds = make_feeds(call)
    past = next(v for k, v in feeds.items() if k.startswith("past_key_values.") and ".encoder." not in k).shape[2]
    if "attention_mask" in feeds:
        assert feeds["attention_mask"].shape[-1] == past + feeds["input_ids"].shape[-1]
    if "position_ids" in feeds:
        assert feeds["position_ids"][0, 0] == past
    for field, change in (("attention_mask", lambda f: f["shape"].__setitem__(-1, f["shape"][-1] - 1)),
                          ("position_ids", lambda f: f.__setitem__("start", 0)),
                          ("past_key_values.0", lambda f: f["shape"].__setitem__(2, f["shape"][2] + 1))):
        broken = copy.deepcopy(call)
        targets = [f for f in broken["feeds"] if f["name"].startswith(field)]
        if not targets:
            continue
        change(targets[0])
        with pytest.raises(InconsistentFeeds):
            check_consistent(broken)


@pytest.mark.skipif(not DECODERS, reason="no decoder with past in the zoo")
def test_only_decode_steps_grow_and_prefills_are_timed_as_they_are():
    """A prefill's past is empty: timing it as a chunk over a growing past measured another workload."""
    for model in DECODERS:
        assert is_decode_step(model["calls"]["decode"])
        prefills = [call for name, call in model["calls"].items() if name != "decode" and past_length(call) == 0]
        assert prefills and all(not is_decode_step(call) for call in prefills)
    assert not is_decode_step({"feeds": [{"name": "input_ids", "shape": [1, 16]}]})


@pytest.mark.skipif(not DECODERS, reason="no decoder with past in the zoo")
def test_growing_decode_walks_one_consistent_sequence():
    """The timed decode calls grow by one token each and every one still describes one sequence, so both runtimes
    are timed on a generation loop's shapes, never on one repeated signature."""
    for model in DECODERS:
        call = model["calls"]["decode"]
        seen = []
        decode = GrowingDecode(call, lambda feed: feed)
        for step in range(3):
            if step:
                decode.advance()
            check_consistent(grown(call, decode.extra))
            feed = decode()
            seen.append(next(v.shape for k, v in feed.items()
                             if k.startswith("past_key_values.") and ".encoder." not in k)[2])
        assert seen == [past_length(call) + k for k in range(3)]
        wrapping = GrowingDecode(call, lambda feed: feed, steps=2)
        wrapping.advance()
        wrapping.advance()  # the next generation starts again at the manifest's length
        assert wrapping.extra == 0
    with pytest.raises(ValueError, match="extra"):
        grown(DECODERS[0]["calls"]["decode"], -1)


def test_round_medians_spread_and_slowest_round():
    """Run to run: each block's median (a round) as well as every call; one slow call among a round's moves
    the per-call maximum, not the round's median."""
    import zoo_bench

    samples = [1.0] * 9 + [30.0] + [1.2] * 10 + [0.8] * 10  # three rounds of 10, one descheduled call
    s = zoo_bench.stats(samples, quiet_median=1.0, block=10)
    assert s["rounds"] == 3 and s["max_over_quiet"] == 30.0
    assert s["round_max_over_quiet"] == pytest.approx(1.2)
    assert s["round_spread"] == pytest.approx((1.2 - 0.8) / 1.0)
    assert "rounds" not in zoo_bench.stats(samples)


def test_block_positions_and_the_spread_of_the_settled_calls():
    """The first calls of each block (refilling what other processes emptied during the pause before it) are
    told apart: each position's median, and the spread of the calls from SETTLED_FROM on, which leaves them out;
    the per-call spread (the target) still counts every call. The settled spread stands beside the busy targets,
    for both runtimes, not as a target."""
    import zoo_bench

    first = [2.0, 1.5, 1.3]
    samples = (first + [1.0] * 7) * 3
    s = zoo_bench.stats(samples, quiet_median=1.0, block=10)
    assert s["positions"] == first + [1.0] * 7
    assert s["spread"] == pytest.approx(0.5) and s["settled_spread"] == 0.0
    assert zoo_bench.SETTLED_FROM == len(first)
    assert "settled_spread" not in zoo_bench.stats(samples)
    short = zoo_bench.stats([3.0, 1.0, 1.0], block=10)  # fewer calls than a block: positions as far as they go
    assert short["positions"] == [3.0, 1.0, 1.0] and math.isnan(short["settled_spread"])

    busy = {"median": 1.0, "spread": 0.5, "round_spread": 0.0, "max_over_quiet": 2.0, "round_max_over_quiet": 1.0,
            "cpu": {"spread": 0.4}, "settled_spread": 0.1}
    quiet = {"median": 1.0, "cpu": {"median": 1.0}}
    cold = {"create_first_s": 1.0, "create_first_cpu_s": 1.0, "rss_peak": 1}
    calls = {"a": {"quiet/1/ours": quiet, "quiet/1/ort": quiet, "busy/1/ours": busy,
                   "busy/1/ort": {**busy, "settled_spread": 0.3}}}
    verdict = zoo_bench.verdicts([{"name": "m", "steady": {"calls": calls}, "cold": {"ours": cold, "ort": cold}}],
                                 ["1"], busy=True)
    settled = verdict["same_run"]["busy spread per call from each block's call 4, one thread (not a target)"]
    assert (settled["ours_held"], settled["ort_held"], settled["ours_worst"], settled["ort_worst"]) == (1, 0, 0.1, 0.3)
    assert not any("block's call" in row["target"] for row in verdict["rows"])


def test_busy_targets_count_onnxruntime_over_the_same_calls():
    """Each busy target on a runtime's own calls is counted for both runtimes over the same calls, with the
    calls both missed; the CPU-time spread stands beside them against the same limit, not as a target."""
    import zoo_bench

    def measured(spread, cpu_spread, max_over_quiet):
        return {"median": 1.0, "spread": spread, "round_spread": 0.1, "max_over_quiet": max_over_quiet,
                "round_max_over_quiet": 1.2, "cpu": {"spread": cpu_spread}}

    quiet = {"median": 1.0, "cpu": {"median": 1.0}}
    calls = {"a": {"quiet/1/ours": quiet, "quiet/1/ort": quiet,
                   "busy/1/ours": measured(0.9, 0.1, 40.0), "busy/1/ort": measured(1.1, 0.2, 2.0)},
             "b": {"quiet/1/ours": quiet, "quiet/1/ort": quiet,
                   "busy/1/ours": measured(0.2, 0.3, 2.0), "busy/1/ort": measured(0.5, 0.1, 9.0)}}
    cold = {"create_first_s": 1.0, "create_first_cpu_s": 1.0, "rss_peak": 1}
    result = {"name": "m", "steady": {"calls": calls}, "cold": {"ours": cold, "ort": cold}}
    verdict = zoo_bench.verdicts([result], ["1"], busy=True)
    held = {row["target"]: [] for row in verdict["rows"]}
    for row in verdict["rows"]:
        held[row["target"]].append(row["holds"])
    assert held["busy spread per call (ours), one thread"] == [False, True]  # the targets themselves unchanged
    same = verdict["same_run"]
    spread = same["busy spread per call, one thread"]
    assert (spread["checked"], spread["ours_held"], spread["ort_held"], spread["both_missed"]) == (2, 1, 0, 1)
    slowest = same["busy max call / quiet median, one thread"]
    assert (slowest["ours_held"], slowest["ort_held"], slowest["both_missed"]) == (1, 1, 0)
    assert (slowest["ours_worst"], slowest["ort_worst"]) == (40.0, 9.0)
    cpu = same["busy spread per call of CPU time, one thread (not a target)"]
    assert (cpu["ours_held"], cpu["ort_held"], cpu["limit"]) == (1, 2, zoo_bench.BUSY_SPREAD)
    assert not any("CPU time" in row["target"] for row in verdict["rows"])
    table = "\n".join(zoo_bench.verdict_table(verdict))
    assert "| busy spread per call, one thread | 0.25 | 1 of 2 | 0 of 2 | 1 | 0.90 / 1.10 |" in table


def test_busy_outliers_spread_of_the_calls_the_host_left_alone():
    """busy_outliers: a preempted call (an involuntary switch or run-queue wait) and the one after it are left out
    of the third spread only, the others count every call; a slow call's own CPU right after a preempted call is
    told apart from one's own CPU elsewhere."""
    import busy_outliers

    def row(wall, cpu, wait=0.0, nivcsw=0):
        return {"wall": wall, "cpu": cpu, "wait": wait, "nivcsw": nivcsw, "nvcsw": 0, "gc": 0.0, "gcs": 0,
                "minflt": 0, "majflt": 0, "others_cpu": 0.0, "others_wait": 0.0}

    rows = [row(1.0, 1.0)] * 4 + [row(30.0, 2.0, wait=28.0, nivcsw=1), row(2.0, 2.0)] + [row(1.0, 1.0)] * 4
    rows[8] = row(1.0, 1.0, wait=1e-6)  # jitter of the wait counter, not a preemption
    assert [busy_outliers.preempted(r) for r in rows] == [False] * 4 + [True] + [False] * 5
    s = busy_outliers.summarize(rows, quiet_median=1.0)
    assert (s["preempted_calls"], s["over_3x"], s["over_3x_preempted"]) == (1, 1, 1)
    assert s["spread"]["left_alone"] == 8 and s["spread"]["wall_left_alone"] == 0.0
    assert s["spread"]["wall"] == pytest.approx(1.0) and s["spread"]["cpu"] == pytest.approx(1.0)
    rows[5] = row(4.0, 4.0)  # its own CPU time, the caches emptied by whoever ran meanwhile
    rows[2] = row(4.0, 4.0)
    why = busy_outliers.summarize(rows, quiet_median=1.0)["over_3x_why"]
    assert why == {"own CPU": 1, "own CPU right after a preempted call": 1, "own run-queue wait": 1}


def test_busy_outliers_by_block_position():
    """busy_outliers: each block position's median CPU time and its excess over the settled calls' median (what
    the first calls after a pause pay), and the wall spread of the settled calls alone."""
    import busy_outliers

    def row(wall, cpu):
        return {"wall": wall, "cpu": cpu, "wait": 0.0, "nivcsw": 0, "nvcsw": 0, "gc": 0.0, "gcs": 0,
                "minflt": 0, "majflt": 0, "others_cpu": 0.0, "others_wait": 0.0}

    block = [row(160e-6, 160e-6), row(130e-6, 130e-6), row(120e-6, 120e-6)] + [row(100e-6, 100e-6)] * 7
    s = busy_outliers.summarize(block * 4, quiet_median=100e-6, block=10)
    at = s["positions"]
    assert at["cpu_us"][:4] == [160.0, 130.0, 120.0, 100.0]
    assert at["excess_us"][:4] == pytest.approx([60.0, 30.0, 20.0, 0.0])
    assert at["settled_wall_spread"] == 0.0 and s["spread"]["wall"] > 0.25
    assert "positions" not in busy_outliers.summarize(block, quiet_median=100e-6)


def test_settle_waits_for_another_spinning_thread():
    """A block starts once no other thread of the process runs: onnxruntime's intra-op pool spins ~40 ms of
    CPU after its runs, longer than the pause, and the next block's runtime would share the CPUs with it."""
    import threading
    import time

    import numpy as np
    import zoo_bench

    def spin(seconds: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            np.sqrt(np.ones(16))  # releases the GIL now and then, as a native pool's spin never holds it

    spinner = threading.Thread(target=spin, args=(0.3,))
    start = time.perf_counter()
    spinner.start()
    zoo_bench.settle(0.0, limit=5.0)
    assert time.perf_counter() - start >= 0.25 and not spinner.is_alive()
    idle = threading.Thread(target=threading.Event().wait, args=(2.0,), daemon=True)
    idle.start()  # a sleeping thread is not waited for
    start = time.perf_counter()
    zoo_bench.settle(0.0, limit=5.0)
    assert time.perf_counter() - start < 0.5
    spinner = threading.Thread(target=spin, args=(3.0,), daemon=True)
    spinner.start()
    start = time.perf_counter()
    zoo_bench.settle(0.0, limit=0.2)  # bounded
    assert time.perf_counter() - start < 1.5


def finite_positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.skipif(SMALL not in {m["name"] for m in MODELS}, reason=f"{SMALL} is not in the zoo")
def test_quick_run(tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/zoo_bench.py"), "--quick", "--zoo", str(ZOO),
                           "--models", SMALL, "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:] + done.stdout[-2000:]
    assert "| target | limit | holds | worst |" in done.stdout
    assert "| busy, each runtime's own | limit | ours holds | onnxruntime holds | both miss |" in done.stdout
    data = json.loads(out.read_text())
    (result,) = data["results"]
    assert result["name"] == SMALL and "error" not in result
    for measured in result["steady"]["calls"].values():
        assert measured["max_rel_diff"] < 1e-3  # the timed runs compute the same thing
        for condition in ("quiet", "busy"):
            for threads in ("1", "default"):
                for runtime in ("ours", "ort"):
                    s = measured[f"{condition}/{threads}/{runtime}"]
                    assert s["n"] >= 10
                    assert all(finite_positive(s[k]) for k in ("median", "p10", "p90", "min", "max"))
                    assert s["min"] <= s["p10"] <= s["median"] <= s["p90"] <= s["max"]
                    assert s["cpu"]["n"] == s["n"] and finite_positive(s["cpu"]["median"])
                    assert math.isfinite(s["spread"]) and s["spread"] >= 0
                    assert s["rounds"] >= 2 and math.isfinite(s["round_spread"]) and s["round_spread"] >= 0
                    if condition == "busy":
                        assert finite_positive(s["max_over_quiet"]) and finite_positive(s["round_max_over_quiet"])
                        assert finite_positive(s["cpu"]["max_over_quiet"])
    for runtime in ("ours", "ort"):
        cold = result["cold"][runtime]
        assert all(finite_positive(cold[k]) for k in ("import_s", "create_s", "create_first_s", "create_first_cpu_s"))
        assert all(finite_positive(v) for v in cold["first_s"].values())
        assert cold["rss_peak"] >= cold["rss_before_session"] > cold["rss_start"] > 0
    rows = data["verdicts"]["rows"]
    assert {row["target"] for row in rows} >= {"session creation + first runs", "peak RSS of the process"}
    assert all(finite_positive(row["value"]) and isinstance(row["holds"], bool) for row in rows)
    assert all(math.isfinite(v["value"]) for v in data["verdicts"]["overall"].values())
    assert all(finite_positive(v) for v in data["verdicts"]["info"].values())


def test_workers_keep_a_bytecode_cache_where_the_environment_turned_it_off(monkeypatch):
    """A fresh worker runs as an installed package does, from bytecode: where PYTHONDONTWRITEBYTECODE is set, the
    workers write and read it under the benchmark's own folder; a prefix the user set is kept; and an environment
    that writes bytecode is passed on as it is."""
    import zoo_bench

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX", raising=False)
    env = zoo_bench.worker_environment()
    assert "PYTHONDONTWRITEBYTECODE" not in env
    assert env["PYTHONPYCACHEPREFIX"] == str(zoo_bench.PYCACHE)
    assert zoo_bench.PYCACHE.is_relative_to(Path(zoo_bench.__file__).parent / ".models")  # (ignored by git)
    monkeypatch.setenv("PYTHONPYCACHEPREFIX", "/elsewhere")
    assert zoo_bench.worker_environment()["PYTHONPYCACHEPREFIX"] == "/elsewhere"
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    monkeypatch.delenv("PYTHONPYCACHEPREFIX")
    env = zoo_bench.worker_environment()
    assert "PYTHONDONTWRITEBYTECODE" not in env and "PYTHONPYCACHEPREFIX" not in env
