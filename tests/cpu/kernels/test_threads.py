"""The CPU provider's threads: the split kernels' count (a session's options, read by its runs; the CPUs the
process may use) and numpy's BLAS pool (the ``blas_threads`` knob; per session: test_threads_per_session.py)."""

from __future__ import annotations

import os

import numpy as np
import onnx_runtime as ort
import pytest
from onnx_runtime import cpus
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime_ep_cpu import threads
from threadpoolctl import threadpool_info


def _blas_threads() -> set[int]:
    """numpy's BLAS pool sizes (the pool the provider sizes; another package's BLAS is its own)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(np.__file__)))
    return {pool["num_threads"] for pool in threadpool_info()
            if pool["user_api"] == "blas" and os.path.abspath(pool["filepath"]).startswith(root)}


@pytest.fixture
def restore_threads(monkeypatch):
    monkeypatch.setattr(threads, "_blas_applied", threads._blas_applied)


def _session(chain_model, **settings):
    options = ort.SessionOptions()
    for key, value in settings.items():
        setattr(options, key, value)
    return ort.InferenceSession(chain_model.SerializeToString(), options, providers=["cpu"])


def test_intra_op_num_threads_is_the_sessions_and_blas_keeps_one(chain_model, restore_threads):
    assert threads.session_threads({"session.intra_op_num_threads": "1"}) == 1  # the caller alone
    assert threads.session_threads({"session.intra_op_num_threads": "2"}) == min(2, threads.default_threads())
    assert threads.session_threads({"session.intra_op_num_threads": "64"}) == threads.default_threads()
    sess = _session(chain_model, intra_op_num_threads=2)
    assert threads.kernel_threads() == threads.default_threads()  # outside its runs, creation changed nothing
    assert _blas_threads() == {1}  # OpenBLAS's own pool stays at the knob's size
    assert sess.run(None, {"x": np.ones((2, 6), np.float32)})[0].shape == (2, 6)


def test_the_blas_threads_knob_sizes_numpys_pool(chain_model, restore_threads, knobs):
    _session(chain_model)
    assert _blas_threads() == {1}
    knobs(blas_threads=2)
    assert _blas_threads() == {2}


def test_deterministic_compute_runs_on_one_thread(chain_model, restore_threads):
    _session(chain_model, intra_op_num_threads=2, use_deterministic_compute=True)
    assert _blas_threads() == {1}
    assert threads.session_threads({"session.intra_op_num_threads": "2",
                                    "session.use_deterministic_compute": "1"}) == 1


def test_zero_keeps_the_default_and_negative_is_refused(chain_model, restore_threads):
    assert threads.session_threads({"session.intra_op_num_threads": "0"}) == threads.default_threads()
    _session(chain_model, intra_op_num_threads=0)
    assert threads.kernel_threads() == threads.default_threads()
    with pytest.raises(InvalidArgumentError, match="intra_op_num_threads must be >= 0"):
        _session(chain_model, intra_op_num_threads=-1)
    with pytest.raises(InvalidArgumentError, match="intra_op_num_threads must be an integer"):
        threads.session_threads({"session.intra_op_num_threads": "two"})


def test_the_default_is_the_cpus_the_process_may_use(tmp_path):
    assert cpus.usable_cpus(affinity=8, quota=None) == 8
    assert cpus.usable_cpus(affinity=8, quota=1.5) == 2  # a container's --cpus=1.5
    assert cpus.usable_cpus(affinity=2, quota=4.0) == 2
    assert cpus.usable_cpus(affinity=4, quota=0.2) == 1
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cpus.cgroup_cpu_quota(str(v1)) == 1.5
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpus.cgroup_cpu_quota(str(v1)) is None
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("300000 100000\n")
    assert cpus.cgroup_cpu_quota(str(v2)) == 3.0
    (v2 / "cpu.max").write_text("max 100000\n")
    assert cpus.cgroup_cpu_quota(str(v2)) is None
    assert cpus.cgroup_cpu_quota(str(tmp_path / "none")) is None


def test_blas_pool_sized_through_threadpoolctl_where_numpy_bundles_no_openblas(chain_model, restore_threads,
                                                                                monkeypatch, knobs):
    monkeypatch.setattr(threads, "_setter", [None])  # as where numpy links another BLAS
    monkeypatch.setattr(threads, "_blas_applied", None)
    knobs(blas_threads=2)
    _session(chain_model)
    assert _blas_threads() == {2}
    knobs(blas_threads=1)
    assert _blas_threads() == {1}


ONE_THREAD = r"""
import json, sys
import numpy as np
from onnx_runtime import cpus
read = []
real = cpus.usable_cpus
cpus.usable_cpus = lambda *args, **kwargs: read.append(1) or real(*args, **kwargs)  # (before the provider imports it)
import onnx_runtime as ort
from onnx_runtime_ep_cpu import threads
options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
y = sess.run(None, {"x": np.load(sys.argv[2])})[0]
at_first_run = len(read)
default = threads.kernel_threads()  # (outside any run: the default)
print(json.dumps({"at_first_run": at_first_run, "default": default, "real": real(), "reads": len(read),
                  "y": y.tolist()}))
"""


def test_a_one_thread_session_never_reads_the_usable_cpus(chain_model, tmp_path):
    """The default count (the affinity set and the cgroup's quota files) is read at its first need: a session of one
    thread, whose runs set their own count, creates and runs without it; the default is the same when asked."""
    from model_helpers import json_from_child, saved_for_child
    from reference64 import assert_within, run_float64

    x = np.random.default_rng(2).standard_normal((2, 6)).astype(np.float32)
    model_path, x_path = saved_for_child(tmp_path, chain_model, x, "chain")
    report = json_from_child(ONE_THREAD, model_path, x_path, timeout=300)
    assert report["at_first_run"] == 0, "the usable CPUs were read for a session of one thread"
    assert report["default"] == report["real"] and report["reads"] == 1  # (read when asked)
    exact = run_float64(chain_model, {"x": x})[0]
    assert_within(np.array(report["y"], np.float32), exact, 1e-5)
