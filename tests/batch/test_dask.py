"""The predictor and the batch command on a local Dask distributed cluster (two worker processes, one per
module): ``map_partitions`` as documented, the same results as one process, and a killed worker whose rows
are neither lost nor duplicated."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest
from batch_helpers import assert_predictions, mlp_reference
from onnx_runtime.batch import Predictor, read_predictions, run_job, sessions_here

distributed = pytest.importorskip("distributed", reason="dask.distributed is not installed: "
                                                        "pip install 'onnx-runtime[dask]'")
dd = pytest.importorskip("dask.dataframe", reason="dask.dataframe is not installed: pip install 'onnx-runtime[dask]'")


@pytest.fixture(scope="module")
def client():
    import dask

    with dask.config.set({"dataframe.convert-string": False}), \
            distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                     dashboard_address=None) as cluster, distributed.Client(cluster) as client:
        yield client


def test_map_partitions_matches_one_process(client, mlp, rows):
    import pandas as pd

    one_process = Predictor(mlp, intra_op_threads=1)({"x": rows})["y"]
    frame = pd.DataFrame({"id": np.arange(len(rows)), "x": list(rows)})
    ddf = dd.from_pandas(frame, npartitions=4)
    out = ddf.map_partitions(Predictor(mlp), meta={"id": "int64", "y": "object"}).compute()
    assert list(out["id"]) == list(range(len(rows))) and list(out.columns) == ["id", "y"]
    got = np.stack(out["y"])
    np.testing.assert_allclose(got, one_process, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got, mlp_reference(rows), rtol=1e-5, atol=1e-5)
    # each worker made its session once, with one intra-op thread per Dask task slot
    threads = client.run(lambda: [s.get_session_options().intra_op_num_threads for s in sessions_here()])
    assert all(len(t) <= 1 for t in threads.values()) and sum(map(len, threads.values())) >= 1
    assert all(t == [1] for t in threads.values() if t)


def test_batch_command_on_dask_with_a_killed_worker(client, mlp, rows, parquet_data, tmp_path):
    out = tmp_path / "out"
    killed = []

    def kill_one_worker():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (out.is_dir() and any(f.startswith("part-")
                                                                           for f in os.listdir(out))):
            time.sleep(0.01)
        pids = client.run(os.getpid)
        pid = sorted(pids.values())[0]
        os.kill(pid, signal.SIGKILL)
        killed.append(sum(f.startswith("part-") for f in os.listdir(out)))

    killer = threading.Thread(target=kill_one_worker)
    killer.start()
    summary = run_job(mlp, parquet_data, str(out), engine="dask", workers=2, threads=1, shard_rows=10,
                      address=client.scheduler.address, progress=False)
    killer.join()
    assert killed and killed[0] < 60, "no worker killed mid-job"
    assert summary.processed_rows == 600 and summary.failures == [] and summary.failed_shards == []
    assert_predictions(read_predictions(str(out)), rows, list(range(600)))
