"""A decode step's BLAS-sized products add their bias without numba's dispatcher: a planned FusedMatMul (gpt2's
out-projection and fc2) calls the bias and residual epilogue's entry point, bound once per dtype, and a ProjectionGroup
without a bias (llama's, phi3's and gemma's projections) adds nothing after np.dot. Repeated calls never reach the
dispatcher and stay within a float64 reference's bound; a strided bias or residual and the other dtype take the
dispatcher with their own values (a kernel that dropped those checks would read the wrong memory or type)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.compiled import transformer as compiled
from onnx_runtime_ep_cpu.fused_domain import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import linalg, projection_group
from reference64 import assert_within, gamma

RNG = np.random.default_rng(31)


@pytest.fixture
def epilogues(monkeypatch):
    """The calls of the bias and residual epilogue (compiled/transformer.add_bias_residual_) through its dispatcher."""
    loop = compiled.add_bias_residual_
    if not isinstance(loop, deferred.Loop):
        pytest.skip("the epilogue is not a deferred loop on this host")
    y = np.zeros((1, 4), np.float32)
    loop(y, np.zeros(4, np.float32), np.zeros((0, 0), np.float32))  # switched to numba, as the loader leaves it
    if not loop.switched:
        pytest.skip("numba does not serve the epilogue here (its numpy twin does)")
    calls: list[int] = []
    original = deferred.Loop.__call__

    def counted(self, *arguments):
        if self is loop:
            calls.append(1)
        return original(self, *arguments)

    monkeypatch.setattr(deferred.Loop, "__call__", counted)
    return calls


def _constant(array: np.ndarray) -> np.ndarray:
    array.setflags(write=False)  # an initializer: the same read-only array on every run
    return array


def _within(y, a, w, addends: tuple) -> None:
    """y against a @ w + addends in float64: the product's bound for any summation order, and the additions'."""
    a64, w64 = a.astype(np.float64).reshape(-1, a.shape[-1]), w.astype(np.float64)
    exact = a64 @ w64
    magnitude = np.abs(a64) @ np.abs(w64)
    for addend in addends:
        exact = exact + np.asarray(addend, np.float64).reshape(-1, w.shape[1])
        magnitude = magnitude + np.abs(np.asarray(addend, np.float64)).reshape(-1, w.shape[1])
    assert y.shape == a.shape[:-1] + (w.shape[1],)
    assert_within(y.reshape(exact.shape), exact, gamma(a.shape[-1] + len(addends), y.dtype) * magnitude + 1e-30,
                  "product")


def test_a_blas_fused_product_adds_its_bias_through_the_entry_point(knobs, epilogues):
    knobs(threads=1)
    depth, columns = 64, 64  # below the few-row tiles' sizes: BLAS's product and the compiled epilogue
    w = _constant(RNG.standard_normal((depth, columns), dtype=np.float32))
    bias = _constant(RNG.standard_normal(columns).astype(np.float32))
    node = Node("FusedMatMul", ["a", "w", "bias", "r"], ["y"], domain=FUSED_DOMAIN, opset=1)
    kernel = linalg.fused_matmul(node, [(1, 1, depth), w.shape, bias.shape, (1, 1, columns)], 1)
    a = RNG.standard_normal((1, 1, depth), dtype=np.float32)
    (y,) = kernel(a, w, bias, RNG.standard_normal((1, 1, columns), dtype=np.float32))
    epilogues.clear()
    for call in range(6):  # new A's, residuals and none: the entry point alone
        a = RNG.standard_normal((1, 1, depth), dtype=np.float32)
        residual = None if call % 3 == 2 else RNG.standard_normal((1, 1, columns), dtype=np.float32)
        (y,) = kernel(a, w, bias, *([] if residual is None else [residual]))
        _within(y, a, w, (bias,) if residual is None else (bias, residual))
    assert epilogues == []
    # A strided constant bias (kept as the constants from then on): its epilogue through the dispatcher, each call.
    spaced = _constant(np.repeat(RNG.standard_normal(columns).astype(np.float32), 2)[::2])
    for _ in range(2):
        a = RNG.standard_normal((1, 1, depth), dtype=np.float32)
        (y,) = kernel(a, w, spaced)
        _within(y, a, w, (spaced,))
    assert len(epilogues) == 2
    # float64 operands: the float64 entry point, bound at its first call; then float32 again.
    w64, bias64 = _constant(w.astype(np.float64)), _constant(bias.astype(np.float64))
    for _ in range(3):
        a64 = RNG.standard_normal((1, 1, depth))
        (y,) = kernel(a64, w64, bias64)
        assert y.dtype == np.float64
        _within(y, a64, w64, (bias64,))
    a = RNG.standard_normal((1, 1, depth), dtype=np.float32)
    (y,) = kernel(a, w, bias)
    _within(y, a, w, (bias,))
    assert len(epilogues) == 3  # (float64's first epilogue binds its entry point: the dispatcher's call)


def _kept(kernel) -> tuple:
    """The planned FusedMatMul kernel's kept BLAS operands (b, bias, dtype, the run through the entry point)."""
    cells = dict(zip(kernel.__code__.co_freevars, (cell.cell_contents for cell in kernel.__closure__)))
    return cells["blas_kept"]


