"""Batch throughput: one model over one Parquet data set as a single process, on each engine, and with
onnxruntime wrapped the same way, interleaved over rounds (medians).

    python benchmarks/batch_bench.py [--model M.onnx] [--rows 4000] [--shard-rows 250] [--rounds 2]

Every configuration does the same work per shard (read its row group, predict, write its part file:
onnx_runtime.batch.job.process_shard). The single process runs the shards in a loop in this process, at each
thread count up to the CPUs, and the best is the reference; the engines run with workers x threads = CPUs
(onnx_runtime.batch.plan_workers). Ray and Dask clusters are started before the timed runs (a cluster outlives
a job); the engines' worker start-up is inside the time. Default model: the zoo's resnet.dynamo.fp32
(scripts/build_zoo.sh), 3x64x64 images.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

ZOO = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".models", "zoo")


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


def single_process(model, data, out, shard_rows, threads, runtime) -> float:
    from onnx_runtime.batch.job import process_shard
    from onnx_runtime.batch.sources import open_source

    source = open_source(data)
    os.makedirs(out)
    job = {"source": source, "output": out, "id_column": None,
           "predictor": dict(model=model, intra_op_threads=threads, keep_columns=[], errors="record", runtime=runtime)}
    start = time.perf_counter()
    rows = sum(process_shard(job, shard)["rows"] for shard in source.shards(shard_rows))
    rate = rows / (time.perf_counter() - start)
    return rate, rate


def engine_run(engine, model, data, out, shard_rows, workers, threads, runtime, address) -> float:
    from onnx_runtime.batch import run_job

    summary = run_job(model, data, out, engine=engine, workers=workers, threads=threads, shard_rows=shard_rows,
                      address=address, progress=False, runtime=runtime)
    assert summary.processed_rows == summary.rows and not summary.failures, summary.as_dict()
    print(f"    start-up (to the first shard) {summary.first_shard_seconds:.1f} s, after it "
          f"{summary.steady_rows_per_second:.1f} rows/s", flush=True)
    return summary.rows_per_second, summary.steady_rows_per_second


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=os.path.join(ZOO, "resnet.dynamo.fp32.onnx"))
    parser.add_argument("--rows", type=int, default=4000)
    parser.add_argument("--shard-rows", type=int, default=250)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--engines", default="local,ray,dask")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.model):
        raise SystemExit(f"batch_bench: no model {args.model}; build the zoo (scripts/build_zoo.sh) or pass --model")
    from onnx_runtime.batch import plan_workers, usable_cpus

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
            ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
            print(f"ray.init: {time.perf_counter() - start:.1f} s (not in the timed runs)")
        if "dask" in engines:
            from distributed import LocalCluster

            start = time.perf_counter()
            cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None)
            addresses["dask"] = cluster.scheduler_address
            print(f"dask LocalCluster: {time.perf_counter() - start:.1f} s (not in the timed runs)")
        configs = [(f"single process, {t} threads", None, t) for t in range(1, cpus + 1)]
        configs += [(f"{e}, {workers} workers x {threads} threads", e, threads) for e in engines]
        results: dict = {}
        for round_ in range(args.rounds):
            for runtime in ("onnx_runtime", "onnxruntime"):
                for label, engine, t in configs:
                    out = os.path.join(folder, f"out-{round_}-{runtime}-{len(results)}")
                    if engine is None:
                        rate, steady = single_process(args.model, data, out, args.shard_rows, t, runtime)
                    else:
                        rate, steady = engine_run(engine, args.model, data, out, args.shard_rows, workers, t, runtime,
                                          addresses.get(engine))
                    shutil.rmtree(out, ignore_errors=True)
                    results.setdefault((runtime, label), []).append(rate)
                    results.setdefault((runtime, label, "steady"), []).append(steady)
                    print(f"round {round_ + 1} {runtime:<13} {label:<32} {rate:9.1f} rows/s", flush=True)
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
    print(f"\nmodel {os.path.basename(args.model)}, {args.rows} rows, shards of {args.shard_rows}, {cpus} CPUs, "
          f"medians of {args.rounds} rounds (rows/s, wall clock)")
    for runtime in ("onnx_runtime", "onnxruntime"):
        best = max(median[(runtime, label)] for label, engine, _ in configs if engine is None)
        print(f"{runtime}: best single process {best:.1f} rows/s")
        for label, engine, _ in configs:
            if engine is not None:
                rate, steady = median[(runtime, label)], median[(runtime, label, "steady")]
                print(f"  {label:<32} {rate:9.1f} rows/s = {rate / best:.2f} x the best single process; after "
                      f"start-up {steady:9.1f} rows/s = {steady / best:.2f} x")
    print("onnx_runtime / onnxruntime, same configuration:")
    for label, _, _ in configs:
        print(f"  {label:<32} {median[('onnx_runtime', label)] / median[('onnxruntime', label)]:.2f}")


if __name__ == "__main__":
    sys.exit(main())
