"""Model loading (onnx_runtime.loader) directly and through InferenceSession: every malformed input
becomes a typed error naming the problem, graphs are ordered and scoped, and types, opsets and
attributes reach the IR."""

from __future__ import annotations

import os
import pathlib
import random

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime import ir
from onnx_runtime import loader as model_loader
from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidGraphError, ModelLoadError
from onnx_runtime.loader import load_model

CPU = ["CPUExecutionProvider"]


def vi(name, shape=(2, 3), elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def make(nodes, inputs, outputs, inits=(), opsets=(("", 18),), name="g"):
    graph = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])


def session(model):
    return ort.InferenceSession(model, providers=CPU)


LOADERS = {"load_model": load_model, "InferenceSession": session}
each_loader = pytest.mark.parametrize("loader", LOADERS.values(), ids=LOADERS.keys())


@pytest.fixture(scope="module")
def add_relu():
    """Y = Relu(X + W), with an initializer W."""
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3) - 3, "W")
    nodes = [helper.make_node("Add", ["X", "W"], ["T"], name="add"),
             helper.make_node("Relu", ["T"], ["Y"], name="relu")]
    return make(nodes, [vi("X")], [vi("Y")], [w])


def expected_add_relu(x):
    return np.maximum(x + (np.arange(6, dtype=np.float32).reshape(2, 3) - 3), 0)


X = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)


# -- unreadable input ----------------------------------------------------------------------------------
@each_loader
def test_missing_file(loader, tmp_path):
    path = tmp_path / "absent.onnx"
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        loader(str(path))
    assert "absent.onnx" in str(info.value)


@each_loader
def test_directory(loader, tmp_path):
    with pytest.raises(ModelLoadError, match="is a directory"):
        loader(str(tmp_path))


@each_loader
def test_empty_file(loader, tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty") as info:
        loader(str(path))
    assert "empty.onnx" in str(info.value)
    with pytest.raises(ModelLoadError, match="empty"):
        loader(b"")


def test_every_truncation_of_a_real_model_is_a_load_error(add_relu):
    data = add_relu.SerializeToString()
    assert len(data) > 50
    for cut in range(len(data)):
        with pytest.raises(ModelLoadError) as info:
            load_model(data[:cut])
        message = str(info.value)
        assert any(word in message for word in ("truncated", "empty", "opset_import")), (cut, message)


@each_loader
@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
def test_truncated_model_file(loader, add_relu, tmp_path, fraction):
    data = add_relu.SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: int(len(data) * fraction)])
    with pytest.raises(ModelLoadError, match="truncated") as info:
        loader(str(path))
    assert "cut.onnx" in str(info.value)


@each_loader
@pytest.mark.parametrize("seed", range(8))
def test_random_garbage(loader, seed):
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, int(rng.integers(1, 400)), dtype=np.uint8).tobytes()
    with pytest.raises(ModelLoadError, match="not"):
        loader(data)


@each_loader
@pytest.mark.parametrize("data", [
    b"\x08\x07",  # ir_version = 7 and nothing else
    helper.make_graph([], "g", [], []).SerializeToString(),
    b"\x00" * 16,
    b"this is a text file, not a model\n",
], ids=["ir_version_only", "graph_proto", "zeros", "text"])
def test_bytes_that_are_not_a_model(loader, data):
    with pytest.raises(ModelLoadError, match="not an ONNX model|not a valid ONNX protobuf"):
        loader(data)


def test_model_without_opset_import(add_relu):
    model = onnx.ModelProto()
    model.CopyFrom(add_relu)
    del model.opset_import[:]
    with pytest.raises(ModelLoadError, match="opset_import"):
        load_model(model)


@each_loader
@pytest.mark.parametrize("bad", [123, None, 1.5, ["model.onnx"], {"path": "m.onnx"}], ids=repr)
def test_wrong_argument_type(loader, bad):
    with pytest.raises(ModelLoadError, match="cannot load a model from") as info:
        loader(bad)
    assert type(bad).__name__ in str(info.value)


