"""The host KV cache grown in place (onnx_runtime.kv_append): a cache laid out at its capacity, whose
``present = Concat(past, new)`` writes only the step's rows into the bound buffer. Checked for the same tokens as
the copying loop and onnxruntime, one append per cache and step at a fixed address, the refusals that send a
Concat back to numpy, and a bound run on a hand-made cache graph against the plain run and a float64 reference."""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime import InferenceSession, generate, kv_append
from onnx_runtime.session.device_io_binding import DeviceBindingSpec
from test_generate import PROMPT, _model, onnxruntime_greedy

CPU = "CPUExecutionProvider"


def _counting_appends(monkeypatch) -> list[int]:
    """Counts of appends made in place: [made, refused] (a Concat's append and PastAttention's numpy path call
    append_window; PastAttention's compiled decode step claims the rows it writes, both caches in one call)."""
    counts = [0, 0]
    append, claim, claim_pair = kv_append.append_window, kv_append.claim, kv_append.claim_pair

    def counted(output, xs, axis):
        grown = append(output, xs, axis)
        counts[0 if grown is not None else 1] += 1
        return grown

    def claimed(window, length, grown):
        counts[0] += 1
        return claim(window, length, grown)

    def claimed_pair(key_window, value_window, length, grown):
        counts[0] += 2
        return claim_pair(key_window, value_window, length, grown)

    monkeypatch.setattr(kv_append, "append_window", counted)
    monkeypatch.setattr(kv_append, "claim", claimed)
    monkeypatch.setattr(kv_append, "claim_pair", claimed_pair)
    return counts


@pytest.mark.parametrize("name", ["gpt2.dynamo.fp32", "llama.torchscript.fp32"])
def test_caches_appended_in_place_give_the_copying_loops_and_onnxruntimes_tokens(name, monkeypatch):
    path = _model(name)
    new = 12
    monkeypatch.setattr(generate, "IN_PLACE_BYTES", 1 << 62)  # every cache below it: copied at every step
    copying = generate.Generator(path, providers=[CPU]).generate(PROMPT, new).tokens
    monkeypatch.setattr(generate, "IN_PLACE_BYTES", 0)
    counts = _counting_appends(monkeypatch)
    generator = generate.Generator(path, providers=[CPU])
    tokens = generator.generate(PROMPT, new).tokens
    assert tokens == copying == onnxruntime_greedy(path, PROMPT, new)
    caches = len(generator.layout.caches)
    assert counts[0] == caches * new  # every cache appended in place at every step, prefill included (the
    # refusals are the graph's other Concats: a rotary table's, say)
    # The next generation on the same session (new bindings, the kept plans) appends again.
    assert generator.generate(PROMPT, new).tokens == tokens and counts[0] == 2 * caches * new


def test_each_step_writes_its_rows_at_a_fixed_address(monkeypatch):
    path = _model("gpt2.dynamo.fp32")
    monkeypatch.setattr(generate, "IN_PLACE_BYTES", 0)
    generator = generate.Generator(path, providers=[CPU])
    session = generator.session
    seen: list[tuple] = []
    prepare = session.prepare_device_binding_run

    def prepared(bindings, *args, **kwargs):  # the host loop's steps go through the prepared run
        run = prepare(bindings, *args, **kwargs)
        cache = next(b for b in bindings if b.output_name == "present.0.key")

        def watch(*step_args):
            results = run(*step_args)
            whole = cache.host_array()[: np.prod(cache.physical_shape)].reshape(cache.physical_shape)
            seen.append((cache.buffer.ptr, cache.logical_shape, whole.copy()))
            return results

        watch.held = lambda: contextlib.nullcontext(watch)  # (the loop runs its steps inside held())
        return watch

    monkeypatch.setattr(session, "prepare_device_binding_run", prepared)
    generator.generate(PROMPT, 6)
    assert len({ptr for ptr, _shape, _rows in seen}) == 1
    assert [shape[2] for _ptr, shape, _rows in seen] == [len(PROMPT) + step for step in range(6)]
    for (_p, shape, before), (_q, _s, after) in zip(seen, seen[1:]):  # the rows once written stay as they are
        np.testing.assert_array_equal(after[:, :, : shape[2]], before[:, :, : shape[2]])
        # Nothing written past the new row (the rows there hold whatever the allocation held: compared as bits).
        assert after[:, :, shape[2] + 1:].tobytes() == before[:, :, shape[2] + 1:].tobytes()


