"""A decode step's one-row products of constant weights with the one_row_tile_weights knob's weights and at least
products.ONE_ROW_DEPTH deep take compiled/few_rows.py's tiles (OPT's MatMul q/k/v/out and lm head, Gemm transB
fc1/fc2, FusedMatMul out-projection with bias and residual, ProjectionGroup), below few_rows_packed_macs; shallower
or smaller ones stay BLAS's. Results against a float64 reference; the route read from the node's PackedProduct."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import record_calls
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms import products
from onnx_runtime_ep_cpu.compiled import gemm
from onnx_runtime_ep_cpu.ops import linalg, projection_group

pytestmark = pytest.mark.skipif(not gemm.AVAILABLE, reason="the few-row tiles run on AVX-512 hosts only")

FUSED = "ai.onnx_runtime.cpu"


def _constant(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False  # an initializer: the same read-only array on every run
    return array


def _bound(a: np.ndarray, b: np.ndarray, depth: int) -> float:
    return 1e-5 * np.sqrt(depth) * float(np.abs(a).max()) * float(np.abs(b).max()) + 1e-6


def _product(op: str, depth: int, columns: int, rng):
    """(kernel, its inputs, the float64 reference) of a one-row product ``op`` of (depth, columns) constant weights."""
    a = rng.standard_normal((1, 1, depth), dtype=np.float32)
    w = _constant(rng.standard_normal((depth, columns), dtype=np.float32))
    bias = _constant(rng.standard_normal(columns).astype(np.float32))
    reference = a.astype(np.float64) @ w.astype(np.float64)
    if op == "MatMul":
        return linalg.matmul(Node("MatMul", ["a", "w"], ["y"], opset=13), [a.shape, w.shape], 13), (a, w), reference
    if op == "Gemm":  # fc1/fc2 of an OPT export: transB weights (N, K), C the bias row
        flat = a.reshape(1, depth)
        node = Node("Gemm", ["a", "w", "c"], ["y"], attrs={"transB": 1}, opset=13)
        weights = _constant(np.ascontiguousarray(w.T))
        kernel = linalg.gemm_7(node, [flat.shape, weights.shape, bias.shape], 13)
        return kernel, (flat, weights, bias), reference.reshape(1, columns) + bias
    if op == "FusedMatMul":  # an out-projection: bias and the residual in the product's epilogue
        residual = rng.standard_normal((1, 1, columns), dtype=np.float32)
        node = Node("FusedMatMul", ["a", "w", "bias", "r"], ["y"], domain=FUSED, opset=1)
        kernel = linalg.fused_matmul(node, [a.shape, w.shape, bias.shape, residual.shape], 1)
        return kernel, (a, w, bias, residual), reference + bias + residual
    widths = [columns // 4, columns // 4, columns - columns // 2]  # ProjectionGroup: query, key, value
    node = Node("ProjectionGroup", ["a", "w", "bias"], ["q", "k", "v"], domain=FUSED, attrs={"widths": widths},
                opset=1)
    kernel = projection_group.projection_group(node, [a.shape, w.shape, bias.shape], 1)
    return (lambda *args: (np.concatenate(kernel(*args), axis=-1),)), (a, w, bias), reference + bias


def _run(kernel, inputs, reference, depth) -> None:
    for _ in range(3):  # the first call may be the deferred trial; then the node's kept (bound) call
        (y,) = kernel(*inputs)
        assert y.shape == reference.shape and y.dtype == np.float32
        assert np.abs(y - reference).max() <= _bound(inputs[0], inputs[1], depth)


@pytest.mark.parametrize("op", ["MatMul", "Gemm", "FusedMatMul", "ProjectionGroup"])
@pytest.mark.parametrize("depth,columns", [(256, 256), (512, 256), (256, 1000), (128, 520)])
def test_one_row_of_l3_sized_weights_takes_the_tiles(monkeypatch, knobs, op, depth, columns):
    knobs(threads=1)
    assert depth * columns >= products.KNOBS.one_row_tile_weights > 0
    assert depth * columns < products.KNOBS.few_rows_packed_macs  # the route this knob adds, not the older one's
    taken = record_calls(monkeypatch, products.PackedProduct)
    _run(*_product(op, depth, columns, np.random.default_rng(depth + columns)), depth)
    assert taken and taken[-1].route == ("few rows", 1)


@pytest.mark.parametrize("op", ["MatMul", "Gemm", "FusedMatMul", "ProjectionGroup"])
@pytest.mark.parametrize("depth,columns,knob", [(64, 1024, None), (256, 256, 1 << 17), (127, 1024, None)])
def test_shallow_or_smaller_one_row_products_stay_blas(monkeypatch, knobs, op, depth, columns, knob):
    knobs(threads=1, **({} if knob is None else {"one_row_tile_weights": knob}))
    assert depth * columns < products.KNOBS.few_rows_packed_macs
    taken = record_calls(monkeypatch, products.PackedProduct)
    _run(*_product(op, depth, columns, np.random.default_rng(depth)), depth)
    assert not taken


def test_the_knob_moves_a_built_kernel_at_its_next_call(monkeypatch, knobs):
    """Kernels kept bound across calls (MatMul/Gemm) and FusedMatMul's planned route follow a knob change."""
    knobs(threads=1)
    rng = np.random.default_rng(3)
    for op in ("MatMul", "Gemm", "FusedMatMul"):
        kernel, inputs, reference = _product(op, 256, 512, rng)
        taken = record_calls(monkeypatch, products.PackedProduct)
        _run(kernel, inputs, reference, 256)
        assert taken, op
        knobs(one_row_tile_weights=1 << 30)
        taken.clear()
        _run(kernel, inputs, reference, 256)
        assert not taken, op
        knobs(one_row_tile_weights=1 << 16)
        _run(kernel, inputs, reference, 256)
        assert taken, op


