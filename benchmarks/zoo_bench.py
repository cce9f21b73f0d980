"""This runtime against onnxruntime over the model zoo (benchmarks/.models/zoo, scripts/build_zoo.sh), the way
issue 19's targets are stated: steady state on one thread and on the default threads, quiet and beside a
CPU-bound process this script starts, session creation and first run in a fresh process, peak memory.

    .venv/bin/python benchmarks/zoo_bench.py --variants fp32 [--models 'gpt2.*,bert.*'] [--json out.json]
    .venv/bin/python benchmarks/zoo_bench.py --quick --models bert.torchscript.fp32

Every measurement runs in a child process (this script again, ``--worker``), so that a crash or a refusal in
one model costs only that model, and so that creation and the first run start from a fresh interpreter: no
session, plan or compiled function in memory, numba's on-disk cache as earlier runs left it (warm: the steady
worker runs every model before its creations are timed). See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import math
import multiprocessing
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_ZOO = HERE / ".models" / "zoo"

# Issue 19's targets (ours / onnxruntime unless said otherwise; lower is better).
QUIET_GEOMEAN, QUIET_EACH = 1.0, 1.25
BUSY_RATIO, BUSY_SPREAD, BUSY_MAX_OVER_QUIET = 1.5, 0.25, 3.0
COLD_RATIO = 2.0
RSS_RATIO = 1.5
# The busy targets on our own calls (their stats key): onnxruntime's value of the same run is kept beside ours.
BUSY_OWN_TARGETS = (("busy spread per call (ours)", "spread", BUSY_SPREAD),
                    ("busy spread of round medians (ours)", "round_spread", BUSY_SPREAD),
                    ("busy max call / quiet median (ours)", "max_over_quiet", BUSY_MAX_OVER_QUIET),
                    ("busy slowest round / quiet median (ours)", "round_max_over_quiet", BUSY_MAX_OVER_QUIET))
SETTLE_LIMIT = 0.5  # seconds a block waits at most for the other runtime's pool to stop spinning
# A block's timed calls from this position on count as settled: the pause before a block lets the host's other
# processes run on this core, and the first calls after it refill the caches and predictors they emptied, an
# absolute cost (busy_outliers' block positions) that weighs more on a shorter call.
SETTLED_FROM = 3
THREADS = {"1": 1, "default": 0}  # label -> intra_op_num_threads (0: each runtime's own default)
SAYS = {"1": "one thread", "default": "default threads"}


# --- the measuring children ---------------------------------------------------------------------------------


def rss_now() -> int:
    """Resident bytes of this process now (ru_maxrss only gives the peak)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def session(runtime: str, path: str, threads: int):
    """A session as users make one: default options, plus the thread count when one is asked for."""
    if runtime == "ours":
        import onnx_runtime as rt
    else:
        import onnxruntime as rt
    options = rt.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    if runtime == "ort":
        options.log_severity_level = 3
    return rt.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def load_model(zoo: Path, name: str, batch: int = 1) -> dict:
    """The manifest's entry of ``name``, its calls' inputs ``batch`` times as many along their first axis."""
    from zoo_feeds import batched

    for model in json.loads((zoo / "manifest.json").read_text())["models"]:
        if model["name"] == name:
            return model if batch == 1 else {**model, "calls": {call: batched(spec, batch)
                                                               for call, spec in model["calls"].items()}}
    raise SystemExit(f"{name}: not in {zoo / 'manifest.json'}")


def worker_cold(zoo: Path, name: str, runtime: str, batch: int = 1) -> dict:
    """Import, session creation and the first run of each call (in the manifest's order: a decoder's prefill,
    then its first decode step, a new input signature) in this fresh process, default threads; then a few more
    runs of each call, so that the peak includes what steady calls hold."""
    from zoo_feeds import make_feeds

    model = load_model(zoo, name, batch)
    feeds = {call: make_feeds(spec) for call, spec in model["calls"].items()}
    out = {"rss_start": rss_now()}
    start = time.perf_counter()
    if runtime == "ours":
        import onnx_runtime  # noqa: F401
    else:
        import onnxruntime  # noqa: F401
    out["import_s"] = time.perf_counter() - start
    out["rss_before_session"] = rss_now()
    start, start_cpu = time.perf_counter(), time.process_time()
    sess = session(runtime, str(zoo / model["file"]), 0)
    out["create_s"] = time.perf_counter() - start
    out["first_s"] = {}
    for call, feed in feeds.items():
        start = time.perf_counter()
        sess.run(None, feed)
        out["first_s"][call] = time.perf_counter() - start
    out["create_first_cpu_s"] = time.process_time() - start_cpu  # all threads: compiling ones too
    for _ in range(3):
        for feed in feeds.values():
            sess.run(None, feed)
    out["rss_peak"] = rss_peak()
    out["rss_end"] = rss_now()
    return out


