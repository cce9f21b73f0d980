"""Grid tables (qdq_tables.fuse_grid_tables, ops/grid_table.py): a QDQ model's float chain of one rounded
activation and constant scalars runs as one lookup of the activation's code, with the values the chain's own
nodes give. Checked against a float64 evaluation of the same graph (QuantizeLinear rounding at the same points),
onnxruntime, and on the zoo's QDQ decoders (both exporters): the chains are tabled and the steps per decode call
fall."""
from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import onnx
import onnx_runtime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import OnnxRuntimeError
from onnx_runtime_ep_cpu import qdq_fusions

SCALE_X, ZERO_X = 0.021, 131
# (name, scale, zero point) of each rounding; int8 zero points for one of them
GRIDS = [("a", 0.013, 128), ("b", 0.0071, 10), ("c", 0.012, 0), ("d", 0.0093, -3), ("e", 0.011, 120)]


def _qdq(nodes, inits, x: str, tag: str, scale: float, zero: int) -> str:
    dtype = np.int8 if zero < 0 else np.uint8
    inits += [numpy_helper.from_array(np.array(scale, np.float32), f"s_{tag}"),
              numpy_helper.from_array(np.array(zero, dtype), f"z_{tag}")]
    nodes += [helper.make_node("QuantizeLinear", [x, f"s_{tag}", f"z_{tag}"], [f"q_{tag}"]),
              helper.make_node("DequantizeLinear", [f"q_{tag}", f"s_{tag}", f"z_{tag}"], [f"r_{tag}"])]
    return f"r_{tag}"


def _tanh_gelu_model() -> onnx.ModelProto:
    """x -> rounding -> GPT-2's tanh GELU with a rounding after each operator -> MatMul by a float weight (a
    reader outside the chain)."""
    nodes, inits = [], []
    g = _qdq(nodes, inits, "x", "x", SCALE_X, ZERO_X)
    constants = {"three": 3.0, "k": 0.044715, "c": 0.7978846, "one": 1.0, "half": 0.5}
    inits += [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in constants.items()]
    steps = [("Pow", [g, "three"]), ("Mul", [None, "k"]), ("Add", [g, None]), ("Mul", [None, "c"]),
             ("Tanh", [None]), ("Add", [None, "one"]), ("Mul", [g, None]), ("Mul", [None, "half"])]
    value = g
    for index, (op, inputs) in enumerate(steps):
        out = f"t{index}"
        nodes.append(helper.make_node(op, [value if i is None else i for i in inputs], [out]))
        tag, scale, zero = GRIDS[index % len(GRIDS)]
        value = _qdq(nodes, inits, out, f"{tag}{index}", scale, zero)
    inits.append(numpy_helper.from_array(np.random.default_rng(1).standard_normal((16, 8)).astype(np.float32), "w"))
    nodes.append(helper.make_node("MatMul", [value, "w"], ["y"]))
    graph = helper.make_graph(nodes, "tanh_gelu", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 8])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 19)])


def _float64_reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    """The graph in float64 with QuantizeLinear's rounding (half to even, saturated) at each pair."""
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    values = {"x": x.astype(np.float64), **{k: v.astype(np.float64) if v.dtype == np.float32 else v
                                              for k, v in constants.items()}}
    ops = {"Pow": np.power, "Mul": np.multiply, "Add": np.add, "Tanh": np.tanh, "MatMul": np.matmul}
    for node in model.graph.node:
        a = [values[i] for i in node.input]
        if node.op_type == "QuantizeLinear":
            info = np.iinfo(a[2].dtype)
            out = np.clip(np.rint(a[0] / a[1]) + a[2].astype(np.float64), info.min, info.max).astype(a[2].dtype)
        elif node.op_type == "DequantizeLinear":
            out = (a[0].astype(np.float64) - a[2].astype(np.float64)) * a[1]
        else:
            out = ops[node.op_type](*a)
        values[node.output[0]] = out
    return values["y"]


def _session(model: onnx.ModelProto, tmp_path: Path, name: str = "model.onnx"):
    path = tmp_path / name
    onnx.save(model, path)
    return onnx_runtime.InferenceSession(str(path), providers=["cpu"]), path


