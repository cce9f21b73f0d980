"""Structural checks before shape inference: models that crashed the process, expanded forever or sent
data propagation after unbounded memory now fail at creation with a typed error naming the rule.

The hostile models run in a subprocess with a time and memory limit, so that a regression shows as a
failed test instead of a dead test process."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx_runtime.errors import InvalidGraphError
from onnx_runtime.model_checks import MAX_DECLARED_DIM, check_model_structure

CREATE = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
import onnx_runtime
try:
    onnx_runtime.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
    print("created")
except onnx_runtime.errors.InvalidGraphError as exc:
    print("InvalidGraphError:", exc)
"""


def tensor(name, elem=TensorProto.FLOAT, shape=(2,)):
    return helper.make_tensor_value_info(name, elem, list(shape) if shape is not None else None)


def model(nodes, inputs, outputs, opsets=(("", 17),), functions=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_operatorsetid(d, v) for d, v in opsets],
                             functions=list(functions))


def regex_with_empty_input():
    return model([helper.make_node("RegexFullMatch", [""], ["y"], pattern="a")], [tensor("x", TensorProto.STRING)],
                 [tensor("y", TensorProto.BOOL)], opsets=(("", 20),))


def label_encoder_with_empty_input():
    return model([helper.make_node("LabelEncoder", [""], ["y"], domain="ai.onnx.ml", keys_strings=["a"],
                                   values_int64s=[1])],
                 [tensor("x", TensorProto.STRING)], [tensor("y", TensorProto.INT64)],
                 opsets=(("", 17), ("ai.onnx.ml", 2)))


def huge_declared_dim():
    return model([helper.make_node("Shape", ["x"], ["s"]), helper.make_node("ConstantOfShape", ["s"], ["y"])],
                 [tensor("x", shape=[2**63 - 1])], [tensor("y", shape=None)])


def self_calling_function():
    body = helper.make_function("local", "Self", ["a"], ["b"], [helper.make_node("Self", ["a"], ["b"], domain="local")],
                                [helper.make_operatorsetid("", 17)])
    return model([helper.make_node("Self", ["x"], ["y"], domain="local")], [tensor("x")], [tensor("y")],
                 opsets=(("", 17), ("local", 1)), functions=[body])


def mutually_recursive_functions():
    ping = helper.make_function("local", "Ping", ["a"], ["b"], [helper.make_node("Pong", ["a"], ["b"], domain="local")],
                                [helper.make_operatorsetid("", 17)])
    pong = helper.make_function("local", "Pong", ["a"], ["b"], [helper.make_node("Ping", ["a"], ["b"], domain="local")],
                                [helper.make_operatorsetid("", 17)])
    return model([helper.make_node("Ping", ["x"], ["y"], domain="local")], [tensor("x")], [tensor("y")],
                 opsets=(("", 17), ("local", 1)), functions=[ping, pong])


def layer_norm_statistics(axis):
    def build():
        node = helper.make_node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv"], name="ln", axis=axis)
        return model([node], [tensor("x", shape=[2, 3, 4]), tensor("s", shape=[4]), tensor("b", shape=[4])],
                     [tensor("y", shape=None), tensor("mean", shape=None)])
    return build


def gather_nd_negative_batch_dims():
    # Fuzz seed 44: onnx's GatherND inference indexes by batch_dims; -2 crashed the process (SIGSEGV).
    node = helper.make_node("GatherND", ["d", "i"], ["o"], batch_dims=-2)
    return model([node], [tensor("d", TensorProto.INT32, [2, 2, 2]), tensor("i", TensorProto.INT64, [2, 1])],
                 [tensor("o", TensorProto.INT32, None)], opsets=(("", 13),))


def einsum_malformed_equation():
    # Fuzz seed 44: onnx's Einsum inference looped forever on a byte-flipped equation.
    node = helper.make_node("Einsum", ["x"], ["y"], equation="...\x07i ->(..i")
    return model([node], [tensor("x", shape=[3, 5, 5])], [tensor("y", shape=None)], opsets=(("", 12),))