def busy_loop() -> None:
    """The competing process: pure Python arithmetic, never sleeping, on whichever core the OS gives it."""
    x = 0
    while True:
        x = (x + 1) & 0xFFFF


def _percentile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))]


def _spread(ordered: list[float]) -> float:
    """(p90 - p10) / median of sorted samples."""
    med = statistics.median(ordered)
    return (_percentile(ordered, 0.9) - _percentile(ordered, 0.1)) / med if med > 0 else math.inf


def stats(samples: list[float], quiet_median: float | None = None, block: int = 0) -> dict:
    """Per call: median, p10/p90, min/max and the spread (p90 - p10) / median. With ``block`` (the calls each
    turn timed in a row, in_blocks), per round as well: each block's median, their spread the same way and
    the slowest round's median over the quiet median: run to run as a user timing a batch of calls sees it,
    where one descheduled call among hundreds moves the per-call maximum but not a round. Per block position
    too (not a target): each position's median and the spread of the settled calls (SETTLED_FROM on), which
    leaves out the first calls' refill after the pause before their block."""
    ordered = sorted(samples)
    med = statistics.median(ordered)
    out = {"n": len(ordered), "median": med, "p10": _percentile(ordered, 0.1), "p90": _percentile(ordered, 0.9),
           "min": ordered[0], "max": ordered[-1], "spread": _spread(ordered)}
    rounds = sorted(statistics.median(samples[i:i + block]) for i in range(0, len(samples), block)) if block else []
    if rounds:
        middle = statistics.median(rounds)
        out["rounds"] = len(rounds)
        out["round_spread"] = ((_percentile(rounds, 0.9) - _percentile(rounds, 0.1)) / middle if middle > 0
                               else math.inf)
        out["positions"] = [statistics.median(samples[i::block]) for i in range(min(block, len(samples)))]
        settled = sorted(sample for i, sample in enumerate(samples) if i % block >= SETTLED_FROM)
        out["settled_spread"] = _spread(settled) if settled else math.nan
    if quiet_median:
        out["max_over_quiet"] = ordered[-1] / quiet_median
        out["p90_over_quiet"] = _percentile(ordered, 0.9) / quiet_median
        if rounds:
            out["round_max_over_quiet"] = rounds[-1] / quiet_median
    return out


def others_running() -> bool:
    """Whether another thread of this process is running or waiting for a CPU (Linux: /proc's task states):
    a pool spinning after its last job (onnxruntime's intra-op pool spins ~40 ms of CPU after a run, longer
    than the pause; numpy's OpenBLAS ~0.1 s; our helpers 5 ms)."""
    me = threading.get_native_id()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as stat:
                if stat.read().rsplit(b")", 1)[1].split()[0] == b"R":
                    return True
        except (OSError, IndexError):  # a thread that ended meanwhile
            continue
    return False


def settle(pause: float, limit: float = SETTLE_LIMIT) -> None:
    """Sleep ``pause`` seconds, then until no other thread of this process runs (at most ``limit`` more): the
    next block's runtime then does not share the CPUs with the other runtime's spinning pool."""
    time.sleep(pause)
    deadline = time.perf_counter() + limit
    while time.perf_counter() < deadline and others_running():
        time.sleep(0.002)


def in_blocks(runners: dict, repeat: int, block: int, pause: float, max_seconds: float,
              min_samples: int) -> dict[str, tuple[list[float], list[float]]]:
    """Seconds per call of each runner, wall clock and this process's CPU time: blocks of ``block`` timed
    calls, the runtimes taking turns (order rotating), ``pause`` seconds before each block and then until no
    other thread of this process runs (settle) and its first call untimed, so neither pays for the other's
    spinning pool. Stops at ``repeat`` calls each, or after
    ``max_seconds`` once each has ``min_samples``.

    The CPU time leaves out the time this process waited for a core, which on a loaded host dominates the wall
    clock; on one thread it is the work of the call (both runtimes compute on the calling thread then)."""
    names = list(runners)
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in names}
    began = time.perf_counter()
    round_ = 0
    while min(len(t[0]) for t in times.values()) < repeat:
        if time.perf_counter() - began > max_seconds and min(len(t[0]) for t in times.values()) >= min_samples:
            break
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            settle(pause)
            run, (wall, cpu) = runners[name], times[name]
            advance = getattr(run, "advance", None)  # a growing decode call's next inputs, made untimed
            run()
            for _ in range(min(block, repeat - len(wall))):
                if advance is not None:
                    advance()
                start, start_cpu = time.perf_counter(), time.process_time()
                run()
                wall.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
        round_ += 1
    return times