def test_a_kept_fused_product_runs_without_the_checks_only_where_they_hold(knobs, epilogues):
    """Once its constants are kept and the epilogue's entry point bound, a BLAS-path FusedMatMul keeps a run that
    skips the epilogue's checks; its callers' operands stay what the run assumes: F-ordered constant weights (np.dot's
    y is C-contiguous), a strided residual of the output's shape (copied by the kernel), none; a strided bias keeps
    no run (the checked path)."""
    knobs(threads=1)
    depth, columns = 64, 64
    node = Node("FusedMatMul", ["a", "w", "bias", "r"], ["y"], domain=FUSED_DOMAIN, opset=1)
    kernel = linalg.fused_matmul(node, [(1, 1, depth), (depth, columns), (columns,), (1, 1, columns)], 1)
    for order in ("C", "F"):
        w = _constant(np.array(RNG.standard_normal((depth, columns), dtype=np.float32), order=order))
        bias = _constant(RNG.standard_normal(columns).astype(np.float32))
        for call in range(5):
            a = RNG.standard_normal((1, 1, depth), dtype=np.float32)
            wide = RNG.standard_normal((1, 1, 2 * columns), dtype=np.float32)
            residual = [wide[..., :columns].copy(), wide[..., ::2], None][call % 3]
            (y,) = kernel(a, w, bias, *([] if residual is None else [residual]))
            _within(y, a, w, (bias,) if residual is None else (bias, residual))
        kept = _kept(kernel)
        assert kept[0] is w and kept[1] is bias and kept[3] is not None, order
    spaced = _constant(np.repeat(RNG.standard_normal(columns).astype(np.float32), 2)[::2])
    for _ in range(3):
        a = RNG.standard_normal((1, 1, depth), dtype=np.float32)
        (y,) = kernel(a, w, spaced)
        _within(y, a, w, (spaced,))
    assert _kept(kernel)[1] is spaced and _kept(kernel)[3] is None


def test_a_projection_group_without_bias_adds_nothing_after_its_product(knobs, epilogues):
    knobs(threads=1)
    depth, widths = 64, [32, 32, 64]  # llama's q, k, v: BLAS's product below the few-row tiles' sizes
    w = _constant(RNG.standard_normal((depth, sum(widths)), dtype=np.float32))
    bias = _constant(RNG.standard_normal(sum(widths)).astype(np.float32))
    node = Node("ProjectionGroup", ["a", "w"], ["q", "k", "v"], domain=FUSED_DOMAIN, attrs={"widths": widths}, opset=1)
    kernel = projection_group.projection_group(node, [(1, 1, depth), w.shape], 1)
    for _ in range(4):
        a = RNG.standard_normal((1, 1, depth), dtype=np.float32)
        _within(np.concatenate(kernel(a, w), axis=-1), a, w, ())
    assert epilogues == []
    a = RNG.standard_normal((1, 1, depth), dtype=np.float32)  # a bias still added, by the epilogue
    _within(np.concatenate(kernel(a, w, bias), axis=-1), a, w, (bias,))
