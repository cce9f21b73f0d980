"""com.microsoft SkipLayerNormalization, SkipSimplifiedLayerNormalization and EmbedLayerNormalization, and
SimplifiedLayerNormalization (default ONNX domain), against onnxruntime's CPU provider."""

from __future__ import annotations

import numpy as np
import pytest
from contrib_oracle import F16, F32, close, compare, model, oracle, ours, placed_on_cpu, rand
from onnx_runtime.errors import OnnxRuntimeError

I32 = np.int32


# -- SkipLayerNormalization ----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("skip_shape", ["full", "broadcast batch", "2-D"])
@pytest.mark.parametrize("optional", [(), ("beta",), ("bias",), ("beta", "bias")])
def test_skip_layer_norm(dtype, skip_shape, optional):
    x = rand(2, 5, 16, dtype=dtype, low=-2, high=2)
    skip = rand(*{"full": (2, 5, 16), "broadcast batch": (1, 5, 16), "2-D": (5, 16)}[skip_shape], dtype=dtype)
    beta = rand(16, dtype=dtype) if "beta" in optional else None
    bias = rand(16, dtype=dtype) if "bias" in optional else None
    inputs = [x, skip, rand(16, dtype=dtype), beta, bias]
    while inputs[-1] is None:
        inputs.pop()
    compare("SkipLayerNormalization", inputs, {"epsilon": 1e-5}, n_outputs=4, scale=4)


def test_skip_layer_norm_default_epsilon_and_2d_input():
    inputs = [rand(6, 32), rand(6, 32), rand(32), rand(32)]
    compare("SkipLayerNormalization", inputs, n_outputs=4, scale=4)


def test_skip_layer_norm_omitted_outputs():
    x, skip, gamma, bias = rand(2, 3, 8), rand(2, 3, 8), rand(8), rand(8)
    got, _ = compare("SkipLayerNormalization", [x, skip, gamma, None, bias], outputs=["y", "", "", "sum"])
    assert [g.shape for g in got] == [(2, 3, 8), (2, 3, 8)]


@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_simplified_layer_norm(dtype, with_bias):
    x, skip, gamma = rand(3, 4, 24, dtype=dtype), rand(3, 4, 24, dtype=dtype), rand(24, dtype=dtype)
    inputs = [x, skip, gamma, rand(24, dtype=dtype)] if with_bias else [x, skip, gamma]
    got, expected = compare("SkipSimplifiedLayerNormalization", inputs, {"epsilon": 1e-6}, n_outputs=4, scale=4,
                            only=(0, 2, 3))
    # RMS normalization computes no mean: that output has the statistics' shape and type, and holds zeros.
    assert got[1].shape == expected[1].shape and got[1].dtype == np.float32 and not got[1].any()


def test_skip_simplified_layer_norm_2d_default_epsilon():
    compare("SkipSimplifiedLayerNormalization", [rand(7, 16), rand(7, 16), rand(16)], scale=4)


@pytest.mark.parametrize("op,inputs,expect", [
    ("SkipLayerNormalization", [rand(2, 3, 8), rand(2, 4, 8), rand(8)], "do not fit"),
    ("SkipLayerNormalization", [rand(2, 3, 8), rand(2, 3, 8), rand(7)], "gamma has shape (7,); expected (8,)"),
    ("SkipSimplifiedLayerNormalization", [rand(2, 3, 8), rand(2, 3, 8), rand(8), rand(3)], "bias has shape (3,)"),
])
def test_skip_norm_bad_inputs(op, inputs, expect):
    with pytest.raises(OnnxRuntimeError, match=rf"{op.lower()}_node.*{op}\).*" + expect.replace("(", r"\(")
                       .replace(")", r"\)")):
        ours(model(op, inputs, n_outputs=1), inputs)


# -- SimplifiedLayerNormalization ----------------------------------------------------------------


@pytest.mark.parametrize("x_dtype,scale_dtype", [(F32, F32), (F16, F16), (F16, F32), (F32, F16),
                                                 (np.float64, np.float64)])
def test_simplified_layer_norm_dtypes(x_dtype, scale_dtype):
    inputs = [rand(2, 3, 32, dtype=x_dtype, low=-3, high=3), rand(32, dtype=scale_dtype)]
    # float64 inputs still keep float32 statistics (stash_type 1): float32's tolerance.
    got, _ = compare("SimplifiedLayerNormalization", inputs, n_outputs=2, domain="", scale=4,
                     dtype=F32 if x_dtype == np.float64 else None)
    assert got[0].dtype == scale_dtype and got[1].dtype == np.float32


@pytest.mark.parametrize("axis,scale_shape", [(-1, (8,)), (2, (4, 8)), (1, (3, 4, 8)), (-2, (1, 8))])
def test_simplified_layer_norm_axis(axis, scale_shape):
    inputs = [rand(2, 3, 4, 8), rand(*scale_shape)]
    got, _ = compare("SimplifiedLayerNormalization", inputs, {"axis": axis, "epsilon": 1e-3}, n_outputs=2,
                     domain="", scale=4)
    start = axis % 4
    assert got[1].shape == (2, 3, 4, 8)[:start] + (1,) * (4 - start)


