"""Shape and data-movement kernels against onnx's reference evaluator."""

from __future__ import annotations

import numpy as np
import pytest
from kernel_reference import assert_same, check, f32, i32, i64, make_kernel, rng, run_kernel, run_reference
from onnx_runtime.errors import InvalidGraphError
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)

# -- shape --------------------------------------------------------------------------------------------


def test_reshape():
    x = f32(2, 3, 4)
    check("Reshape", [x, i64([4, -1])], opset=13)
    check("Reshape", [x, i64([0, 0, 2, 2])], opset=14)
    check("Reshape", [x, i64([-1])], opset=5)
    check("Reshape", [np.zeros((0, 3), np.float32), i64([3, 0])], {"allowzero": 1}, opset=14)
    check("Reshape", [f32(1), i64([])], opset=14)
    (y,) = run_kernel("Reshape", [x], {"shape": [6, 4]}, opset=1)
    assert y.shape == (6, 4)


@pytest.mark.parametrize("perm", [None, [0, 2, 1], [2, 0, 1]])
def test_transpose(perm):
    check("Transpose", [f32(2, 3, 4)], {} if perm is None else {"perm": perm}, opset=13)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat(axis):
    check("Concat", [f32(2, 3), f32(2, 3), f32(2, 3)], {"axis": axis}, opset=13)
    check("Concat", [i32(2, 0), i32(2, 3)], {"axis": -1}, opset=13)


def test_concat_v1_defaults_to_axis_1_and_v4_requires_axis():
    (y,) = run_kernel("Concat", [f32(2, 3), f32(2, 1)], opset=1)
    assert y.shape == (2, 4)
    with pytest.raises(InvalidGraphError, match="axis"):
        make_kernel("Concat", [f32(2, 3)], opset=4)


def test_split_versions():
    x = f32(6, 4)
    check("Split", [x], {"axis": 0}, opset=11, n_outputs=3)
    check("Split", [x], {"axis": 1, "split": [1, 3]}, opset=11, n_outputs=2)
    check("Split", [x, i64([2, 4])], {"axis": 0}, opset=13, n_outputs=2)
    check("Split", [x], {"axis": -1}, opset=13, n_outputs=2)
    check("Split", [f32(7, 2)], {"num_outputs": 3}, opset=18, n_outputs=3)
    check("Split", [x, i64([1, 1, 4])], opset=18, n_outputs=3)


