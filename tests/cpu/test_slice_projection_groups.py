"""Two more spellings of one input's projections as one ProjectionGroup, from the holdout decoders nobody tuned on.

Phi-3's exports write q/k/v (and gate/up) as one product cut by Slices of constant column ranges along its last
axis, not by a Split (projection_groups.split_projection_outputs takes both); Gemma's write the gate and up
products as siblings whose readers differ: Gelu on the gate, a Mul of the two (group_sibling_projections reads
those as column views). Small layers of each spelling at a prefill's rows (strided column views) and a decode
step's one row, against a float64 reference and the graph with the grouping passes off; Slices that do not cut the
product into adjacent parts covering it once, or a part read elsewhere, keep their nodes; the holdout's Phi-3 and
Gemma from both exporters against onnx's float64 evaluator."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import attention_heads, projection_groups, provider
from reference64 import assert_within, gamma, run_float64

HOLDOUT = Path(__file__).resolve().parents[2] / "benchmarks" / ".models" / "holdout"
_INT64_MAX = np.iinfo(np.int64).max


def _ungrouped(monkeypatch) -> None:
    """The provider's passes without the three groupings."""
    gone = (projection_groups.group_sibling_projections, projection_groups.group_attention_projections,
            projection_groups.split_projection_outputs)
    monkeypatch.setattr(provider, "HEADS_PASSES", [p for p in attention_heads.HEADS_PASSES if p not in gone],
                        raising=False)


def _session(model: onnx.ModelProto):
    return ort.InferenceSession(model.SerializeToString(), providers=["cpu"])


def _runs(session, feeds: dict) -> list:
    for _ in range(2):  # (the specialized plan, where the groupings fire, is made at a first run)
        got = session.run(None, feeds)
    return got


# -- Phi-3: one product, Slices of its last axis ------------------------------------------------------------------

def _phi3_layer(batch, length, embed, q_heads, kv_heads, size, hidden, axis: int, steps: bool):
    """x -> x @ [Wq | Wk | Wv] -> three Slices of the last axis (written k, v, q; the last one's end INT64_MAX, its
    start negative) -> head splits -> causal Attention -> head merge -> y; x -> x @ [Wg | Wu] -> two Slices ->
    Swish(gate) * up -> down product -> z. ``axis``: the Slices' axes value; ``steps``: a steps input of ones."""
    rng = np.random.default_rng(embed * 3 + hidden)
    q_width, kv_width = q_heads * size, kv_heads * size
    total = q_width + 2 * kv_width
    values = {"wqkv": (rng.standard_normal((embed, total)) / 3).astype(np.float32),
              "wgu": (rng.standard_normal((embed, 2 * hidden)) / 3).astype(np.float32),
              "wd": (rng.standard_normal((hidden, embed)) / 3).astype(np.float32),
              "axes": np.array([axis], np.int64), "one": np.array([1], np.int64),
              "heads_shape": np.array([batch, length, -1, size], np.int64),
              "merged_shape": np.array([batch, length, -1], np.int64)}
    bounds = {"q": (0, q_width), "k": (q_width, q_width + kv_width), "v": (-kv_width, _INT64_MAX),
              "gate": (0, hidden), "up": (hidden, 2 * hidden)}
    nodes = [helper.make_node("MatMul", ["x", "wqkv"], ["qkv"]), helper.make_node("MatMul", ["x", "wgu"], ["gu"])]
    for name, (start, end) in bounds.items():
        values[f"{name}_start"], values[f"{name}_end"] = np.array([start], np.int64), np.array([end], np.int64)
        source = "gu" if name in ("gate", "up") else "qkv"
        inputs = [source, f"{name}_start", f"{name}_end", "axes"] + (["one"] if steps else [])
        nodes.append(helper.make_node("Slice", inputs, [name]))
    nodes = nodes[:2] + [nodes[3], nodes[4], nodes[2]] + nodes[5:]  # (the Slices out of column order)
    for name in "qkv":
        nodes += [helper.make_node("Reshape", [name, "heads_shape"], [f"{name}_split"]),
                  helper.make_node("Transpose", [f"{name}_split"], [f"{name}_heads"], perm=[0, 2, 1, 3])]
    nodes += [helper.make_node("Attention", ["q_heads", "k_heads", "v_heads"], ["y_heads"], is_causal=1),
              helper.make_node("Transpose", ["y_heads"], ["y_split"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["y_split", "merged_shape"], ["y"]),
              helper.make_node("Sigmoid", ["gate"], ["gate_sigmoid"]),
              helper.make_node("Mul", ["gate", "gate_sigmoid"], ["swish"]),
              helper.make_node("Mul", ["swish", "up"], ["gated"]),
              helper.make_node("MatMul", ["gated", "wd"], ["z"])]
    initializers = [numpy_helper.from_array(value, name) for name, value in values.items()]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [batch, length, embed])],
                       [tensor_info("y", TensorProto.FLOAT, None), tensor_info("z", TensorProto.FLOAT, None)],
                       initializers, opset=23)
    return model, values


