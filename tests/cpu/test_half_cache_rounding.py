"""A half-precision decoder's past inputs rounded where a bound run's KV cache holds them (ops/precision.py's
RoundToHalf over kv_append's windows): the converter's ``Cast(past, float16)`` rounds the valid rows of the cache
buffer in place and passes the window on, so the present is still appended in place. Checked: the compiled row
rounding against float16's own rounding (rows past the valid ones untouched), a hand-made float16 cache model bound
at fixed strides against its plain run and a float64 reference of the float16 model (past rows that are not
float16 values, written into the buffer between runs, included), plain runs with arbitrary float32 pasts still
rounded, and the zoo's float16 decoders appending in place with onnxruntime's tokens."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime import InferenceSession, generate, kv_append
from onnx_runtime.session.device_io_binding import DeviceBindingSpec
from onnx_runtime_ep_cpu.algorithms.half_caches import CacheRowRounding
from test_generate import PROMPT, _model, onnxruntime_greedy
from test_generate_kv_in_place import _counting_appends

CPU = "CPUExecutionProvider"
F16 = np.float16


def _half(x) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(x, np.float32).astype(F16).astype(np.float64)


@pytest.mark.parametrize("rows", [0, 1, 5, 33, 40])
def test_cache_rows_round_as_float16_and_the_rest_stays(rows):
    rng = np.random.default_rng(rows)
    shape = (2, 3, 40, 16)  # the compiled loop from a few rows on, numpy's below
    x = (rng.standard_normal(shape) * np.exp2(rng.uniform(-30, 18, shape))).astype(np.float32)
    x.reshape(-1)[:8] = [np.inf, -np.inf, np.nan, 65519.99, 65520.0, -0.0, 2.0 ** -25, -(2.0 ** -14) * 0.99]
    before = x.copy()
    rounding = CacheRowRounding()
    for _ in range(2):  # the second call through the kept geometry and entry point; rounding is idempotent
        rounding([(x, 2, rows)])
        np.testing.assert_array_equal(x[:, :, :rows], _half(before[:, :, :rows]).astype(np.float32))
        assert x[:, :, rows:].tobytes() == before[:, :, rows:].tobytes()


def _half_cache_model():
    """onnxruntime's float16 converter's spelling (keep_io_types): float32 past, k and q cast to float16 at the
    edge, present = Concat(past, k) cast back to float32, y = softmax((q W) . present^T) through a float16 weight."""
    weight = numpy_helper.from_array(np.random.default_rng(5).standard_normal((4, 4)).astype(F16), "w")
    nodes = [helper.make_node("Cast", ["past"], ["past16"], to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["k"], ["k16"], to=TensorProto.FLOAT16),
             helper.make_node("Cast", ["q"], ["q16"], to=TensorProto.FLOAT16),
             helper.make_node("Concat", ["past16", "k16"], ["present16"], axis=2),
             helper.make_node("Cast", ["present16"], ["present"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["q16", "w"], ["qw"]),
             helper.make_node("Transpose", ["present16"], ["present_t"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["qw", "present_t"], ["scores"]),
             helper.make_node("Softmax", ["scores"], ["y16"], axis=-1),
             helper.make_node("Cast", ["y16"], ["y"], to=TensorProto.FLOAT)]
    inputs = [tensor_info("past", TensorProto.FLOAT, [1, 2, "past_len", 4]),
              tensor_info("k", TensorProto.FLOAT, [1, 2, "k_len", 4]),
              tensor_info("q", TensorProto.FLOAT, [1, 2, 1, 4])]
    outputs = [tensor_info("present", TensorProto.FLOAT, [1, 2, "total", 4]),
               tensor_info("y", TensorProto.FLOAT, [1, 2, 1, "total"])]
    return make_model(nodes, inputs, outputs, initializers=[weight]).SerializeToString(), \
        numpy_helper.to_array(weight).astype(np.float64)


def _reference(past, k, q, weight):
    """The float16 model in float64 but for its roundings at the edge: (present, y)."""
    present = np.concatenate([_half(past), _half(k)], axis=2)
    scores = (_half(q) @ weight) @ present.swapaxes(-1, -2)
    y = np.exp(scores - scores.max(-1, keepdims=True))
    return present, y / y.sum(-1, keepdims=True)


def _not_half(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32) + np.float32(1e-4)
    assert (_half(x) != x).any()
    return x


def _counting_windows(monkeypatch) -> list[int]:
    found = [0]
    fed_window = kv_append.fed_window

    def counted(past):
        window = fed_window(past)
        found[0] += window is not None
        return window

    monkeypatch.setattr(kv_append, "fed_window", counted)
    return found


def _bound(session, name, array):
    binding = session.device_io_binding(DeviceBindingSpec.input(name, np.float32, array.shape))
    binding.write_logical(array)
    return binding


def test_a_bound_half_cache_is_rounded_in_place_and_appended_in_place(monkeypatch):
    counts, windows = _counting_appends(monkeypatch), _counting_windows(monkeypatch)
    model, weight = _half_cache_model()
    session = InferenceSession(model, providers=[CPU])
    capacity = 12
    cache = session.device_io_binding(DeviceBindingSpec.input(
        "past", np.float32, (1, 2, capacity, 4), (1, 2, 0, 4), output_name="present", expose_logical_input_shape=True,
        fixed_physical_strides=True))
    rng = np.random.default_rng(3)
    past = np.zeros((1, 2, 0, 4), np.float32)
    physical = cache.host_array()[: np.prod(cache.physical_shape)].reshape(cache.physical_shape)
    steps = (3, 1, 1, 2, 1)
    for step, rows in enumerate(steps):
        if step == 3:  # a caller's own rows in the buffer, not float16 values: rounded as a plain run rounds them
            physical[:, :, :past.shape[2]] = _not_half(rng, past.shape)
            past = physical[:, :, :past.shape[2]].copy()
        k, q = _not_half(rng, (1, 2, rows, 4)), _not_half(rng, (1, 2, 1, 4))
        (y,) = session.run_with_device_bindings([cache, _bound(session, "k", k), _bound(session, "q", q)],
                                                output_names=["y"])
        present, plain_y = session.run(None, {"past": past, "k": k, "q": q})
        exact_present, exact_y = _reference(past, k, q, weight)
        np.testing.assert_array_equal(cache.read_logical(), present)
        np.testing.assert_array_equal(present, exact_present.astype(np.float32))
        np.testing.assert_allclose(y, exact_y, rtol=0, atol=2e-3)  # the float16 output's rounding
        np.testing.assert_allclose(y, plain_y, rtol=0, atol=1e-6)
        past = present
    assert cache.logical_shape == (1, 2, sum(steps), 4)
    assert windows[0] == len(steps)  # every bound run rounded its cache where it lies
    assert counts[0] == len(steps)  # and appended the step's rows in place


def test_plain_runs_round_arbitrary_float32_pasts():
    model, weight = _half_cache_model()
    session = InferenceSession(model, providers=[CPU])
    rng = np.random.default_rng(11)
    for length in (0, 1, 7, 300):
        past, k, q = _not_half(rng, (1, 2, length, 4)) if length else np.zeros((1, 2, 0, 4), np.float32), \
            _not_half(rng, (1, 2, 1, 4)), _not_half(rng, (1, 2, 1, 4))
        kept = past.copy()
        present, y = session.run(None, {"past": past, "k": k, "q": q})
        exact_present, exact_y = _reference(past, k, q, weight)
        np.testing.assert_array_equal(present, exact_present.astype(np.float32))
        np.testing.assert_allclose(y, exact_y, rtol=0, atol=2e-3)
        np.testing.assert_array_equal(past, kept)  # a caller's feed is never rounded where it lies


@pytest.mark.parametrize("name", ["gpt2.dynamo.fp16", "gpt2.torchscript.fp16", "llama.dynamo.fp16",
                                  "llama.torchscript.fp16"])
def test_half_decoders_append_their_caches_in_place_with_onnxruntimes_tokens(name, monkeypatch):
    path = _model(name)
    new = 10
    monkeypatch.setattr(generate, "IN_PLACE_BYTES", 0)
    counts, windows = _counting_appends(monkeypatch), _counting_windows(monkeypatch)
    generator = generate.Generator(path, providers=[CPU])
    tokens = generator.generate(PROMPT, new).tokens
    assert tokens == onnxruntime_greedy(path, PROMPT, new)
    caches = len(generator.layout.caches)
    assert windows[0] == caches * new  # every past rounded where its cache lies, prefill (no rows) included
    assert counts[0] == caches * new  # and every cache appended in place at every step


def test_plain_runs_import_no_cache_rounding(tmp_path):
    """A converted model run without bound caches (an encoder's inputs rounded by the same node) loads neither
    the cache windows' module for it nor the row rounding's (cold start)."""
    path = tmp_path / "half_cache.onnx"
    path.write_bytes(_half_cache_model()[0])
    code = ("import sys, numpy as np, onnx_runtime\n"
            f"s = onnx_runtime.InferenceSession({str(path)!r}, providers=['CPUExecutionProvider'])\n"
            "z = np.zeros((1, 2, 3, 4), np.float32)\n"
            "s.run(None, {'past': z, 'k': z[:, :, :1], 'q': z[:, :, :1]})\n"
            "print('onnx_runtime_ep_cpu.algorithms.half_caches' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.split()[-1] == "False"
