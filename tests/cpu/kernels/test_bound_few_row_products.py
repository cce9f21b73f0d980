"""A MatMul or Gemm node's kept product (PackedProduct.bound): from its second call a constant-weight product of the
same shape runs the compiled tiles' entry point directly; its results match the PackedProduct's own call bit for bit
and a float64 reference, and a changed knob, thread count or input shape goes back through the full checks."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import record_calls
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms import products
from onnx_runtime_ep_cpu.compiled import gemm
from onnx_runtime_ep_cpu.ops import linalg

pytestmark = pytest.mark.skipif(not gemm.AVAILABLE, reason="the few-row tiles run on AVX-512 hosts only")


def _constant(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False  # an initializer: the same read-only array on every run
    return array


def _bound(a: np.ndarray, b: np.ndarray, depth: int) -> float:
    return 1e-5 * np.sqrt(depth) * float(np.abs(a).max()) * float(np.abs(b).max()) + 1e-6


@pytest.mark.parametrize("rows", [1, 3, 8, 12, 16])
@pytest.mark.parametrize("depth,columns", [(64, 64), (37, 45), (129, 97)])
def test_matmul_keeps_the_bound_product(monkeypatch, knobs, rows, depth, columns):
    knobs(threads=1, few_rows_packed_macs=1, packed_macs=1)
    rng = np.random.default_rng(rows * 100 + depth)
    a = rng.standard_normal((rows, depth), dtype=np.float32)
    b = _constant(rng.standard_normal((depth, columns), dtype=np.float32))
    kernel = linalg.matmul(Node("MatMul", ["a", "b"], ["y"], opset=13), None, 13)
    first = [kernel(a, b)[0] for _ in range(2)][-1]  # (the first call may be the deferred trial)
    taken = record_calls(monkeypatch, products.PackedProduct)
    for scale in (1.0, -3.0):  # new values of the same shape: the bound call reads them
        x = a * np.float32(scale)
        (y,) = kernel(x, b)
        assert y.shape == (rows, columns) and y.dtype == np.float32
        assert np.abs(y - x.astype(np.float64) @ b.astype(np.float64)).max() <= _bound(x, b, depth)
    assert not taken  # both through the bound entry point
    assert np.array_equal(kernel(a, b)[0], first)
    # A knob change (the epoch) or another shape goes through the PackedProduct again.
    knobs(gemv_split_weights=1 << 29)
    kernel(a, b)
    assert len(taken) == 1
    kernel(np.vstack([a, a[:1]]), b)  # one row more
    assert len(taken) == 2


@pytest.mark.parametrize("rows", [2, 8, 16])
@pytest.mark.parametrize("c_shape", [None, "row", "row2d"])
def test_gemm_keeps_the_bound_product_with_its_bias(monkeypatch, knobs, rows, c_shape):
    knobs(threads=1, few_rows_packed_macs=1, few_rows_transposed_macs=1, packed_macs=1)
    depth, columns = 69, 47
    rng = np.random.default_rng(rows)
    a = rng.standard_normal((rows, depth), dtype=np.float32)
    b = _constant(rng.standard_normal((columns, depth), dtype=np.float32))
    c = {None: None, "row": rng.standard_normal(columns), "row2d": rng.standard_normal((1, columns))}[c_shape]
    c = None if c is None else _constant(c.astype(np.float32))
    node = Node("Gemm", ["a", "b", "c"] if c is not None else ["a", "b"], ["y"], attrs={"transB": 1}, opset=13)
    kernel = linalg.gemm_7(node, None, 13)
    inputs = (b,) if c is None else (b, c)
    for _ in range(2):
        kernel(a, *inputs)
    taken = record_calls(monkeypatch, products.PackedProduct)
    x = a * np.float32(-2)
    (y,) = kernel(x, *inputs)
    expected = x.astype(np.float64) @ b.T.astype(np.float64) + (0 if c is None else c.astype(np.float64))
    assert y.shape == (rows, columns) and np.abs(y - expected).max() <= _bound(x, b, depth)
    assert not taken
    # A writable C (not a constant) is not kept: its values may change between calls.
    if c is not None:
        changed = c.copy()
        kernel(a, b, changed)
        changed += 1
        (y,) = kernel(a, b, changed)
        expected = a.astype(np.float64) @ b.T.astype(np.float64) + changed.astype(np.float64)
        assert np.abs(y - expected).max() <= _bound(a, b, depth) + 1e-5


def test_no_bound_product_where_the_plan_splits_across_threads(knobs):
    knobs(threads=2, few_rows_packed_macs=1, gemv_split_weights=1)
    rng = np.random.default_rng(3)
    a = rng.standard_normal((4, 200), dtype=np.float32)
    b = _constant(rng.standard_normal((200, 300), dtype=np.float32))
    packed = products.PackedProduct()
    for _ in range(2):
        packed(a, b)
    assert packed.route == ("few rows", 2)
    assert packed.bound(a, b) is None
    knobs(threads=1)
    packed(a, b)
    run = packed.bound(a, b)
    assert run is not None and np.array_equal(run(a), packed(a, b))
    assert packed.bound(a[:2], b) is None  # not the last call's shape


@pytest.mark.parametrize("rows", [9, 12, 16])
def test_transposed_gemm_of_9_to_16_rows_takes_the_tiles(monkeypatch, knobs, rows):
    """Gemm's transB weights by 9-16 rows take few_rows.py's tiles from few_rows_transposed_macs (not OpenBLAS's
    strided packing), in the planned-shape kernel as in the general one; FEW_TILE_ROWS is few_rows.PANEL_ROWS."""
    from onnx_runtime_ep_cpu.compiled import few_rows

    assert products.FEW_TILE_ROWS == few_rows.PANEL_ROWS
    knobs(threads=1, few_rows_transposed_macs=1 << 16, packed_macs=1 << 19, few_rows_packed_macs=1 << 20)
    depth, columns = 64, 256  # rows * 16K multiply-adds: above the transposed knob, below packed_macs
    rng = np.random.default_rng(rows)
    a = rng.standard_normal((rows, depth), dtype=np.float32)
    b = _constant(rng.standard_normal((columns, depth), dtype=np.float32))
    c = _constant(rng.standard_normal(columns).astype(np.float32))
    node = Node("Gemm", ["a", "b", "c"], ["y"], attrs={"transB": 1}, opset=13)
    taken = record_calls(monkeypatch, products.PackedProduct)
    planned = linalg.gemm_7(node, [(rows, depth), (columns, depth), (columns,)], 13)
    for kernel in (planned, linalg.gemm_7(node, None, 13)):
        (y,) = kernel(a, b, c)
        expected = a.astype(np.float64) @ b.T.astype(np.float64) + c
        assert np.abs(y - expected).max() <= _bound(a, b, depth) + 1e-5
    assert len({id(packed) for packed in taken}) == 2 and all(packed.route == ("few rows", 1) for packed in taken)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trans_a,trans_b", [(0, 0), (0, 1), (1, 0), (1, 1)])
@pytest.mark.parametrize("rows,depth,columns", [(1, 64, 12), (3, 64, 30), (2, 5, 7)])
def test_a_planned_small_gemm_is_blas_bit_for_bit(dtype, trans_a, trans_b, rows, depth, columns):
    """The planned-shape Gemm of a BLAS-sized product (a streaming classifier's head) computes np.matmul's bits,
    except a float32 one small enough for compiled/small_gemm.py's loop (product and bias in one call, kept bound),
    which is within float32 rounding of float64."""
    rng = np.random.default_rng(rows + depth)
    a = rng.standard_normal((depth, rows) if trans_a else (rows, depth)).astype(dtype)
    b = _constant(rng.standard_normal((columns, depth) if trans_b else (depth, columns)).astype(dtype))
    c = _constant(rng.standard_normal(columns).astype(dtype))
    node = Node("Gemm", ["a", "b", "c"], ["y"], attrs={"transA": trans_a, "transB": trans_b}, opset=13)
    kernel = linalg.gemm_7(node, [a.shape, b.shape, c.shape], 13)
    expected = np.matmul(a.T if trans_a else a, b.T if trans_b else b) + c
    looped = dtype == np.float32 and linalg._small_loop(rows, depth, columns, trans_a, trans_b, c.shape)  # noqa: SLF001
    wide = (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b).astype(np.float64) + c
    for _ in range(3):
        (y,) = kernel(a, b, c)
        assert y.dtype == dtype
        if looped:
            assert np.abs(y - wide).max() <= _bound(a, b, depth)
        else:
            assert np.array_equal(y, expected)
