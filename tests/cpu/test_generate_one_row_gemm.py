"""A decoder's one-row Gemm (OPT's fc1/fc2: one token against constant weights, C a bias row) of a planned shape too
large for BLAS at every thread count takes the few-row tiles (compiled/few_rows.py) on one thread and on two; within
float32 rounding of a float64 reference, with and without transB and C."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, record_calls, tensor_info
from onnx import helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms.products import PackedProduct, gemv_host
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.ops import linalg

CPU = "CPUExecutionProvider"


def _gemm_model(rows: int, depth: int, columns: int, trans_b: bool, with_c: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    b = (rng.standard_normal((columns, depth) if trans_b else (depth, columns)) / np.sqrt(depth)).astype(np.float32)
    c = rng.standard_normal(columns).astype(np.float32)
    inputs = ["a", "b"] + (["c"] if with_c else [])
    node = helper.make_node("Gemm", inputs, ["y"], transB=int(trans_b))
    initializers = [numpy_helper.from_array(b, "b")] + ([numpy_helper.from_array(c, "c")] if with_c else [])
    model = make_model([node], [tensor_info("a", shape=[rows, depth])], [tensor_info("y", shape=[rows, columns])],
                       initializers)
    return model.SerializeToString(), b, c if with_c else None


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("with_c", [True, False])
def test_one_row_gemm_takes_the_lean_kernel_and_matches_float64(threads, trans_b, with_c, monkeypatch):
    if not gemv_host():
        pytest.skip("the few-row split runs on AVX-512 hosts only; elsewhere every one-row Gemm is BLAS's")
    calls: list[int] = []
    few = linalg.few_rows_product

    def counted(a, b, transposed):
        y = few(a, b, transposed)
        calls.append(y is not None)
        return y

    monkeypatch.setattr(linalg, "few_rows_product", counted)
    taken = record_calls(monkeypatch, PackedProduct)
    data, b, c = _gemm_model(1, 1024, 1024, trans_b, with_c)  # enough weights to split
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(data, options, providers=[CPU])
    rng = np.random.default_rng(1)
    # A process's first products are numpy's or BLAS's while the kernel loader links the compiled ones (run alone,
    # this test is such a process): the route asserted below is the one taken once they are loaded.
    session.run(None, {"a": rng.standard_normal((1, 1024)).astype(np.float32)})
    deferred.wait_ready(480)
    calls.clear()  # (taken keeps the first compiled call: later ones are the node's bound call, PackedProduct.bound)
    for _ in range(3):  # the planned shape, repeated (a decode loop's)
        a = rng.standard_normal((1, 1024)).astype(np.float32)
        y = session.run(None, {"a": a})[0]
        reference = a.astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
        if c is not None:
            reference = reference + c
        np.testing.assert_allclose(y, reference, rtol=1e-5, atol=1e-5)
    # Constant weights this large take the few-row tiles (compiled/few_rows.py) on every thread count: the few-row
    # split, which reads the weights once per row, is not asked.
    assert not calls
    assert taken and all(packed.route == ("few rows", threads) for packed in taken)


def test_rows_of_a_free_dimension_match_float64_whatever_their_count():
    data, b, c = _gemm_model(1, 256, 512, True, True)
    model = __import__("onnx").load_from_string(data)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "rows"
    model.graph.output[0].type.tensor_type.shape.dim[0].dim_param = "rows"
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=[CPU])
    rng = np.random.default_rng(2)
    for rows in (1, 3, 1, 12, 1):
        a = rng.standard_normal((rows, 256)).astype(np.float32)
        y = session.run(None, {"a": a})[0]
        np.testing.assert_allclose(y, a.astype(np.float64) @ b.T.astype(np.float64) + c, rtol=1e-5, atol=1e-5)