# -- invalid graphs --------------------------------------------------------------------------------------
@each_loader
def test_cycle_names_nodes(loader):
    nodes = [
        helper.make_node("Relu", ["X"], ["ok"], name="fine"),
        helper.make_node("Add", ["ok", "B"], ["A"], name="cyc_a"),
        helper.make_node("Neg", ["A"], ["B"], name="cyc_b"),
        helper.make_node("Relu", ["B"], ["Y"], name="after"),
    ]
    with pytest.raises(InvalidGraphError, match="cycle") as info:
        loader(make(nodes, [vi("X")], [vi("Y")]))
    message = str(info.value)
    assert "cyc_a" in message and "cyc_b" in message and "fine" not in message


@each_loader
def test_node_reading_undefined_value(loader):
    nodes = [helper.make_node("Add", ["X", "ghost"], ["Y"], name="adder")]
    with pytest.raises(InvalidGraphError, match="'ghost'") as info:
        loader(make(nodes, [vi("X")], [vi("Y")]))
    assert "adder" in str(info.value)


@each_loader
def test_duplicate_producers(loader):
    nodes = [helper.make_node("Relu", ["X"], ["Y"], name="first"), helper.make_node("Neg", ["X"], ["Y"], name="second")]
    with pytest.raises(InvalidGraphError, match="more than one node") as info:
        loader(make(nodes, [vi("X")], [vi("Y")]))
    assert "'Y'" in str(info.value) and "second" in str(info.value)


def test_node_overwriting_a_graph_input():
    nodes = [helper.make_node("Relu", ["Y"], ["X"], name="clobber")]
    with pytest.raises(InvalidGraphError, match="'X'"):
        load_model(make(nodes, [vi("X"), vi("Y")], [vi("X")]))


@each_loader
def test_domain_not_imported(loader):
    nodes = [helper.make_node("Frob", ["X"], ["Y"], name="frob", domain="com.example")]
    with pytest.raises(InvalidGraphError, match="com.example") as info:
        loader(make(nodes, [vi("X")], [vi("Y")]))
    assert "frob" in str(info.value) and "opset_import" in str(info.value)


def test_graph_output_not_produced():
    nodes = [helper.make_node("Relu", ["X"], ["T"], name="r")]
    with pytest.raises(InvalidGraphError, match="'Y'"):
        load_model(make(nodes, [vi("X")], [vi("Y")]))


# -- ordering --------------------------------------------------------------------------------------------
def diamond_nodes():
    return [
        helper.make_node("Add", ["X", "X"], ["a"], name="n_a"),
        helper.make_node("Mul", ["a", "X"], ["b"], name="n_b"),
        helper.make_node("Neg", ["a"], ["c"], name="n_c"),
        helper.make_node("Sub", ["b", "c"], ["d"], name="n_d"),
        helper.make_node("Relu", ["d"], ["Y"], name="n_y"),
    ]


def expected_diamond(x):
    a = x + x
    return np.maximum(a * x + a, 0)


def assert_topological(graph: ir.Graph):
    seen = set(graph.initializers) | {v.name for v in graph.inputs}
    for node in graph.nodes:
        assert all(name in seen for name in node.inputs if name), node
        seen.update(node.outputs)


@pytest.mark.parametrize("seed", range(5))
def test_shuffled_nodes_are_ordered_and_run(seed):
    nodes = diamond_nodes()
    random.Random(seed).shuffle(nodes)
    model = make(nodes, [vi("X")], [vi("Y")])
    graph = load_model(model).graph
    assert_topological(graph)
    assert sorted(n.name for n in graph.nodes) == sorted(n.name for n in diamond_nodes())
    (y,) = session(model).run(None, {"X": X})
    np.testing.assert_allclose(y, expected_diamond(X), rtol=1e-6)


