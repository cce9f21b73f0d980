"""com.microsoft Attention, MultiHeadAttention, GroupQueryAttention and RotaryEmbedding against onnxruntime's
CPU provider. Where that provider refuses a documented form (Attention's 4-D mask and shared past/present
buffer, MultiHeadAttention's packed Q/K/V) the oracle runs the equivalent unpacked/unshared model."""

from __future__ import annotations

import numpy as np
import onnx_runtime
import pytest
from contrib_oracle import F16, F32, close, compare, model, oracle, ours, placed_on_cpu, rand
from onnx_runtime.errors import OnnxRuntimeError, UnsupportedOperatorError

I32, I64 = np.int32, np.int64
B, S, D, N, HEAD = 2, 4, 6, 2, 8
HIDDEN = N * HEAD


def _mask(*shape, seed=0):
    mask = (np.random.default_rng(seed).uniform(size=shape) > 0.3).astype(I32)
    mask[..., 0] = 1  # every query keeps a key
    return mask


# -- Attention -----------------------------------------------------------------------------------


def _attention_inputs(dtype=F32, v_hidden=HIDDEN):
    return [rand(B, S, D, dtype=dtype), rand(D, 2 * HIDDEN + v_hidden, dtype=dtype),
            rand(2 * HIDDEN + v_hidden, dtype=dtype)]


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("attrs", [{}, {"unidirectional": 1}, {"scale": 0.3}])
def test_attention(dtype, attrs):
    compare("Attention", _attention_inputs(dtype), {"num_heads": N, **attrs}, scale=4)


def test_attention_without_bias_and_with_v_hidden_size():
    x, w, _ = _attention_inputs()
    compare("Attention", [x, w], {"num_heads": N})
    inputs = _attention_inputs(v_hidden=2 * HIDDEN)
    compare("Attention", inputs, {"num_heads": N, "qkv_hidden_sizes": [HIDDEN, HIDDEN, 2 * HIDDEN]}, scale=4)


@pytest.mark.parametrize("mask", [
    np.array([3, 2], I32),  # right padding: valid lengths
    np.array([4, 3, 1, 0], I32),  # left and right padding: ends, then starts
    _mask(B, S),  # raw (B, T)
    _mask(B, S, S),  # raw (B, S, T)
], ids=["1-D", "2B", "2-D", "3-D"])
@pytest.mark.parametrize("attrs", [{}, {"unidirectional": 1}, {"mask_filter_value": -50.0}])
def test_attention_mask_index(mask, attrs):
    compare("Attention", _attention_inputs() + [mask], {"num_heads": N, **attrs}, scale=4)


def test_attention_4d_mask_reads_its_rows_past_the_past():
    # (B, 1, M, M): rows past .. past + S and columns 0 .. T of a raw mask apply. onnxruntime's CPU kernel
    # refuses 4-D masks: the equivalent 3-D mask is the oracle's.
    past = rand(2, B, N, 3, HEAD)
    big = _mask(B, 1, 10, 10, seed=4)
    inputs = _attention_inputs() + [big, past]
    equivalent = inputs[:3] + [np.ascontiguousarray(big[:, 0, 3:3 + S, :3 + S]), past]
    got = ours(model("Attention", inputs, {"num_heads": N}, 2), inputs)
    expected = oracle(model("Attention", equivalent, {"num_heads": N}, 2), equivalent)
    for g, e in zip(got, expected):
        close(g, e, scale=4)


@pytest.mark.parametrize("attrs", [{}, {"unidirectional": 1}])
@pytest.mark.parametrize("with_mask", [False, True])
def test_attention_past_and_present(attrs, with_mask):
    past = rand(2, B, N, 3, HEAD)
    mask = _mask(B, 3 + S, seed=1) if with_mask else None
    compare("Attention", _attention_inputs() + [mask, past], {"num_heads": N, **attrs}, n_outputs=2, scale=4)


@pytest.mark.parametrize("bias_shape", [(B, N, S, S), (1, 1, S, S), (B, 1, S, S)])
def test_attention_bias(bias_shape):
    compare("Attention", _attention_inputs() + [None, None, rand(*bias_shape)], {"num_heads": N}, scale=4)


