"""The decode step's fused row kernels (RotateHalfEmbedding, SkipRMSNormalization, SwishMul, GeluMul) call their
compiled loop's entry point, kept with the shapes of their last call, instead of numba's dispatcher: repeated calls
of one shape and dtype never reach the dispatcher and stay within a float64 reference's bound, and each call the
entry point cannot take (another shape, the other dtype, an input not C-contiguous as reshaped for the loop, another
weight) goes through the dispatcher with its own values, so a kernel that dropped one of those checks reads the
wrong memory or type and fails the bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms.activations import gelu_series
from onnx_runtime_ep_cpu.compiled import decoder, deferred
from onnx_runtime_ep_cpu.fused_domain import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import fused
from reference64 import assert_within, gamma

RNG = np.random.default_rng(21)


@pytest.fixture
def dispatches(monkeypatch):
    """The calls that reach a compiled loop's dispatcher (deferred.Loop.__call__), by loop name."""
    for loop in (decoder.rotate_half, decoder.skip_rms_norm, decoder.swish_mul_float32, decoder.swish_mul,
                 decoder.gelu_mul_float32):
        if not isinstance(loop, deferred.Loop):
            pytest.skip("the compiled loops are not deferred loops on this host")
    calls: list[str] = []
    original = deferred.Loop.__call__

    def counted(self, *arguments):
        calls.append(self.__name__ if hasattr(self, "__name__") else repr(self))
        return original(self, *arguments)

    monkeypatch.setattr(deferred.Loop, "__call__", counted)
    return calls


def _switch(loop, arguments: tuple) -> None:
    """Run ``loop`` once compiled, as the background loader leaves it (switched to numba's dispatcher)."""
    loop(*arguments)
    if not loop.switched:
        pytest.skip("numba does not serve the decoder loops here (their numpy twins do)")


def _rotate64(q, cos, sin, half):
    q64, cos64, sin64 = (x.astype(np.float64) for x in (q, cos, sin))
    rotated = np.concatenate((-q64[..., half:], q64[..., :half]), axis=-1)
    exact = q64 * cos64 + rotated * sin64
    return exact, gamma(2, q.dtype) * (np.abs(q64 * cos64) + np.abs(rotated * sin64)) + 1e-300


def _rotate_kernel(half, end):
    node = Node("RotateHalfEmbedding", ["q", "cos", "sin"], ["y"], domain=FUSED_DOMAIN,
                attrs={"half": half, "end": end})
    return fused.rotate_half_embedding(node, [None] * 3, 1)


def _tables(shape, dtype, read_only: bool):
    cos, sin = (RNG.standard_normal(shape).astype(dtype) for _ in range(2))
    if read_only:  # (a decode step's tables come frozen from the shape-values cache)
        cos.setflags(write=False)
        sin.setflags(write=False)
    return cos, sin


def test_rotate_half_repeats_through_its_entry_point_and_declines_what_it_was_not_bound_for(dispatches):
    q_shape, table_shape = (1, 4, 1, 16), (1, 1, 1, 16)
    rows, table = np.zeros((4, 16), np.float32), np.zeros((1, 16), np.float32)
    _switch(decoder.rotate_half, (rows, table, table, np.zeros(4, np.int64), 8, np.empty((4, 16), np.float32)))
    kernel = _rotate_kernel(8, 16)

    def check(q, cos, sin):
        (got,) = kernel(q, cos, sin)
        exact, bound = _rotate64(q, cos, sin, 8)
        assert got.dtype == q.dtype and got.shape == q.shape
        assert_within(got, exact, bound, "rotate_half")

    check(RNG.standard_normal(q_shape).astype(np.float32), *_tables(table_shape, np.float32, True))
    dispatches.clear()
    for step in range(4):  # new values every step, the tables read-only or not: the entry point alone
        check(RNG.standard_normal(q_shape).astype(np.float32), *_tables(table_shape, np.float32, step % 2 == 0))
    assert dispatches == []
    # Another shape (kept from then on), the first shape again (kept again), then at those shapes a q strided
    # across heads, strided tables and the other dtype: each through the dispatcher, each within the bound.
    check(RNG.standard_normal((1, 4, 3, 16)).astype(np.float32), *_tables((1, 1, 3, 16), np.float32, True))
    check(RNG.standard_normal(q_shape).astype(np.float32), *_tables(table_shape, np.float32, True))
    merged = RNG.standard_normal((1, 4, 2, 16)).astype(np.float32)
    check(merged[:, :, 1:], *_tables(table_shape, np.float32, True))
    wide_cos, wide_sin = _tables((1, 1, 1, 32), np.float32, False)
    check(RNG.standard_normal(q_shape).astype(np.float32), wide_cos[..., ::2], wide_sin[..., ::2])
    check(RNG.standard_normal(q_shape), *_tables(table_shape, np.float64, True))
    assert len(dispatches) == 5
    check(RNG.standard_normal(q_shape).astype(np.float32), *_tables(table_shape, np.float32, True))


def _skip_kernel(epsilon=1e-5):
    node = Node("SkipRMSNormalization", ["a", "b", "w"], ["y", "s"], domain=FUSED_DOMAIN,
                attrs={"epsilon": epsilon, "stash_type": 1})
    return fused.skip_rms_normalization(node, [None] * 3, 1)


