"""A job's worker CPU (Summary.worker_cpu): from a new worker's start, from a pooled worker's first shard of the job."""

from __future__ import annotations

from onnx_runtime.batch import Summary
from onnx_runtime.batch.job import process_shard
from onnx_runtime.batch.sources import open_source


def _result(worker, before, after):
    return {"worker": worker, "process_cpu_before": before, "process_cpu_seconds": after}


def test_a_new_worker_counts_from_its_start_and_a_kept_one_from_its_first_shard():
    summary = Summary()
    for result in (_result("h:1", 0.0, 2.0), _result("h:1", 2.0, 3.0),  # new: imports and session before its first
                   _result("h:2", 9.0, 9.5), _result("h:2", 10.0, 10.25), _result("h:2", 9.5, 10.0)):  # kept
        summary.count_worker(result)
    assert summary.worker_cpu == {"h:1": 3.0, "h:2": 1.25}
    assert summary.worker_cpu_seconds == 4.25


def test_only_a_processs_first_shard_counts_from_the_process_start(mlp, parquet_data, tmp_path, monkeypatch):
    from onnx_runtime.batch import job as job_module

    monkeypatch.setattr(job_module, "_SHARDS_HERE", [0])
    source = open_source(parquet_data)
    job = {"source": source, "output": str(tmp_path), "id_column": None,
           "predictor": dict(model=mlp, intra_op_threads=1, keep_columns=[], errors="record")}
    first, second = (process_shard(job, shard) for shard in source.shards(100)[:2])
    assert first["process_cpu_before"] == 0.0
    assert 0.0 < second["process_cpu_before"] <= second["process_cpu_seconds"]
    assert second["process_cpu_before"] >= first["process_cpu_seconds"]


def test_a_worker_started_before_the_job_counts_from_count_from_here(mlp, parquet_data, tmp_path, monkeypatch):
    from onnx_runtime.batch import job as job_module

    monkeypatch.setattr(job_module, "_SHARDS_HERE", [0])
    monkeypatch.setattr(job_module, "_STARTED_CPU", [0.0])
    job_module.count_from_here()
    mark = job_module._STARTED_CPU[0]  # noqa: SLF001
    source = open_source(parquet_data)
    job = {"source": source, "output": str(tmp_path), "id_column": None,
           "predictor": dict(model=mlp, intra_op_threads=1, keep_columns=[], errors="record")}
    first = process_shard(job, source.shards(100)[0])
    assert 0.0 < mark == first["process_cpu_before"] <= first["process_cpu_seconds"]
