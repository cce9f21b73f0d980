"""A QDQ decoder's present Concat in a symbolic decode plan (lengths new to the session): the rounded Concat folds
there too (its shape rule, shape_rules.CONCAT, lets a shape program pass it), and the past's rounding before it is
left to the Concat's (qdq_concat_inputs) with the plan's Shape of the past reading the past itself; a present's
rounding that a Shape reads folds too (the torchscript export's), being a graph output no specialization drops:
three steps per present become one, the values unchanged bit for bit."""
from __future__ import annotations

import numpy as np
import onnx_runtime
import pytest
from onnx_runtime.ir import Node
from onnx_runtime.session import shape_rules, shape_symbols
from onnx_runtime_ep_cpu import qdq_concat_inputs, qdq_epilogues
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN


def _forms(shape, symbols=1):
    out = []
    for d in shape:
        form = np.zeros(1 + symbols, np.int64)
        if isinstance(d, str):
            form[1] = 1
        else:
            form[0] = d
        out.append(form)
    return tuple(out)


def test_rounded_concat_shape_follows_concat():
    rule = shape_rules.rule_of(FUSED_DOMAIN, "ConcatRounded")
    assert rule == shape_rules.ShapeRule(shape_rules.CONCAT, (2,))
    node = Node("ConcatRounded", ["past", "new", "s", "z"], ["present"], domain=FUSED_DOMAIN, attrs={"axis": -2})
    declared = shape_symbols._declared_shape  # noqa: SLF001 (the rule's use in a shape program)
    got = declared(node, [_forms((1, 2, "L", 16)), _forms((1, 2, 1, 16)), (), ()], 1)
    assert [tuple(int(v) for v in f) for f in got] == [(1, 0), (2, 0), (1, 1), (16, 0)]  # (1, 2, L + 1, 16)
    unknown = declared(node, [_forms((1, 2, "L", 16)), None, (), ()], 1)
    assert unknown is None
    with pytest.raises(ValueError, match="operand"):
        shape_rules.declare("test.domain", "Joined", shape_rules.CONCAT, (1, 2))


@pytest.fixture()
def fold_off(monkeypatch):
    """Turns the fold off as before it: no rounded Concat of a symbolic shape, Shape readers keep the rounding."""
    fold, static = qdq_epilogues._foldable, qdq_epilogues._static  # noqa: SLF001 (patched)

    def static_only(graph, view, rounding):
        producer = fold(graph, view, rounding)
        if producer is not None and producer.op_type == "Concat" and not static(graph, producer.outputs[0]):
            return None
        return producer

    def off():
        monkeypatch.setattr(qdq_epilogues, "_foldable", static_only)
        monkeypatch.setattr(qdq_concat_inputs, "_sizes", lambda *args: False)

    return off


@pytest.mark.parametrize("name", ["llama.dynamo", "llama.torchscript", "gpt2.dynamo", "gpt2.torchscript"])
def test_symbolic_decode_plan_rounds_the_presents_in_their_concat(qdq_decoders, fold_off, name):
    built, entries, zoo_feeds = qdq_decoders
    calls = entries[name + ".fp32"]["calls"]
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    theirs = oracle.InferenceSession(str(built[name]), providers=["CPUExecutionProvider"])
    decode = [zoo_feeds.make_feeds(zoo_feeds.grown(calls["decode"], extra)) for extra in range(6)]
    ours = onnx_runtime.InferenceSession(str(built[name]), providers=["cpu"])
    got = [ours.run(None, feeds) for feeds in decode]
    graph = ours.graph_for(decode[-1])
    past = {i.name for i in graph.inputs if i.name.startswith("past")}
    assert any(not isinstance(d, int) for i in graph.inputs for d in (i.type.shape or ())), "not a symbolic plan"
    fold_off()
    plain = onnx_runtime.InferenceSession(str(built[name]), providers=["cpu"])
    want = [plain.run(None, feeds) for feeds in decode]
    plain_graph = plain.graph_for(decode[-1])

    def past_roundings(g):
        return [n for n in g.nodes if n.op_type == "QuantizeDequantize" and n.inputs[0] in past]

    # (GPT-2's value presents stay a Concat: its context product quantizes the unrounded Concat itself)
    assert len(past_roundings(graph)) < len(past_roundings(plain_graph)) and len(graph.nodes) < len(plain_graph.nodes)
    if name.startswith("llama"):
        ops = [n.op_type for n in graph.nodes]
        assert ops.count("ConcatRounded") >= 4 and not past_roundings(graph), ops
    for feeds, mine, plains in zip(decode, got, want):
        for a, b in zip(mine, plains):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(mine, theirs.run(None, feeds)):
            assert float(np.abs(a - b).max()) <= 0.08 * max(1.0, float(np.abs(b).max()))
