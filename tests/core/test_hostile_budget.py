"""The run-time size budget (session.max_value_bytes) and the checks of hostile values the fuzz harness found:
operators that size their output from data refuse, typed and before allocating, a value over the budget or a
size the spec forbids; model_checks refuses opsets onnx does not define and names that are not text."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx_runtime import InferenceSession, SessionOptions, budget
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError, ShapeOverflowError


def session(nodes, inputs, limit=None, opset=17):
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", opset)])
    options = SessionOptions()
    if limit is not None:
        options.add_session_config_entry("session.max_value_bytes", str(limit))
    return InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def test_tile_over_the_budget_is_refused_with_the_size_and_the_option():
    s = session([helper.make_node("Tile", ["x", "r"], ["y"], name="tiler")],
                [vi("x", TensorProto.FLOAT, [2, 2]), vi("r", TensorProto.INT64, [2])], limit=4096)
    x = np.ones((2, 2), np.float32)
    assert s.run(None, {"x": x, "r": np.array([4, 8])})[0].shape == (8, 16)  # 512 bytes
    with pytest.raises(ShapeOverflowError, match=r"'tiler'.*16,384 bytes.*session.max_value_bytes"):
        s.run(None, {"x": x, "r": np.array([32, 32])})
    with pytest.raises(ShapeOverflowError, match="tiler"):  # the default budget: far past any machine
        session([helper.make_node("Tile", ["x", "r"], ["y"], name="tiler")],
                [vi("x", TensorProto.FLOAT, [2, 2]), vi("r", TensorProto.INT64, [2])]).run(
            None, {"x": x, "r": np.array([2**31, 2**20])})


def test_tile_repeats_must_match_the_rank_and_be_non_negative():
    s = session([helper.make_node("Tile", ["x", "r"], ["y"])],
                [vi("x", TensorProto.FLOAT, [2, 2]), vi("r", TensorProto.INT64, None)])
    for repeats in ([1, 2, 3], [-1, 2]):
        with pytest.raises(InvalidArgumentError, match="repeats"):
            s.run(None, {"x": np.ones((2, 2), np.float32), "r": np.array(repeats)})


def test_range_over_the_budget_or_the_full_int64_span_is_refused():
    s = session([helper.make_node("Range", ["a", "b", "d"], ["y"], name="rng")],
                [vi(n, TensorProto.INT64, []) for n in "abd"], limit=1 << 20)
    scalars = lambda a, b, d: {"a": np.array(a), "b": np.array(b), "d": np.array(d)}  # noqa: E731
    np.testing.assert_array_equal(s.run(None, scalars(0, 10, 3))[0], [0, 3, 6, 9])
    with pytest.raises(ShapeOverflowError, match="'rng'.*Range's output"):
        s.run(None, scalars(0, 1 << 40, 1))
    with pytest.raises(ShapeOverflowError, match="rng"):  # was silently empty: the span overflowed int64
        s.run(None, scalars(-(2**63), 2**63 - 1, 1))


def test_float_range_of_non_finite_values_is_refused():
    s = session([helper.make_node("Range", ["a", "b", "d"], ["y"])], [vi(n, TensorProto.FLOAT, []) for n in "abd"])
    with pytest.raises(InvalidArgumentError, match="no finite length"):
        s.run(None, {"a": np.array(0, np.float32), "b": np.array(np.inf, np.float32), "d": np.array(1, np.float32)})


def test_constant_of_shape_and_one_hot_check_their_sizes():
    s = session([helper.make_node("ConstantOfShape", ["s"], ["y"], name="fill")], [vi("s", TensorProto.INT64, [2])],
                limit=1 << 16)
    assert s.run(None, {"s": np.array([4, 4])})[0].shape == (4, 4)
    with pytest.raises(ShapeOverflowError, match="'fill'"):
        s.run(None, {"s": np.array([1 << 20, 1 << 20])})
    with pytest.raises(InvalidArgumentError, match="negative"):
        s.run(None, {"s": np.array([-1, 4])})
    hot = session([helper.make_node("OneHot", ["i", "d", "v"], ["y"], name="hot")],
                  [vi("i", TensorProto.INT64, [3]), vi("d", TensorProto.INT64, []), vi("v", TensorProto.FLOAT, [2])],
                  limit=1 << 20)
    feeds = {"i": np.array([0, 1, 2]), "v": np.array([0, 1], np.float32)}
    np.testing.assert_array_equal(hot.run(None, {**feeds, "d": np.array(3)})[0], np.eye(3, dtype=np.float32))
    with pytest.raises(ShapeOverflowError, match="'hot'"):
        hot.run(None, {**feeds, "d": np.array(2**27)})
    with pytest.raises(InvalidArgumentError, match="depth -3"):
        hot.run(None, {**feeds, "d": np.array(-3)})


def test_the_budget_option_must_be_a_positive_number():
    for text in ("0", "-5", "lots"):
        options = SessionOptions()
        options.add_session_config_entry("session.max_value_bytes", text)
        with pytest.raises(InvalidArgumentError, match="max_value_bytes"):
            InferenceSession(helper.make_model(helper.make_graph([], "g", [], [])).SerializeToString(), options,
                             providers=["CPUExecutionProvider"])
    assert budget.default_budget() > 1 << 30


@pytest.mark.parametrize("version", [0, -1, 10000])
def test_an_opset_onnx_does_not_define_is_refused(version):
    # Cast with an INTS 'to' at opset 0 named no schema, so nothing was checked; it reached the optimizer.
    node = helper.make_node("Cast", ["x"], ["y"])
    node.attribute.append(helper.make_attribute("to", [1, 2]))
    with pytest.raises(InvalidGraphError, match=f"opset {version} of domain 'ai.onnx'"):
        session([node], [vi("x", TensorProto.FLOAT, [2])], opset=version)


def test_an_operator_name_that_is_not_text_is_refused():
    # protobuf hands such a name over as bytes; the schema lookup raised TypeError.
    model = helper.make_model(helper.make_graph([helper.make_node("StringConcat", ["x", "x"], ["y"])], "g",
                                                [vi("x", TensorProto.STRING, [1])], [vi("y", TensorProto.STRING, [1])]),
                              opset_imports=[helper.make_operatorsetid("", 20)])
    data = model.SerializeToString().replace(b"StringConcat", b"Strin\x9dConcat")
    assert isinstance(onnx.ModelProto.FromString(data).graph.node[0].op_type, bytes)
    with pytest.raises(InvalidGraphError, match="not UTF-8 text"):
        InferenceSession(data, providers=["CPUExecutionProvider"])


def test_inputs_of_one_type_parameter_must_share_their_type():
    # float32 + int64 returned float64 (numpy's promotion); the schema's T is one type, as onnxruntime enforces.
    with pytest.raises(InvalidGraphError, match=r"inputs 0 and 1 share type T but are tensor\(float\) and "
                                                r"tensor\(int64\)"):
        session([helper.make_node("Add", ["a", "b"], ["y"])], [vi("a", TensorProto.FLOAT, [2]),
                                                               vi("b", TensorProto.INT64, [2])])


def test_an_element_type_the_schema_does_not_allow_is_refused():
    # A string into Acosh reached numpy's ufunc (TypeError inside a KernelError).
    with pytest.raises(InvalidGraphError, match=r"input 0 \('x'\) is tensor\(string\); its schema allows"):
        session([helper.make_node("Acosh", ["x"], ["y"])], [vi("x", TensorProto.STRING, [2])])


@pytest.mark.parametrize("op", ["Div", "Mod"])
def test_integer_division_by_zero_is_refused(op):
    # numpy warned and returned 0; the spec leaves it undefined.
    s = session([helper.make_node(op, ["a", "b"], ["y"], name="q")], [vi("a", TensorProto.INT64, [2]),
                                                                      vi("b", TensorProto.INT64, [2])])
    np.testing.assert_array_equal(s.run(None, {"a": np.array([7, -7]), "b": np.array([2, 2])})[0],
                                  [3, -3] if op == "Div" else [1, 1])
    with pytest.raises(InvalidArgumentError, match=f"'q'.*{op}: integer division by zero"):
        s.run(None, {"a": np.array([7, 1]), "b": np.array([2, 0])})
    floats = session([helper.make_node(op, ["a", "b"], ["y"], **({"fmod": 1} if op == "Mod" else {}))],
                     [vi("a", TensorProto.FLOAT, [1]), vi("b", TensorProto.FLOAT, [1])])
    assert not np.isfinite(floats.run(None, {"a": np.ones(1, np.float32), "b": np.zeros(1, np.float32)})[0]).all()


def test_an_element_type_number_onnx_does_not_define_is_refused():
    # Found by the fuzz harness: the type check itself raised ValueError on elem_type 100.
    # (the declaration itself is refused now, before the type check reads it)
    with pytest.raises(InvalidGraphError, match=r"value 'x' .* declares element type 100, which is no ONNX type"):
        session([helper.make_node("Relu", ["x"], ["y"])], [vi("x", 100, [2])])


def test_split_sizes_must_be_non_negative():
    """[4, -1] sums to a dimension of 3: it used to return 3 and 0 elements where the spec has no answer."""
    graph = helper.make_graph([helper.make_node("Split", ["x", "s"], ["a", "b"], name="cut", axis=0)], "g",
                              [vi("x", TensorProto.FLOAT, [3]), vi("s", TensorProto.INT64, [2])],
                              [vi("a", TensorProto.FLOAT, None), vi("b", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)])
    s = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.arange(3, dtype=np.float32)
    assert [v.tolist() for v in s.run(None, {"x": x, "s": np.array([1, 2])})] == [[0.0], [1.0, 2.0]]
    with pytest.raises(InvalidArgumentError, match=r"'cut'.*non-negative values"):
        s.run(None, {"x": x, "s": np.array([4, -1])})


def test_negative_pads_may_remove_at_most_the_axis():
    """Pads of -5 on an axis of 3 used to return an empty axis silently."""
    s = session([helper.make_node("Pad", ["x", "p"], ["y"])],
                [vi("x", TensorProto.FLOAT, [3]), vi("p", TensorProto.INT64, [2])])
    x = np.arange(3, dtype=np.float32)
    assert s.run(None, {"x": x, "p": np.array([-1, 2])})[0].tolist() == [1.0, 2.0, 0.0, 0.0]
    with pytest.raises(InvalidArgumentError, match="removes 5 elements of axis 0, which has 3"):
        s.run(None, {"x": x, "p": np.array([-5, 4])})


@pytest.mark.parametrize(("node", "inputs", "feeds", "what"), [
    (helper.make_node("Expand", ["x", "s"], ["y"], name="grow"),
     [vi("x", TensorProto.FLOAT, [1]), vi("s", TensorProto.INT64, [2])],
     {"x": np.ones(1, np.float32), "s": np.array([1 << 20, 1 << 20])}, "Expand's output"),
    (helper.make_node("Pad", ["x", "p"], ["y"], name="grow"),
     [vi("x", TensorProto.FLOAT, [1]), vi("p", TensorProto.INT64, [2])],
     {"x": np.ones(1, np.float32), "p": np.array([0, 1 << 40])}, "Pad's output"),
    (helper.make_node("Resize", ["x", "", "sc"], ["y"], name="grow"),
     [vi("x", TensorProto.FLOAT, [1, 1, 2, 2]), vi("sc", TensorProto.FLOAT, [4])],
     {"x": np.ones((1, 1, 2, 2), np.float32), "sc": np.array([1, 1, 1e6, 1e6], np.float32)}, "Resize's output"),
])
def test_expand_pad_and_resize_check_their_output_against_the_budget(node, inputs, feeds, what):
    with pytest.raises(ShapeOverflowError, match=rf"'grow'.*{what}.*session.max_value_bytes"):
        session([node], inputs, limit=1 << 20).run(None, feeds)


@pytest.mark.parametrize(("op", "inputs", "feeds", "attrs"), [
    ("Gather", ["x", "i"], {"i": np.array([0, 5])}, {}),
    ("GatherElements", ["x", "i"], {"i": np.array([[0, 7]])}, {"axis": 1}),
    ("GatherND", ["x", "i"], {"i": np.array([[0, 9]])}, {}),
    ("ScatterElements", ["x", "i", "u"], {"i": np.array([[0, 7]]), "u": np.ones((1, 2), np.float32)}, {"axis": 1}),
    ("ScatterND", ["x", "i", "u"], {"i": np.array([[4, 0]]), "u": np.ones(1, np.float32)}, {}),
])
def test_an_index_out_of_range_is_an_invalid_argument_naming_the_node(op, inputs, feeds, attrs):
    """numpy's IndexError used to reach the caller as a kernel failure wrapping an internal exception."""
    declared = [vi("x", TensorProto.FLOAT, [2, 3])] + [
        vi(name, TensorProto.INT64 if name == "i" else TensorProto.FLOAT, list(value.shape))
        for name, value in feeds.items()]
    s = session([helper.make_node(op, inputs, ["y"], name="lookup", **attrs)], declared)
    with pytest.raises(InvalidArgumentError, match=rf"'lookup' \({op}\): an index is out of range") as raised:
        s.run(None, {"x": np.zeros((2, 3), np.float32), **feeds})
    assert not isinstance(raised.value.__cause__, IndexError)


