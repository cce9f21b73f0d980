"""A decoder layer's cache Concats and head merge folded into its attention (past_attention.fuse_past_attention):
PastAttention against a float64 reference on a cached layer (grouped-query heads, a float mask, decode rows and a
prefill's, one and two sequences), the zoo's decoders from both torch exporters (no Concat or head merge left
around attention, decode outputs within the float64 bound, greedy tokens as onnxruntime's), the fold off keeps the
four steps, and inputs the kernel cannot take are a typed error naming the node."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info, zoo_model
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import attention_heads, past_attention, provider
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.fused_domain import FUSED_DOMAIN
from onnx_runtime_ep_cpu.registry import lookup
from reference64 import assert_within, gamma, run_float64


def _layer(batch, length, past, embed, heads, kv_heads, size, mask=True):
    """x -> q, k, v products -> head splits -> k, v after the past (Concat on axis 2) -> Attention (a float mask
    over every key) -> head merge -> y; the presents are graph outputs (a decoder's layer with past)."""
    rng = np.random.default_rng(embed + length + past)
    weights, nodes = {}, []
    for name, count in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
        weights[f"w{name}"] = (rng.standard_normal((embed, count * size)) / 3).astype(np.float32)
        weights[f"{name}_shape"] = np.array([batch, length, count, size], np.int64)
        nodes += [helper.make_node("MatMul", ["x", f"w{name}"], [f"{name}_flat"]),
                  helper.make_node("Reshape", [f"{name}_flat", f"{name}_shape"], [f"{name}_split"]),
                  helper.make_node("Transpose", [f"{name}_split"], [f"{name}_heads"], perm=[0, 2, 1, 3])]
    weights["merged_shape"] = np.array([batch, length, heads * size], np.int64)
    nodes += [helper.make_node("Concat", ["past_k", "k_heads"], ["present_k"], axis=2),
              helper.make_node("Concat", ["past_v", "v_heads"], ["present_v"], axis=-2),
              helper.make_node("Attention", ["q_heads", "present_k", "present_v"] + (["mask"] if mask else []),
                               ["y_heads"]),
              helper.make_node("Transpose", ["y_heads"], ["y_split"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["y_split", "merged_shape"], ["y"])]
    cache = [batch, kv_heads, past, size]
    inputs = [tensor_info("x", TensorProto.FLOAT, [batch, length, embed]),
              tensor_info("past_k", TensorProto.FLOAT, cache), tensor_info("past_v", TensorProto.FLOAT, cache)]
    if mask:
        inputs.append(tensor_info("mask", TensorProto.FLOAT, [batch, 1, length, past + length]))
    outputs = [tensor_info(n, TensorProto.FLOAT, None) for n in ("y", "present_k", "present_v")]
    model = make_model(nodes, inputs, outputs, [numpy_helper.from_array(v, n) for n, v in weights.items()], opset=23)
    return model, weights


LAYERS = [  # batch, length, past, embed, heads, kv heads, head size, mask
    (1, 1, 7, 16, 4, 4, 4, True),  # a decode step
    (1, 1, 9, 16, 4, 2, 4, True),  # grouped-query heads (qwen2/llama style)
    (2, 1, 5, 12, 2, 1, 6, True),  # two sequences
    (1, 4, 6, 16, 4, 2, 4, True),  # a prefill's rows after a past (the merge a real transpose)
    (1, 1, 0, 16, 4, 4, 4, False),  # an empty past, no mask
]


def _feeds(case, rng):
    batch, length, past, embed, heads, kv_heads, size, mask = case
    feeds = {"x": rng.standard_normal((batch, length, embed)).astype(np.float32),
             "past_k": rng.standard_normal((batch, kv_heads, past, size)).astype(np.float32),
             "past_v": rng.standard_normal((batch, kv_heads, past, size)).astype(np.float32)}
    if mask:  # the first key hidden from every query, the others visible
        bias = np.zeros((batch, 1, length, past + length), np.float32)
        bias[..., 0] = -1e9 if past + length > 1 else 0
        feeds["mask"] = bias
    return feeds


@pytest.mark.parametrize("case", LAYERS, ids=[f"b{c[0]}-s{c[1]}-p{c[2]}-h{c[4]}/{c[5]}" for c in LAYERS])
def test_a_layer_with_past_is_one_step_within_the_float64_bound(case, made):
    batch, length, past, embed, heads, kv_heads, size, _ = case
    model, weights = _layer(*case)
    session = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    rng = np.random.default_rng(5)
    for _ in range(3):  # (the specialized plan, where the passes fire, is made at a first run)
        feeds = _feeds(case, rng)
        got = session.run(None, feeds)
        exact = run_float64(model, feeds)
        x64 = np.abs(feeds["x"].astype(np.float64))
        product = max(float((x64 @ np.abs(weights[f"w{n}"])).max()) for n in "qkv")
        reach = max(product, float(np.abs(feeds["past_v"]).max(initial=0.0)))
        bound = gamma(embed + 1) * product * 8 * (1 + reach * np.sqrt(size)) + \
            gamma(size + past + length + 8) * 40 * reach
        for name, value, reference in zip(("y", "present_k", "present_v"), got, exact):
            assert value.shape == reference.shape, name
            assert_within(value, reference, bound, name)
    ops = [op for op, _ in made]
    assert "PastAttention" in ops, ops
    assert not {"Concat", "Attention", "TransposeReshape"} & set(ops), ops


def test_without_the_fold_the_appends_and_merge_stay(made, monkeypatch):
    monkeypatch.setattr(provider, "HEADS_PASSES",
                        [p for p in attention_heads.HEADS_PASSES if p is not past_attention.fuse_past_attention],
                        raising=False)
    model, _ = _layer(*LAYERS[1])
    session = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    feeds = _feeds(LAYERS[1], np.random.default_rng(1))
    for _ in range(2):
        session.run(None, feeds)
    ops = [op for op, _ in made]
    assert "PastAttention" not in ops and ops.count("Concat") >= 2 and "TransposeReshape" in ops, ops


def test_a_present_read_elsewhere_keeps_its_concat(made):
    """The fold takes a Concat only its Attention reads (besides the graph's outputs)."""
    model, _ = _layer(*LAYERS[0])
    model.graph.node.append(helper.make_node("Neg", ["present_k"], ["k_negated"]))
    model.graph.output.append(tensor_info("k_negated", TensorProto.FLOAT, None))
    session = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    feeds = _feeds(LAYERS[0], np.random.default_rng(2))
    for _ in range(2):
        got = session.run(None, feeds)
    np.testing.assert_array_equal(got[3], -got[1])
    assert "PastAttention" not in [op for op, _ in made]


ZOO_DECODERS = ["gpt2.torchscript.fp32", "gpt2.dynamo.fp32", "llama.torchscript.fp32", "llama.dynamo.fp32"]


@pytest.mark.parametrize("name", ZOO_DECODERS)
def test_zoo_decoders_attend_with_past_in_one_step(name, made):
    entry, path = zoo_model(name)
    from zoo_feeds import make_feeds

    session = ort.InferenceSession(path, providers=["cpu"])
    for call in ("prefill", "decode"):
        made.clear()
        feeds = make_feeds(entry["calls"][call])
        for _ in range(2):
            got = session.run(None, feeds)
        for value, exact in zip(got, run_float64(onnx.load(path), feeds)):
            scale = float(np.abs(exact).max()) + 1e-6
            np.testing.assert_allclose(value, exact, rtol=0, atol=1e-4 * scale)
        ops = [op for op, _ in made]
        assert ops.count("PastAttention") == 2 and "Attention" not in ops, ops
        if call == "decode":  # (a prefill's flattened merge before dynamo's addmm stays for the Gemm's fusion)
            assert "TransposeReshape" not in ops, ops


@pytest.mark.parametrize("name", ["gpt2.dynamo.fp32", "llama.torchscript.fp32"])
def test_zoo_greedy_tokens_match_onnxruntime(name):
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    _, path = zoo_model(name)
    from onnx_runtime.generate import Generator

    prompt = [5, 17, 42, 99, 3, 250, 7, 11]
    with Generator(path, providers=["cpu"]) as generator:
        ours = generator.generate(prompt, 24).tokens
    theirs_session = oracle.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in theirs_session.get_inputs()]
    caches = [i for i in theirs_session.get_inputs() if i.name.startswith("past")]
    state = {i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in caches}
    tokens, ids = [], list(prompt)
    for _ in range(24):
        length = sum(v.shape[2] for v in list(state.values())[:1]) + len(ids)
        feeds = {"input_ids": np.array([ids], np.int64), "attention_mask": np.ones((1, length), np.int64), **state}
        if "position_ids" in names:
            feeds["position_ids"] = np.arange(length - len(ids), length, dtype=np.int64)[None]
        outputs = theirs_session.run(None, feeds)
        token = int(np.argmax(outputs[0][0, -1]))
        tokens.append(token)
        ids = [token]
        presents = dict(zip([o.name for o in theirs_session.get_outputs()], outputs))
        state = {c.name: presents[c.name.replace("past_key_values", "present")] for c in caches}
    assert ours == tokens


def _node(inputs=("q", "k", "v", "mask", "pk", "pv")) -> Node:
    return Node("PastAttention", list(inputs), ["y", "present_k", "present_v"], name="layer0/past",
                domain=FUSED_DOMAIN, attrs={}, opset=23)


def test_inputs_it_cannot_take_are_a_typed_error():
    factory = lookup("PastAttention", FUSED_DOMAIN, 23)
    with pytest.raises(InvalidArgumentError, match="layer0/past"):  # 3-D q: no head axis to attend per head
        factory(_node(), [(1, 1, 16), (1, 4, 1, 4), (1, 4, 1, 4), None, (1, 4, 3, 4), (1, 4, 3, 4)], 23)
    with pytest.raises(InvalidArgumentError, match="layer0/past"):  # no past_value
        factory(_node(("q", "k", "v", "", "pk", "")), [(1, 4, 1, 4)] * 3 + [None, (1, 4, 3, 4), None], 23)


def test_one_row_appends_reuse_their_views_and_write_each_row():
    """kv_append makes a one-row append's two views once per length: a second generation over the same buffer gets
    the same window objects back, with the new rows where a concatenation puts them."""
    from onnx_runtime import kv_append

    physical = np.zeros((1, 2, 6, 3), np.float32)
    window = kv_append.Window(physical[:, :, :0], physical, 2, "present")
    rng = np.random.default_rng(4)
    seen = []
    for _generation in range(2):
        fed, expected, results = physical[:, :, :0], np.zeros((1, 2, 0, 3), np.float32), []
        for _ in range(5):
            row = rng.standard_normal((1, 2, 1, 3)).astype(np.float32)
            window.fed, window.result = fed, None
            saved = kv_append.enter([window])
            try:
                grown = kv_append.append("present", (fed, row), 2)
            finally:
                kv_append.leave(saved)
            expected = np.concatenate((expected, row), axis=2)
            np.testing.assert_array_equal(grown, expected)
            results.append(grown)
            fed = grown
        seen.append(results)
    assert all(first is again for first, again in zip(*seen))


@pytest.mark.parametrize("name", ["gpt2.dynamo.fp32", "llama.dynamo.fp32"])
def test_decode_attention_reads_the_appended_buffers_without_looking_them_up(name, monkeypatch):
    """PastAttention hands the buffers its appends wrote to the attention (few_over_rows): the decode steps never ask
    kv_append.contiguous_rows, and the tokens are those of a run that does."""
    _, path = zoo_model(name)
    from onnx_runtime import kv_append
    from onnx_runtime.generate import Generator

    monkeypatch.setenv("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")  # (the compiled loops from the first step)
    prompt = [3, 14, 15, 92, 65, 35]
    with Generator(path, providers=["cpu"]) as generator:
        expected = generator.generate(prompt, 12).tokens
    asked = []
    looked_up = kv_append.contiguous_rows

    def counting(keys, values):
        if keys.shape[2] > len(prompt):  # a decode step's (the prefill's attention takes the lanes path)
            asked.append(keys.shape)
        return looked_up(keys, values)

    monkeypatch.setattr(kv_append, "contiguous_rows", counting)
    with Generator(path, providers=["cpu"]) as generator:
        assert generator.generate(prompt, 12).tokens == expected
    assert asked == []


@pytest.mark.parametrize("heads,kv_heads,masked", [(4, 4, False), (4, 2, False), (4, 4, True)],
                         ids=["heads", "grouped", "a row fully masked"])
def test_a_bound_decode_step_appends_and_attends_in_one_compiled_call(heads, kv_heads, masked, monkeypatch):
    """In a bound run whose caches kv_append grows (a generation's decode step), PastAttention writes the step's rows
    and attends over the grown cache in one compiled call (append_attention_float32): Y within the float64 bound,
    the rows in the buffers, the presents the windows' results. A row with no finite score (every key masked) still
    gets its rows written and takes the attention's general path, which gives such a row zeros."""
    monkeypatch.setenv("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")  # (the compiled loops from the first call)
    from onnx_runtime import kv_append
    from onnx_runtime_ep_cpu.algorithms.bound_loop import EntryOnce
    from onnx_runtime_ep_cpu.compiled import decoder

    size, capacity, past = 8, 12, 7
    node = Node("PastAttention", ["q", "k", "v", "mask", "pk", "pv"], ["y", "present_k", "present_v"], name="layer0",
                domain=FUSED_DOMAIN, attrs={"scale": 0.5, "merge_shape": [1, 1, heads * size]}, opset=23)
    rng = np.random.default_rng(heads + kv_heads)
    q = rng.standard_normal((1, heads, 1, size)).astype(np.float32)
    k, v = (rng.standard_normal((1, kv_heads, 1, size)).astype(np.float32) for _ in range(2))
    mask = np.zeros((1, 1, 1, past + 1), np.float32)
    mask[..., 0] = -np.inf if not masked else 0
    if masked:
        mask[...] = -np.inf
    keys, values = (rng.standard_normal((1, kv_heads, capacity, size)).astype(np.float32) for _ in range(2))
    before_keys, before_values = keys.copy(), values.copy()
    shapes = [q.shape, k.shape, v.shape, mask.shape, (1, kv_heads, past, size), (1, kv_heads, past, size)]
    kernel = lookup("PastAttention", FUSED_DOMAIN, 1)(node, shapes, 23)
    calls = []
    compiled = decoder.append_attention_float32
    # (the attention's loop, counted: a plain function, so its EntryOnce calls it rather than an entry point)
    monkeypatch.setattr(kernel.attention, "_append", EntryOnce(lambda *a: calls.append(a[5]) or compiled(*a)))
    fed_keys, fed_values = keys[:, :, :past], values[:, :, :past]
    windows = [kv_append.Window(fed_keys, keys, 2, "present_k"), kv_append.Window(fed_values, values, 2, "present_v")]
    with kv_append.appending(windows):
        y, present_k, present_v = kernel(q, k, v, mask, fed_keys, fed_values)
    assert calls == [past]
    assert present_k is windows[0].result and present_v is windows[1].result
    assert np.shares_memory(present_k, keys) and np.shares_memory(present_v, values)
    grown_k = np.concatenate((before_keys[:, :, :past], k), axis=2)
    grown_v = np.concatenate((before_values[:, :, :past], v), axis=2)
    np.testing.assert_array_equal(present_k, grown_k)
    np.testing.assert_array_equal(present_v, grown_v)
    np.testing.assert_array_equal(keys[:, :, past + 1:], before_keys[:, :, past + 1:])  # nothing past the new row
    group = heads // kv_heads
    k64, v64 = (np.repeat(x.astype(np.float64), group, axis=1) for x in (grown_k, grown_v))
    scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k64) * 0.5 + mask
    if masked:
        exact = np.zeros((1, heads, 1, size))
    else:
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        exact = np.einsum("bhqk,bhkd->bhqd", weights / weights.sum(-1, keepdims=True), v64)
    exact = exact.transpose(0, 2, 1, 3).reshape(1, 1, heads * size)
    reach = float(np.abs(v64).max())
    assert_within(y, exact, gamma(size + past + 8) * 40 * reach * (1 + float(np.abs(scores[np.isfinite(scores)])
                                                                                .max(initial=0.0))), "y")