def test_attention_shared_past_present_buffer():
    # The present state is the past buffer with this step's keys/values written at past_sequence_length; the
    # attention reads its first past + S positions (onnxruntime's CPU kernel refuses the shared buffer: the
    # oracle is the unshared model over the buffer's valid part).
    past = rand(2, B, N, 3, HEAD)
    buffer = rand(2, B, N, 10, HEAD)
    buffer[:, :, :, :3] = past
    projection = _attention_inputs()
    inputs = projection + [None, buffer, None, np.array(3, I32)]
    got = ours(model("Attention", inputs, {"num_heads": N, "past_present_share_buffer": 1, "unidirectional": 1}, 2),
               inputs)
    unshared = projection + [None, past]
    expected = oracle(model("Attention", unshared, {"num_heads": N, "unidirectional": 1}, 2), unshared)
    close(got[0], expected[0], scale=4)
    assert got[1].shape == buffer.shape
    close(got[1][:, :, :, :3 + S], expected[1], scale=4)
    np.testing.assert_array_equal(got[1][:, :, :, 3 + S:], buffer[:, :, :, 3 + S:])


@pytest.mark.parametrize("inputs,attrs,expect", [
    (_attention_inputs() + [np.zeros((3,), I32)], {}, "fits no mask convention"),
    ([rand(B, S, D), rand(D, 47)], {}, "weights have 47 columns"),
    (_attention_inputs() + [None, rand(2, B, N, 3, HEAD), None, None], {"past_present_share_buffer": 1},
     "past_sequence_length"),
    (_attention_inputs(), {"do_rotary": 1}, "'do_rotary' is 1"),
])
def test_attention_bad_inputs(inputs, attrs, expect):
    with pytest.raises(OnnxRuntimeError, match=rf"attention_node.*Attention.*{expect}"):
        ours(model("Attention", inputs, {"num_heads": N, **attrs}, 2 if len(inputs) > 4 else 1), inputs)


# -- MultiHeadAttention --------------------------------------------------------------------------

L = 5


def _mha_inputs(dtype=F32, kv_len=L, bias=True):
    q, k, v = (rand(B, length, HIDDEN, dtype=dtype) for length in (S, kv_len, kv_len))
    return [q, k, v, rand(3 * HIDDEN, dtype=dtype) if bias else None]


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("bias", [False, True])
def test_mha(dtype, bias):
    compare("MultiHeadAttention", _mha_inputs(dtype, bias=bias), {"num_heads": N}, scale=4)


@pytest.mark.parametrize("mask", [np.array([3, 5], I32), _mask(B, L, seed=2), _mask(B, S, L, seed=3)],
                         ids=["lengths", "2-D", "3-D"])
def test_mha_key_padding_mask(mask):
    compare("MultiHeadAttention", _mha_inputs() + [mask], {"num_heads": N, "mask_filter_value": -300.0}, scale=4)


@pytest.mark.parametrize("bias_shape", [(B, N, S, L), (1, N, S, L), (B, 1, S, L), (1, 1, S, L)])
def test_mha_attention_bias(bias_shape):
    compare("MultiHeadAttention", _mha_inputs() + [None, rand(*bias_shape)], {"num_heads": N, "scale": 0.2},
            scale=4)


@pytest.mark.parametrize("attrs", [{}, {"unidirectional": 1}])
def test_mha_past_and_present(attrs):
    q = rand(B, S, HIDDEN)
    inputs = [q, rand(B, S, HIDDEN), rand(B, S, HIDDEN), rand(3 * HIDDEN), _mask(B, 3 + S, seed=5), None,
              rand(B, N, 3, HEAD), rand(B, N, 3, HEAD)]
    compare("MultiHeadAttention", inputs, {"num_heads": N, **attrs}, n_outputs=3, scale=4)


def test_mha_unidirectional_self_attention():
    q, k, v, bias = _mha_inputs(kv_len=S)
    compare("MultiHeadAttention", [q, k, v, bias], {"num_heads": N, "unidirectional": 1}, scale=4)


