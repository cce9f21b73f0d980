"""Batch throughput: one model over one Parquet data set as a single process, on each engine, and with
onnxruntime wrapped the same way, interleaved over rounds (medians): each configuration runs both runtimes back to
back, the first of the pair alternating by round, so that their ratio sees the same load on a shared host.

    python benchmarks/batch_bench.py [--model M.onnx] [--rows 16000] [--shard-rows 250] [--batch-size N] [--rounds 2]

Every configuration does the same work per shard (read its row group, predict, write its part file:
onnx_runtime.batch.job.process_shard). A single process runs the shards in a loop at each thread count up to the
CPUs, twice: in a fresh process (imports and session creation included, as a user runs it) and in this process,
where one untimed shard per runtime and thread count has made the sessions and loaded the kernels first. The
engines run with workers x threads = CPUs (onnx_runtime.batch.plan_workers). Ray and Dask clusters are started
before the timed runs (a cluster outlives a job), Ray's with its worker processes started, the batch job's
shared modules (pyarrow, onnx_runtime.batch.job) imported in them and the job's runtime-independent work done
once (two shards read, a part written: pyarrow's first use in a process), so that neither runtime's first run pays
for the other's; each runtime's own imports and session creation are inside the time. Their worker
processes outlive a job too (the Ray engine runs tasks on Ray's worker pool), so the first round's engine runs
create the workers' sessions and later rounds find them made: each engine's ratio to the same round's best warm
single process is printed per round as well as the medians. Default model: the zoo's resnet.dynamo.fp32
(scripts/build_zoo.sh), 3x64x64 images.

On a loaded host the wall clock says little, so each configuration also reports its CPU time: the fresh single
process's (the child's rusage), the in-process loop's (process_time), and for an engine the driver's plus every
worker's since it started (process_time at its last shard: imports, session creation and every shard; forked
local workers count from the fork, their forkserver's imports are not in it). Rows per CPU-second compare the
work each configuration does per row, start-up included; on an idle host an engine's rows/s approach its
workers x its rows per CPU-second when its workers stay busy.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".models", "zoo")
RUNTIMES = ("onnx_runtime", "onnxruntime")


def make_data(model: str, rows: int, shard_rows: int, folder: str) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from onnx_runtime.batch.runner import _model_inputs

    (name, shape), = _model_inputs(model)
    per_row = shape[1:]
    if not all(isinstance(d, int) and d > 0 for d in per_row):
        raise SystemExit(f"batch_bench: the model's input {name} needs a static per-row shape, has {shape}")
    size = int(np.prod(per_row))
    values = np.random.default_rng(0).standard_normal((rows, size)).astype(np.float32)
    path = os.path.join(folder, "data.parquet")
    column = pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), size)
    pq.write_table(pa.table({name: column}), path, row_group_size=shard_rows)
    return path


SINGLE = r"""
import os, sys, time
from onnx_runtime.batch.job import process_shard
from onnx_runtime.batch.sources import open_source
model, data, out, shard_rows, threads, runtime, batch_size = sys.argv[1:8]
source = open_source(data)
os.makedirs(out)
job = {"source": source, "output": out, "id_column": None,
       "predictor": dict(model=model, intra_op_threads=int(threads), keep_columns=[], errors="record", runtime=runtime,
                         batch_size=int(batch_size) or None)}
rows = sum(process_shard(job, shard)["rows"] for shard in source.shards(int(shard_rows)))
print(rows)
"""


def fresh_single_process(model, data, out, shard_rows, threads, runtime, batch_size) -> tuple[float, float, float]:
    """``(rows/s, rows/s, CPU seconds)`` of the shard loop in a new process: interpreter start, imports, session
    creation and every shard, as one process over the data set runs."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", SINGLE, model, data, out, str(shard_rows), str(threads), runtime,
                           str(batch_size or 0)],
                          capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"batch_bench: the single process failed:\n{done.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rows = int(done.stdout.split()[-1])
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return rows / seconds, rows / seconds, cpu