def _phi3_reference(x, values, q_heads, kv_heads, size, hidden):
    """(y, z) in float64 and bounds on a float32 computation's error."""
    x = x.astype(np.float64)
    batch, length, embed = x.shape
    qkv, gu = x @ values["wqkv"].astype(np.float64), x @ values["wgu"].astype(np.float64)
    q_width = q_heads * size

    def heads(t):
        return t.reshape(batch, length, -1, size).transpose(0, 2, 1, 3)

    q, k, v = heads(qkv[..., :q_width]), heads(qkv[..., q_width:-kv_heads * size]), heads(qkv[..., -kv_heads * size:])
    k, v = np.repeat(k, q_heads // kv_heads, axis=1), np.repeat(v, q_heads // kv_heads, axis=1)
    scores = q @ k.swapaxes(-1, -2) / np.sqrt(size)
    scores = np.where(np.tril(np.ones((length, length), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    y = (probs @ v).transpose(0, 2, 1, 3).reshape(batch, length, -1)
    scale = max(float(np.abs(qkv).max()), 1.0)
    y_bound = (gamma(embed + 1) * 40 + gamma(size + length + 8) * 40) * scale * (1 + scale * np.sqrt(size))
    gate, up = gu[..., :hidden], gu[..., hidden:]
    gated = gate / (1 + np.exp(-gate)) * up
    wd = values["wd"].astype(np.float64)
    z = gated @ wd
    magnitude = np.abs(x) @ np.abs(values["wgu"].astype(np.float64))
    magnitude = np.maximum(magnitude[..., :hidden], magnitude[..., hidden:])
    gated_bound = gamma(embed + 8) * 4 * magnitude * (np.abs(gate) + np.abs(up) + magnitude)
    z_bound = gated_bound @ np.abs(wd) + gamma(embed + hidden) * (np.abs(gated) @ np.abs(wd))
    return [y, z], [np.full(y.shape, y_bound), z_bound]


PHI3_LAYERS = [
    # batch, length, embed, query heads, KV heads, head size, feed-forward width, Slice axes value, steps input
    (1, 16, 64, 4, 2, 16, 128, -1, True),  # the holdout Phi-3's layer at a prefill (dynamo's spelling)
    (2, 7, 13, 3, 1, 5, 11, 2, False),  # odd sizes, a batch of two, axis 2 (TorchScript's), no steps
    (1, 1, 24, 4, 2, 6, 40, -1, True),  # a decode step's one row
]


@pytest.mark.parametrize("case", PHI3_LAYERS, ids=[f"b{c[0]}s{c[1]}e{c[2]}h{c[3]}-{c[4]}d{c[5]}f{c[6]}a{c[7]}"
                                                   for c in PHI3_LAYERS])
def test_a_product_cut_by_slices_is_one_group(case, made, monkeypatch):
    batch, length, embed, q_heads, kv_heads, size, hidden, axis, steps = case
    model, values = _phi3_layer(*case)
    session = _session(model)
    for seed in (0, 1):  # the planned kernels on new values
        x = np.random.default_rng(seed).standard_normal((batch, length, embed)).astype(np.float32)
        got = _runs(session, {"x": x})
        exact, bounds = _phi3_reference(x, values, q_heads, kv_heads, size, hidden)
        for name, value, reference, bound in zip("yz", got, exact, bounds):
            assert_within(value, reference, bound, f"{name}, seed {seed}")
    ops = [op for op, _ in made]
    groups = sorted(shapes[1] for op, shapes in made if op == "ProjectionGroup")
    assert groups == sorted([(embed, (q_heads + 2 * kv_heads) * size), (embed, 2 * hidden)]), made
    assert "Slice" not in ops and ops.count("MatMul") == 1, ops  # only the down product is left
    _ungrouped(monkeypatch)
    made.clear()
    plain = _runs(_session(model), {"x": x})
    assert "Slice" in [op for op, _ in made]
    for name, value, unfused, bound in zip("yz", got, plain, bounds):
        assert_within(value, unfused.astype(np.float64), 2 * bound, f"{name} against the ungrouped graph")


def _cut_product(spans, axis=-1, step=1, extra_output: bool = False, opset: int = 23):
    """x (2, 5, 12) -> x @ W (12, 16) -> a Slice per (start, end) of ``spans`` on ``axis`` with ``step`` -> each
    part times itself (Mul: a view reader) -> outputs; ``extra_output``: the first part is an output too. Opset 9
    writes the Slices' bounds as attributes."""
    w = (np.random.default_rng(7).standard_normal((12, 16)) / 3).astype(np.float32)
    values = {"w": w}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["product"])]
    outputs = []
    for index, (start, end) in enumerate(spans):
        if opset < 10:
            nodes.append(helper.make_node("Slice", ["product"], [f"part{index}"], starts=[start], ends=[end],
                                          axes=[axis]))
        else:
            for key, value in (("start", start), ("end", end), ("axis", axis), ("step", step)):
                values[f"{key}{index}"] = np.array([value], np.int64)
            nodes.append(helper.make_node("Slice", ["product", *(f"{key}{index}" for key in
                                                                 ("start", "end", "axis", "step"))],
                                          [f"part{index}"]))
        nodes.append(helper.make_node("Mul", [f"part{index}", f"part{index}"], [f"square{index}"]))
        outputs.append(tensor_info(f"square{index}", TensorProto.FLOAT, None))
    if extra_output:
        outputs.append(tensor_info("part0", TensorProto.FLOAT, None))
    initializers = [numpy_helper.from_array(value, name) for name, value in values.items()]
    return make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [2, 5, 12])], outputs, initializers,
                      opset=opset), w


