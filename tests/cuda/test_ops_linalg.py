"""MatMul and Gemm on the CUDA provider (kernels/gemm.cu) against the CPU provider.

On the simulator (and on GPUs before sm_80) the shared-memory tiled kernel runs; on a real sm_80+ GPU
(ONNX_RUNTIME_CUDA_TESTS=real) the float16/bfloat16 cases run the tensor-core path.
"""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from cuda_op_harness import (
    CUDA_FIRST,
    HALVES,
    LINALG_OPS,
    check_node,
    decline_reason,
    family_cases,
    node_model,
    random,
    run_backend_case,
    tolerance,
)
from onnx_runtime import Tensor
from onnx_runtime.errors import OnnxRuntimeError

pytestmark = pytest.mark.usefixtures("cuda_driver_mode")



@pytest.mark.parametrize("name", family_cases(LINALG_OPS))
def test_backend_case(name):
    run_backend_case(name)


# -- MatMul ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("a_shape, b_shape", [
    ((70, 33), (33, 65)),          # odd sizes: partial tiles on every edge
    ((130, 40), (40, 3)),          # several row tiles, one thin column tile
    ((5, 100), (100, 7)),          # the reduction spans several slabs
    ((2, 3, 5, 7), (7, 9)),        # a shared B: the batch folds into the rows
    ((7,), (3, 7, 4)),             # 1-D A against a batch
    ((2, 3, 4, 6), (6,)),          # 1-D B
    ((9,), (9,)),                  # vector dot product: a scalar
    ((4, 6), (3, 6, 5)),           # a shared A: zero batch stride
    ((2, 1, 4, 6), (1, 3, 6, 5)),  # batches broadcast both ways: the offset table
    ((3, 2, 1, 4, 6), (2, 3, 6, 5)),
])
def test_matmul_shapes(a_shape, b_shape):
    check_node("MatMul", {"a": random(a_shape, seed=1), "b": random(b_shape, seed=2)}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("a_shape, b_shape", [((0, 5), (5, 4)), ((3, 0), (0, 4)), ((2, 0, 3), (3, 4))])
def test_matmul_empty(a_shape, b_shape):
    (y,) = check_node("MatMul", {"a": random(a_shape), "b": random(b_shape)})
    if y.size:
        assert not y.any(), "an empty reduction sums to zero"


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("a_shape, b_shape", [((67, 45), (45, 70)), ((2, 16, 40), (40, 24))])
def test_matmul_half_types(dtype, a_shape, b_shape):
    check_node("MatMul", {"a": random(a_shape, dtype, 3), "b": random(b_shape, dtype, 4)}, **tolerance(dtype))


def test_matmul_declines_integers_and_doubles():
    ints = {"a": np.ones((2, 2), np.int32), "b": np.ones((2, 2), np.int32)}
    assert "input 0 is int32" in decline_reason("MatMul", ints)
    doubles = {"a": np.ones((2, 2)), "b": np.ones((2, 2))}
    assert "input 0 is double" in decline_reason("MatMul", doubles)


# -- Gemm --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_transposes(trans_a, trans_b):
    m, k, n = 37, 70, 66
    a = random((k, m) if trans_a else (m, k), seed=5)
    b = random((n, k) if trans_b else (k, n), seed=6)
    check_node("Gemm", {"a": a, "b": b, "c": random((n,), seed=7)},
               {"transA": trans_a, "transB": trans_b, "alpha": 0.5, "beta": 2.0}, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("c_shape", [(), (1,), (9,), (5, 1), (1, 9), (5, 9)])
def test_gemm_broadcasts_c(c_shape):
    check_node("Gemm", {"a": random((5, 4)), "b": random((4, 9), seed=1), "c": random(c_shape, seed=2)},
               {"beta": -1.5}, rtol=1e-4, atol=1e-5)


def test_gemm_without_c_and_with_beta_zero():
    a, b = random((6, 3)), random((3, 4), seed=1)
    check_node("Gemm", {"a": a, "b": b, "c": None}, {"alpha": 3.0}, rtol=1e-4, atol=1e-5)
    poisoned = np.full((6, 4), np.nan, np.float32)  # beta = 0 ignores C, NaNs included, as the CPU does
    (y,) = check_node("Gemm", {"a": a, "b": b, "c": poisoned}, {"beta": 0.0}, rtol=1e-4, atol=1e-5)
    assert np.isfinite(y).all()


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: np.dtype(d).name)
def test_gemm_half_types(dtype):
    a, b, c = random((70, 33), dtype), random((66, 33), dtype, 1), random((66,), dtype, 2)
    check_node("Gemm", {"a": a, "b": b, "c": c}, {"transB": 1, "alpha": 0.25}, **tolerance(dtype))


def test_gemm_rejects_c_that_does_not_broadcast():
    feeds = {"a": random((5, 4)), "b": random((4, 9)), "c": random((5, 3))}
    session = ort.InferenceSession(node_model("Gemm", feeds), providers=CUDA_FIRST)
    with pytest.raises(OnnxRuntimeError, match=r"C of shape \(5, 3\) does not broadcast to the output \(5, 9\)"):
        session.run(None, feeds)


@pytest.mark.parametrize("dtype", HALVES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("m, k, n, trans_a, trans_b, batch", [
    (70, 45, 66, False, False, 1),   # partial tiles and a partial 32-deep slab
    (16, 16, 8, False, True, 1),     # exactly one mma per warp tile
    (130, 100, 3, True, False, 2),   # several row tiles, batched
])
def test_the_tensor_core_body(kernel_context, dtype, m, k, n, trans_a, trans_b, batch):
    """GEMM_EMULATE_MMA runs gemm_f16/gemm_bf16's mma.sync body on the simulator (each mma computed from
    warp shuffles under the PTX fragment layouts); on a real sm_80+ GPU the option is inert and the
    tensor cores run it."""
    from onnx_runtime_ep_cuda.ops.linalg import SUFFIX, GemmGeometry, launch_gemm

    ctx = kernel_context
    a = random((batch, k, m) if trans_a else (batch, m, k), dtype, 1)
    b = random((batch, n, k) if trans_b else (batch, k, n), dtype, 2)
    c = random((n,), dtype, 3)
    tensors = [Tensor.from_numpy(v, provider=ctx.handle) for v in (a, b, c)]
    y = ctx.empty(tensors[0].dtype, (batch, m, n))
    geo = GemmGeometry(m, n, k, (1, m) if trans_a else (k, 1), (1, k) if trans_b else (n, 1), batch, m * k, k * n)
    function = ctx.function("gemm.cu", f"gemm_{SUFFIX[tensors[0].dtype]}", options=("-DGEMM_EMULATE_MMA",))
    launch_gemm(ctx, function, geo, tensors[0], tensors[1], y, tensors[2], (0, 1), alpha=0.5, beta=2.0)
    wide_a, wide_b = a.astype(np.float32), b.astype(np.float32)
    op_a = wide_a.transpose(0, 2, 1) if trans_a else wide_a
    op_b = wide_b.transpose(0, 2, 1) if trans_b else wide_b
    expected = 0.5 * (op_a @ op_b) + 2.0 * c.astype(np.float32)
    np.testing.assert_allclose(y.numpy().astype(np.float32), expected, **tolerance(dtype))


def test_the_tensor_core_path_is_what_nvrtc_compiles_for_sm80():
    """gemm_f16/gemm_bf16 take the mma.sync body on sm_80+ (the simulator runs only the fallback)."""
    nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-python is not installed")
    from onnx_runtime_ep_cuda import nvrtc as compiler

    try:
        flags = ["--gpu-architecture=compute_80", "-default-device", "--std=c++17", *compiler._header_flags()]
    except Exception as exc:  # no NVRTC or no half headers: the compile test names the problem
        pytest.skip(f"NVRTC is not usable here: {exc}")
    source = compiler.kernel_source("gemm.cu").encode()
    err, program = nvrtc.nvrtcCreateProgram(source, b"gemm.cu", 0, [], [])
    (err,) = nvrtc.nvrtcCompileProgram(program, len(flags), [f.encode() for f in flags])
    assert int(err) == 0
    _, size = nvrtc.nvrtcGetPTXSize(program)
    ptx = bytearray(size)
    nvrtc.nvrtcGetPTX(program, ptx)
    nvrtc.nvrtcDestroyProgram(program)
    text = bytes(ptx).decode(errors="replace")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in text
