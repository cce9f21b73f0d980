"""The training optimizers' learning-rate arithmetic at attributes that zero its divisor (Adam's alpha 1, Adagrad's
decay -1/T) or leave its square root's domain (Adam's beta past 1): the kernels give the inf or NaN that onnx's
reference computes in numpy, never Python's ZeroDivisionError or math domain error (fuzz seed 86 found Adam's)."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

TRAINING = "ai.onnx.preview.training"


def _model(op: str, attrs: dict):
    outputs = ["x_new", "h_new"] if op == "Adagrad" else ["x_new", "v_new", "h_new"]
    inputs = ["r", "t", "x", "g", "h"] if op == "Adagrad" else ["r", "t", "x", "g", "v", "h"]
    node = helper.make_node(op, inputs, outputs, domain=TRAINING, **attrs)
    infos = [helper.make_tensor_value_info("r", TensorProto.FLOAT, []),
             helper.make_tensor_value_info("t", TensorProto.INT64, [])]
    infos += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in inputs[2:]]
    graph = helper.make_graph([node], "g", infos, [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3])
                                                   for n in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)])


@pytest.mark.parametrize(("op", "attrs"), [("Adam", {"alpha": 1.0}), ("Adam", {"beta": 1.5}),
                                           ("Adagrad", {"decay_factor": -1.0})])
def test_a_zeroed_divisor_or_a_root_of_a_negative_gives_the_references_inf_or_nan(op, attrs):
    model = _model(op, attrs)
    feeds = {"r": np.array(0.1, np.float32), "t": np.array(1, np.int64),
             "x": np.array([1.0, -2.0, 0.5], np.float32), "g": np.array([0.3, 0.0, -1.0], np.float32)}
    feeds.update({n: np.array([0.2, 0.1, 0.4], np.float32) for n in ("v", "h") if n in model.graph.node[0].input})
    options = ort.SessionOptions()
    options.add_session_config_entry("session.compile_in_background", "0")
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    with np.errstate(all="ignore"):
        got = session.run(None, feeds)
        expected = ReferenceEvaluator(model).run(None, feeds)
    assert not all(np.isfinite(x).all() for x in got[:1])  # (the rate itself is inf or NaN)
    for ours, reference in zip(got, expected):
        np.testing.assert_allclose(ours, reference, rtol=1e-6, equal_nan=True)
