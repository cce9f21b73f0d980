"""The compiled transformer loops (Gelu, LayerNormalization, FusedMatMul's bias/Gelu/residual epilogue,
the attention softmax) against the numpy kernels and onnx.reference, and the dtypes that keep numpy."""

from __future__ import annotations

import math

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms import activations
from onnx_runtime_ep_cpu.compiled import transformer as compiled
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import activation as activation_ops
from onnx_runtime_ep_cpu.ops import linalg, normalization
from onnx_runtime_ep_cpu.ops import transformer as ops_transformer
from reference64 import assert_within, product_error_bound, unit_roundoff

RNG = np.random.default_rng(7)


def _special(x: np.ndarray) -> np.ndarray:
    values = [np.inf, -np.inf, np.nan, 0.0, -0.0, 60.0, -60.0, 1e-30]
    flat = x.reshape(-1)
    flat[: len(values)] = values[: flat.size]
    return x


# -- Gelu --------------------------------------------------------------------------------------------


def _exact_gelu(x: np.ndarray, approximate: str) -> np.ndarray:
    """Gelu in float64 without cancellation: x * Phi(x), or x * sigmoid(2 s) for the tanh form's s."""
    xd = x.astype(np.float64)
    if approximate == "none":
        return xd * 0.5 * np.vectorize(math.erfc, otypes=[np.float64])(-xd / math.sqrt(2))
    s = math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)
    with np.errstate(over="ignore"):
        return xd / (1 + np.exp(-2 * s))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", [(2, 3, 200), (5, 64), (7,), (3, 1, 5)])
def test_gelu_float32_is_accurate_and_keeps_special_values(approximate, shape):
    x = _special((RNG.standard_normal(shape) * 4).astype(np.float32))
    kernel = activation_ops.gelu(Node("Gelu", ["x"], ["y"], attrs={"approximate": approximate}, opset=20), None, 20)
    got = kernel(x)[0]
    assert got.shape == x.shape and got.dtype == x.dtype
    numpy_fn = activations.gelu_erf if approximate == "none" else activations.gelu_tanh
    with np.errstate(all="ignore"):
        want = numpy_fn(x)
    special = ~np.isfinite(x) | (np.abs(x) >= 60) | (x == 0)  # inf -> inf, -inf -> NaN, NaN, signed zeros
    np.testing.assert_array_equal(got[special], want[special])
    exact = _exact_gelu(x[~special], approximate)
    np.testing.assert_allclose(got[~special], exact, rtol=2e-6, atol=2e-7)


def test_gelu_float32_tanh_form_keeps_relative_accuracy_in_the_negative_tail():
    # 0.5 * x * (1 + tanh(s)) cancels where tanh(s) nears -1 (numpy's kernel: 13x off at x = -8); the
    # compiled loop computes x * sigmoid(2 s) instead.
    x = np.linspace(-10, -0.5, 4000, dtype=np.float32).reshape(4, 1000)
    kernel = activation_ops.gelu(Node("Gelu", ["x"], ["y"], attrs={"approximate": "tanh"}, opset=20), None, 20)
    # (atol: results below float32's normal range, x < -9.9, flush to zero)
    np.testing.assert_allclose(kernel(x)[0], _exact_gelu(x, "tanh"), rtol=2e-5, atol=1e-36)


def test_gelu_float32_whole_range_and_epilogue_forms():
    # Every operand form of the one-pass loop (bias, residual, in place) against the exact Gelu.
    x = np.linspace(-12, 12, 64 * 300, dtype=np.float32).reshape(64, 300)
    bias = (RNG.standard_normal(300) * 0.1).astype(np.float32)
    residual = RNG.standard_normal((64, 300)).astype(np.float32)
    for approximate in ("none", "tanh"):
        coefficients = activations.gelu_series(approximate, np.float32)
        exact = _exact_gelu(x + bias, approximate)
        np.testing.assert_allclose(compiled.gelu(x, coefficients, bias), exact, rtol=2e-6, atol=2e-7)
        with_residual = compiled.gelu(x, coefficients, bias, residual)
        np.testing.assert_array_equal(with_residual, compiled.gelu(x, coefficients, bias) + residual)
        inplace = x.copy()
        assert compiled.gelu(inplace, coefficients, bias, out=inplace) is inplace
        np.testing.assert_array_equal(inplace, compiled.gelu(x, coefficients, bias))


