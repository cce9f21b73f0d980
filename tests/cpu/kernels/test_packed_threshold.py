"""Float32 products of constant weights below the packed_macs knob (a short sequence through 64-wide layers) take
BLAS and the compiled epilogue, larger ones the packed product (compiled/matmul.py; with a Gelu epilogue from
linalg.GELU_PACKED_FACTOR times the knob); both give float64's results, for MatMul and for FusedMatMul with its
bias, Gelu and residual, through the kernels made for one shape too."""

from __future__ import annotations

import math

import numpy as np
import pytest
from model_helpers import record_calls
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms import products
from onnx_runtime_ep_cpu.compiled import gemm
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import linalg
from onnx_runtime_ep_cpu.tuning import KNOBS

pytestmark = pytest.mark.skipif(not gemm.AVAILABLE, reason="the packed product runs on AVX-512 hosts only")
RNG = np.random.default_rng(7)


def _constant(shape) -> np.ndarray:
    array = RNG.standard_normal(shape, dtype=np.float32)
    array.flags.writeable = False
    return array


# (rows, depth, width): a prefill of 16 tokens through 64-wide layers (below the knob), and larger products.
SMALL = [(16, 64, 64), (16, 64, 192), (24, 256, 64)]
LARGE = [(64, 96, 128), (16, 64, 1000), (128, 128, 512)]


@pytest.mark.parametrize("shape_known", [False, True])
@pytest.mark.parametrize("rows,depth,width", SMALL + LARGE)
def test_products_take_the_packed_product_from_the_knob_on(monkeypatch, shape_known, rows, depth, width):
    taken = record_calls(monkeypatch, products.PackedProduct)
    a = RNG.standard_normal((1, rows, depth), dtype=np.float32)
    b, bias = _constant((depth, width)), _constant((width,))
    residual = RNG.standard_normal((1, rows, width), dtype=np.float32)
    shapes = [a.shape, b.shape, bias.shape, residual.shape] if shape_known else None
    node = Node("FusedMatMul", ["a", "b", "c", "r"], ["y"], domain=FUSED_DOMAIN, attrs={"activation": "gelu"},
                opset=1)
    (fused,) = linalg.fused_matmul(node, shapes, 1)(a, b, bias, residual)
    (plain,) = linalg.matmul(Node("MatMul", ["a", "b"], ["y"], opset=13), shapes and shapes[:2], 13)(a, b)
    product = a.astype(np.float64) @ b.astype(np.float64)
    u = product + bias
    gelu = 0.5 * u * (1 + np.vectorize(math.erf)(u / np.sqrt(2)))
    tolerance = 1e-5 * np.sqrt(depth)
    np.testing.assert_allclose(plain, product, rtol=1e-5, atol=tolerance)
    np.testing.assert_allclose(fused, gelu + residual, rtol=1e-5, atol=tolerance)
    macs = rows * depth * width  # MatMul from the knob on, FusedMatMul with Gelu from GELU_PACKED_FACTOR times it
    expected = (macs >= KNOBS.packed_macs) + (macs >= linalg.GELU_PACKED_FACTOR * KNOBS.packed_macs)
    assert len(taken) == expected, (rows, depth, width, KNOBS.packed_macs)


def test_the_knob_moves_the_choice(monkeypatch, knobs):
    taken = record_calls(monkeypatch, products.PackedProduct)
    a, b = RNG.standard_normal((16, 64), dtype=np.float32), _constant((64, 64))
    kernel = linalg.matmul(Node("MatMul", ["a", "b"], ["y"], opset=13), None, 13)
    kernel(a, b)
    assert not taken
    knobs(packed_macs=16 * 64 * 64)
    (y,) = kernel(a, b)
    assert len(taken) == 1
    np.testing.assert_allclose(y, a.astype(np.float64) @ b.astype(np.float64), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows,depth,width", [(1, 64, 10), (1, 64, 64), (4, 128, 96)])
def test_a_small_planned_gemm_is_the_general_kernels_bits(rows, depth, width):
    """A Gemm made for its one shape, small enough for BLAS at every thread count, gives the general kernel's
    bits (the same BLAS call and in-place add) and float64's results."""
    a = RNG.standard_normal((rows, depth), dtype=np.float32)
    b, c = _constant((width, depth)), _constant((width,))
    node = Node("Gemm", ["a", "b", "c"], ["y"], attrs={"transB": 1}, opset=13)
    planned = linalg.gemm_7(node, [a.shape, b.shape, c.shape], 13)
    general = linalg.gemm_7(node, None, 13)
    assert planned.__qualname__ != general.__qualname__  # the lean kernel was made
    (y,) = planned(a, b, c)
    np.testing.assert_array_equal(y, general(a, b, c)[0])
    np.testing.assert_allclose(y, a.astype(np.float64) @ b.T.astype(np.float64) + c, rtol=1e-5, atol=1e-5)
