"""A decode loop's feeds grow every step: an array whose dtype, rank and fixed dimensions match the declaration
is taken without the general check at every new shape, and anything else still meets that check (its typed
error names the input, the expectation and the fix)."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.session import inference_session


def _session() -> ort.InferenceSession:
    model = make_model([helper.make_node("Concat", ["past", "new"], ["present"], axis=2)],
                       [tensor_info("past", TensorProto.FLOAT, [1, 2, "past", 4]),
                        tensor_info("new", TensorProto.FLOAT, [1, 2, 1, 4])],
                       [tensor_info("present", TensorProto.FLOAT, None)])
    return ort.InferenceSession(model.SerializeToString(), providers=["cpu"])


def test_growing_feeds_skip_the_general_check(monkeypatch):
    sess = _session()
    calls = []
    general = inference_session._check_feed  # noqa: SLF001  (counted: white box)
    monkeypatch.setattr(inference_session, "_check_feed", lambda *args: calls.append(args[0]) or general(*args))
    rng = np.random.default_rng(0)
    new = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
    for length in range(300):  # more new shapes than the cache of checked shapes holds
        past = rng.standard_normal((1, 2, length, 4)).astype(np.float32)
        present = sess.run(None, {"past": past, "new": new})[0]
        np.testing.assert_allclose(present.astype(np.float64), np.concatenate([past, new], axis=2), rtol=0, atol=0)
    assert calls == []


@pytest.mark.parametrize(("past", "message"), [
    (np.zeros((1, 2, 3, 4), np.float64), r"input 'past' expects tensor\(float\), got float64 array.*astype"),
    (np.zeros((1, 3, 3, 4), np.float32), r"input 'past' dimension 1 must be 2"),
    (np.zeros((2, 3, 4), np.float32), r"input 'past' expects rank 4"),
    (np.zeros((1, 2, 3, 4), np.int64), r"input 'past' expects tensor\(float\), got int64 array"),
])
def test_other_feeds_still_meet_the_general_check(past, message):
    sess = _session()
    new = np.zeros((1, 2, 1, 4), np.float32)
    sess.run(None, {"past": np.zeros((1, 2, 5, 4), np.float32), "new": new})
    with pytest.raises(InvalidArgumentError, match=message):
        sess.run(None, {"past": past, "new": new})


def test_a_list_feed_is_still_converted():
    sess = _session()
    present = sess.run(None, {"past": [[[[1.0] * 4]] * 2], "new": np.zeros((1, 2, 1, 4), np.float32)})[0]
    assert present.shape == (1, 2, 2, 4) and present.dtype == np.float32
