"""The predictor and the batch command on a local Ray cluster (``ray.init(num_cpus=2)``, one per module): Ray
Data's ``map_batches`` as documented, the same results as one process, and killed actors and task workers
whose rows are neither lost nor duplicated."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
from batch_helpers import assert_predictions, mlp_reference
from onnx_runtime.batch import Predictor, read_predictions, run_job

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'onnx-runtime[ray]'")
pytest.importorskip("ray.data", reason="Ray Data is not installed: pip install 'onnx-runtime[ray]'")


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield
    ray.shutdown()


class DiesOnce(Predictor):
    """A predictor whose process exits in its first batch across the cluster (a marker file makes it once)."""

    def __init__(self, marker: str, **kwargs):
        super().__init__(**kwargs)
        self.marker = marker

    def __call__(self, batch):
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return super().__call__(batch)
        os._exit(1)


def test_map_batches_matches_one_process_and_survives_a_killed_actor(cluster, mlp, rows, tmp_path):
    """Ray Data as documented (a callable class, constructor kwargs as plain data); the first batch kills its
    actor's process, which Ray restarts and retries the batch on."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the workers' path
    one_process = Predictor(mlp, intra_op_threads=1)({"x": rows})["y"]
    marker = str(tmp_path / "died")
    dataset = ray.data.from_items([{"id": i, "x": row} for i, row in enumerate(rows)], override_num_blocks=6)
    out = dataset.map_batches(DiesOnce, fn_constructor_kwargs={"marker": marker, "model": mlp, "intra_op_threads": 1},
                              concurrency=2, batch_size=50, num_cpus=1).take_all()
    assert os.path.exists(marker), "no actor died"
    ids = [r["id"] for r in out]
    assert sorted(ids) == list(range(len(rows))), "rows lost or duplicated"
    assert "x" not in out[0]  # the model's input column is not carried to the result
    got = np.stack([r["y"] for r in out])
    np.testing.assert_allclose(got, one_process[ids], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, mlp_reference(rows[ids]), rtol=1e-5, atol=1e-5)


def test_batch_command_on_ray_with_a_killed_worker(cluster, mlp, rows, parquet_data, tmp_path):
    import psutil

    out = tmp_path / "out"
    killed = []

    def kill_one_worker():
        # The first worker seen running a shard, polled from the job's start: the workers load their kernels
        # before the shards, after which the shards finish faster than a wait for the first part file and a
        # scan of the processes (the kill came after the job's end, at load).
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not done.is_set():
            for process in psutil.Process().children(recursive=True):  # this test's Ray only
                try:
                    command = process.cmdline()
                except psutil.Error:  # exited meanwhile
                    continue
                if any("_ray_shard" in part for part in command):  # a worker running a shard (its process title)
                    os.kill(process.pid, signal.SIGKILL)
                    killed.append(sum(f.startswith("part-") for f in os.listdir(out)) if out.is_dir() else 0)
                    return

    done = threading.Event()
    killer = threading.Thread(target=kill_one_worker)
    killer.start()
    try:
        summary = run_job(mlp, parquet_data, str(out), engine="ray", workers=2, threads=1, shard_rows=10,
                          progress=False)
    finally:
        done.set()
        killer.join()
    assert killed and killed[0] < 60, "no Ray worker killed mid-job"
    assert summary.processed_rows == 600 and summary.failures == [] and summary.failed_shards == []
    assert_predictions(read_predictions(str(out)), rows, list(range(600)))


def test_a_second_job_on_the_cluster_runs_on_the_same_workers(cluster, mlp, rows, parquet_data, tmp_path):
    """Shards are Ray tasks on Ray's pooled workers: a second job finds the processes (and their sessions) the
    first one used, and counts their CPU from its own first shard, not from the processes' start."""
    first = run_job(mlp, parquet_data, str(tmp_path / "one"), engine="ray", workers=2, threads=1, shard_rows=50,
                    progress=False)
    second = run_job(mlp, parquet_data, str(tmp_path / "two"), engine="ray", workers=2, threads=1, shard_rows=50,
                     progress=False)
    assert first.processed_rows == second.processed_rows == 600
    kept = set(first.worker_cpu) & set(second.worker_cpu)
    assert kept, f"no worker process kept between jobs: {sorted(first.worker_cpu)} then {sorted(second.worker_cpu)}"
    for worker in kept:
        start, end = second.worker_cpu_span[worker]
        assert 0 < start <= end, (worker, start, end)
    assert 0 < second.shard_cpu_seconds <= second.worker_cpu_seconds
    assert_predictions(read_predictions(str(tmp_path / "two")), rows, list(range(600)))