def test_decode_steps_keep_one_bound_entry_point_for_strided_and_contiguous_keys(monkeypatch):
    """The decode step's compiled call is bound to its entry point at the first step and every later step passes
    the types it was bound for: K and V that arrive as strided views of one projection (a ProjectionGroup's columns)
    or as contiguous arrays, step after step over the growing cache, give the float64 reference's Y and rows."""
    monkeypatch.setenv("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")
    from onnx_runtime import kv_append
    from onnx_runtime_ep_cpu.compiled import decoder

    heads, size, capacity, past = 4, 8, 12, 5
    node = Node("PastAttention", ["q", "k", "v", "mask", "pk", "pv"], ["y", "present_k", "present_v"], name="layer0",
                domain=FUSED_DOMAIN, attrs={"scale": 0.5, "merge_shape": [1, 1, heads * size]}, opset=23)
    shapes = [(1, heads, 1, size)] * 3 + [(1, 1, 1, past + 1), (1, heads, past, size), (1, heads, past, size)]
    kernel = lookup("PastAttention", FUSED_DOMAIN, 1)(node, shapes, 23)
    rng = np.random.default_rng(5)
    keys, values = (np.zeros((1, heads, capacity, size), np.float32) for _ in range(2))
    keys[:, :, :past], values[:, :, :past] = (rng.standard_normal((1, heads, past, size)) for _ in range(2))
    for step in range(4):
        length = past + step
        q = rng.standard_normal((1, heads, 1, size)).astype(np.float32)
        packed = rng.standard_normal((1, 1, 3 * heads * size)).astype(np.float32)  # (q | k | v) of one product
        k, v = (packed[..., i * heads * size:(i + 1) * heads * size].reshape(1, 1, heads, size).transpose(0, 2, 1, 3)
                for i in (1, 2))
        if step % 2:
            k, v = np.ascontiguousarray(k), np.ascontiguousarray(v)
        mask = np.zeros((1, 1, 1, length + 1), np.float32)
        fed_keys, fed_values = keys[:, :, :length], values[:, :, :length]
        windows = [kv_append.Window(fed_keys, keys, 2, "present_k"),
                   kv_append.Window(fed_values, values, 2, "present_v")]
        with kv_append.appending(windows):
            y, present_k, present_v = kernel(q, k, v, mask, fed_keys, fed_values)
        assert present_k is windows[0].result and np.shares_memory(present_v, values)
        np.testing.assert_array_equal(keys[:, :, length], k[:, :, 0])
        np.testing.assert_array_equal(values[:, :, length], v[:, :, 0])
        k64, v64 = keys[:, :, :length + 1].astype(np.float64), values[:, :, :length + 1].astype(np.float64)
        scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k64) * 0.5
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        exact = np.einsum("bhqk,bhkd->bhqd", weights / weights.sum(-1, keepdims=True), v64)
        exact = exact.transpose(0, 2, 1, 3).reshape(1, 1, heads * size)
        reach = float(np.abs(v64).max()) * (1 + float(np.abs(scores).max()))
        assert_within(y, exact, gamma(size + length + 8) * 40 * reach, f"y at step {step}")
    if isinstance(decoder.append_attention_float32, deferred.Loop) and decoder.append_attention_float32.switched:
        assert kernel.attention._append.entry is not None  # noqa: SLF001 (bound once, at the first step)


