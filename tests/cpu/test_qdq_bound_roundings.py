"""A QDQ decode step's small kernels keep their compiled loop's entry point for the call they repeat (issue 20):
the rounded Add/Sub/Mul/Div and two-input Concat (ops/rounded_output.py), QuantizeDequantize
(ops/quantization.py) and QuantizedMatMul's plain and stacked repeats (ops/qdq_linear.py). After the first call
the loop's dispatcher is not called again for that call; every value agrees with a float64 reference of the
operator then the rounding, and a call that differs from the kept one (another shape, a strided operand, a fed
scale) takes the checked path with the right values."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.fusions import FUSED_DOMAIN
from onnx_runtime_ep_cpu.ops import quantization, rounded_output
from onnx_runtime_ep_cpu.ops.qdq_linear import quantized_matmul

F32 = np.float32
SCALE, ZERO = 0.017, 131


def _constant(value, dtype):
    array = np.array(value, dtype)
    array.flags.writeable = False  # as initializers are
    return array


@pytest.fixture(autouse=True)
def loops_linked(monkeypatch):
    """As after the background loader's switch: compiled loops serve (not numpy meanwhile)."""
    monkeypatch.setattr(deferred, "numpy_first", lambda *kinds: False)
    monkeypatch.setattr(deferred.state, "guarding", False)
    monkeypatch.setattr(deferred.state, "deferring", False)


@pytest.fixture()
def loop_calls(monkeypatch):
    """Returns a function that starts counting calls of any compiled loop through its dispatcher."""
    calls: list = []
    real = deferred.Loop.__call__

    def start():
        def counting(self, *args, **kwargs):
            calls.append(self)
            return real(self, *args, **kwargs)

        monkeypatch.setattr(deferred.Loop, "__call__", counting)
        return calls

    return start


def _rounded(values, scale=SCALE, zero=ZERO):
    """The float64 reference of QuantizeLinear -> DequantizeLinear (uint8) of float32 ``values``."""
    v = np.asarray(values, np.float64)
    codes = np.clip(np.rint(v / np.float64(F32(scale))) + zero, 0, 255)
    return (codes - zero) * np.float64(F32(scale))


def _close(got, want, scale=SCALE):
    """Within one code of the float64 reference (a float32 value within rounding of a half step may go either
    way), and at most a float32 rounding off a grid value."""
    assert got.dtype == F32 and got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=F32(scale) * 1.0001)
    assert np.mean(np.abs(got - want) < 1e-6) > 0.99


def _rounded_node(op: str, count: int, **attrs) -> Node:
    names = [f"x{i}" for i in range(count)]
    return Node(op + "Rounded", [*names, "s", "z"], ["y"], name=op.lower(), domain=FUSED_DOMAIN,
                attrs={**attrs, "rounding_axis": 1, "rounding_opset": 19, "inner_opset": 14}, opset=1)


@pytest.mark.parametrize("op, a_shape, b_shape", [
    ("Mul", (1, 4, 1, 16), (1, 1, 1, 16)),  # rotary's cos over heads
    ("Add", (1, 1, 64), (1, 1, 64)),  # a residual
    ("Sub", (1, 4, 1, 17), (1,)),
    ("Div", (1, 4, 1, 17), (1, 4, 1, 17)),
])
def test_rounded_binary_repeats_through_the_entry_point(loop_calls, op, a_shape, b_shape):
    kernel = rounded_output.rounded_output(_rounded_node(op, 2), [a_shape, b_shape, (), ()], 1)
    scale, zero = _constant(SCALE, F32), _constant(ZERO, np.uint8)
    fn = {"Mul": np.multiply, "Add": np.add, "Sub": np.subtract, "Div": np.divide}[op]
    rng = np.random.default_rng(1)

    def operands(shape_a=a_shape, shape_b=b_shape):
        a = (rng.standard_normal(shape_a) * 2).astype(F32)
        b = (rng.standard_normal(shape_b) + (3 if op == "Div" else 0)).astype(F32)
        return a, b

    a, b = operands()
    _close(kernel(a, b, scale, zero)[0], _rounded(fn(a, b)))  # checked, then bound
    calls = loop_calls()
    for _ in range(3):
        a, b = operands()
        _close(kernel(a, b, scale, zero)[0], _rounded(fn(a, b)))
    assert not calls  # the entry point served the repeats
    # calls unlike the kept one: a strided A of the same shape, another shape, a fed scale
    a, b = operands()
    strided = np.empty(a.shape[::-1], F32).transpose()
    strided[...] = a
    _close(kernel(strided, b, scale, zero)[0], _rounded(fn(a, b)))
    a2, b2 = operands(a_shape[:-1] + (a_shape[-1] * 2,), b_shape[:-1] + (b_shape[-1] * 2 if b_shape[-1] > 1 else 1,))
    _close(kernel(a2, b2, scale, zero)[0], _rounded(fn(a2, b2)))
    fed = np.array(0.031, F32)
    _close(kernel(a, b, fed, zero)[0], _rounded(fn(a, b), 0.031), 0.031)
    assert calls  # the checked path calls the loop
    a, b = operands()
    _close(kernel(a, b, scale, zero)[0], _rounded(fn(a, b)))  # the first shape again