def test_mha_unidirectional_cross_attention_keeps_earlier_keys():
    # Query i sees keys 0 .. i (past length 0). onnxruntime's kernel agrees except on the last query row,
    # which it leaves unmasked when there are more keys than queries: that row is not compared.
    inputs = _mha_inputs()
    proto = model("MultiHeadAttention", inputs, {"num_heads": N, "unidirectional": 1})
    got, expected = ours(proto, inputs)[0], oracle(proto, inputs)[0]
    close(got[:, :S - 1], expected[:, :S - 1], scale=4)


def test_mha_cross_attention_cache_and_v_hidden():
    # Keys/values in the head layout (B, N, L, D) take no bias.
    q, _, _, bias = _mha_inputs()
    compare("MultiHeadAttention", [q, rand(B, N, L, HEAD), rand(B, N, L, HEAD), bias], {"num_heads": N},
            n_outputs=3, scale=4)
    compare("MultiHeadAttention", [q, rand(B, L, HIDDEN), rand(B, L, 2 * HIDDEN)], {"num_heads": N}, scale=4)


def test_mha_qk_output():
    inputs = _mha_inputs() + [_mask(B, L, seed=6), rand(B, N, S, L)]
    got, _ = compare("MultiHeadAttention", inputs, {"num_heads": N}, n_outputs=4, scale=4, types={3: F32})
    assert got[3].shape == (B, N, S, L)
    inputs16 = [x.astype(F16) if x.dtype == F32 else x for x in inputs]
    compare("MultiHeadAttention", inputs16, {"num_heads": N}, n_outputs=4, scale=4, types={3: F32})


def test_mha_unnamed_outputs():
    # Outputs listed without a name are computed and dropped; the named ones still come back.
    got, _ = compare("MultiHeadAttention", _mha_inputs(), {"num_heads": N}, outputs=["y", "", "present_value"],
                     scale=4)
    assert [g.shape for g in got] == [(B, S, HIDDEN), (B, N, L, HEAD)]


def test_mha_bfloat16_rounds_the_float32_result():
    import ml_dtypes

    inputs = _mha_inputs()
    narrow = [x.astype(ml_dtypes.bfloat16) for x in inputs]
    (got,) = ours(model("MultiHeadAttention", narrow, {"num_heads": N}), narrow)
    (wide,) = ours(model("MultiHeadAttention", [x.astype(F32) for x in narrow], {"num_heads": N}),
                   [x.astype(F32) for x in narrow])
    assert got.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got, wide.astype(ml_dtypes.bfloat16))


def test_mha_packed_qkv_and_kv():
    # onnxruntime's CPU kernel refuses packed inputs: the oracle runs them unpacked.
    qkv, kv = rand(B, S, N, 3, HEAD), rand(B, L, N, 2, HEAD)
    q = rand(B, S, HIDDEN)
    packed = [([qkv], [qkv[:, :, :, i].reshape(B, S, HIDDEN) for i in range(3)]),
              ([q, kv], [q] + [kv[:, :, :, i].reshape(B, L, HIDDEN) for i in range(2)])]
    for inputs, unpacked in packed:
        got = ours(model("MultiHeadAttention", inputs, {"num_heads": N}), inputs)
        expected = oracle(model("MultiHeadAttention", unpacked, {"num_heads": N}), unpacked)
        close(got[0], expected[0], scale=4)


def test_mha_shared_buffer_and_cache_indirection():
    # Decoding one token into a (B, N, 6, D) buffer holding 3 past positions; with beam search's
    # cache_indirection (1 batch entry x 2 beams), past position t of beam w reads beam ci[0, w, t].
    q, k, v = rand(B, 1, HIDDEN), rand(B, 1, HIDDEN), rand(B, 1, HIDDEN)
    buffers = [rand(B, N, 6, HEAD), rand(B, N, 6, HEAD)]
    indirection = np.array([[[1, 0, 1, 0, 0, 0], [0, 0, 1, 1, 1, 0]]], I32)
    inputs = [q, k, v, rand(3 * HIDDEN), None, None, *buffers, np.array(3, I32)]
    compare("MultiHeadAttention", inputs, {"num_heads": N}, n_outputs=3, scale=4)
    compare("MultiHeadAttention", inputs + [indirection], {"num_heads": N}, n_outputs=3, scale=4)


