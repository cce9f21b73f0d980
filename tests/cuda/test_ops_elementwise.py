"""CUDA elementwise operators (kernels/elementwise.cu, ops/elementwise.py) against the CPU provider.

Runs on the simulator (``ONNX_RUNTIME_CUDA_SIM=1``) by default; with ``ONNX_RUNTIME_CUDA_TESTS=real`` the same
tests run against the real driver on a GPU machine. The backend-case harness here is shared with
test_ops_reduce.py and test_ops_normalization.py.
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper

driver = pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
import onnx_runtime as ort  # noqa: E402
from onnx_runtime_ep_cuda import nvrtc  # noqa: E402
from onnx_runtime_ep_cuda.ops import elementwise  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance"))
from backend_cases import _normalize, assert_similar, exclusions, known_failures, node_cases  # noqa: E402

REAL = os.environ.get("ONNX_RUNTIME_CUDA_TESTS", "").lower() == "real"
CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
CPU = ["CPUExecutionProvider"]
BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module", autouse=True)
def device_mode():
    """The simulator unless the real driver was asked for; skips when the chosen one is not usable. The
    provider registry caches availability at discovery (an earlier test may have found no driver), so it
    is refreshed on the way in and out."""
    from onnx_runtime.discovery import registry

    with pytest.MonkeyPatch.context() as patch:
        if REAL:
            patch.delenv(driver.SIM_ENV, raising=False)
        else:
            patch.setenv(driver.SIM_ENV, "1")
        reason = driver.probe()
        if reason:
            pytest.skip(f"the CUDA {'driver' if REAL else 'simulator'} is not usable: {reason}")
        registry().refresh()
        yield
    registry().refresh()


# -- shared harness -------------------------------------------------------------------------------------------


def backend_cases_for(ops: set[str]) -> list[str]:
    """Names of onnx backend node cases built only from ``ops`` (and not excluded or failing on the CPU)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = node_cases()
    skip = set(exclusions()) | set(known_failures())
    return sorted(name for name, case in cases.items()
                  if name not in skip and {n.op_type for n in case.model.graph.node} <= ops)


def run_backend_case(name: str) -> None:
    """Run a backend case with CUDA first; skip when some node is declined (the reasons say why)."""
    case = node_cases()[name]
    session = ort.InferenceSession(case.model.SerializeToString(), providers=CUDA)
    declined = {f"{n.op_type}: {n.rejected.get('CUDAExecutionProvider')}" for n in session.placement()
                if n.provider != "CUDAExecutionProvider"}
    if declined:
        pytest.skip("; ".join(sorted(declined)))
    graph = case.model.graph
    names = [vi.name for vi in graph.input if vi.name not in {i.name for i in graph.initializer}]
    for inputs, expected in case.data_sets:
        outputs = session.run(None, dict(zip(names, [_normalize(v) for v in inputs])))
        assert_similar([_normalize(v) for v in expected], outputs, case.rtol, case.atol)


def single_node_model(op: str, inputs, outputs, attrs=None, opset: int = 17, domain: str = "",
                      initializers=()) -> bytes:
    """A one-node model; ``inputs`` and ``outputs`` are (name, TensorProto type, shape or None)."""
    node = helper.make_node(op, [i[0] for i in inputs], [o[0] for o in outputs], domain=domain, **(attrs or {}))
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(*i) for i in inputs
                                            if i[0] and i[0] not in {t.name for t in initializers}],
                              [helper.make_tensor_value_info(*o) for o in outputs], initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model.SerializeToString()


def on_cuda(model: bytes) -> ort.InferenceSession:
    """A CUDA-first session whose nodes all run on CUDA (fails with the reasons otherwise)."""
    session = ort.InferenceSession(model, providers=CUDA)
    declined = {n.op_type: n.rejected for n in session.placement() if n.provider != "CUDAExecutionProvider"}
    assert not declined, declined
    return session