def test_simplified_layer_norm_double_stash_against_numpy():
    x, scale = rand(4, 16, dtype=np.float64), rand(16, dtype=np.float64)
    got = ours(model("SimplifiedLayerNormalization", [x, scale], {"stash_type": 11}, 2, domain=""), [x, scale])
    inv = 1 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + 1e-5)
    close(got[0], x * inv * scale)
    close(got[1], inv)


def test_simplified_layer_norm_bad_scale():
    inputs = [rand(2, 3, 8), rand(5)]
    with pytest.raises(OnnxRuntimeError, match=r"simplifiedlayernormalization_node.*scale has shape \(5,\)"):
        ours(model("SimplifiedLayerNormalization", inputs, domain=""), inputs)


# -- EmbedLayerNormalization ---------------------------------------------------------------------


def _embed_inputs(dtype, batch=2, steps=5, hidden=16, vocab=11, positions=9, segments=2, seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (batch, steps)).astype(I32)
    segment_ids = rng.integers(0, segments, (batch, steps)).astype(I32)
    tables = [rand(vocab, hidden, dtype=dtype), rand(positions, hidden, dtype=dtype),
              rand(segments, hidden, dtype=dtype)]
    return ids, segment_ids, tables, rand(hidden, dtype=dtype), rand(hidden, dtype=dtype)


@pytest.mark.parametrize("dtype", [F32, F16])
def test_embed_layer_norm_all_outputs(dtype):
    ids, segment_ids, (word, position, segment), gamma, beta = _embed_inputs(dtype)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], I32)
    inputs = [ids, segment_ids, word, position, segment, gamma, beta, mask]
    got, _ = compare("EmbedLayerNormalization", inputs, {"epsilon": 1e-5}, n_outputs=3, scale=4)
    assert got[1].tolist() == [3, 5]


def test_embed_layer_norm_without_segments_or_mask():
    ids, _, (word, position, _), gamma, beta = _embed_inputs(F32)
    inputs = [ids, None, word, position, None, gamma, beta]
    got, _ = compare("EmbedLayerNormalization", inputs, n_outputs=2, scale=4)
    assert got[1].tolist() == [0, 0]  # no mask: no counts


@pytest.mark.parametrize("shape", [(2, 5), (1, 5)])
def test_embed_layer_norm_position_ids(shape):
    ids, segment_ids, (word, position, segment), gamma, beta = _embed_inputs(F32)
    position_ids = np.random.default_rng(3).integers(0, 9, shape).astype(I32)
    mask = np.array([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0]], I32)
    inputs = [ids, segment_ids, word, position, segment, gamma, beta, mask, position_ids]
    compare("EmbedLayerNormalization", inputs, n_outputs=3, scale=4)


def test_embed_layer_norm_mask_index_counts_ones():
    ids, segment_ids, (word, position, segment), gamma, beta = _embed_inputs(F32)
    mask = np.array([[1, 2, 1, 0, 1], [0, 1, 0, 0, 0]], I32)
    inputs = [ids, segment_ids, word, position, segment, gamma, beta, mask]
    got, expected = compare("EmbedLayerNormalization", inputs, n_outputs=2, scale=4)
    assert got[1].tolist() == expected[1].tolist() == [3, 1]


def test_embed_layer_norm_out_of_range_ids():
    ids, segment_ids, (word, position, segment), gamma, beta = _embed_inputs(F32)
    ids[1, 2] = 11
    inputs = [ids, segment_ids, word, position, segment, gamma, beta]
    with pytest.raises(OnnxRuntimeError, match=r"embedlayernormalization_node.*input_ids.*expected ids in \[0, 11\)"):
        ours(model("EmbedLayerNormalization", inputs, n_outputs=2), inputs)
    with pytest.raises(Exception, match="out of range"):  # the oracle refuses them as well
        oracle(model("EmbedLayerNormalization", inputs, n_outputs=2), inputs)


def test_embed_layer_norm_segment_ids_need_their_table():
    ids, segment_ids, (word, position, _), gamma, beta = _embed_inputs(F32)
    inputs = [ids, segment_ids, word, position, None, gamma, beta]
    with pytest.raises(OnnxRuntimeError, match="segment_ids and segment_embedding must be given together"):
        ours(model("EmbedLayerNormalization", inputs, n_outputs=2), inputs)


# -- placement -----------------------------------------------------------------------------------


@pytest.mark.parametrize("op,inputs,domain", [
    ("SkipLayerNormalization", [rand(1, 2, 4), rand(1, 2, 4), rand(4)], "com.microsoft"),
    ("SkipSimplifiedLayerNormalization", [rand(1, 2, 4), rand(1, 2, 4), rand(4)], "com.microsoft"),
    ("SimplifiedLayerNormalization", [rand(1, 2, 4), rand(4)], ""),
    ("EmbedLayerNormalization", [np.zeros((1, 2), I32), None, rand(3, 4), rand(3, 4), None, rand(4), rand(4)],
     "com.microsoft"),
])
def test_placed_on_cpu(op, inputs, domain):
    placed_on_cpu(op, inputs, domain=domain, n_outputs=2 if op == "EmbedLayerNormalization" else 1)