def agreement(ours: list, theirs: list) -> float:
    """The largest |ours - onnxruntime| over the outputs, relative to each output's magnitude."""
    import numpy as np

    worst = 0.0
    for a, b in zip(ours, theirs):
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a64.shape != b64.shape:
            return math.inf
        if a64.size:
            worst = max(worst, float(np.max(np.abs(a64 - b64))) / max(float(np.max(np.abs(b64))), 1e-30))
    return worst


class Competitors:
    """``count`` busy_loop processes for the duration of a ``with`` block (spawned: this process has threads)."""

    def __init__(self, count: int):
        context = multiprocessing.get_context("spawn")
        self.processes = [context.Process(target=busy_loop, daemon=True) for _ in range(count)]

    def __enter__(self) -> Competitors:
        for process in self.processes:
            process.start()
        time.sleep(0.5)  # their interpreters started and spinning
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes:
            process.terminate()
            process.join()


def measure(condition: str, sessions: dict, feeds: dict, threads: list[str], out: dict,
            args: argparse.Namespace, specs: dict) -> None:
    """Times of every call and thread setting under ``condition``, into ``out[call]``. Decode calls grow by one
    token per timed call (zoo_feeds.GrowingDecode) unless ``--fixed-decode``; prefill calls (an empty past) do not."""
    from zoo_feeds import GrowingDecode, is_decode_step

    for call, feed in feeds.items():
        growing = not args.fixed_decode and is_decode_step(specs[call])
        for label in threads:
            runners = {runtime: (GrowingDecode(specs[call], lambda f, s=sessions[runtime, label]: s.run(None, f))
                                 if growing else (lambda s=sessions[runtime, label], f=feed: s.run(None, f)))
                       for runtime in ("ours", "ort")}
            times = in_blocks(runners, args.repeat, args.block, args.pause, args.max_seconds, args.min_samples)
            for runtime, (wall, cpu) in times.items():
                quiet = out[call].get(f"quiet/{label}/{runtime}", {})
                out[call][f"{condition}/{label}/{runtime}"] = {
                    **stats(wall, quiet.get("median"), args.block),
                    "cpu": stats(cpu, quiet.get("cpu", {}).get("median"), args.block)}


def worker_steady(zoo: Path, name: str, args: argparse.Namespace) -> dict:
    """Steady-state times of every call, for each thread setting, quiet and then beside ``args.busy`` CPU-bound
    processes; the four sessions (two runtimes x two thread settings) live in this one process so that the
    host's slow phases fall on both runtimes."""
    from zoo_feeds import check_consistent, make_feeds

    # Steady state is the compiled kernels': not the first runs a new process serves from numpy while they load
    # in the background (which would also count the loader's CPU time against the calls it overlaps).
    os.environ["ONNX_RUNTIME_COMPILE_IN_BACKGROUND"] = "0"
    model = load_model(zoo, name, args.batch)
    for spec in model["calls"].values():
        check_consistent(spec)
    feeds = {call: make_feeds(spec) for call, spec in model["calls"].items()}
    path = str(zoo / model["file"])
    threads = [label for label in THREADS if label in args.threads.split(",")]
    sessions = {(runtime, label): session(runtime, path, THREADS[label]) for label in threads
                for runtime in ("ours", "ort")}
    calls: dict[str, dict] = {}
    for call, feed in feeds.items():
        label = threads[-1]
        calls[call] = {"max_rel_diff": agreement(sessions["ours", label].run(None, feed),
                                                 sessions["ort", label].run(None, feed))}
        for sess in sessions.values():  # warm-up: signatures specialized, pools started
            for _ in range(args.warmup):
                sess.run(None, feed)
    load_before = os.getloadavg()
    measure("quiet", sessions, feeds, threads, calls, args, model["calls"])
    if args.busy:
        with Competitors(args.busy):
            measure("busy", sessions, feeds, threads, calls, args, model["calls"])
    return {"calls": calls, "load_before": load_before, "load_after": os.getloadavg()}


