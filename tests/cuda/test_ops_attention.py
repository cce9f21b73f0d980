"""ONNX Attention on the CUDA provider (kernels/attention.cu, ops/attention.py) against the CPU provider.

The fused kernel is built for decode steps (one query row over a long KV sequence, split over several
blocks whose softmax states are merged) and also runs prefill; the sizes here are small enough for the
simulator but cross its internal boundaries: KV lengths that are not multiples of the 16-key step or of a
split, head sizes of every per-lane width (1, 2, 4, 8 values), head groups larger than the 4 heads a block
takes, and fully masked rows.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import onnx_runtime as ort
import pytest
from cuda_op_harness import (
    CUDA,
    CUDA_FIRST,
    HALVES,
    check_node,
    decline_reason,
    node_cases,
    node_model,
    random,
    run_backend_case,
)
from cuda_op_harness import tolerance as half_tolerance
from onnx import TensorProto, helper
from onnx_runtime.errors import InvalidGraphError

pytestmark = pytest.mark.usefixtures("cuda_driver_mode")

# Backend cases the CUDA provider declines on purpose: they run on the CPU, with the reason in placement().
DECLINED = {"test_attention_local_window_gqa_rank4_mask": "softmax_precision=11"}


def attention_cases() -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node_cases()
    return sorted(name for name, case in cases.items() if {n.op_type for n in case.model.graph.node} == {"Attention"})


@pytest.mark.parametrize("name", attention_cases())
def test_backend_case(name):
    run_backend_case(name, declined_ok=lambda case: case in DECLINED)


@pytest.mark.parametrize("name", sorted(DECLINED))
def test_backend_case_declined_with_reason(name):
    session = ort.InferenceSession(node_cases()[name].model.SerializeToString(), providers=CUDA_FIRST)
    (placed,) = session.placement()
    assert placed.provider == "CPUExecutionProvider"
    assert DECLINED[name] in placed.rejected[CUDA]


def tolerance(dtype) -> dict:
    # Scores sum many products: float32 differs from the CPU's BLAS order by a few ulps of the sum.
    return {"rtol": 1e-4, "atol": 1e-5} if np.dtype(dtype) == np.float32 else half_tolerance(dtype)


def attention(q, k, v, mask=None, past_key=None, past_value=None, nonpad=None, opset=23, outputs=1,
              **attrs) -> list:
    """One Attention node on CUDA against the CPU provider; returns the CUDA outputs."""
    inputs = {"q": q, "k": k, "v": v, "mask": mask, "past_key": past_key, "past_value": past_value}
    if nonpad is not None:
        inputs["nonpad"] = nonpad
    while inputs[list(inputs)[-1]] is None:  # no trailing omitted inputs
        inputs.pop(list(inputs)[-1])
    return check_node("Attention", inputs, attrs, opset=opset, outputs=outputs, **tolerance(q.dtype))


def qkv(batch, q_heads, kv_heads, q_len, kv_len, head_size, v_head_size=None, dtype=np.float32, seed=0,
        layout=4):
    """Random Q, K, V in the 4-D (B, H, S, D) or the 3-D (B, S, H * D) layout."""
    v_head_size = v_head_size or head_size
    shapes = [(batch, q_heads, q_len, head_size), (batch, kv_heads, kv_len, head_size),
              (batch, kv_heads, kv_len, v_head_size)]
    if layout == 3:
        shapes = [(b, s, h * d) for b, h, s, d in shapes]
    return [random(shape, dtype, seed + i) * (2 if i == 0 else 1) for i, shape in enumerate(shapes)]


# -- decode ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kv_len", [1, 15, 17, 300])  # below, around and well past a 16-key step and a split
def test_decode_grouped_query_heads(kv_len):
    q, k, v = qkv(1, 8, 2, 1, kv_len, 64)  # 4 query heads per KV head
    attention(q, k, v)


def test_decode_splits_a_long_sequence():
    # 1,000 keys over a single (batch, KV head) row: several splits whose last one is partial.
    q, k, v = qkv(1, 2, 1, 1, 1000, 128)
    attention(q, k, v, scale=0.3)


def test_decode_shapes_here_take_the_split_path():
    from onnx_runtime_ep_cuda.ops import attention as ops

    node = SimpleNamespace(name="n", attr=lambda name, default=None: default)
    plan = ops._plan(node, 132, (1, 2, 1, 128), (1, 1, 1000, 128), (1, 1, 1000, 128), None, None)
    assert plan.splits > 2 and 1000 % plan.chunk  # several splits, the last one partial
    plan = ops._plan(node, 132, (1, 8, 1, 64), (1, 2, 300, 64), (1, 2, 300, 64), None, None)
    assert plan.splits == 2 and plan.group == 4


@pytest.mark.parametrize("dtype", HALVES, ids=["f16", "bf16"])
def test_decode_half_precision(dtype):
    q, k, v = qkv(2, 8, 2, 1, 130, 64, dtype=dtype)
    attention(q, k, v, is_causal=1)


def test_decode_with_past_is_causal_and_writes_present():
    q, k, v = qkv(2, 8, 2, 1, 1, 32, layout=3)
    past_key, past_value = random((2, 2, 299, 32), seed=5), random((2, 2, 299, 32), seed=6)
    y, present_key, present_value = attention(q, k, v, None, past_key, past_value, outputs=3, is_causal=1,
                                              q_num_heads=8, kv_num_heads=2)
    assert present_key.shape == (2, 2, 300, 32)
    np.testing.assert_array_equal(present_key[:, :, :299], past_key)
    np.testing.assert_array_equal(present_value[:, :, 299], v.reshape(2, 2, 32))


@pytest.mark.parametrize("mask_shape", [(300,), (1, 8, 1, 300), (2, 1, 1, 300), (2, 1, 1, 250)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_decode_masks(kind, mask_shape):
    q, k, v = qkv(2, 8, 2, 1, 300, 16)
    rng = np.random.default_rng(7)
    mask = rng.random(mask_shape) < 0.7
    if kind == "float":
        mask = np.where(mask, rng.uniform(-2, 2, mask_shape), -np.inf).astype(np.float32)
    attention(q, k, v, mask)


@pytest.mark.parametrize("dtype", HALVES, ids=["f16", "bf16"])
def test_decode_half_precision_float_mask_and_past(dtype):
    q, k, v = qkv(1, 4, 4, 1, 1, 40, dtype=dtype)
    past_key, past_value = random((1, 4, 99, 40), dtype, 3), random((1, 4, 99, 40), dtype, 4)
    mask = random((1, 100), dtype, 5)
    attention(q, k, v, mask, past_key, past_value, outputs=3)


def test_decode_external_cache_lengths():
    # opset 24: K/V hold a 64-slot cache of which nonpad_kv_seqlen slots are filled, per batch entry.
    q, k, v = qkv(3, 4, 2, 1, 64, 16)
    nonpad = np.array([1, 37, 64], np.int64)
    attention(q, k, v, nonpad=nonpad, opset=24, is_causal=1)
    mask = np.random.default_rng(8).random((3, 1, 1, 64)) < 0.8
    attention(q, k, v, mask, nonpad=nonpad, opset=24, is_causal=1)


# -- prefill and general shapes ----------------------------------------------------------------------------


# Every per-lane width (1, 2, 4, 8 values); 33/70 do not split into whole lane slices, so rows load per element.
@pytest.mark.parametrize("head_size, v_head_size", [(8, 8), (40, 24), (128, 100), (256, 200), (33, 70)])
def test_prefill_causal_head_sizes(head_size, v_head_size):
    q, k, v = qkv(1, 2, 2, 9, 9, head_size, v_head_size, layout=3)
    attention(q, k, v, is_causal=1, q_num_heads=2, kv_num_heads=2)


@pytest.mark.parametrize("head_size", [128, 256])  # 8- and 16-byte vector loads of float16/bfloat16 slices
@pytest.mark.parametrize("dtype", HALVES, ids=["f16", "bf16"])
def test_decode_half_precision_wide_heads(dtype, head_size):
    q, k, v = qkv(1, 4, 1, 1, 70, head_size, dtype=dtype)
    attention(q, k, v)


def test_prefill_with_past_cross_lengths_and_many_heads_per_group():
    # 12 query heads per KV head: three blocks of 4; causal frontier offset by the 20 past keys.
    q, k, v = qkv(2, 12, 1, 5, 5, 16)
    past_key, past_value = random((2, 1, 20, 16), seed=9), random((2, 1, 20, 16), seed=10)
    attention(q, k, v, None, past_key, past_value, outputs=3, is_causal=1)


@pytest.mark.parametrize("left, right", [(3, -1), (2, 4), (-1, 1), (0, 0)])
def test_sliding_windows(left, right):
    q, k, v = qkv(2, 4, 2, 6, 6, 8)
    attention(q, k, v, opset=25, left_window_size=left, right_window_size=right)
    attention(q, k, v, opset=25, is_causal=1, left_window_size=left, right_window_size=right)


def test_softcap_and_fully_masked_rows_give_zeros():
    q, k, v = qkv(1, 2, 2, 3, 20, 8)
    mask = np.ones((3, 20), bool)
    mask[1] = False  # query row 1 sees nothing
    (y,) = attention(q, k, v, mask, softcap=1.5)
    assert not np.isnan(y).any() and np.all(y[:, :, 1] == 0)


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_qk_matmul_output(mode):
    q, k, v = qkv(2, 4, 2, 3, 4, 8)
    past_key, past_value = random((2, 2, 5, 8), seed=11), random((2, 2, 5, 8), seed=12)
    mask = np.random.default_rng(13).random((3, 9)) < 0.7
    mask[0] = False
    attention(q, k, v, mask, past_key, past_value, outputs=4, is_causal=1, softcap=2.0, qk_matmul_output_mode=mode)


def test_qk_matmul_output_half_precision():
    q, k, v = qkv(1, 2, 1, 2, 40, 8, dtype=np.float16)
    attention(q, k, v, outputs=4, qk_matmul_output_mode=3)


def test_empty_query():
    q, k, v = qkv(1, 2, 2, 0, 5, 8)
    (y,) = attention(q, k, v)
    assert y.shape == (1, 2, 0, 8)


# -- what runs on the CPU instead ----------------------------------------------------------------------------


def decline(q, k, v, mask=None, opset=23, outputs=1, **attrs) -> str:
    inputs = {"q": q, "k": k, "v": v, "mask": mask}
    if mask is None:
        inputs.pop("mask")
    return decline_reason("Attention", inputs, attrs, opset=opset, outputs=outputs)


def test_declined_configurations_fall_back_with_reasons():
    q, k, v = qkv(1, 2, 2, 1, 4, 8)
    assert "softmax_precision=11" in decline(q, k, v, softmax_precision=11)
    big = qkv(1, 1, 1, 1, 4, 512)
    assert "head sizes up to 256" in decline(*big)
    with pytest.raises(InvalidGraphError, match="share type"):  # refused at load: the spec's types, checked first
        decline(q.astype(np.float16), k, v)
    assert "not int64" in decline(q, k, v, np.zeros((1, 4), np.int64))
    assert "not a scalar" in decline(q, k, v, np.array(0.5, np.float32))


def test_no_keys_give_zeros():
    q, k, v = qkv(1, 2, 2, 3, 0, 8)
    (y,) = attention(q, k, v)
    assert y.shape == (1, 2, 3, 8) and not y.any()


def test_declined_node_still_runs_on_the_cpu():
    q, k, v = qkv(1, 2, 2, 2, 4, 300)
    model = node_model("Attention", {"q": q, "k": k, "v": v}, opset=23)
    session = ort.InferenceSession(model, providers=CUDA_FIRST)
    assert [p.provider for p in session.placement()] == ["CPUExecutionProvider"]
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"q": q, "k": k, "v": v})
    np.testing.assert_allclose(session.run(None, {"q": q, "k": k, "v": v})[0], expected[0], rtol=1e-6)


def test_three_d_inputs_need_head_counts():
    t = TensorProto.FLOAT
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"])
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, [1, 2, 8]) for n in "qkv"],
                              [helper.make_tensor_value_info("y", t, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    with pytest.raises(Exception, match="q_num_heads"):
        ort.InferenceSession(model.SerializeToString(), providers=CUDA_FIRST)