def single_process(model, data, out, shard_rows, threads, runtime, batch_size) -> tuple[float, float, float]:
    from onnx_runtime.batch.job import process_shard
    from onnx_runtime.batch.sources import open_source

    source = open_source(data)
    os.makedirs(out)
    job = {"source": source, "output": out, "id_column": None,
           "predictor": dict(model=model, intra_op_threads=threads, keep_columns=[], errors="record", runtime=runtime,
                             batch_size=batch_size)}
    start, cpu = time.perf_counter(), time.process_time()
    rows = sum(process_shard(job, shard)["rows"] for shard in source.shards(shard_rows))
    rate = rows / (time.perf_counter() - start)
    return rate, rate, time.process_time() - cpu


def warm_up(model, data, shard_rows, cpus, batch_size) -> None:
    """Create each runtime's in-process sessions (one per thread count) and run one shard through them, untimed,
    so the warm single process is warm in every round: the first round would otherwise pay session creation and
    kernel loading, which a fresh process measures already."""
    from onnx_runtime.batch.predictor import Predictor
    from onnx_runtime.batch.sources import open_source

    source = open_source(data)
    shard = source.shards(shard_rows)[0]
    columns, ids, _ = source.read(shard, None)
    for runtime in ("onnx_runtime", "onnxruntime"):
        for threads in range(1, cpus + 1):
            predictor = Predictor(model, intra_op_threads=threads, keep_columns=[], errors="record", runtime=runtime,
                                  batch_size=batch_size)
            predictor.predict(columns, len(ids), ids)


def engine_run(engine, model, data, out, shard_rows, workers, threads, runtime, address,
               batch_size) -> tuple[float, float, float]:
    from onnx_runtime.batch import run_job

    cpu, wall = time.process_time(), time.perf_counter()
    summary = run_job(model, data, out, engine=engine, workers=workers, threads=threads, shard_rows=shard_rows,
                      batch_size=batch_size, address=address, progress=False, runtime=runtime)
    driver, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert summary.processed_rows == summary.rows and not summary.failures, summary.as_dict()
    # from the call, not the summary's start: the driver's reading before it overlaps the workers' preparing
    before_start = max(wall - summary.seconds, 0.0)
    print(f"    start-up (to the first shard, from the call) {before_start + summary.first_shard_seconds:.2f} s, "
          f"after it "
          f"{summary.steady_rows_per_second:.1f} rows/s; CPU: driver {driver:.2f} s, {len(summary.worker_cpu)} workers "
          f"{summary.worker_cpu_seconds:.2f} s of which shards {summary.shard_cpu_seconds:.2f} s", flush=True)
    return summary.processed_rows / wall, summary.steady_rows_per_second, driver + summary.worker_cpu_seconds


def _shared_imports(data: str | None = None, shard_rows: int = 0) -> tuple[int, float]:
    """A Ray worker's start, as a cluster that ran an earlier job has it: Ray and the batch job's own modules
    (the engine's, which either runtime's shards import) loaded, and the job's runtime-independent work done once
    (two shards of ``data`` read and a part file written, to a folder removed after): a fresh worker's first
    reads cost several times its later ones (pyarrow's first use in the process), which the runtime whose job
    runs first on fresh workers would pay alone. Neither onnxruntime nor numba and the CPU provider loaded."""
    import pyarrow.parquet  # noqa: F401
    from onnx_runtime.batch import job

    if data is not None:
        from onnx_runtime.batch.sources import open_source

        source = open_source(data)
        scratch = tempfile.mkdtemp(prefix="batch_bench_warm_")
        try:
            for shard in source.shards(shard_rows)[:2]:
                columns, ids, _ = source.read(shard, None)
                job.write_part(scratch, shard.index, ids, {"y": np.zeros((len(ids), 8), np.float32)}, {}, [])
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    job.count_from_here()  # (the workers' CPU counts from here: the cluster's start is not the job's)
    before = time.process_time()  # (Ray's import, the setup hook's where it has one)
    time.sleep(0.5)  # (held, so that each worker of the pool takes one)
    return os.getpid(), before


def ray_pool_ready(ray, workers: int, threads: int, data: str | None = None,
                   shard_rows: int = 0) -> tuple[int, float]:
    """Start the cluster's worker processes before the timed runs: the first engine run would otherwise pay their
    start (Ray's own import) and the other runtime's first run find them started. With ``data``, each worker also
    does the job's runtime-independent work once (see _shared_imports). Returns how many and their CPU until
    then."""
    task = ray.remote(_shared_imports).options(num_cpus=threads)
    started = dict(ray.get([task.remote(data, shard_rows) for _ in range(workers)]))
    return len(started), sum(started.values())


