"""``run_job``: a batch job over a data set, its shards run by an engine, resumable, with a summary.

``OUT/_job.json`` records what the part files were computed from; a rerun with the same job skips the shards
whose parts exist, and one with a different job is refused rather than mixed in.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass, field

from ..errors import InvalidArgumentError
from . import engines
from .job import part_path
from .sizing import even_micro_batch, plan_workers
from .sources import open_source


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _model_inputs(model: str) -> list:
    import onnx

    proto = onnx.load(model, load_external_data=False)
    initializers = {t.name for t in proto.graph.initializer}
    inputs = []
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        dims = value.type.tensor_type.shape.dim
        inputs.append((value.name, [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims]))
    return inputs


@dataclass
class Summary:
    rows: int = 0
    shards: int = 0
    skipped_shards: int = 0
    processed_rows: int = 0
    failures: list = field(default_factory=list)  # [row id, message]
    failed_shards: list = field(default_factory=list)  # [shard index, first row, rows, message]
    seconds: float = 0.0
    first_shard_seconds: float = 0.0  # start-up: workers started, sessions created, first shard written
    first_shard_rows: int = 0
    shard_cpu_seconds: float = 0.0  # CPU the shards took in the workers (read, predict, write)
    worker_cpu_span: dict = field(default_factory=dict)  # "host:pid" -> [CPU at its first shard's start, at its last]

    def count_worker(self, result: dict) -> None:
        """A finished shard's worker CPU (job.process_shard's accounting) into ``worker_cpu``."""
        span = self.worker_cpu_span.setdefault(result["worker"], [result["process_cpu_before"], 0.0])
        span[0] = min(span[0], result["process_cpu_before"])
        span[1] = max(span[1], result["process_cpu_seconds"])

    @property
    def worker_cpu(self) -> dict:
        """``"host:pid"`` -> the CPU that worker spent on this job: from its start (a new process: imports and
        session creation) or its first shard of the job (a pooled process that ran an earlier job) to its last."""
        return {worker: end - start for worker, (start, end) in self.worker_cpu_span.items()}

    @property
    def worker_cpu_seconds(self) -> float:
        """CPU the workers spent in all, start-up (imports, session creation) included."""
        return sum(self.worker_cpu.values())

    @property
    def rows_per_second(self) -> float:
        return self.processed_rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def steady_rows_per_second(self) -> float:
        """Throughput after the first shard: the engine's rate once started, start-up excluded."""
        span = self.seconds - self.first_shard_seconds
        return (self.processed_rows - self.first_shard_rows) / span if span > 0 else 0.0

    def as_dict(self) -> dict:
        return {"rows": self.rows, "shards": self.shards, "skipped_shards": self.skipped_shards,
                "processed_rows": self.processed_rows, "seconds": round(self.seconds, 3),
                "rows_per_second": round(self.rows_per_second, 2), "first_shard_seconds": round(
                    self.first_shard_seconds, 3), "steady_rows_per_second": round(self.steady_rows_per_second, 2),
                "shard_cpu_seconds": round(self.shard_cpu_seconds, 3),
                "worker_cpu_seconds": round(self.worker_cpu_seconds, 3), "workers_seen": len(self.worker_cpu),
                "failed_rows": len(self.failures),
                "failures": self.failures, "failed_shards": self.failed_shards}


