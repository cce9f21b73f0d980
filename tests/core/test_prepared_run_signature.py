"""A prepared host run (a decode loop's) names its executor from the shapes it fed its bindings at, put in the
model's input order, instead of reading each feed's shape again: the same executor executor_for(feeds) gives, for
bindings listed in any order, step after step as the lengths change; a session whose inputs a run does not bind
each once keeps executor_for."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper
from onnx_runtime import DeviceBindingSpec, InferenceSession


def _session() -> InferenceSession:
    # (inputs in the order scale, past, new: the bindings below are listed otherwise)
    nodes = [helper.make_node("Concat", ["past", "new"], ["present"], axis=2),
             helper.make_node("Mul", ["present", "scale"], ["scaled"]),
             helper.make_node("ReduceSum", ["scaled"], ["total"], keepdims=0)]
    model = make_model(nodes, [tensor_info("scale", shape=[1, 1, "m", 1]), tensor_info("past", shape=[1, 2, "n", 4]),
                               tensor_info("new", shape=[1, 2, 1, 4])],
                       [tensor_info("present", shape=[1, 2, "m", 4]), tensor_info("total", shape=[])])
    return InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_the_executor_comes_from_the_fed_shapes_in_the_models_input_order(monkeypatch):
    session = _session()
    specializer = session._specializer  # noqa: SLF001 (white box: which lookup the run asks)
    assert specializer is not None
    asked, by_feeds = [], []
    by_signature = specializer.executor_for_signature
    monkeypatch.setattr(specializer, "executor_for_signature", lambda signature: asked.append(signature) or
                        by_signature(signature))
    plain = specializer.executor_for
    monkeypatch.setattr(specializer, "executor_for", lambda feeds: by_feeds.append(feeds) or plain(feeds))
    past = session.device_io_binding(DeviceBindingSpec.input(
        "past", np.float32, (1, 2, 8, 4), (1, 2, 0, 4), output_name="present", expose_logical_input_shape=True,
        fixed_physical_strides=True))
    new = session.device_io_binding(DeviceBindingSpec.input("new", np.float32, (1, 2, 1, 4)))
    scale = session.device_io_binding(DeviceBindingSpec.input("scale", np.float32, (1, 1, 8, 1), (1, 1, 1, 1),
                                                              expose_logical_input_shape=True))
    run = session.prepare_device_binding_run([new, past, scale], output_names=["total"])
    rng = np.random.default_rng(4)
    rows = np.zeros((1, 2, 0, 4), np.float32)
    for step in range(5):
        row = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
        weights = rng.uniform(0.5, 2.0, (1, 1, step + 1, 1)).astype(np.float32)
        new.host_array()[:] = row.ravel()
        scale.set_logical_shape(weights.shape)
        scale.host_array()[: weights.size] = weights.ravel()
        (total,) = run()
        rows = np.concatenate((rows, row), axis=2)
        exact = float((rows.astype(np.float64) * weights).sum())
        assert abs(float(total) - exact) <= 1e-5 * (1 + float(np.abs(rows).sum() * 2)), step
        np.testing.assert_array_equal(past.read_logical(), rows)
        # (the signature is the model's order: scale, past, new)
        assert asked[-1] == ((1, 1, step + 1, 1), (1, 2, step, 4), (1, 2, 1, 4)), step
    assert len(asked) == 5 and by_feeds == []
    session.close()


def test_a_run_not_binding_every_input_once_keeps_executor_for():
    session = _session()
    specializer = session._specializer  # noqa: SLF001
    assert specializer is not None
    order = specializer.signature_order(("new", "past", "scale"))
    assert order is not None and order(("n", "p", "s")) == ("s", "p", "n")
    assert specializer.signature_order(("new", "past")) is None  # (an input fed, not bound)
    assert specializer.signature_order(("new", "past", "scale", "past")) is None
    assert specializer.signature_order(("new", "past", "other")) is None
    session.close()


def test_one_input_gives_a_one_shape_signature():
    model = make_model([helper.make_node("Relu", ["x"], ["y"])], [tensor_info("x", shape=["n"])],
                       [tensor_info("y", shape=["n"])])
    session = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    specializer = session._specializer  # noqa: SLF001
    if specializer is None:
        pytest.skip("no specializer for this session")
    assert specializer.signature_order(("x",))(((3,),)) == ((3,),)
    session.close()