CUTS = {
    "adjacent parts, opset 9 attributes": ([(10, 16), (0, 4), (4, 10)], -1, 1, False, 9, True),
    "negative bounds past the ends": ([(-100, 5), (5, -6), (-6, 99)], 2, 1, False, 23, True),
    "overlapping parts": ([(0, 8), (6, 16)], -1, 1, False, 23, False),
    "a gap": ([(0, 8), (9, 16)], -1, 1, False, 23, False),
    "a step of two": ([(0, 8), (8, 16)], -1, 2, False, 23, False),
    "another axis": ([(0, 1), (1, 5)], 1, 1, False, 23, False),
    "one part": ([(0, 16)], -1, 1, False, 23, False),
    "a part read elsewhere": ([(0, 8), (8, 16)], -1, 1, True, 23, False),
}


@pytest.mark.parametrize("case", list(CUTS), ids=list(CUTS))
def test_only_slices_covering_the_last_axis_once_group(case, made):
    spans, axis, step, extra, opset, grouped = CUTS[case]
    model, w = _cut_product(spans, axis, step, extra, opset)
    x = np.random.default_rng(8).standard_normal((2, 5, 12)).astype(np.float32)
    got = _runs(_session(model), {"x": x})
    product = x.astype(np.float64) @ w.astype(np.float64)
    product_bound = gamma(12) * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)))
    parts = [product[(slice(None),) * (axis % 3) + (slice(start, end, step),)] for start, end in spans]
    bounds = [product_bound[(slice(None),) * (axis % 3) + (slice(start, end, step),)] for start, end in spans]
    for index, (part, bound) in enumerate(zip(parts, bounds)):
        assert_within(got[index], part * part, 2 * bound * np.abs(part) + gamma(1) * part * part, f"part {index}")
    if extra:
        assert_within(got[-1], parts[0], bounds[0], "the part read elsewhere")
    ops = [op for op, _ in made]
    if grouped:
        assert ops.count("ProjectionGroup") == 1 and "Slice" not in ops and "MatMul" not in ops, ops
    else:
        assert "ProjectionGroup" not in ops and "Slice" in ops, ops