# --- the parent ------------------------------------------------------------------------------------------------


# Python's bytecode cache for the workers, where the environment turned it off (PYTHONDONTWRITEBYTECODE, as some CI
# hosts and sandboxes do): an installed package runs from the bytecode pip compiled at install, and without it
# every fresh worker would compile our modules' sources again and count that in its import, creation and first run.
PYCACHE = HERE / ".models" / "pycache"


def worker_environment() -> dict[str, str]:
    """The workers' environment: this one, with bytecode written and read where it was turned off (under PYCACHE
    unless a prefix is set, so the source tree stays clean)."""
    env = dict(os.environ)
    if env.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
        env.setdefault("PYTHONPYCACHEPREFIX", str(PYCACHE))
    return env


def child(argv: list[str], timeout: float) -> dict:
    """Run this script as a worker; its last stdout line is its JSON result (or the error it failed with)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE,
                              env=worker_environment())
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = done.stdout.strip().splitlines()
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": f"exit {done.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


def select(models: list[dict], args: argparse.Namespace) -> tuple[list[dict], list[tuple[str, str]]]:
    patterns = [p.strip() for p in (args.models or "*").split(",") if p.strip()]
    variants = set(args.variants.split(",")) if args.variants else None
    exporters = set(args.exporters.split(",")) if args.exporters else None
    chosen, skipped = [], []
    for model in models:
        if not any(fnmatch.fnmatchcase(model["name"], p) for p in patterns):
            continue
        if (variants and model["variant"] not in variants) or (exporters and model["exporter"] not in exporters):
            continue
        if model["status"] != "ok":
            skipped.append((model["name"], f"not built ({model['stage']}): {model['reason']}"))
        else:
            chosen.append(model)
    return chosen, skipped


def median_of(values: list[float]) -> float:
    return statistics.median(values) if values else math.nan


def bench_model(zoo: Path, model: dict, args: argparse.Namespace, passthrough: list[str]) -> dict:
    name = model["name"]
    result: dict = {"name": name, "architecture": model["architecture"], "exporter": model["exporter"],
                    "variant": model["variant"], "calls": list(model["calls"])}
    # The steady worker first: it also leaves every kernel this model needs in numba's disk cache.
    steady = child(["--worker", "steady", "--zoo", str(zoo), "--model", name, *passthrough], args.timeout)
    if "error" in steady:
        result["error"] = "steady: " + steady["error"]
        return result
    result["steady"] = steady
    runs: dict[str, list[dict]] = {"ours": [], "ort": []}
    for rep in range(args.create_repeat):
        for runtime in ("ours", "ort") if rep % 2 == 0 else ("ort", "ours"):
            cold = child(["--worker", "cold", "--zoo", str(zoo), "--model", name, "--runtime", runtime,
                          "--batch", str(args.batch)],
                         args.timeout)
            if "error" in cold:
                result["error"] = f"cold ({runtime}): {cold['error']}"
                return result
            runs[runtime].append(cold)
    result["cold"] = {}
    for runtime, reps in runs.items():
        summary = {key: median_of([r[key] for r in reps])
                   for key in ("import_s", "create_s", "rss_start", "rss_before_session", "rss_peak", "rss_end")}
        summary["first_s"] = {call: median_of([r["first_s"][call] for r in reps]) for call in model["calls"]}
        summary["create_first_s"] = median_of([r["create_s"] + sum(r["first_s"].values()) for r in reps])
        summary["create_first_cpu_s"] = median_of([r["create_first_cpu_s"] for r in reps])
        summary["rss_model"] = summary["rss_peak"] - summary["rss_before_session"]
        summary["runs"] = reps
        result["cold"][runtime] = summary
    return result


def ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.inf


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def verdicts(results: list[dict], threads: list[str], busy: bool) -> dict:
    """Each target, per model (and call) and overall: the value, the limit and whether it holds."""
    rows: list[dict] = []
    quiet_ratios: dict[str, list[float]] = {label: [] for label in threads}
    cpu_spreads: list[tuple[str, float, float]] = []
    for result in results:
        if "error" in result:
            continue
        for call, measured in result["steady"]["calls"].items():
            for label in threads:
                ours, ort = measured[f"quiet/{label}/ours"], measured[f"quiet/{label}/ort"]
                value = ratio(ours["median"], ort["median"])
                quiet_ratios[label].append(value)
                rows.append({"target": f"quiet ratio, {SAYS[label]}", "model": result["name"], "call": call,
                             "value": value, "limit": QUIET_EACH})
                if not busy:
                    continue
                ours_busy, ort_busy = measured[f"busy/{label}/ours"], measured[f"busy/{label}/ort"]
                rows.append({"target": f"busy ratio, {SAYS[label]}", "model": result["name"], "call": call,
                             "value": ratio(ours_busy["median"], ort_busy["median"]), "limit": BUSY_RATIO})
                for target, key, limit in BUSY_OWN_TARGETS:
                    # onnxruntime's value of the same run beside ours: a miss both share is the host's.
                    rows.append({"target": f"{target}, {SAYS[label]}", "model": result["name"], "call": call,
                                 "value": ours_busy[key], "limit": limit, "ort": ort_busy[key]})
                cpu_spreads += side_spreads(ours_busy, ort_busy, SAYS[label])
        cold = result["cold"]
        rows.append({"target": "session creation + first runs", "model": result["name"], "call": "all",
                     "value": ratio(cold["ours"]["create_first_s"], cold["ort"]["create_first_s"]),
                     "limit": COLD_RATIO})
        rows.append({"target": "peak RSS of the process", "model": result["name"], "call": "all",
                     "value": ratio(cold["ours"]["rss_peak"], cold["ort"]["rss_peak"]), "limit": RSS_RATIO})
    for row in rows:
        row["holds"] = row["value"] <= row["limit"]
    overall = {}
    for label, values in quiet_ratios.items():
        value = geomean(values)
        overall[f"quiet geomean, {SAYS[label]}"] = {"value": value, "limit": QUIET_GEOMEAN,
                                                        "holds": value <= QUIET_GEOMEAN}
    summary: dict[str, dict] = {}
    for row in rows:
        entry = summary.setdefault(row["target"], {"limit": row["limit"], "held": 0, "checked": 0, "worst": 0.0})
        entry["checked"] += 1
        entry["held"] += row["holds"]
        entry["worst"] = max(entry["worst"], row["value"])
    return {"overall": overall, "per_target": summary, "rows": rows, "info": informative(results, threads),
            "same_run": same_run(rows, cpu_spreads)}


def side_spreads(ours: dict, ort: dict, says: str) -> list[tuple[str, float, float]]:
    """The spreads beside the busy targets (not targets), ours and onnxruntime's: of the CPU time per call, and of
    the settled calls' wall time (each block's from SETTLED_FROM on, where the block's timing gave positions)."""
    spreads = [(f"busy spread per call of CPU time, {says}", ours["cpu"]["spread"], ort["cpu"]["spread"])]
    if "settled_spread" in ours and "settled_spread" in ort:
        spreads.append((f"busy spread per call from each block's call {SETTLED_FROM + 1}, {says}",
                        ours["settled_spread"], ort["settled_spread"]))
    return spreads