class Progress:
    """A one-line progress bar on stderr with rows done and rows per second, redrawn at most 5 times a second."""

    def __init__(self, total: int, done: int = 0, stream=None, enabled: bool = True):
        self.total, self.done, self.enabled = max(total, 1), done, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.start, self._start_done, self._drawn = time.perf_counter(), done, 0.0

    def advance(self, rows: int) -> None:
        self.done += rows
        now = time.perf_counter()
        if self.enabled and (now - self._drawn >= 0.2 or self.done >= self.total):
            self._drawn = now
            rate = (self.done - self._start_done) / max(now - self.start, 1e-9)
            filled = min(30, self.done * 30 // self.total)
            self.stream.write(f"\rbatch [{'#' * filled}{'.' * (30 - filled)}] {self.done * 100 // self.total:3d}% "
                              f"{self.done}/{self.total} rows  {rate:,.0f} rows/s")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _prepare_output(output: str, manifest: dict, overwrite: bool) -> None:
    os.makedirs(output, exist_ok=True)
    path = os.path.join(output, "_job.json")
    if os.path.exists(path):
        with open(path) as f:
            previous = json.load(f)
        if previous != manifest:
            if not overwrite:
                changed = sorted(k for k in set(previous) | set(manifest) if previous.get(k) != manifest.get(k))
                raise InvalidArgumentError(
                    f"batch: {output!r} holds the output of a different job (its {', '.join(changed)} differ); "
                    f"resume only with the same model, input and settings, or pass --overwrite or another --output")
            for name in os.listdir(output):
                if name.startswith(("part-", ".part-", "_summary")):
                    os.remove(os.path.join(output, name))
    for name in os.listdir(output):  # temporaries of an interrupted run: their shards are not done
        if name.startswith(".part-") and name.endswith(".tmp"):
            os.remove(os.path.join(output, name))
    with open(path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def _recorded_failures(output: str, index: int) -> list:
    import pyarrow.parquet as pq

    table = pq.read_table(part_path(output, index), columns=["row_id", "error"])
    return [[row_id, error] for row_id, error in zip(table.column("row_id").to_pylist(),
                                                     table.column("error").to_pylist()) if error is not None]


def run_job(model: str, data: str, output: str, *, engine: str = "local", workers: int | None = None,
            threads: int | None = None, shard_rows: int = 1024, batch_size: int | None = None,
            providers=None, id_column: str | None = None, outputs: list | None = None, address: str | None = None,
            retries: int = 3, overwrite: bool = False, progress: bool = True, runtime: str = "onnx_runtime",
            predictor_options: dict | None = None) -> Summary:
    """Predict every row of ``data`` with ``model`` into the folder ``output`` on ``engine`` (local, ray, dask);
    returns the summary, also written to ``output/_summary.json``."""
    if engine not in engines.ENGINES:
        raise InvalidArgumentError(f"batch: engine {engine!r} is not one of {', '.join(engines.ENGINES)}")
    if not os.path.isfile(model):
        raise InvalidArgumentError(f"batch: model {model!r} is not a file")
    workers, threads = plan_workers(workers, threads)
    # (the manifest keeps the batch size as given: a resumed job picks the same one)
    run_rows = even_micro_batch(shard_rows) if batch_size is None else batch_size
    settings = dict(model=os.path.abspath(model), providers=providers, intra_op_threads=threads,
                    batch_size=run_rows, outputs=outputs, keep_columns=[], errors="record", runtime=runtime,
                    **(predictor_options or {}))
    # the workers create their sessions while this process reads the model's inputs, hashes it and opens the data
    preparing = engines.PREPARE[engine](settings, workers, threads, address) if engine in engines.PREPARE else []
    source = open_source(data, _model_inputs(model))
    shards = source.shards(shard_rows)
    manifest = {"model_sha256": _sha256(model), "source": source.describe(), "shard_rows": shard_rows,
                "shards": len(shards), "id_column": id_column, "outputs": outputs, "batch_size": batch_size,
                "runtime": runtime, "predictor_options": predictor_options or {}}
    _prepare_output(output, manifest, overwrite)
    done = {s.index for s in shards if os.path.exists(part_path(output, s.index))}
    summary = Summary(rows=sum(s.stop - s.start for s in shards), shards=len(shards), skipped_shards=len(done))
    for index in sorted(done):
        summary.failures += _recorded_failures(output, index)
    pending = [s for s in shards if s.index not in done]
    job = {"source": source, "output": os.path.abspath(output), "id_column": id_column, "predictor": settings}
    bar = Progress(summary.rows, sum(s.stop - s.start for s in shards if s.index in done), enabled=progress)
    start = time.perf_counter()

    def finished(result: dict) -> None:
        bar.advance(result["rows"])
        if not summary.first_shard_seconds:
            summary.first_shard_seconds, summary.first_shard_rows = time.perf_counter() - start, result["rows"]
        if "worker" in result:
            summary.shard_cpu_seconds += result["cpu_seconds"]
            summary.count_worker(result)
        if result["written"]:
            summary.processed_rows += result["rows"]
            summary.failures += [list(f) for f in result["failures"]]
        else:
            summary.failed_shards.append([result["index"], result["first_row"], result["rows"], result["error"]])

    try:
        engines.ENGINES[engine](job, pending, workers, threads, finished, retries, address)
    finally:
        del preparing  # (the preparing tasks referenced until the job ends)
        bar.close()
        summary.seconds = time.perf_counter() - start
        with open(os.path.join(output, "_summary.json"), "w") as f:
            json.dump(dict(summary.as_dict(), engine=engine, workers=workers, threads=threads), f, indent=1,
                      default=str)
    return summary
