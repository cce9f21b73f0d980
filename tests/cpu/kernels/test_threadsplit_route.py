"""The few-row product split (algorithms/products.Split): which thread count and work items a shape is given,
read from the Split itself rather than from timings, and the split results against float64 for odd shapes."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.algorithms import products
from onnx_runtime_ep_cpu.compiled import gemm

pytestmark = pytest.mark.skipif(not gemm.AVAILABLE, reason="the few-row products run on AVX-512 hosts only")


def _operands(rows: int, depth: int, columns: int, transposed: bool, seed: int = 19):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((rows, depth), dtype=np.float32)
    b = rng.standard_normal((columns, depth) if transposed else (depth, columns), dtype=np.float32)
    return a, b


@pytest.mark.parametrize("transposed", [False, True], ids=["a@b", "a@b.T"])
def test_the_split_takes_every_thread_from_the_split_size_and_one_below(knobs, transposed):
    knobs(threads=2, gemv_split_weights=1 << 14, few_rows_blas_macs=1)
    large = products.few_rows_split(*_operands(1, 259, 131, transposed), transposed)
    small = products.few_rows_split(*_operands(1, 67, 61, transposed), transposed)
    assert large is not None and large.route[0] == 2
    assert small is not None and small.route[0] == 1


def test_one_thread_below_the_blas_size_is_left_to_blas(knobs):
    knobs(threads=1, few_rows_blas_macs=1 << 22)
    assert products.few_rows_split(*_operands(3, 129, 65, False), False) is None
    knobs(threads=2, gemv_split_weights=1)
    split = products.few_rows_split(*_operands(3, 129, 65, False), False)
    assert split is not None and split.route[0] == 2


@pytest.mark.parametrize("transposed", [False, True], ids=["a@b", "a@b.T"])
@pytest.mark.parametrize("rows,depth,columns", [(1, 771, 1029), (3, 257, 97), (5, 130, 33), (8, 1, 17), (7, 385, 2)])
def test_split_results_match_float64(knobs, transposed, rows, depth, columns):
    knobs(threads=2, gemv_split_weights=1, few_rows_blas_macs=1)
    a, b = _operands(rows, depth, columns, transposed)
    split = products.few_rows_split(a, b, transposed)
    assert split is not None
    threads, items = split.route
    assert 1 <= threads <= 2 and items >= threads
    expected = a.astype(np.float64) @ (b.T if transposed else b).astype(np.float64)
    bound = 1e-5 * np.sqrt(depth) * np.abs(a).max() * np.abs(b).max()
    for _ in range(3):  # the first call may be the deferred trial; later ones post to the helpers
        y = split(a, b)
        assert y.shape == expected.shape and y.dtype == np.float32
        assert np.abs(y - expected).max() <= bound