def test_gelu_float32_loop_refuses_a_series_it_has_no_loop_for():
    with pytest.raises(ValueError, match="degree 6"):
        compiled.gelu(np.ones((2, 8), np.float32), np.ones(3, np.float32))


def test_gelu_tanh_float64_compiles_and_matches():
    x = _special(RNG.standard_normal((4, 130)) * 3)
    kernel = activation_ops.gelu(Node("Gelu", ["x"], ["y"], attrs={"approximate": "tanh"}, opset=20), None, 20)
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(kernel(x)[0], activations.gelu_tanh(x))


@pytest.mark.parametrize("dtype,approximate", [(np.float16, "none"), (np.float64, "none"), (np.float16, "tanh")])
def test_gelu_other_dtypes_keep_numpy_path(monkeypatch, dtype, approximate):
    monkeypatch.setattr(compiled, "gelu", lambda *a, **k: pytest.fail("compiled path taken"))
    x = (RNG.standard_normal((3, 70)) * 2).astype(dtype)
    kernel = activation_ops.gelu(Node("Gelu", ["x"], ["y"], attrs={"approximate": approximate}, opset=20), None, 20)
    got = kernel(x)[0]
    erf = np.vectorize(math.erf)
    xd = x.astype(np.float64)
    want = 0.5 * xd * (1 + erf(xd / math.sqrt(2))) if approximate == "none" else \
        0.5 * xd * (1 + np.tanh(math.sqrt(2 / math.pi) * (xd + 0.044715 * xd ** 3)))
    assert got.dtype == dtype
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3 if dtype == np.float16 else 1e-12, atol=1e-3)


# -- LayerNormalization ------------------------------------------------------------------------------


def _layer_norm(axis=-1, epsilon=1e-5, outputs=3, stash=None):
    attrs = {"axis": axis, "epsilon": epsilon}
    if stash is not None:
        attrs["stash_type"] = stash
    node = Node("LayerNormalization", ["x", "s", "b"], ["y", "mean", "inv_std"][:outputs], attrs=attrs, opset=17)
    return normalization.layer_normalization(node, None, 17)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape,axis", [((2, 5, 256), -1), ((3, 37), 1), ((2, 3, 4, 5), 2), ((4, 9), 0), ((1, 3), -1)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_compiled_matches_numpy_path(monkeypatch, dtype, shape, axis, with_bias):
    x = (RNG.standard_normal(shape) * 3 + 1.5).astype(dtype)
    start = axis % len(shape)
    scale = RNG.standard_normal(shape[start:]).astype(dtype)
    bias = RNG.standard_normal(shape[start:]).astype(dtype) if with_bias else None
    stash = 11 if dtype == np.float64 else 1
    kernel = _layer_norm(axis, stash=stash)
    got = kernel(x, scale, bias)
    monkeypatch.setattr(normalization, "layer_norm_compiles", lambda *a: False)
    want = kernel(x, scale, bias)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=tol, atol=tol)