def _variants(heads, size, past):
    """Input shapes beside a decode step's (q, k, v, mask, past k, past v): each changes what the length-free
    key holds (a head count, the head size, the batch, the query rows, the mask's lead) or only the lengths."""
    q, kv, mask, cache = (1, heads, 1, size), (1, heads, 1, size), (1, 1, 1, past + 1), (1, heads, past, size)
    step = [q, kv, kv, mask, cache, cache]
    wider = (1, heads, 1, size * 2)
    return {
        "the same": (step, True),
        "a longer past": ([q, kv, kv, (1, 1, 1, past + 4), (1, heads, past + 3, size), (1, heads, past + 3, size)],
                          True),
        "two new rows": ([q, (1, heads, 2, size), (1, heads, 2, size), (1, 1, 1, past + 2), cache, cache], True),
        "another q": ([(1, heads, 2, size), kv, kv, (1, 1, 2, past + 1), cache, cache], False),
        "another batch": ([(2, heads, 1, size), (2, heads, 1, size), (2, heads, 1, size), (2, 1, 1, past + 1),
                           (2, heads, past, size), (2, heads, past, size)], False),
        "another head size": ([(1, heads, 1, size * 2), wider, wider, mask, (1, heads, past, size * 2),
                               (1, heads, past, size * 2)], False),
        "another value size": ([q, kv, wider, mask, cache, (1, heads, past, size * 2)], False),
        "another mask lead": ([q, kv, kv, (1, heads, 1, past + 1), cache, cache], False),
        "a 3-D mask": ([q, kv, kv, (1, 1, past + 1), cache, cache], False),
        "another past head count": ([q, kv, kv, mask, (1, heads * 2, past, size), cache], False),
    }


