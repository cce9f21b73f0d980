"""A run's feeds checked by one generated function (inference_session._all_feeds_check): a dict holding exactly the
model's inputs, each an array of its declared dtype, rank and fixed dimensions, is taken as it is without the
per-input checks; anything else (a wrong dtype or dimension, a missing or unknown name, a list, a dict subclass)
meets the general checks and their typed errors as before."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.session import inference_session


def _session() -> ort.InferenceSession:
    """present = Concat(past, new); ids + 1 (an int64 feed of any rank)."""
    model = make_model([helper.make_node("Concat", ["past", "new"], ["present"], axis=2),
                        helper.make_node("Add", ["ids", "one"], ["next"])],
                       [tensor_info("past", TensorProto.FLOAT, [1, 2, "past", 4]),
                        tensor_info("new", TensorProto.FLOAT, [1, 2, 1, 4]),
                        tensor_info("ids", TensorProto.INT64, None)],
                       [tensor_info("present", TensorProto.FLOAT, None), tensor_info("next", TensorProto.INT64, None)],
                       [helper.make_tensor("one", TensorProto.INT64, [], [1])])
    return ort.InferenceSession(model.SerializeToString(), providers=["cpu"])


def _feeds(length: int, rng) -> dict:
    return {"past": rng.standard_normal((1, 2, length, 4)).astype(np.float32),
            "new": rng.standard_normal((1, 2, 1, 4)).astype(np.float32),
            "ids": rng.integers(0, 9, (1, 3))}


def test_exact_array_feeds_skip_the_per_input_checks():
    sess = _session()
    sess._feed_checks = {}  # noqa: SLF001 (without the one function, every feed would meet _check_feed)
    calls: list = []
    general = inference_session._check_feed  # noqa: SLF001
    rng = np.random.default_rng(0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(inference_session, "_check_feed", lambda *args: calls.append(args[0]) or general(*args))
        for length in range(0, 40, 3):
            feeds = _feeds(length, rng)
            present, following = sess.run(None, feeds)
            np.testing.assert_array_equal(present, np.concatenate([feeds["past"], feeds["new"]], axis=2))
            np.testing.assert_array_equal(following, feeds["ids"] + 1)
    assert calls == []


def test_the_checked_feeds_are_a_new_dict_of_the_same_arrays():
    sess = _session()
    feeds = _feeds(5, np.random.default_rng(1))
    checked = sess._validate_feeds(feeds)  # noqa: SLF001
    assert checked == feeds and checked is not feeds
    assert all(checked[name] is feeds[name] for name in feeds)


@pytest.mark.parametrize(("change", "message"), [
    (lambda f: f.update(past=f["past"].astype(np.float64)), r"input 'past' expects tensor\(float\), got float64"),
    (lambda f: f.update(new=np.zeros((1, 3, 1, 4), np.float32)), r"input 'new' dimension 1 must be 2"),
    (lambda f: f.update(new=np.zeros((2, 1, 4), np.float32)), r"input 'new' expects rank 4"),
    (lambda f: f.pop("ids"), r"missing inputs 'ids'"),
    (lambda f: f.update(other=np.zeros(1, np.float32)), r"unknown input 'other'"),
])
def test_other_feeds_meet_the_general_checks(change, message):
    sess = _session()
    feeds = _feeds(4, np.random.default_rng(2))
    change(feeds)
    with pytest.raises(InvalidArgumentError, match=message):
        sess.run(None, feeds)


def test_lists_and_dict_subclasses_take_the_general_path():
    sess = _session()
    rng = np.random.default_rng(3)
    feeds = _feeds(2, rng)
    feeds["ids"] = [[1, 2, 3]]  # converted by the general check
    assert sess.run(None, feeds)[1].tolist() == [[2, 3, 4]]

    class Feeds(dict):
        pass

    feeds = Feeds(_feeds(2, rng))
    present = sess.run(None, feeds)[0]
    np.testing.assert_array_equal(present, np.concatenate([feeds["past"], feeds["new"]], axis=2))


def test_inputs_the_one_function_cannot_check_leave_it_out():
    model = make_model([helper.make_node("Identity", ["s"], ["t"])],
                       [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, None)],
                       [helper.make_tensor_sequence_value_info("t", TensorProto.FLOAT, None)], opset=17)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert sess._all_feeds_check is None  # noqa: SLF001
    value = [np.ones(2, np.float32)]
    out = sess.run(None, {"s": value})[0]
    assert len(out) == 1 and np.array_equal(out[0], value[0])


def test_a_model_without_inputs_runs_on_an_empty_feed():
    model = make_model([helper.make_node("Identity", ["c"], ["y"])], [], [tensor_info("y", TensorProto.FLOAT, None)],
                       [helper.make_tensor("c", TensorProto.FLOAT, [2], [1.0, 2.0])])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert sess.run(None, {})[0].tolist() == [1.0, 2.0]
