"""Few-row float32 products (compiled/gemv.py): a decode step's MatMuls and a CNN's classifier Gemm,
split across the helper threads and posted from compiled code (workers.offer/collect), against float64
numpy and onnx's reference evaluator."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
from model_helpers import record_calls
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms import products
from onnx_runtime_ep_cpu.compiled import gemm, gemv
from onnx_runtime_ep_cpu.ops import linalg

pytestmark = pytest.mark.skipif(not gemm.AVAILABLE, reason="the few-row products run on AVX-512 hosts only")


@pytest.fixture(autouse=True)
def few_rows_at_every_size(knobs, monkeypatch):
    """These tests are about gemv.py's loops: products below the few_rows_blas_macs knob take them too, and so do
    constant weights (which compiled/few_rows.py's tiles take otherwise: test_few_row_tiles.py)."""
    knobs(few_rows_blas_macs=1)
    monkeypatch.setattr(products.PackedProduct, "takes_few", staticmethod(lambda a, b: False))


def _taken(monkeypatch) -> list:
    """Records each few-row product computed by gemv.py."""
    return record_calls(monkeypatch, products.Split)


def _matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    (y,) = linalg.matmul(Node("MatMul", ["a", "b"], ["y"], opset=13), None, 13)(a, b)
    return y


# (a's shape, b's shape): one to eight rows, leading dimensions, depths below, at and across the
# 128-row blocks of k (with tails of 1-3 rows), widths with and without 16-column tails.
SHAPES = [
    ((1, 256), (256, 128)),
    ((1, 1, 768), (768, 256)),
    ((1, 1, 256), (256, 1000)),
    ((2, 3, 130), (130, 33)),
    ((8, 257), (257, 64)),
    ((1, 1), (1, 5)),
    ((4, 3), (3, 200)),
    ((1, 129), (129, 16)),
]


@pytest.mark.parametrize("a_shape,b_shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_few_row_matmul_matches_float64(monkeypatch, kernel_threads, a_shape, b_shape):
    rng = np.random.default_rng(21)
    a = rng.standard_normal(a_shape, dtype=np.float32)
    b = rng.standard_normal(b_shape, dtype=np.float32)
    taken = _taken(monkeypatch)
    y = _matmul(a, b)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    assert taken and y.dtype == np.float32 and y.shape == expected.shape and y.flags.c_contiguous
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5 * np.sqrt(b_shape[0]))


@pytest.mark.parametrize("rows", [3, 37], ids=["few rows (gemv.py)", "many rows (matmul.py)"])
def test_results_do_not_depend_on_the_thread_count(monkeypatch, rows, knobs):
    """Blocks of k are summed in block order wherever they were computed (few rows), each output's sum runs
    k = 0 .. K-1 whichever thread has its panel (many): the same bits from one thread, two, or three
    (whose third part runs on the caller)."""
    knobs(gemv_split_weights=1)
    knobs(split_macs=1)
    rng = np.random.default_rng(22)
    a = rng.standard_normal((rows, 700), dtype=np.float32) * 100
    b = rng.standard_normal((700, 300), dtype=np.float32)
    b.flags.writeable = False  # an initializer (many rows of float32 run compiled/matmul.py against constants)
    results = []
    for count in (1, 2, 3):
        knobs(threads=count)
        results.append(_matmul(a, b))
    np.testing.assert_array_equal(results[0], results[1])
    np.testing.assert_array_equal(results[0], results[2])


def test_transposed_weights_and_strided_inputs(monkeypatch, kernel_threads):
    """Gemm's transB weights (rows of w per output) and non-contiguous inputs (copied first)."""
    rng = np.random.default_rng(23)
    a = rng.standard_normal((300, 2), dtype=np.float32).T  # a transposed view
    w = rng.standard_normal((90, 300), dtype=np.float32)
    node = Node("Gemm", ["a", "b"], ["y"], attrs=dict(transB=1), opset=13)
    taken = _taken(monkeypatch)
    (y,) = linalg.gemm_7(node, None, 13)(a, w)
    assert taken
    np.testing.assert_allclose(y, a.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4)
    (y,) = linalg.gemm_7(Node("Gemm", ["a", "b"], ["y"], attrs={}, opset=13), None, 13)(a, w.T)  # strided b
    np.testing.assert_allclose(y, a.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-5, atol=1e-4)


def test_mismatched_depth_is_numpys_error_not_a_read_past_the_weights(monkeypatch):
    taken = _taken(monkeypatch)
    with pytest.raises(ValueError, match="mismatch"):
        _matmul(np.ones((1, 5), np.float32), np.ones((4, 3), np.float32))
    assert not taken


def test_many_rows_float64_and_batched_weights_stay_on_blas(monkeypatch):
    taken = _taken(monkeypatch)
    for a, b in [(np.ones((9, 4), np.float32), np.ones((4, 3), np.float32)),
                 (np.ones((1, 4), np.float64), np.ones((4, 3), np.float64)),
                 (np.ones((2, 1, 4), np.float32), np.ones((2, 4, 3), np.float32))]:
        np.testing.assert_array_equal(_matmul(a, b), a @ b)
    assert not taken


def test_a_decode_step_shaped_model_matches_the_reference(monkeypatch, knobs):
    """Through a session, as a user runs it: one token's hidden state through constant projections."""
    import onnx_runtime as ort

    knobs(gemv_split_weights=1)
    rng = np.random.default_rng(24)
    w1 = rng.standard_normal((64, 96), dtype=np.float32) * 0.1
    w2 = rng.standard_normal((96, 64), dtype=np.float32) * 0.1
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["y"])],
        "decode", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 64])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    taken = _taken(monkeypatch)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for _ in range(3):
        x = rng.standard_normal((1, 1, 64), dtype=np.float32)
        (y,) = session.run(None, {"x": x})
        (expected,) = ReferenceEvaluator(model).run(None, {"x": x})
        np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)
    assert len(taken) == 6


