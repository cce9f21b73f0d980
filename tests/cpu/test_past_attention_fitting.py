"""PastAttention's step for inputs its own shape check matched (_call_if_fits): the mask's read (few_mask_lead)
found once per kernel and the windows' buffers' contiguity as the windows kept it, with every per-step check that
those kept reads do not cover (the mask's type and length, a buffer that is not C-contiguous) still made."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime import kv_append
from onnx_runtime.ir import Node
from onnx_runtime_ep_cpu.algorithms.bound_loop import EntryOnce
from onnx_runtime_ep_cpu.compiled import decoder
from onnx_runtime_ep_cpu.fused_domain import FUSED_DOMAIN
from onnx_runtime_ep_cpu.registry import lookup
from reference64 import assert_within, gamma

HEADS, SIZE, PAST, CAPACITY = 2, 8, 5, 16


def _kernel(mask_shape):
    inputs = ["q", "k", "v", "mask" if mask_shape is not None else "", "pk", "pv"]
    node = Node("PastAttention", inputs, ["y", "present_k", "present_v"], name="layer0", domain=FUSED_DOMAIN,
                attrs={"scale": 0.5}, opset=23)
    step, cache = (1, HEADS, 1, SIZE), (1, HEADS, PAST, SIZE)
    return lookup("PastAttention", FUSED_DOMAIN, 1)(node, [step, step, step, mask_shape, cache, cache], 23)


def _exact(q, keys, values, mask):
    k64, v64 = keys.astype(np.float64), values.astype(np.float64)
    scores = np.einsum("bhqd,bhkd->bhqk", q.astype(np.float64), k64) * 0.5
    if mask is not None:
        scores = scores + mask.astype(np.float64).reshape((1,) * (4 - mask.ndim) + mask.shape)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    exact = np.einsum("bhqk,bhkd->bhqd", weights / weights.sum(-1, keepdims=True), v64)
    return exact, float(np.abs(v64).max()) * (1 + float(np.abs(scores).max()))


@pytest.mark.parametrize("form", ["4-D", "2-D", "strided 4-D", "none"])
def test_fitting_steps_find_the_masks_read_once_and_attend_within_the_bound(form, monkeypatch):
    monkeypatch.setenv("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")
    lead = {"4-D": (1, 1, 1), "2-D": (1,), "strided 4-D": (1, 1, 1), "none": None}[form]
    kernel = _kernel(None if lead is None else lead + (PAST + 1,))
    assert kernel.call_if_fits is not None
    leads = []
    found = kernel.attention.few_mask_lead
    monkeypatch.setattr(kernel.attention, "few_mask_lead", lambda *a: leads.append(a) or found(*a))
    monkeypatch.setattr(kernel.attention, "few_mask", lambda *a: pytest.fail("the mask's read looked up again"))
    rng = np.random.default_rng(3)
    keys, values = (rng.standard_normal((1, HEADS, CAPACITY, SIZE)).astype(np.float32) for _ in range(2))
    for step in range(4):
        length = PAST + step
        q, k, v = (rng.standard_normal((1, HEADS, 1, SIZE)).astype(np.float32) for _ in range(3))
        mask = None
        if lead is not None:
            wide = rng.standard_normal(lead + (2 * (length + 1),)).astype(np.float32)
            mask = wide[..., ::2] if form.startswith("strided") else np.ascontiguousarray(wide[..., :length + 1])
        fed_keys, fed_values = keys[:, :, :length], values[:, :, :length]
        windows = [kv_append.Window(fed_keys, keys, 2, "present_k"),
                   kv_append.Window(fed_values, values, 2, "present_v")]
        with kv_append.appending(windows):
            y, present_k, present_v = kernel.call_if_fits(q, k, v, mask, fed_keys, fed_values)
        assert present_k is windows[0].result and present_v is windows[1].result, step
        np.testing.assert_array_equal(keys[:, :, length], k[:, :, 0])
        np.testing.assert_array_equal(values[:, :, length], v[:, :, 0])
        exact, reach = _exact(q, keys[:, :, :length + 1], values[:, :, :length + 1], mask)
        assert_within(y, exact, gamma(SIZE + length + 8) * 40 * reach, f"y at step {step}")
    assert len(leads) == (0 if lead is None else 1)


def test_a_fitting_step_declines_what_its_kept_reads_do_not_cover(monkeypatch):
    """append_over_windows writes nothing and gives None for a buffer that is not C-contiguous (either cache), a
    mask not float32, a mask over another number of keys, or a mask lead it cannot read; the same call with none of
    those attends (so each case declines for its own reason). Through the kernel, such a buffer takes the general
    path, within the bound, without the compiled step."""
    monkeypatch.setenv("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")
    kernel = _kernel((1, 1, 1, PAST + 1))
    attention = kernel.attention
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, HEADS, 1, SIZE)).astype(np.float32) for _ in range(3))
    mask = rng.standard_normal((1, 1, 1, PAST + 1)).astype(np.float32)
    lead = attention.few_mask_lead(mask.shape, 1)
    assert lead == (1, 1, 1)

    def windows(strided):
        made = []
        for name in ("present_k", "present_v"):
            whole = rng.standard_normal((1, HEADS, CAPACITY, 2 * SIZE)).astype(np.float32)
            physical = whole[..., ::2] if name in strided else np.ascontiguousarray(whole[..., :SIZE])
            made.append(kv_append.Window(physical[:, :, :PAST], physical, 2, name))
        return made

    attention(q, np.ascontiguousarray(windows(())[0].physical[:, :, :PAST + 1]),
              np.ascontiguousarray(windows(())[1].physical[:, :, :PAST + 1]), mask)  # (the small call tried once)
    cases = {"the key buffer strided": (windows(("present_k",)), mask, lead),
             "the value buffer strided": (windows(("present_v",)), mask, lead),
             "a float64 mask": (windows(()), mask.astype(np.float64), lead),
             "a mask over more keys": (windows(()), np.zeros((1, 1, 1, PAST + 2), np.float32), lead),
             "a lead it cannot read": (windows(()), mask, None)}
    for name, (made, fed_mask, fed_lead) in cases.items():
        before = [window.physical.copy() for window in made]
        got = attention.append_over_windows(q, k, v, fed_mask, fed_lead, made[0], made[1], PAST)
        assert got is None, name
        for window, kept in zip(made, before):
            np.testing.assert_array_equal(window.physical, kept, name)
    made = windows(())
    assert attention.append_over_windows(q, k, v, mask, lead, made[0], made[1], PAST) is not None
    np.testing.assert_array_equal(made[0].physical[:, :, PAST], k[:, :, 0])

    made = windows(("present_k",))
    keys, values = made[0].physical, made[1].physical
    calls = []
    compiled = decoder.append_attention_float32  # (the compiled step, counted through a plain function's EntryOnce)
    monkeypatch.setattr(attention, "_append", EntryOnce(lambda *a: calls.append(1) or compiled(*a)))
    past_keys, past_values = keys[:, :, :PAST].copy(), values[:, :, :PAST].copy()
    with kv_append.appending(made):
        y = kernel.call_if_fits(q, k, v, mask, made[0].fed, made[1].fed)[0]
    assert calls == []
    exact, reach = _exact(q, np.concatenate((past_keys, k), 2), np.concatenate((past_values, v), 2), mask)
    assert_within(y, exact, gamma(SIZE + PAST + 8) * 40 * reach, "y over a strided key buffer")