def compare_with_cpu(model: bytes, feeds: dict, rtol: float = 1e-5, atol: float = 1e-6) -> list:
    """Run ``model`` on CUDA (every node) and on the CPU provider; assert equal dtypes, shapes and values."""
    got = on_cuda(model).run(None, feeds)
    want = ort.InferenceSession(model, providers=CPU).run(None, feeds)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        if w.dtype.kind in "biu":
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=rtol, atol=atol)
    return got


def cuda_reason(model: bytes) -> str:
    """Why the CUDA provider declined the model's only node."""
    [node] = ort.InferenceSession(model, providers=CUDA).placement()
    assert node.provider == "CPUExecutionProvider"
    return node.rejected["CUDAExecutionProvider"]


ONNX_TYPE = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
             np.dtype(BF16): TensorProto.BFLOAT16, np.dtype(np.float64): TensorProto.DOUBLE,
             np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8,
             np.dtype(np.int16): TensorProto.INT16, np.dtype(np.uint16): TensorProto.UINT16,
             np.dtype(np.int32): TensorProto.INT32, np.dtype(np.uint32): TensorProto.UINT32,
             np.dtype(np.int64): TensorProto.INT64, np.dtype(np.uint64): TensorProto.UINT64,
             np.dtype(np.bool_): TensorProto.BOOL}


def random(shape, dtype, rng, low=-3.0, high=3.0):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -100), min(info.max, 100), size=shape, endpoint=True).astype(dtype)
    return rng.uniform(low, high, size=shape).astype(dtype)


# -- onnx backend cases ---------------------------------------------------------------------------------------

ELEMENTWISE_OPS = {
    "Abs", "Neg", "Exp", "Log", "Sqrt", "Reciprocal", "Relu", "LeakyRelu", "Sigmoid", "Tanh", "Erf", "Gelu",
    "Softplus", "Softsign", "Floor", "Ceil", "Round", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh",
    "Asinh", "Acosh", "Atanh", "Elu", "Selu", "Celu", "ThresholdedRelu", "HardSigmoid", "HardSwish", "Mish", "Sign",
    "Not", "Identity", "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Equal", "Less", "Greater",
    "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "Where", "Cast", "CastLike", "Clip",
}


@pytest.mark.parametrize("name", backend_cases_for(ELEMENTWISE_OPS))
def test_backend_case(name):
    run_backend_case(name)


# -- kernel sources and registry ------------------------------------------------------------------------------


def _enum(name: str) -> tuple[str, ...]:
    source = nvrtc.kernel_source("elementwise.cu")
    body = re.search(r"enum " + name + r" \{(.*?)\};", source, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    return tuple(item.strip().split("_", 1)[1].lower() for item in body.split(",") if item.strip())


def test_op_codes_match_the_kernel_enums():
    assert _enum("UnaryOp") == elementwise.UNARY_OPS
    assert _enum("BinaryOp") == elementwise.BINARY_OPS


# -- unary ----------------------------------------------------------------------------------------------------

FLOAT_UNARY = ["Exp", "Log", "Sqrt", "Reciprocal", "Sigmoid", "Tanh", "Erf", "Softplus", "Softsign", "Floor", "Ceil",
               "Round", "Sin", "Cos", "Tan", "Atan", "Sinh", "Cosh", "Asinh", "Elu", "Selu", "HardSigmoid",
               "HardSwish", "LeakyRelu", "Relu", "Abs", "Neg", "Sign"]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, BF16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("op", FLOAT_UNARY)
def test_float_unary(op, dtype):
    rng = np.random.default_rng(len(op))
    low = 0.1 if op in ("Log", "Sqrt") else -3.0
    x = random((3, 257), dtype, rng, low=low)  # 771 elements: not a multiple of the block size
    x.flat[:3] = [0.0, 0.5, -0.5] if op not in ("Log", "Sqrt") else [1.0, 0.5, 2.5]
    t = ONNX_TYPE[np.dtype(dtype)]
    model = single_node_model(op, [("x", t, None)], [("y", t, None)], opset=18)
    tight = dtype == np.float32
    compare_with_cpu(model, {"x": x}, rtol=1e-5 if tight else 1e-2, atol=1e-6 if tight else 1e-2)


def test_float_unary_special_values():
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 80.0, -80.0, 1e-30], np.float32)
    for op in ("Relu", "Sigmoid", "Softplus", "Abs", "Sign", "Tanh", "Exp", "LeakyRelu", "HardSigmoid"):
        model = single_node_model(op, [("x", TensorProto.FLOAT, None)], [("y", TensorProto.FLOAT, None)])
        got, = on_cuda(model).run(None, {"x": x})
        want, = ort.InferenceSession(model, providers=CPU).run(None, {"x": x})
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=op)


