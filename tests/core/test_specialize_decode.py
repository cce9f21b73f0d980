"""A decode loop after a prefill: the step's one-token dimension stays 1 in the template that serves every
later step (the past's length symbolic), so what depends on the token's shape folds and fuses."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
from model_helpers import decode_concat_model


def _feeds(seq, past, rng):
    return {"x": rng.standard_normal((1, seq, 4)).astype(np.float32),
            "past": rng.standard_normal((1, past, 4)).astype(np.float32)}


def test_the_decode_steps_token_dimension_stays_one_in_the_template():
    sess = ort.InferenceSession(decode_concat_model(), providers=["cpu"])
    rng = np.random.default_rng(0)
    sess.run(None, _feeds(3, 0, rng))  # the prefill
    for past in (3, 4, 5, 8):  # then one token at a time
        feeds = _feeds(1, past, rng)
        y, present = sess.run(None, feeds)
        want_present = np.concatenate((feeds["past"], feeds["x"]), 1).astype(np.float64)
        np.testing.assert_allclose(present, want_present, rtol=0, atol=0)
        np.testing.assert_allclose(y, feeds["x"] + want_present.sum(1, keepdims=True), rtol=1e-6, atol=1e-6)
    prefill, step = sess.graph_for(_feeds(3, 0, rng)), sess.graph_for(_feeds(1, 8, rng))
    assert sess.graph_for(_feeds(1, 30, rng)) is step and step is not prefill  # one plan serves every step
    ops = [node.op_type for node in step.nodes]
    # The token's length stays 1 in it (the past's is symbolic): x's shape folds into the Expand's target.
    assert "Shape" not in ops and "Concat" in ops, ops


def test_a_length_that_leaves_one_becomes_symbolic():
    sess = ort.InferenceSession(decode_concat_model(), providers=["cpu"])
    rng = np.random.default_rng(1)
    for seq in (1, 5, 6):
        feeds = _feeds(seq, 2, rng)
        y, present = sess.run(None, feeds)
        want_present = np.concatenate((feeds["past"], feeds["x"]), 1).astype(np.float64)
        np.testing.assert_allclose(y, feeds["x"] + want_present.sum(1, keepdims=True), rtol=1e-6, atol=1e-6)
    # The sequence length is symbolic: one plan serves the later lengths, Shape(x) read at run time.
    later = sess.graph_for(_feeds(7, 2, rng))
    assert sess.graph_for(_feeds(9, 2, rng)) is later and "Shape" in [n.op_type for n in later.nodes]
