"""CPU kernels for elementwise, shape, reduction and generator ops, checked against onnx's
reference evaluator on single-node models (old and new opset versions, broadcasting, several
dtypes, empty tensors)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from onnx_runtime.errors import InvalidGraphError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu import ops  # noqa: F401  (fills the registry)
from onnx_runtime_ep_cpu.ops import elementwise
from onnx_runtime_ep_cpu.registry import lookup

rng = np.random.default_rng(0)


def f32(*shape, low=-3.0, high=3.0):
    return rng.uniform(low, high, shape).astype(np.float32)


def i32(*shape, low=-10, high=10):
    return rng.integers(low, high, shape).astype(np.int32)


def i64(values):
    return np.array(values, dtype=np.int64)


def make_kernel(op, inputs, attrs=None, opset=18, n_outputs=1):
    """The registered kernel for one node; ``inputs`` are arrays, or None for an omitted input."""
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    node = Node(op, names, [f"out{i}" for i in range(n_outputs)], name="n", attrs=dict(attrs or {}), opset=opset)
    factory = lookup(op, "", opset)
    assert factory is not None, f"no kernel for {op} at opset {opset}"
    return factory(node, [None if x is None else x.shape for x in inputs], opset)


def run_kernel(op, inputs, attrs=None, opset=18, n_outputs=1):
    outputs = make_kernel(op, inputs, attrs, opset, n_outputs)(*inputs)
    assert isinstance(outputs, tuple) and len(outputs) == n_outputs
    return outputs


def _elem_type(x):
    return TensorProto.STRING if x.dtype == object else helper.np_dtype_to_tensor_dtype(x.dtype)


def run_reference(op, inputs, attrs=None, opset=18, n_outputs=1):
    names = ["" if x is None else f"in{i}" for i, x in enumerate(inputs)]
    outputs = [f"out{i}" for i in range(n_outputs)]
    proto_attrs = {k: numpy_helper.from_array(v) if isinstance(v, np.ndarray) else v for k, v in (attrs or {}).items()}
    graph = helper.make_graph(
        [helper.make_node(op, names, outputs, **proto_attrs)],
        "single_node",
        [helper.make_tensor_value_info(n, _elem_type(x), x.shape) for n, x in zip(names, inputs) if n],
        [helper.make_value_info(name, onnx.TypeProto()) for name in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feeds = {n: x for n, x in zip(names, inputs) if n}
    return ReferenceEvaluator(model).run(None, feeds)


def assert_same(actual, expected):
    expected = np.asarray(expected)
    if expected.dtype.kind in "US" or actual.dtype == object:
        assert actual.dtype == object
        np.testing.assert_array_equal(actual.astype(str), expected.astype(str))
        return
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if actual.dtype.kind in "biu":
        np.testing.assert_array_equal(actual, expected)
    elif actual.dtype in (np.float32, np.float64):
        np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-6)
    else:  # float16, bfloat16, float8: compare in float32 with the narrow type's precision
        np.testing.assert_allclose(actual.astype(np.float32), expected.astype(np.float32), rtol=1e-2, atol=1e-3)


def check(op, inputs, attrs=None, opset=18, n_outputs=1):
    """Run the kernel and the reference evaluator on the same node and compare every output."""
    actual = run_kernel(op, inputs, attrs, opset, n_outputs)
    expected = run_reference(op, inputs, attrs, opset, n_outputs)
    for a, e in zip(actual, expected):
        assert_same(a, e)
    return actual


# -- elementwise --------------------------------------------------------------------------------------

UNARY_DOMAINS = {
    "Sqrt": (0.01, 5),
    "Log": (0.01, 5),
    "Reciprocal": (0.5, 5),
    "Asin": (-0.99, 0.99),
    "Acos": (-0.99, 0.99),
    "Atanh": (-0.99, 0.99),
    "Acosh": (1.01, 5),
}
UNARY_OPS = [
    "Neg", "Abs", "Sqrt", "Exp", "Log", "Reciprocal", "Floor", "Ceil", "Round", "Sign", "Tanh", "Sigmoid",
    "Softplus", "Softsign", "Mish", "HardSwish", "Erf", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh",
    "Cosh", "Asinh", "Acosh", "Atanh", "Relu", "Identity", "IsNaN",
]  # fmt: skip


@pytest.mark.parametrize("op", UNARY_OPS)
def test_unary_float(op):
    x = f32(3, 4, low=UNARY_DOMAINS.get(op, (-4, 4))[0], high=UNARY_DOMAINS.get(op, (-4, 4))[1])
    check(op, [x])
    check(op, [x.astype(np.float64)])
    check(op, [np.zeros((0, 3), np.float32)])


def test_round_is_half_to_even():
    check("Round", [np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 2.6], np.float32)], opset=11)


def test_erf_accuracy_across_ranges():
    x = np.concatenate([np.linspace(-6, 6, 2001), [0, 1e-8, -1e-4, 0.49999, 0.5, np.inf, -np.inf, np.nan]])
    check("Erf", [x.astype(np.float32)], opset=13)
    check("Erf", [x], opset=13)
    (half,) = run_kernel("Erf", [x.astype(np.float16)], opset=13)
    assert half.dtype == np.float16


def test_integer_unary_keep_dtype():
    x = np.array([-128, -3, 0, 5, 127], np.int8)
    for op in ("Neg", "Abs", "Sign"):
        check(op, [x], opset=13)
    check("Relu", [x], opset=14)
    check("Not", [np.array([True, False])], opset=1)
    check("BitwiseNot", [np.array([0, 5, 255], np.uint8)], opset=18)


@pytest.mark.parametrize(
    "op, attrs",
    [
        ("LeakyRelu", {}),
        ("LeakyRelu", {"alpha": 0.3}),
        ("Elu", {"alpha": 0.7}),
        ("Selu", {}),
        ("Selu", {"alpha": 2.0, "gamma": 3.0}),
        ("Celu", {"alpha": 1.5}),
        ("HardSigmoid", {"alpha": 0.3, "beta": 0.4}),
        ("ThresholdedRelu", {"alpha": 0.5}),
    ],
)
def test_activations_with_attributes(op, attrs):
    actual = check(op, [f32(2, 5)], attrs)
    assert actual[0].dtype == np.float32


def test_prelu_broadcasts_slope():
    check("PRelu", [f32(2, 3, 4), f32(3, 1)], opset=16)
    check("PRelu", [f32(2, 3, 4), f32(4)], opset=9)


@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div"])
@pytest.mark.parametrize("opset", [7, 14])
def test_arithmetic_broadcasting(op, opset):
    check(op, [f32(2, 3, 4), f32(3, 1)], opset=opset)
    b = i32(4)
    b[b == 0] = 3
    check(op, [i32(2, 3, 4), b], opset=opset)
    check(op, [np.zeros((0, 4), np.float32), f32(4)], opset=opset)


def test_integer_div_truncates_toward_zero():
    a = np.array([7, -7, 7, -7, 6, -1], np.int64)
    b = np.array([2, 2, -2, -2, 3, 5], np.int64)
    (y,) = check("Div", [a, b], opset=14)
    np.testing.assert_array_equal(y, [3, -3, -3, 3, 2, 0])
    check("Div", [a.astype(np.uint8) % 8, np.full(6, 3, np.uint8)], opset=14)


def test_legacy_broadcast_with_axis():
    a, b = f32(2, 3, 4), f32(3)
    (y,) = run_kernel("Add", [a, b], {"broadcast": 1, "axis": 1}, opset=6)
    np.testing.assert_array_equal(y, a + b[:, None])
    (y,) = run_kernel("Mul", [a, f32(4)], {"broadcast": 1}, opset=6)
    assert y.shape == a.shape


def test_pow_keeps_base_dtype():
    check("Pow", [f32(3, 4, low=0.1, high=3), f32(4, low=-2, high=2)], opset=15)
    check("Pow", [f32(3, 4, low=0.1, high=3), i64([1, 2, 3, 0])], opset=15)
    check("Pow", [i32(3, 4, low=1, high=5), np.array([0, 1, 2, 3], np.int32)], opset=15)
    (y,) = run_kernel("Pow", [np.array([2, 1, -1, 4], np.int64), i64([-1, -3, -3, 1])], opset=15)
    np.testing.assert_array_equal(y, [0, 1, -1, 4])


@pytest.mark.parametrize("fmod", [0, 1])
def test_mod(fmod):
    a, b = i32(4, 5), i32(5, low=1, high=6) * np.array([1, -1, 1, -1, 1], np.int32)
    check("Mod", [a, b], {"fmod": fmod}, opset=13)
    check("Mod", [f32(4, 5), f32(5, low=0.5, high=2)], {"fmod": 1}, opset=13)


@pytest.mark.parametrize("op", ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
def test_comparisons(op):
    check(op, [i32(3, 4, low=0, high=3), i32(4, low=0, high=3)], opset=16)
    check(op, [f32(3, 4), f32(3, 1)], opset=16)


def test_equal_on_strings():
    a = np.array(["a", "b", "c"], dtype=object)
    check("Equal", [a, np.array(["a", "x", "c"], dtype=object)], opset=19)


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic(op):
    check(op, [rng.random((3, 4)) > 0.5, rng.random(4) > 0.5], opset=7)


@pytest.mark.parametrize("op", ["BitwiseAnd", "BitwiseOr", "BitwiseXor"])
def test_bitwise(op):
    check(op, [i32(3, 4, low=-100, high=100), i32(4, low=-100, high=100)], opset=18)
    check(op, [np.array([1, 200], np.uint8), np.array([3, 7], np.uint8)], opset=18)


@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
def test_bit_shift(direction):
    x = np.array([1, 4, 255, 16], np.uint8)
    check("BitShift", [x, np.array([1, 2, 3, 7], np.uint8)], {"direction": direction}, opset=11)
    check("BitShift", [x.astype(np.uint64), np.array([1], np.uint64)], {"direction": direction}, opset=11)


def test_bit_shift_rejects_bad_direction():
    with pytest.raises(InvalidGraphError, match="direction"):
        make_kernel("BitShift", [i32(2), i32(2)], {"direction": "UP"}, opset=11)


def test_where_broadcasts():
    check("Where", [rng.random((3, 1)) > 0.5, f32(3, 4), f32(4)], opset=16)
    check("Where", [np.array([True, False]), np.array(["a", "b"], object), np.array(["c", "d"], object)])


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
def test_variadic(op):
    check(op, [f32(3, 4), f32(4), f32(3, 1)], opset=13)
    check(op, [f32(2, 2)], opset=13)
    if op != "Mean":
        check(op, [i32(3, 4), i32(4)], opset=13)


def test_min_max_propagate_nan():
    a = np.array([1.0, np.nan, 3.0], np.float32)
    check("Max", [a, np.array([2.0, 2.0, np.nan], np.float32)], opset=13)


def test_clip_versions():
    x = f32(3, 4)
    check("Clip", [x], {"min": -1.0, "max": 0.5}, opset=6)
    check("Clip", [x], {}, opset=6)
    check("Clip", [x, np.array(-1, np.float32), np.array(1, np.float32)], opset=11)
    check("Clip", [x, None, np.array(0.2, np.float32)], opset=13)
    check("Clip", [x, np.array(0.2, np.float32)], opset=13)
    check("Clip", [i32(5), np.array(-2, np.int32), np.array(3, np.int32)], opset=13)
    (y,) = check("Clip", [x, np.array(2, np.float32), np.array(1, np.float32)], opset=13)
    assert (y == 1).all()  # min > max gives max everywhere


def test_is_inf_and_is_nan():
    x = np.array([np.inf, -np.inf, np.nan, 0.0, 1.0], np.float32)
    for pos in (0, 1):
        for neg in (0, 1):
            check("IsInf", [x], {"detect_positive": pos, "detect_negative": neg}, opset=10)
    check("IsNaN", [x], opset=13)


CAST_TARGETS = [
    TensorProto.FLOAT,
    TensorProto.DOUBLE,
    TensorProto.FLOAT16,
    TensorProto.BFLOAT16,
    TensorProto.INT8,
    TensorProto.UINT8,
    TensorProto.INT32,
    TensorProto.INT64,
    TensorProto.BOOL,
    TensorProto.STRING,
]


@pytest.mark.parametrize("to", CAST_TARGETS)
def test_cast_numeric(to):
    check("Cast", [np.array([-2.75, -1, 0, 0.5, 1.5, 100], np.float32)], {"to": to}, opset=13)
    check("Cast", [np.array([-3, 0, 1, 7], np.int32)], {"to": to}, opset=13)
    check("Cast", [np.array([True, False])], {"to": to}, opset=13)


def test_cast_from_strings():
    s = np.array(["1.5", "-2", "1e-5", "INF", "-inf", "NaN"], dtype=object)
    check("Cast", [s], {"to": TensorProto.FLOAT}, opset=13)
    check("Cast", [s], {"to": TensorProto.DOUBLE}, opset=13)
    (y,) = run_kernel("Cast", [np.array(["12", "-3", "9000000000"], dtype=object)], {"to": TensorProto.INT64})
    np.testing.assert_array_equal(y, [12, -3, 9000000000])


def test_cast_v1_takes_a_type_name():
    (y,) = run_kernel("Cast", [i32(4)], {"to": "FLOAT"}, opset=1)
    assert y.dtype == np.float32


@pytest.mark.parametrize(
    "to", [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E4M3FNUZ, TensorProto.FLOAT8E5M2, TensorProto.FLOAT8E5M2FNUZ]
)
@pytest.mark.parametrize("saturate", [0, 1])
def test_cast_float8(to, saturate):
    x = np.array([0.0, 0.3, -1.7, 300.0, 1e6, -1e6, 60000.0], np.float32)
    actual = run_kernel("Cast", [x], {"to": to, "saturate": saturate}, opset=19)[0]
    expected = run_reference("Cast", [x], {"to": to, "saturate": saturate}, opset=19)[0]
    assert actual.dtype == expected.dtype
    np.testing.assert_array_equal(actual.astype(np.float32), expected.astype(np.float32))


@pytest.mark.parametrize("round_mode", ["up", "down", "nearest"])
def test_cast_float8e8m0(round_mode):
    x = np.array([1.0, 1.5, 3.0, 0.3, 1e30, 2.0**-120], np.float32)
    actual = run_kernel("Cast", [x], {"to": TensorProto.FLOAT8E8M0, "round_mode": round_mode}, opset=24)[0]
    expected = run_reference("Cast", [x], {"to": TensorProto.FLOAT8E8M0, "round_mode": round_mode}, opset=24)[0]
    np.testing.assert_array_equal(actual.view(np.uint8), expected.view(np.uint8))


def test_cast_int4_and_cast_like():
    check("Cast", [np.array([-8, -1, 0, 7], np.int32)], {"to": TensorProto.INT4}, opset=21)
    check("CastLike", [f32(3), np.zeros(1, np.int64)], opset=15)
    check("CastLike", [f32(3), np.zeros(1, np.float16)], opset=19)
    check("CastLike", [np.array([1.5, 1e6], np.float32), np.zeros(1, ml_dtypes.float8_e4m3fn)], opset=19)


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


# -- reduction ----------------------------------------------------------------------------------------

REDUCE_OPS = [
    "ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
    "ReduceLogSum", "ReduceLogSumExp", "ReduceSumSquare",
]  # fmt: skip


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("keepdims", [0, 1])
def test_reduce_axes_attribute(op, keepdims):
    x = f32(2, 3, 4, low=0.1, high=2)
    for axes in (None, [1], [0, -1]):
        attrs = {"keepdims": keepdims} | ({} if axes is None else {"axes": axes})
        check(op, [x], attrs, opset=11)
        check(op, [x.astype(np.float64)], attrs, opset=11)


@pytest.mark.parametrize("op", REDUCE_OPS)
def test_reduce_axes_input(op):
    x = f32(2, 3, 4, low=0.1, high=2)
    opset = 18
    check(op, [x, i64([1])], opset=opset)
    check(op, [x, i64([-1, 0])], {"keepdims": 0}, opset=opset)
    check(op, [x], opset=opset)
    check(op, [x, i64([])], opset=opset)
    (y,) = check(op, [x, i64([])], {"noop_with_empty_axes": 1}, opset=opset)
    assert y.shape == x.shape


@pytest.mark.parametrize("op", ["ReduceSum", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceMean"])
def test_reduce_integers_keep_dtype(op):
    x = i32(3, 4, low=-3, high=4)
    (y,) = check(op, [x], {"axes": [1]}, opset=11)
    assert y.dtype == np.int32


def test_reduce_sum_versions_and_empty():
    x = f32(2, 3)
    check("ReduceSum", [x, i64([1])], opset=13)
    check("ReduceSum", [x], {"axes": [1]}, opset=11)
    empty = np.zeros((0, 3), np.float32)
    for op in ("ReduceSum", "ReduceProd", "ReduceMax", "ReduceMin", "ReduceLogSumExp", "ReduceL2"):
        check(op, [empty, i64([0])], opset=18)
    check("ReduceMax", [np.array([[True, False], [False, False]]), i64([1])], opset=20)


def test_reduce_log_sum_exp_is_stable():
    x = np.array([[1000.0, 1000.0], [-np.inf, -np.inf]], np.float32)
    (y,) = run_kernel("ReduceLogSumExp", [x, i64([1])], opset=18)
    np.testing.assert_allclose(y[:, 0], [1000 + np.log(2), -np.inf])


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("select_last_index", [0, 1])
def test_arg_max_min(op, select_last_index):
    x = np.array([[3, 1, 3, 1], [2, 2, 0, 0]], np.int32)
    for axis in (0, 1, -1):
        for keepdims in (0, 1):
            attrs = {"axis": axis, "keepdims": keepdims, "select_last_index": select_last_index}
            check(op, [x], attrs, opset=13)
    check(op, [f32(3, 4)], {}, opset=1)


@pytest.mark.parametrize("exclusive", [0, 1])
@pytest.mark.parametrize("reverse", [0, 1])
def test_cum_sum(exclusive, reverse):
    attrs = {"exclusive": exclusive, "reverse": reverse}
    check("CumSum", [f32(3, 4), np.array(1, np.int32)], attrs, opset=14)
    check("CumSum", [i32(3, 4), i64(-2)], attrs, opset=14)
    check("CumSum", [i32(5), i64(0)], attrs, opset=11)


# -- generators ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attrs",
    [
        {"value": np.arange(6, dtype=np.float32).reshape(2, 3)},
        {"value": np.array(["a", "bc"], dtype=object)},
        {"value_float": 1.5},
        {"value_floats": [1.0, 2.5]},
        {"value_int": 7},
        {"value_ints": [1, -2, 3]},
        {"value_string": "hello"},
        {"value_strings": ["x", "yz"]},
    ],
)
def test_constant(attrs):
    check("Constant", [], attrs, opset=13)


def test_constant_needs_exactly_one_value():
    with pytest.raises(InvalidGraphError, match="Constant"):
        make_kernel("Constant", [], {"value_int": 1, "value_float": 2.0}, opset=13)


def test_constant_of_shape():
    check("ConstantOfShape", [i64([2, 3])], opset=9)
    check("ConstantOfShape", [i64([2, 0])], opset=9)
    check("ConstantOfShape", [i64([])], {"value": np.array([4], np.int32)}, opset=9)
    check("ConstantOfShape", [i64([3])], {"value": np.array([True])}, opset=20)


def test_range():
    check("Range", [np.array(3, np.int64), np.array(9, np.int64), np.array(3, np.int64)], opset=11)
    check("Range", [np.array(10, np.int32), np.array(4, np.int32), np.array(-2, np.int32)], opset=11)
    check("Range", [np.array(1, np.int32), np.array(1, np.int32), np.array(2, np.int32)], opset=11)
    check("Range", [np.array(0.5, np.float32), np.array(3.2, np.float32), np.array(0.3, np.float32)], opset=11)
    check("Range", [np.array(5, np.float64), np.array(-1, np.float64), np.array(-1.5, np.float64)], opset=11)
    # stash_type=1 computes a float16 range in float32, rounding each element once.
    (y,) = run_kernel("Range", [np.array(v, np.float16) for v in (0.1, 40, 0.1)], opset=27)
    steps = np.arange(y.size, dtype=np.float32)
    np.testing.assert_array_equal(y, (np.float32(np.float16(0.1)) * (steps + 1)).astype(np.float16))


def test_eye_like():
    check("EyeLike", [f32(3, 4)], opset=9)
    check("EyeLike", [f32(4, 3)], {"k": -1, "dtype": TensorProto.INT32}, opset=9)
    check("EyeLike", [i32(3, 3)], {"k": 2}, opset=9)


@pytest.mark.parametrize("op", ["RandomUniform", "RandomNormal"])
def test_random(op):
    attrs = {"shape": [200, 3], "seed": 5.0, "dtype": TensorProto.DOUBLE}
    if op == "RandomUniform":
        attrs |= {"low": 2.0, "high": 3.0}
    first = run_kernel(op, [], attrs, opset=1)[0]
    again = run_kernel(op, [], attrs, opset=1)[0]
    assert first.shape == (200, 3) and first.dtype == np.float64
    np.testing.assert_array_equal(first, again)  # same seed, same values
    if op == "RandomUniform":
        assert ((first >= 2) & (first < 3)).all()
    (like,) = run_kernel(op + "Like", [np.zeros((2, 5), np.float16)], {}, opset=1)
    assert like.shape == (2, 5) and like.dtype == np.float16


def test_bernoulli():
    p = np.array([0.0, 1.0, 0.0, 1.0], np.float32)
    (y,) = run_kernel("Bernoulli", [p], {"seed": 1.0}, opset=15)
    np.testing.assert_array_equal(y, p)
    (y,) = run_kernel("Bernoulli", [p], {"dtype": TensorProto.INT64}, opset=15)
    assert y.dtype == np.int64


# -- invalid attributes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "op, inputs, attrs, opset, attribute",
    [
        ("Mod", [i32(2), i32(2)], {"fmod": 2}, 13, "fmod"),
        ("DepthToSpace", [f32(1, 4, 1, 1)], {"blocksize": 2, "mode": "XYZ"}, 13, "mode"),
        ("SpaceToDepth", [f32(1, 4, 2, 2)], {}, 13, "blocksize"),
        ("ScatterND", [f32(2), i64([[0]]), f32(1)], {"reduction": "mean"}, 18, "reduction"),
        ("Cast", [f32(2)], {"to": 999}, 19, "to"),
        ("Cast", [f32(2)], {"to": TensorProto.FLOAT8E8M0, "round_mode": "odd"}, 24, "round_mode"),
        ("Unsqueeze", [f32(2)], {}, 11, "axes"),
    ],
)
def test_invalid_attributes_name_node_and_attribute(op, inputs, attrs, opset, attribute):
    with pytest.raises(InvalidGraphError, match=f"'n'.*{attribute}"):
        make_kernel(op, inputs, attrs, opset)


@pytest.mark.parametrize("op", sorted(elementwise._NEVER_WARN - {"Not", "BitwiseNot"}))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, ml_dtypes.bfloat16])
def test_unary_ops_run_without_errstate_never_warn(op, dtype):
    # These kernels skip np.errstate (its cost exceeds theirs on small tensors): they must not raise
    # a floating-point error for any value, even with every numpy warning turned into an error.
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1e4, -1e4, 6e4, 1e-8, 2.5, -2.5]).astype(dtype)
    kernel = make_kernel(op, [x], opset=20)
    with np.errstate(all="raise"):
        (y,) = kernel(x)
    assert y.shape == x.shape
