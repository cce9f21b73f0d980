"""A streaming model's small closing nodes keep their last call (issue 19: small graphs called every frame): a small
float32 Gemm by constant weights runs compiled/small_gemm.py's loop through its bound entry point, Softmax and
LogSoftmax call their rows' bound entry point, and a Gather by a constant index keeps its view's key. Each agrees
with a float64 reference (onnx's formulas) on the kept call and on every call that differs from it (another shape,
dtype, layout, fed weights or indices), and nothing is bound while numba is still loading."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.ops import linalg, shape, softmax

CPU = ["CPUExecutionProvider"]


@pytest.fixture(autouse=True)
def loops_linked(monkeypatch):
    """As after the background loader's switch: compiled loops serve (not numpy meanwhile)."""
    monkeypatch.setattr(deferred, "numpy_first", lambda *kinds: False)
    monkeypatch.setattr(linalg, "numpy_first", lambda *kinds: False)
    monkeypatch.setattr(deferred.state, "guarding", False)
    monkeypatch.setattr(deferred.state, "deferring", False)


@pytest.fixture()
def binds(monkeypatch):
    """The small Gemm's bind attempts: whether each found an entry point."""
    found: list[bool] = []
    real = linalg._bind_small  # noqa: SLF001 (spied on)

    def spy(*args):
        result = real(*args)
        found.append(result is not None)
        return result

    monkeypatch.setattr(linalg, "_bind_small", spy)
    return found


def _gemm_reference(a, b, c, trans_b: bool):
    y = a.astype(np.float64) @ (b.T if trans_b else b).astype(np.float64)
    return y if c is None else y + c.astype(np.float64)


def _gemm_session(rows, depth, columns, trans_b: bool, c_shape, c_fed=False, seed=0):
    rng = np.random.default_rng(seed)
    b = rng.standard_normal((columns, depth) if trans_b else (depth, columns)).astype(np.float32)
    c = None if c_shape is None else rng.standard_normal(c_shape).astype(np.float32)
    inputs, initializers, infos = ["a", "b"], [numpy_helper.from_array(b, "b")], [tensor_info("a", shape=[rows, depth])]
    if c is not None:
        inputs.append("c")
        if c_fed:
            infos.append(tensor_info("c", shape=list(c_shape)))
        else:
            initializers.append(numpy_helper.from_array(c, "c"))
    node = helper.make_node("Gemm", inputs, ["y"], transB=int(trans_b))
    model = make_model([node], infos, [tensor_info("y", shape=[rows, columns])], initializers)
    return ort.InferenceSession(model.SerializeToString(), providers=CPU), b, c


@pytest.mark.parametrize("rows, depth, columns, trans_b, c_shape, bound", [
    (1, 64, 12, True, (12,), True), (1, 64, 30, True, (1, 30), True), (4, 64, 30, True, None, True),
    (2, 64, 64, False, (64,), True), (1, 7, 5, False, (1, 5), True), (3, 17, 9, True, (9,), True),
    (4, 64, 30, False, (30,), False),  # K x N weights past two rows: BLAS's
    (16, 64, 64, True, (64,), False),  # past SMALL_GEMM_MACS
    (1, 128, 96, True, (96,), True), (1, 256, 128, True, None, True),  # one row by transposed weights: further
    (2, 128, 96, True, (96,), False), (1, 128, 96, False, (96,), False),
])
def test_small_gemm_bound_and_within_float32_rounding(binds, rows, depth, columns, trans_b, c_shape, bound):
    session, b, c = _gemm_session(rows, depth, columns, trans_b, c_shape)
    rng = np.random.default_rng(1)
    for _ in range(4):  # the first call binds; the rest run the bound entry point
        a = rng.standard_normal((rows, depth)).astype(np.float32)
        (y,) = session.run(None, {"a": a})
        assert y.dtype == np.float32 and y.shape == (rows, columns)
        np.testing.assert_allclose(y, _gemm_reference(a, b, c, trans_b), rtol=1e-5, atol=1e-5 * np.sqrt(depth))
    assert (True in binds) == bound, binds
    assert binds.count(True) <= 1  # bound once, then kept