def run_config(engine, args, data, out, workers, threads, runtime, addresses) -> tuple[float, float, float]:
    """``(rows/s, rows/s after start-up, CPU seconds)`` of one configuration."""
    if engine == "ray":
        import ray

        # (untimed) the workers' CPU counts from here: an idle Ray worker spends ~1% of a CPU, which the rounds'
        # other configurations before this run would add to a first job's start-up
        ray_pool_ready(ray, workers, threads, data, args.shard_rows)
    if engine is None:
        return single_process(args.model, data, out, args.shard_rows, threads, runtime, args.batch_size)
    if engine == "fresh":
        return fresh_single_process(args.model, data, out, args.shard_rows, threads, runtime, args.batch_size)
    return engine_run(engine, args.model, data, out, args.shard_rows, workers, threads, runtime, addresses.get(engine),
                      args.batch_size)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(ZOO, "resnet.dynamo.fp32.onnx"))
    parser.add_argument("--rows", type=int, default=16000)
    parser.add_argument("--shard-rows", type=int, default=250)
    parser.add_argument("--batch-size", type=int, default=None,
                        help="rows per model run (default: run_job's, the model's static batch or the shard's rows "
                             "in equal runs of at most 32)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", default="local,ray,dask")
    parser.add_argument("--ray-setup-hook", action="store_true",
                        help="start Ray with onnx_runtime.batch.ray_runtime_env(): its workers import numba and the "
                             "CPU provider's kernel modules as they start, before the timed runs (their CPU is "
                             "printed, not counted in the runs)")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.model):
        raise SystemExit(f"batch_bench: no model {args.model}; build the zoo (scripts/build_zoo.sh) or pass --model")
    from onnx_runtime.batch import plan_workers, usable_cpus
    from onnx_runtime.batch.sizing import even_micro_batch

    if args.batch_size is None:  # the engines' (run_job's), for the single processes too: the same runs per shard
        args.batch_size = even_micro_batch(args.shard_rows)
    cpus = usable_cpus()
    workers, threads = plan_workers(cpus=cpus)
    engines = [e for e in args.engines.split(",") if e]
    folder = tempfile.mkdtemp(prefix="batch_bench_")
    addresses = {}
    cluster = None
    try:
        data = make_data(args.model, args.rows, args.shard_rows, folder)
        if "ray" in engines:
            import ray

            start = time.perf_counter()
            from onnx_runtime.batch import ray_runtime_env

            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False,
                     runtime_env=ray_runtime_env() if args.ray_setup_hook else None)
            up, setup_cpu = ray_pool_ready(ray, workers, threads, data, args.shard_rows)
            print(f"ray.init: {time.perf_counter() - start:.1f} s, its {up} workers up after "
                  f"{time.perf_counter() - start:.1f} s (not in the timed runs); their CPU before the job "
                  f"{setup_cpu:.2f} s{' (with the setup hook)' if args.ray_setup_hook else ''}", flush=True)
        if "dask" in engines:
            from distributed import LocalCluster

            start = time.perf_counter()
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None)
            addresses["dask"] = cluster.scheduler_address
            print(f"dask LocalCluster: {time.perf_counter() - start:.1f} s (not in the timed runs)")
        warm_up(args.model, data, args.shard_rows, cpus, args.batch_size)
        configs = [(f"fresh single process, {t} threads", "fresh", t) for t in range(1, cpus + 1)]
        configs += [(f"warm single process, {t} threads", None, t) for t in range(1, cpus + 1)]
        configs += [(f"{e}, {workers} workers x {threads} threads", e, threads) for e in engines]
        results: dict = {}
        for round_ in range(args.rounds):
            for label, engine, t in configs:
                # both runtimes back to back, the first of the pair alternating by round: on a shared host the
                # load moves within a round, and their ratio should see the same load
                for runtime in RUNTIMES if round_ % 2 == 0 else RUNTIMES[::-1]:
                    out = os.path.join(folder, f"out-{round_}-{runtime}-{len(results)}")
                    rate, steady, cpu = run_config(engine, args, data, out, workers, t, runtime, addresses)
                    shutil.rmtree(out, ignore_errors=True)
                    results.setdefault((runtime, label), []).append(rate)
                    results.setdefault((runtime, label, "steady"), []).append(steady)
                    results.setdefault((runtime, label, "cpu"), []).append(cpu)
                    print(f"round {round_ + 1} {runtime:<13} {label:<36} {rate:9.1f} rows/s, CPU {cpu:6.2f} s = "
                          f"{args.rows / cpu:8.1f} rows per CPU-second (load {os.getloadavg()[0]:.1f})", flush=True)
        report(results, configs, cpus, args)
    finally:
        if cluster is not None:
            cluster.close()
        if "ray" in engines and "ray" in sys.modules:
            sys.modules["ray"].shutdown()
        shutil.rmtree(folder, ignore_errors=True)
    return 0


