"""QuantizedMatMul of two activations (attention's stacked products, B fed each call): a call with the last call's
A and B shapes and types and the same constant parameters runs the compiled loop from the kept arguments, reading
the new A and B; any other call goes through the checks. Each result is the exact integer product requantized
once (float64 of the same codes)."""
from __future__ import annotations

import numpy as np
import pytest
from model_helpers import read_only
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops.qdq_linear import quantized_matmul

F32 = np.float32


PARAMS = (read_only(0.04, F32), read_only(128, np.uint8), read_only(0.02, F32), read_only(120, np.uint8),
          read_only(0.5, F32), read_only(100, np.uint8))


def _want(a, b, params=PARAMS):
    a_scale, a_zero, b_scale, b_zero, y_scale, y_zero = params
    aq = np.clip(np.rint(a / a_scale) + a_zero.astype(F32), 0, 255) - float(a_zero)
    bq = np.clip(np.rint(b / b_scale) + b_zero.astype(F32), 0, 255) - float(b_zero)
    multiplier = np.float64(a_scale) * np.float64(b_scale) / np.float64(y_scale)
    codes = np.clip(np.rint(np.matmul(aq.astype(np.float64), bq) * multiplier) + float(y_zero), 0, 255)
    return ((codes - float(y_zero)) * y_scale).astype(F32)


def _kernel():
    node = Node("QuantizedMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"], name="scores",
                domain=FUSED_DOMAIN, attrs={"quantize_a": 1, "quantize_b": 1, "dequantize": 1}, opset=1)
    return quantized_matmul(node, [None] * 8, 1)


def _call(kernel, a, b, params=PARAMS):
    a_scale, a_zero, b_scale, b_zero, y_scale, y_zero = params
    return kernel(a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero)[0]


def test_repeated_stacked_calls_read_new_operands_and_stay_exact():
    kernel, rng = _kernel(), np.random.default_rng(7)
    for shapes in [((2, 3, 4, 8), (2, 3, 8, 5))] * 3 + [((2, 3, 1, 8), (2, 3, 8, 5)), ((2, 3, 4, 8), (2, 3, 8, 6)),
                                                         ((1, 3, 4, 8), (2, 3, 8, 5))]:
        a = (rng.standard_normal(shapes[0]) * 3).astype(F32)
        b = (rng.standard_normal(shapes[1]) * 2).astype(F32)
        a.reshape(-1)[:2] = [1e4, 0.5 * 0.04]  # saturation, a tie
        np.testing.assert_array_equal(_call(kernel, a, b), _want(a, b))
        np.testing.assert_array_equal(_call(kernel, a, b), _want(a, b))  # the kept call
        batch_equal = shapes[0][:-2] == shapes[1][:-2]
        assert (kernel.stacked.match(a, (*PARAMS[:4], *PARAMS[4:], None)) is not None) == batch_equal


def test_other_parameters_or_types_after_a_kept_call_are_checked():
    kernel, rng = _kernel(), np.random.default_rng(8)
    a = rng.standard_normal((2, 4, 8)).astype(F32)
    b = rng.standard_normal((2, 8, 5)).astype(F32)
    _call(kernel, a, b)
    other = (read_only(0.03, F32), *PARAMS[1:])
    np.testing.assert_array_equal(_call(kernel, a, b, other), _want(a, b, other))
    with pytest.raises(OnnxRuntimeError, match="float32"):
        _call(kernel, a, b.astype(np.float64))