@pytest.mark.parametrize("op,alpha", [("Gelu", "none"), ("Gelu", "tanh")])
def test_gelu(op, alpha):
    x = np.linspace(-6, 6, 1001, dtype=np.float32)
    model = single_node_model(op, [("x", TensorProto.FLOAT, None)], [("y", TensorProto.FLOAT, None)],
                              {"approximate": alpha}, opset=20)
    compare_with_cpu(model, {"x": x}, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint32])
@pytest.mark.parametrize("op", ["Abs", "Neg", "Relu", "Sign"])
def test_integer_unary(op, dtype):
    if op in ("Neg", "Relu") and np.dtype(dtype).kind == "u":
        pytest.skip("ONNX defines it for signed types only")
    x = random((5, 7), dtype, np.random.default_rng(0))
    t = ONNX_TYPE[np.dtype(dtype)]
    compare_with_cpu(single_node_model(op, [("x", t, None)], [("y", t, None)], opset=18), {"x": x})


def test_not_and_identity():
    x = np.random.default_rng(1).random((4, 5)) < 0.5
    compare_with_cpu(single_node_model("Not", [("x", TensorProto.BOOL, None)], [("y", TensorProto.BOOL, None)]),
                     {"x": x})
    for dtype in (np.float32, np.int64, np.uint16, np.float64, np.bool_):
        x = random((3, 3), dtype, np.random.default_rng(2))
        t = ONNX_TYPE[np.dtype(dtype)]
        compare_with_cpu(single_node_model("Identity", [("x", t, None)], [("y", t, None)]), {"x": x})


def test_empty_tensors():
    model = single_node_model("Exp", [("x", TensorProto.FLOAT, None)], [("y", TensorProto.FLOAT, None)])
    got, = on_cuda(model).run(None, {"x": np.zeros((0, 3), np.float32)})
    assert got.shape == (0, 3)
    model = single_node_model("Add", [("a", TensorProto.FLOAT, None), ("b", TensorProto.FLOAT, None)],
                              [("y", TensorProto.FLOAT, None)])
    got, = on_cuda(model).run(None, {"a": np.zeros((0, 3), np.float32), "b": np.ones((1, 3), np.float32)})
    assert got.shape == (0, 3)


# -- binary ---------------------------------------------------------------------------------------------------

SHAPE_PAIRS = [
    ((1000,), (1000,)),  # equal shapes: rank 1 after collapsing
    ((3, 4, 5), ()),  # scalar operand
    ((), (2, 3)),
    ((2, 3, 4, 5), (3, 1, 5)),
    ((4, 1), (1, 6)),  # both broadcast
    ((2, 1, 3, 1, 2), (1, 4, 1, 5, 1)),
    ((2, 1, 2, 1, 2, 1, 2, 3), (1, 2, 1, 2, 1, 2, 1, 3)),  # rank 8, nothing collapses
    ((7, 33, 9), (7, 1, 9)),
]