def test_layer_norm_compiled_handles_constant_rows_and_non_finite_values():
    x = RNG.standard_normal((4, 64)).astype(np.float32)
    x[0] = 2.0  # zero variance: epsilon alone
    x[1, 3] = np.nan
    x[2, 5] = np.inf
    scale, bias = np.ones(64, np.float32), np.zeros(64, np.float32)
    y, mean, inv_std = _layer_norm()(x, scale, bias)
    np.testing.assert_allclose(y[0], 0.0)
    np.testing.assert_allclose(inv_std[0, 0], 1 / math.sqrt(1e-5), rtol=1e-6)
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()
    np.testing.assert_allclose(mean[3, 0], x[3].mean(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["float16", "stash_differs", "broadcast_scale"])
def test_layer_norm_other_cases_keep_numpy_path(monkeypatch, case):
    monkeypatch.setattr(compiled, "layer_norm", lambda *a, **k: pytest.fail("compiled path taken"))
    x = RNG.standard_normal((3, 16)).astype(np.float16 if case == "float16" else np.float32)
    scale = np.full((1, 16) if case == "broadcast_scale" else (16,), 2.0, x.dtype)
    kernel = _layer_norm(stash=11 if case == "stash_differs" else 1)
    y = kernel(x, scale, None)[0]
    xd = x.astype(np.float64)
    want = (xd - xd.mean(-1, keepdims=True)) / np.sqrt(xd.var(-1, keepdims=True) + 1e-5) * 2
    np.testing.assert_allclose(y.astype(np.float64), want.reshape(y.shape), rtol=5e-3, atol=5e-3)


# -- FusedMatMul: the fusion and its kernel ------------------------------------------------------------


def _mlp_model(activation, residual, bias_first, dtype=TensorProto.FLOAT, rank=3):
    np_dtype = np.float32 if dtype == TensorProto.FLOAT else np.float64
    k, n = 48, 80
    shape = [2, 5, k][3 - rank:]
    out_shape = shape[:-1] + [n]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["mm"]),
             helper.make_node("Add", ["b", "mm"] if bias_first else ["mm", "b"], ["biased"])]
    last = "biased"
    if activation:
        nodes.append(helper.make_node("Gelu", [last], ["act"], approximate=activation))
        last = "act"
    inputs = [tensor_info("x", dtype, shape)]
    if residual:
        nodes.append(helper.make_node("Add", ["r", last], ["res"]))
        inputs.append(tensor_info("r", dtype, out_shape))
        last = "res"
    nodes.append(helper.make_node("Identity", [last], ["y"]))
    inits = [numpy_helper.from_array((RNG.standard_normal((k, n)) * 0.2).astype(np_dtype), "w"),
             numpy_helper.from_array(RNG.standard_normal(n).astype(np_dtype), "b")]
    model = make_model(nodes, inputs, [tensor_info("y", dtype, out_shape)], inits, opset=20)
    feeds = {"x": (RNG.standard_normal(shape) * 2).astype(np_dtype)}
    if residual:
        feeds["r"] = RNG.standard_normal(out_shape).astype(np_dtype)
    return model, feeds


@pytest.mark.parametrize("activation", [None, "none", "tanh"])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("bias_first", [False, True])
@pytest.mark.parametrize("dtype", [TensorProto.FLOAT, TensorProto.DOUBLE])
def test_matmul_bias_gelu_residual_fuses_and_matches_reference(activation, residual, bias_first, dtype):
    model, feeds = _mlp_model(activation, residual, bias_first, dtype)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert [n.op_type for n in sess.placement().nodes if n.op_type != "Identity"] == ["FusedMatMul"]
    got = sess.run(None, feeds)[0]
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    assert got.dtype == want.dtype
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_matmul_bias_fuses_for_2d_inputs_of_unknown_shape():
    model, feeds = _mlp_model("none", True, False, rank=2)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "rows"
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    assert "FusedMatMul" in [n.op_type for n in sess.placement().nodes]
    np.testing.assert_allclose(sess.run(None, feeds)[0], ReferenceEvaluator(model).run(None, feeds)[0],
                               rtol=1e-5, atol=1e-5)


def test_matmul_bias_leaves_shared_intermediates_alone():
    model, feeds = _mlp_model("none", False, False)
    model.graph.output.append(tensor_info("biased", TensorProto.FLOAT, [2, 5, 80]))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    ops = [n.op_type for n in sess.placement().nodes]
    assert "FusedMatMul" in ops and "Gelu" in ops  # the Gelu stays: its input is a graph output


