"""DynamicQuantizeLinear's range (compiled/quantize.value_range) over eight running pairs and a remainder: every
length and NaN/inf/-0.0 position gives numpy's [min(x, 0), max(x, 0)] without NaN (+0.0 where nothing is beyond
zero), and the quantized codes, scale and zero point stay onnxruntime's."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import pytest
from onnx import TensorProto, helper
from onnx_runtime_ep_cpu.compiled import deferred, quantize

onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")


def _expected(x: np.ndarray) -> tuple[float, float]:
    finite = x[~np.isnan(x)]
    low = min(float(finite.min()), 0.0) if finite.size else 0.0
    high = max(float(finite.max()), 0.0) if finite.size else 0.0
    return low + 0.0, high + 0.0  # (-0.0 never replaces the starting +0.0)


@pytest.mark.parametrize("length", [*range(0, 26), 63, 64, 65, 1024, 1027, 3072])
def test_range_of_every_length_and_position(length):
    deferred.wait_ready(300)
    rng = np.random.default_rng(length)
    x = rng.standard_normal(length).astype(np.float32) * 3
    cases = [x]
    for at in range(min(length, 17)):  # an extreme, a NaN and -0.0 at each lane and remainder position
        for value in (np.float32(-50), np.float32(50), np.float32(np.nan), np.float32(-np.inf), np.float32(-0.0)):
            y = x.copy()
            y[at] = value
            cases.append(y)
    if length:
        cases += [np.full(length, np.nan, np.float32), np.full(length, -0.0, np.float32), np.abs(x), -np.abs(x)]
    for y in cases:
        low, high = quantize.value_range(y)
        assert (float(low), float(high)) == _expected(y)
        assert not np.signbit(low) or low < 0


@pytest.mark.parametrize("length", [7, 64, 1000, 4099])
def test_dynamic_quantize_linear_stays_onnxruntimes(length):
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zero"])
    graph = helper.make_graph([node], "dql", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [length])],
                              [helper.make_tensor_value_info(n, t, None) for n, t in
                               (("y", TensorProto.UINT8), ("scale", TensorProto.FLOAT), ("zero", TensorProto.UINT8))])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    ours = onnx_runtime.InferenceSession(data, providers=["cpu"])
    theirs = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(length)
    for trial in range(3):
        x = (rng.standard_normal(length) * 4 + trial).astype(np.float32)
        got, want = ours.run(None, {"x": x}), theirs.run(None, {"x": x})
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
        deferred.wait_ready(300)