@pytest.mark.parametrize("op", ["FusedMatMul", "ProjectionGroup"])
def test_fused_and_grouped_products_keep_a_bound_call(monkeypatch, knobs, op):
    """After its first products a FusedMatMul (bias and residual) or ProjectionGroup (bias) runs its bound call: no
    PackedProduct call, and new values of the same shapes (a new residual too) within the float64 bound."""
    knobs(threads=1)
    rng = np.random.default_rng(7)
    kernel, inputs, reference = _product(op, 256, 512, rng)
    _run(kernel, inputs, reference, 256)
    taken = record_calls(monkeypatch, products.PackedProduct)
    a, w, bias = inputs[:3]
    for _ in range(3):
        a = rng.standard_normal(a.shape, dtype=np.float32)
        residual = rng.standard_normal((1, 1, 512), dtype=np.float32) if op == "FusedMatMul" else None
        (y,) = kernel(a, w, bias, *([] if residual is None else [residual]))
        expected = a.astype(np.float64) @ w.astype(np.float64) + bias + (0 if residual is None else residual)
        assert y.shape == expected.shape and np.abs(y - expected).max() <= _bound(a, w, 256)
    assert not taken


def test_a_bound_fused_product_leaves_other_residuals_to_the_checked_path(monkeypatch, knobs):
    """A residual the bound call was not made for (float64, or none where it adds one) goes the checked way."""
    knobs(threads=1)
    rng = np.random.default_rng(8)
    kernel, (a, w, bias, residual), reference = _product("FusedMatMul", 256, 512, rng)
    _run(kernel, (a, w, bias, residual), reference, 256)
    wide = rng.standard_normal((1, 1, 512))
    (y,) = kernel(a, w, bias, wide)
    expected = a.astype(np.float64) @ w.astype(np.float64) + bias + wide
    assert np.abs(y - expected).max() <= _bound(a, w, 256) * 2
    (y,) = kernel(a, w, bias)
    assert np.abs(y - (a.astype(np.float64) @ w.astype(np.float64) + bias)).max() <= _bound(a, w, 256)


