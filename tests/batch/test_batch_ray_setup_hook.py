"""Ray's worker setup hook (onnx_runtime.batch.engines.ray_worker_setup, through ray_runtime_env): a cluster
started with it imports numba and the CPU provider's kernel modules in each worker before its first task, a
batch job on it gives the single process's results, and the hook falls back cleanly: a module that does not
import is skipped (Ray would refuse a worker whose hook raised), another hook in the runtime_env is refused by
name."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from batch_helpers import assert_predictions
from onnx_runtime.batch import engines, read_predictions, run_job
from onnx_runtime.errors import InvalidArgumentError


def test_the_hook_skips_what_does_not_import_and_never_raises():
    """In a fresh process (the hook records its run in module state, as a Ray worker's would keep it)."""
    script = ("import sys\n"
              "from onnx_runtime.batch import engines\n"
              "assert engines.ray_setup_state() == (False, [])\n"
              "names = ['onnx_runtime_no_such_module_h5', 'json', 'onnx_runtime.batch.job']\n"
              "skipped = engines.ray_worker_setup(names)\n"
              "assert skipped == ['onnx_runtime_no_such_module_h5'], skipped\n"
              "assert engines.ray_setup_state() == (True, skipped)\n"
              "assert 'json' in sys.modules\n"
              "print('ok')\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_runtime_env_keeps_the_callers_entries_and_refuses_another_hook():
    env = engines.ray_runtime_env({"env_vars": {"A": "1"}})
    assert env == {"env_vars": {"A": "1"}, "worker_process_setup_hook": engines.RAY_SETUP_HOOK}
    assert engines.ray_runtime_env(env) == env  # the same hook again: accepted
    with pytest.raises(InvalidArgumentError, match="ray_worker_setup"):
        engines.ray_runtime_env({"worker_process_setup_hook": "mine.setup"})


def _worker_state():
    from onnx_runtime.batch.engines import ray_setup_state

    return os.getpid(), ray_setup_state(), "numba" in sys.modules, "onnx_runtime_ep_cpu.compiled.gemm" in sys.modules


def test_workers_of_a_hooked_cluster_import_ahead_and_run_a_job(mlp, rows, parquet_data, tmp_path):
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'onnx-runtime[ray]'")
    if ray.is_initialized():
        pytest.skip("another test module's Ray is running")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False,
             runtime_env=engines.ray_runtime_env())
    try:
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is not on the workers' path
        probe = ray.remote(_worker_state).options(num_cpus=1)
        states = ray.get([probe.remote() for _ in range(2)])
        for _, (ran, skipped), numba_loaded, kernels_loaded in states:
            assert ran and skipped == [] and numba_loaded and kernels_loaded, states
        out = tmp_path / "out"
        summary = run_job(mlp, parquet_data, str(out), engine="ray", workers=2, threads=1, shard_rows=50,
                          progress=False)
        assert summary.processed_rows == 600 and summary.failures == [] and summary.failed_shards == []
        assert_predictions(read_predictions(str(out)), rows, list(range(600)))
    finally:
        ray.shutdown()