def _fused(activation="none"):
    node = Node("FusedMatMul", ["a", "b", "c", "r"], ["y"], domain=FUSED_DOMAIN, attrs={"activation": activation},
                opset=1)
    return linalg.fused_matmul(node, None, 1)


# Gelu's largest slope (erf form, 1.129 at x = 1.5; the tanh form's is within 0.5% of it): how far an error
# in its input moves its output.
_GELU_SLOPE = 1.13


@pytest.mark.parametrize("activation", ["none", "gelu", "gelu_tanh"])
def test_fused_matmul_kernel_is_within_float32_error_of_the_exact_result(activation):
    """The fused product (+ bias, Gelu, + residual) and the unfused numpy kernels, each against the exact
    (float64) result within float32's error bound for the product and the Gelu kernel's own accuracy."""
    a = _special((RNG.standard_normal((3, 4, 16)) * 3).astype(np.float32))
    b = RNG.standard_normal((16, 96)).astype(np.float32)
    bias, residual = RNG.standard_normal(96).astype(np.float32), RNG.standard_normal((3, 4, 96)).astype(np.float32)
    gelu = {"gelu": "none", "gelu_tanh": "tanh"}.get(activation)
    with np.errstate(all="ignore"):
        exact = a.astype(np.float64) @ b.astype(np.float64) + bias
        bound = product_error_bound(a, b, addends=(bias,))
        y = np.matmul(a, b) + bias
        if gelu is not None:
            y = activation_ops.gelu(Node("Gelu", ["x"], ["y"], attrs={"approximate": gelu}, opset=20), None, 20)(y)[0]
            exact = _exact_gelu(exact, gelu)
            bound = _GELU_SLOPE * bound + 2e-6 * np.abs(exact) + 2e-7  # the Gelu kernel's accuracy, tested above
        with_residual = exact + residual
        bound_residual = bound + 2 * unit_roundoff(np.float32) * (np.abs(exact) + np.abs(residual))
        assert_within(_fused(activation)(a, b, bias, residual)[0], with_residual, bound_residual, "fused, residual")
        assert_within(_fused(activation)(a, b, bias)[0], exact, bound, "fused")
        assert_within(y + residual, with_residual, bound_residual, "unfused, residual")
        assert_within(y, exact, bound, "unfused")


def test_fused_matmul_broadcasting_residual_and_integer_inputs_take_numpy_path(monkeypatch):
    monkeypatch.setattr(compiled, "add_bias_residual", lambda *a, **k: pytest.fail("compiled path taken"))
    a, b = RNG.standard_normal((2, 3, 8)).astype(np.float32), RNG.standard_normal((8, 5)).astype(np.float32)
    bias, residual = RNG.standard_normal(5).astype(np.float32), RNG.standard_normal((1, 5)).astype(np.float32)
    np.testing.assert_allclose(_fused()(a, b, bias, residual)[0], a @ b + bias + residual, rtol=1e-6, atol=1e-6)
    ai, bi = np.arange(6, dtype=np.int32).reshape(2, 3), np.arange(12, dtype=np.int32).reshape(3, 4)
    bias_i = np.arange(4, dtype=np.int32)
    np.testing.assert_array_equal(_fused()(ai, bi, bias_i)[0], ai @ bi + bias_i)


def test_fused_matmul_rejects_unknown_activation():
    with pytest.raises(Exception, match="activation"):
        _fused("swish")


# -- Attention ---------------------------------------------------------------------------------------


def _attention(shapes, opset=23, **attrs):
    names = ["q", "k", "v", "mask"][: len(shapes)]
    node = Node("Attention", names, ["y", "present_key", "present_value"], attrs=attrs, opset=opset)
    return ops_transformer._Attention(node, shapes, opset)


def _no_compiled(attention):
    attention.compiled = attention.few = None
    return attention


