"""BatchNormalization (inference, training, fused), InstanceNormalization, LayerNormalization,
GroupNormalization and LRN against onnx's reference evaluator."""

from __future__ import annotations

import numpy as np
import pytest
from node_reference import F16, F32, F64, check, ours, rand, reference
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.ops import normalization

# -- normalization -------------------------------------------------------------------------------


def _bn_inputs(shape, dtype=F32):
    c = shape[1]
    return [rand(*shape, dtype=dtype), rand(c, dtype=dtype), rand(c, dtype=dtype),
            rand(c, dtype=dtype), rand(c, dtype=dtype, low=0.1, high=2.0)]


@pytest.mark.parametrize("opset,attrs", [
    (1, {"is_test": 1, "consumed_inputs": [0, 0, 0, 1, 1]}),
    (6, {"is_test": 1, "epsilon": 1e-3}),
    (7, {"spatial": 1}),
    (9, {"momentum": 0.8}),
    (14, {"training_mode": 0}),
    (15, {"epsilon": 1e-2}),
])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 4), (1, 2, 3, 2, 2)])
def test_batch_normalization_inference(opset, attrs, shape):
    # The reference runs opset 6-13 in training mode whenever momentum is set; inference semantics
    # are the same in every version, so opset 15's reference (training_mode=0) is the oracle.
    inputs = _bn_inputs(shape)
    expected = reference("BatchNormalization", inputs, {"epsilon": attrs.get("epsilon", 1e-5)}, 15)
    check("BatchNormalization", inputs, attrs, opset, expected=expected)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 2, 40, 33), (3, 4)])
def test_fused_batchnorm_relu_special_values(shape):
    # The same values as BatchNormalization then Relu, NaN and infinities included.
    x, *stats = _bn_inputs(shape)
    x.flat[:4] = [np.nan, np.inf, -np.inf, 0.0]
    node = Node("FusedBatchNormalization", ["x", "s", "b", "m", "v"], ["y"], name="f",
                attrs={"activation": "Relu"}, opset=1)
    (fused,) = normalization.fused_batch_normalization(node, [None] * 5, 1)(x, *stats)
    (normalized,) = ours("BatchNormalization", [x, *stats], {}, 15)
    np.testing.assert_array_equal(fused, np.maximum(normalized, 0))
    assert np.isnan(fused.flat[0]) and (fused >= 0).sum() == fused.size - 1


def test_batch_normalization_half_and_training():
    check("BatchNormalization", _bn_inputs((2, 3, 4, 4), F16), {}, 15)
    attrs = {"training_mode": 1, "momentum": 0.7}
    check("BatchNormalization", _bn_inputs((3, 2, 4, 3)), attrs, 15, n_outputs=3)


def test_batch_normalization_training_outputs_before_14():
    # Opset 9 names its training outputs (mean, var, saved_mean, saved_var); the reference has no
    # such kernel, so the running stats come from opset 15's and the batch stats from numpy.
    inputs = _bn_inputs((3, 2, 4, 3))
    y, run_mean, run_var = reference("BatchNormalization", inputs, {"training_mode": 1}, 15, 3)
    x = inputs[0]
    expected = [y, run_mean, run_var, x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))]
    check("BatchNormalization", inputs, {}, 9, n_outputs=5, expected=expected)


def test_batch_normalization_inference_passes_running_stats_through():
    inputs = _bn_inputs((2, 3, 4))
    (y,) = reference("BatchNormalization", inputs, {}, 15)
    check("BatchNormalization", inputs, {}, 15, n_outputs=3, expected=[y, inputs[3], inputs[4]])
    check("BatchNormalization", inputs, {"is_test": 1}, 6, n_outputs=3, expected=[y, inputs[3], inputs[4]])


def test_batch_normalization_per_activation_before_9():
    # spatial=0 (opset 7): statistics and parameters per (C, D1, ...) activation.
    x, (s, b, m) = rand(2, 3, 4), (rand(3, 4) for _ in range(3))
    v = rand(3, 4, low=0.1, high=2.0)
    expected = (s * (x - m) / np.sqrt(v + 1e-5) + b).astype(F32)
    check("BatchNormalization", [x, s, b, m, v], {"spatial": 0}, 7, expected=[expected])


@pytest.mark.parametrize("opset", [1, 6, 22])
@pytest.mark.parametrize("shape,dtype", [((2, 3, 5, 4), F32), ((1, 2, 7), F16), ((1, 2, 3, 2, 4), F64)])
def test_instance_normalization(opset, shape, dtype):
    x, s, b = rand(*shape, dtype=dtype), rand(shape[1], dtype=dtype), rand(shape[1], dtype=dtype)
    check("InstanceNormalization", [x, s, b], {"epsilon": 1e-3}, opset, ref_opset=max(opset, 6))


@pytest.mark.parametrize("axis", [-1, 1, 0, -2])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_normalization(axis, with_bias):
    x = rand(2, 3, 4, 5)
    norm_shape = x.shape[axis % 4:]
    scale, bias = rand(*norm_shape), rand(*norm_shape) if with_bias else None
    check("LayerNormalization", [x, scale, bias], {"axis": axis, "epsilon": 1e-3}, 17, n_outputs=3)


def test_layer_normalization_half_and_broadcast_scale():
    x, scale, bias = rand(3, 4, 6, dtype=F16), rand(6, dtype=F16), rand(6, dtype=F16)
    check("LayerNormalization", [x, scale, bias], {}, 17)
    # Mean and InvStdDev are float32 (the stash type) whatever the input precision.
    _, mean, inv_std = ours("LayerNormalization", [x, scale, bias], {}, 17, n_outputs=3)
    assert mean.dtype == inv_std.dtype == np.float32 and mean.shape == (3, 4, 1)
    x, scale = rand(2, 3, 4), rand(1, 4)  # scale broadcasts over the normalized [3, 4]
    check("LayerNormalization", [x, scale], {"axis": 1}, 17)


@pytest.mark.parametrize("opset", [18, 21])
@pytest.mark.parametrize("shape,groups", [((2, 6, 4, 3), 3), ((1, 4, 5), 1), ((2, 4, 2, 2, 3), 4)])
def test_group_normalization(opset, shape, groups):
    params = groups if opset == 18 else shape[1]
    inputs = [rand(*shape), rand(params), rand(params)]
    check("GroupNormalization", inputs, {"num_groups": groups, "epsilon": 1e-3}, opset)


def test_group_normalization_rejects_uneven_groups():
    with pytest.raises(InvalidArgumentError, match="groups"):
        ours("GroupNormalization", [rand(1, 5, 3), rand(5), rand(5)], {"num_groups": 2}, 21)
    with pytest.raises(InvalidGraphError, match="num_groups"):
        ours("GroupNormalization", [rand(1, 4, 3), rand(4), rand(4)], {}, 21)


@pytest.mark.parametrize("opset", [1, 13])
@pytest.mark.parametrize("attrs", [
    {"size": 3}, {"size": 2, "alpha": 0.01, "beta": 0.5, "bias": 2.0}, {"size": 5, "alpha": 0.1},
])
def test_lrn(opset, attrs):
    # The reference loops over the batch dim where it means channels; with N == C it is right.
    check("LRN", [rand(5, 5, 3, 4)], attrs, opset, ref_opset=13)


def test_lrn_half_precision():
    check("LRN", [rand(4, 4, 3, 3, dtype=F16)], {"size": 3}, 13)
