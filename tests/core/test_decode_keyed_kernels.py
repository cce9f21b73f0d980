"""A kernel that serves every length of a decode loop (one with ``shape_key``, an attention reading the keys'
length per call) is found again for every length a later generation walks without asking ``shape_key``, while
kernels made per shape stay bounded in number (they may hold per-length arrays)."""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Node
from onnx_runtime.session.steps import ShapeKeyedKernel

KEYED_FROM = 1000  # lengths below it get a kernel of their own (as a causal prefill's frontier is per length)


def _length_free(shapes) -> tuple:
    return tuple(shape[:-1] for shape in shapes), shapes[0][-1] >= KEYED_FROM


class _Hook:
    def __init__(self):
        self.made: list = []

    def get_kernel(self, node, shapes, opset, graph):
        self.made.append(shapes)

        def kernel(a, b):
            return (a * 2 + b,)

        if shapes[0][-1] >= KEYED_FROM:
            kernel.shape_key = _length_free
        return kernel


class _Handle:
    name = "fake"

    def __init__(self):
        self.hook = _Hook()


def _run(keyed: ShapeKeyedKernel, lengths) -> None:
    for n in lengths:
        a, b = np.arange(n, dtype=np.float64).reshape(1, n), np.ones((1, n))
        np.testing.assert_allclose(keyed(a, b)[0], 2 * a + 1, rtol=0, atol=0)


def test_a_later_generation_finds_every_length_without_shape_key():
    handle = _Handle()
    keyed = ShapeKeyedKernel(handle, Node("Attention", ["a", "b"], ["c"]), graph=None)
    _run(keyed, range(KEYED_FROM, KEYED_FROM + 300))  # a first generation: one kernel, found by shape_key
    assert len(handle.hook.made) == 1
    asked = []
    keyed.shape_key = lambda shapes: asked.append(shapes) or _length_free(shapes)
    _run(keyed, range(KEYED_FROM, KEYED_FROM + 300))
    assert asked == [] and len(handle.hook.made) == 1


def test_kernels_of_their_own_stay_bounded_beside_shared_ones():
    handle = _Handle()
    keyed = ShapeKeyedKernel(handle, Node("Attention", ["a", "b"], ["c"]), graph=None)
    _run(keyed, range(KEYED_FROM, KEYED_FROM + 100))  # shared entries
    _run(keyed, range(1, 400))
    assert keyed.owned <= ShapeKeyedKernel.LIMIT
    distinct = {id(kernel) for kernel in keyed.cache.values()}
    assert len(distinct) <= ShapeKeyedKernel.LIMIT + len(keyed.by_key)
    assert len(handle.hook.made) == 1 + 399


def test_shared_entries_start_over_at_their_bound(monkeypatch):
    """A first generation longer than the bound: every length still finds the one kernel, the entries stay bounded."""
    monkeypatch.setattr(ShapeKeyedKernel, "SHARED_LIMIT", 16)
    handle = _Handle()
    keyed = ShapeKeyedKernel(handle, Node("Attention", ["a", "b"], ["c"]), graph=None)
    for end in (KEYED_FROM + 15, KEYED_FROM + 100):
        _run(keyed, range(KEYED_FROM, end))
        assert 0 < len(keyed.cache) <= 16 and len(handle.hook.made) == 1
