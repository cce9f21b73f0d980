"""Batch inference over data sets: a predictor for Ray Data and Dask, and jobs over Parquet, NumPy and images.

    from onnx_runtime.batch import Predictor
    ds.map_batches(Predictor, fn_constructor_kwargs={"model": "model.onnx"}, concurrency=2, batch_size=64)
    ddf.map_partitions(Predictor("model.onnx"), meta=...)

``onnx-runtime batch MODEL --input DATA --output OUT`` runs :func:`run_job` (docs/batch.md).
"""

from .engines import ray_runtime_env, ray_worker_setup
from .job import read_predictions
from .predictor import Predictor, check_providers, sessions_here
from .runner import Summary, run_job
from .sizing import plan_workers, usable_cpus, worker_threads

__all__ = ["Predictor", "Summary", "check_providers", "plan_workers", "ray_runtime_env", "ray_worker_setup",
           "read_predictions", "run_job", "sessions_here", "usable_cpus", "worker_threads"]