def _qkv(batch, q_heads, kv_heads, q_len, kv_len, size, rank):
    def make(heads, length):
        x = RNG.standard_normal((batch, length, heads, size)).astype(np.float32)
        return x.reshape(batch, length, heads * size) if rank == 3 else x.transpose(0, 2, 1, 3)

    return make(q_heads, q_len), make(kv_heads, kv_len), make(kv_heads, kv_len)


def session_attention_matches_reference(q, k, v, **attrs):
    """One Attention node over 3-D q, k, v (``attrs``: its heads, causality) through a session, as a user runs
    it, against onnx's reference evaluator."""
    nodes = [helper.make_node("Attention", ["q", "k", "v"], ["y"], **attrs)]
    inputs = [tensor_info(n, shape=list(a.shape)) for n, a in (("q", q), ("k", k), ("v", v))]
    model = make_model(nodes, inputs, [tensor_info("y", shape=list(q.shape))], opset=23)
    feeds = {"q": q, "k": k, "v": v}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    np.testing.assert_allclose(sess.run(None, feeds)[0], ReferenceEvaluator(model).run(None, feeds)[0],
                               rtol=1e-5, atol=1e-6)


def non_finite_values_spread_as_in_the_numpy_path(q, k, v, calls, nan_query) -> np.ndarray:
    """A NaN key (in KV head 1) and an infinite value (head 0) through the path whose results ``calls``
    records, against the numpy path: NaN in the same places, the rest close; then a NaN query (at index
    ``nan_query``) leaves its row without a finite score, which that path hands over (None) and the
    general path decides. Returns the first result."""
    k[0, 1, 7, 3] = np.nan
    v[0, 0, 9, 0] = np.inf
    shapes = [q.shape, k.shape, v.shape]
    got = _attention(shapes)(q, k, v)[0]
    want = _no_compiled(_attention(shapes))(q, k, v)[0]
    assert len(calls) == 1 and calls[0][0] is got and np.isnan(got).any()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5)
    q[nan_query] = np.nan
    second = _attention(shapes)(q, k, v)[0]
    assert calls[1] is None
    np.testing.assert_allclose(second, _no_compiled(_attention(shapes))(q, k, v)[0], rtol=2e-5, atol=1e-5)
    return got


MASKS = ["none", "2d", "4d", "causal_attr", "row_masked", "broadcast_row", "bool"]


def _mask(kind, q_len, kv_len):
    if kind in ("none", "causal_attr"):
        return None
    if kind == "bool":
        return RNG.random((q_len, kv_len)) > 0.3
    if kind == "broadcast_row":
        return RNG.standard_normal((1, kv_len)).astype(np.float32)
    mask = np.triu(np.full((q_len, kv_len), -np.inf, np.float32), 1 + kv_len - q_len)
    mask += RNG.standard_normal((q_len, kv_len)).astype(np.float32)
    if kind == "row_masked":
        mask[q_len // 2] = -np.inf  # a query that sees no key: zeros, decided by the general path
    return mask.reshape(1, 1, q_len, kv_len) if kind == "4d" else mask


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("geometry", [(1, 4, 4, 16, 16, 8, 4), (2, 4, 2, 5, 9, 8, 3), (1, 6, 3, 1, 17, 4, 4),
                                      (2, 4, 2, 70, 75, 8, 4), (1, 2, 1, 100, 100, 16, 3)])  # last two: row blocks
def test_attention_compiled_matches_numpy_paths(mask_kind, geometry):
    compiled_and_numpy_attention(mask_kind, geometry, atol=2e-6)


def compiled_and_numpy_attention(mask_kind, geometry, atol):
    """Attention of a geometry (batch, query heads, KV heads, queries, keys, head size, rank) and mask kind
    through the compiled paths and the numpy path, compared output by output."""
    batch, q_heads, kv_heads, q_len, kv_len, size, rank = geometry
    q, k, v = _qkv(batch, q_heads, kv_heads, q_len, kv_len, size, rank)
    mask = _mask(mask_kind, q_len, kv_len)
    attrs = {"q_num_heads": q_heads, "kv_num_heads": kv_heads} if rank == 3 else {}
    if mask_kind == "causal_attr":
        attrs["is_causal"] = 1
    shapes = [q.shape, k.shape, v.shape] + ([] if mask is None else [mask.shape])
    args = (q, k, v) if mask is None else (q, k, v, mask)
    got = _attention(shapes, scale=0.3, **attrs)(*args)
    want = _no_compiled(_attention(shapes, scale=0.3, **attrs))(*args)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=atol)


