"""The packed float32 MatMul (compiled/matmul.py): many rows times constant weights, with FusedMatMul's
bias, Gelu and residual fused, split by column panels across the helper threads; against float64
numpy, the unfused kernels and onnx's reference evaluator."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import make_model, record_calls, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms import activations, products
from onnx_runtime_ep_cpu.compiled import gemm
from onnx_runtime_ep_cpu.compiled import transformer as compiled
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import activation as activation_ops
from onnx_runtime_ep_cpu.ops import linalg
from test_compiled_transformer import _exact_gelu
from test_few_row_products import _matmul

pytestmark = pytest.mark.skipif(not gemm.AVAILABLE, reason="the packed MatMul needs an AVX-512 host")
RNG = np.random.default_rng(41)


@pytest.fixture(autouse=True)
def packed_at_every_size(knobs):
    """These tests are about the packed product itself: products below the packed_macs knob take it too."""
    knobs(packed_macs=1)


def _constant(array: np.ndarray) -> np.ndarray:
    """An initializer as kernels see it: a read-only array."""
    array = np.array(array)
    array.flags.writeable = False
    return array


def _fused(activation="none"):
    node = Node("FusedMatMul", ["a", "b", "c", "r"], ["y"], domain=FUSED_DOMAIN, attrs={"activation": activation},
                opset=1)
    return linalg.fused_matmul(node, None, 1)


# (a's shape, b's shape): row counts that are whole 12- and 8-row tiles and ones that leave 1-11 rows
# over, leading dimensions, depths from 1 up, widths with and without 32-column tails.
SHAPES = [
    ((9, 70), (70, 40)),
    ((128, 256), (256, 768)),
    ((1, 128, 256), (256, 1000)),
    ((2, 10, 64), (64, 33)),
    ((16, 1), (1, 5)),
    ((21, 300), (300, 32)),
    ((131, 40), (40, 97)),
    ((9, 3, 17), (17, 64)),
]


@pytest.mark.parametrize("a_shape,b_shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_packed_matmul_matches_float64(monkeypatch, kernel_threads, a_shape, b_shape):
    a = RNG.standard_normal(a_shape, dtype=np.float32)
    b = _constant(RNG.standard_normal(b_shape, dtype=np.float32))
    taken = record_calls(monkeypatch, products.PackedProduct)
    y = _matmul(a, b)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    assert taken and y.dtype == np.float32 and y.shape == expected.shape and y.flags.c_contiguous
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.sqrt(b_shape[0]))


@pytest.mark.parametrize("activation", ["none", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("rows", [128, 45])
def test_fused_matmul_is_the_unfused_kernels_bit_for_bit(monkeypatch, kernel_threads, activation, rows):
    """FusedMatMul's epilogue (bias, Gelu, residual) on the packed product gives the bits of the packed
    MatMul kernel followed by the Add and Gelu nodes' kernels."""
    a = (RNG.standard_normal((rows, 96)) * 3).astype(np.float32)
    b = _constant(RNG.standard_normal((96, 200), dtype=np.float32))
    bias = _constant(RNG.standard_normal(200, dtype=np.float32))
    residual = RNG.standard_normal((rows, 200), dtype=np.float32)
    taken = record_calls(monkeypatch, products.PackedProduct)
    y = _matmul(a, b) + bias
    gelu = {"gelu": "none", "gelu_tanh": "tanh"}.get(activation)
    if gelu is not None:
        y = activation_ops.gelu(Node("Gelu", ["x"], ["y"], attrs={"approximate": gelu}, opset=20), None, 20)(y)[0]
    np.testing.assert_array_equal(_fused(activation)(a, b, bias, residual)[0], y + residual)
    np.testing.assert_array_equal(_fused(activation)(a, b, bias)[0], y)
    assert len(taken) == 3


def test_gelu_rows_match_the_exact_gelu(kernel_threads):
    a = RNG.standard_normal((50, 64), dtype=np.float32)
    b = _constant(RNG.standard_normal((64, 70), dtype=np.float32) * 0.5)
    bias = _constant(RNG.standard_normal(70, dtype=np.float32))
    (y,) = _fused("gelu")(a, b, bias)
    u = a.astype(np.float64) @ b.astype(np.float64) + bias
    np.testing.assert_allclose(y, _exact_gelu(u, "none"), rtol=1e-4, atol=1e-5)


def test_weights_are_packed_once_per_constant_array(monkeypatch):
    from onnx_runtime_ep_cpu.compiled import matmul

    packs = []
    real = matmul.pack_columns
    monkeypatch.setattr(matmul, "pack_columns", lambda w: packs.append(w) or real(w))
    kernel = linalg.matmul(Node("MatMul", ["a", "b"], ["y"], opset=13), None, 13)
    a = RNG.standard_normal((20, 8), dtype=np.float32)
    b = _constant(RNG.standard_normal((8, 6), dtype=np.float32))
    for _ in range(3):
        np.testing.assert_allclose(kernel(a, b)[0], a @ b, rtol=1e-5, atol=1e-5)
    assert len(packs) == 1
    other = _constant(b * 2)
    np.testing.assert_allclose(kernel(a, other)[0], a @ other, rtol=1e-5, atol=1e-5)
    assert len(packs) == 2


