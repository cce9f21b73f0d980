"""What a slow call beside a CPU-bound process is made of (issue 19's "no run above 3x its quiet median").

Each timed call of each runtime records, besides its wall time: the calling thread's CPU time, the time it and
every other thread of this process waited on a run queue while the call ran (``/proc/<tid>/schedstat``'s second
field: ready to run, no CPU given), its minor/major page faults and involuntary context switches
(``getrusage(RUSAGE_THREAD)``), and the time Python's cyclic collector ran inside it (``gc.callbacks``). A call
is then attributed: the wall time left after the calling thread's CPU time and its run-queue wait is time it
slept or spun waiting on another thread (a helper, OpenBLAS's pool) or blocked on a fault.

    .venv/bin/python benchmarks/busy_outliers.py --models mobilenetv3.torchscript.fp32 --threads 1,default

Both runtimes run in this one process, taking turns in blocks, quiet and then beside ``--busy`` competitors
(zoo_bench's), so the host's slow phases fall on both.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from zoo_bench import DEFAULT_ZOO, SETTLED_FROM, THREADS, Competitors, load_model, session, settle, stats  # noqa: E402


class Collector:
    """Time Python's cyclic collector spends, accumulated by gc.callbacks."""

    def __init__(self) -> None:
        self.seconds, self.count, self._start = 0.0, 0, 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.count += 1


class RunQueueWait:
    """Nanoseconds every thread of this process has waited on a run queue (schedstat's run_delay), per thread,
    read through descriptors kept open (pread at 0 regenerates the line)."""

    def __init__(self) -> None:
        self.me = os.open(f"/proc/self/task/{_gettid()}/schedstat", os.O_RDONLY)
        self.others: list[int] = []

    def rescan(self) -> None:
        """Open every other thread alive now (helpers, pools and the loader start lazily)."""
        for fd in self.others:
            os.close(fd)
        mine = _gettid()
        tids = [tid for tid in os.listdir("/proc/self/task") if int(tid) != mine]
        self.others = [os.open(f"/proc/self/task/{tid}/schedstat", os.O_RDONLY) for tid in tids]
        self.names = []
        for tid in tids:
            try:
                self.names.append(f"{tid}:" + Path(f"/proc/self/task/{tid}/comm").read_text().strip())
            except OSError:
                self.names.append(tid)

    def per_thread_cpu(self) -> dict[str, int]:
        return {name: self._read(fd)[0] for name, fd in zip(self.names, self.others)}

    @staticmethod
    def _read(fd: int) -> tuple[int, int]:
        try:
            fields = os.pread(fd, 128, 0).split()
            return int(fields[0]), int(fields[1])  # on-CPU ns, run-queue wait ns
        except (OSError, IndexError):  # a thread that ended
            return 0, 0

    def sample(self) -> tuple[int, int, int, int]:
        own_cpu, own_wait = self._read(self.me)
        other_cpu = other_wait = 0
        for fd in self.others:
            cpu, wait = self._read(fd)
            other_cpu += cpu
            other_wait += wait
        return own_cpu, own_wait, other_cpu, other_wait


def _gettid() -> int:
    return getattr(os, "gettid", lambda: int(os.readlink("/proc/thread-self").rsplit("/", 1)[1]))()


def timed(run, count: int, queue: RunQueueWait, collector: Collector) -> list[dict]:
    rows = []
    for _ in range(count):
        usage = resource.getrusage(resource.RUSAGE_THREAD)
        gc_before, gc_count = collector.seconds, collector.count
        before = queue.sample()
        start, start_cpu = time.perf_counter(), time.thread_time()
        run()
        wall, cpu = time.perf_counter() - start, time.thread_time() - start_cpu
        after = queue.sample()
        done = resource.getrusage(resource.RUSAGE_THREAD)
        rows.append({"wall": wall, "cpu": cpu, "wait": (after[1] - before[1]) * 1e-9,
                     "others_cpu": (after[2] - before[2]) * 1e-9, "others_wait": (after[3] - before[3]) * 1e-9,
                     "gc": collector.seconds - gc_before, "gcs": collector.count - gc_count,
                     "minflt": done.ru_minflt - usage.ru_minflt, "majflt": done.ru_majflt - usage.ru_majflt,
                     "nivcsw": done.ru_nivcsw - usage.ru_nivcsw, "nvcsw": done.ru_nvcsw - usage.ru_nvcsw})
    return rows