def test_attention_row_blocks_skip_hidden_keys_and_defer_hidden_blocks():
    q, k, v = _qkv(1, 2, 2, 96, 96, 8, 4)
    mask = np.zeros((96, 96), np.float32)
    mask[:, 40:] = -np.inf  # no row sees a key past 40: every block's scores stop there
    mask[70:, 20:] = -np.inf
    shapes = [q.shape, k.shape, v.shape, mask.shape]
    assert compiled.key_extents(mask, 32, 200.0).tolist() == [40, 40, 40]
    want = _no_compiled(_attention(shapes))(q, k, v, mask)[0]
    np.testing.assert_allclose(_attention(shapes)(q, k, v, mask)[0], want, rtol=2e-5, atol=2e-6)
    mask[64:] = -np.inf  # rows that see no key hide nothing; they output zeros, through the general path
    assert compiled.key_extents(mask, 32, 200.0).tolist() == [40, 40, 96]
    got = _attention(shapes)(q, k, v, mask)[0]
    np.testing.assert_array_equal(got[:, :, 64:], 0)
    np.testing.assert_allclose(got, _no_compiled(_attention(shapes))(q, k, v, mask)[0], rtol=2e-5, atol=2e-6)


def test_key_extents_hide_keys_far_enough_below_the_row_peak():
    mask = np.zeros((64, 50), np.float32)
    mask[:, 30:] = -1e9
    mask[32:, 20:30] = -300  # 300 below the peak: hidden by a gap of 200, not by one of 400
    mask[5, 45] = np.nan  # NaN hides nothing
    assert compiled.key_extents(mask, 32, 200.0).tolist() == [46, 20]
    assert compiled.key_extents(mask, 32, 400.0).tolist() == [46, 30]
    assert compiled.key_extents(mask, 32, np.inf).tolist() == [50, 50]
    mask[32:] += 1e9  # large-magnitude masks: the gap grows with float32's rounding at the peak
    mask[32:, 20:30] = 1e9 - 200
    assert compiled.key_extents(mask, 32, 150.0).tolist()[1] == 30


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # the numpy path on an infinite query
@pytest.mark.parametrize("fill", [-1e9, -1e4, -60.0])
def test_attention_finite_causal_mask_skips_keys_only_when_weights_vanish(fill):
    q, k, v = _qkv(1, 2, 2, 96, 96, 8, 4)
    mask = np.where(np.tril(np.ones((96, 96), bool)), np.float32(0), np.float32(fill))
    shapes = [q.shape, k.shape, v.shape, mask.shape]
    attention = _attention(shapes)
    gap = attention._hiding_gap(np.ascontiguousarray(q), np.ascontiguousarray(k.swapaxes(-1, -2)))
    assert (compiled.key_extents(mask, 32, gap).tolist() == [32, 64, 96]) == (fill < -gap)
    want = _no_compiled(_attention(shapes))(q, k, v, mask)[0]
    np.testing.assert_allclose(attention(q, k, v, mask)[0], want, rtol=2e-5, atol=2e-6)
    q[0, 0, 3, 1] = np.inf  # unbounded scores: nothing is hidden, NaN/inf spread as in the numpy paths
    assert attention._hiding_gap(np.ascontiguousarray(q), np.ascontiguousarray(k.swapaxes(-1, -2))) == np.inf
    got, want = attention(q, k, v, mask)[0], _no_compiled(_attention(shapes))(q, k, v, mask)[0]
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