def test_a_sleeping_helper_is_skipped_and_woken_and_a_late_sleeper_runs_its_part(monkeypatch):
    """Posting from compiled code: a helper found asleep is skipped (the caller runs its part) and woken
    (from compiled code, a futex) for later jobs; a part posted to a helper that fell asleep just as it
    came is run once the waker wakes it."""
    from onnx_runtime_ep_cpu.compiled import jobs, workers

    monkeypatch.setattr(workers, "_SPIN_SECONDS", 0.02)
    pool = workers.Helpers(1)
    mailbox = pool.mailboxes[0]
    rng = np.random.default_rng(25)
    a = rng.standard_normal((2, 300), dtype=np.float32)
    w = rng.standard_normal((300, 64), dtype=np.float32)
    expected = a.astype(np.float64) @ w.astype(np.float64)
    blocks = -(-300 // gemv.DEPTH_BLOCK)
    runner = jobs.PRODUCT.address()

    def run() -> np.ndarray:
        sums = np.zeros((blocks, 2, 64), np.float32)
        assert pool.call(jobs.split_product, (False, a, w, sums, 1, blocks, 2), runner) is not None
        np.testing.assert_allclose(sums[0], expected, rtol=1e-5, atol=1e-4)
        return sums[0].copy()

    threading.Event().wait(0.1)  # past the spin time: the helper sleeps
    assert workers._load(mailbox, workers.SLEEPING)
    mailbox[workers.CPU] = -1
    first = run()
    assert mailbox[workers.CPU] == -1  # skipped: the caller ran both parts
    deadline = time.monotonic() + 30  # woken by that call, it takes parts within milliseconds (a loaded
    while time.monotonic() < deadline:  # machine may keep it waiting for a CPU)
        mailbox[workers.CPU] = -1
        again = run()
        if mailbox[workers.CPU] >= 0:
            break
        threading.Event().wait(0.005)
    else:
        pytest.fail("the helper never took a part")
    np.testing.assert_array_equal(again, first)

    # A late sleeper: a part posted while the helper sleeps (as when it fell asleep between offer's check
    # and the post) waits in its mailbox until wake, then runs.
    threading.Event().wait(0.1)
    assert workers._load(mailbox, workers.SLEEPING)
    sums = np.zeros((blocks, 2, 64), np.float32)
    jobs._write_product(mailbox, False, a, w, sums, 1, 0, blocks)
    mailbox[workers.RUNNER] = runner
    sequence, asleep = workers._publish(mailbox)
    assert asleep
    threading.Event().wait(0.05)
    assert workers._load(mailbox, workers.DONE) != sequence  # asleep: not run yet
    workers.wake(mailbox)
    pool._helpers[0].wait(sequence)
    gemv.sum_blocks(sums)
    np.testing.assert_array_equal(sums[0], first)


@pytest.mark.skipif(not hasattr(os, "register_at_fork"), reason="needs fork")
def test_a_forked_child_does_not_post_to_its_parents_helpers(monkeypatch, knobs):
    knobs(threads=2)
    knobs(gemv_split_weights=1)
    rng = np.random.default_rng(26)
    a = rng.standard_normal((1, 300), dtype=np.float32)
    b = rng.standard_normal((300, 40), dtype=np.float32)
    expected = _matmul(a, b)  # the split plan is cached, with the parent's helpers started
    child = os.fork()
    if child == 0:
        status = 1
        try:
            status = 0 if np.array_equal(_matmul(a, b), expected) else 3
        finally:
            os._exit(status)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.parametrize("rows,depth,columns", [(1, 1024, 1000), (3, 100, 7), (8, 33, 5), (1, 64, 4), (2, 1, 3)])
@pytest.mark.parametrize("trans_b", [True, False])
def test_few_row_gemm_matches_numpy(kernel_threads, rows, depth, columns, trans_b):
    rng = np.random.default_rng(12)
    a = rng.standard_normal((rows, depth), dtype=np.float32)
    b = rng.standard_normal((columns, depth) if trans_b else (depth, columns), dtype=np.float32)
    c = rng.standard_normal(columns, dtype=np.float32)
    node = Node("Gemm", ["a", "b", "c"], ["y"], attrs=dict(transB=int(trans_b), alpha=0.5, beta=2.0), opset=13)
    (y,) = linalg.gemm_7(node, None, 13)(a, b, c)
    expected = 0.5 * (a @ (b.T if trans_b else b)) + 2.0 * c
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4 * np.sqrt(depth))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("activation", [None, "Relu"])
def test_a_convolutional_classifier_is_a_few_row_product(monkeypatch, kernel_threads, batch, activation):
    """A 1x1 convolution over the 1x1 image global pooling leaves (DenseNet's classifier) runs as a
    few-row product, with a FusedConv's bias, residual and activation after it, as a user's session does."""
    import onnx_runtime as ort

    rng = np.random.default_rng(27)
    w = rng.standard_normal((40, 96, 1, 1), dtype=np.float32)
    b = rng.standard_normal(40, dtype=np.float32)
    nodes = [helper.make_node("GlobalAveragePool", ["x"], ["g"]), helper.make_node("Conv", ["g", "w", "b"], ["c"])]
    if activation:
        nodes += [helper.make_node("Add", ["c", "r"], ["s"]), helper.make_node(activation, ["s"], ["y"])]
    else:
        nodes[-1].output[0] = "y"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 96, 5, 5])]
    if activation:
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, [batch, 40, 1, 1]))
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    graph = helper.make_graph(nodes, "classifier", inputs, outputs,
                              [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    taken = _taken(monkeypatch)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {"x": rng.standard_normal((batch, 96, 5, 5), dtype=np.float32)}
    if activation:
        feeds["r"] = rng.standard_normal((batch, 40, 1, 1), dtype=np.float32)
    (y,) = session.run(None, feeds)
    np.testing.assert_allclose(y, ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5, atol=1e-5)
    assert len(taken) == 1 and y.shape == (batch, 40, 1, 1)


def test_a_node_reuses_its_split_only_for_the_same_constant_and_shape(monkeypatch, knobs):
    """A MatMul node keeps its last few-row product of a constant (a decode step repeats it every run)
    and skips the lookups; another shape of ``a``, another ``b``, a writable ``b`` or another thread
    count looks its product up again, and every result is the product of what was passed."""
    knobs(gemv_split_weights=1)
    knobs(threads=2)
    kernel = linalg.matmul(Node("MatMul", ["a", "b"], ["y"], opset=13), None, 13)
    lookups = []
    real = products.few_rows_split
    monkeypatch.setattr(linalg, "few_rows_split", lambda *args: lookups.append(args[0].shape) or real(*args))
    rng = np.random.default_rng(28)
    b = rng.standard_normal((300, 70), dtype=np.float32)
    b.flags.writeable = False  # an initializer
    other = rng.standard_normal((300, 70), dtype=np.float32)
    other.flags.writeable = False

    def check(a, w):
        (y,) = kernel(a, w)
        np.testing.assert_allclose(y, a.astype(np.float64) @ w.astype(np.float64), rtol=1e-5, atol=1e-4)

    steps = [((1, 1, 300), b), ((1, 1, 300), b), ((1, 1, 300), b), ((2, 300), b), ((2, 300), b), ((2, 300), other)]
    for shape, w in steps:
        check(rng.standard_normal(shape, dtype=np.float32), w)
    assert lookups == [(1, 1, 300), (2, 300), (2, 300)]
    knobs(threads=1)  # a session set another thread count: looked up again
    check(rng.standard_normal((2, 300), dtype=np.float32), other)
    assert lookups[3:] == [(2, 300)]
    writable = np.array(other)  # a fed matrix may change between runs: never kept
    check(rng.standard_normal((2, 300), dtype=np.float32), writable)
    check(rng.standard_normal((2, 300), dtype=np.float32), writable)
    assert lookups[4:] == [(2, 300), (2, 300)]
    taken = _taken(monkeypatch)
    float64 = other.astype(np.float64)
    float64.flags.writeable = False
    for _ in range(2):  # float64: declined by the lookup once, then BLAS's product is the one kept
        check(rng.standard_normal((2, 300), dtype=np.float64), float64)
    assert len(lookups) == 7 and not taken
