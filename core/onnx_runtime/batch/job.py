"""One shard of a batch job, processed in a worker and written whole or not at all.

Every shard's predictions go to ``OUT/part-NNNNNN.parquet`` through a temporary file renamed into place, so a
part file exists only complete, and a shard processed twice (a worker killed after writing, its task retried)
writes the same file again: no row is lost or duplicated.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np

from .predictor import Predictor
from .sources import Shard

_PREDICTORS: dict = {}  # per process: repr(predictor settings) -> Predictor
_SHARDS_HERE = [0]  # shards this process has run, of any job: a pooled worker (Ray, Dask) runs several jobs
_STARTED_CPU = [0.0]  # the process CPU its first shard counts from (count_from_here)


def part_path(output: str, index: int) -> str:
    return os.path.join(output, f"part-{index:06d}.parquet")


def _predictor(job: dict) -> Predictor:
    return prepare_worker(job["predictor"])


def prepare_worker(settings: dict) -> Predictor:
    """This process's predictor for ``settings`` (a job's ``predictor`` entry), its session created and kernels
    loaded at construction: an engine calls it ahead of the shards, while the driver still reads the data set."""
    key = repr(settings)
    if key not in _PREDICTORS:
        _PREDICTORS[key] = Predictor(**settings, prepare=True)
    return _PREDICTORS[key]


def count_from_here() -> None:
    """Count this worker's start-up CPU from now, not from its process's start: for a worker a benchmark started
    before its timed runs (the cluster's own start is not the job's)."""
    _STARTED_CPU[0] = time.process_time()


def process_shard(job: dict, shard: Shard) -> dict:
    """Read, predict and write one shard (in a worker). Returns its rows, failures and times."""
    wall, cpu = time.perf_counter(), time.process_time()
    first_here = _SHARDS_HERE[0] == 0
    _SHARDS_HERE[0] += 1
    try:
        columns, ids, failures = job["source"].read(shard, job["id_column"])
        outputs, row_failures = _predictor(job).predict(columns, len(ids), ids) if ids else ({}, {})
    except Exception as exc:  # a shard that cannot be read or run: reported, left unwritten for a rerun
        return {"index": shard.index, "rows": shard.stop - shard.start, "written": False, "failures": [],
                "error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - wall,
                "first_row": shard.base}
    write_part(job["output"], shard.index, ids, outputs, row_failures, failures)
    # Where the time went, for the engines' accounting (benchmarks/batch_bench.py): this shard's CPU, and the
    # worker's CPU at its start and end, by pid; a process's first shard counts from the process's start
    # (imports and session creation), a later one's from itself (a worker kept from an earlier job).
    return {"index": shard.index, "rows": len(ids) + len(failures), "written": True,
            "failures": failures + [(ids[i], message) for i, message in sorted(row_failures.items())],
            "error": None, "seconds": time.perf_counter() - wall, "cpu_seconds": time.process_time() - cpu,
            "worker": f"{socket.gethostname()}:{os.getpid()}", "process_cpu_seconds": time.process_time(),
            "process_cpu_before": _STARTED_CPU[0] if first_here else cpu,
            "started": time.time() - (time.perf_counter() - wall)}


def _flat(value: np.ndarray):
    """A flat numeric array as Arrow over the same memory: ``pa.array`` imports pandas (checking for its types),
    which is a third of a new worker's first shard."""
    import pyarrow as pa

    if value.dtype.kind in "iuf" and value.dtype.isnative:
        value = np.ascontiguousarray(value.reshape(-1))
        return pa.Array.from_buffers(pa.from_numpy_dtype(value.dtype), len(value), [None, pa.py_buffer(value)])
    return pa.array(value.reshape(-1))


def _arrow_column(value, extra: int):
    import pyarrow as pa

    if isinstance(value, np.ndarray) and value.dtype != object and not extra:
        if value.ndim == 1:
            return _flat(value)
        if value.ndim == 2:  # one vector per row: a fixed-size list, which pandas and every reader take
            return pa.FixedSizeListArray.from_arrays(_flat(value), value.shape[1])
        return pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(value))
    rows = [None if v is None else np.asarray(v).tolist() for v in value]
    return pa.array(rows + [None] * extra)


def write_part(output: str, index: int, ids: list, outputs: dict, row_failures: dict, read_failures: list) -> None:
    """The part file of shard ``index``, written to a temporary name and renamed into place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    extra = len(read_failures)
    row_ids = list(ids) + [row_id for row_id, _ in read_failures]
    plain = all(type(i) is int for i in row_ids) and row_ids and -(1 << 63) <= min(row_ids) and max(row_ids) < 1 << 63
    columns = {"row_id": _flat(np.array(row_ids, dtype=np.int64)) if plain else pa.array(row_ids)}
    for name, value in outputs.items():
        columns[name] = _arrow_column(value, extra)
    errors = [row_failures.get(i) for i in range(len(ids))] + [message for _, message in read_failures]
    columns["error"] = pa.array(errors, type=pa.string()) if any(errors) else pa.nulls(len(errors), pa.string())
    path = part_path(output, index)
    temporary = os.path.join(output, f".part-{index:06d}.{os.getpid()}.tmp")
    pq.write_table(pa.Table.from_arrays(list(columns.values()), names=list(columns)), temporary)
    os.replace(temporary, path)


def read_predictions(output: str):
    """Every part of a finished (or partial) job as one pyarrow Table, in shard order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts = sorted(f for f in os.listdir(output) if f.startswith("part-") and f.endswith(".parquet"))
    return pa.concat_tables([pq.read_table(os.path.join(output, f)) for f in parts]) if parts else pa.table({})