def test_tanh_gelu_chain_is_one_table_and_agrees_with_float64_and_onnxruntime(tmp_path):
    model = _tanh_gelu_model()
    session, path = _session(model, tmp_path)
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((33, 16)) * 2).astype(np.float32)
    x.reshape(-1)[:3] = [40.0, -40.0, 0.5 * SCALE_X]  # saturation both ways, a tie
    ops = [n.op_type for n in session.graph_for({"x": x}).nodes]
    assert ops.count("GridTable") == 1 and not {"Pow", "Tanh", "Add"} & set(ops), ops
    got = session.run(None, {"x": x})[0]
    # the last rounding's code times the weight's column sums bounds one code's effect on y
    weight = numpy_helper.to_array([i for i in model.graph.initializer if i.name == "w"][0]).astype(np.float64)
    code = GRIDS[7 % len(GRIDS)][1] * np.abs(weight).sum(0).max()
    exact = _float64_reference(model, x)
    assert float(np.abs(got - exact).max()) <= code * (1 + 1e-4)
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    want = oracle.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert float(np.abs(got - want).max()) <= code * (1 + 1e-4)
    again = session.run(None, {"x": x[:5]})[0]  # another length: the same table
    np.testing.assert_allclose(again, got[:5], rtol=0, atol=1e-6)


def test_the_table_is_the_chain_without_the_pass(tmp_path):
    """Tabled and untabled runs of the same graph agree to float32 rounding (the same kernels per element)."""
    model = _tanh_gelu_model()
    x = (np.random.default_rng(3).standard_normal((7, 16)) * 3).astype(np.float32)
    tabled = _session(model, tmp_path)[0].run(None, {"x": x})[0]
    with _without_tables():  # (a session runs the passes again when it specializes to the feeds' shapes)
        plain_session = _session(model, tmp_path, "plain.onnx")[0]
        assert "GridTable" not in [n.op_type for n in plain_session.graph_for({"x": x}).nodes]
        plain = plain_session.run(None, {"x": x})[0]
    np.testing.assert_allclose(tabled, plain, rtol=1e-6, atol=1e-6)


@contextlib.contextmanager
def _without_tables():
    """Sessions made inside build their plans without the grid-table pass (restored at its place after)."""
    passes = qdq_fusions.QDQ_PASSES
    index = passes.index(qdq_fusions.fuse_grid_tables)
    passes.remove(qdq_fusions.fuse_grid_tables)
    try:
        yield
    finally:
        passes.insert(index, qdq_fusions.fuse_grid_tables)


def test_a_grid_table_refuses_other_input_types(tmp_path):
    session, _ = _session(_tanh_gelu_model(), tmp_path)
    graph = session.graph_for({"x": np.zeros((2, 16), np.float32)})
    table = next(n for n in graph.nodes if n.op_type == "GridTable")
    from onnx_runtime_ep_cpu.ops.grid_table import grid_table

    kernel = grid_table(table, [None] * len(table.inputs), 1)
    constants = [graph.initializers[name] for name in table.inputs[1:]]
    with pytest.raises(OnnxRuntimeError, match="float32"):
        kernel(np.zeros(4, np.float64), *constants)
    with pytest.raises(OnnxRuntimeError, match="uint8 or int8"):
        kernel(np.zeros(4, np.float32), constants[0], np.array(3, np.int32), *constants[2:])


@pytest.mark.parametrize("name, gone", [
    ("gpt2.torchscript", {"Pow", "Tanh"}), ("gpt2.dynamo", {"Pow", "Tanh"}),  # the tanh GELU
    ("llama.torchscript", {"Sigmoid"}), ("llama.dynamo", {"Sigmoid"}),  # SiLU's gate
])
def test_decoder_chains_are_tabled_and_steps_fall(qdq_decoders, name, gone):
    built, entries, zoo_feeds = qdq_decoders
    feeds = zoo_feeds.make_feeds(entries[name + ".fp32"]["calls"]["decode"])
    tabled = onnx_runtime.InferenceSession(str(built[name]), providers=["cpu"]).graph_for(feeds)
    with _without_tables():
        plain = onnx_runtime.InferenceSession(str(built[name]), providers=["cpu"]).graph_for(feeds)
    ops = [n.op_type for n in tabled.nodes]
    assert "GridTable" in ops and not gone & set(ops), ops
    assert len(tabled.nodes) < len(plain.nodes) - 8, (len(tabled.nodes), len(plain.nodes))
