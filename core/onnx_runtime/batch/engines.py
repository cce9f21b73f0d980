"""Engines that run a job's shards: a process pool here, Ray actors, or Dask workers.

Each calls ``finished(result)`` once per shard, in completion order. A worker that dies mid-shard has its
shard run again (the part file is rewritten whole, so nothing is duplicated); after ``retries`` deaths the
job stops with an error rather than retrying forever.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from ..errors import InvalidArgumentError, OnnxRuntimeError
from .job import prepare_worker, process_shard


class WorkerLostError(OnnxRuntimeError):
    """Workers kept dying: the job gave up after its retries."""


class WorkerStartError(WorkerLostError):
    """Local workers exited while starting, before running anything: not retried, since a restart dies the same
    way (most often a script that calls ``run_job`` outside an ``if __name__ == "__main__":`` block)."""


def _worker_started(started) -> None:
    """Pool initializer: runs in each worker once it has imported the parent's ``__main__``, so a pool broken with
    this never set lost its workers while they started."""
    started.set()


def _start_failure(exc: BaseException) -> WorkerStartError:
    import sys

    main = getattr(sys.modules.get("__main__"), "__file__", None)
    where = f"the script {main!r}" if main else "your program"
    return WorkerStartError(
        f"batch: the local engine's worker processes exited while starting, before any shard ran ({exc}). Each "
        f"worker imports {where} as its __main__ module, so a call to run_job at the script's top level runs again "
        f"inside every worker, which multiprocessing refuses; put the call under `if __name__ == \"__main__\":`. "
        f"If it is there already, the workers' own error is printed above this one")


def run_local(job, shards, workers, threads, finished, retries, address) -> None:
    """A pool of ``workers`` processes on this machine; a dead worker breaks the pool, which is rebuilt
    and given the shards that had not finished."""
    if address:
        raise InvalidArgumentError("batch: --address is for --engine ray or dask; the local engine takes none")
    pending = {s.index: s for s in shards}
    restarts = 0
    context = _pool_context()
    started = context.Event()
    while pending:
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_worker_started,
                                 initargs=(started,)) as pool:
            futures = {pool.submit(process_shard, job, s) for s in pending.values()}
            try:
                while futures:
                    done, futures = wait(futures, return_when=FIRST_COMPLETED)
                    for future in done:
                        result = future.result()
                        pending.pop(result["index"], None)
                        finished(result)
            except BrokenProcessPool as exc:
                if not started.is_set():
                    raise _start_failure(exc) from None
                restarts += 1
                if restarts > retries:
                    raise WorkerLostError(
                        f"batch: local workers died {restarts} times ({exc}); {len(pending)} shards left unwritten. "
                        f"Rerun the same command to resume, with fewer --workers if memory ran out") from None


def _pool_context():
    """Workers forked from a server that imported the runtime once (Linux, macOS): a pool rebuilt after a worker
    died, or the next job of this process, starts in milliseconds instead of importing everything again.
    Elsewhere, spawned processes."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(forkserver_preload())
    return context


def forkserver_preload() -> list[str]:
    """What the local engine's forkserver imports once for all its workers: the runtime and the CPU provider, and
    numba with the provider's compiled-kernel, operator and algorithm modules, which a worker would otherwise
    import at its first run (numba's import is most of a worker's start-up after the session's kernels). Only
    imports: nothing here starts a thread or touches a device, so forking after them is safe. Missing ones are
    skipped by the server."""
    import importlib.util
    import pkgutil

    names = ["onnx_runtime.batch.job", "onnx_runtime.session", "onnx_runtime_ep_cpu"]
    for package in ("compiled", "ops", "algorithms"):  # (the operator modules load lazily, on first use)
        try:
            found = importlib.util.find_spec(f"onnx_runtime_ep_cpu.{package}")
        except ModuleNotFoundError:  # no CPU provider installed
            return names
        if found is None or not found.submodule_search_locations:
            continue
        if package == "compiled":
            # numba, and the parts of it that loading a cached kernel imports
            names += ["numba", "numba.np.arrayobj", "numba.cpython.unicode", "numba.cpython.hashing"]
        names += [f"onnx_runtime_ep_cpu.{package}.{module.name}"
                  for module in pkgutil.iter_modules(found.submodule_search_locations)]
    return names


RAY_SETUP_HOOK = "onnx_runtime.batch.engines.ray_worker_setup"
_SETUP_SKIPPED: list = []  # modules this process's setup hook could not import (empty where it ran cleanly)
_SETUP_RAN = [False]


def ray_worker_setup(names: list[str] | None = None) -> list[str]:
    """Ray's ``worker_process_setup_hook`` (:func:`ray_runtime_env`): imports what the local engine's forkserver
    preloads (numba and the CPU provider's kernel modules) as each worker process starts, ahead of its first
    task, so that workers a long-lived cluster started before the job (for other tasks, or a warm-up) begin
    their first shard with only the session to make. Never raises: Ray refuses a worker whose hook fails, so a
    module that does not import is skipped here and reported by the task that needs it. Returns the skipped
    names.

    run_ray does not set it on the cluster it starts itself: Ray prestarts workers only for jobs without a
    runtime_env, so there the first shard would wait for new processes to start and import instead."""
    import importlib

    skipped = []
    for name in forkserver_preload() if names is None else names:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 (the task that imports it reports the real error)
            skipped.append(name)
    _SETUP_SKIPPED[:] = skipped
    _SETUP_RAN[0] = True
    return skipped


