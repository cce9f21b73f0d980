"""Session options that set the CPU provider's threads: BLAS's and the helper threads' of its own split
kernels (process-wide, as numpy's BLAS is)."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime_ep_cpu import threads
from threadpoolctl import threadpool_info, threadpool_limits


def _blas_threads() -> set[int]:
    return {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}


@pytest.fixture
def restore_blas_threads(monkeypatch):
    before = max(_blas_threads())
    monkeypatch.setattr(threads, "_threads", threads._threads)  # restored after the test
    yield
    threadpool_limits(limits=before, user_api="blas")


def _session(chain_model, **settings):
    options = ort.SessionOptions()
    for key, value in settings.items():
        setattr(options, key, value)
    return ort.InferenceSession(chain_model.SerializeToString(), options, providers=["cpu"])


def test_intra_op_num_threads_sets_the_blas_pool(chain_model, restore_blas_threads):
    _session(chain_model, intra_op_num_threads=1)
    assert _blas_threads() == {1}
    assert threads.kernel_threads() == 1  # the split kernels run on the caller alone
    sess = _session(chain_model, intra_op_num_threads=2)
    assert _blas_threads() == {2}
    assert threads.kernel_threads() == min(2, threads._DEFAULT_THREADS)
    assert sess.run(None, {"x": np.ones((2, 6), np.float32)})[0].shape == (2, 6)


def test_deterministic_compute_runs_blas_on_one_thread(chain_model, restore_blas_threads):
    _session(chain_model, intra_op_num_threads=2, use_deterministic_compute=True)
    assert _blas_threads() == {1}
    assert threads.kernel_threads() == 1


def test_zero_keeps_the_default_and_negative_is_refused(chain_model, restore_blas_threads):
    before = _blas_threads()
    _session(chain_model, intra_op_num_threads=0)
    assert _blas_threads() == before
    with pytest.raises(InvalidArgumentError, match="intra_op_num_threads must be >= 0"):
        _session(chain_model, intra_op_num_threads=-1)