def test_ties_keep_file_order():
    nodes = [helper.make_node("Relu", ["X"], [f"o{i}"], name=f"r{i}") for i in (3, 1, 2)]
    graph = load_model(make(nodes, [vi("X")], [vi(f"o{i}") for i in (1, 2, 3)])).graph
    assert [n.name for n in graph.nodes] == ["r3", "r1", "r2"]


def stable_order(nodes: list, defined: set) -> list[str]:
    """The order the loader promises, by its definition: each time, the first node in file order whose inputs
    are all defined."""
    left, order, defined = list(nodes), [], set(defined)
    while left:
        ready = next(n for n in left if all(name in defined for name in n.input))
        left.remove(ready)
        order.append(ready.name)
        defined.update(ready.output)
    return order


@pytest.mark.parametrize("seed", range(12))
def test_every_file_order_loads_in_the_stable_order(seed):
    """Graphs already in order (the usual file, every cached plan) keep it as they are; any other order is
    sorted into the same stable order."""
    nodes = diamond_nodes() + [helper.make_node("Relu", ["X"], ["side"], name="n_side")]
    random.Random(seed).shuffle(nodes)
    graph = load_model(make(nodes, [vi("X")], [vi("Y"), vi("side")])).graph
    assert [n.name for n in graph.nodes] == stable_order(nodes, {"X"})
    again = load_model(make([n.proto for n in graph.nodes], [vi("X")], [vi("Y"), vi("side")])).graph
    assert [n.name for n in again.nodes] == [n.name for n in graph.nodes]


