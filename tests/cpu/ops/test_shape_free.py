"""Kernels marked shape_free serve any input shapes (the session keeps them for a node whose shapes change
every run, a decode step's): made for one set of shapes, each gives on another set exactly what a kernel
made for that set gives, across lengths, ranks and dtypes."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.registry import lookup

RNG = np.random.default_rng(0)


def _f32(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _i64(*values):
    return np.array(values, np.int64)


# (op, attributes, opset, inputs for the kernel's own shapes, inputs of other shapes)
CASES = [
    ("Add", {}, 17, [_f32(1, 1, 1, 5), _f32(1, 4, 1, 5)], [_f32(1, 1, 1, 9), _f32(1, 4, 1, 1)]),
    ("LessOrEqual", {}, 17, [_i64(0, 1, 2), _i64(1)], [_i64(4, 0, 7, 1).reshape(2, 2), _i64(3)]),
    ("Where", {}, 17, [np.array([True, False]), _f32(2), _f32(1)],
     [np.array([[True], [False]]), _f32(1, 3), _f32(2, 1)]),
    ("Max", {}, 17, [_i64(1, 5), _i64(3)], [_i64(2, 9, 4), _i64(7, 1, 3), _i64(0)]),
    ("Cast", {"to": 1}, 19, [_i64(1, 2)], [_i64(3, 4, 5, 6).reshape(2, 1, 2)]),
    ("Cast", {"to": 7}, 19, [_f32(3)], [_f32(2, 2) * 100]),
    ("Shape", {}, 17, [_f32(1, 4, 3, 2)], [_f32(2, 5)]),
    ("Shape", {"start": 1, "end": -1}, 17, [_f32(1, 4, 3, 2)], [_f32(2, 5, 7, 1, 3)]),
    ("Expand", {}, 17, [_f32(1, 1, 1, 1), _i64(1, 1, 1, 5)], [_f32(3, 1), _i64(2, 1, 4)]),
    ("Unsqueeze", {}, 17, [_f32(1, 5), _i64(1)], [_f32(2, 3, 4), _i64(-1)]),
    ("Squeeze", {}, 17, [_f32(1, 5, 1), _i64(0)], [_f32(1, 7, 2), _i64(0)]),
    ("Concat", {"axis": -2}, 17, [_f32(1, 4, 3, 8), _f32(1, 4, 1, 8)], [_f32(1, 4, 9, 8), _f32(1, 4, 1, 8)]),
    ("Concat", {"axis": -2}, 17, [_f32(1, 4, 3, 8), _f32(1, 4, 1, 8)], [_f32(2, 6), _f32(1, 6)]),  # another rank
    ("Concat", {"axis": 1}, 17, [_i64(1, 2).reshape(1, 2), _i64(3).reshape(1, 1)], [_i64(5).reshape(1, 1)] * 3),
    ("Reshape", {}, 17, [_f32(1, 4, 6), _i64(0, -1)], [_f32(2, 9, 2), _i64(1, 0, -1)]),
    ("Transpose", {"perm": [0, 2, 1, 3]}, 17, [_f32(1, 1, 4, 3)], [_f32(2, 5, 4, 3)]),
    ("Flatten", {"axis": -1}, 17, [_f32(1, 1, 4)], [_f32(2, 3, 5, 2)]),
    ("Neg", {}, 17, [_f32(1, 3)], [_f32(4, 1, 2)]),
    ("Log", {}, 17, [_f32(2)], [_f32(3, 3)]),
    ("Gather", {"axis": 1}, 17, [_f32(3, 5), _i64(0, -1)], [_f32(2, 7, 2), np.array(3, np.int64)]),
    ("GatherND", {}, 17, [_f32(1, 5), _i64(0, 1, 0, 4).reshape(1, 1, 2, 2)],
     [_f32(2, 9, 3), _i64(1, 8, 0, -1).reshape(2, 2)]),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'-'.join(f'{k}{v}' for k, v in c[1].items())}")
def test_a_shape_free_kernel_serves_other_shapes_as_their_own_kernel(case):
    op, attrs, opset, first, other = case
    factory = lookup(op, "", opset)

    def made_for(inputs):
        node = Node(op, [f"in{i}" for i in range(len(inputs))], ["out"], name="n", attrs=dict(attrs), opset=opset)
        return factory(node, [x.shape for x in inputs], opset)

    kept = made_for(first)
    assert getattr(kept, "shape_free", False), f"{op} is expected to be marked shape_free"
    for inputs in (other, first):
        want = made_for(inputs)(*inputs)
        got = kept(*inputs)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_array_equal(g, w)
