"""Data-movement operators on the CUDA provider (kernels/data.cu) against the CPU provider, and the index
validation of Gather, GatherElements, GatherND and ScatterND (clamped accesses, a flag bit instead of corruption)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx_runtime as ort
import pytest
from cuda_op_harness import (
    CUDA_FIRST,
    DATA_OPS,
    check_node,
    decline_reason,
    family_cases,
    node_model,
    run_backend_case,
)
from onnx import numpy_helper
from onnx_runtime import Tensor
from onnx_runtime.errors import DeviceValidationError, OnnxRuntimeError
from onnx_runtime.ir import Node

# One dtype per element width the kernels are stamped out for, plus bool and the 16-bit floats.
WIDTHS = [np.float32, np.float16, ml_dtypes.bfloat16, np.int64, np.int8, np.bool_, np.uint16, np.float64]

pytestmark = pytest.mark.usefixtures("cuda_driver_mode")


def values(shape, dtype=np.float32, seed=0):
    raw = np.random.default_rng(seed).integers(-50, 50, shape)
    return (raw > 0) if np.dtype(dtype) == np.bool_ else raw.astype(dtype)


def ints(*v, dtype=np.int64):
    return np.array(v, dtype)


@pytest.mark.parametrize("name", family_cases(DATA_OPS))
def test_backend_case(name):
    run_backend_case(name)


# -- Transpose, Expand, Slice ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", WIDTHS, ids=lambda d: np.dtype(d).name)
def test_transpose_every_width(dtype):
    check_node("Transpose", {"x": values((3, 4, 5), dtype)}, {"perm": [2, 0, 1]})


@pytest.mark.parametrize("shape, perm", [
    ((2, 1, 3, 1, 2, 3, 1, 2), [7, 6, 5, 4, 3, 2, 1, 0]),  # rank 8
    ((4, 5, 6), None),                                      # default: reversed
    ((2, 3, 4, 5), [0, 1, 3, 2]),                           # merged leading dims
    ((0, 3), [1, 0]),                                       # empty
    ((3, 4), [0, 1]),                                       # identity: a plain copy
])
def test_transpose_shapes(shape, perm):
    check_node("Transpose", {"x": values(shape)}, {"perm": perm} if perm is not None else {})


def test_transpose_past_rank_8_is_declined():
    assert "rank 8 or less" in decline_reason("Transpose", {"x": values((1,) * 9)})


@pytest.mark.parametrize("dtype", [np.float16, np.int64, np.bool_], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("x_shape, repeats", [
    ((1, 2, 1, 5, 4), (1, 1, 2, 1, 1)),  # grouped-query heads: one repeated dimension
    ((2, 3, 2, 2, 3), (2, 2, 3, 2, 2)),  # ten dimensions that do not merge: more than one launch
    ((3,), (0,)),                        # empty result
    ((), ()),                            # a scalar
])
def test_tile(x_shape, repeats, dtype):
    check_node("Tile", {"x": values(x_shape, dtype), "repeats": ints(*repeats)})


@pytest.mark.parametrize("x_shape, shape", [((3, 1), (2, 1, 6)), ((1,), (4, 3)), ((2, 3), (1, 1, 3)),
                                            ((1, 1, 2), (0, 1, 1))])
def test_expand(x_shape, shape):
    check_node("Expand", {"x": values(x_shape, np.float16), "shape": ints(*shape)})


@pytest.mark.parametrize("index_type", [np.int32, np.int64])
@pytest.mark.parametrize("starts, ends, axes, steps", [
    ([1, -1], [-1, 0], [0, 2], [1, -1]),          # negative step from the end
    ([-100], [100], [1], [3]),                     # clamped bounds
    ([5, 2], [0, 0], [0, 1], [-2, -1]),
    ([2], [2], [0], [1]),                          # empty result
    ([0, 0, 1], [9, 9, 3], [-3, -2, -1], None),    # negative axes, default steps
    ([1], [3], None, None),                        # default axes
])
def test_slice(index_type, starts, ends, axes, steps):
    inputs = {"x": values((6, 5, 4), np.int8)}
    for name, given in (("starts", starts), ("ends", ends), ("axes", axes), ("steps", steps)):
        inputs[name] = ints(*given, dtype=index_type) if given is not None else None
    check_node("Slice", inputs, opset=13)


def test_slice_1_takes_attributes():
    check_node("Slice", {"x": values((4, 6))}, {"starts": [1, -4], "ends": [3, 100], "axes": [0, 1]}, opset=1)


# -- Concat and Split -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.bool_, np.int64, ml_dtypes.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(dtype, axis):
    inputs = {}
    for i, size in enumerate((2, 0, 3)):  # different lengths along the axis, the middle input empty
        shape = [2, 3, 4]
        shape[axis] = size
        inputs[f"x{i}"] = values(tuple(shape), dtype, i)
    check_node("Concat", inputs, {"axis": axis}, opset=13)


@pytest.mark.parametrize("opset, attrs, split", [
    (13, {"axis": 1}, ints(1, 3, 0)),
    (13, {"axis": -1}, None),
    (18, {"axis": 1, "num_outputs": 3}, None),     # uneven: 2, 2, 0
    (11, {"axis": 0, "split": [3, 1, 2]}, None),
])
def test_split(opset, attrs, split):
    x = values((6, 4, 3), np.float16)
    check_node("Split", {"x": x, "split": split}, attrs, opset=opset, outputs=3)


# -- layout-only operators -------------------------------------------------------------------------------


def test_reshape_squeeze_unsqueeze_flatten():
    x = values((2, 1, 3, 4), np.int8)
    check_node("Reshape", {"x": x, "shape": ints(0, -1, 2)}, opset=14)
    check_node("Reshape", {"x": values((0, 3)), "shape": ints(3, 0)}, {"allowzero": 1}, opset=14)
    check_node("Squeeze", {"x": x, "axes": ints(-3)}, opset=13)
    check_node("Squeeze", {"x": x, "axes": None}, opset=13)
    check_node("Squeeze", {"x": x}, {"axes": [1]}, opset=11)
    check_node("Unsqueeze", {"x": x, "axes": ints(0, -1)}, opset=13)
    check_node("Unsqueeze", {"x": x}, {"axes": [2]}, opset=11)
    check_node("Flatten", {"x": x}, {"axis": -2}, opset=13)
    check_node("Flatten", {"x": x}, {"axis": 0}, opset=13)


def test_reshape_reports_a_bad_shape():
    feeds = {"x": values((2, 3)), "shape": ints(4, -1)}
    session = ort.InferenceSession(node_model("Reshape", feeds), providers=CUDA_FIRST)
    with pytest.raises(OnnxRuntimeError, match=r"cannot infer the -1 of \[4, -1\] for 6 elements"):
        session.run(None, feeds)


# -- Gather, GatherElements, ScatterND ------------------------------------------------------------------


@pytest.mark.parametrize("index_type", [np.int32, np.int64])
@pytest.mark.parametrize("axis, indices", [(0, [[2, -1], [0, 1]]), (1, [3, -4, 0]), (-1, 1), (1, [])])
def test_gather(index_type, axis, indices):
    check_node("Gather", {"x": values((3, 4, 2), np.float16), "i": np.array(indices, index_type)}, {"axis": axis})


@pytest.mark.parametrize("index_type", [np.int32, np.int64])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(index_type, axis):
    data = values((3, 4, 5), np.int64)
    indices = np.random.default_rng(1).integers(-3, 3, (2, 3, 4)).astype(index_type)
    check_node("GatherElements", {"x": data, "i": indices}, {"axis": axis})


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.bool_], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("data_shape, indices, batch_dims", [
    ((4, 3, 5), [[1, 0], [3, -1], [0, 2]], 0),  # slices of the last axis, a negative index
    ((4, 3, 5), [[[2]], [[-4]]], 0),  # whole (3, 5) slices under two leading index dimensions
    ((4, 3, 5), [[1, 2, 4], [0, 0, -1]], 0),  # single elements
    ((2, 3, 5), [[[1], [2]], [[0], [-1]]], 1),  # per batch (the dynamo exports' last-token pick)
    ((2, 3, 4, 5), [[[1, 3]], [[2, 0]]], 1),
    ((2, 3, 4, 5), [[[1], [3], [0]], [[2], [0], [1]]], 2),  # two batch dimensions
])
def test_gather_nd(dtype, data_shape, indices, batch_dims):
    check_node("GatherND", {"x": values(data_shape, dtype), "i": np.array(indices, np.int64)},
               {"batch_dims": batch_dims}, opset=13)


def test_gather_nd_with_no_tuples_and_bad_indices():
    check_node("GatherND", {"x": values((4, 3)), "i": np.zeros((0, 1), np.int64)}, opset=13)
    for indices, attrs in ((np.array([[1, 0, 2]]), {}), (np.array([[[0]], [[1]], [[0]]]), {"batch_dims": 1})):
        feeds = {"x": values((2, 3)), "i": indices}
        session = ort.InferenceSession(node_model("GatherND", feeds, attrs, opset=13), providers=CUDA_FIRST)
        assert [p.provider for p in session.placement()] == ["CUDAExecutionProvider"]
        with pytest.raises(OnnxRuntimeError, match=r"GatherND\): indices \[.*\] must end in a tuple length"):
            session.run(None, feeds)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int32, np.float64], ids=lambda d: np.dtype(d).name)
def test_scatter_nd(reduction, dtype):
    data = values((4, 3, 5), dtype)
    # Reductions combine duplicate tuples in order; without one, duplicates are unspecified, so none here.
    indices = np.array([[1, 0], [3, -1], [1, 0]] if reduction != "none" else [[1, 0], [3, -1], [0, 2]])
    updates = values((3, 5), dtype, seed=1)
    check_node("ScatterND", {"x": data, "i": indices, "u": updates}, {"reduction": reduction}, opset=18)


def test_scatter_nd_whole_slices_and_bool():
    inputs = {"x": values((4, 3), np.bool_), "i": np.array([[2], [0]]), "u": values((2, 3), np.bool_, 1)}
    check_node("ScatterND", inputs)


def test_scatter_nd_reduction_on_int8_is_declined():
    inputs = {"x": values((4,), np.int8), "i": np.array([[1]]), "u": values((1,), np.int8)}
    assert "ScatterND reduction=add on" in decline_reason("ScatterND", inputs, {"reduction": "add"})


# -- Shape, ConstantOfShape, Range ----------------------------------------------------------------------


def test_shape_constant_of_shape_and_range():
    x = values((2, 3, 4, 5))
    check_node("Shape", {"x": x})
    check_node("Shape", {"x": x}, {"start": -3, "end": -1}, opset=15)
    check_node("ConstantOfShape", {"s": ints(2, 3)})
    for value, opset in ((np.array([7], np.int64), 9), (np.array([True]), 9), (np.array([1.5], np.float16), 20)):
        check_node("ConstantOfShape", {"s": ints(3, 2)}, {"value": numpy_helper.from_array(value)}, opset=opset)
    check_node("ConstantOfShape", {"s": ints(3, 0)}, {"value": numpy_helper.from_array(np.array([7], np.int8))})
    for start, limit, delta, dtype in [(0, 10, 3, np.int64), (5, -7, -2, np.int32), (1, 1, 1, np.int16),
                                       (0.5, 7.3, 0.7, np.float32), (3.0, -2.0, -0.3, np.float64)]:
        scalars = {name: np.array(v, dtype) for name, v in (("start", start), ("limit", limit), ("delta", delta))}
        check_node("Range", scalars, opset=11)
    for dtype in (np.float16, ml_dtypes.bfloat16):
        scalars = {"start": np.array(100.0, dtype), "limit": np.array(300.0, dtype), "delta": np.array(3.3, dtype)}
        for stash in (0, 1):  # in the type itself, or in float32 and rounded once
            check_node("Range", scalars, {"stash_type": stash}, opset=27)


# -- validation: out-of-range indices -------------------------------------------------------------------


def _flag_word(ctx) -> int:
    """The flags raised since the last call (with no run open, kernels raise them in the provider-wide word)."""
    word = np.zeros(4, np.uint8)
    ctx.device.download(word, ctx.validation_flags())
    ctx.device.fill(ctx.validation_flags(), 4, 0)
    return int(word.view(np.uint32)[0])


@pytest.mark.parametrize("op, attrs, arrays", [
    ("Gather", {"axis": 1}, [values((3, 4)), ints(1, 4, -5)]),
    ("Gather", {"axis": 0}, [values((0, 2)), ints(0)]),  # an empty axis: every index is out of range
    ("GatherElements", {"axis": 0}, [values((3, 2)), np.array([[0, 3], [-4, 1]])]),
    ("ScatterND", {}, [values((3, 2)), np.array([[1], [7]]), values((2, 2))]),
    ("GatherND", {}, [values((3, 2)), np.array([[1, 0], [0, -3]])]),
])
def test_an_out_of_range_index_is_clamped_and_flagged(kernel_context, op, attrs, arrays):
    """Kernel level: the access is clamped, the flag raised; in-range indices raise nothing."""
    from onnx_runtime_ep_cuda.ops.registry import lookup

    ctx = kernel_context
    node = Node(op, [f"in{i}" for i in range(len(arrays))], ["y"], name="n", attrs=attrs, opset=18)
    kernel = lookup(op, "", 18).factory(node, [a.shape for a in arrays], 18, ctx)
    assert _flag_word(ctx) == 0
    tensors = [Tensor.from_numpy(a, provider=ctx.handle) for a in arrays]
    (y,) = kernel(*tensors)
    assert _flag_word(ctx) & 1, "bit 0 marks an index out of range"
    if arrays[0].size:
        if op == "Gather":  # in-range indices still gather what they name
            np.testing.assert_array_equal(y.numpy()[:, 0], arrays[0][:, 1])
        in_range = Tensor.from_numpy(np.zeros_like(arrays[1]), provider=ctx.handle)
        kernel(tensors[0], in_range, *tensors[2:])
        assert _flag_word(ctx) == 0


def test_an_out_of_range_gather_fails_the_run_that_met_it():
    feeds = {"x": values((3, 4)), "i": ints(0, 7)}
    session = ort.InferenceSession(node_model("Gather", feeds, {"axis": 1}), providers=CUDA_FIRST)
    with pytest.raises(DeviceValidationError, match="flags=0x1"):
        session.run(None, feeds)
    (y,) = session.run(None, {**feeds, "i": ints(0, -1)})
    np.testing.assert_array_equal(y, feeds["x"][:, [0, 3]])
