"""MatMul, Gemm, MatMulInteger and Einsum against onnx's reference evaluator."""

from __future__ import annotations

import numpy as np
import pytest
from node_reference import F16, RNG, check, ours, rand
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)

# -- linalg --------------------------------------------------------------------------------------


@pytest.mark.parametrize("a_shape,b_shape", [
    ((3, 4), (4, 5)), ((4,), (4, 2)), ((3, 4), (4,)), ((4,), (4,)),
    ((2, 1, 3, 4), (5, 4, 6)), ((2, 3, 4), (4, 2)),
])
@pytest.mark.parametrize("opset", [1, 13])
def test_matmul(a_shape, b_shape, opset):
    check("MatMul", [rand(*a_shape), rand(*b_shape)], {}, opset)


def test_matmul_dtypes():
    check("MatMul", [rand(2, 3, 8, dtype=F16), rand(8, 4, dtype=F16)], {}, 13)
    a, b = RNG.integers(-9, 9, (3, 4)).astype(np.int64), RNG.integers(-9, 9, (4, 2)).astype(np.int64)
    check("MatMul", [a, b], {}, 13)


@pytest.mark.parametrize("c_shape", [None, (3, 5), (5,), (1, 5), (3, 1), ()])
@pytest.mark.parametrize("attrs", [{}, {"transA": 1}, {"transB": 1, "alpha": 0.5},
                                   {"transA": 1, "transB": 1, "alpha": 2.0, "beta": -1.5}])
def test_gemm(c_shape, attrs):
    a = rand(4, 3) if attrs.get("transA") else rand(3, 4)
    b = rand(5, 4) if attrs.get("transB") else rand(4, 5)
    c = None if c_shape is None else rand(*c_shape)
    check("Gemm", [a, b, c], attrs, 13)


def test_gemm_old_opsets():
    a, b, c = rand(3, 4), rand(4, 5), rand(5)
    check("Gemm", [a, b, c], {"broadcast": 1, "beta": 2.0}, 6)
    check("Gemm", [a, b, rand(3, 5)], {"alpha": 0.5}, 1, ref_opset=6)  # no reference Gemm-1
    check("Gemm", [a, b, c], {"transA": 0}, 7)
    check("Gemm", [a.astype(F16), b.astype(F16), c.astype(F16)], {}, 11)
    with pytest.raises(InvalidArgumentError, match="broadcast"):
        ours("Gemm", [a, b, c], {}, 6)


@pytest.mark.parametrize("a_dtype,b_dtype", [(np.uint8, np.uint8), (np.int8, np.int8), (np.uint8, np.int8)])
@pytest.mark.parametrize("zero_points", ["none", "scalar", "vector"])
def test_matmul_integer(a_dtype, b_dtype, zero_points):
    def ints(dtype, *shape):
        info = np.iinfo(dtype)
        return RNG.integers(info.min, info.max, shape, endpoint=True).astype(dtype)

    a, b = ints(a_dtype, 2, 3, 6), ints(b_dtype, 6, 4)
    azp = bzp = None
    if zero_points == "scalar":
        azp, bzp = ints(a_dtype), ints(b_dtype)
    elif zero_points == "vector":
        azp, bzp = ints(a_dtype, 3), ints(b_dtype, 4)
        # The reference subtracts a vector zero point of A along K; A's zero point is per row.
        a32, b32 = a.astype(np.int32) - azp.astype(np.int32)[:, None], b.astype(np.int32) - bzp
        check("MatMulInteger", [a, b, azp, bzp], {}, 10, expected=[a32 @ b32])
        return
    check("MatMulInteger", [a, b, azp, bzp], {}, 10)


@pytest.mark.parametrize("equation,shapes", [
    ("ij,jk->ik", [(3, 4), (4, 5)]),
    ("bij, bjk -> bik", [(2, 3, 4), (2, 4, 5)]),
    ("ii->i", [(4, 4)]),
    ("i,i", [(5,), (5,)]),
    ("...ij->...ji", [(2, 3, 4, 5)]),
    ("ij,jk", [(3, 4), (4, 2)]),
    ("bhid,bhjd->bhij", [(1, 2, 3, 4), (1, 2, 5, 4)]),
    ("Ab,bc->cA", [(2, 3), (3, 4)]),
])
@pytest.mark.parametrize("opset", [12, 28])
def test_einsum(equation, shapes, opset):
    check("Einsum", [rand(*s) for s in shapes], {"equation": equation}, opset, ref_opset=12)


def test_einsum_dtypes_and_errors():
    check("Einsum", [rand(3, 4, dtype=F16), rand(4, 2, dtype=F16)], {"equation": "ij,jk->ik"}, 12)
    a, b = RNG.integers(-5, 5, (3, 4)).astype(np.int32), RNG.integers(-5, 5, (4,)).astype(np.int32)
    check("Einsum", [a, b], {"equation": "ij,j->i"}, 12)
    with pytest.raises(InvalidGraphError, match="equation"):
        ours("Einsum", [rand(2)], {}, 12)