@pytest.mark.parametrize("windowed", [True, False], ids=["bound caches", "plain pasts"])
def test_its_own_shape_check_takes_exactly_the_shapes_of_its_length_free_key(windowed, monkeypatch):
    """call_if_fits (which ShapeKeyedKernel calls instead of building a key of the six shapes) serves exactly the
    inputs whose length-free key is the kernel's: a new length or row count is served within the float64 bound,
    any other change declined with nothing written to the caches (the session then finds the shapes' own kernel)."""
    monkeypatch.setenv("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")
    from onnx_runtime import kv_append
    from onnx_runtime_ep_cpu.algorithms.attention_keys import length_free_key

    heads, size, past, capacity = 2, 4, 5, 16
    node = Node("PastAttention", ["q", "k", "v", "mask", "pk", "pv"], ["y", "present_k", "present_v"], name="layer0",
                domain=FUSED_DOMAIN, attrs={"scale": 0.5}, opset=23)
    variants = _variants(heads, size, past)
    first = variants["the same"][0]
    kernel = lookup("PastAttention", FUSED_DOMAIN, 1)(node, first, 23)
    assert kernel.call_if_fits is not None
    rng = np.random.default_rng(8)
    for name, (shapes, served) in variants.items():
        assert (length_free_key(tuple(shapes)) == length_free_key(tuple(first))) == served, name
        q, k, v, mask = (rng.standard_normal(s).astype(np.float32) for s in shapes[:4])
        pk_shape, pv_shape = shapes[4], shapes[5]
        keys = rng.standard_normal(pk_shape[:2] + (capacity,) + pk_shape[3:]).astype(np.float32)
        values = rng.standard_normal(pv_shape[:2] + (capacity,) + pv_shape[3:]).astype(np.float32)
        before_keys, before_values = keys.copy(), values.copy()
        fed_keys, fed_values = keys[:, :, :pk_shape[2]], values[:, :, :pv_shape[2]]
        windows = [kv_append.Window(fed_keys, keys, 2, "present_k"),
                   kv_append.Window(fed_values, values, 2, "present_v")]
        saved = kv_append.enter(windows if windowed else [])
        try:
            got = kernel.call_if_fits(q, k, v, mask, fed_keys, fed_values)
        finally:
            kv_append.leave(saved)
        if not served:
            assert got is None, name
            np.testing.assert_array_equal(keys, before_keys, name)
            np.testing.assert_array_equal(values, before_values, name)
            assert windows[0].result is None and windows[1].result is None, name
            continue
        y, present_k, present_v = got
        k64 = np.concatenate((before_keys[:, :, :pk_shape[2]], k), axis=2).astype(np.float64)
        v64 = np.concatenate((before_values[:, :, :pv_shape[2]], v), axis=2).astype(np.float64)
        np.testing.assert_array_equal(present_k, k64.astype(np.float32), name)
        np.testing.assert_array_equal(present_v, v64.astype(np.float32), name)
        if windowed:
            assert present_k is windows[0].result and np.shares_memory(present_v, values), name
        scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k64) * 0.5 + mask
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        exact = np.einsum("bhqk,bhkd->bhqd", weights / weights.sum(-1, keepdims=True), v64)
        reach = float(np.abs(v64).max()) * (1 + float(np.abs(scores).max()))
        assert_within(y, exact, gamma(size + k64.shape[2] + 8) * 40 * reach, f"y, {name}")


