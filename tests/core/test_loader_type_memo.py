"""Tensor types read once per distinct TypeProto (loader.TENSOR_TYPES): a graph's values repeat a few types, and a
plan is decoded at every cached creation and first run, where the per-dimension reads were most of each value's
cost. The memo must give each value its own TypeInfo and the same types as converting every value anew."""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto, helper
from onnx_runtime import loader


def _graph(count: int) -> onnx.GraphProto:
    """``count`` Relu nodes over one (batch, 8, 8) float tensor type, plus values of other kinds and types."""
    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(count)]
    nodes.append(helper.make_node("SequenceConstruct", [f"v{count}"], ["seq"]))
    nodes.append(helper.make_node("Shape", [f"v{count}"], ["shape"]))
    infos = [helper.make_tensor_value_info(f"v{i}", TensorProto.FLOAT, ["batch", 8, 8]) for i in range(1, count)]
    infos.append(helper.make_tensor_sequence_value_info("seq", TensorProto.FLOAT, ["batch", 8, 8]))
    infos.append(helper.make_tensor_value_info("shape", TensorProto.INT64, [3]))
    infos.append(helper.make_value_info("untyped", onnx.TypeProto()))
    zero = helper.make_tensor_value_info("zero", TensorProto.FLOAT16, [0, None, -1])
    first = helper.make_tensor_value_info("v0", TensorProto.FLOAT, ["batch", 8, 8])
    out = helper.make_tensor_value_info("shape", TensorProto.INT64, None)
    return helper.make_graph(nodes, "g", [first, zero], [out], value_info=infos)


def _expected(gp: onnx.GraphProto) -> dict:
    return {vi.name: loader.convert_type(vi.type) for vi in [*gp.value_info, *gp.input, *gp.output]}


def test_repeated_types_are_read_once_and_match_a_full_conversion(monkeypatch):
    gp = _graph(40)
    expected = _expected(gp)
    loader.TENSOR_TYPES.clear()
    calls = []
    convert = loader.convert_type
    monkeypatch.setattr(loader, "convert_type", lambda tp: calls.append(1) or convert(tp))
    graph = loader.convert_graph(gp, {"": 17}, outer_scope=())
    assert {name: info.type for name, info in graph.value_info.items()} == expected
    assert [vi.type for vi in graph.inputs] == [expected["v0"], expected["zero"]]
    assert expected["zero"].shape == (0, None, None) and expected["seq"].elem.shape == ("batch", 8, 8)
    # 40 values of one type, its input too, read once; the sequence, shape, untyped, float16 and output once each
    assert len(calls) <= 8, len(calls)


def test_each_value_gets_its_own_type_info():
    loader.TENSOR_TYPES.clear()
    graph = loader.convert_graph(_graph(4), {"": 17}, outer_scope=())
    first, second = graph.value_info["v1"].type, graph.value_info["v2"].type
    assert first == second and first is not second
    first.shape = (2, 8, 8)  # a pass that rewrites one value's type leaves the others (and later graphs) alone
    assert second.shape == ("batch", 8, 8)
    again = loader.convert_graph(_graph(4), {"": 17}, outer_scope=())
    assert again.value_info["v1"].type.shape == ("batch", 8, 8)
    assert graph.inputs[0].type is not graph.value_info["v0"].type


def test_the_memo_is_bounded(monkeypatch):
    monkeypatch.setattr(loader, "TENSOR_TYPES_KEPT", 5)
    loader.TENSOR_TYPES.clear()
    nodes = [helper.make_node("Relu", [f"v{i}"], [f"v{i + 1}"]) for i in range(30)]
    infos = [helper.make_tensor_value_info(f"v{i}", TensorProto.FLOAT, [i + 1]) for i in range(1, 30)]
    gp = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("v0", TensorProto.FLOAT, [1])],
                           [helper.make_tensor_value_info("v30", TensorProto.FLOAT, [31])], value_info=infos)
    graph = loader.convert_graph(gp, {"": 17}, outer_scope=())
    assert len(loader.TENSOR_TYPES) <= 5
    assert [graph.value_info[f"v{i}"].type.shape for i in range(31)] == [(i + 1,) for i in range(31)]


@pytest.mark.parametrize("dims", [[3, "n"], [], None])
def test_types_that_differ_only_in_a_dimension_stay_apart(dims):
    loader.TENSOR_TYPES.clear()
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, 4])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, dims)
    c = helper.make_tensor_value_info("c", TensorProto.DOUBLE, [3, 4])
    gp = helper.make_graph([helper.make_node("Identity", ["a"], ["b"]), helper.make_node("Cast", ["a"], ["c"], to=11)],
                           "g", [a], [b, c])
    graph = loader.convert_graph(gp, {"": 17}, outer_scope=())
    assert graph.value_info["a"].type.shape == (3, 4)
    assert graph.value_info["b"].type == loader.convert_type(b.type)
    assert graph.value_info["c"].type.dtype != graph.value_info["a"].type.dtype