def test_trailing_empty_inputs_are_left_out_optionals():
    """Add(x, x, '', '') passed two None arguments to a two-input kernel (a TypeError inside a kernel failure)."""
    s = session([helper.make_node("Add", ["x", "x", "", ""], ["y"])], [vi("x", TensorProto.FLOAT, [3])])
    assert s.run(None, {"x": np.arange(3, dtype=np.float32)})[0].tolist() == [0.0, 2.0, 4.0]


def test_dropout_ratio_must_be_a_scalar():
    """A ratio of two values failed inside the kernel with numpy's TypeError."""
    graph = helper.make_graph([helper.make_node("Dropout", ["x", "r", "t"], ["y"], name="drop")], "g",
                              [vi("x", TensorProto.FLOAT, [3]), vi("r", TensorProto.FLOAT, [2]),
                               vi("t", TensorProto.BOOL, [])], [vi("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)])
    s = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(InvalidArgumentError, match=r"'drop' \(Dropout\): input 'ratio' must be a scalar"):
        s.run(None, {"x": np.ones(3, np.float32), "r": np.array([0.1, 0.2], np.float32), "t": np.array(True)})


@pytest.mark.parametrize(("target", "message"), [
    ([-5, 3], "a dimension below -1"),  # numpy takes -5 as the inferred dimension: it returned shape (2, 3)
    ([4, 3], "cannot give shape"),
    ([-1, -1], "cannot give shape"),
])
def test_reshape_to_an_invalid_shape_is_an_invalid_argument(target, message):
    s = session([helper.make_node("Reshape", ["x", "s"], ["y"], name="shaper")],
                [vi("x", TensorProto.FLOAT, [6]), vi("s", TensorProto.INT64, [2])])
    with pytest.raises(InvalidArgumentError, match=rf"'shaper'.*{message}") as raised:
        s.run(None, {"x": np.zeros(6, np.float32), "s": np.array(target)})
    assert raised.value.__cause__ is None or isinstance(raised.value.__cause__, InvalidArgumentError)  # not numpy's


def test_average_pool_pads_must_be_smaller_than_the_kernel():
    """A pad as wide as the kernel gives windows wholly in the padding: they averaged to NaN."""
    with pytest.raises(InvalidGraphError, match=r"'avg' \(AveragePool\): attribute 'pads'.*smaller than the kernel"):
        session([helper.make_node("AveragePool", ["x"], ["y"], name="avg", kernel_shape=[2, 2], pads=[2, 0, 0, 0])],
                [vi("x", TensorProto.FLOAT, [1, 1, 4, 4])])


def test_rotary_embedding_positions_must_lie_in_the_caches():
    """Position -1 wrapped to the caches' last row."""
    graph = helper.make_graph(
        [helper.make_node("RotaryEmbedding", ["x", "c", "s", "p"], ["y"], name="rope")], "g",
        [vi("x", TensorProto.FLOAT, [1, 1, 2, 4]), vi("c", TensorProto.FLOAT, [8, 2]),
         vi("s", TensorProto.FLOAT, [8, 2]), vi("p", TensorProto.INT64, [1, 2])], [vi("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 23)])
    s = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": np.ones((1, 1, 2, 4), np.float32), "c": np.ones((8, 2), np.float32),
             "s": np.zeros((8, 2), np.float32)}
    assert s.run(None, {**feeds, "p": np.array([[0, 7]])})[0].shape == (1, 1, 2, 4)
    with pytest.raises(InvalidArgumentError, match=r"'rope'.*position_ids span -1\.\.0; they must lie in \[0, 8\)"):
        s.run(None, {**feeds, "p": np.array([[-1, 0]])})


@pytest.mark.parametrize(("op", "feeds", "attrs", "message"), [
    ("GatherElements", {"i": np.zeros((1, 5), np.int64)}, {"axis": 0}, "do not fit data"),
    ("ScatterElements", {"i": np.zeros((1, 2), np.int64), "u": np.ones((1, 3), np.float32)}, {"axis": 1},
     "must have one shape"),
    ("ScatterND", {"i": np.zeros((1, 1), np.int64), "u": np.ones((1, 2), np.float32)}, {}, "must have shape"),
])
def test_index_and_update_shapes_must_match_the_data(op, feeds, attrs, message):
    """These used to broadcast: a mismatched indices or updates shape gave a result instead of an error."""
    declared = [vi("x", TensorProto.FLOAT, [2, 3])] + [
        vi(name, TensorProto.INT64 if name == "i" else TensorProto.FLOAT, list(value.shape))
        for name, value in feeds.items()]
    inputs = ["x", *feeds]
    s = session([helper.make_node(op, inputs, ["y"], name="mix", **attrs)], declared)
    with pytest.raises(InvalidArgumentError, match=rf"'mix' \({op}\).*{message}"):
        s.run(None, {"x": np.zeros((2, 3), np.float32), **feeds})


def test_roi_align_output_over_the_budget_is_refused_before_allocating():
    # Fuzz seed 48: output_height 2**31 - 1 for 3 RoIs asked numpy for 120 GiB (a MemoryError).
    node = helper.make_node("RoiAlign", ["x", "rois", "idx"], ["y"], name="roi", output_height=2**31 - 1,
                            output_width=5, sampling_ratio=1)
    s = session([node], [vi("x", TensorProto.FLOAT, [1, 1, 4, 4]), vi("rois", TensorProto.FLOAT, [3, 4]),
                         vi("idx", TensorProto.INT64, [3])], limit=1 << 20)
    feeds = {"x": np.ones((1, 1, 4, 4), np.float32), "rois": np.zeros((3, 4), np.float32), "idx": np.zeros(3, np.int64)}
    with pytest.raises(ShapeOverflowError, match=r"'roi'.*RoiAlign's output would take 128,849,018,820 bytes"):
        s.run(None, feeds)


def _scalar(name, elem=TensorProto.INT64):
    return vi(name, elem, [])


SIGNAL_CASES = {
    "HannWindow": ([helper.make_node("HannWindow", ["n"], ["y"], name="op")], [_scalar("n")], {"n": 2**40}),
    "BlackmanWindow": ([helper.make_node("BlackmanWindow", ["n"], ["y"], name="op")], [_scalar("n")], {"n": 2**40}),
    "MelWeightMatrix": ([helper.make_node("MelWeightMatrix", ["a", "b", "c", "d", "e"], ["y"], name="op")],
                        [_scalar("a"), _scalar("b"), _scalar("c"), _scalar("d", TensorProto.FLOAT),
                         _scalar("e", TensorProto.FLOAT)],
                        {"a": 2**20, "b": 2**22, "c": 16000, "d": np.float32(0), "e": np.float32(8000)}),
    "DFT": ([helper.make_node("DFT", ["x", "n"], ["y"], name="op")], [vi("x", TensorProto.FLOAT, [1, 4, 1]),
                                                                     _scalar("n")],
            {"x": np.ones((1, 4, 1), np.float32), "n": 2**40}),
    "STFT": ([helper.make_node("STFT", ["x", "s", "", "l"], ["y"], name="op")],
             [vi("x", TensorProto.FLOAT, [1, 4096, 1]), _scalar("s"), _scalar("l")],
             {"x": np.ones((1, 4096, 1), np.float32), "s": 1, "l": 2048}),
}


@pytest.mark.parametrize("op", sorted(SIGNAL_CASES))
def test_signal_outputs_sized_by_inputs_are_checked_against_the_budget(op):
    # The windows, MelWeightMatrix, DFT's dft_length and STFT's frames asked numpy for TiBs (a MemoryError).
    nodes, inputs, feeds = SIGNAL_CASES[op]
    s = session(nodes, inputs, limit=1 << 20)
    feeds = {name: np.asarray(value) for name, value in feeds.items()}
    with pytest.raises(ShapeOverflowError, match=rf"'op'.*{op}'s .* would take [\d,]+ bytes .*session.max_value_bytes"):
        s.run(None, feeds)


def test_attribute_sized_ml_and_text_outputs_are_checked_against_the_budget():
    # TfIdfVectorizer's width is its largest ngram index + 1, TreeEnsemble's columns its n_targets: attributes of
    # any size (2**40 asked numpy for TiBs).
    tfidf = helper.make_node("TfIdfVectorizer", ["x"], ["y"], name="op", mode="TF", min_gram_length=1,
                             max_gram_length=1, max_skip_count=0, ngram_counts=[0], ngram_indexes=[2**40],
                             pool_int64s=[3])
    with pytest.raises(ShapeOverflowError, match=r"'op'.*TfIdfVectorizer's output would take 8,796,093,022,216"):
        session([tfidf], [vi("x", TensorProto.INT64, [2, 3])], limit=1 << 20).run(
            None, {"x": np.array([[3, 1, 3], [2, 3, 0]])})
    trees = helper.make_node(
        "TreeEnsemble", ["x"], ["y"], name="op", domain="ai.onnx.ml", aggregate_function=1, n_targets=2**40,
        nodes_featureids=[0], nodes_splits=helper.make_tensor("s", TensorProto.FLOAT, [1], [0.5]),
        nodes_modes=helper.make_tensor("m", TensorProto.UINT8, [1], [0]), nodes_truenodeids=[0], nodes_trueleafs=[1],
        nodes_falsenodeids=[0], nodes_falseleafs=[1], tree_roots=[0], leaf_targetids=[0],
        leaf_weights=helper.make_tensor("w", TensorProto.FLOAT, [1], [1.0]), post_transform=0)
    graph = helper.make_graph([trees], "g", [vi("x", TensorProto.FLOAT, [2, 1])], [vi("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 21),
                                                    helper.make_operatorsetid("ai.onnx.ml", 5)])
    s = InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    with pytest.raises(ShapeOverflowError, match=r"'op'.*TreeEnsemble's scores would take 17,592,186,044,416"):
        s.run(None, {"x": np.ones((2, 1), np.float32)})