# -- Gemma: sibling products, Gelu on the gate -------------------------------------------------------------------

def _gemma_block(batch, length, embed, hidden, approximate: str):
    """x -> Gelu(x @ Wg) * (x @ Wu) -> down product -> z, the gate's product written first."""
    rng = np.random.default_rng(embed * 5 + hidden)
    values = {"wg": (rng.standard_normal((embed, hidden)) / 3).astype(np.float32),
              "wu": (rng.standard_normal((embed, hidden)) / 3).astype(np.float32),
              "wd": (rng.standard_normal((hidden, embed)) / 3).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["gate"]),
             helper.make_node("Gelu", ["gate"], ["gate_gelu"], approximate=approximate),
             helper.make_node("MatMul", ["x", "wu"], ["up"]),
             helper.make_node("Mul", ["gate_gelu", "up"], ["gated"]),
             helper.make_node("MatMul", ["gated", "wd"], ["z"])]
    initializers = [numpy_helper.from_array(value, name) for name, value in values.items()]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [batch, length, embed])],
                       [tensor_info("z", TensorProto.FLOAT, None)], initializers, opset=23)
    return model, values


def _gemma_reference(x, values, approximate: str):
    """z in float64, and a bound on a float32 computation's error: each product's, carried through Gelu (slope at
    most 1.2) plus Gelu's own rounding (8 units of |gate|), the Mul and the down product."""
    x, wg, wu, wd = (a.astype(np.float64) for a in (x, values["wg"], values["wu"], values["wd"]))
    gate, up = x @ wg, x @ wu
    if approximate == "tanh":
        gelu = 0.5 * gate * (1 + np.tanh(math.sqrt(2 / math.pi) * (gate + 0.044715 * gate ** 3)))
    else:
        gelu = 0.5 * gate * (1 + np.vectorize(math.erf)(gate / math.sqrt(2)))
    gated = gelu * up
    embed = x.shape[-1]
    gate_bound, up_bound = gamma(embed) * (np.abs(x) @ np.abs(wg)), gamma(embed) * (np.abs(x) @ np.abs(wu))
    gelu_bound = 1.2 * gate_bound + gamma(8) * np.abs(gate)
    gated_bound = gelu_bound * (np.abs(up) + up_bound) + np.abs(gelu) * up_bound + gamma(1) * np.abs(gated)
    z_bound = gated_bound @ np.abs(wd) + gamma(wd.shape[0]) * ((np.abs(gated) + gated_bound) @ np.abs(wd))
    return gated @ wd, z_bound


GEMMA_BLOCKS = [
    # batch, length, embed, feed-forward width, Gelu's approximation
    (1, 16, 64, 128, "tanh"),  # the holdout Gemma's block at a prefill (strided column views)
    (1, 1, 64, 128, "tanh"),  # a decode step's one row
    (2, 7, 13, 11, "none"),  # odd sizes, a batch of two, exact Gelu
]


