"""Memory high-water of repeated session creation: a session dropped before the next is created must not be
alive beside it. Its weights and plans hang off reference cycles, and creation pauses the collector, so
without a collection first every create/destroy cycle held two sessions at its peak (light_resnet50 over 20
cycles: 622 MB against onnxruntime's 361 MB; 350 MB with the collection)."""

from __future__ import annotations

import gc

import numpy as np
from model_helpers import light_model
from onnx_runtime import InferenceSession


def test_a_dropped_session_is_collected_before_the_next_one_is_created():
    model, name, shape = light_model("light_squeezenet")
    data = model.SerializeToString()
    feed = {name: np.zeros(shape, np.float32)}
    InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feed)
    session = InferenceSession(data, providers=["CPUExecutionProvider"])
    session.run(None, feed)
    gc.collect()
    del session  # its cycles (over a thousand objects) are garbage now, not yet collected
    assert gc.isenabled()
    kept = InferenceSession(data, providers=["CPUExecutionProvider"])
    assert gc.collect() < 50, "the dropped session's cycles were still alive through the next creation"
    kept.run(None, feed)