def test_fed_weights_few_rows_float64_and_batched_weights_stay_on_blas(monkeypatch):
    taken = record_calls(monkeypatch, products.PackedProduct)
    for a, b in [(np.ones((20, 4), np.float32), np.ones((4, 3), np.float32)),  # writeable: a fed input
                 (np.ones((20, 4), np.float64), _constant(np.ones((4, 3), np.float64))),
                 (np.ones((2, 20, 4), np.float32), _constant(np.ones((2, 4, 3), np.float32))),
                 (np.ones((8, 4), np.float32), _constant(np.ones((4, 3), np.float32)))]:  # few rows: gemv.py's
        np.testing.assert_array_equal(_matmul(a, b), a @ b)
    assert not taken


def test_mismatched_depth_is_numpys_error_not_a_read_past_the_weights(monkeypatch):
    taken = record_calls(monkeypatch, products.PackedProduct)
    with pytest.raises(ValueError, match="mismatch"):
        _matmul(np.ones((20, 5), np.float32), _constant(np.ones((4, 3), np.float32)))
    assert not taken


def test_a_prefill_shaped_model_matches_the_reference(monkeypatch, knobs):
    """Through a session, as a user runs it: 40 tokens through MatMul + bias + Gelu + MatMul + bias +
    residual (fused into FusedMatMul nodes) with constant weights."""
    import onnx_runtime as ort

    knobs(split_macs=1)
    w1 = RNG.standard_normal((64, 256), dtype=np.float32) * 0.1
    w2 = RNG.standard_normal((256, 64), dtype=np.float32) * 0.1
    b1, b2 = RNG.standard_normal(256, dtype=np.float32), RNG.standard_normal(64, dtype=np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Gelu", ["hb"], ["g"]), helper.make_node("MatMul", ["g", "w2"], ["o"]),
             helper.make_node("Add", ["o", "b2"], ["ob"]), helper.make_node("Add", ["ob", "x"], ["y"])]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [1, 40, 64])],
                       [tensor_info("y", TensorProto.FLOAT, [1, 40, 64])],
                       [numpy_helper.from_array(v, n) for n, v in (("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2))],
                       opset=20)
    taken = record_calls(monkeypatch, products.PackedProduct)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert [n.op_type for n in session.placement().nodes] == ["FusedMatMul", "FusedMatMul"]
    for _ in range(3):
        x = RNG.standard_normal((1, 40, 64), dtype=np.float32)
        (y,) = session.run(None, {"x": x})
        (expected,) = ReferenceEvaluator(model).run(None, {"x": x})
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    assert len(taken) == 6


def test_compiled_gelu_is_what_the_fused_epilogue_runs():
    """The epilogue's Gelu is compiled.gelu_float32_ (the Gelu node's loop), per row of the product."""
    a = RNG.standard_normal((16, 8), dtype=np.float32)
    b = _constant(RNG.standard_normal((8, 40), dtype=np.float32))
    bias = _constant(RNG.standard_normal(40, dtype=np.float32))
    product = _matmul(a, b)
    coefficients = activations.gelu_series("tanh", np.float32)
    np.testing.assert_array_equal(_fused("gelu_tanh")(a, b, bias)[0], compiled.gelu(product, coefficients, bias))


def test_a_part_no_helper_starts_is_taken_back_by_the_caller():
    """A part posted to a helper that does not start it (here: a mailbox no thread serves, as a helper
    descheduled behind another process's spinning threads) is run by the caller once its own part is
    done, in the helper's place, instead of waiting for it: its tasks claimed, then the job itself taken back."""
    import threading

    from onnx_runtime_ep_cpu.compiled import jobs, matmul, workers

    a = RNG.standard_normal((40, 64), dtype=np.float32)
    b = RNG.standard_normal((64, 100), dtype=np.float32)
    packed, depth, n = matmul.pack_columns(b), 64, 100
    scratch = np.empty(matmul.scratch_size(depth), dtype=np.float32)
    mailboxes = np.zeros((1, workers.MAILBOX_SIZE), dtype=np.int64)  # served by no thread
    mailboxes[0, workers.BUFFER], mailboxes[0, workers.BUFFER_SIZE] = scratch.ctypes.data, scratch.size
    states = np.zeros(1, dtype=np.int64)
    y = np.full(40 * n, np.nan, dtype=np.float32)
    empty = np.empty(0, dtype=np.float32)
    arguments = (a.reshape(-1), depth, 40, depth, packed, gemm.packed_offsets(depth), empty, y, n, empty, 0, empty,
                 np.array([0, 2, packed.shape[0]], dtype=np.int64), np.array([0, 1, 2], dtype=np.int64),
                 np.zeros(2, dtype=np.int64), workers.local_mailbox(matmul.scratch_size(depth)), mailboxes, states,
                 jobs.MATMUL.address())
    caller = threading.Thread(target=jobs.split_matmul, args=arguments, daemon=True)
    caller.start()
    caller.join(timeout=30)
    assert not caller.is_alive(), "the caller waited for a helper that never started its part"
    assert states[0] == 0 and mailboxes[0, workers.CLAIMED] == mailboxes[0, workers.POSTED] == 1
    np.testing.assert_allclose(y.reshape(40, n), a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("c_shape", [None, (60,), (1, 60), (20, 60)])
def test_gemm_of_a_batch_runs_packed_with_c_as_bias_or_residual(monkeypatch, kernel_threads, trans_b, c_shape):
    """A classifier's Gemm over a batch (transB weights, C per column or whole) through the packed product."""
    a = RNG.standard_normal((20, 50), dtype=np.float32)
    w = _constant(RNG.standard_normal((60, 50) if trans_b else (50, 60), dtype=np.float32))
    c = None if c_shape is None else _constant(RNG.standard_normal(c_shape, dtype=np.float32))
    node = Node("Gemm", ["a", "b", "c"], ["y"], attrs=dict(transB=int(trans_b)), opset=13)
    kernel = linalg.gemm_7(node, None, 13)
    taken = record_calls(monkeypatch, products.PackedProduct)
    for _ in range(2):  # the second call finds the weights packed
        (y,) = kernel(a, w) if c is None else kernel(a, w, c)
        expected = a.astype(np.float64) @ (w.T if trans_b else w).astype(np.float64) + (0 if c is None else c)
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4)
    assert len(taken) == 2 and len(taken[0]._weights._entry[1]) == 1 and taken[0]._weights._entry[1][0] is w


def test_gemm_with_trans_a_runs_packed(monkeypatch, kernel_threads):
    a = RNG.standard_normal((50, 20), dtype=np.float32)  # A^T: 20 rows of 50
    w = _constant(RNG.standard_normal((50, 60), dtype=np.float32))
    taken = record_calls(monkeypatch, products.PackedProduct)
    (y,) = linalg.gemm_7(Node("Gemm", ["a", "b"], ["y"], attrs=dict(transA=1), opset=13), None, 13)(a, w)
    np.testing.assert_allclose(y, a.T.astype(np.float64) @ w, rtol=1e-5, atol=1e-4)
    assert len(taken) == 1


def test_gemm_with_scaling_stays_on_blas(monkeypatch):
    a = RNG.standard_normal((20, 50), dtype=np.float32)
    w = _constant(RNG.standard_normal((50, 60), dtype=np.float32))
    c = _constant(RNG.standard_normal(60, dtype=np.float32))
    taken = record_calls(monkeypatch, products.PackedProduct)
    for attrs in (dict(alpha=2.0), dict(beta=0.5)):
        (y,) = linalg.gemm_7(Node("Gemm", ["a", "b", "c"], ["y"], attrs=attrs, opset=13), None, 13)(a, w, c)
        want = attrs.get("alpha", 1.0) * (a.astype(np.float64) @ w) + attrs.get("beta", 1.0) * c
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-4)
    assert not taken


@pytest.mark.parametrize("subtasks", [1, 4])
@pytest.mark.parametrize("panels,threads", [(24, 2), (7, 2), (3, 2), (1, 1), (10, 3)])
def test_each_threads_share_of_panels_is_cut_into_claimed_tasks(monkeypatch, panels, threads, subtasks, knobs):
    """Thread t's even share of the panels, as up to product_tasks_per_thread tasks in order (jobs.MATMUL claims
    them one at a time: a thread done first takes what another has not started)."""
    knobs(product_tasks_per_thread=subtasks)
    bounds, ranges = products.PackedProduct()._tasks(panels, threads)
    assert bounds[0] == 0 and bounds[-1] == panels and (np.diff(bounds) > 0).all()
    assert len(ranges) == threads + 1 and ranges[0] == 0 and ranges[-1] == len(bounds) - 1
    for t in range(threads):
        share = bounds[ranges[t]:ranges[t + 1] + 1]
        assert share[0] == panels * t // threads and share[-1] == panels * (t + 1) // threads
        assert 1 <= len(share) - 1 <= subtasks and len(share) - 1 == min(subtasks, share[-1] - share[0])


def test_products_cut_into_more_tasks_give_the_same_bits(monkeypatch, kernel_threads, knobs):
    """However the shares are cut into claimed tasks, each output column's sum runs k = 0 .. K-1 in one
    panel: the same bits as the shares whole."""
    a = RNG.standard_normal((40, 96), dtype=np.float32)
    b = _constant(RNG.standard_normal((96, 300), dtype=np.float32))
    results = []
    for subtasks in (1, 4):
        knobs(product_tasks_per_thread=subtasks)
        results.append(_matmul(a, b))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_allclose(results[1], a.astype(np.float64) @ b, rtol=1e-5, atol=1e-4)
