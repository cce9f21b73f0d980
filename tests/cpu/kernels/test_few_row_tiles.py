"""Few-row products of constant weights through compiled/few_rows.py's tiles (MatMul, Gemm with transA/transB,
alpha, beta and C), against float64; the route read from the node's PackedProduct (its ``route``), not timings."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, record_calls, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms import products
from onnx_runtime_ep_cpu.compiled import few_rows, gemm
from onnx_runtime_ep_cpu.ops import linalg

pytestmark = pytest.mark.skipif(not gemm.AVAILABLE, reason="the few-row tiles run on AVX-512 hosts only")


def _constant(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False  # an initializer: the same read-only array on every run
    return array


def _bound(a: np.ndarray, b: np.ndarray, depth: int) -> float:
    return 1e-5 * np.sqrt(depth) * float(np.abs(a).max()) * float(np.abs(b).max()) + 1e-6


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17])
@pytest.mark.parametrize("depth,columns", [(1, 33), (7, 31), (129, 97), (257, 130), (64, 1)])
def test_matmul_of_constant_weights_matches_float64(monkeypatch, knobs, threads, rows, depth, columns):
    knobs(threads=threads, few_rows_packed_macs=1, few_rows_transposed_macs=1, gemv_split_weights=1, packed_macs=1,
          split_macs=1)
    rng = np.random.default_rng(rows * 1000 + depth)
    a = rng.standard_normal((rows, depth), dtype=np.float32)
    b = _constant(rng.standard_normal((depth, columns), dtype=np.float32))
    taken = record_calls(monkeypatch, products.PackedProduct)
    kernel = linalg.matmul(Node("MatMul", ["a", "b"], ["y"], opset=13), None, 13)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    for _ in range(2):  # the first call may be the deferred trial
        (y,) = kernel(a, b)
        assert y.shape == expected.shape and y.dtype == np.float32
        assert np.abs(y - expected).max() <= _bound(a, b, depth)
    assert taken and taken[-1].route[0] == ("few rows" if rows <= few_rows.PANEL_ROWS else "panels")
    assert taken[-1].route[1] == min(threads, -(-columns // gemm.NR))


def test_leading_dimensions_and_the_thread_count_give_the_same_sums(knobs):
    """Every output sums k = 0 .. K-1 in one chain whichever tile and thread computes it."""
    rng = np.random.default_rng(5)
    a = rng.standard_normal((2, 3, 300), dtype=np.float32) * 10
    b = _constant(rng.standard_normal((300, 200), dtype=np.float32))
    kernel = linalg.matmul(Node("MatMul", ["a", "b"], ["y"], opset=13), None, 13)
    results = []
    for threads in (1, 2, 3):
        knobs(threads=threads, few_rows_packed_macs=1, few_rows_transposed_macs=1, gemv_split_weights=1)
        results.append([kernel(a, b)[0] for _ in range(2)][-1])
    assert all(np.array_equal(results[0], other) for other in results[1:])
    expected = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(results[0] - expected).max() <= _bound(a, b, 300)


def test_below_the_knob_one_thread_leaves_the_product_to_blas(monkeypatch, knobs):
    knobs(threads=1, few_rows_packed_macs=1 << 30, few_rows_transposed_macs=1 << 30, few_rows_blas_macs=1 << 30)
    taken = record_calls(monkeypatch, products.PackedProduct)
    rng = np.random.default_rng(6)
    a = rng.standard_normal((4, 96), dtype=np.float32)
    b = _constant(rng.standard_normal((96, 80), dtype=np.float32))
    (y,) = linalg.matmul(Node("MatMul", ["a", "b"], ["y"], opset=13), None, 13)(a, b)
    assert not taken
    assert np.abs(y - a.astype(np.float64) @ b).max() <= _bound(a, b, 96)
    # From the split size, a second thread takes the tiles at any size.
    knobs(threads=2, gemv_split_weights=96 * 80)
    assert products.PackedProduct.takes_few(a, b)
    knobs(threads=1)
    assert not products.PackedProduct.takes_few(a, b)
    # Two or more rows by transposed weights (Gemm's transB) take the tiles from their own, smaller knob.
    transposed = _constant(np.ascontiguousarray(b.T)).T
    knobs(few_rows_transposed_macs=4 * 96 * 80)
    assert products.PackedProduct.takes_few(a, transposed) and not products.PackedProduct.takes_few(a, b)
    assert not products.PackedProduct.takes_few(a[:1], transposed)


def _gemm(a, b, c, **attributes):
    node = Node("Gemm", ["a", "b", "c"] if c is not None else ["a", "b"], ["y"], attrs=attributes, opset=13)
    kernel = linalg.gemm_7(node, None, 13)
    return kernel(a, b) if c is None else kernel(a, b, c)


@pytest.mark.parametrize("trans_a,trans_b", [(0, 1), (1, 0), (1, 1), (0, 0)])
@pytest.mark.parametrize("alpha,beta,c_shape", [
    (1.0, 1.0, "row"), (1.0, 1.0, "full"), (0.5, 1.0, "row"), (1.0, -2.0, "full"), (1.0, 1.0, None),
    (2.0, 0.5, "scalar"), (1.0, 1.0, "column"),
])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_gemm_of_constant_weights_matches_float64(monkeypatch, knobs, trans_a, trans_b, alpha, beta, c_shape, rows):
    knobs(threads=1, few_rows_packed_macs=1, few_rows_transposed_macs=1)
    depth, columns = 69, 47
    rng = np.random.default_rng(rows + 10 * trans_a + 20 * trans_b)
    a = rng.standard_normal((depth, rows) if trans_a else (rows, depth), dtype=np.float32)
    b = _constant(rng.standard_normal((columns, depth) if trans_b else (depth, columns), dtype=np.float32))
    c = {None: None, "row": rng.standard_normal(columns), "full": rng.standard_normal((rows, columns)),
         "scalar": rng.standard_normal(1), "column": rng.standard_normal((rows, 1))}[c_shape]
    c = None if c is None else _constant(c.astype(np.float32))
    taken = record_calls(monkeypatch, products.PackedProduct)
    (y,) = _gemm(a, b, c, alpha=alpha, beta=beta, transA=trans_a, transB=trans_b)
    left, right = (a.T if trans_a else a).astype(np.float64), (b.T if trans_b else b).astype(np.float64)
    expected = alpha * (left @ right) + (0 if c is None else beta * c.astype(np.float64))
    assert y.shape == (rows, columns) and y.dtype == np.float32
    assert np.abs(y - expected).max() <= _bound(a, b, depth) * max(1, abs(alpha)) + 1e-5 * abs(beta)
    assert taken and taken[-1].route == ("few rows", 1)


def test_a_session_runs_a_few_row_gemm_of_initializers(knobs):
    knobs(threads=1, few_rows_packed_macs=1, few_rows_transposed_macs=1)
    rng = np.random.default_rng(8)
    w = rng.standard_normal((37, 301), dtype=np.float32)
    bias = rng.standard_normal(37).astype(np.float32)
    node = helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1, alpha=1.0)
    model = make_model([node], [tensor_info("x", shape=["n", 301])], [tensor_info("y", shape=["n", 37])],
                       [numpy_helper.from_array(w, "w"), numpy_helper.from_array(bias, "c")])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for rows in (1, 6, 8, 11):
        x = rng.standard_normal((rows, 301), dtype=np.float32)
        (y,) = session.run(None, {"x": x})
        expected = x.astype(np.float64) @ w.T.astype(np.float64) + bias
        assert np.abs(y - expected).max() <= _bound(x, w, 301)


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("lead", [(1, 1), (2, 3), (1, 8)])
def test_a_projection_group_of_a_decode_step_takes_the_tiles(monkeypatch, knobs, with_bias, lead):
    """A merged query/key/value product (ProjectionGroup) of a decode step's few rows by its constant weights."""
    from onnx_runtime_ep_cpu.ops import projection_group

    knobs(threads=1, few_rows_packed_macs=1)
    rng = np.random.default_rng(9)
    depth, widths = 97, [32, 17, 17]
    a = rng.standard_normal((*lead, depth), dtype=np.float32)
    w = _constant(rng.standard_normal((depth, sum(widths)), dtype=np.float32))
    bias = _constant(rng.standard_normal(sum(widths)).astype(np.float32)) if with_bias else None
    node = Node("ProjectionGroup", ["a", "w"] + (["bias"] if with_bias else []), ["q", "k", "v"],
                domain="ai.onnx_runtime.cpu", attrs={"widths": widths}, opset=1)
    kernel = projection_group.projection_group(node, [a.shape, w.shape] + ([bias.shape] if with_bias else []), 1)
    taken = record_calls(monkeypatch, products.PackedProduct)
    expected = a.astype(np.float64) @ w.astype(np.float64) + (0 if bias is None else bias)
    for _ in range(2):
        outputs = kernel(a, w, bias) if with_bias else kernel(a, w)
        y = np.concatenate(outputs, axis=-1)
        assert y.shape == expected.shape and np.abs(y - expected).max() <= _bound(a, w, depth)
    assert taken and taken[-1].route == ("few rows", 1)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_the_tiles_epilogue_adds_bias_gelu_and_residual(knobs, threads, rows):
    """The epilogue PackedProduct's callers may ask of few rows: bias, the erf Gelu's series, residual."""
    import math

    from onnx_runtime_ep_cpu.algorithms.activations import gelu_series

    knobs(threads=threads, gemv_split_weights=1)
    rng = np.random.default_rng(rows)
    depth, columns = 83, 70
    a = rng.standard_normal((rows, depth), dtype=np.float32) * 0.2
    b = _constant(rng.standard_normal((depth, columns), dtype=np.float32) * 0.2)
    bias = _constant(rng.standard_normal(columns).astype(np.float32))
    residual = rng.standard_normal((rows, columns)).astype(np.float32)
    packed = products.PackedProduct()
    u = a.astype(np.float64) @ b.astype(np.float64) + bias
    erf = np.vectorize(math.erf)
    for coefficients, expected in ((None, u + residual), (gelu_series("none", np.float32),
                                                           0.5 * u * (1 + erf(u / math.sqrt(2))) + residual)):
        for _ in range(2):
            y = packed(a, b, bias, residual, coefficients)
            assert y.shape == (rows, columns) and np.abs(y - expected).max() <= 1e-5
        assert packed.route[0] == "few rows"