# -- sources -------------------------------------------------------------------------------------------------
def test_model_from_path_bytes_and_proto(add_relu, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save_model(add_relu, str(path))
    sources = {"str": str(path), "pathlib": pathlib.Path(path), "bytes": add_relu.SerializeToString(),
               "bytearray": bytearray(add_relu.SerializeToString()), "proto": add_relu}
    for label, source in sources.items():
        model = load_model(source)
        assert [n.op_type for n in model.graph.nodes] == ["Add", "Relu"], label
        np.testing.assert_array_equal(model.graph.initializers["W"], np.arange(6, dtype=np.float32).reshape(2, 3) - 3)
        assert model.path == (str(path) if label in ("str", "pathlib") else None), label
        (y,) = session(source).run(None, {"X": X})
        np.testing.assert_allclose(y, expected_add_relu(X), err_msg=label)


def test_loading_does_not_mutate_the_callers_proto(add_relu):
    before = add_relu.SerializeToString()
    load_model(add_relu)
    assert add_relu.SerializeToString() == before


@pytest.mark.parametrize("scan_limit", [None, 0], ids=["searched for its key", "past the search limit: walked"])
def test_external_data(add_relu, tmp_path, monkeypatch, scan_limit):
    if scan_limit is not None:  # a model larger than the limit: onnx's walk over its tensors finds the file
        monkeypatch.setattr(model_loader, "_SCAN_LIMIT", scan_limit)
    path = tmp_path / "ext.onnx"
    proto = onnx.ModelProto()
    proto.CopyFrom(add_relu)  # (saving moves the tensors' data out of the proto it is given)
    onnx.save_model(proto, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="ext.onnx.data", size_threshold=0)
    data_file = tmp_path / "ext.onnx.data"
    assert data_file.exists() and data_file.stat().st_size == 24
    model = load_model(str(path))
    np.testing.assert_array_equal(model.graph.initializers["W"], np.arange(6, dtype=np.float32).reshape(2, 3) - 3)
    (y,) = session(str(path)).run(None, {"X": X})
    np.testing.assert_allclose(y, expected_add_relu(X))

    os.remove(data_file)
    for loader in LOADERS.values():
        with pytest.raises(ModelLoadError, match="external data") as info:
            loader(str(path))
        assert "ext.onnx" in str(info.value)


@pytest.mark.parametrize("location", ["../outside.data", "/etc/hostname"])
def test_external_data_outside_the_model_directory(add_relu, tmp_path, location):
    path = tmp_path / "m.onnx"
    proto = onnx.ModelProto()
    proto.CopyFrom(add_relu)
    onnx.save_model(proto, str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    proto = onnx.load(str(path), load_external_data=False)
    for entry in proto.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    onnx.save_model(proto, str(path))
    with pytest.raises(ModelLoadError, match="external data"):
        load_model(str(path))


def test_external_data_offset_past_end_of_file(add_relu, tmp_path):
    path = tmp_path / "m.onnx"
    onnx.save_model(add_relu, str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    proto = onnx.load(str(path), load_external_data=False)
    tensor = proto.graph.initializer[0]
    offsets = [e for e in tensor.external_data if e.key == "offset"]
    if offsets:
        offsets[0].value = "4096"
    else:
        tensor.external_data.add(key="offset", value="4096")
    onnx.save_model(proto, str(path))
    with pytest.raises(ModelLoadError, match="external data"):
        load_model(str(path))


# -- what the IR records ----------------------------------------------------------------------------------------
def test_opsets_per_domain():
    nodes = [
        helper.make_node("Relu", ["X"], ["T"], name="r"),
        helper.make_node("Frob", ["T"], ["Y"], name="f", domain="com.example"),
    ]
    model = make(nodes, [vi("X")], [vi("Y")], opsets=(("ai.onnx", 17), ("com.example", 3), ("ai.onnx.ml", 4)))
    loaded = load_model(model)
    assert loaded.opsets == {"": 17, "com.example": 3, "ai.onnx.ml": 4}
    assert loaded.graph.opsets == loaded.opsets
    by_name = {n.name: n for n in loaded.graph.nodes}
    assert (by_name["r"].domain, by_name["r"].opset) == ("", 17)
    frob = by_name["f"]
    assert (frob.domain, frob.opset, frob.qualified_op) == ("com.example", 3, "com.example::Frob")


def test_model_metadata():
    model = make([helper.make_node("Relu", ["X"], ["Y"])], [vi("X")], [vi("Y")])
    model.producer_name, model.producer_version, model.model_version = "tests", "9.9", 42
    onnx.helper.set_model_props(model, {"author": "me"})
    loaded = load_model(model)
    assert (loaded.producer_name, loaded.producer_version, loaded.model_version) == ("tests", "9.9", 42)
    assert loaded.metadata == {"author": "me"} and loaded.ir_version == model.ir_version
    assert loaded.graph.nodes[0].name == "Relu_0"  # unnamed nodes get a stable name


def branch(name, op, out):
    return helper.make_graph([helper.make_node(op, ["outer", "outer"] if op == "Add" else ["outer"], [out],
                                               name=f"{name}_node")], name, [], [vi(out, (2,))])


def test_subgraph_outer_scope_reads_and_ordering():
    nodes = [
        helper.make_node("If", ["cond"], ["Y"], name="the_if",
                         then_branch=branch("then", "Add", "t"), else_branch=branch("else", "Neg", "e")),
        helper.make_node("Relu", ["X"], ["outer"], name="producer"),  # listed after its reader
    ]
    graph = load_model(make(nodes, [vi("X", (2,)), vi("cond", (), TensorProto.BOOL)], [vi("Y", (2,))])).graph
    assert [n.name for n in graph.nodes] == ["producer", "the_if"]
    the_if = graph.nodes[1]
    assert the_if.attrs["then_branch"].outer_names == ["outer"]
    assert the_if.attrs["else_branch"].outer_names == ["outer"]
    assert graph.outer_names == []
    assert [n.name for n in graph.walk()][:2] == ["producer", "the_if"]
    assert sorted(n.name for n in graph.walk()) == ["else_node", "producer", "the_if", "then_node"]


def test_nested_subgraph_reads_propagate_to_the_outer_node():
    inner_if = helper.make_node("If", ["cond"], ["mid"], name="inner_if",
                                then_branch=branch("inner_then", "Add", "it"),
                                else_branch=branch("inner_else", "Neg", "ie"))
    middle = helper.make_graph([inner_if], "middle", [], [vi("mid", (2,))])
    trivial = helper.make_graph([helper.make_node("Identity", ["X"], ["z"], name="z_node")], "plain", [],
                                [vi("z", (2,))])
    nodes = [
        helper.make_node("If", ["cond"], ["Y"], name="outer_if", then_branch=middle, else_branch=trivial),
        helper.make_node("Neg", ["X"], ["outer"], name="producer"),
    ]
    graph = load_model(make(nodes, [vi("X", (2,)), vi("cond", (), TensorProto.BOOL)], [vi("Y", (2,))])).graph
    assert [n.name for n in graph.nodes] == ["producer", "outer_if"]
    outer_if = graph.nodes[1]
    assert outer_if.attrs["then_branch"].outer_names == ["cond", "outer"]
    assert outer_if.attrs["else_branch"].outer_names == ["X"]
    inner = outer_if.attrs["then_branch"].nodes[0]
    assert inner.attrs["then_branch"].outer_names == ["outer"]


def test_subgraph_reading_an_undefined_outer_value_is_rejected():
    nodes = [helper.make_node("If", ["cond"], ["Y"], name="the_if",
                              then_branch=branch("then", "Add", "t"), else_branch=branch("else", "Neg", "e"))]
    with pytest.raises(InvalidGraphError, match="'outer'"):
        load_model(make(nodes, [vi("cond", (), TensorProto.BOOL)], [vi("Y", (2,))]))


def test_cycle_through_a_subgraph_read():
    nodes = [
        helper.make_node("If", ["cond"], ["Y"], name="the_if",
                         then_branch=branch("then", "Add", "t"), else_branch=branch("else", "Neg", "e")),
        helper.make_node("Relu", ["Y"], ["outer"], name="feeds_back"),
    ]
    with pytest.raises(InvalidGraphError, match="cycle") as info:
        load_model(make(nodes, [vi("cond", (), TensorProto.BOOL)], [vi("Y", (2,))]))
    assert "the_if" in str(info.value) and "feeds_back" in str(info.value)


def test_inferred_shapes_of_intermediates():
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["mm"], name="mm"),
        helper.make_node("Cast", ["mm"], ["as_half"], name="cast", to=TensorProto.FLOAT16),
        helper.make_node("Relu", ["as_half"], ["Y"], name="relu"),
    ]
    model = make(nodes, [vi("X", ("batch", 4)), vi("W", (4, 5))], [helper.make_tensor_value_info("Y", 10, None)])
    graph = load_model(model).graph
    assert graph.type_of("mm") == ir.TypeInfo("tensor", DataType.FLOAT, ("batch", 5))
    assert graph.type_of("as_half").dtype is DataType.FLOAT16 and graph.type_of("as_half").shape == ("batch", 5)
    assert graph.type_of("mm").static_shape is None and graph.type_of("W").static_shape == (4, 5)
    assert graph.type_of("X").shape == ("batch", 4)
    assert load_model(model, infer_shapes=False).graph.type_of("mm") is None


@pytest.mark.parametrize("declared_as_input", [False, True], ids=["initializer", "overridable"])
def test_shape_inference_sees_weights_as_types_and_shape_constants_by_value(declared_as_input):
    """Large initializers reach shape inference as typed stand-in inputs (no data serialized); small
    ones, the shape-like constants, by value. Neither changes the graph's inputs or initializers."""
    from onnx_runtime import loader

    rows = loader.SHAPE_VALUE_LIMIT + 1
    weight = numpy_helper.from_array(np.arange(rows * 2, dtype=np.float32).reshape(rows, 2), "W")
    shape = numpy_helper.from_array(np.array([-1, 1, 2], dtype=np.int64), "shape")
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["mm"], name="mm"),
        helper.make_node("Reshape", ["mm", "shape"], ["Y"], name="reshape"),
    ]
    inputs = [vi("X", (3, rows))] + ([vi("W", (rows, 2))] if declared_as_input else [])
    model = make(nodes, inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], [weight, shape])
    graph = load_model(model).graph
    assert graph.type_of("mm").shape == (3, 2)
    assert graph.type_of("Y").shape == (3, 1, 2)  # needs the small constant's value
    assert set(graph.initializers) == {"W", "shape"}
    assert [v.name for v in graph.inputs] == ["X"]
    x = np.ones((3, rows), dtype=np.float32)
    (y,) = session(model).run(None, {"X": x})
    np.testing.assert_allclose(y, (x @ numpy_helper.to_array(weight)).reshape(3, 1, 2))