def same_run(rows: list[dict], cpu_spreads: list[tuple[str, float, float]]) -> dict:
    """The busy targets on our own spread and slowest calls, counted for both runtimes over the same calls of
    the same run, and how many calls both missed (what the host did to both); beside them, not a target, the
    spread of the process's CPU time per call against the same limit: near the wall-time spread where the work
    itself varied, far below it where calls waited for a core; and the wall-time spread of the settled calls
    (SETTLED_FROM on in each block), where the first calls' refill after the pause is left out."""
    counts: dict[str, dict] = {}
    for row in rows:
        if "ort" in row:
            add_counts(counts, row["target"].replace(" (ours)", ""), row["limit"], row["value"], row["ort"])
    for target, ours, ort in cpu_spreads:
        add_counts(counts, target + " (not a target)", BUSY_SPREAD, ours, ort)
    return counts


def add_counts(counts: dict, target: str, limit: float, ours: float, ort: float) -> None:
    entry = counts.setdefault(target, {"limit": limit, "checked": 0, "ours_held": 0, "ort_held": 0,
                                       "both_missed": 0, "ours_worst": 0.0, "ort_worst": 0.0})
    entry["checked"] += 1
    entry["ours_held"] += ours <= limit
    entry["ort_held"] += ort <= limit
    entry["both_missed"] += ours > limit and ort > limit
    entry["ours_worst"] = max(entry["ours_worst"], ours)
    entry["ort_worst"] = max(entry["ort_worst"], ort)