@pytest.mark.parametrize("inputs,expect", [
    (_mha_inputs() + [np.zeros(3 * B + 2, I32)], "fits no mask convention"),
    ([rand(B, S, HIDDEN)], "expected \\(B, S, hidden\\) with key and value"),
    (_mha_inputs()[:3] + [rand(7)], "bias has shape \\(7,\\)"),
    (_mha_inputs() + [None, rand(B, N, S, L + 1)], "attention_bias has shape"),
])
def test_mha_bad_inputs(inputs, expect):
    with pytest.raises(OnnxRuntimeError, match=rf"multiheadattention_node.*MultiHeadAttention.*{expect}"):
        ours(model("MultiHeadAttention", inputs, {"num_heads": N}), inputs)


# -- GroupQueryAttention -------------------------------------------------------------------------

NQ, NKV, H16 = 4, 2, 16
GQA = {"num_heads": NQ, "kv_num_heads": NKV}


def _gqa_step(batch, steps, dtype=F32):
    return rand(batch, steps, NQ * H16, dtype=dtype), rand(batch, steps, NKV * H16, dtype=dtype), \
        rand(batch, steps, NKV * H16, dtype=dtype)


def _lengths(seqlens, total):
    return np.array(seqlens, I32), np.array(total, I32)


def _compare_gqa(inputs, attrs, valid=None, n_outputs=3, **kwargs):
    """Both runtimes; the present buffers compared up to each batch entry's ``valid`` length (the rest is
    unspecified)."""
    proto = model("GroupQueryAttention", inputs, {**GQA, **attrs}, n_outputs, **kwargs)
    got, expected = ours(proto, inputs), oracle(proto, inputs)
    for index, (g, e) in enumerate(zip(got, expected)):
        if index in (1, 2) and valid is not None:
            assert g.shape == e.shape
            for b, length in enumerate(valid):
                close(g[b, :, :length], e[b, :, :length], scale=4)
        else:
            close(g, e, scale=4, what=f"output {index}")
    return got


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("attrs", [{}, {"local_window_size": 2}, {"softcap": 0.5}, {"scale": 0.7}, {"causal": 0},
                                   {"smooth_softmax": 1}])
def test_gqa_prompt(dtype, attrs):
    q, k, v = _gqa_step(2, 5, dtype)
    _compare_gqa([q, k, v, None, None, *_lengths([4, 4], 5)], attrs)