def test_attribute_decoding():
    then_g = branch("sub", "Neg", "s")
    node = helper.make_node(
        "Frob", ["X"], ["Y"], name="frob", domain="com.example",
        i=3, f=1.5, s="héllo", ints=[1, -2], floats=[0.5, 2.0], strings=["a", "b"],
        t=numpy_helper.from_array(np.array([[1, 2], [3, 4]], np.int64)),
        g=then_g, gs=[then_g, branch("sub2", "Add", "s2")],
    )
    nodes = [helper.make_node("Relu", ["X"], ["outer"], name="r"), node]
    graph = load_model(make(nodes, [vi("X", (2,))], [vi("Y", (2,))], opsets=(("", 18), ("com.example", 1)))).graph
    attrs = graph.nodes[1].attrs
    assert attrs["i"] == 3 and type(attrs["i"]) is int
    assert attrs["f"] == 1.5 and type(attrs["f"]) is float
    assert attrs["s"] == "héllo" and attrs["strings"] == ["a", "b"]
    assert attrs["ints"] == [1, -2] and attrs["floats"] == [0.5, 2.0]
    assert isinstance(attrs["t"], np.ndarray) and attrs["t"].dtype == np.int64
    np.testing.assert_array_equal(attrs["t"], [[1, 2], [3, 4]])
    assert isinstance(attrs["g"], ir.Graph) and attrs["g"].name == "sub" and attrs["g"].outer_names == ["outer"]
    assert [g.name for g in attrs["gs"]] == ["sub", "sub2"] and all(isinstance(g, ir.Graph) for g in attrs["gs"])
    assert graph.nodes[1].subgraphs() == [attrs["g"], *attrs["gs"]]
    assert graph.nodes[1].attr("missing", 7) == 7


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int8, np.uint8, np.int16, np.uint16,
                                   np.int32, np.uint32, np.int64, np.uint64, np.bool_])
def test_tensor_arrays_are_numpy_helpers(dtype):
    """loader.tensor_array reads plain raw_data tensors itself: the same dtype, shape, values and flags as
    numpy_helper.to_array, which the typed-field, string and packed tensors still take."""
    values = (np.arange(24) % 7 - 3).reshape(2, 3, 4).astype(dtype)
    protos = [numpy_helper.from_array(values, "raw"), helper.make_tensor("typed", helper.np_dtype_to_tensor_dtype(
        np.dtype(dtype)), values.shape, values.reshape(-1).tolist()), numpy_helper.from_array(values[:0], "empty"),
        helper.make_tensor("text", TensorProto.STRING, (2,), [b"a", b"bc"]),
        helper.make_tensor("packed", TensorProto.INT4, (3,), [1, -2, 3])]
    for proto in protos:
        got, expected = model_loader.tensor_array(proto), numpy_helper.to_array(proto)
        assert got.dtype == expected.dtype and got.shape == expected.shape, proto.name
        assert got.flags.writeable == expected.flags.writeable, proto.name
        np.testing.assert_array_equal(got, expected, err_msg=proto.name)
    assert protos[0].HasField("raw_data") and not protos[1].HasField("raw_data")
