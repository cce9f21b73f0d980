"""com.microsoft Gelu, BiasGelu, FastGelu, QuickGelu, BiasAdd and BiasSplitGelu against onnxruntime's CPU
provider (BiasAdd and BiasSplitGelu, which it implements only on CUDA, against numpy)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from contrib_oracle import F16, F32, close, compare, model, ours, placed_on_cpu, rand
from onnx_runtime.errors import OnnxRuntimeError

F64 = np.float64
_erf = np.vectorize(math.erf)


def _gelu(x):
    x = x.astype(F64)
    return 0.5 * x * (1 + _erf(x / math.sqrt(2)))


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("shape", [(2, 3, 8), (5,), (1, 4, 2, 16)])
def test_gelu(dtype, shape):
    compare("Gelu", [rand(*shape, dtype=dtype, low=-4, high=4)])


def test_gelu_double_against_numpy():
    # onnxruntime's CPU provider has no double Erf for this kernel's function body: numpy is the reference.
    x = rand(3, 7, dtype=F64, low=-5, high=5)
    (got,) = ours(model("Gelu", [x]), [x])
    close(got, _gelu(x))


@pytest.mark.parametrize("dtype", [F32, F16])
def test_bias_gelu(dtype):
    compare("BiasGelu", [rand(2, 5, 12, dtype=dtype, low=-3, high=3), rand(12, dtype=dtype)])


@pytest.mark.parametrize("dtype", [F32, F16, F64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fast_gelu(dtype, with_bias):
    x = rand(3, 4, 10, dtype=dtype, low=-4, high=4)
    # onnxruntime's double kernels use single-precision constants: float32's tolerance bounds them.
    compare("FastGelu", [x, rand(10, dtype=dtype)] if with_bias else [x], dtype=F32 if dtype == F64 else None)


@pytest.mark.parametrize("dtype", [F32, F16, F64])
@pytest.mark.parametrize("attrs", [{}, {"alpha": 1.0}, {"alpha": -0.75}])
def test_quick_gelu(dtype, attrs):
    compare("QuickGelu", [rand(4, 9, dtype=dtype, low=-6, high=6)], attrs, dtype=F32 if dtype == F64 else None)


def test_gelu_family_saturates_without_nan():
    x = np.array([-1e4, -60.0, -0.0, 0.0, 60.0, 1e4, np.inf, -np.inf], F32)
    for op in ("Gelu", "FastGelu", "QuickGelu"):
        (got,) = ours(model(op, [x]), [x])
        assert not np.isnan(got[:6]).any(), op
        np.testing.assert_allclose(got[[1, 4]], [0.0, 60.0], atol=1e-6, err_msg=op)


@pytest.mark.parametrize("dtype", [F32, F16])
def test_bias_add(dtype):
    x, bias, skip = rand(2, 6, 8, dtype=dtype), rand(8, dtype=dtype), rand(2, 6, 8, dtype=dtype)
    (got,) = ours(model("BiasAdd", [x, bias, skip]), [x, bias, skip])
    expected = x.astype(F64) + bias.astype(F64) + skip.astype(F64)
    close(got, expected.astype(dtype))


@pytest.mark.parametrize("dtype", [F32, F16])
def test_bias_split_gelu(dtype):
    x, bias = rand(2, 5, 12, dtype=dtype, low=-3, high=3), rand(12, dtype=dtype)
    (got,) = ours(model("BiasSplitGelu", [x, bias]), [x, bias])
    total = x.astype(F64) + bias.astype(F64)
    assert got.shape == (2, 5, 6)
    close(got, (total[..., :6] * _gelu(total[..., 6:])).astype(dtype))


@pytest.mark.parametrize("op,inputs,expect", [
    ("BiasGelu", [rand(2, 4), rand(2, 4)], "expected (4,)"),
    ("FastGelu", [rand(2, 4), rand(3)], "expected (4,)"),
    ("BiasAdd", [rand(2, 3, 4), rand(4), rand(2, 3, 5)], "must both be (N, S, C)"),
    ("BiasSplitGelu", [rand(2, 3, 5), rand(5)], "even hidden size"),
])
def test_bad_inputs_raise_typed_errors(op, inputs, expect):
    with pytest.raises(OnnxRuntimeError, match=rf"{op.lower()}_node.*{op}.*{re.escape(expect)}"):
        ours(model(op, inputs), inputs)


@pytest.mark.parametrize("op,inputs", [
    ("Gelu", [rand(2, 3)]), ("BiasGelu", [rand(2, 3), rand(3)]), ("FastGelu", [rand(2, 3)]),
    ("QuickGelu", [rand(2, 3)]), ("BiasAdd", [rand(1, 2, 3), rand(3), rand(1, 2, 3)]),
    ("BiasSplitGelu", [rand(1, 2, 4), rand(4)]),
])
def test_placed_on_cpu(op, inputs):
    placed_on_cpu(op, inputs)