def test_fed_c_is_not_bound_and_each_value_is_used(binds):
    session, b, _ = _gemm_session(1, 64, 12, True, (12,), c_fed=True)
    a = np.random.default_rng(2).standard_normal((1, 64)).astype(np.float32)
    for value in (0.0, 1.0, -3.0, 7.5):
        c = np.full(12, value, np.float32)
        (y,) = session.run(None, {"a": a, "c": c})
        np.testing.assert_allclose(y, _gemm_reference(a, b, c, True), rtol=1e-5, atol=1e-4)
    assert True not in binds


def _gemm_kernel(rows, depth, columns, trans_b: bool):
    node = Node("Gemm", ["a", "b", "c"], ["y"], name="g", attrs={"transB": int(trans_b)}, opset=13)
    return linalg.gemm_7(node, [(rows, depth), (columns, depth) if trans_b else (depth, columns), (columns,)], 13)


def test_bound_gemm_serves_only_its_own_call(binds):
    kernel = _gemm_kernel(2, 64, 12, True)
    rng = np.random.default_rng(3)
    b = rng.standard_normal((12, 64)).astype(np.float32)
    c = rng.standard_normal(12).astype(np.float32)
    b.flags.writeable = c.flags.writeable = False
    a = rng.standard_normal((2, 64)).astype(np.float32)
    for _ in range(2):
        np.testing.assert_allclose(kernel(a, b, c)[0], _gemm_reference(a, b, c, True), rtol=1e-5, atol=1e-4)
    assert binds == [True]
    wide = rng.standard_normal((2, 128)).astype(np.float32)[:, ::2]  # the kept shape, not contiguous
    other_b = b + 1  # another (writable) weight array
    doubled = a.astype(np.float64)
    for args in ((wide, b, c), (a, other_b, c), (a, b, None), (doubled, b.astype(np.float64), c.astype(np.float64))):
        (y,) = kernel(*args)
        np.testing.assert_allclose(y, _gemm_reference(*args, True), rtol=1e-5, atol=1e-4)
        assert y.dtype == args[0].dtype


def test_nothing_bound_while_numba_loads(binds, monkeypatch):
    monkeypatch.setattr(linalg, "numpy_first", lambda *kinds: True)
    session, b, c = _gemm_session(1, 64, 12, True, (12,))
    a = np.random.default_rng(4).standard_normal((1, 64)).astype(np.float32)
    for _ in range(4):
        np.testing.assert_allclose(session.run(None, {"a": a})[0], _gemm_reference(a, b, c, True), rtol=1e-5,
                                   atol=1e-4)
    assert binds and True not in binds


# -- Softmax / LogSoftmax -----------------------------------------------------------------------------------------


def _softmax_reference(x, axis: int, flattened: bool, log: bool):
    x = x.astype(np.float64)
    shaped = x.reshape(int(np.prod(x.shape[:axis])), -1) if flattened else np.moveaxis(x, axis, -1)
    shifted = shaped - shaped.max(axis=-1, keepdims=True)
    total = np.exp(shifted).sum(axis=-1, keepdims=True)
    y = shifted - np.log(total) if log else np.exp(shifted) / total
    return y.reshape(x.shape) if flattened else np.moveaxis(y, -1, axis)


@pytest.mark.parametrize("log", [False, True])
@pytest.mark.parametrize("opset, axis, kept_shape", [
    (13, -1, (1, 30)), (13, 2, (2, 3, 12)), (11, 1, (2, 3, 4)), (11, 0, (3, 4)), (11, 1, (1, 12)),
])
def test_softmax_kept_call_and_every_other_call(log, opset, axis, kept_shape):
    node = Node("LogSoftmax" if log else "Softmax", ["x"], ["y"], name="s", attrs={"axis": axis}, opset=opset)
    factory = {(False, 11): softmax.softmax_1, (False, 13): softmax.softmax_13,
               (True, 11): softmax.log_softmax_1, (True, 13): softmax.log_softmax_13}[(log, opset)]
    kernel = factory(node, [kept_shape], opset)
    rng = np.random.default_rng(5)

    def check(x):
        (y,) = kernel(x)
        assert y.shape == x.shape and y.dtype == x.dtype
        a = axis % x.ndim
        np.testing.assert_allclose(y, _softmax_reference(x, a, opset < 13, log), rtol=2e-6, atol=2e-6)

    for _ in range(3):
        check((rng.standard_normal(kept_shape) * 10).astype(np.float32))
    others = [
        (rng.standard_normal((4,) + kept_shape[1:]) * 10).astype(np.float32),  # another shape
        (rng.standard_normal(kept_shape) * 10).astype(np.float64),  # another dtype
        np.asfortranarray((rng.standard_normal(kept_shape) * 10).astype(np.float32)),  # another layout
        np.array([[-np.inf] * 29 + [0.0]], np.float32).reshape(kept_shape) if kept_shape == (1, 30) else
        (rng.standard_normal(kept_shape) * 1e4).astype(np.float32),  # extreme values, through the kept call
    ]
    for x in others:
        check(x)
        check((rng.standard_normal(kept_shape) * 10).astype(np.float32))  # and the kept call again