def explain(row: dict, after_preemption: bool = False) -> str:
    """The largest part of a slow call's wall time; own CPU right after a preempted call is told apart: the
    process that ran meanwhile emptied the caches the call's weights and buffers were in."""
    parts = {"own run-queue wait": row["wait"], "collector": row["gc"], "own CPU": row["cpu"] - row["gc"],
             "blocked/other threads": row["wall"] - row["cpu"] - row["wait"]}
    why = max(parts, key=parts.get)
    return why + " right after a preempted call" if why == "own CPU" and after_preemption else why


def preempted(row: dict) -> bool:
    """Whether the call lost its CPU to another process while it ran (an involuntary switch, run-queue wait)."""
    return row["nivcsw"] > 0 or row["wait"] > PREEMPTED_WAIT


PREEMPTED_WAIT = 10e-6  # seconds of run-queue wait that count as a preemption (the counter's own jitter is below)


def spread(values: list[float]) -> float:
    """zoo_bench's spread: (p90 - p10) / median."""
    return stats(values)["spread"] if values else float("nan")


def spreads(rows: list[dict]) -> dict:
    """The per-call spread of the wall time and of the calling thread's CPU time, and the wall time's over the
    calls the host left alone: neither preempted nor right after a preempted one (whose caches the other
    process emptied). Where that last one misses too, the work itself varied; where only the first does, the
    calls waited for a CPU."""
    alone = [row for i, row in enumerate(rows) if not preempted(row) and not (i and preempted(rows[i - 1]))]
    return {"wall": spread([r["wall"] for r in rows]), "cpu": spread([r["cpu"] for r in rows]),
            "wall_left_alone": spread([r["wall"] for r in alone]), "left_alone": len(alone)}


def by_position(rows: list[dict], block: int) -> dict:
    """The calls by their position in their block (rows in blocks of ``block`` calls, in order): each position's
    median CPU time, and its excess over the median of the settled calls (zoo_bench.SETTLED_FROM on), in
    microseconds: what the first calls after a block's pause pay to refill the caches and predictors that other
    processes emptied meanwhile, an absolute cost that weighs more on a shorter call; and the wall time's spread
    of the settled calls."""
    positions = [[r["cpu"] for r in rows[i::block]] for i in range(min(block, len(rows)))]
    settled = [r for i, r in enumerate(rows) if i % block >= SETTLED_FROM]
    base = statistics.median(r["cpu"] for r in settled) if settled else math.nan
    return {"cpu_us": [round(statistics.median(p) * 1e6, 1) for p in positions],
            "excess_us": [round((statistics.median(p) - base) * 1e6, 1) for p in positions],
            "settled_wall_spread": spread([r["wall"] for r in settled])}