def informative(results: list[dict], threads: list[str]) -> dict:
    """Geomeans that are not targets: CPU-time ratios (robust on a loaded host) and the cold start's."""
    ok = [r for r in results if "error" not in r]

    def cold(key: str) -> float:
        return geomean([ratio(r["cold"]["ours"][key], r["cold"]["ort"][key]) for r in ok])

    info = {"cold geomean, wall": cold("create_first_s"), "cold geomean, CPU": cold("create_first_cpu_s")}
    if "1" in threads:
        info["quiet geomean, one thread, CPU"] = geomean([
            ratio(m["quiet/1/ours"]["cpu"]["median"], m["quiet/1/ort"]["cpu"]["median"])
            for r in ok for m in r["steady"]["calls"].values()])
    return info


# --- the report ------------------------------------------------------------------------------------------------


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}" if math.isfinite(seconds) else "-"


def fmt(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "-"


def mb(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f}"


def steady_table(ok: list[dict], threads: list[str]) -> list[str]:
    cpu = "1" in threads
    lines = ["Steady state, quiet: median ms per call, ours / onnxruntime, and the ratio"
             + (" (CPU: the process's CPU time per call on one thread, which leaves out waiting for a core)."
                if cpu else "."), "",
             "| model | call | " + " | ".join(f"{SAYS[label]}: ours / ort | ratio" for label in threads)
             + (" | one thread, CPU: ours / ort | ratio" if cpu else "") + " |",
             "|" + "---|" * (2 + 2 * len(threads) + 2 * cpu)]
    for r in ok:
        for call, m in r["steady"]["calls"].items():
            cells = []
            for label in threads:
                ours, ort = m[f"quiet/{label}/ours"]["median"], m[f"quiet/{label}/ort"]["median"]
                cells += [f"{ms(ours)} / {ms(ort)}", fmt(ratio(ours, ort))]
            if cpu:
                ours, ort = m["quiet/1/ours"]["cpu"]["median"], m["quiet/1/ort"]["cpu"]["median"]
                cells += [f"{ms(ours)} / {ms(ort)}", fmt(ratio(ours, ort))]
            lines.append(f"| {r['name']} | {call} | " + " | ".join(cells) + " |")
    return lines


def busy_table(ok: list[dict], threads: list[str]) -> list[str]:
    lines = ["Beside a CPU-bound process: median ms, the ratio, the spread (p90 - p10) / median of each runtime "
             "per call and over the rounds' medians (a round: the calls a turn times in a row), the slowest "
             "call and round over the quiet median, each runtime's, and the slowest call's CPU time over the quiet "
             "CPU median (the process's CPU time: near 1 where a slow call waited for a CPU; on the default threads "
             "it counts every thread, at the scheduler's tick); the CPU spread is the same spread of that CPU time.",
             "",
             "| model | call | threads | ours / ort | ratio | spread per call ours / ort "
             "| CPU spread per call ours / ort | spread of rounds ours / ort | max call / quiet ours / ort "
             "| slowest round / quiet ours / ort | max CPU / quiet CPU ours / ort |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in ok:
        for call, m in r["steady"]["calls"].items():
            for label in threads:
                ours, ort = m[f"busy/{label}/ours"], m[f"busy/{label}/ort"]
                lines.append(f"| {r['name']} | {call} | {SAYS[label]} | {ms(ours['median'])} / {ms(ort['median'])} "
                             f"| {fmt(ratio(ours['median'], ort['median']))} | {ours['spread']:.0%} / "
                             f"{ort['spread']:.0%} | {ours['cpu']['spread']:.0%} / {ort['cpu']['spread']:.0%} "
                             f"| {ours['round_spread']:.0%} / {ort['round_spread']:.0%} "
                             f"| {fmt(ours['max_over_quiet'])} / {fmt(ort['max_over_quiet'])} "
                             f"| {fmt(ours['round_max_over_quiet'])} / {fmt(ort['round_max_over_quiet'])} "
                             f"| {fmt(ours['cpu']['max_over_quiet'])} / {fmt(ort['cpu']['max_over_quiet'])} |")
    return lines


def cold_table(ok: list[dict]) -> list[str]:
    lines = ["A fresh process, default threads (medians over the processes): ours' import (s), session creation "
             "and the first run of each call in order (ms), creation + first runs and the ratio, peak RSS of the "
             "process and in brackets its growth from just before the session (MB). The CPU ratio compares the "
             "CPU time of creation + first runs, all threads.", "",
             "| model | ours import | ours create / first | ort create / first | create + first: ours / ort "
             "| ratio | ratio, CPU | peak RSS ours / ort | ratio |", "|---|---|---|---|---|---|---|---|---|"]
    for r in ok:
        c = r["cold"]
        cells = []
        for runtime in ("ours", "ort"):
            firsts = " + ".join(ms(v) for v in c[runtime]["first_s"].values())
            cells.append(f"{ms(c[runtime]['create_s'])} / {firsts}")
        rss = (f"{mb(c['ours']['rss_peak'])} ({mb(c['ours']['rss_model'])}) / "
               f"{mb(c['ort']['rss_peak'])} ({mb(c['ort']['rss_model'])})")
        lines.append(f"| {r['name']} | {c['ours']['import_s']:.2f} | {cells[0]} | {cells[1]} | "
                     f"{ms(c['ours']['create_first_s'])} / {ms(c['ort']['create_first_s'])} | "
                     f"{fmt(ratio(c['ours']['create_first_s'], c['ort']['create_first_s']))} | "
                     f"{fmt(ratio(c['ours']['create_first_cpu_s'], c['ort']['create_first_cpu_s']))} | {rss} | "
                     f"{fmt(ratio(c['ours']['rss_peak'], c['ort']['rss_peak']))} |")
    return lines


def verdict_table(verdict: dict) -> list[str]:
    lines = ["Targets (issue 19): how many models (and calls) meet each, and the worst value.", "",
             "| target | limit | holds | worst |", "|---|---|---|---|"]
    for target, entry in verdict["overall"].items():
        lines.append(f"| {target} | {entry['limit']} | {'yes' if entry['holds'] else 'NO'} | {fmt(entry['value'])} |")
    for target, entry in verdict["per_target"].items():
        lines.append(f"| {target} | {entry['limit']} | {entry['held']} of {entry['checked']} | "
                     f"{fmt(entry['worst'])} |")
    lines += ["", "Not targets: " + ", ".join(f"{k} {fmt(v)}" for k, v in verdict["info"].items()) + "."]
    if verdict.get("same_run"):
        lines += ["", "The busy targets on each runtime's own calls, counted for both over the same calls of this run "
                  "(a call both miss is the host's doing more than a runtime's), and the spread of the process's CPU "
                  "time per call against the same limit (not a target: far below the wall-time spread where calls "
                  f"waited for a core), and the wall-time spread of each block's calls from call {SETTLED_FROM + 1} "
                  "on (not a target: the first calls after a block's pause refill the caches and predictors other "
                  "processes emptied meanwhile).", "",
                  "| busy, each runtime's own | limit | ours holds | onnxruntime holds | both miss "
                  "| worst ours / ort |",
                  "|---|---|---|---|---|---|"]
        for target, entry in verdict["same_run"].items():
            lines.append(f"| {target} | {entry['limit']} | {entry['ours_held']} of {entry['checked']} | "
                         f"{entry['ort_held']} of {entry['checked']} | {entry['both_missed']} | "
                         f"{fmt(entry['ours_worst'])} / {fmt(entry['ort_worst'])} |")
    return lines


def report(results: list[dict], skipped: list[tuple[str, str]], threads: list[str], busy: bool,
           verdict: dict) -> str:
    ok = [r for r in results if "error" not in r]
    lines = steady_table(ok, threads) + [""]
    if busy:
        lines += busy_table(ok, threads) + [""]
    lines += cold_table(ok) + [""]
    failed = [r for r in results if "error" in r]
    if failed or skipped:
        lines += ["Not measured:", ""] + [f"- {r['name']}: {r['error']}" for r in failed]
        lines += [f"- {name}: {why}" for name, why in skipped] + [""]
    return "\n".join(lines + verdict_table(verdict))


def environment(zoo: Path) -> dict:
    import numpy
    import onnxruntime

    def git(*argv: str) -> str:
        try:
            return subprocess.run(["git", *argv], capture_output=True, text=True, cwd=HERE).stdout.strip()
        except OSError:
            return ""

    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git("rev-parse", "--short", "HEAD"), "dirty": bool(git("status", "--porcelain", "--", ".")),
            "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "load": os.getloadavg(), "numpy": numpy.__version__,
            "onnxruntime": onnxruntime.__version__, "zoo": str(zoo)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, default=DEFAULT_ZOO, help="the zoo's folder (with manifest.json)")
    parser.add_argument("--models", help="comma-separated names or globs ('*.fp32', 'gpt2.*'); default all")
    parser.add_argument("--variants", help="comma-separated variants (fp32, fp16, int8_dynamic, int8_qdq, "
                        "int8_qoperator, int4, optimized); default all")
    parser.add_argument("--exporters", help="torchscript, dynamo or both (default)")
    parser.add_argument("--threads", default="1,default", help="thread settings: 1, default or both (default)")
    parser.add_argument("--busy", type=int, default=1, help="competing CPU-bound processes (default 1; 0: none)")
    parser.add_argument("--repeat", type=int, default=200, help="timed calls per runtime and condition at most")
    parser.add_argument("--min-samples", type=int, default=40, help="timed calls at least (default 40)")
    parser.add_argument("--max-seconds", type=float, default=2.0,
                        help="stop adding blocks after this long once --min-samples are in (default 2)")
    parser.add_argument("--block", type=int, default=10, help="consecutive timed calls per turn (default 10)")
    parser.add_argument("--pause", type=float, default=0.02, help="seconds before each block (default 0.02)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per session and call (default 3)")
    parser.add_argument("--create-repeat", type=int, default=3, help="fresh processes per runtime (default 3)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a worker may take (default 600)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few calls, one creation each")
    parser.add_argument("--json", type=Path, help="write every number here")
    parser.add_argument("--batch", type=int, default=1,
                        help="each call's inputs this many times along their first axis, the models' batch (default 1)")
    parser.add_argument("--fixed-decode", action="store_true",
                        help="time decode calls at one past length (default: one token longer per call, as a "
                        "generation loop runs)")
    parser.add_argument("--worker", choices=("steady", "cold"), help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--runtime", choices=("ours", "ort"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    unknown = set(args.threads.split(",")) - set(THREADS)
    if unknown or not args.threads:
        parser.error(f"--threads takes {', '.join(THREADS)} or both, not {args.threads!r}")
    if args.quick:
        args.repeat, args.min_samples, args.max_seconds, args.block = 20, 10, 0.2, 5
        args.pause, args.warmup, args.create_repeat = 0.005, 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    zoo = args.zoo.resolve()
    if args.worker:
        out = worker_steady(zoo, args.model, args) if args.worker == "steady" else \
            worker_cold(zoo, args.model, args.runtime, args.batch)
        print(json.dumps(out))
        return 0
    manifest = zoo / "manifest.json"
    if not manifest.is_file():
        print(f"the model zoo is not built ({manifest} is missing): run scripts/build_zoo.sh", file=sys.stderr)
        return 2
    chosen, skipped = select(json.loads(manifest.read_text())["models"], args)
    if not chosen:
        print("no model selected", file=sys.stderr)
        return 2
    threads = [label for label in THREADS if label in args.threads.split(",")]
    passthrough = ["--threads", ",".join(threads), "--busy", str(args.busy), "--repeat", str(args.repeat),
                   "--min-samples", str(args.min_samples), "--max-seconds", str(args.max_seconds),
                   "--block", str(args.block), "--pause", str(args.pause), "--warmup", str(args.warmup),
                   "--batch", str(args.batch)]
    if args.fixed_decode:
        passthrough.append("--fixed-decode")
    env = environment(zoo)
    print(f"# zoo_bench {env['date']} at {env['commit']}{' (dirty)' if env['dirty'] else ''}: {len(chosen)} models, "
          f"{env['cpus']} CPUs, load {env['load'][0]:.2f}, onnxruntime {env['onnxruntime']}"
          f"{f', batch {args.batch}' if args.batch != 1 else ''}", flush=True)
    began = time.perf_counter()
    results = []
    for model in chosen:
        start = time.perf_counter()
        result = bench_model(zoo, model, args, passthrough)
        results.append(result)
        status = result.get("error") or ", ".join(
            f"{call} {label}: {fmt(ratio(m[f'quiet/{label}/ours']['median'], m[f'quiet/{label}/ort']['median']))}"
            for call, m in result["steady"]["calls"].items() for label in threads)
        print(f"{model['name']}: {status} ({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    verdict = verdicts(results, threads, bool(args.busy))
    print(report(results, skipped, threads, bool(args.busy), verdict))
    print(f"\n{time.perf_counter() - began:.0f} s")
    if args.json:
        env["seconds"] = time.perf_counter() - began
        env["commit_end"] = environment(zoo)["commit"]  # the checkout may move while a long run goes on
        env["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        args.json.write_text(json.dumps({"environment": env, "results": results, "skipped": skipped,
                                         "verdicts": verdict}, indent=1))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
