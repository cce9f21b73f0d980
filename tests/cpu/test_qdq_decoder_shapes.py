"""QDQ decoders with a past (onnxruntime.quantization.quantize_static of the zoo's gpt2 and llama, both torch
exporters; benchmarks/qdq_decoders.py) keep their shape work out of the per-call steps.

The provider's fusions replace nodes with operators of its own domain (QuantizeDequantize, QuantizedMatMul,
CodeTable, ...); each must declare how its output shapes follow (fused_shapes.py into session/shape_rules.py), or
everything downstream looks value-dependent and a decode step's Shape/Unsqueeze/Range chains run on every call
(and for every new length). The QDQ pairs also keep Reshape, Split, Flatten and reductions that a float graph
fuses away, so their shapes are given from shape-only sizes (steps.py, shape_layout.py)."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime
import pytest
from onnx import TensorProto, numpy_helper
from onnx_runtime.session import shape_rules
from onnx_runtime.session.shape_layout import layout_shapes
from onnx_runtime_ep_cpu import fused_shapes, registry
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN

DECODERS = ("gpt2.torchscript", "gpt2.dynamo", "llama.torchscript", "llama.dynamo", "t5_decoder.torchscript",
            "t5_decoder.dynamo")
# Operators that only compute shapes, positions or masks: none may run per call once the lengths are known.
SHAPE_WORK = ("Shape", "Size", "Range", "ConstantOfShape")


def test_every_fused_operator_declares_its_shape_rule():
    fused = {op for domain, op in registry.registered_ops() if domain == FUSED_DOMAIN}
    declared = shape_rules.declared(FUSED_DOMAIN)
    assert fused, "no fused operators registered"
    assert sorted(fused - set(declared)) == [], "fused operators without a shape rule (fused_shapes.RULES)"
    assert sorted(set(fused_shapes.RULES) - fused) == [], "rules for operators no kernel implements"
    assert all(rule.kind in shape_rules.KINDS for rule in declared.values())


def test_a_conflicting_or_malformed_declaration_is_refused():
    with pytest.raises(ValueError, match="QuantizeDequantize"):
        shape_rules.declare(FUSED_DOMAIN, "QuantizeDequantize", shape_rules.SHAPES)
    with pytest.raises(ValueError, match="kind"):
        shape_rules.declare("test.domain", "Anything", "elementwise")
    with pytest.raises(ValueError, match="operand"):
        shape_rules.declare("test.domain", "Anything", shape_rules.MATMUL, (0,))
    assert shape_rules.rule_of("test.domain", "Anything") is None


def _forms(shape, symbols=1):
    out = []
    for d in shape:
        form = np.zeros(1 + symbols, np.int64)
        if isinstance(d, str):
            form[1] = 1  # the symbol itself
        else:
            form[0] = d
        out.append(form)
    return tuple(out)


def _at(forms, value):
    return tuple(int(f[0] + f[1] * value) for f in forms)


@pytest.mark.parametrize("op, attrs, shape, sizes, numpy_rule", [
    ("Reshape", {}, (1, "s", 64), [1, -1, 4, 16], lambda x: x.reshape(1, -1, 4, 16)),
    ("Reshape", {}, (1, "s", 4, 16), [0, 0, 64], lambda x: x.reshape(x.shape[0], x.shape[1], 64)),
    ("Reshape", {}, (2, "s", 3), [-1, 3], lambda x: x.reshape(-1, 3)),
    ("Unsqueeze", {}, (1, "s"), [1, -1], lambda x: x[:, None, :, None]),
    ("Squeeze", {}, (1, "s", 1), [0], lambda x: x[0]),
    ("Flatten", {"axis": 2}, (1, 4, "s", 2), None, lambda x: x.reshape(4, -1)),
    ("ReduceMean", {"keepdims": 1}, (1, "s", 8), [-1], lambda x: x.mean(-1, keepdims=True)),
    ("ReduceSum", {"keepdims": 0}, (2, "s", 8), [0, 2], lambda x: x.sum((0, 2))),
])
def test_layout_shapes_agree_with_numpy(op, attrs, shape, sizes, numpy_rule):
    node = onnx_runtime.ir.Node(op, ["x", "sizes"] if sizes is not None else ["x"], ["y"], attrs=attrs)
    got = layout_shapes(node, [_forms(shape)], lambda i: list(_forms(sizes)), 1)
    assert got is not None
    for length in (1, 3, 7):
        x = np.zeros(tuple(length if isinstance(d, str) else d for d in shape))
        assert _at(got[0], length) == numpy_rule(x).shape, (op, length)


def test_split_shapes_and_refusals():
    node = onnx_runtime.ir.Node("Split", ["x", "split"], ["a", "b", "c"], attrs={"axis": 2})
    got = layout_shapes(node, [_forms((1, "s", 192))], lambda i: list(_forms((64, 64, 64))), 1)
    assert [_at(g, 5) for g in got] == [(1, 5, 64)] * 3
    uneven = onnx_runtime.ir.Node("Split", ["x"], ["a", "b"], attrs={"axis": 1})
    assert layout_shapes(uneven, [_forms((1, "s", 8))], lambda i: None, 1) is None  # a symbolic split axis
    unknown = onnx_runtime.ir.Node("Reshape", ["x", "shape"], ["y"])
    assert layout_shapes(unknown, [_forms((1, "s"))], lambda i: None, 1) is None  # sizes computed per call


def _steps(session) -> tuple[int, dict]:
    summary = session.profile_summary()
    return sum(calls for op, (_, calls) in summary.items() if op != "copy"), summary


@pytest.mark.parametrize("name", DECODERS)
def test_a_new_length_runs_no_shape_step(qdq_decoders, name, tmp_path):
    built, entries, zoo_feeds = qdq_decoders
    calls = entries[name + ".fp32"]["calls"]
    options = onnx_runtime.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    session = onnx_runtime.InferenceSession(str(built[name]), options, providers=["cpu"])
    ops = {node.op_type for node in session.graph_for(zoo_feeds.make_feeds(calls["prefill"])).nodes}
    # the QDQ pairs were fused (into QuantizeDequantize nodes, or the nodes that round, which may leave none)
    assert "QuantizedMatMul" in ops and not {"QuantizeLinear", "DequantizeLinear"} & ops, ops
    decode = [zoo_feeds.make_feeds(zoo_feeds.grown(calls["decode"], extra)) for extra in range(12)]
    session.run(None, zoo_feeds.make_feeds(calls["prefill"]))
    for feeds in decode[:4]:  # an exact plan, then a symbolic one, then its shape program
        session.run(None, feeds)
    session.end_profiling()
    for feeds in decode[4:]:  # new lengths
        session.run(None, feeds)
    grown, summary = _steps(session)
    assert not [op for op in SHAPE_WORK if op in summary], {op: summary[op] for op in SHAPE_WORK if op in summary}
    session.end_profiling()
    for feeds in decode[4:]:  # lengths seen before
        session.run(None, feeds)
    again, _ = _steps(session)
    assert grown == again, (grown, again)


@pytest.mark.parametrize("name", DECODERS)
def test_outputs_agree_with_onnxruntime_within_activation_codes(qdq_decoders, name):
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    built, entries, zoo_feeds = qdq_decoders
    model = onnx.load(built[name])
    constants = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    producer = {out: node for node in model.graph.node for out in node.output}
    # each output is a DequantizeLinear of codes: its scale is one activation code
    code = {o.name: float(constants[producer[o.name].input[1]]) for o in model.graph.output}
    ours = onnx_runtime.InferenceSession(str(built[name]), providers=["cpu"])
    theirs = oracle.InferenceSession(str(built[name]), providers=["CPUExecutionProvider"])
    calls = entries[name + ".fp32"]["calls"]
    feeds = [zoo_feeds.make_feeds(calls["prefill"])]
    feeds += [zoo_feeds.make_feeds(zoo_feeds.grown(calls["decode"], extra)) for extra in range(8)]
    for feed in feeds:
        for output, got, want in zip(code, ours.run(None, feed), theirs.run(None, feed)):
            assert got.shape == want.shape
            # the first layer's presents are one rounding from the fed values: one code; the logits (and t5's
            # later presents, past its RMSNorm's roundings) sit past earlier layers' roundings, where a tie rounded
            # the other way upstream moves them by a few codes
            first = output.startswith("present") and (name.startswith(("gpt2", "llama")) or ".0." in output)
            bound = (1.0 if first else 8.0) * code[output] * (1 + 1e-5)
            assert float(np.abs(got - want).max()) <= bound, (output, float(np.abs(got - want).max()) / code[output])


def _float64_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """The quantized graph with every float32 value, constant and cast in float64 (the codes stay integers)."""
    wide = onnx.ModelProto()
    wide.CopyFrom(model)
    graph = wide.graph
    del graph.value_info[:]
    for index, init in enumerate(graph.initializer):
        if init.data_type == TensorProto.FLOAT:
            graph.initializer[index].CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float64), init.name))
    for info in list(graph.input) + list(graph.output):
        if info.type.tensor_type.elem_type == TensorProto.FLOAT:
            info.type.tensor_type.elem_type = TensorProto.DOUBLE
    for node in graph.node:
        for attr in node.attribute:
            if node.op_type == "Cast" and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.DOUBLE
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == TensorProto.FLOAT:
                attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float64), attr.t.name))
    return wide


def _reference_ops():
    from onnx.reference.op_run import OpRun

    class DequantizeLinear(OpRun):  # per tensor, in float64
        op_domain = ""

        def _run(self, x, scale, zero=None, **_):
            return ((x.astype(np.float64) - (0 if zero is None else zero.astype(np.float64))) * scale,)

    class QuantizeLinear(OpRun):  # rounding half to even, saturating
        op_domain = ""

        def _run(self, x, scale, zero=None, **_):
            dtype = np.dtype(np.uint8) if zero is None else zero.dtype
            shift = 0 if zero is None else zero.astype(np.float64)
            info = np.iinfo(dtype)
            return (np.clip(np.rint(x / scale) + shift, info.min, info.max).astype(dtype),)

    return [DequantizeLinear, QuantizeLinear]


@pytest.mark.parametrize("name", DECODERS)
def test_outputs_agree_with_a_float64_evaluation_of_the_quantized_graph(qdq_decoders, name):
    from onnx.reference import ReferenceEvaluator

    built, entries, zoo_feeds = qdq_decoders
    model = onnx.load(built[name])
    reference = ReferenceEvaluator(_float64_model(model), new_ops=_reference_ops())
    constants = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    producer = {out: node for node in model.graph.node for out in node.output}
    code = {o.name: float(constants[producer[o.name].input[1]]) for o in model.graph.output}
    ours = onnx_runtime.InferenceSession(str(built[name]), providers=["cpu"])
    calls = entries[name + ".fp32"]["calls"]
    feeds = [zoo_feeds.make_feeds(calls["prefill"])]
    feeds += [zoo_feeds.make_feeds(zoo_feeds.grown(calls["decode"], extra)) for extra in (0, 5)]
    for feed in feeds:
        want = reference.run(None, {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feed.items()})
        for output, got, exact in zip(code, ours.run(None, feed), want):
            # float32 arithmetic between roundings moves a tie by one code; a second layer's key can read one
            # such flip from the first layer, hence two codes
            error = float(np.abs(got - exact).max()) / code[output]
            assert error <= 2.0 + 1e-4, (output, error)