def ray_setup_state() -> tuple[bool, list[str]]:
    """``(ran, skipped)``: whether this process ran :func:`ray_worker_setup`, and what it skipped."""
    return _SETUP_RAN[0], list(_SETUP_SKIPPED)


def ray_runtime_env(runtime_env: dict | None = None) -> dict:
    """``runtime_env`` (a ``ray.init`` argument) with :func:`ray_worker_setup` as its worker setup hook:
    ``ray.init(runtime_env=ray_runtime_env())``. A different hook already there is refused (Ray runs one): call
    ray_worker_setup from it instead."""
    env = dict(runtime_env or {})
    hook = env.get("worker_process_setup_hook")
    if hook not in (None, RAY_SETUP_HOOK, ray_worker_setup):
        raise InvalidArgumentError(
            f"batch: runtime_env already has the worker_process_setup_hook {hook!r}; Ray runs one hook per job, so "
            f"call onnx_runtime.batch.engines.ray_worker_setup() from yours and pass your runtime_env as it is")
    env["worker_process_setup_hook"] = RAY_SETUP_HOOK
    return env


def _ray_shard(job, shard):
    """A Ray task: one shard, in a pooled worker process whose predictor and session stay for its next shards."""
    return process_shard(job, shard)


def _ray_prepare(settings: dict) -> None:
    prepare_worker(settings)


def prepare_ray(settings: dict, workers: int, threads: int, address) -> list:
    """On a running Ray, one task per worker that constructs its predictor (session created, kernels loaded)
    before the job's shards, while the driver reads the data set; refs the caller keeps until the job ends.
    Empty without a running Ray (run_ray starts one and its workers construct at their first shard)."""
    try:
        import ray
    except ImportError:
        return []
    if not ray.is_initialized():
        return []
    task = ray.remote(_ray_prepare).options(num_cpus=threads, max_retries=0)
    return [task.remote(settings) for _ in range(workers)]


def run_ray(job, shards, workers, threads, finished, retries, address) -> None:
    """The shards as Ray tasks of ``threads`` CPUs each, ``workers`` of them at a time, two queued per worker.

    Tasks, not actors: a task runs in one of Ray's pooled worker processes, started with the cluster and kept
    after the task, so the job starts on processes that have imported Ray already and a later job on the same
    cluster finds its session made (the predictor's per-process cache). An actor is a new process per job
    and per actor, which on a loaded 2-CPU host took longer to start than the shards took to run. A worker
    that dies mid-shard has its task retried (``max_retries``); the part file is rewritten whole. Uses a
    running Ray (``ray.init`` done by the caller) or connects to ``address``, else starts one on this
    machine."""
    try:
        import ray
    except ImportError:
        raise InvalidArgumentError("batch: --engine ray needs Ray; install it with `pip install 'onnx-runtime[ray]'`"
                                   ) from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 num_cpus=None if address else workers * threads)
    task = ray.remote(_ray_shard).options(num_cpus=threads, max_retries=retries, retry_exceptions=False)
    try:
        _drive(ray, task, ray.put(job), list(shards), finished, retries, 2 * workers)
    finally:
        if started:
            ray.shutdown()


def _drive(ray, task, job, queue, finished, retries, window) -> None:
    lost = (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.OutOfMemoryError)
    queue.reverse()
    running = [task.remote(job, queue.pop()) for _ in range(min(window, len(queue)))]
    while running:
        done, running = ray.wait(running, num_returns=1)
        try:
            result = ray.get(done[0])
        except lost as exc:
            for ref in running:
                ray.cancel(ref)
            raise WorkerLostError(f"batch: a Ray worker died more than {retries} times ({exc}); rerun the same "
                                  f"command to resume") from None
        finished(result)
        if queue:
            running.append(task.remote(job, queue.pop()))


def run_dask(job, shards, workers, threads, finished, retries, address) -> None:
    """Shards as Dask tasks: on the cluster at ``address``, else a local cluster of ``workers`` processes with one
    task slot each. A worker that dies is restarted by its nanny and its tasks rescheduled."""
    try:
        from distributed import Client, LocalCluster, as_completed
    except ImportError:
        raise InvalidArgumentError(
            "batch: --engine dask needs dask.distributed; install it with `pip install 'onnx-runtime[dask]'`"
        ) from None
    cluster = None if address else LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                                dashboard_address=None)
    client, own = _dask_client(Client, address) if address else (Client(cluster), True)
    try:
        futures = client.map(process_shard, [job] * len(shards), shards, pure=False, retries=retries)
        try:
            # results gathered by the iterator, on the client's loop: a result lost with its worker is recomputed
            for _, result in as_completed(futures, with_results=True):
                finished(result)
        except Exception as exc:  # KilledWorker: the task's workers died past the scheduler's allowance
            raise WorkerLostError(f"batch: a Dask task failed for good ({type(exc).__name__}: {exc}); rerun the "
                                  f"same command to resume") from None
    finally:
        if own:
            client.close()
        if cluster is not None:
            cluster.close()


def _dask_client(client_class, address):
    """``(client, ours)``: this process's client of the scheduler at ``address`` if it has one (two clients of
    one scheduler in one process trip over each other's event loops), else a new one."""
    try:
        from distributed import default_client

        current = default_client()
        if current.scheduler.address == address:
            return current, False
    except ValueError:  # no client in this process
        pass
    return client_class(address), True


ENGINES = {"local": run_local, "ray": run_ray, "dask": run_dask}
PREPARE = {"ray": prepare_ray}  # engines whose workers can construct their predictors before the shards come
