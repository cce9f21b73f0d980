"""elimination in a graph specialized to one input signature: a Slice whose constant bounds cover whole static axes
is an identity, and a Concat's parts of static length 0 along its axis are left out (TorchScript's Phi-3 rotary
embedding: the head sliced into its rotated part, all of it, and an empty rest, concatenated again). The session's
own graph keeps them; outputs against numpy."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper

INT64_MAX = np.iinfo(np.int64).max
HEADS, HEAD = 4, 16


def _ints(name, values):
    return numpy_helper.from_array(np.array(values, np.int64), name)


def _rotary_model(first: tuple, rest: tuple, computed_end: bool = False, opset: int = 17):
    """y = Relu(Concat(Neg(x[..., first]), x[..., rest])) over x of shape (batch, HEADS, seq, HEAD); ``first`` and
    ``rest`` are (start, end[, step]) of the last axis. ``computed_end``: the first Slice's end is x's last
    dimension read through Shape (folded only once shapes are known), as TorchScript writes it."""
    initializers, nodes = [], []

    def slice_node(name, bounds, end_name=None):
        start, end, *step = bounds
        if opset < 10:
            attrs = {"starts": [start], "ends": [end], "axes": [3]}
            nodes.append(helper.make_node("Slice", ["x"], [name], **attrs))
            return
        initializers.extend([_ints(f"{name}_starts", [start]), _ints(f"{name}_axes", [3])])
        inputs = ["x", f"{name}_starts", end_name or f"{name}_ends", f"{name}_axes"]
        if end_name is None:
            initializers.append(_ints(f"{name}_ends", [end]))
        if step:
            initializers.append(_ints(f"{name}_steps", step))
            inputs.append(f"{name}_steps")
        nodes.append(helper.make_node("Slice", inputs, [name]))

    end_name = None
    if computed_end:
        initializers.extend([_ints("last", 3), _ints("zero_axis", [0])])
        nodes += [helper.make_node("Shape", ["x"], ["x_shape"]),
                  helper.make_node("Gather", ["x_shape", "last"], ["x_head"]),
                  helper.make_node("Unsqueeze", ["x_head", "zero_axis"], ["head_end"])]
        end_name = "head_end"
    slice_node("rot", first, end_name)
    slice_node("pass", rest)
    nodes += [helper.make_node("Neg", ["rot"], ["rotated"]),
              helper.make_node("Concat", ["rotated", "pass"], ["joined"], axis=-1),
              helper.make_node("Relu", ["joined"], ["y"])]
    x = tensor_info("x", TensorProto.FLOAT, ["batch", HEADS, "seq", HEAD])
    return make_model(nodes, [x], [tensor_info("y")], initializers, opset=opset)


def _expected(x, first, rest):
    def part(bounds):
        start, end, *step = bounds
        return x[..., slice(start, None if end >= INT64_MAX else end, step[0] if step else 1)]
    return np.maximum(np.concatenate([-part(first), part(rest)], axis=-1), 0)


def _run(model, x):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"x": x})[0]
    return session, got, [node.op_type for node in session.graph_for({"x": x}).nodes]


X = np.random.default_rng(3).standard_normal((2, HEADS, 3, HEAD)).astype(np.float32)


@pytest.mark.parametrize("first, rest, opset, computed_end", [
    ((0, HEAD), (HEAD, INT64_MAX), 17, False),         # to the static length; the rest empty
    ((0, HEAD), (HEAD, INT64_MAX), 17, True),          # the end read from the shape (TorchScript's spelling)
    ((-HEAD, HEAD), (HEAD, INT64_MAX), 17, False),     # from the end: clamps to 0
    ((-100, 100), (100, INT64_MAX), 17, False),        # bounds past both ends clamp to the axis
    ((0, HEAD, 1), (HEAD, HEAD, 1), 17, False),        # explicit steps of 1; an empty range
    ((0, HEAD), (HEAD, INT64_MAX), 9, False),          # opset 9: bounds as attributes
])
def test_whole_and_empty_slices_go_in_the_specialized_graph(first, rest, opset, computed_end):
    session, got, ops = _run(_rotary_model(first, rest, computed_end, opset), X)
    np.testing.assert_array_equal(got, _expected(X, first, rest))
    assert ops == ["Neg", "Relu"], ops
    assert "Concat" in [node.op_type for node in session.model.graph.nodes]  # the session's own graph keeps it


@pytest.mark.parametrize("first, rest, left", [
    ((0, HEAD - 1), (HEAD - 1, INT64_MAX), ["Slice", "Slice", "Neg", "Concat", "Relu"]),  # one short: two parts
    ((1, HEAD), (0, 1), ["Slice", "Slice", "Neg", "Concat", "Relu"]),                   # starts past 0
    ((0, HEAD, 2), (HEAD, INT64_MAX), ["Slice", "Neg", "Relu"]),                         # every other column
])
def test_other_slices_stay(first, rest, left):
    _, got, ops = _run(_rotary_model(first, rest), X)
    np.testing.assert_array_equal(got, _expected(X, first, rest))
    assert sorted(ops) == sorted(left), ops


def test_a_concat_keeps_its_nonempty_parts_in_order_and_one_part_when_all_are_empty():
    initializers = [_ints("starts", [HEAD]), _ints("ends", [INT64_MAX]), _ints("axes", [3])]
    nodes = [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["empty"]),
             helper.make_node("Neg", ["x"], ["negated"]),
             helper.make_node("Concat", ["x", "empty", "negated", "empty"], ["joined"], axis=3),
             helper.make_node("Concat", ["empty", "empty"], ["nothing"], axis=-1),
             helper.make_node("Relu", ["joined"], ["y"]), helper.make_node("Abs", ["nothing"], ["z"])]
    x = tensor_info("x", TensorProto.FLOAT, ["batch", HEADS, "seq", HEAD])
    model = make_model(nodes, [x], [tensor_info("y"), tensor_info("z")], initializers)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    y, z = session.run(None, {"x": X})
    np.testing.assert_array_equal(y, np.maximum(np.concatenate([X, -X], axis=3), 0))
    assert z.shape == X.shape[:3] + (0,)
    concats = [node for node in session.graph_for({"x": X}).nodes if node.op_type == "Concat"]
    assert [len(node.inputs) for node in concats] == [2], concats
    assert concats[0].inputs[0] == "x"


HOLDOUT = Path(os.environ.get("ONNX_RUNTIME_HOLDOUT") or Path(__file__).resolve().parents[2]
               / "benchmarks/.models/holdout")


@pytest.mark.skipif(not (HOLDOUT / "phi3.torchscript.fp32.onnx").is_file(), reason="the holdout set is not built")
def test_holdout_phi3_torchscript_decode_plan_has_no_whole_or_empty_slice():
    """TorchScript's Phi-3 prefill and decode graphs keep no Slice of the heads and no Concat of an empty rest: the
    one Concat left builds the rotary tables (cos/sin of the positions twice), as in the dynamo export's."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from zoo_feeds import make_feeds

    manifest = json.loads((HOLDOUT / "manifest.json").read_text())
    entry = next(model for model in manifest["models"] if model["name"] == "phi3.torchscript.fp32")
    session = ort.InferenceSession(str(HOLDOUT / entry["file"]), providers=["CPUExecutionProvider"])
    for call in ("prefill", "decode"):
        feeds = make_feeds(entry["calls"][call])
        session.run(None, feeds)
        ops = [node.op_type for node in session.graph_for(feeds).nodes]
        assert "Slice" not in ops and ops.count("Concat") == 1 and ops.count("RotateHalfEmbedding") == 4, ops


def test_a_part_empty_only_for_this_signature_stays():
    """A decoder's past at its prefill (length 0 for this signature, fed): the Concat that appends to it stays."""
    nodes = [helper.make_node("Neg", ["x"], ["new"]),
             helper.make_node("Concat", ["past", "new"], ["present"], axis=2)]
    inputs = [tensor_info("past", TensorProto.FLOAT, ["batch", HEADS, "past_length", HEAD]),
              tensor_info("x", TensorProto.FLOAT, ["batch", HEADS, "seq", HEAD])]
    model = make_model(nodes, inputs, [tensor_info("present")])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"past": np.zeros((2, HEADS, 0, HEAD), np.float32), "x": X}
    np.testing.assert_array_equal(session.run(None, feeds)[0], -X)
    assert [node.op_type for node in session.graph_for(feeds).nodes] == ["Neg", "Concat"]
