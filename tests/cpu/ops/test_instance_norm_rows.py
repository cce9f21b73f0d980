"""InstanceNormalization of contiguous float32/float64 planes runs each (image, channel) plane as a row of the
compiled LayerNormalization loop, with the node's per-channel scale and bias after (skipped where they are the
constants 1 and 0). GroupNorm as the TorchScript exporter writes it (wav2vec2's feature extractor: Reshape to
(N, groups, -1), InstanceNormalization of ones and zeros, Reshape back, the affine in a Mul and an Add), and a
plain InstanceNormalization with its own affine, against a float64 reference within float32's error bound."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.compiled import transformer
from reference64 import gamma, run_float64


def _group_norm_model(channels: int, groups: int):
    rng = np.random.default_rng(3)
    consts = [numpy_helper.from_array(np.array([0, groups, -1], np.int64), "grouped"),
              numpy_helper.from_array(np.ones(groups, np.float32), "ones"),
              numpy_helper.from_array(np.zeros(groups, np.float32), "zeros"),
              numpy_helper.from_array(rng.standard_normal((channels, 1)).astype(np.float32), "gamma"),
              numpy_helper.from_array(rng.standard_normal((channels, 1)).astype(np.float32), "beta")]
    nodes = [helper.make_node("Reshape", ["x", "grouped"], ["planes"]),
             helper.make_node("InstanceNormalization", ["planes", "ones", "zeros"], ["normalized"], epsilon=1e-5),
             helper.make_node("Shape", ["x"], ["shape"]),
             helper.make_node("Reshape", ["normalized", "shape"], ["back"]),
             helper.make_node("Mul", ["back", "gamma"], ["scaled"]),
             helper.make_node("Add", ["scaled", "beta"], ["y"])]
    return make_model(nodes, [tensor_info("x", TensorProto.FLOAT, ["batch", channels, "frames"])],
                      [tensor_info("y", TensorProto.FLOAT, None)], consts)


def _instance_norm_model(channels: int):
    rng = np.random.default_rng(4)
    consts = [numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "scale"),
              numpy_helper.from_array(rng.standard_normal(channels).astype(np.float32), "bias")]
    node = helper.make_node("InstanceNormalization", ["x", "scale", "bias"], ["y"], epsilon=1e-3)
    return make_model([node], [tensor_info("x", TensorProto.FLOAT, ["batch", channels, "h", "w"])],
                      [tensor_info("y", TensorProto.FLOAT, None)], consts)


@pytest.mark.parametrize(("model", "shapes", "per_group"), [
    (_group_norm_model(32, 32), [(1, 32, 319), (1, 32, 319), (2, 32, 139)], 1),  # wav2vec2: a channel per group
    (_group_norm_model(12, 4), [(2, 12, 50), (2, 12, 50)], 3),  # three channels per group
    (_instance_norm_model(6), [(2, 6, 5, 7), (2, 6, 5, 7), (1, 6, 9, 3)], 1),  # its own scale and bias
], ids=["groupnorm-32", "groupnorm-4", "instance-affine"])
def test_instance_norm_rows_within_float64(monkeypatch, model, shapes, per_group):
    rows = 0
    real = transformer.layer_norm

    def counted(*args):
        nonlocal rows
        rows += 1
        return real(*args)

    monkeypatch.setattr(transformer, "layer_norm", counted)
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])
    rng = np.random.default_rng(5)
    for shape in shapes:
        x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
        (y,) = sess.run(None, {"x": x})
        exact = run_float64(model, {"x": x})[0]
        plane = int(np.prod(shape[2:])) * per_group
        # statistics of ``plane`` terms, then one scale and one shift: gamma(plane) of the output's magnitude
        bound = 4 * gamma(plane + 4) * (1 + np.abs(exact).max())
        assert y.dtype == np.float32 and y.shape == exact.shape
        assert np.abs(y - exact).max() <= bound
    assert rows == len(shapes)  # every call by the compiled rows
