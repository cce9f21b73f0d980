"""A decode step's attention reads a KV cache appended in place where it lies (kv_append.contiguous_rows, or the
buffers PastAttention appended to, through few_over_rows or append_over_rows): the cache buffers at their capacity
with the valid length, not a contiguous copy of each window every step. Checked
for the same greedy tokens as the copying loop and onnxruntime on the dynamo decoders, for one in-place read per
attention and decode step, and on a hand-made step whose cache rows past the valid length are NaN (a read past
the length would show) against a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime import InferenceSession, generate, kv_append
from onnx_runtime.session.device_io_binding import DeviceBindingSpec
from test_generate import PROMPT, _model, onnxruntime_greedy

CPU = "CPUExecutionProvider"


def _counting_reads(monkeypatch) -> list[int]:
    """[reads of caches where they lie, reads through contiguous copies (or arrays already contiguous)]."""
    counts = [0, 0]
    rows = kv_append.contiguous_rows

    def counted(keys, values):
        key_rows, value_rows = rows(keys, values)
        in_place = key_rows is not keys and np.shares_memory(key_rows, keys) and np.shares_memory(value_rows, values)
        counts[0 if in_place else 1] += 1
        return key_rows, value_rows

    monkeypatch.setattr(kv_append, "contiguous_rows", counted)
    from onnx_runtime_ep_cpu.ops import transformer

    attention = transformer._Attention  # noqa: SLF001 (the kernel's read of the buffers PastAttention hands over)
    over_rows = attention.few_over_rows

    def counted_over(self, q, k, v, mask, key_rows, value_rows):
        found = over_rows(self, q, k, v, mask, key_rows, value_rows)
        if found is not None:
            counts[0 if np.shares_memory(key_rows, k) and np.shares_memory(value_rows, v) else 1] += 1
        return found

    appended_over = attention.append_over_rows

    def counted_appended(self, q, k, v, mask, key_rows, value_rows, length):
        found = appended_over(self, q, k, v, mask, key_rows, value_rows, length)
        if found is not None:  # (PastAttention's compiled append and read of the buffers kv_append admitted)
            counts[0] += 1
        return found

    windows_over = attention.append_over_windows

    def counted_windows(self, q, k, v, mask, mask_lead, key_window, value_window, length):
        found = windows_over(self, q, k, v, mask, mask_lead, key_window, value_window, length)
        if found is not None:  # (the same, for a step PastAttention's own shape check matched)
            counts[0] += 1
        return found

    monkeypatch.setattr(attention, "few_over_rows", counted_over)
    monkeypatch.setattr(attention, "append_over_rows", counted_appended)
    monkeypatch.setattr(attention, "append_over_windows", counted_windows)
    return counts


@pytest.mark.parametrize("name", ["gpt2.dynamo.fp32", "llama.dynamo.fp32"])
def test_decode_attention_reads_the_caches_in_place_with_the_copying_loops_tokens(name, monkeypatch):
    path = _model(name)
    new = 10
    monkeypatch.setattr(generate, "IN_PLACE_BYTES", 1 << 62)  # every cache copied at every step
    copying = generate.Generator(path, providers=[CPU]).generate(PROMPT, new).tokens
    monkeypatch.setattr(generate, "IN_PLACE_BYTES", 0)
    counts = _counting_reads(monkeypatch)
    generator = generate.Generator(path, providers=[CPU])
    tokens = generator.generate(PROMPT, new).tokens
    assert tokens == copying == onnxruntime_greedy(path, PROMPT, new)
    layers = len(generator.layout.caches) // 2  # a key and a value cache per attention
    assert counts[0] >= layers * (new - 1)  # every decode step's attentions read the caches where they lie


def _attention_step_model():
    """present_k/v = Concat(past_k/v, k/v) on the sequence axis, y = Attention(q, present_k, present_v) (grouped
    query: four query heads over two KV heads)."""
    nodes = [helper.make_node("Concat", ["past_k", "k"], ["present_k"], axis=2),
             helper.make_node("Concat", ["past_v", "v"], ["present_v"], axis=2),
             helper.make_node("Attention", ["q", "present_k", "present_v"], ["y"], scale=0.5)]
    inputs = [tensor_info("past_k", TensorProto.FLOAT, [1, 2, "past_len", 4]),
              tensor_info("past_v", TensorProto.FLOAT, [1, 2, "past_len", 4]),
              tensor_info("k", TensorProto.FLOAT, [1, 2, "rows", 4]),
              tensor_info("v", TensorProto.FLOAT, [1, 2, "rows", 4]),
              tensor_info("q", TensorProto.FLOAT, [1, 4, "rows", 4])]
    outputs = [tensor_info("present_k", TensorProto.FLOAT, [1, 2, "total", 4]),
               tensor_info("present_v", TensorProto.FLOAT, [1, 2, "total", 4]),
               tensor_info("y", TensorProto.FLOAT, [1, 4, "rows", 4])]
    return make_model(nodes, inputs, outputs, opset=23).SerializeToString()


def _reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """float64 grouped-query attention of one query row per head, over every key (a decode step's)."""
    keys, values = np.repeat(keys.astype(np.float64), 2, axis=1), np.repeat(values.astype(np.float64), 2, axis=1)
    scores = 0.5 * q.astype(np.float64) @ keys.swapaxes(-1, -2)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ values


def test_a_cache_read_in_place_never_reads_past_its_valid_rows(monkeypatch):
    counts = _counting_reads(monkeypatch)
    session = InferenceSession(_attention_step_model(), providers=[CPU])
    capacity = 12
    caches = {}
    for kind in ("k", "v"):
        caches[kind] = binding = session.device_io_binding(DeviceBindingSpec.input(
            f"past_{kind}", np.float32, (1, 2, capacity, 4), (1, 2, 0, 4), output_name=f"present_{kind}",
            expose_logical_input_shape=True, fixed_physical_strides=True))
        binding.host_array()[:] = np.nan  # what lies past the valid rows must never reach a result
    step = {name: session.device_io_binding(DeviceBindingSpec.input(name, np.float32, shape))
            for name, shape in (("k", (1, 2, 1, 4)), ("v", (1, 2, 1, 4)), ("q", (1, 4, 1, 4)))}
    y_binding = session.device_io_binding(DeviceBindingSpec.output("y", np.float32, (1, 4, 1, 4)))
    rng = np.random.default_rng(5)
    keys, values = np.zeros((1, 2, 0, 4), np.float32), np.zeros((1, 2, 0, 4), np.float32)
    for _ in range(7):
        feed = {name: rng.standard_normal(binding.physical_shape).astype(np.float32) for name, binding in step.items()}
        for name, value in feed.items():
            step[name].write_logical(value)
        session.run_with_device_bindings([*caches.values(), *step.values(), y_binding], output_names=[])
        keys, values = np.concatenate((keys, feed["k"]), axis=2), np.concatenate((values, feed["v"]), axis=2)
        np.testing.assert_array_equal(caches["k"].read_logical(), keys)
        np.testing.assert_array_equal(caches["v"].read_logical(), values)
        np.testing.assert_allclose(y_binding.read_logical(), _reference(feed["q"], keys, values), rtol=0, atol=2e-6)
    assert counts[0] >= 6  # from the second step at the latest, the attention read the caches where they lie