@pytest.mark.parametrize("build, expected", [
    (einsum_malformed_equation, "is not an einsum equation"),
    (gather_nd_negative_batch_dims, "batch_dims is -2; it counts leading dimensions and must be >= 0"),
    # onnx sizes Mean/InvStdDev by the axis unchecked: -5 hung shape inference, 2**31 crashed it (SIGSEGV).
    (layer_norm_statistics(-5), "axis -5 is outside [-3, 3)"),
    (layer_norm_statistics(2**31), "axis 2147483648 is outside [-3, 3)"),
    (regex_with_empty_input, "input 0 (X) is required but named ''"),
    (label_encoder_with_empty_input, "input 0 (X) is required but named ''"),
    (huge_declared_dim, "declares dimension 0 as 9223372036854775807"),
    (self_calling_function, "cycle (local::Self -> local::Self)"),
    (mutually_recursive_functions, "cycle (local::Ping -> local::Pong -> local::Ping)"),
])
def test_a_hostile_model_fails_at_creation_with_a_typed_error(tmp_path, build, expected):
    path = tmp_path / "model.onnx"
    onnx.save(build(), str(path))
    done = subprocess.run([sys.executable, "-c", CREATE, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"the process died (rc {done.returncode}): {done.stderr[-2000:]}"
    assert done.stdout.startswith("InvalidGraphError:") and expected in done.stdout, done.stdout


def test_attribute_of_the_wrong_type_names_node_attribute_and_schema():
    bad = model([helper.make_node("Softmax", ["x"], ["y"], name="probs", axis=1.0)], [tensor("x")], [tensor("y")])
    with pytest.raises(InvalidGraphError, match=r"node 'probs' \(Softmax\).*'axis' is FLOAT; its schema declares INT"):
        check_model_structure(bad, "m")


def test_too_many_inputs_is_refused():
    bad = model([helper.make_node("Relu", ["x", "x"], ["y"])], [tensor("x")], [tensor("y")])
    with pytest.raises(InvalidGraphError, match="has 2 inputs; its schema takes 1 to 1"):
        check_model_structure(bad, "m")


def test_limit_dims_are_refused_inside_subgraphs_too():
    inner = helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "then", [],
                              [tensor("z", shape=[MAX_DECLARED_DIM])])
    bad = model([helper.make_node("If", ["c"], ["y"], then_branch=inner, else_branch=inner)],
                [tensor("c", TensorProto.BOOL, shape=[]), tensor("x")], [tensor("y", shape=None)])
    with pytest.raises(InvalidGraphError, match="a subgraph of a If node"):
        check_model_structure(bad, "m")


def test_optional_inputs_left_empty_still_load_and_run():
    """Empty names where the schema allows them (Clip's bounds, Resize's roi) are not refused."""
    import onnx_runtime

    ok = model([helper.make_node("Clip", ["x", "", "hi"], ["c"]),
                helper.make_node("Resize", ["c", "", "scales"], ["y"], mode="nearest")],
               [tensor("x", shape=[1, 1, 2, 2])], [tensor("y", shape=[1, 1, 4, 4])])
    ok.graph.initializer.extend([onnx.numpy_helper.from_array(np.float32(0.5), "hi"),
                                 onnx.numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")])
    check_model_structure(ok, "m")
    sess = onnx_runtime.InferenceSession(ok.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.array([[[[0.1, 0.9], [0.3, -1.0]]]], np.float32)
    (y,) = sess.run(None, {"x": x})
    assert np.array_equal(y, np.minimum(x, 0.5).repeat(2, axis=2).repeat(2, axis=3))


@pytest.mark.parametrize("node, expected", [
    (helper.make_node("Cast", ["x"], ["y"]), "lacks the required attribute(s) to"),
    (helper.make_node("If", ["c"], ["y"], then_branch=helper.make_graph(
        [helper.make_node("Identity", ["x"], ["z"])], "then", [], [tensor("z")])), "required attribute(s) else_branch"),
])
def test_a_missing_required_attribute_is_refused_at_creation(node, expected):
    import onnx_runtime

    bad = model([node], [tensor("x"), tensor("c", TensorProto.BOOL, shape=[])], [tensor("y")])
    with pytest.raises(InvalidGraphError, match=re.escape(expected)):
        onnx_runtime.InferenceSession(bad.SerializeToString(), providers=["CPUExecutionProvider"])


def test_trailing_empty_names_are_left_out_optionals_not_extra_inputs():
    ok = model([helper.make_node("Split", ["x", ""], ["a", "b"], axis=0, split=[1, 1])], [tensor("x")],
               [tensor("a", shape=[1]), tensor("b", shape=[1])], opsets=(("", 11),))
    check_model_structure(ok, "m")


def test_a_value_defined_twice_is_refused():
    # The fuzz harness's Split wrote its third output over the graph input 'x'.
    bad = model([helper.make_node("Relu", ["x"], ["h"]), helper.make_node("Neg", ["h"], ["x"])],
                [tensor("x")], [tensor("h")])
    with pytest.raises(InvalidGraphError, match="value .x. in model m is a graph input or initializer and also"):
        check_model_structure(bad, "m")


def test_a_cycle_of_nodes_is_refused_and_nodes_out_of_order_are_not():
    # The fuzz harness rewired an EyeLike to read its own output: onnx's shape inference crashed the process.
    loop = model([helper.make_node("EyeLike", ["v"], ["v"])], [tensor("x", shape=[3, 4])], [tensor("v", shape=None)])
    with pytest.raises(InvalidGraphError, match="an? EyeLike node in model m depends on its own output"):
        check_model_structure(loop, "m")
    two = model([helper.make_node("Relu", ["x", ], ["a"]), helper.make_node("Add", ["a", "c"], ["b"]),
                 helper.make_node("Neg", ["b"], ["c"])], [tensor("x")], [tensor("b")])
    with pytest.raises(InvalidGraphError, match="Add node in model m depends on its own output through a cycle"):
        check_model_structure(two, "m")
    out_of_order = model([helper.make_node("Neg", ["a"], ["b"]), helper.make_node("Relu", ["x"], ["a"])],
                         [tensor("x")], [tensor("b")])
    check_model_structure(out_of_order, "m")


def test_counting_attributes_must_match_the_node():
    split = model([helper.make_node("Split", ["x"], ["a", "b", "c"], axis=0, num_outputs=2)],
                  [tensor("x", shape=[6])], [tensor("a", shape=None)], opsets=(("", 18),))
    with pytest.raises(InvalidGraphError, match="has 3 outputs .empty names included. but num_outputs 2"):
        check_model_structure(split, "m")
    # A trailing empty output name still counts: onnx's Split inference indexes that slot too (it aborted the
    # process; fuzz seed 76).
    trailing = model([helper.make_node("Split", ["x"], ["a", "b", ""], axis=0, num_outputs=2)],
                     [tensor("x", shape=[6])], [tensor("a", shape=None)], opsets=(("", 18),))
    with pytest.raises(InvalidGraphError, match="has 3 outputs .empty names included. but num_outputs 2"):
        check_model_structure(trailing, "m")
    body = helper.make_graph([helper.make_node("Identity", ["s"], ["t"])], "body", [tensor("s", shape=[])],
                             [tensor("t", shape=[])])
    scan = model([helper.make_node("Scan", ["x"], ["y"], body=body, num_scan_inputs=2**63 - 1)],
                 [tensor("x", shape=[3])], [tensor("y", shape=None)], opsets=(("", 11),))
    with pytest.raises(InvalidGraphError, match="num_scan_inputs 9223372036854775807 is not in"):
        check_model_structure(scan, "m")


def test_none_of_onnxs_node_cases_is_refused():
    import warnings

    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    assert len(cases) > 1800
    for case in cases:
        check_model_structure(case.model, case.name)


def _sparse_weight(name="w"):
    values = helper.make_tensor(name, TensorProto.FLOAT, [2], [1.0, 2.0])
    indices = helper.make_tensor(f"{name}_indices", TensorProto.INT64, [2], [0, 3])
    return helper.make_sparse_tensor(values, indices, [4])


def test_a_sparse_initializer_is_a_definition_in_the_one_walk():
    # Read by a node: defined. Also produced by a node: two definitions, refused like a dense initializer's.
    reads = model([helper.make_node("Add", ["x", "w"], ["y"])], [tensor("x", shape=[4])], [tensor("y", shape=[4])])
    reads.graph.sparse_initializer.append(_sparse_weight())
    check_model_structure(reads, "m")
    overwritten = model([helper.make_node("Relu", ["x"], ["w"]), helper.make_node("Add", ["x", "w"], ["y"])],
                        [tensor("x", shape=[4])], [tensor("y", shape=[4])])
    overwritten.graph.sparse_initializer.append(_sparse_weight())
    with pytest.raises(InvalidGraphError, match="value 'w' in model m is a graph input or initializer and also "
                                                "produced by a Relu node"):
        check_model_structure(overwritten, "m")


def test_an_undefined_read_is_refused_only_at_the_top_level():
    undefined = model([helper.make_node("Relu", ["nowhere"], ["y"])], [tensor("x")], [tensor("y")])
    with pytest.raises(InvalidGraphError, match="a Relu node in model m reads 'nowhere', which no graph input"):
        check_model_structure(undefined, "m")
    # A subgraph reads its enclosing graph's values.
    branch = helper.make_graph([helper.make_node("Relu", ["x"], ["t"])], "then", [], [tensor("t")])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [], [tensor("e")])
    outer = model([helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)],
                  [tensor("x"), tensor("c", TensorProto.BOOL, [])], [tensor("y")])
    check_model_structure(outer, "m")


def test_latest_opsets_agree_with_every_schema():
    from onnx import defs
    from onnx_runtime.model_checks import _latest_opsets  # noqa: PLC2701 (the cache under test)

    newest: dict[str, int] = {}
    for schema in defs.get_all_schemas_with_history():
        newest[schema.domain] = max(newest.get(schema.domain, 1), schema.since_version)
    latest = _latest_opsets()
    assert {domain: latest[domain] for domain in newest} == newest
    assert latest[""] == defs.onnx_opset_version()


def test_a_training_optimizers_input_types_are_checked(tmp_path):
    # Fuzz seed 42: Adam's G2 declared as a string reached the kernel (a TypeError inside a KernelError).
    names = ["R", "T", "X1", "G1", "V1", "H1"]
    types = [TensorProto.FLOAT, TensorProto.INT64, TensorProto.FLOAT, TensorProto.STRING, TensorProto.FLOAT,
             TensorProto.FLOAT]
    adam = helper.make_node("Adam", names, ["X1_new", "V1_new", "H1_new"], domain="ai.onnx.preview.training")
    bad = model([adam], [tensor(n, t, [] if n in ("R", "T") else [2]) for n, t in zip(names, types)],
                [tensor("X1_new", shape=None), tensor("V1_new", shape=None), tensor("H1_new", shape=None)],
                opsets=(("", 17), ("ai.onnx.preview.training", 1)))
    path = tmp_path / "adam.onnx"
    onnx.save(bad, str(path))
    result = subprocess.run([sys.executable, "-c", CREATE, str(path)], capture_output=True, text=True, timeout=120)
    assert "InvalidGraphError" in result.stdout and "input 3 ('G1') is tensor(string); its schema allows " \
           "tensor(double), tensor(float)" in result.stdout, result.stdout + result.stderr[-2000:]


def _cast(to, opset):
    cast = model([helper.make_node("Cast", ["x"], ["y"], to=to)], [tensor("x")], [tensor("y", shape=None)],
                 opsets=(("", opset),))
    cast.ir_version = 3 if opset < 7 else cast.ir_version
    return cast


@pytest.mark.parametrize(("to", "opset", "shown"), [("", 1, "''"), ("FLAOT", 1, "'FLAOT'"), (100, 13, "'100'"),
                                                    (0, 13, "'0'")])
def test_an_element_type_attribute_must_name_one(to, opset, shown):
    # Fuzz seed 42: Cast-1's string 'to' retyped to '' reached the optimizer (an untyped ValueError).
    with pytest.raises(InvalidGraphError, match=f"a Cast node in model m: attribute 'to' is {shown}, which names no "
                                                f"ONNX element type"):
        check_model_structure(_cast(to, opset), "m")


@pytest.mark.parametrize("to", ["FLOAT", "DOUBLE"])
def test_cast_1_names_its_type_and_runs(to):
    import onnx_runtime as ort

    session = ort.InferenceSession(_cast(to, 1).SerializeToString(), providers=["CPUExecutionProvider"])
    result = session.run(None, {"x": np.array([1.5, -2.0], np.float32)})[0]
    assert result.dtype == (np.float32 if to == "FLOAT" else np.float64) and result.tolist() == [1.5, -2.0]


def test_types_are_checked_inside_subgraphs_with_the_enclosing_values():
    # Fuzz seed 43: a Scan body's Reshape rewired to a float shape reached the kernel (a TypeError inside a
    # KernelError). The branch reads the outer float 's' as Reshape's shape.
    from onnx_runtime.model_checks import check_types

    then = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["t"])], "then", [], [tensor("t", shape=None)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["e"])], "else", [], [tensor("e", shape=None)])
    outer = model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                  [tensor("x", shape=[4]), tensor("s", shape=[1]), tensor("c", TensorProto.BOOL, [])],
                  [tensor("y", shape=None)])
    with pytest.raises(InvalidGraphError, match=r"a Reshape node in model m: input 1 \('s'\) is tensor\(float\); "
                                                r"its schema allows tensor\(int64\)"):
        check_types(outer.graph, {"": 17}, "m")
    # Declared int64 inside the branch (shadowing the outer float), it passes.
    branch = next(a.g for a in outer.graph.node[0].attribute if a.name == "then_branch")
    branch.value_info.append(tensor("s", TensorProto.INT64, [1]))
    check_types(outer.graph, {"": 17}, "m")


def test_a_type_reaches_a_node_through_the_ops_that_keep_it_over_a_stale_declaration():
    # Fuzz seed 60: a string graph input passed Reshape and Transpose (types that keep their input's) into a
    # LogSoftmax while shape inference had failed, and the stale float16 declaration of a later value did not
    # stop it: the kernel subtracted strings (a TypeError inside a KernelError).
    from onnx_runtime.model_checks import check_types

    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
             helper.make_node("Reshape", ["t", "shape"], ["r"]),
             helper.make_node("LogSoftmax", ["r"], ["y"])]
    graph = model(nodes, [tensor("x", TensorProto.STRING, [2, 3]), tensor("shape", TensorProto.INT64, [2])],
                  [tensor("y", TensorProto.FLOAT16, None)]).graph
    graph.value_info.append(tensor("r", TensorProto.FLOAT16, [3, 2]))  # stale: the Reshape keeps x's strings
    with pytest.raises(InvalidGraphError, match=r"a LogSoftmax node in model m: input 0 \('r'\) is "
                                                r"tensor\(string\); its schema allows .*tensor\(float\)"):
        check_types(graph, {"": 17}, "m")
    graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT  # the same graph over floats passes
    check_types(graph, {"": 17}, "m")