@pytest.mark.parametrize("shapes", SHAPE_PAIRS, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Max", "Min", "Less", "Equal"])
def test_broadcasting(op, shapes):
    rng = np.random.default_rng(3)
    a, b = random(shapes[0], np.float32, rng), random(shapes[1], np.float32, rng, low=0.5)
    out = TensorProto.BOOL if op in ("Less", "Equal") else TensorProto.FLOAT
    model = single_node_model(op, [("a", TensorProto.FLOAT, None), ("b", TensorProto.FLOAT, None)],
                              [("y", out, None)], opset=13)
    got, = compare_with_cpu(model, {"a": a, "b": b})
    assert got.shape == np.broadcast_shapes(a.shape, b.shape)


BINARY_DTYPES = [np.float32, np.float16, BF16, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
                 np.uint64]


@pytest.mark.parametrize("dtype", BINARY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_binary_dtypes(dtype):
    rng = np.random.default_rng(4)
    a, b = random((3, 5, 7), dtype, rng), random((5, 1), dtype, rng)
    if np.dtype(dtype).kind in "iu":
        b[b == 0] = 3
    t = ONNX_TYPE[np.dtype(dtype)]
    tol = {"rtol": 1e-2, "atol": 1e-2} if np.dtype(dtype).itemsize == 2 and np.dtype(dtype).kind not in "iu" else {}
    for op in ("Add", "Sub", "Mul", "Div", "Max", "Min", "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"):
        out = TensorProto.BOOL if "Less" in op or "Greater" in op or op == "Equal" else t
        model = single_node_model(op, [("a", t, None), ("b", t, None)], [("y", out, None)], opset=14)
        compare_with_cpu(model, {"a": a, "b": b}, **tol)


def test_integer_division_edges():
    a = np.array([7, -7, 7, -7, -128, 5, -5, 0], np.int8)
    b = np.array([2, 2, -2, -2, -1, 0, 0, 3], np.int8)
    model = single_node_model("Div", [("a", TensorProto.INT8, None), ("b", TensorProto.INT8, None)],
                              [("y", TensorProto.INT8, None)], opset=14)
    got, = on_cuda(model).run(None, {"a": a, "b": b})
    np.testing.assert_array_equal(got, [3, -3, -3, 3, -128, 0, 0, 0])  # truncation; x / 0 is 0 as in numpy


def test_integer_overflow_wraps():
    a = np.array([2**31 - 1, -(2**31), 70000], np.int32)
    b = np.array([1, -1, 70000], np.int32)
    for op in ("Add", "Sub", "Mul"):
        model = single_node_model(op, [("a", TensorProto.INT32, None), ("b", TensorProto.INT32, None)],
                                  [("y", TensorProto.INT32, None)], opset=14)
        with np.errstate(over="ignore"):
            compare_with_cpu(model, {"a": a, "b": b})


def test_nan_propagates_through_max_and_min():
    a = np.array([np.nan, 1.0, 2.0, np.nan], np.float32)
    b = np.array([1.0, np.nan, 1.0, np.nan], np.float32)
    for op in ("Max", "Min"):
        model = single_node_model(op, [("a", TensorProto.FLOAT, None), ("b", TensorProto.FLOAT, None)],
                                  [("y", TensorProto.FLOAT, None)], opset=13)
        got, = on_cuda(model).run(None, {"a": a, "b": b})
        np.testing.assert_array_equal(np.isnan(got), [True, True, False, True])


def test_logic():
    rng = np.random.default_rng(5)
    a, b = rng.random((3, 4)) < 0.5, rng.random((4,)) < 0.5
    for op in ("And", "Or", "Xor", "Equal"):
        model = single_node_model(op, [("a", TensorProto.BOOL, None), ("b", TensorProto.BOOL, None)],
                                  [("y", TensorProto.BOOL, None)], opset=13)
        compare_with_cpu(model, {"a": a, "b": b})


def test_legacy_broadcast_attribute():
    a = np.random.default_rng(6).random((2, 3, 4, 5)).astype(np.float32)
    b = np.arange(3, dtype=np.float32)
    model = single_node_model("Add", [("a", TensorProto.FLOAT, None), ("b", TensorProto.FLOAT, None)],
                              [("y", TensorProto.FLOAT, None)], {"broadcast": 1, "axis": 1}, opset=6)
    got, = on_cuda(model).run(None, {"a": a, "b": b})
    np.testing.assert_allclose(got, a + b.reshape(3, 1, 1))


@pytest.mark.parametrize("base,exponent", [(np.float32, np.float32), (np.float32, np.int64), (np.float32, np.uint32),
                                           (np.float16, np.float16), (BF16, np.float32), (np.int32, np.int32),
                                           (np.int64, np.float32), (np.int32, np.int64)])
def test_pow(base, exponent):
    rng = np.random.default_rng(7)
    a = random((4, 6), base, rng, low=0.5, high=3.0)
    b = (random((6,), exponent, rng, low=-2.0, high=3.0) if np.dtype(exponent).kind == "f"
         else np.arange(6).astype(exponent) % 4)
    tb, te = ONNX_TYPE[np.dtype(base)], ONNX_TYPE[np.dtype(exponent)]
    model = single_node_model("Pow", [("a", tb, None), ("b", te, None)], [("y", tb, None)], opset=15)
    compare_with_cpu(model, {"a": a, "b": b}, rtol=1e-2 if np.dtype(base).itemsize == 2 else 1e-5)


def test_integer_pow_is_exact():
    a = np.array([3, -3, 7, 2, 2], np.int64)
    b = np.array([20, 21, 15, 62, -1], np.int64)
    model = single_node_model("Pow", [("a", TensorProto.INT64, None), ("b", TensorProto.INT64, None)],
                              [("y", TensorProto.INT64, None)], opset=15)
    compare_with_cpu(model, {"a": a, "b": b})


@pytest.mark.parametrize("op", ["Max", "Min", "Sum", "Mean"])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_variadic(op, count):
    rng = np.random.default_rng(8)
    shapes = [(2, 3, 4), (3, 1), (4,)][:count]
    feeds = {f"x{i}": random(s, np.float32, rng) for i, s in enumerate(shapes)}
    model = single_node_model(op, [(k, TensorProto.FLOAT, None) for k in feeds], [("y", TensorProto.FLOAT, None)],
                              opset=13)
    compare_with_cpu(model, feeds)


def test_variadic_half_precision():
    rng = np.random.default_rng(9)
    feeds = {"a": random((5, 6), np.float16, rng), "b": random((6,), np.float16, rng)}
    model = single_node_model("Mean", [(k, TensorProto.FLOAT16, None) for k in feeds],
                              [("y", TensorProto.FLOAT16, None)], opset=13)
    compare_with_cpu(model, feeds, rtol=1e-3, atol=1e-3)


# -- Where, Cast, Clip ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.uint8, np.bool_, np.float64])
def test_where(dtype):
    rng = np.random.default_rng(10)
    c = rng.random((3, 1, 5)) < 0.5
    x, y = random((4, 5), dtype, rng), random((3, 4, 1), dtype, rng)
    t = ONNX_TYPE[np.dtype(dtype)]
    model = single_node_model("Where", [("c", TensorProto.BOOL, None), ("x", t, None), ("y", t, None)],
                              [("z", t, None)], opset=16)
    compare_with_cpu(model, {"c": c, "x": x, "y": y})


CAST_DTYPES = [np.float32, np.float16, BF16, np.int32, np.int64, np.bool_, np.uint8, np.int8]


@pytest.mark.parametrize("target", CAST_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("source", CAST_DTYPES, ids=lambda d: np.dtype(d).name)
def test_cast(source, target):
    x = np.array([0, 1, -1, 2.5, -2.75, 100, 127, -128, 3, 0.25, 7, -7] * 3, np.float32)
    if np.dtype(source).kind == "u":
        x = np.abs(x)
    x = x.astype(source)
    model = single_node_model("Cast", [("x", ONNX_TYPE[np.dtype(source)], None)],
                              [("y", ONNX_TYPE[np.dtype(target)], None)], {"to": ONNX_TYPE[np.dtype(target)]}, opset=19)
    got, = on_cuda(model).run(None, {"x": x})
    with np.errstate(invalid="ignore"):  # out of range: undefined, not compared below
        want = x.astype(target)
    assert got.dtype == want.dtype
    # ONNX leaves a float cast to an integer type undefined out of the target's range: only values in range
    # are compared (an integer cast out of range wraps, which the spec defines, and is compared).
    checked = np.ones(x.shape, bool)
    if np.dtype(source).kind not in "biu" and np.dtype(target).kind in "iu":
        info, whole = np.iinfo(target), np.trunc(x.astype(np.float64))
        checked = (whole >= info.min) & (whole <= info.max)
    np.testing.assert_array_equal(got.astype(np.float64)[checked], want.astype(np.float64)[checked])


def test_cast_like_and_float_specials():
    x = np.array([np.nan, np.inf, -np.inf, 65504, 70000, 1e-8, 3.14159], np.float32)
    like = np.zeros(1, np.float16)
    model = single_node_model("CastLike", [("x", TensorProto.FLOAT, None), ("like", TensorProto.FLOAT16, None)],
                              [("y", TensorProto.FLOAT16, None)], opset=19)
    got, = on_cuda(model).run(None, {"x": x, "like": like})
    with np.errstate(over="ignore"):  # 70000 overflows float16 to inf on purpose
        np.testing.assert_array_equal(got, x.astype(np.float16))
    model = single_node_model("Cast", [("x", TensorProto.FLOAT, None)], [("y", TensorProto.BFLOAT16, None)],
                              {"to": TensorProto.BFLOAT16}, opset=19)
    got, = on_cuda(model).run(None, {"x": x})
    np.testing.assert_array_equal(got.astype(np.float32), x.astype(BF16).astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int8, np.int64, np.uint32])
@pytest.mark.parametrize("bounds", ["both", "min", "max", "none", "inverted"])
def test_clip(dtype, bounds):
    rng = np.random.default_rng(11)
    x = random((6, 7), dtype, rng)
    low, high = {"both": (-1, 2), "min": (-1, None), "max": (None, 2), "none": (None, None),
                 "inverted": (3, 1)}[bounds]
    if np.dtype(dtype).kind == "u":
        low = None if low is None else abs(low)
    t = ONNX_TYPE[np.dtype(dtype)]
    feeds, inputs = {"x": x}, [("x", t, None)]
    for name, value in (("lo", low), ("hi", high)):
        if value is None:
            inputs.append(("", t, None))
        else:
            feeds[name] = np.array(value, dtype)
            inputs.append((name, t, []))
    model = single_node_model("Clip", inputs, [("y", t, None)], opset=13)
    compare_with_cpu(model, feeds)


def test_clip_attributes_before_opset_11():
    x = np.linspace(-3, 3, 50, dtype=np.float32)
    model = single_node_model("Clip", [("x", TensorProto.FLOAT, None)], [("y", TensorProto.FLOAT, None)],
                              {"min": -1.0, "max": 0.5}, opset=6)
    compare_with_cpu(model, {"x": x})


# -- what is declined ------------------------------------------------------------------------------------------


def test_unsupported_cases_fall_back_with_reasons():
    assert "input 0 is double" in cuda_reason(single_node_model(
        "Exp", [("x", TensorProto.DOUBLE, None)], [("y", TensorProto.DOUBLE, None)]))
    rank9 = [("a", TensorProto.FLOAT, [1] * 9), ("b", TensorProto.FLOAT, [1] * 9)]
    assert "rank up to 8" in cuda_reason(single_node_model("Add", rank9, [("y", TensorProto.FLOAT, None)]))
    assert "casts to" in cuda_reason(single_node_model(
        "Cast", [("x", TensorProto.FLOAT, None)], [("y", TensorProto.DOUBLE, None)], {"to": TensorProto.DOUBLE}))
    assert "approximate" in cuda_reason(single_node_model(
        "Gelu", [("x", TensorProto.FLOAT, None)], [("y", TensorProto.FLOAT, None)], {"approximate": "erf"}, opset=20))