def test_softmax_kernel_binds_its_rows_entry_point(monkeypatch):
    """The kept call stands in for the rows loop: after the first call the loop itself is not called again."""
    from onnx_runtime_ep_cpu.compiled import log_softmax as compiled

    loop = compiled.log_softmax_rows_float32_
    x = np.random.default_rng(6).standard_normal((1, 30)).astype(np.float32)
    loop(x, np.empty_like(x))  # switched to numba's dispatcher, as the loader leaves it
    node = Node("LogSoftmax", ["x"], ["y"], name="s", attrs={"axis": -1}, opset=13)
    kernel = softmax.log_softmax_13(node, [(1, 30)], 13)
    kernel(x)
    calls = []
    monkeypatch.setattr(deferred.Loop, "__call__", lambda self, *a: calls.append(1), raising=False)
    for _ in range(3):
        np.testing.assert_allclose(kernel(x)[0], _softmax_reference(x, 1, False, True), rtol=2e-6, atol=2e-6)
    assert loop.switched and not calls


# -- Gather -------------------------------------------------------------------------------------------------------


def _gather_session(data_shape, index, axis: int, fed: bool = False):
    indices = np.array(index, np.int64)
    infos = [tensor_info("x", shape=list(data_shape))]
    initializers = []
    if fed:
        infos.append(tensor_info("i", TensorProto.INT64, list(indices.shape)))
    else:
        initializers.append(numpy_helper.from_array(indices, "i"))
    node = helper.make_node("Gather", ["x", "i"], ["y"], axis=axis)
    model = make_model([node], infos, [tensor_info("y")], initializers)
    return ort.InferenceSession(model.SerializeToString(), providers=CPU)


@pytest.mark.parametrize("data_shape, index, axis", [
    ((1, 1, 64), 0, 0), ((1, 1, 64), -1, 1), ((5, 3, 4), [2], 0), ((5, 3, 4), -2, 1), ((5, 3, 4), [-1], 2),
])
def test_gather_constant_index_every_frame(data_shape, index, axis):
    session = _gather_session(data_shape, index, axis)
    rng = np.random.default_rng(7)
    for _ in range(4):
        x = rng.standard_normal(data_shape).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_array_equal(y, np.take(x, np.array(index), axis=axis))


def test_gather_kept_key_serves_only_its_shape_and_indices():
    node = Node("Gather", ["x", "i"], ["y"], name="g", attrs={"axis": 1}, opset=13)
    kernel = shape.gather(node, [(2, 5, 3), ()], 13)
    constant = np.array(-1, np.int64)
    constant.flags.writeable = False
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 5, 3)).astype(np.float32)
    for _ in range(2):
        np.testing.assert_array_equal(kernel(x, constant)[0], x[:, 4])
    other = rng.standard_normal((2, 7, 3)).astype(np.float32)  # another shape: index -1 is 6 there
    np.testing.assert_array_equal(kernel(other, constant)[0], other[:, 6])
    fed = np.array(1, np.int64)  # writable: its value may change between calls
    np.testing.assert_array_equal(kernel(x, fed)[0], x[:, 1])
    fed[...] = 3
    np.testing.assert_array_equal(kernel(x, fed)[0], x[:, 3])
    np.testing.assert_array_equal(kernel(x, constant)[0], x[:, 4])


def test_gather_constant_index_out_of_range_is_a_typed_error():
    session = _gather_session((1, 2, 4), 5, 1)
    x = np.zeros((1, 2, 4), np.float32)
    for _ in range(2):
        with pytest.raises(InvalidArgumentError, match="out of range"):
            session.run(None, {"x": x})
