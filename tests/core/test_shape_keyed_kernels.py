"""A node whose input shapes change from run to run (a decode step's mask and cache) gets its kernel per shape
through ShapeKeyedKernel: a kernel marked shape_free is kept for every later shape, other kernels are cached
per shape up to a bound."""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Node
from onnx_runtime.session.steps import ShapeKeyedKernel


class _Hook:
    def __init__(self, free: bool):
        self.free = free
        self.made: list = []

    def get_kernel(self, node, shapes, opset, graph):
        self.made.append(shapes)

        def kernel(a, b):
            return (a + b,)

        if self.free:
            kernel.shape_free = True
        return kernel


class _Handle:
    name = "fake"

    def __init__(self, free: bool):
        self.hook = _Hook(free)


def _run_lengths(keyed: ShapeKeyedKernel, lengths) -> None:
    for n in lengths:
        a, b = np.arange(n, dtype=np.float32), np.ones(n, np.float32)
        np.testing.assert_array_equal(keyed(a, b)[0], a + 1)


def test_a_shape_free_kernel_is_made_once_for_every_shape():
    handle = _Handle(free=True)
    keyed = ShapeKeyedKernel(handle, Node("Add", ["a", "b"], ["c"]), graph=None)
    _run_lengths(keyed, range(1, 50))
    assert handle.hook.made == [[(1,), (1,)]]


def test_other_kernels_are_made_per_shape_and_their_cache_is_bounded():
    handle = _Handle(free=False)
    keyed = ShapeKeyedKernel(handle, Node("Add", ["a", "b"], ["c"]), graph=None)
    _run_lengths(keyed, [3, 4, 3, 4])
    assert len(handle.hook.made) == 2  # one per distinct shape
    _run_lengths(keyed, range(1, 300))  # a long generation's growing length
    assert len(keyed.cache) <= ShapeKeyedKernel.LIMIT
    assert len(handle.hook.made) == 2 + 299 - 2


class _CheckingHook:
    """Kernels of one length each whose call_if_fits checks it (None for any other, having done nothing)."""

    def __init__(self, honest: bool = True):
        self.made: list = []
        self.checked: list = []
        self.honest = honest

    def get_kernel(self, node, shapes, opset, graph):
        self.made.append(shapes)
        length = shapes[0][0]

        def kernel(a, b):
            return (a + b,)

        def call_if_fits(a, b):
            self.checked.append((length, a.shape[0]))
            return (a + b,) if self.honest and a.shape[0] == length and b.shape[0] == length else None

        kernel.call_if_fits = call_if_fits
        return kernel


def test_a_kernel_checking_its_own_shapes_is_asked_first_and_the_cache_decides_where_it_declines():
    handle = _Handle(free=False)
    handle.hook = _CheckingHook()
    keyed = ShapeKeyedKernel(handle, Node("Add", ["a", "b"], ["c"]), graph=None)
    _run_lengths(keyed, [3, 3, 3, 4, 4, 3])
    assert handle.hook.made == [[(3,), (3,)], [(4,), (4,)]]
    # Each call asks the last kernel found; a decline (3 -> 4, 4 -> 3) goes to the cache, whose kernel then serves.
    assert handle.hook.checked == [(3, 3), (3, 3), (3, 3), (3, 4), (4, 4), (4, 4), (4, 3), (3, 3)]


def test_a_kernel_declining_the_shapes_it_was_made_for_is_a_typed_error():
    import pytest
    from onnx_runtime.errors import KernelError

    handle = _Handle(free=False)
    handle.hook = _CheckingHook(honest=False)
    keyed = ShapeKeyedKernel(handle, Node("Add", ["a", "b"], ["c"], name="adder"), graph=None)
    with pytest.raises(KernelError, match="adder"):
        _run_lengths(keyed, [3])