def summarize(rows: list[dict], quiet_median: float, block: int = 0) -> dict:
    walls = [r["wall"] for r in rows]
    med = statistics.median(walls)
    slow = sorted(rows, key=lambda r: r["wall"], reverse=True)[:5]
    over = [r for r in rows if r["wall"] > 3 * quiet_median]
    after = {id(row) for previous, row in zip(rows, rows[1:]) if preempted(previous)}
    whys = [explain(r, id(r) in after) for r in over]
    cpus = sorted(r["cpu"] for r in rows)
    return {"n": len(rows), "median_ms": med * 1e3, "spread": spreads(rows),
            "preempted_calls": sum(map(preempted, rows)), "over_3x_preempted": sum(map(preempted, over)),
            "cpu_ms": [round(cpus[len(cpus) // 2] * 1e3, 3), round(cpus[int(0.9 * len(cpus))] * 1e3, 3),
                       round(cpus[-1] * 1e3, 3)], "max_over_quiet": max(walls) / quiet_median,
            "over_3x": len(over), "gc_calls": sum(r["gcs"] > 0 for r in rows),
            "faults_calls": sum(r["minflt"] + r["majflt"] > 0 for r in rows),
            "over_3x_why": {why: whys.count(why) for why in sorted(set(whys))},
            "slowest": [{k: (round(v * 1e3, 3) if isinstance(v, float) else v) for k, v in r.items()}
                        for r in slow], **({"positions": by_position(rows, block)} if block else {})}


def in_rounds(sessions: dict, feed: dict, count: int, block: int, queue: RunQueueWait, collector: Collector,
              pause) -> tuple[dict, dict]:
    """Blocks of ``block`` timed calls, the sessions taking turns (order rotating), ``pause()`` and one untimed
    call before each; returns each session's rows and the CPU time each other thread used inside its blocks."""
    rows: dict = {key: [] for key in sessions}
    threads_cpu: dict = {}
    for round_ in range(count // block):
        keys = list(sessions)
        for key in keys[round_ % 2:] + keys[:round_ % 2]:
            sess = sessions[key]
            pause()
            sess.run(None, feed)
            before = queue.per_thread_cpu()
            rows[key] += timed(lambda s=sess: s.run(None, feed), block, queue, collector)
            after = queue.per_thread_cpu()
            spent = threads_cpu.setdefault(key, {})
            for thread in after:
                spent[thread] = spent.get(thread, 0) + after[thread] - before.get(thread, 0)
    return rows, threads_cpu


def probe(zoo: Path, name: str, labels: list[str], busy: int, count: int, block: int, settled: bool,
          call: str | None = None) -> dict:
    from zoo_feeds import make_feeds

    os.environ["ONNX_RUNTIME_COMPILE_IN_BACKGROUND"] = "0"
    model = load_model(zoo, name)
    call = call or next(iter(model["calls"]))
    if call not in model["calls"]:
        raise SystemExit(f"{name} has no call {call!r}: it has {', '.join(model['calls'])}")
    spec = model["calls"][call]
    feed = make_feeds(spec)
    path = str(zoo / model["file"])
    sessions = {(rt, label): session(rt, path, THREADS[label]) for label in labels for rt in ("ours", "ort")}
    for sess in sessions.values():
        for _ in range(5):
            sess.run(None, feed)
    collector, queue = Collector(), RunQueueWait()
    queue.rescan()
    out: dict = {"model": name, "call": call}
    for condition in ("quiet", "busy") if busy else ("quiet",):
        competitors = Competitors(busy) if condition == "busy" else None
        if competitors:
            competitors.__enter__()
        try:
            rows, threads_cpu = in_rounds(sessions, feed, count, block, queue, collector,
                                          (lambda: settle(0.02)) if settled else (lambda: time.sleep(0.02)))
        finally:
            if competitors:
                competitors.__exit__()
        for (rt, label), got in rows.items():
            quiet = out.get(f"quiet/{label}/{rt}", {}).get("median_ms")
            quiet = quiet * 1e-3 if quiet else statistics.median(r["wall"] for r in got)
            out[f"{condition}/{label}/{rt}"] = summarize(got, quiet, block)
            spent = threads_cpu[rt, label]
            out[f"{condition}/{label}/{rt}"]["other_threads_ms"] = {
                name: round(ns * 1e-6, 2) for name, ns in spent.items() if ns > 0}
    out["load"] = os.getloadavg()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo", type=Path, default=DEFAULT_ZOO)
    parser.add_argument("--models", required=True, help="comma-separated zoo names")
    parser.add_argument("--threads", default="1,default")
    parser.add_argument("--busy", type=int, default=1)
    parser.add_argument("--count", type=int, default=400, help="timed calls per session and condition")
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--call", help="the manifest call to time (a decoder's decode; default: its first)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-settle", action="store_true",
                        help="only the 20 ms pause before a block, not zoo_bench's wait for the other pools")
    args = parser.parse_args(argv)
    labels = [label for label in THREADS if label in args.threads.split(",")]
    results = []
    for name in args.models.split(","):
        result = probe(args.zoo.resolve(), name, labels, args.busy, args.count, args.block,
                       not args.no_settle, args.call)
        results.append(result)
        for key, s in result.items():
            if isinstance(s, dict):
                print(f"{name} {key}: median {s['median_ms']:.3f} ms, max/quiet {s['max_over_quiet']:.1f}, "
                      f">3x {s['over_3x']} {s['over_3x_why']}, calls with gc {s['gc_calls']}, "
                      f"with faults {s['faults_calls']}", flush=True)
                print("     other threads' CPU in its blocks (ms):", s["other_threads_ms"],
                      "; CPU-time p50/p90/max (ms):", s["cpu_ms"])
                sp = s["spread"]
                print(f"     preempted {s['preempted_calls']} of {s['n']} calls ({s['over_3x_preempted']} of the "
                      f"{s['over_3x']} >3x); spread per call: wall {sp['wall']:.0%}, CPU {sp['cpu']:.0%}, wall over "
                      f"the {sp['left_alone']} calls the host left alone {sp['wall_left_alone']:.0%}")
                at = s["positions"]
                print(f"     by block position, CPU us: {at['cpu_us']}; over the settled median: {at['excess_us']}; "
                      f"wall spread of the calls from position {SETTLED_FROM}: {at['settled_wall_spread']:.0%}")
                if s["max_over_quiet"] > 3:
                    for row in s["slowest"][:3]:
                        print("    ", row)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