@pytest.mark.parametrize("case", GEMMA_BLOCKS, ids=[f"b{c[0]}s{c[1]}e{c[2]}f{c[3]}{c[4]}" for c in GEMMA_BLOCKS])
def test_gate_and_up_products_read_by_gelu_and_mul_are_one_group(case, made, monkeypatch):
    batch, length, embed, hidden, approximate = case
    model, values = _gemma_block(*case)
    session = _session(model)
    for seed in (0, 1):  # the planned kernels on new values
        x = np.random.default_rng(seed).standard_normal((batch, length, embed)).astype(np.float32)
        (z,) = _runs(session, {"x": x})
        exact, bound = _gemma_reference(x, values, approximate)
        assert_within(z, exact, bound, f"z, seed {seed}")
    ops = [op for op, _ in made]
    groups = [shapes[1] for op, shapes in made if op == "ProjectionGroup"]
    assert groups == [(embed, 2 * hidden)] and ops.count("MatMul") == 1, made  # only the down product is left
    _ungrouped(monkeypatch)
    made.clear()
    (plain,) = _runs(_session(model), {"x": x})
    assert "ProjectionGroup" not in [op for op, _ in made]
    assert_within(z, plain.astype(np.float64), 2 * bound, "z against the ungrouped graph")


# -- the holdout's decoders ----------------------------------------------------------------------------------------

HOLDOUT_DECODERS = ["phi3.torchscript.fp32", "phi3.dynamo.fp32", "gemma.torchscript.fp32", "gemma.dynamo.fp32"]


@pytest.mark.parametrize("name", HOLDOUT_DECODERS)
def test_holdout_decoders_group_every_layers_projections_and_match(name, made, monkeypatch):
    """Per layer (two) and call (prefill, decode): q/k/v and gate/up are one ProjectionGroup each; outputs within
    the float32 bound the zoo's decoders meet against onnx's float64 evaluator, and the ungrouped graph's."""
    path = HOLDOUT / f"{name}.onnx"
    if not path.is_file():
        pytest.skip("the holdout set is not built: run benchmarks/zoo.py --holdout")
    monkeypatch.syspath_prepend(str(HOLDOUT.parents[1]))  # (benchmarks/: zoo_feeds)
    from zoo_feeds import make_feeds

    entry = next(m for m in json.loads((HOLDOUT / "manifest.json").read_text())["models"] if m["name"] == name)
    calls = {call: make_feeds(spec) for call, spec in entry["calls"].items()}
    session = ort.InferenceSession(str(path), providers=["cpu"])
    ours = {}
    for call, feeds in calls.items():
        for _ in range(2):  # (the specialized plan, where the passes fire, is made at a first run)
            ours[call] = session.run(None, feeds)
    groups = [op for op, _ in made if op == "ProjectionGroup"]
    assert len(groups) == 4 * len(calls), made
    # the products left alone: each layer's output and down projections, and the head
    assert [op for op, _ in made].count("MatMul") == 5 * len(calls), made
    _ungrouped(monkeypatch)
    made.clear()
    plain_session = ort.InferenceSession(str(path), providers=["cpu"])
    assert "ProjectionGroup" not in [op for op, _ in made]
    model = onnx.load(str(path))
    for call, feeds in calls.items():
        unfused, exact = plain_session.run(None, feeds), run_float64(model, feeds)
        for got, plain, wide in zip(ours[call], unfused, exact):
            scale = float(np.abs(wide).max()) + 1e-6
            np.testing.assert_allclose(got, plain, rtol=0, atol=2e-5 * scale, err_msg=f"{call}: the ungrouped graph")
            np.testing.assert_allclose(got, wide, rtol=0, atol=1e-4 * scale, err_msg=f"{call}: the reference")