def report(results, configs, cpus, args) -> None:
    median = {key: statistics.median(values) for key, values in results.items()}
    print(f"\nmodel {os.path.basename(args.model)}, {args.rows} rows, shards of {args.shard_rows}, "
          f"{args.batch_size} rows per run, {cpus} CPUs, "
          f"medians of {args.rounds} rounds (rows/s: wall clock; rows/CPU-s: CPU time, start-up included)")
    for runtime in ("onnx_runtime", "onnxruntime"):
        for kind in ("fresh", None):
            labels = [label for label, engine, _ in configs if engine == kind]
            best = max(labels, key=lambda label: median[(runtime, label)])
            efficient = max(labels, key=lambda label: args.rows / median[(runtime, label, "cpu")])
            print(f"{runtime}: best {'fresh' if kind else 'warm'} single process {median[(runtime, best)]:.1f} rows/s "
                  f"({best}); most rows per CPU-second {args.rows / median[(runtime, efficient, 'cpu')]:.1f} "
                  f"({efficient})")
        fresh = max(median[(runtime, label)] for label, engine, _ in configs if engine == "fresh")
        warm = max(median[(runtime, label)] for label, engine, _ in configs if engine is None)
        fresh_cpu = min(median[(runtime, label, "cpu")] for label, engine, _ in configs if engine == "fresh")
        for label, engine, _ in configs:
            if engine not in (None, "fresh"):
                rate, steady, cpu = (median[(runtime, label)], median[(runtime, label, "steady")],
                                     median[(runtime, label, "cpu")])
                print(f"  {label:<36} {rate:9.1f} rows/s = {rate / fresh:.2f} x the best fresh single process, "
                      f"{rate / warm:.2f} x the best warm one; after start-up {steady / warm:.2f} x the warm one; "
                      f"CPU {cpu:.2f} s = {cpu / fresh_cpu:.2f} x the fresh single process's least")
    report_rounds(results, configs)
    print("onnx_runtime / onnxruntime, same configuration (rows/s; CPU seconds):")
    for label, _, _ in configs:
        print(f"  {label:<36} {median[('onnx_runtime', label)] / median[('onnxruntime', label)]:.2f}; "
              f"{median[('onnx_runtime', label, 'cpu')] / median[('onnxruntime', label, 'cpu')]:.2f}")



def report_rounds(results, configs) -> None:
    """Each engine's ratios round by round: a first round creates the workers' sessions, later ones find them made,
    and on a shared host the load moves between rounds, so the medians alone hide both."""
    engines = [label for label, engine, _ in configs if engine not in (None, "fresh")]
    for runtime in RUNTIMES:
        for label in engines:
            per_round = [rate / max(results[(runtime, other)][r] for other, kind, _ in configs if kind is None)
                         for r, rate in enumerate(results[(runtime, label)])]
            print(f"{runtime}: {label} / the same round's best warm single process, by round: "
                  f"{', '.join(f'{value:.2f}' for value in per_round)}")
    for label in engines:
        rates = zip(results[("onnx_runtime", label)], results[("onnxruntime", label)])
        cpus = zip(results[("onnx_runtime", label, "cpu")], results[("onnxruntime", label, "cpu")])
        print(f"onnx_runtime / onnxruntime, {label}, by round: rows/s "
              f"{', '.join(f'{ours / theirs:.2f}' for ours, theirs in rates)}; rows per CPU-second "
              f"{', '.join(f'{theirs / ours:.2f}' for ours, theirs in cpus)}")


if __name__ == "__main__":
    sys.exit(main())
