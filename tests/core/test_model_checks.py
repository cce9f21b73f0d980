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


@pytest.mark.parametrize("build, expected", [
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


def test_counting_attributes_must_match_the_node():
    split = model([helper.make_node("Split", ["x"], ["a", "b", "c"], axis=0, num_outputs=2)],
                  [tensor("x", shape=[6])], [tensor("a", shape=None)], opsets=(("", 18),))
    with pytest.raises(InvalidGraphError, match="has 3 outputs but num_outputs 2"):
        check_model_structure(split, "m")
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