@pytest.mark.parametrize("a_shape, b_shape, axis", [
    ((1, 2, 16, 16), (1, 2, 1, 16), 2),  # a decode step's present key
    ((1, 4, 1, 8), (1, 4, 1, 8), -1),  # rotate_half's halves
])
def test_rounded_concat_repeats_through_the_entry_point(loop_calls, a_shape, b_shape, axis):
    kernel = rounded_output.rounded_output(_rounded_node("Concat", 2, axis=axis), [a_shape, b_shape, (), ()], 1)
    scale, zero = _constant(SCALE, F32), _constant(ZERO, np.uint8)
    rng = np.random.default_rng(2)

    def check(a_shape=a_shape, b_shape=b_shape, s=scale, scale_value=SCALE):
        a, b = (rng.standard_normal(a_shape) * 2).astype(F32), (rng.standard_normal(b_shape) * 2).astype(F32)
        _close(kernel(a, b, s, zero)[0], _rounded(np.concatenate([a, b], axis), scale_value), scale_value)

    check()
    calls = loop_calls()
    for _ in range(3):
        check()
    assert not calls
    grown = tuple(d + 1 if i == axis % len(a_shape) else d for i, d in enumerate(a_shape))
    check(grown)  # the past one longer
    check(s=np.array(0.031, F32), scale_value=0.031)
    assert calls


def test_quantize_dequantize_repeats_through_the_entry_point(loop_calls):
    node = Node("QuantizeDequantize", ["x", "s", "z"], ["y"], name="r", domain=FUSED_DOMAIN,
                attrs={"axis": 1, "opset": 19}, opset=1)
    kernel = quantization.quantize_dequantize(node, [(1, 4, 17, 16), (), ()], 1)
    scale, zero = _constant(SCALE, F32), _constant(ZERO, np.uint8)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((1, 4, 17, 16)) * 2).astype(F32)
    _close(kernel(x, scale, zero)[0], _rounded(x))
    calls = loop_calls()
    for _ in range(3):
        x = (rng.standard_normal((1, 4, 17, 16)) * 2).astype(F32)
        x.reshape(-1)[:3] = [1e6, -1e6, np.nan]  # saturation both ways; NaN gives code 0
        want = _rounded(np.nan_to_num(x, nan=-ZERO * SCALE))
        _close(kernel(x, scale, zero)[0], want)
    assert not calls
    strided = (rng.standard_normal((1, 4, 16, 17)) * 2).astype(F32).transpose(0, 1, 3, 2)
    _close(kernel(strided, scale, zero)[0], _rounded(strided))
    y = (rng.standard_normal((1, 4, 18, 16)) * 2).astype(F32)
    _close(kernel(y, scale, zero)[0], _rounded(y))
    assert calls


PARAMS = (_constant(0.04, F32), _constant(128, np.uint8), _constant(0.02, F32), _constant(120, np.uint8),
          _constant(0.05, F32), _constant(100, np.uint8))


