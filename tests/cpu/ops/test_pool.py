"""MaxPool (with indices), AveragePool, LpPool and the global pools against onnx's reference evaluator."""

from __future__ import annotations

import numpy as np
import pytest
from node_reference import F16, F32, F64, RNG, check, ours, rand
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)

# -- pooling -------------------------------------------------------------------------------------

POOL_CASES = [
    ((1, 2, 7, 7), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}),
    ((2, 3, 8, 7), {"kernel_shape": [2, 3], "strides": [2, 1], "pads": [0, 1, 1, 0]}),
    ((1, 2, 8, 8), {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}),
    ((1, 2, 7, 8), {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 0, 1, 1], "ceil_mode": 1}),
    ((1, 2, 7, 9), {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"}),
    ((1, 2, 6, 7), {"kernel_shape": [2, 3], "auto_pad": "SAME_LOWER"}),
    ((1, 2, 7, 7), {"kernel_shape": [3, 2], "strides": [2, 1], "auto_pad": "VALID"}),
    ((1, 3, 10), {"kernel_shape": [3], "strides": [2], "pads": [1, 2]}),
    ((1, 2, 4, 5, 6), {"kernel_shape": [2, 2, 3], "strides": [2, 1, 2], "pads": [0, 1, 1, 1, 0, 1]}),
    ((1, 2, 5, 6), {"kernel_shape": [1, 1], "strides": [2, 2]}),
    ((1, 2, 5, 6), {"kernel_shape": [1, 1]}),
    # Stride-1 windows wider than the pads reach: border outputs of the flat folds with 3 and 1 taps inside.
    ((2, 3, 5, 6), {"kernel_shape": [5, 4], "pads": [2, 2, 2, 1]}),
    ((1, 2, 3, 1), {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}),
]


@pytest.mark.parametrize("x_shape,attrs", POOL_CASES)
def test_max_pool(x_shape, attrs):
    check("MaxPool", [rand(*x_shape)], attrs, 12)


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("x_shape,attrs", [
    ((2, 2, 7, 6), {"kernel_shape": [3, 2], "strides": [2, 2], "pads": [1, 1, 1, 0]}),
    ((1, 2, 9, 9), {"kernel_shape": [2, 2], "dilations": [2, 3], "strides": [1, 2]}),
    ((1, 2, 5, 4, 6), {"kernel_shape": [2, 2, 3], "strides": [2, 1, 2], "pads": [1, 0, 0, 0, 1, 1]}),
    ((1, 3, 9), {"kernel_shape": [3], "strides": [2], "ceil_mode": 1}),
])
def test_max_pool_indices(x_shape, attrs, storage_order):
    check("MaxPool", [rand(*x_shape)], {**attrs, "storage_order": storage_order}, 12, n_outputs=2)


def test_max_pool_dilated_borders():
    check("MaxPool", [rand(1, 2, 7, 8)], {"kernel_shape": [3, 3], "pads": [2, 2, 2, 2], "dilations": [2, 2]}, 12)


def test_max_pool_old_opset_dilations_and_int8():
    check("MaxPool", [rand(1, 2, 6, 6)], {"kernel_shape": [2, 2], "strides": [2, 2]}, 1)
    check("MaxPool", [rand(1, 2, 9, 8, dtype=F16)], {"kernel_shape": [2, 2], "dilations": [2, 2]}, 10)
    x = RNG.integers(-128, 127, (1, 2, 6, 7)).astype(np.int8)
    check("MaxPool", [x], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "strides": [2, 2]}, 12)


@pytest.mark.parametrize("count_include_pad", [0, 1])
@pytest.mark.parametrize("x_shape,attrs", POOL_CASES)
def test_average_pool(x_shape, attrs, count_include_pad):
    check("AveragePool", [rand(*x_shape)], {**attrs, "count_include_pad": count_include_pad}, 11)


def test_average_pool_dilations_and_dtypes():
    attrs = {"kernel_shape": [2, 3], "dilations": [2, 1], "pads": [1, 1, 0, 1], "count_include_pad": 1}
    check("AveragePool", [rand(1, 2, 7, 7)], attrs, 19)
    check("AveragePool", [rand(1, 2, 6, 6, dtype=F16)], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, 7)
    check("AveragePool", [rand(1, 2, 6, 5, dtype=F64)], {"kernel_shape": [2, 2], "strides": [2, 2]}, 1)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("x_shape,attrs", [POOL_CASES[0], POOL_CASES[1], POOL_CASES[4], POOL_CASES[7]])
def test_lp_pool(x_shape, attrs, p):
    check("LpPool", [rand(*x_shape)], {**attrs, "p": p}, 11)


def test_lp_pool_dilations_opset_18():
    attrs = {"kernel_shape": [2, 2], "dilations": [2, 2], "strides": [1, 2], "p": 1}
    check("LpPool", [rand(1, 2, 7, 8)], attrs, 18)


@pytest.mark.parametrize("shape", [(2, 3, 5, 4), (1, 2, 7), (1, 2, 3, 2, 4)])
@pytest.mark.parametrize("dtype", [F32, F16])
def test_global_pools(shape, dtype):
    x = rand(*shape, dtype=dtype)
    axes = tuple(range(2, len(shape)))
    check("GlobalAveragePool", [x], {}, 1)
    # The reference GlobalMaxPool drops a dim of 1-D inputs; numpy states it directly.
    check("GlobalMaxPool", [x], {}, 22, expected=[x.max(axis=axes, keepdims=True)])
    for p, opset in ((2, 2), (3, 2), (1.0, 1)):  # GlobalLpPool-1 takes a float p
        expected = (np.abs(x.astype(F64)) ** p).sum(axis=axes, keepdims=True) ** (1 / p)
        check("GlobalLpPool", [x], {"p": p}, opset, expected=[expected.astype(dtype)])


def test_pool_rejects_bad_attributes():
    with pytest.raises(InvalidGraphError, match="kernel_shape"):
        ours("MaxPool", [rand(1, 1, 4, 4)], {}, 12)
    with pytest.raises(InvalidGraphError, match="storage_order"):
        ours("MaxPool", [rand(1, 1, 4, 4)], {"kernel_shape": [2, 2], "storage_order": 2}, 12, n_outputs=2)
    with pytest.raises(InvalidGraphError, match="dilations"):
        ours("AveragePool", [rand(1, 1, 4, 4)], {"kernel_shape": [2, 2], "dilations": [1]}, 19)
    with pytest.raises(InvalidArgumentError, match="smaller than"):
        ours("MaxPool", [rand(1, 1, 2, 2)], {"kernel_shape": [3, 3]}, 12)