def _window(capacity=6, heads=2, dim=3, length=2):
    physical = np.zeros((1, heads, capacity, dim), np.float32)
    physical[:, :, :length] = np.arange(heads * length * dim, dtype=np.float32).reshape(1, heads, length, dim) + 1
    fed = physical[:, :, :length]
    return physical, fed, kv_append.Window(fed, physical, 2, "present")


def test_append_writes_the_new_rows_after_the_window_and_returns_the_longer_window():
    physical, fed, window = _window()
    new = np.full((1, 2, 1, 3), 7, np.float32)
    expected = np.concatenate((fed, new), axis=2)
    saved = kv_append.enter([window])
    try:
        grown = kv_append.append("present", (fed, new), 2)
        assert kv_append.append("present", (fed, new), 2) is None  # once per run: a second Concat copies
    finally:
        kv_append.leave(saved)
    np.testing.assert_array_equal(grown, expected)
    assert np.shares_memory(grown, physical) and grown is window.result
    assert not physical[:, :, 3:].any()


@pytest.mark.parametrize("case", ["other output", "other axis", "other dtype", "past capacity", "other value",
                                  "three inputs", "other heads"])
def test_append_refuses_what_it_cannot_do_in_place(case):
    physical, fed, window = _window()
    new, output, axis, xs = np.ones((1, 2, 1, 3), np.float32), "present", 2, None
    if case == "other output":
        output = "logits"
    elif case == "other axis":
        axis = 3
    elif case == "other dtype":
        new = new.astype(np.float64)
    elif case == "past capacity":
        new = np.ones((1, 2, 5, 3), np.float32)
    elif case == "other value":
        xs = (fed.copy(), new)
    elif case == "three inputs":
        xs = (fed, new, new)
    elif case == "other heads":
        new = np.ones((1, 1, 1, 3), np.float32)
    before = physical.copy()
    saved = kv_append.enter([window])
    try:
        assert kv_append.append(output, xs or (fed, new), axis) is None
    finally:
        kv_append.leave(saved)
    np.testing.assert_array_equal(physical, before)


def _pair(length=2, value_length=None):
    """A layer's key and value windows (outputs "present_key", "present_value") over caches of 6 rows."""
    keys, fed_keys, key_window = _window(length=length)
    values, fed_values, value_window = _window(length=length if value_length is None else value_length)
    key_window.output, value_window.output = "present_key", "present_value"
    return (keys, fed_keys, key_window), (values, fed_values, value_window)


@pytest.mark.parametrize("case", ["admitted", "value other length", "value not fed", "key taken", "other dtype",
                                  "other heads", "past capacity", "one window", "no run"])
def test_a_pair_is_admitted_where_each_cache_alone_would_be(case):
    (keys, fed_keys, key_window), (values, fed_values, value_window) = _pair(
        value_length=3 if case == "value other length" else None)
    k, v = np.ones((1, 2, 1, 3), np.float32), np.full((1, 2, 1, 3), 2, np.float32)
    pasts, windows = (fed_keys, fed_values), [key_window, value_window]
    if case == "value not fed":
        pasts = (fed_keys, fed_values.copy())
    elif case == "key taken":
        key_window.result = fed_keys
    elif case == "other dtype":
        v = v.astype(np.float64)
    elif case == "other heads":
        k = np.ones((1, 1, 1, 3), np.float32)
    elif case == "past capacity":
        k, v = np.ones((1, 2, 5, 3), np.float32), np.ones((1, 2, 5, 3), np.float32)
    elif case == "one window":
        windows = [key_window]
    saved = kv_append.enter(windows) if case != "no run" else None
    try:
        each = (kv_append.admitted("present_key", (pasts[0], k), 2), kv_append.admitted("present_value",
                                                                                      (pasts[1], v), 2))
        pair = kv_append.admitted_pair(("present_key", "present_value"), pasts, (k, v), 2)
    finally:
        if saved is not None:
            kv_append.leave(saved)
    if case == "admitted":
        assert each == ((key_window, 2), (value_window, 2)) and pair == (key_window, value_window, 2)
    else:
        assert pair is None and (None in each or each[0][1] != each[1][1])
    assert not keys[:, :, 2:].any() and not values[:, :, 3:].any()  # nothing written either way