@pytest.mark.parametrize("activation", ["none", "gelu"])
@pytest.mark.parametrize("depth,columns", [(64, 64), (256, 64)])
def test_a_blas_sized_fused_product_keeps_its_constants_and_reads_each_calls_values(knobs, activation, depth, columns):
    """A one-row FusedMatMul below the tiles' sizes (gpt2's out-projection and fc2) runs BLAS's product; once its
    constant weights and bias were checked, later calls check only A and the residual: new A's and residuals (and
    none), another bias array, a float64 residual and a writable weight matrix changed in place between calls all
    give the float64 reference's values."""
    knobs(threads=1)
    rng = np.random.default_rng(depth + columns)
    a = rng.standard_normal((1, 1, depth), dtype=np.float32)
    w = _constant(rng.standard_normal((depth, columns), dtype=np.float32))
    bias = _constant(rng.standard_normal(columns).astype(np.float32))
    node = Node("FusedMatMul", ["a", "w", "bias", "r"], ["y"], domain=FUSED, attrs={"activation": activation},
                opset=1)
    kernel = linalg.fused_matmul(node, [a.shape, w.shape, bias.shape, (1, 1, columns)], 1)

    def expected(a, w, bias, residual):
        y = a.astype(np.float64) @ w.astype(np.float64) + bias
        if activation == "gelu":
            y = 0.5 * y * (1 + np.vectorize(__import__("math").erf)(y / np.sqrt(2)))
        return y + (0 if residual is None else residual)

    for call in range(8):
        a = rng.standard_normal(a.shape, dtype=np.float32)
        residual = None if call % 3 == 2 else rng.standard_normal((1, 1, columns), dtype=np.float32)
        if call == 5:
            residual = rng.standard_normal((1, 1, columns))  # float64: the checked path's
        if call == 6:
            bias = _constant(rng.standard_normal(columns).astype(np.float32))  # another constant bias
        (y,) = kernel(a, w, bias, *([] if residual is None else [residual]))
        assert y.shape == (1, 1, columns)
        assert np.abs(y - expected(a, w, bias, residual)).max() <= 2 * _bound(a, w, depth), call
    writable = rng.standard_normal((depth, columns), dtype=np.float32)
    for _ in range(2):
        (y,) = kernel(a, writable, bias)
        assert np.abs(y - expected(a, writable, bias, None)).max() <= 2 * _bound(a, writable, depth)
        writable *= -2  # changed in place: a kernel must not keep a writable operand


@pytest.mark.parametrize("a_shape,columns", [((1, 1, 64), 1000), ((1, 64), 64), ((1, 3, 256), 64), ((2, 1, 64), 64)])
def test_a_blas_matmul_of_one_matrix_is_one_dot_of_it(monkeypatch, knobs, a_shape, columns):
    """A MatMul below the tiles' sizes (gpt2's lm head at a decode step) whose A holds one matrix multiplies it by
    np.dot's C function, bit for bit np.matmul's product, without calling np.matmul; A of several matrices (a batch)
    keeps np.matmul."""
    knobs(threads=1)
    real, calls = np.matmul, []
    monkeypatch.setattr(np, "matmul", lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    rng = np.random.default_rng(columns)
    w = _constant(rng.standard_normal((a_shape[-1], columns), dtype=np.float32))
    kernel = linalg.matmul(Node("MatMul", ["a", "w"], ["y"], opset=13), [a_shape, w.shape], 13)
    for _ in range(3):  # the first call, then the node's kept product
        a = rng.standard_normal(a_shape, dtype=np.float32)
        (y,) = kernel(a, w)
        np.testing.assert_array_equal(y, real(a, w))
    assert bool(calls) == (a_shape[0] > 1)