def test_a_session_finds_another_kernel_where_its_checking_kernel_declines(monkeypatch):
    """Through ShapeKeyedKernel: decode steps at growing lengths reuse the checking kernel without asking the
    cache, and shapes it declines (another batch, then back) get their own kernel, each call within the bound."""
    from onnx_runtime.session.steps import ShapeKeyedKernel

    class _Handle:
        name = "cpu"

        class hook:  # noqa: N801 (the provider's hook, as the session calls it)
            made: list = []

            @classmethod
            def get_kernel(cls, node, shapes, opset, graph):
                cls.made.append(shapes)
                return lookup("PastAttention", FUSED_DOMAIN, 1)(node, shapes, opset)

    node = Node("PastAttention", ["q", "k", "v", "mask", "pk", "pv"], ["y", "present_k", "present_v"], name="layer0",
                domain=FUSED_DOMAIN, attrs={"scale": 0.5}, opset=23)
    keyed = ShapeKeyedKernel(_Handle, node, graph=None)
    rng = np.random.default_rng(9)
    heads, size = 2, 4
    for batch, past in [(1, 3), (1, 4), (1, 5), (2, 5), (2, 6), (1, 6), (1, 7)]:
        q, k, v = (rng.standard_normal((batch, heads, 1, size)).astype(np.float32) for _ in range(3))
        pk, pv = (rng.standard_normal((batch, heads, past, size)).astype(np.float32) for _ in range(2))
        mask = np.zeros((batch, 1, 1, past + 1), np.float32)
        y, present_k, present_v = keyed(q, k, v, mask, pk, pv)
        k64 = np.concatenate((pk, k), axis=2).astype(np.float64)
        v64 = np.concatenate((pv, v), axis=2).astype(np.float64)
        np.testing.assert_array_equal(present_k, k64.astype(np.float32))
        scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k64) * 0.5
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        exact = np.einsum("bhqk,bhkd->bhqd", weights / weights.sum(-1, keepdims=True), v64)
        reach = float(np.abs(v64).max()) * (1 + float(np.abs(scores).max()))
        assert_within(y, exact, gamma(size + past + 8) * 40 * reach, f"y, batch {batch}, past {past}")
    assert [shapes[0][0] for shapes in _Handle.hook.made] == [1, 2]  # one kernel per batch, none per length
    assert len(keyed.cache) == 3  # (the first sight of each kernel, and batch 1 found again once by its key)