def test_claiming_a_pair_marks_both_windows_as_claiming_each_does():
    (keys, fed_keys, key_window), (values, fed_values, value_window) = _pair()
    saved = kv_append.enter([key_window, value_window])
    try:
        key_window_, value_window_, length = kv_append.admitted_pair(
            ("present_key", "present_value"), (fed_keys, fed_values), (np.ones((1, 2, 1, 3), np.float32),) * 2, 2)
        keys[:, :, length], values[:, :, length] = 5, 6  # the caller writes the rows, then claims them
        present_key, present_value = kv_append.claim_pair(key_window_, value_window_, length, length + 1)
        assert key_window.result is present_key and value_window.result is present_value
        np.testing.assert_array_equal(present_key, keys[:, :, :3])
        np.testing.assert_array_equal(present_value, values[:, :, :3])
        # (a reader of both grown windows reads the buffers where they lie, as after two claims)
        assert all(a is b for a, b in zip(kv_append.contiguous_rows(present_key, present_value), (keys, values)))
        assert kv_append.admitted_pair(("present_key", "present_value"), (fed_keys, fed_values),
                                       (np.ones((1, 2, 1, 3), np.float32),) * 2, 2) is None  # once per run
    finally:
        kv_append.leave(saved)


def test_another_threads_concat_does_not_see_this_runs_windows():
    physical, fed, window = _window()
    got = []
    saved = kv_append.enter([window])
    try:
        thread = threading.Thread(target=lambda: got.append(kv_append.append("present", (fed, fed[:, :, :1]), 2)))
        thread.start()
        thread.join()
    finally:
        kv_append.leave(saved)
    assert got == [None] and not physical[:, :, 2:].any()


def _cache_model():
    """present = Concat(past, k) on the sequence axis, y = softmax(q . present^T) as the step's reader."""
    nodes = [helper.make_node("Concat", ["past", "k"], ["present"], axis=2),
             helper.make_node("Transpose", ["present"], ["present_t"], perm=[0, 1, 3, 2]),
             helper.make_node("MatMul", ["q", "present_t"], ["scores"]),
             helper.make_node("Softmax", ["scores"], ["y"], axis=-1)]
    inputs = [tensor_info("past", TensorProto.FLOAT, [1, 2, "past_len", 4]),
              tensor_info("k", TensorProto.FLOAT, [1, 2, "k_len", 4]),
              tensor_info("q", TensorProto.FLOAT, [1, 2, 1, 4])]
    outputs = [tensor_info("present", TensorProto.FLOAT, [1, 2, "total", 4]),
               tensor_info("y", TensorProto.FLOAT, [1, 2, 1, "total"])]
    return make_model(nodes, inputs, outputs).SerializeToString()


def test_a_bound_run_on_a_cache_at_fixed_strides_matches_the_plain_run_and_float64(monkeypatch):
    counts = _counting_appends(monkeypatch)
    session = InferenceSession(_cache_model(), providers=[CPU])
    capacity = 9
    cache = session.device_io_binding(DeviceBindingSpec.input(
        "past", np.float32, (1, 2, capacity, 4), (1, 2, 0, 4), output_name="present", expose_logical_input_shape=True,
        fixed_physical_strides=True))
    rng = np.random.default_rng(3)
    past = np.zeros((1, 2, 0, 4), np.float32)
    for rows in (3, 1, 1, 2):
        k = rng.standard_normal((1, 2, rows, 4)).astype(np.float32)
        q = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
        (y,) = session.run_with_device_bindings([cache], {"k": k, "q": q}, output_names=["y"])
        present, plain_y = session.run(None, {"past": past, "k": k, "q": q})
        np.testing.assert_array_equal(cache.read_logical(), present)
        scores = q.astype(np.float64) @ present.astype(np.float64).swapaxes(-1, -2)
        exact = np.exp(scores - scores.max(-1, keepdims=True))
        exact /= exact.sum(-1, keepdims=True)
        np.testing.assert_allclose(y, exact, rtol=0, atol=1e-6)
        np.testing.assert_allclose(y, plain_y, rtol=0, atol=1e-6)
        past = present
    assert cache.logical_shape == (1, 2, 7, 4)
    assert counts[0] == 0  # a run with host feeds takes the general path: scattered at the strides, not appended
