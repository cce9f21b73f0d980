"""Dropout, Gelu and the error function against onnx's reference evaluator and float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
from node_reference import F16, F32, F64, check, ours, rand
from onnx_runtime.errors import InvalidGraphError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.registry import lookup

# -- Dropout -------------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", [7, 10, 12, 13, 22])
def test_dropout_inference(opset):
    x = rand(3, 4)
    check("Dropout", [x], {}, opset, n_outputs=2, expected=None if opset >= 10 else [x, np.ones_like(x)])
    check("Dropout", [x], {}, opset)


def test_dropout_old_opsets_and_training_mode():
    x = rand(2, 5)
    check("Dropout", [x], {"is_test": 1, "ratio": 0.3}, 1, expected=[x])
    check("Dropout", [x], {"ratio": 0.2}, 6, n_outputs=2, expected=[x, np.ones_like(x)])
    check("Dropout", [x, np.array(0.4, F32), np.array(False)], {}, 13, n_outputs=2)
    y, mask = ours("Dropout", [rand(50, 40), np.array(0.5, F32), np.array(True)], {"seed": 3}, 13, 2)
    assert mask.dtype == np.bool_ and 0.3 < mask.mean() < 0.7
    assert np.all(y[~mask] == 0)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [F32, F16, F64])
def test_gelu(approximate, dtype):
    x = np.concatenate([rand(40, dtype=dtype, low=-6, high=6), np.array([0, -0.0, 1e-30, 7, -9], dtype)])
    expected = None
    if dtype == F64 and approximate == "none":
        # The reference's Erf rounds through float32; float64 Gelu must be exact to double precision.
        expected = [np.array([0.5 * v * (1 + math.erf(v / math.sqrt(2))) for v in x])]
    check("Gelu", [x], {"approximate": approximate}, 20, expected=expected)


def test_erf_is_accurate_in_float64_and_float32():
    from onnx_runtime_ep_cpu.algorithms.erf import erf_float32, erf_float64

    x = np.concatenate([np.linspace(-7, 7, 20001), [0.0, 1e-300, -1e-10, np.inf, -np.inf]])
    expected = np.array([math.erf(v) for v in x])
    np.testing.assert_allclose(erf_float64(x), expected, rtol=1e-14, atol=1e-15)
    assert np.isnan(erf_float64(np.array([np.nan])))[0]
    # The Erf operator's float64 path is this one; its float32 path stays within float32 precision.
    erf = lookup("Erf", "", 13)(Node("Erf", ["x"], ["y"], name="erf", opset=13), [x.shape], 13)
    np.testing.assert_array_equal(erf(x)[0], erf_float64(x))
    np.testing.assert_allclose(erf_float32(x.astype(np.float32)), expected, atol=4e-7)


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(InvalidGraphError, match="approximate"):
        ours("Gelu", [rand(3)], {"approximate": "fast"}, 20)