def _product_reference(a, b, quantize_b: bool, params=PARAMS):
    a_scale, a_zero, b_scale, b_zero, y_scale, y_zero = (np.float64(p) for p in params)
    aq = np.clip(np.rint(a / F32(a_scale)) + a_zero, 0, 255) - a_zero
    bq = (np.clip(np.rint(b / F32(b_scale)) + b_zero, 0, 255) if quantize_b else b.astype(np.float64)) - b_zero
    codes = np.clip(np.rint(np.matmul(aq, bq) * (a_scale * b_scale / y_scale)) + y_zero, 0, 255)
    return (codes - y_zero) * F32(y_scale)


@pytest.mark.parametrize("stacked", [False, True])
def test_quantized_matmul_repeats_through_the_entry_point(loop_calls, stacked):
    """A projection by constant int8 codes (a decode step's linear) and attention's stacked product of two
    activations: the repeats call the entry point; another A shape goes through the checks."""
    node = Node("QuantizedMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"], name="p",
                domain=FUSED_DOMAIN, attrs={"quantize_a": 1, "quantize_b": int(stacked), "dequantize": 1}, opset=1)
    kernel = quantized_matmul(node, [None] * 8, 1)
    rng = np.random.default_rng(4)
    a_shape, b_shape = ((1, 4, 1, 16), (1, 4, 16, 17)) if stacked else ((1, 1, 64), (64, 48))
    if stacked:
        params = (*PARAMS[:3], _constant(128, np.uint8), *PARAMS[4:])
    else:
        params = PARAMS
        b = _constant(rng.integers(-127, 128, b_shape), np.int8)
        params = (*PARAMS[:3], _constant(0, np.int8), *PARAMS[4:])

    def check(rows=a_shape[-2]):
        nonlocal b
        a = (rng.standard_normal(a_shape[:-2] + (rows, a_shape[-1])) * 2).astype(F32)
        if stacked:
            b = (rng.standard_normal(b_shape) * 2).astype(F32)
        got = kernel(a, params[0], params[1], b, params[2], params[3], params[4], params[5])[0]
        _close(got, _product_reference(a, b, stacked, params), 0.05)

    b = None if stacked else b
    check()
    calls = loop_calls()
    for _ in range(3):
        check()
    assert not calls
    check(rows=3)
    assert calls


def test_a_growing_past_binds_once(loop_calls, monkeypatch):
    """A decode loop's present-key Concat sees a longer past every step: the entry point is bound once (binding
    types every argument, tens of microseconds), and each new length is checked once, then kept."""
    from onnx_runtime_ep_cpu.algorithms import bound_loop

    binds = []
    real = bound_loop.bound_entry
    monkeypatch.setattr(bound_loop, "bound_entry", lambda *args: binds.append(1) or real(*args))
    kernel = rounded_output.rounded_output(_rounded_node("Concat", 2, axis=2), [None, None, (), ()], 1)
    scale, zero = _constant(SCALE, F32), _constant(ZERO, np.uint8)
    rng = np.random.default_rng(5)
    calls = loop_calls()
    for past in range(3, 9):
        for _ in range(3):
            a, b = (rng.standard_normal((1, 2, past, 16)) * 2).astype(F32), rng.standard_normal((1, 2, 1, 16))
            b = b.astype(F32)
            _close(kernel(a, b, scale, zero)[0], _rounded(np.concatenate([a, b], 2)))
    assert len(binds) == 1
    assert len(calls) == 6  # the first call of each length


# The loops whose kernels call their entry point on a repeated call (rounded_concat also reads strided halves in
# the rotary embedding, which go through its checked path; the product groups are qdq_group.py's)
BOUND_LOOPS = {"rounded_binary", "fake_quantize", "requantized_product", "requantized_batched_product", "grid_lookup",
               "rounded_rms_norm", "rounded_rotary", "rounded_attention"}


