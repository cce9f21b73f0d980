"""The packed float32 MatMul on one thread (a prefill's LM head at intra_op_num_threads=1) runs its panels in one
compiled call, without posting a job to its own mailbox: against float64 with bias, Gelu and residual fused, and
bit for bit the product the same shapes give when split across threads."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx_runtime_ep_cpu.algorithms import activations, products
from onnx_runtime_ep_cpu.compiled import gemm, jobs

pytestmark = pytest.mark.skipif(not gemm.AVAILABLE, reason="the packed MatMul needs an AVX-512 host")
RNG = np.random.default_rng(19)


def _constant(array: np.ndarray) -> np.ndarray:
    array = np.array(array)
    array.flags.writeable = False
    return array


@pytest.mark.parametrize("epilogue", ["none", "bias", "gelu", "residual"])
@pytest.mark.parametrize("a_shape,n", [((1, 16, 64), 1000), ((17, 64), 256), ((1, 5, 40), 33)])
def test_one_thread_runs_one_call_and_matches_the_split_product(monkeypatch, knobs, epilogue, a_shape, n):
    knobs(packed_macs=1, split_macs=1, gemv_split_weights=1)
    a = RNG.standard_normal(a_shape, dtype=np.float32)
    b = _constant(RNG.standard_normal((a_shape[-1], n), dtype=np.float32))
    bias = _constant(RNG.standard_normal(n, dtype=np.float32)) if epilogue != "none" else None
    residual = RNG.standard_normal(a_shape[:-1] + (n,), dtype=np.float32) if epilogue == "residual" else None
    series = activations.gelu_series("none", np.float32) if epilogue == "gelu" else None
    posted = []
    real = jobs.split_matmul

    def counting(*args):
        posted.append(len(args))
        return real(*args)

    monkeypatch.setattr(jobs, "split_matmul", counting)
    knobs(threads=1)
    one = products.PackedProduct()(a, b, bias, residual, series)
    assert not posted  # one thread: no job posted
    knobs(threads=3)
    split = products.PackedProduct()(a, b, bias, residual, series)
    assert posted  # three threads: the split job
    np.testing.assert_array_equal(one, split)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    if bias is not None:
        expected = expected + bias
    if series is not None:
        expected = 0.5 * expected * (1 + np.vectorize(math.erf)(expected / np.sqrt(2)))
    if residual is not None:
        expected = expected + residual
    assert one.dtype == np.float32 and one.shape == expected.shape
    np.testing.assert_allclose(one, expected, rtol=1e-5, atol=1e-5 * np.sqrt(a_shape[-1]))