def test_skip_rms_norm_repeats_through_its_entry_point_for_its_constant_weight_only(dispatches):
    n = 64
    shape = (1, 1, n)
    _switch(decoder.skip_rms_norm, (np.ones((1, n), np.float32), np.ones((1, n), np.float32), np.ones(n, np.float32),
                                    1e-5, np.empty((1, n), np.float32), np.empty((1, n), np.float32)))
    kernel = _skip_kernel()
    weight = RNG.standard_normal(n).astype(np.float32)
    weight.setflags(write=False)  # a constant: the same read-only array every run

    def check(a, b, w):
        got, total = kernel(a, b, w)
        s = a.astype(np.float64) + b.astype(np.float64)
        exact = s / np.sqrt((s * s).mean(-1, keepdims=True) + 1e-5) * w.astype(np.float64)
        assert got.dtype == a.dtype and got.shape == a.shape
        assert_within(total, s, gamma(1, a.dtype) * np.abs(s), "a + b")
        # (the statistics in float32, the node's stash_type, for either input dtype)
        assert_within(got, exact, gamma(n + 6, np.float32) * np.abs(exact) + 1e-30, "rms")

    check(RNG.standard_normal(shape).astype(np.float32), RNG.standard_normal(shape).astype(np.float32), weight)
    dispatches.clear()
    for _ in range(4):
        check(RNG.standard_normal(shape).astype(np.float32), RNG.standard_normal(shape).astype(np.float32), weight)
    assert dispatches == []
    # Two rows (kept from then on), one row again (kept again), then a strided weight of the same values and a
    # strided a: each through the dispatcher; float64 inputs (the statistics kept in float32) through numpy.
    check(RNG.standard_normal((1, 2, n)).astype(np.float32), RNG.standard_normal((1, 2, n)).astype(np.float32),
          weight)
    check(RNG.standard_normal(shape).astype(np.float32), RNG.standard_normal(shape).astype(np.float32), weight)
    spaced = np.repeat(weight, 2)[::2]
    check(RNG.standard_normal(shape).astype(np.float32), RNG.standard_normal(shape).astype(np.float32), spaced)
    check(RNG.standard_normal((1, 1, 2 * n)).astype(np.float32)[..., ::2],
          RNG.standard_normal(shape).astype(np.float32), weight)
    check(RNG.standard_normal(shape), RNG.standard_normal(shape), weight.astype(np.float64))
    assert len(dispatches) == 4


def _sigmoid64(x):
    return 1 / (1 + np.exp(-x))


@pytest.mark.parametrize("first", [np.float32, np.float64])
def test_swish_mul_repeats_through_the_entry_point_of_its_dtype(dispatches, first):
    size = 128
    for loop, dtype in ((decoder.swish_mul_float32, np.float32), (decoder.swish_mul, np.float64)):
        _switch(loop, (np.ones(size, dtype), np.ones(size, dtype), 1.0, np.empty(size, dtype)))
    kernel = fused.swish_mul(Node("SwishMul", ["a", "b"], ["y"], domain=FUSED_DOMAIN, attrs={"alpha": 1.0}),
                             [None, None], 1)

    def check(a, b):
        (got,) = kernel(a, b)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        exact = a64 * _sigmoid64(a64) * b64
        assert got.dtype == a.dtype and got.shape == a.shape
        assert_within(got, exact, 16 * np.finfo(a.dtype).eps * np.abs(exact) + 1e-30, "swish_mul")

    other = np.float64 if first is np.float32 else np.float32
    shape = (1, 1, size)
    check(*(RNG.standard_normal(shape).astype(first) for _ in range(2)))
    dispatches.clear()
    for _ in range(4):
        check(*(RNG.standard_normal(shape).astype(first) for _ in range(2)))
    assert dispatches == []
    check(*(RNG.standard_normal((1, 3, size)).astype(first) for _ in range(2)))  # kept from then on
    check(*(RNG.standard_normal(shape).astype(first) for _ in range(2)))  # kept again
    check(RNG.standard_normal((1, 1, 2 * size)).astype(first)[..., ::2], RNG.standard_normal(shape).astype(first))
    check(*(RNG.standard_normal(shape).astype(other) for _ in range(2)))
    assert len(dispatches) == 4


def test_gelu_mul_repeats_through_its_entry_point(dispatches):
    size = 128
    coefficients = np.ascontiguousarray(gelu_series("none", np.float32))
    _switch(decoder.gelu_mul_float32, (np.ones(size, np.float32), np.ones(size, np.float32), coefficients,
                                       np.empty(size, np.float32)))
    kernel = fused.gelu_mul(Node("GeluMul", ["a", "b"], ["y"], domain=FUSED_DOMAIN, attrs={"approximate": "none"}),
                            [None, None], 1)
    erf = np.vectorize(math.erf)

    def check(a, b):
        (got,) = kernel(a, b)
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        gelu = 0.5 * a64 * (1 + erf(a64 / math.sqrt(2)))
        assert got.dtype == np.float32 and got.shape == a.shape
        assert_within(got, gelu * b64, 8 * np.finfo(np.float32).eps * (np.abs(gelu) + np.abs(a64)) * np.abs(b64)
                      + 1e-30, "gelu_mul")

    shape = (1, 1, size)
    check(*(RNG.standard_normal(shape).astype(np.float32) for _ in range(2)))
    dispatches.clear()
    for _ in range(4):
        check(*(RNG.standard_normal(shape).astype(np.float32) for _ in range(2)))
    assert dispatches == []
    merged = RNG.standard_normal((1, 2, 2 * size)).astype(np.float32)
    check(merged[..., :size], merged[..., size:])  # two rows of column views: another shape, kept from then on
    check(*(RNG.standard_normal(shape).astype(np.float32) for _ in range(2)))  # kept again
    spaced = RNG.standard_normal((1, 1, 2 * size)).astype(np.float32)[..., ::2]
    check(RNG.standard_normal(shape).astype(np.float32), spaced)
    assert len(dispatches) == 3
