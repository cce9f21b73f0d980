"""com.microsoft FusedMatMul and FusedConv against onnxruntime's CPU provider, and that they stay apart from
the provider's own FusedMatMul/FusedConv (its fusions' private domain)."""

from __future__ import annotations

import numpy as np
import pytest
from contrib_oracle import F16, F32, close, compare, model, oracle, ours, placed_on_cpu, rand
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.registry import lookup

# -- FusedMatMul ---------------------------------------------------------------------------------


@pytest.mark.parametrize("a_shape,b_shape,attrs", [
    ((3, 4), (4, 5), {}),
    ((4, 3), (4, 5), {"transA": 1}),
    ((3, 4), (5, 4), {"transB": 1, "alpha": 0.5}),
    ((4, 3), (5, 4), {"transA": 1, "transB": 1, "alpha": -2.0}),
    ((2, 3, 4), (2, 4, 5), {}),
    ((1, 3, 4), (2, 4, 5), {"alpha": 3.0}),
    ((2, 3, 4), (4, 5), {"transA": 0}),
    ((3, 2, 4), (2, 4, 5), {"transBatchA": 1}),
    ((2, 3, 4), (4, 2, 5), {"transBatchB": 1}),
    ((4, 2, 3), (2, 4, 5), {"transBatchA": 1, "transA": 1}),
    ((2, 3, 4), (5, 2, 4), {"transBatchB": 1, "transB": 1}),
    ((3, 2, 5, 4), (2, 5, 4, 6), {"transBatchA": 1}),
    ((4, 2, 5, 3), (6, 2, 5, 4), {"transBatchA": 1, "transA": 1, "transBatchB": 1, "transB": 1, "alpha": 0.25}),
    ((4,), (4, 5), {"transA": 1}),
    ((3, 4), (4,), {"transB": 1}),
])
@pytest.mark.parametrize("dtype", [F32, F16, np.float64])
def test_fused_matmul(a_shape, b_shape, attrs, dtype):
    compare("FusedMatMul", [rand(*a_shape, dtype=dtype), rand(*b_shape, dtype=dtype)], attrs, scale=4)


@pytest.mark.parametrize("a_shape,b_shape,attrs,expect", [
    ((3, 2, 4), (4, 5), {"transBatchA": 1}, "need A and B of one rank >= 3"),
    ((3, 4), (5, 4), {}, "do not multiply"),
])
def test_fused_matmul_bad_shapes(a_shape, b_shape, attrs, expect):
    inputs = [rand(*a_shape), rand(*b_shape)]
    with pytest.raises(OnnxRuntimeError, match=rf"fusedmatmul_node.*FusedMatMul.*{expect}"):
        ours(model("FusedMatMul", inputs, attrs), inputs)


def test_contrib_and_private_fused_ops_are_separate_registrations():
    for op in ("FusedMatMul", "FusedConv"):
        assert lookup(op, "com.microsoft", 1) is not lookup(op, FUSED_DOMAIN, 1)


# -- FusedConv -----------------------------------------------------------------------------------

_ACTIVATIONS = [
    {},
    {"activation": "Relu"},
    {"activation": "Tanh"},
    {"activation": "Sigmoid"},
    {"activation": "LeakyRelu", "activation_params": [0.2]},
    {"activation": "Clip", "activation_params": [-0.3, 0.4]},
    {"activation": "HardSigmoid", "activation_params": [0.3, 0.45]},
]


@pytest.mark.parametrize("attrs", _ACTIVATIONS)
@pytest.mark.parametrize("inputs", ["x w", "x w b", "x w b z", "x w - z"])
def test_fused_conv_activations_and_optional_inputs(attrs, inputs):
    x, w, b, z = rand(2, 4, 7, 6), rand(6, 4, 3, 3), rand(6), rand(2, 6, 5, 4)
    chosen = {"x": x, "w": w, "b": b, "z": z, "-": None}
    compare("FusedConv", [chosen[name] for name in inputs.split()], attrs, scale=4)


@pytest.mark.parametrize("conv_attrs", [
    {"pads": [1, 1, 1, 1], "strides": [2, 2]},
    {"dilations": [2, 1], "group": 2, "kernel_shape": [3, 3]},
    {"auto_pad": "SAME_UPPER"},
])
def test_fused_conv_conv_attributes(conv_attrs):
    x, w = rand(1, 4, 9, 8), rand(6, 4 // conv_attrs.get("group", 1), 3, 3)
    compare("FusedConv", [x, w, rand(6)], {"activation": "Relu", **conv_attrs}, scale=4)


def test_fused_conv_float16_and_1d():
    compare("FusedConv", [rand(1, 3, 6, 6, dtype=F16), rand(4, 3, 3, 3, dtype=F16), rand(4, dtype=F16)],
            {"activation": "Relu"})
    compare("FusedConv", [rand(2, 3, 10), rand(5, 3, 3), rand(5)], {"activation": "Sigmoid", "pads": [1, 1]})


def test_fused_conv_double_against_float32_oracle():
    # onnxruntime's CPU provider has FusedConv for float only: the double result is checked against it.
    x, w, b, z = rand(1, 3, 6, 6), rand(4, 3, 3, 3), rand(4), rand(1, 4, 4, 4)
    attrs = {"activation": "LeakyRelu", "activation_params": [0.1]}
    wide = [t.astype(np.float64) for t in (x, w, b, z)]
    (got,) = ours(model("FusedConv", wide, attrs), wide)
    (expected,) = oracle(model("FusedConv", [x, w, b, z], attrs), [x, w, b, z])
    close(got, expected.astype(np.float64), dtype=F32, scale=4)


def test_fused_conv_unknown_activation():
    inputs = [rand(1, 2, 4, 4), rand(3, 2, 3, 3)]
    with pytest.raises(OnnxRuntimeError, match=r"fusedconv_node.*FusedConv.*'activation' is 'Elu'"):
        ours(model("FusedConv", inputs, {"activation": "Elu"}), inputs)


def test_fused_conv_bad_z():
    inputs = [rand(1, 2, 4, 4), rand(3, 2, 3, 3), None, rand(1, 3, 3, 3)]
    with pytest.raises(OnnxRuntimeError, match=r"fusedconv_node.*Z has shape \(1, 3, 3, 3\)"):
        ours(model("FusedConv", inputs), inputs)


@pytest.mark.parametrize("op,inputs", [("FusedMatMul", [rand(2, 3), rand(3, 2)]),
                                       ("FusedConv", [rand(1, 2, 4, 4), rand(3, 2, 3, 3)])])
def test_placed_on_cpu(op, inputs):
    placed_on_cpu(op, inputs)