def test_split_repeated_calls_follow_shapes_and_sizes():
    """A node keeps the parts' indices of its last shape and constant sizes (a decode step splits the same
    shape every run); another shape, another sizes array or a fed (writable) one works them out again."""
    kernel = make_kernel("Split", [f32(6, 4), i64([2, 4])], {"axis": 0}, opset=13, n_outputs=2)
    constant, other = i64([2, 4]), i64([5, 1])
    constant.flags.writeable = other.flags.writeable = False
    fed = i64([3, 3])
    for x, split, rows in [(f32(6, 4), constant, [2, 4]), (f32(6, 4), constant, [2, 4]), (f32(6, 3), constant, [2, 4]),
                           (f32(6, 3), other, [5, 1]), (f32(6, 3), fed, [3, 3]), (f32(6, 3), fed, [3, 3]),
                           (f32(6, 3), other, [5, 1])]:
        fed[:] = [3, 3] if x.shape[1] == 3 else [2, 4]
        parts = kernel(x, split)
        assert [p.shape for p in parts] == [(n, x.shape[1]) for n in rows]
        np.testing.assert_array_equal(np.concatenate(parts), x)
        assert all(np.shares_memory(p, x) for p in parts)  # views
    fed[:] = [1, 5]  # the same fed array with new values: not the last call's parts
    assert [p.shape[0] for p in kernel(f32(6, 3), fed)] == [1, 5]
    even = make_kernel("Split", [f32(6, 4)], {"axis": -1}, opset=13, n_outputs=2)
    for x in (f32(6, 4), f32(6, 4), f32(2, 8)):
        assert [p.shape for p in even(x)] == [(x.shape[0], x.shape[1] // 2)] * 2
    with pytest.raises(Exception, match="summing to dimension"):
        kernel(f32(7, 3), constant)


@pytest.mark.parametrize(
    "starts, ends, axes, steps",
    [
        ([1, 0], [3, 2], None, None),
        ([0], [-1], [1], None),
        ([-1], [-1000], [0], [-1]),
        ([10], [-10], [1], [-2]),
        ([0, 1], [2**62, 9], [-1, 0], [2, 3]),
        ([5], [1], [0], [1]),
        ([-100], [100], [2], [1]),
    ],
)
def test_slice(starts, ends, axes, steps):
    x = f32(4, 5, 6)
    inputs = [x, i64(starts), i64(ends)]
    inputs += [None if axes is None else i64(axes), None if steps is None else i64(steps)]
    if steps is None:
        inputs = inputs[:-1] if axes is not None else inputs[:3]
    check("Slice", inputs, opset=13)
    if steps is None:
        attrs = {"starts": starts, "ends": ends} | ({} if axes is None else {"axes": axes})
        check("Slice", [x], attrs, opset=1)


def test_slice_int32_inputs():
    check("Slice", [f32(5), np.array([1], np.int32), np.array([4], np.int32)], opset=13)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather(axis):
    x = f32(3, 4, 5)
    check("Gather", [x, i64([[0, -1], [1, 2]])], {"axis": axis}, opset=13)
    check("Gather", [x, np.array(1, np.int32)], {"axis": axis}, opset=13)


def test_gather_elements():
    x = f32(3, 4)
    check("GatherElements", [x, i64([[0, 1, 2, 0], [2, -1, 0, 0]])], {"axis": 0}, opset=13)
    check("GatherElements", [x, i64([[3, 0], [-4, 2], [0, 0]])], {"axis": 1}, opset=13)
    # Off the axis, indices may be shorter than the data (the reference evaluator rejects this).
    (y,) = run_kernel("GatherElements", [x, i64([[3, 0], [1, 1]])], {"axis": 1}, opset=13)
    np.testing.assert_array_equal(y, [[x[0, 3], x[0, 0]], [x[1, 1], x[1, 1]]])


def test_gather_nd():
    x = f32(2, 3, 4)
    check("GatherND", [x, i64([[0, 1], [1, 2]])], opset=13)
    check("GatherND", [x, i64([[[1]], [[0]]])], opset=13)
    check("GatherND", [x, i64([[0, 1, 3], [1, -1, 0]])], opset=13)
    check("GatherND", [x, i64([[1], [2]])], {"batch_dims": 1}, opset=13)
    check("GatherND", [x, i64([[[0, 1], [2, 3]], [[1, 1], [0, 0]]])], {"batch_dims": 1}, opset=13)


@pytest.mark.parametrize("reduction", [None, "add", "mul", "max", "min"])
def test_scatter_elements(reduction):
    attrs = {"axis": 1} | ({} if reduction is None else {"reduction": reduction})
    data, indices, updates = f32(3, 4), i64([[0, 1], [3, -1], [2, 2]]), f32(3, 2)
    check("ScatterElements", [data, indices, updates], attrs, opset=18)


def test_scatter_is_the_old_name_of_scatter_elements():
    inputs = [f32(3, 3), i64([[1, 0, 2]]), f32(1, 3)]
    (y,) = run_kernel("Scatter", inputs, {"axis": 0}, opset=9)
    assert_same(y, run_reference("ScatterElements", inputs, {"axis": 0}, opset=11)[0])


@pytest.mark.parametrize("reduction", [None, "add", "mul", "max", "min"])
def test_scatter_nd(reduction):
    attrs = {} if reduction is None else {"reduction": reduction}
    data = f32(4, 3, 2)
    check("ScatterND", [data, i64([[1], [3], [1]]), f32(3, 3, 2)], attrs, opset=18)
    check("ScatterND", [data, i64([[0, 1], [-1, 2]]), f32(2, 2)], attrs, opset=18)


def test_squeeze_and_unsqueeze():
    x = f32(1, 3, 1, 2)
    check("Squeeze", [x], opset=13)
    check("Squeeze", [x, i64([0, -2])], opset=13)
    check("Squeeze", [x], {"axes": [2]}, opset=11)
    check("Unsqueeze", [f32(3, 2), i64([0, -1])], opset=13)
    check("Unsqueeze", [f32(3, 2), i64([3, 1])], opset=13)
    check("Unsqueeze", [np.array(5.0, np.float32), i64([0])], opset=13)
    check("Unsqueeze", [f32(3, 2)], {"axes": [0, 3]}, opset=11)


def test_shape_and_size():
    x = f32(2, 3, 4)
    check("Shape", [x], opset=13)
    for start, end in [(1, None), (-2, None), (0, -1), (-10, 10), (2, 1)]:
        check("Shape", [x], {"start": start} | ({} if end is None else {"end": end}), opset=15)
    check("Size", [x], opset=13)
    check("Size", [np.zeros((0, 3), np.float32)], opset=13)


def test_expand_and_tile():
    check("Expand", [f32(3, 1), i64([2, 3, 4])], opset=13)
    check("Expand", [f32(3, 4), i64([1, 1])], opset=13)
    check("Tile", [f32(2, 3), i64([2, 1])], opset=13)
    check("Tile", [i32(2, 3), i64([0, 3])], opset=13)
    (y,) = run_kernel("Tile", [f32(2, 3), i64(3), i64(1)], opset=1)
    assert y.shape == (2, 9)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad(mode):
    x = f32(3, 4)
    check("Pad", [x, i64([1, 2, 2, 1])], {"mode": mode}, opset=19)
    check("Pad", [x, i64([0, 1, 0, 2]), None, i64([-1, 0])], {"mode": mode}, opset=19)
    if mode == "constant":
        check("Pad", [x, i64([1, 0, 0, 1]), np.array(7.5, np.float32)], opset=13)
        check("Pad", [x], {"pads": [1, 0, 0, 1], "value": 2.0}, opset=2)
        check("Pad", [i32(2, 2), i64([1, 1, 1, 1]), np.array(-4, np.int32)], opset=13)


def test_pad_negative_crops():
    x = f32(4, 5)
    (y,) = run_kernel("Pad", [x, i64([-1, 2, 0, -2])], opset=13)
    np.testing.assert_array_equal(y, np.pad(x[1:, :3], [(0, 0), (2, 0)]))


def test_pad_rejects_wrap_before_19():
    with pytest.raises(InvalidGraphError, match="mode"):
        make_kernel("Pad", [f32(2), i64([1, 1])], {"mode": "wrap"}, opset=18)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_depth_to_space_and_back(mode):
    x = f32(2, 8, 3, 4)
    check("DepthToSpace", [x], {"blocksize": 2, "mode": mode}, opset=13)
    check("SpaceToDepth", [f32(2, 3, 4, 6)], {"blocksize": 2}, opset=13)


@pytest.mark.parametrize("upper", [0, 1])
def test_trilu(upper):
    for k in (None, 0, 1, -2, 9):
        inputs = [f32(2, 4, 5)] + ([] if k is None else [np.array(k, np.int64)])
        check("Trilu", inputs, {"upper": upper}, opset=14)


def test_compress_non_zero_one_hot():
    x = f32(3, 4)
    check("Compress", [x, np.array([True, False, True])], {"axis": 0}, opset=11)
    check("Compress", [x, np.array([False, True])], {"axis": -1}, opset=11)
    check("Compress", [x, rng.random(12) > 0.5], opset=11)
    check("NonZero", [np.array([[1, 0, 2], [0, 0, 3]], np.int32)], opset=13)
    check("NonZero", [np.zeros((2, 0), np.float32)], opset=13)
    check("NonZero", [np.array(3.0, np.float32)], opset=13)
    indices = i64([[0, 2], [-1, 5]])
    for axis in (-1, 0, 1):
        check("OneHot", [indices, i64(4), np.array([0.0, 1.0], np.float32)], {"axis": axis}, opset=11)
    check("OneHot", [np.array([1.0, 3.0], np.float32), np.array(3.0, np.float32), i64([-1, 9])], opset=11)
    # depth may also be a one-element vector (the reference evaluator only takes a scalar).
    (y,) = run_kernel("OneHot", [i64([2, -1]), i64([3]), i64([0, 1])], opset=11)
    np.testing.assert_array_equal(y, [[0, 0, 1], [0, 0, 1]])


@pytest.mark.parametrize("largest", [0, 1])
@pytest.mark.parametrize("axis", [0, -1])
def test_top_k(largest, axis):
    x = np.array([[3, 1, 3, 2], [1, 1, 0, 5], [2, 2, 2, 2]], np.float32)
    check("TopK", [x, i64([2])], {"axis": axis, "largest": largest}, opset=11, n_outputs=2)
    check("TopK", [x.astype(np.int32), i64([3])], {"axis": axis, "largest": largest}, opset=11, n_outputs=2)
    check("TopK", [x, i64([0])], {"axis": axis, "largest": largest}, opset=11, n_outputs=2)


def test_top_k_v1_and_v10():
    x = f32(3, 5)
    check("TopK", [x], {"k": 2}, opset=1, n_outputs=2)
    check("TopK", [x, i64([3])], {"axis": 0}, opset=10, n_outputs=2)


@pytest.mark.parametrize("sorted_", [0, 1])
def test_unique(sorted_):
    x = np.array([2, 1, 1, 3, 4, 3], np.int64)
    check("Unique", [x], {"sorted": sorted_}, opset=11, n_outputs=4)
    m = np.array([[1, 0, 0], [1, 0, 0], [2, 3, 4]], np.float32)
    check("Unique", [m], {"sorted": sorted_, "axis": 0}, opset=11, n_outputs=4)
    # Without an axis the input is flattened (the reference evaluator mishandles 2-D unsorted input).
    for actual, expected in zip(
        run_kernel("Unique", [m], {"sorted": sorted_}, opset=11, n_outputs=4),
        run_reference("Unique", [m.reshape(-1)], {"sorted": sorted_}, opset=11, n_outputs=4),
    ):
        assert_same(actual, expected)