def test_gqa_packed_query():
    q, k, v = _gqa_step(2, 5)
    _compare_gqa([np.concatenate([q, k, v], -1), None, None, None, None, *_lengths([4, 4], 5)], {})


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("position_ids", [None, np.array([[3, 4, 5, 6, 7]] * 2, I64)])
def test_gqa_prompt_rotary(interleaved, position_ids):
    q, k, v = _gqa_step(2, 5)
    cos, sin = rand(20, H16 // 2), rand(20, H16 // 2)
    inputs = [q, k, v, None, None, *_lengths([4, 4], 5), cos, sin, position_ids]
    _compare_gqa(inputs, {"do_rotary": 1, "rotary_interleaved": interleaved})


def test_gqa_partial_rotary():
    query, key = rand(1, 3, NQ * 32), rand(1, 3, NKV * 32)
    cos, sin = rand(8, 8), rand(8, 8)  # a rotary dim of 16 in heads of 32
    _compare_gqa([query, key, key.copy(), None, None, *_lengths([2], 3), cos, sin], {"do_rotary": 1})


@pytest.mark.parametrize("attrs", [{}, {"local_window_size": 3}, {"softcap": 0.4}, {"do_rotary": 1},
                                   {"do_rotary": 1, "rotary_interleaved": 1}])
@pytest.mark.parametrize("buffer", [6, 9], ids=["past", "shared buffer"])
def test_gqa_decode_ragged(attrs, buffer):
    # Entry 0 has 4 tokens so far, entry 1 has 6: the new token lands at positions 3 and 5 of the present.
    q, k, v = _gqa_step(2, 1)
    past = [rand(2, NKV, buffer, H16), rand(2, NKV, buffer, H16)]
    seqlens, total = _lengths([3, 5], 6)
    extra = [rand(20, H16 // 2), rand(20, H16 // 2)] if attrs.get("do_rotary") else []
    got = _compare_gqa([q, k, v, *past, seqlens, total, *extra], attrs, valid=[4, 6])
    assert got[1].shape == (2, NKV, buffer, H16)
    # Past each entry's length the present buffer keeps the past buffer's content (a shared buffer's).
    for b, length in enumerate([4, 6]):
        np.testing.assert_array_equal(got[1][b, :, length:], past[0][b, :, length:])


def test_gqa_decode_float16():
    q, k, v = _gqa_step(2, 1, F16)
    past = [rand(2, NKV, 7, H16, dtype=F16), rand(2, NKV, 7, H16, dtype=F16)]
    cos, sin = rand(20, H16 // 2, dtype=F16), rand(20, H16 // 2, dtype=F16)
    _compare_gqa([q, k, v, *past, *_lengths([2, 6], 7), cos, sin], {"do_rotary": 1, "softcap": 0.6}, valid=[3, 7])


def test_gqa_decode_position_ids_bias_and_sink():
    q, k, v = _gqa_step(2, 1)
    past = [rand(2, NKV, 6, H16), rand(2, NKV, 6, H16)]
    seqlens, total = _lengths([3, 5], 6)
    cos, sin = rand(20, H16 // 2), rand(20, H16 // 2)
    inputs = [q, k, v, *past, seqlens, total, cos, sin, np.array([[9], [2]], I64), rand(2, NQ, 1, 6), rand(NQ)]
    _compare_gqa(inputs, {"do_rotary": 1}, valid=[4, 6])


def test_gqa_subsequent_prompt():
    q, k, v = _gqa_step(1, 3)
    past = [rand(1, NKV, 6, H16), rand(1, NKV, 6, H16)]
    inputs = [q, k, v, *past, *_lengths([5], 6), rand(10, H16 // 2), rand(10, H16 // 2)]
    _compare_gqa(inputs, {"do_rotary": 1, "local_window_size": 4}, valid=[6])


@pytest.mark.parametrize("mode", [1, 2])
@pytest.mark.parametrize("attrs", [{}, {"local_window_size": 2}, {"softcap": 0.3}])
def test_gqa_qk_output(mode, attrs):
    q, k, v = _gqa_step(1, 3)
    past = [rand(1, NKV, 3, H16), rand(1, NKV, 3, H16)]
    inputs = [q, k, v, *past, *_lengths([5], 6), None, None, None, rand(1, NQ, 3, 6)]
    got = _compare_gqa(inputs, {"qk_output": mode, **attrs}, valid=[6], n_outputs=4)
    assert got[3].shape == (1, NQ, 3, 6)


@pytest.mark.parametrize("inputs,attrs,expect", [
    ([*_gqa_step(2, 1), None, None, *_lengths([3], 6)], {}, "seqlens_k must hold 2 lengths"),
    ([*_gqa_step(2, 1), None, None, *_lengths([3, 9], 6)], {}, "seqlens_k must hold 2 lengths"),
    ([*_gqa_step(1, 2), None, None, *_lengths([4], 6), rand(3, 8), rand(3, 8)], {"do_rotary": 1}, "positions up"),
    ([*_gqa_step(1, 1), None, None, *_lengths([0], 1)], {"do_rotary": 1}, "needs the cos_cache and sin_cache"),
    ([rand(1, 1, 41), None, None, None, None, *_lengths([0], 1)], {}, "packed query hidden size 41"),
])
def test_gqa_bad_inputs(inputs, attrs, expect):
    with pytest.raises(OnnxRuntimeError, match=rf"groupqueryattention_node.*GroupQueryAttention.*{expect}"):
        ours(model("GroupQueryAttention", inputs, {**GQA, **attrs}, 3), inputs)


def test_gqa_unsupported_cache_forms():
    inputs = [*_gqa_step(1, 1), None, None, *_lengths([0], 1)]
    for attrs, expect in (({"sliding_window_cache": 1, "local_window_size": 2}, "'sliding_window_cache' is 1"),
                          ({"k_quant_type": "PER_TENSOR"}, "'k_quant_type' is 'PER_TENSOR'")):
        with pytest.raises(OnnxRuntimeError, match=rf"groupqueryattention_node.*{expect}"):
            ours(model("GroupQueryAttention", inputs, {**GQA, **attrs}, 3), inputs)
    scaled = inputs + [None, None, None, None, None, rand(1)]
    with pytest.raises(OnnxRuntimeError, match=r"groupqueryattention_node.*'k_scale' is not supported"):
        ours(model("GroupQueryAttention", scaled, GQA, 3), scaled)


def test_gqa_bad_attributes():
    inputs = [*_gqa_step(1, 1), None, None, *_lengths([0], 1)]
    for attrs, expect in (({"num_heads": 3}, "multiple of kv_num_heads"), ({"qk_output": 3}, "'qk_output' is 3"),
                          ({"causal": 0, "local_window_size": 2}, "'local_window_size' is 2")):
        with pytest.raises(OnnxRuntimeError, match=expect):
            ours(model("GroupQueryAttention", inputs, {**GQA, **attrs}, 3), inputs)


# -- RotaryEmbedding -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("layout", ["3-D start", "3-D ids", "4-D ids", "3-D num_heads"])
def test_rotary_embedding(dtype, interleaved, layout):
    cos, sin = rand(10, HEAD // 2, dtype=dtype), rand(10, HEAD // 2, dtype=dtype)
    x = rand(B, N, S, HEAD, dtype=dtype) if layout.startswith("4-D") else rand(B, S, HIDDEN, dtype=dtype)
    ids = np.array([5], I64) if layout == "3-D start" else np.array([[0, 1, 2, 3], [6, 7, 9, 2]], I64)
    attrs = {"interleaved": interleaved, **({"num_heads": N} if layout == "3-D num_heads" else {})}
    compare("RotaryEmbedding", [x, ids, cos, sin], attrs)


@pytest.mark.parametrize("four_d", [False, True])
def test_rotary_embedding_partial(four_d):
    cos, sin = rand(10, 2), rand(10, 2)
    x = rand(B, N, S, HEAD) if four_d else rand(B, S, HIDDEN)
    ids = np.array([[0, 1, 2, 3], [4, 4, 8, 9]], I64)
    compare("RotaryEmbedding", [x, ids, cos, sin], {"rotary_embedding_dim": 4, "num_heads": N, "interleaved": 1})


@pytest.mark.parametrize("ids,attrs,expect", [
    (np.array([[0, 1, 2, 3], [6, 7, 19, 2]], I64), {}, "positions up to 19"),
    (np.array([8], I64), {}, "positions up to 11"),
    (np.array([0], I64), {"rotary_embedding_dim": 4}, "'num_heads' is required"),
    (np.array([[0, 1]], I64), {}, "position_ids has shape \\(1, 2\\)"),
])
def test_rotary_embedding_bad_inputs(ids, attrs, expect):
    inputs = [rand(B, S, HIDDEN), ids, rand(10, HEAD // 2), rand(10, HEAD // 2)]
    with pytest.raises(OnnxRuntimeError, match=rf"rotaryembedding_node.*RotaryEmbedding.*{expect}"):
        ours(model("RotaryEmbedding", inputs, attrs), inputs)


# -- placement -----------------------------------------------------------------------------------


@pytest.mark.parametrize("op,inputs,attrs", [
    ("Attention", _attention_inputs(), {"num_heads": N}),
    ("MultiHeadAttention", _mha_inputs(), {"num_heads": N}),
    ("GroupQueryAttention", [*_gqa_step(1, 2), None, None, *_lengths([1], 2)], GQA),
    ("RotaryEmbedding", [rand(1, 2, HIDDEN), np.array([0], I64), rand(4, HEAD // 2), rand(4, HEAD // 2)], {}),
])
def test_placed_on_cpu(op, inputs, attrs):
    placed_on_cpu(op, inputs, attrs)


def test_unimplemented_contrib_operator_names_itself():
    # Session creation fails naming the node, the operator, its domain and opset, and each provider's reason.
    x = rand(2, 3)
    with pytest.raises(UnsupportedOperatorError, match=r"'nosuchcontribop_node'.*NoSuchContribOp \(domain "
                       r"com\.microsoft, opset 1\).*CPUExecutionProvider.*com\.microsoft::NoSuchContribOp"):
        onnx_runtime.InferenceSession(model("NoSuchContribOp", [x]), providers=["CPUExecutionProvider"])