def test_attention_compiled_matches_onnx_reference():
    q, k, v = _qkv(1, 2, 2, 6, 6, 8, 4)
    mask = _mask("2d", 6, 6)
    nodes = [helper.make_node("Attention", ["q", "k", "v", "mask"], ["y"])]
    inputs = [tensor_info(n, shape=list(a.shape)) for n, a in (("q", q), ("k", k), ("v", v), ("mask", mask))]
    model = make_model(nodes, inputs, [tensor_info("y", shape=list(q.shape))], opset=23)
    feeds = {"q": np.ascontiguousarray(q), "k": np.ascontiguousarray(k), "v": np.ascontiguousarray(v), "mask": mask}
    sess = ort.InferenceSession(model.SerializeToString(), providers=["cpu"])
    np.testing.assert_allclose(sess.run(None, feeds)[0], ReferenceEvaluator(model).run(None, feeds)[0],
                               rtol=1e-5, atol=1e-6)


def test_attention_compiled_path_skips_other_dtypes_and_options():
    q, k, v = _qkv(1, 2, 2, 4, 4, 8, 4)
    assert _attention([q.shape, k.shape, v.shape], softcap=2.0).compiled is None
    assert _attention([q.shape, k.shape, v.shape], softmax_precision=11).compiled is None
    attention = _attention([q.shape, k.shape, v.shape])
    assert attention.compiled is not None
    y64 = attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))[0]
    assert y64.dtype == np.float64
    np.testing.assert_allclose(y64, attention(q, k, v)[0], rtol=1e-5, atol=1e-6)


# -- the loops themselves ------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 64, 131])
def test_row_max_and_sum(n):
    row = RNG.standard_normal(n).astype(np.float32)
    assert compiled.row_max(row) == (row.max() if n else -np.inf)
    np.testing.assert_allclose(compiled.row_sum(row), row.astype(np.float64).sum(), rtol=1e-5, atol=1e-5)
    if n > 2:
        row[n // 2] = np.nan  # ignored by the maximum (as np.fmax), spread by the sum
        assert compiled.row_max(row) == np.nanmax(row)
        assert np.isnan(compiled.row_sum(row))


def test_largest_row_and_column_norms():
    x = RNG.standard_normal((3, 5, 7)).astype(np.float32)
    rows = np.sqrt((x.astype(np.float64) ** 2).sum(axis=-1))
    columns = np.sqrt((x.astype(np.float64) ** 2).sum(axis=-2))
    np.testing.assert_allclose(compiled.largest_row_norm(x.reshape(-1, 7)), rows.max(), rtol=1e-12)
    np.testing.assert_allclose(compiled.largest_column_norm(x), columns.max(), rtol=1e-12)
    for bad in (np.nan, np.inf, -np.inf):
        y = x.copy()
        y[2, 4, 6] = bad
        assert compiled.largest_row_norm(y.reshape(-1, 7)) == np.inf
        assert compiled.largest_column_norm(y) == np.inf


def test_mask_and_shift_reports_rows_without_finite_maximum():
    scores = RNG.standard_normal((2, 3, 5)).astype(np.float32)
    assert compiled.mask_and_shift_(scores.copy(), np.float32(0.5), np.zeros((3, 5), np.float32), 0)
    mask = np.zeros((4, 6), np.float32)
    mask[2] = -np.inf
    assert not compiled.mask_and_shift_(scores.copy(), np.float32(0.5), mask, 0)
    assert compiled.mask_and_shift_(scores.copy(), np.float32(0.5), mask, 1) is False
    shifted = scores.copy()
    assert compiled.mask_and_shift_(shifted, np.float32(0.5), np.vstack([mask[3:], mask[:1], mask[1:2]]), 0)
    np.testing.assert_allclose(shifted.max(axis=-1), 0)
    scores[1, 0, 2] = np.inf
    assert not compiled.mask_and_shift_(scores, np.float32(0.5), np.empty((0, 0), np.float32), 0)
