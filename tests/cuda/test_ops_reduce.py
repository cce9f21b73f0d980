"""CUDA reductions (kernels/reduce.cu, ops/reduce.py) against the CPU provider, on the simulator by default
(``ONNX_RUNTIME_CUDA_TESTS=real`` runs them on a GPU)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
from onnx_runtime_ep_cuda.ops import reduce  # noqa: E402
from test_ops_elementwise import (  # noqa: E402, F401  (device_mode is an autouse fixture)
    BF16,
    ONNX_TYPE,
    backend_cases_for,
    compare_with_cpu,
    device_mode,
    on_cuda,
    random,
    run_backend_case,
    single_node_model,
)

REDUCE_OPS = set(reduce._REDUCERS) | {"ArgMax", "ArgMin"}


@pytest.mark.parametrize("name", backend_cases_for(REDUCE_OPS))
def test_backend_case(name):
    run_backend_case(name)


def reduce_model(op, dtype, axes, keepdims=1, opset=18, noop=None):
    t = ONNX_TYPE[np.dtype(dtype)]
    attrs = {"keepdims": keepdims}
    inputs, inits = [("x", t, None)], []
    if noop is not None:
        attrs["noop_with_empty_axes"] = noop
    if axes is not None and (opset >= 18 or op == "ReduceSum" and opset >= 13):
        inputs.append(("axes", TensorProto.INT64, [len(axes)]))
        inits.append(helper.make_tensor("axes", TensorProto.INT64, [len(axes)], list(axes)))
    elif axes is not None:
        attrs["axes"] = list(axes)
    return single_node_model(op, inputs, [("y", t, None)], attrs, opset=opset, initializers=inits)


AXES = [None, (0,), (1,), (2,), (-1,), (0, 1), (1, 2), (0, 2), (0, 1, 2)]


@pytest.mark.parametrize("axes", AXES, ids=str)
@pytest.mark.parametrize("op", sorted(reduce._REDUCERS))
def test_axes(op, axes):
    rng = np.random.default_rng(0)
    x = random((3, 5, 7), np.float32, rng, low=0.1 if op in ("ReduceLogSum",) else -2.0, high=2.0)
    for keepdims in (0, 1):
        compare_with_cpu(reduce_model(op, np.float32, axes, keepdims), {"x": x}, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMean"])
def test_attribute_axes_of_earlier_opsets(op):
    x = random((4, 3, 6, 2), np.float32, np.random.default_rng(1))
    for axes in ((1,), (0, 2), (1, 3), (-2, -1)):
        compare_with_cpu(reduce_model(op, np.float32, axes, 0, opset=11), {"x": x}, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,axes", [((2, 5000), (1,)), ((5000, 3), (0,)), ((70000,), None),
                                        ((3, 2100, 2), (1,)), ((40, 30, 20), (0, 2))])
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceLogSumExp", "ReduceMean"])
def test_large_extents_split_over_blocks(op, shape, axes):
    x = random(shape, np.float32, np.random.default_rng(2), low=-1.0, high=1.0)
    compare_with_cpu(reduce_model(op, np.float32, axes, 1), {"x": x}, rtol=1e-4, atol=1e-4)


def test_split_plan():
    plan = reduce.reduction_plan((2, 5000), (1,), False, reduce.PRE_NONE, reduce.POST_DIVIDE)
    assert [launch.splits for launch in plan.launches] == [5, 1] and plan.temps == (10,)
    assert plan.launches[0].post == reduce.POST_NONE and plan.launches[1].post == reduce.POST_DIVIDE
    plan = reduce.reduction_plan((4, 3, 6, 5), (0, 2), True, reduce.PRE_SQUARE, reduce.POST_SQRT)
    assert plan.out_shape == (1, 3, 1, 5) and plan.count == 24
    assert [(la.outer, la.extent, la.inner) for la in plan.launches] == [(1, 4, 90), (3, 6, 5)]
    assert [la.pre for la in plan.launches] == [reduce.PRE_SQUARE, reduce.PRE_NONE]
    assert [la.post for la in plan.launches] == [reduce.POST_NONE, reduce.POST_SQRT]
    # Size-1 dims between reduced axes vanish, so the axes are adjacent: one pass.
    plan = reduce.reduction_plan((4, 1, 6, 5), (0, 2), False, reduce.PRE_NONE, reduce.POST_NONE)
    assert plan.out_shape == (1, 5) and [(la.outer, la.extent, la.inner) for la in plan.launches] == [(1, 24, 5)]


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.int32, np.int64], ids=["f16", "bf16", "i32", "i64"])
@pytest.mark.parametrize("op", ["ReduceSum", "ReduceProd", "ReduceMax", "ReduceMin", "ReduceL1", "ReduceSumSquare",
                                "ReduceMean", "ReduceLogSumExp"])
def test_dtypes(op, dtype):
    if np.dtype(dtype).kind == "i" and op in ("ReduceMean", "ReduceLogSumExp"):
        pytest.skip("float types only")
    rng = np.random.default_rng(3)
    low, high = (-2, 2) if op == "ReduceProd" else (-3, 3)
    x = random((4, 6, 5), dtype, rng, low=low, high=high)
    if np.dtype(dtype).kind == "i" and op == "ReduceProd":
        x = (x % 3).astype(dtype)
    narrow = np.dtype(dtype).kind not in "iu"
    for axes in ((1,), (0, 2), None):
        compare_with_cpu(reduce_model(op, dtype, axes, 0), {"x": x}, rtol=2e-2 if narrow else 0,
                         atol=5e-2 if narrow else 0)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.bool_])
@pytest.mark.parametrize("op", ["ReduceMax", "ReduceMin"])
def test_small_types(op, dtype):
    x = random((5, 9), dtype, np.random.default_rng(4))
    compare_with_cpu(reduce_model(op, dtype, (1,), 1, opset=20), {"x": x})
    compare_with_cpu(reduce_model(op, dtype, None, 0, opset=20), {"x": x})


def test_integer_sums_wrap_like_numpy():
    x = np.full((3, 4), 2**30, np.int32)
    compare_with_cpu(reduce_model("ReduceSum", np.int32, (1,), 0), {"x": x})


@pytest.mark.parametrize("op", sorted(reduce._REDUCERS))
def test_empty_reductions(op):
    x = np.zeros((0, 3), np.float32)
    got, = compare_with_cpu(reduce_model(op, np.float32, (0,), 0), {"x": x})
    assert got.shape == (3,)
    got, = compare_with_cpu(reduce_model(op, np.float32, (0,), 1), {"x": np.zeros((3, 0), np.float32)})
    assert got.shape == (1, 0)


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceSumSquare", "ReduceLogSum", "ReduceMean"])
def test_noop_with_empty_axes(op):
    x = random((3, 4), np.float32, np.random.default_rng(5), low=0.5)
    for noop in (0, 1):
        compare_with_cpu(reduce_model(op, np.float32, (), 1, noop=noop), {"x": x})


def test_nan_propagates():
    x = np.array([[1.0, np.nan, 3.0], [1.0, 2.0, 3.0]], np.float32)
    for op in ("ReduceMax", "ReduceMin", "ReduceSum"):
        got, = on_cuda(reduce_model(op, np.float32, (1,), 0)).run(None, {"x": x})
        assert np.isnan(got[0]) and not np.isnan(got[1])


def test_duplicate_axes_are_rejected():
    with pytest.raises(Exception, match="duplicate"):
        on_cuda(reduce_model("ReduceSum", np.float32, (1, -1), 0)).run(None, {"x": np.ones((2, 3), np.float32)})


# -- ArgMax / ArgMin ------------------------------------------------------------------------------------------


def arg_model(op, dtype, axis, keepdims=1, last=0, opset=13):
    t = ONNX_TYPE[np.dtype(dtype)]
    return single_node_model(op, [("x", t, None)], [("y", TensorProto.INT64, None)],
                             {"axis": axis, "keepdims": keepdims, "select_last_index": last}, opset=opset)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16, np.int32, np.int64, np.uint8, np.int8],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
def test_arg(op, dtype):
    rng = np.random.default_rng(6)
    x = random((4, 70, 3), dtype, rng, low=-4, high=4)
    x = np.round(x.astype(np.float32)).astype(dtype)  # ties on purpose
    for axis in (0, 1, 2, -1):
        for keepdims in (0, 1):
            for last in (0, 1):
                compare_with_cpu(arg_model(op, dtype, axis, keepdims, last), {"x": x})


def test_arg_over_a_long_row_and_nan():
    x = np.random.default_rng(7).standard_normal((2, 50000)).astype(np.float32)
    x[0, 123] = 100.0
    x[1, 40000] = np.nan
    x[1, 45000] = np.nan
    for op in ("ArgMax", "ArgMin"):
        for last in (0, 1):
            compare_with_cpu(arg_model(op, np.float32, 1, 0, last), {"x": x})


def test_arg_of_an_empty_axis_is_an_error():
    with pytest.raises(Exception, match="has size 0"):
        on_cuda(arg_model("ArgMax", np.float32, 1)).run(None, {"x": np.zeros((2, 0), np.float32)})
