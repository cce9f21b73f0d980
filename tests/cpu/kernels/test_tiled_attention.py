"""The tiled float32 attention (compiled/attention.py): query tiles through the microkernel, softmax in
cache, hidden keys skipped, (batch, head) units split across the helper threads; against the numpy
paths and onnx's reference evaluator."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import record_results
from onnx_runtime_ep_cpu.compiled import attention, gemm
from onnx_runtime_ep_cpu.ops import transformer as ops_transformer
from test_compiled_transformer import (
    MASKS,
    _attention,
    _mask,
    _no_compiled,
    _qkv,
    compiled_and_numpy_attention,
    non_finite_values_spread_as_in_the_numpy_path,
    session_attention_matches_reference,
)

pytestmark = pytest.mark.skipif(not gemm.AVAILABLE, reason="the tiled attention needs an AVX-512 host")


@pytest.fixture
def tiled_calls(monkeypatch):
    """The results of _tiled_attention in this test (None where it handed over to another path)."""
    return record_results(monkeypatch, ops_transformer._Attention, "_tiled_attention")


# (batch, query heads, KV heads, queries, keys, head size, value head size... as _qkv: one size, rank)
GEOMETRIES = [(1, 4, 4, 16, 16, 32, 4), (2, 4, 2, 37, 45, 32, 3), (1, 2, 1, 128, 128, 64, 3),
              (1, 3, 3, 20, 300, 32, 4), (1, 2, 2, 129, 129, 64, 4)]


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "-".join(map(str, g)))
def test_tiled_attention_matches_the_numpy_path(tiled_calls, knobs, mask_kind, geometry):
    knobs(few_query_macs=1)  # (the smallest geometry is a short sequence decoder.py's one call would take)
    compiled_and_numpy_attention(mask_kind, geometry, atol=1e-5)  # float32 sums over up to 300 keys
    # A float mask over every query and key (or none) runs the tiles; a row that sees no key hands over.
    if mask_kind in ("none", "2d", "4d", "causal_attr"):
        assert len(tiled_calls) == 1 and tiled_calls[0] is not None
    elif mask_kind == "row_masked":
        assert tiled_calls == [None]
    else:  # boolean and broadcasting masks: the other paths
        assert not tiled_calls


def test_results_do_not_depend_on_the_thread_count(monkeypatch, tiled_calls, knobs):
    knobs(split_macs=1, few_query_macs=1)  # (50 queries: the few-row lanes would take them)
    q, k, v = _qkv(2, 4, 2, 50, 50, 32, 3)
    mask = _mask("2d", 50, 50)
    results = []
    for count in (1, 2, 3):
        knobs(threads=count)
        attn = _attention([q.shape, k.shape, v.shape, mask.shape], q_num_heads=4, kv_num_heads=2)
        results.append(attn(q, k, v, mask)[0])
    assert len(tiled_calls) == 3 and all(r is not None for r in tiled_calls)
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


def test_a_finite_causal_mask_skips_the_future_and_keeps_the_weights():
    """-1e9 above the diagonal (a PyTorch export's causal mask): each tile computes only the keys up to
    its last row, and the outputs are the full computation's."""
    q, k, v = _qkv(1, 2, 2, 64, 64, 32, 4)
    mask = np.triu(np.full((64, 64), -1e9, np.float32), 1)
    plan = attention.tiles(64)
    assert plan.tolist() == [[0, 12, 12], [12, 12, 12], [24, 12, 12], [36, 12, 12], [48, 12, 12], [60, 4, 8]]
    shapes = [q.shape, k.shape, v.shape, mask.shape]
    got = _attention(shapes)(q, k, v, mask)[0]
    want = _no_compiled(_attention(shapes))(q, k, v, mask)[0]
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)


def test_non_finite_inputs_spread_as_in_the_numpy_path(tiled_calls, knobs):
    """A NaN key makes the weights of the rows that see it NaN (numpy's softmax spreads it over the row),
    an infinite value spreads through the product; a NaN query leaves its row without a finite score,
    which the general path decides."""
    knobs(few_query_macs=1)  # (24 rows per KV head: the few-row lanes would take them)
    non_finite_values_spread_as_in_the_numpy_path(*_qkv(1, 2, 2, 24, 24, 32, 4), tiled_calls, (0, 0, 5, 3))


def test_a_prefill_attention_matches_onnx_reference(tiled_calls, knobs):
    """Through a session, as a user runs it: 3-D Q/K/V of 40 tokens, grouped-query heads, a causal mask."""
    knobs(few_query_macs=1)  # (40 tokens: the few-row lanes would take them)
    session_attention_matches_reference(*_qkv(1, 4, 2, 40, 40, 32, 3), q_num_heads=4, kv_num_heads=2, is_causal=1)
    assert tiled_calls and tiled_calls[0] is not None