@pytest.mark.parametrize("name", ["llama.torchscript", "llama.dynamo", "gpt2.torchscript", "gpt2.dynamo"])
def test_a_decode_step_repeats_without_the_dispatcher(qdq_decoders, loop_calls, name):
    """After its first runs, a static QDQ decoder's decode step calls none of those loops through numba's
    dispatcher, and its outputs stay those of the first run and within a few codes of onnxruntime's. (T5's
    position bias is added as a strided view, which the rounded Add takes through its checked path.)"""
    import onnx_runtime

    built, entries, zoo_feeds = qdq_decoders
    feeds = zoo_feeds.make_feeds(entries[name + ".fp32"]["calls"]["decode"])
    session = onnx_runtime.InferenceSession(str(built[name]), providers=["cpu"])
    first = [session.run(None, feeds) for _ in range(3)][0]
    calls = loop_calls()
    got = session.run(None, feeds)
    assert not {getattr(loop, "__name__", "") for loop in calls} & BOUND_LOOPS, calls
    for a, b in zip(got, first):
        np.testing.assert_array_equal(a, b)
    oracle = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
    want = oracle.InferenceSession(str(built[name]), providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(got, want):  # a few codes of each output's grid: onnxruntime's integer kernels round apart
        assert float(np.abs(a - b).max()) <= 0.08 * max(1.0, float(np.abs(b).max()))


@pytest.mark.parametrize("zero_dtype", [np.uint8, np.int8])
def test_an_empty_past_is_rounded_without_the_two_kernels(monkeypatch, zero_dtype):
    """A prefill's empty past (1, heads, 0, head size) through QuantizeDequantize: an empty float32 tensor of its
    shape straight away (QuantizeLinear's and DequantizeLinear's kernels and checks cost ~15 us on nothing), as
    onnxruntime's two nodes give it; a per-channel scale still goes through the kernels' checks."""
    made = []
    real = quantization._quantize_factory  # noqa: SLF001 (spied on)

    def spy(*args, **kwargs):
        run = real(*args, **kwargs)

        def counted(*inputs):
            made.append(1)
            return run(*inputs)

        return counted

    monkeypatch.setattr(quantization, "_quantize_factory", spy)
    node = Node("QuantizeDequantize", ["x", "s", "z"], ["y"], name="past", domain=FUSED_DOMAIN,
                attrs={"axis": 1, "opset": 19}, opset=1)
    kernel = quantization.quantize_dequantize(node, [(1, 4, 0, 16), (), ()], 1)
    scale, zero = _constant(SCALE, F32), _constant(7, zero_dtype)
    for _ in range(2):
        (y,) = kernel(np.zeros((1, 4, 0, 16), F32), scale, zero)
        assert y.dtype == F32 and y.shape == (1, 4, 0, 16)
    assert not made
    x = (np.random.default_rng(6).standard_normal((1, 4, 3, 16)) * 2).astype(F32)
    _close(kernel(x, scale, zero)[0], _rounded(x, zero=7) if zero_dtype is np.uint8 else _signed_rounded(x))
    channels = _constant(np.full(4, SCALE, F32), F32), _constant(np.full(4, 7, zero_dtype), zero_dtype)
    (y,) = kernel(np.zeros((1, 4, 0, 16), F32), *channels)
    assert y.dtype == F32 and y.shape == (1, 4, 0, 16) and made


def _signed_rounded(values):
    v = np.asarray(values, np.float64)
    codes = np.clip(np.rint(v / np.float64(F32(SCALE))) + 7, -128, 127)
    return (codes - 7) * np.float64(F32(SCALE))


def test_a_present_after_an_empty_past_is_one_compiled_pass(monkeypatch):
    """A prefill's present key: ConcatRounded of the empty past and the new keys runs the compiled rounded
    concat (the new part rounded), not the Concat kernel and a rounding after it; values within one code of the
    float64 reference, either part empty."""
    concats = []
    real = rounded_output.lookup

    def spying(op_type, domain, opset):
        factory = real(op_type, domain, opset)

        def made(*args):
            run = factory(*args)
            return lambda *inputs: concats.append(op_type) or run(*inputs)

        return made

    monkeypatch.setattr(rounded_output, "lookup", spying)
    kernel = rounded_output.rounded_output(_rounded_node("Concat", 2, axis=2), [None, None, (), ()], 1)
    scale, zero = _constant(SCALE, F32), _constant(ZERO, np.uint8)
    rng = np.random.default_rng(9)
    for past, new in [(0, 16), (0, 1), (16, 0), (5, 1)]:
        a = (rng.standard_normal((1, 2, past, 16)) * 2).astype(F32)
        b = (rng.standard_normal((1, 2, new, 16)) * 2).astype(F32)
        (y,) = kernel(a, b, scale, zero)
        assert y.shape == (1, 2, past + new, 16)
        _close(y, _rounded(np.concatenate([a, b], 2)))
    assert not concats
