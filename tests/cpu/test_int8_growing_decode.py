"""A dynamic int8 decoder step (onnxruntime.quantization.quantize_dynamic of a small float model with a past) in a
generation loop, one token further each call, as zoo_bench times decode. Its query, key and value products read
one input (one DynamicQuantizeMatMulGroup, qdq_fusions.py), and its T5-style relative-position bias reads the
present's length off Shape of the present (Concat of the past and the group's key) and gathers a quantized table
(Gather of int8 codes, DequantizeLinear). The group and the table's DequantizeLinear must leave those steps
shape-only (session/steps.py, session/shape_symbols.py), so that a new length instantiates them instead of running
them: counted per run through the profile, a new length runs as many steps as a length seen before, and every
output stays within a bound of a float64 evaluation of the quantized graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime
import pytest
from onnx import TensorProto, helper, numpy_helper

D, BUCKETS = 16, 8
PAST = 3
_SHAPE_WORK = ("Shape", "Range", "Sub", "Neg", "Min", "DequantizeLinear")


def _float_model() -> onnx.ModelProto:
    rng = np.random.default_rng(20)
    weights = {name: (rng.standard_normal((D, D)) * 0.3).astype(np.float32) for name in ("wq", "wk", "wv", "wo")}
    consts = {**weights, "table": rng.standard_normal((BUCKETS, 1)).astype(np.float32),
              "zero": np.array(0, np.int64), "one": np.array(1, np.int64), "top": np.array(BUCKETS - 1, np.int64),
              "scale": np.array(D ** -0.5, np.float32), "ax": np.array([0], np.int64)}
    n = helper.make_node
    nodes = [n("MatMul", ["x", "wq"], ["q"]), n("MatMul", ["x", "wk"], ["k"]), n("MatMul", ["x", "wv"], ["v"]),
             n("Concat", ["past_k", "k"], ["present_k"], axis=1),
             n("Concat", ["past_v", "v"], ["present_v"], axis=1),
             n("Shape", ["present_k"], ["shape"]),
             n("Gather", ["shape", "one"], ["total"], axis=0),
             n("Range", ["zero", "total", "one"], ["pos"]),
             n("Sub", ["total", "pos"], ["distance"]),  # how far back each key is, from 1
             n("Min", ["distance", "top"], ["bucket"]),
             n("Gather", ["table", "bucket"], ["bias_col"], axis=0),  # (total, 1)
             n("Transpose", ["bias_col"], ["bias"], perm=[1, 0]),  # (1, total)
             n("Transpose", ["present_k"], ["keys_t"], perm=[0, 2, 1]),
             n("MatMul", ["q", "keys_t"], ["raw"]),
             n("Mul", ["raw", "scale"], ["scaled"]),
             n("Add", ["scaled", "bias"], ["scores"]),
             n("Softmax", ["scores"], ["probs"], axis=-1),
             n("MatMul", ["probs", "present_v"], ["context"]),
             n("MatMul", ["context", "wo"], ["y"])]
    info = helper.make_tensor_value_info
    graph = helper.make_graph(
        nodes, "int8_decoder_step",
        [info("x", TensorProto.FLOAT, [1, 1, D]), info("past_k", TensorProto.FLOAT, [1, "past", D]),
         info("past_v", TensorProto.FLOAT, [1, "past", D])],
        [info("y", TensorProto.FLOAT, None), info("present_k", TensorProto.FLOAT, None),
         info("present_v", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(value, name) for name, value in consts.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> onnx.ModelProto:
    quantization = pytest.importorskip("onnxruntime.quantization")
    folder = tmp_path_factory.mktemp("int8_decoder")
    onnx.save(_float_model(), folder / "float.onnx")
    quantization.quantize_dynamic(folder / "float.onnx", folder / "int8.onnx", weight_type=quantization.QuantType.QInt8)
    model = onnx.load(folder / "int8.onnx")
    ops = {node.op_type for node in model.graph.node}
    assert {"DynamicQuantizeLinear", "MatMulInteger", "DequantizeLinear"} <= ops, ops  # the table is int8 too
    return model


def _dynamic_quantize(x: np.ndarray) -> tuple[np.ndarray, np.float64, np.float64]:
    """DynamicQuantizeLinear as the ONNX spec writes it (its scale a float32, as the outputs' type)."""
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = np.float64(np.float32((high - low) / 255)) if high > low else np.float64(np.float32(1 / 255))
    zero = np.clip(np.rint(-low / scale), 0, 255)
    return np.clip(np.rint(x / scale) + zero, 0, 255), scale, zero


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


# The float64 evaluation of each operator the quantized graph holds: (inputs, attributes) -> outputs.
_FLOAT64 = {
    "DynamicQuantizeLinear": lambda a, _: list(_dynamic_quantize(a[0])),
    "MatMulInteger": lambda a, _: [(a[0] - a[2]) @ (a[1].astype(np.float64) - a[3].astype(np.float64))],
    "Cast": lambda a, _: [a[0].astype(np.float64)],
    "DequantizeLinear": lambda a, _: [(a[0].astype(np.float64) - a[2].astype(np.float64)) * a[1]],
    "Shape": lambda a, _: [np.array(a[0].shape, np.int64)],
    "Gather": lambda a, at: [np.take(a[0], a[1].astype(np.int64), axis=at.get("axis", 0))],
    "Range": lambda a, _: [np.arange(int(a[0]), int(a[1]), int(a[2]), dtype=np.int64)],
    "Concat": lambda a, at: [np.concatenate(a, axis=at["axis"])],
    "Transpose": lambda a, at: [np.transpose(a[0], at["perm"])],
    "Softmax": lambda a, _: [_softmax(a[0])],
    "Sub": lambda a, _: [a[0] - a[1]], "Min": lambda a, _: [np.minimum(a[0], a[1])],
    "Add": lambda a, _: [a[0] + a[1]], "Mul": lambda a, _: [a[0] * a[1]], "MatMul": lambda a, _: [a[0] @ a[1]],
}


def _reference(model: onnx.ModelProto, feeds: dict) -> tuple[dict, dict]:
    """Every value of the quantized graph in float64 (integer products exact); and for each product's float
    output, what one code of difference in each of its activation's codes (a tie rounded the other way in
    float32) could move it by: the weight's column sums of |codes - zero point|, times the product's scale."""
    env: dict = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    env.update({name: value.astype(np.float64) for name, value in feeds.items()})
    slack: dict = {}
    for node in model.graph.node:
        a = [env[name] for name in node.input]
        attrs = {attr.name: helper.get_attribute_value(attr) for attr in node.attribute}
        env.update(zip(node.output, _FLOAT64[node.op_type](a, attrs)))
        if node.op_type == "MatMulInteger":
            slack[node.output[0]] = np.abs(a[1].astype(np.float64) - a[3].astype(np.float64)).sum(axis=0)
        elif node.op_type in ("Cast", "Mul") and node.input[0] in slack:  # codes to float, then rescaled
            slack[node.output[0]] = slack[node.input[0]] * (np.abs(a[1]) if node.op_type == "Mul" else 1.0)
    return env, slack


def _decode_feeds(lengths: range):
    rng = np.random.default_rng(7)
    for past in lengths:
        yield {"x": rng.standard_normal((1, 1, D)).astype(np.float32),
               "past_k": rng.standard_normal((1, past, D)).astype(np.float32),
               "past_v": rng.standard_normal((1, past, D)).astype(np.float32)}


def test_the_query_key_and_value_products_run_as_one_group(quantized):
    session = onnx_runtime.InferenceSession(quantized.SerializeToString(), providers=["cpu"])
    feeds = next(_decode_feeds(range(PAST, PAST + 1)))
    ops = {node.op_type for node in session.graph_for(feeds).nodes}
    assert "DynamicQuantizeMatMulGroup" in ops, ops  # the query, key and value products as one


def _profiled_steps(session) -> tuple[int, dict]:
    summary = session.profile_summary()
    return sum(calls for op, (_, calls) in summary.items() if op != "copy"), summary


def test_a_new_length_runs_the_steps_of_a_length_seen_before(quantized, tmp_path):
    options = onnx_runtime.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = onnx_runtime.InferenceSession(quantized.SerializeToString(), options, providers=["cpu"])
    first, later = range(PAST, PAST + 3), range(PAST + 3, PAST + 23)
    for feeds in _decode_feeds(first):  # an exact plan, then a symbolic one, then its shape program
        session.run(None, feeds)
    session.end_profiling()
    for feeds in _decode_feeds(later):
        session.run(None, feeds)
    grown, summary = _profiled_steps(session)
    assert not [op for op in _SHAPE_WORK if op in summary], summary  # instantiated, not run
    session.end_profiling()
    seen = list(_decode_feeds(later))
    for feeds in seen:  # the same lengths again: their shape values are kept per length
        session.run(None, feeds)
    again, _ = _profiled_steps(session)
    assert grown == again, (grown, again)


def test_growing_decode_outputs_agree_with_a_float64_reference(quantized):
    session = onnx_runtime.InferenceSession(quantized.SerializeToString(), providers=["cpu"])
    outputs = [o.name for o in quantized.graph.output]
    concats = {node.output[0]: node.input[1] for node in quantized.graph.node if node.op_type == "Concat"}
    for feeds in _decode_feeds(range(PAST, PAST + 24)):
        got = dict(zip(outputs, session.run(None, feeds)))
        want, slack = _reference(quantized, feeds)
        for name in ("present_k", "present_v"):  # the past as fed, then the new key or value product
            new = concats[name]
            np.testing.assert_array_equal(got[name][:, :-1], feeds["past_" + name[-1]])
            error = np.abs(got[name][:, -1:] - want[new])
            assert np.all(error <= slack[new] + 1e-5 * np.abs(want[new])), (name, error.max(), slack[new].min())
        # y: softmax over the products, then the output product: bounded relative to its magnitude
        np.testing.assert_allclose(got["y"], want["y"], rtol=0, atol=0.02 * float(np.abs(want["y"]).max()))
