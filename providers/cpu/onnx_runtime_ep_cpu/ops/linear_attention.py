"""The recurrent blocks of linear-attention layers (Qwen3-Next's gated DeltaNet): LinearAttention's state
recurrence and CausalConvWithState's short depthwise causal convolution, direct numpy kernels in float32
(ops/transformer.py has Attention).
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime.errors import InvalidGraphError

from ..algorithms.activations import sigmoid
from ..algorithms.precision import compute_dtype
from ..registry import register
from ._common import argument_error, graph_error, has_input


def _silu(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):  # exp overflow for very negative x: sigmoid is 0 there
        return x * sigmoid(x)


# -- LinearAttention -----------------------------------------------------------------------------

_UPDATE_RULES = ("linear", "gated", "delta", "gated_delta")


@register("LinearAttention", since=27)
def linear_attention(node, shapes, opset):
    rule = node.attr("update_rule", "gated_delta")
    if rule not in _UPDATE_RULES:
        raise graph_error(node, "update_rule", f"is {rule!r}; expected one of {', '.join(_UPDATE_RULES)}")
    heads = {}
    for attr in ("q_num_heads", "kv_num_heads"):
        value = node.attr(attr)
        if value is None or int(value) <= 0:
            raise graph_error(node, attr, f"is {value}; it is required and must be positive")
        heads[attr] = int(value)
    q_heads, kv_heads = heads["q_num_heads"], heads["kv_num_heads"]
    if q_heads % kv_heads:
        raise graph_error(node, "q_num_heads", f"({q_heads}) must be a multiple of kv_num_heads ({kv_heads})")
    gated = rule in ("gated", "gated_delta")
    delta = rule in ("delta", "gated_delta")
    for needed, index, name in ((gated, 4, "decay"), (delta, 5, "beta")):
        if needed and not has_input(node, index):
            raise InvalidGraphError(f"node {node.name!r} (LinearAttention): update_rule {rule!r} needs input {name!r}")
    scale_attr = float(node.attr("scale", 0.0))
    group = q_heads // kv_heads

    def kernel(query, key, value, past_state=None, decay=None, beta=None):
        batch, steps = query.shape[:2]
        d_k, d_v = query.shape[2] // q_heads, value.shape[2] // kv_heads
        f32 = np.float32
        # Query heads kv*group .. kv*group+group-1 read KV head kv's state.
        q = query.astype(f32).reshape(batch, steps, kv_heads, group, d_k)
        k = key.astype(f32).reshape(batch, steps, kv_heads, d_k)
        v = value.astype(f32).reshape(batch, steps, kv_heads, d_v)
        if past_state is None:
            state = np.zeros((batch, kv_heads, d_k, d_v), f32)
        else:
            state = past_state.astype(f32)  # a copy: the recurrence updates it in place
        if gated:
            per_key = decay.shape[-1] == kv_heads * d_k
            if not per_key and decay.shape[-1] != kv_heads:
                raise argument_error(
                    node, f"decay's last dim {decay.shape[-1]} must be {kv_heads} or {kv_heads * d_k}"
                )
            gate = np.exp(decay.astype(f32)).reshape(batch, steps, kv_heads, d_k if per_key else 1, 1)
        if delta:
            rate = beta.astype(f32).reshape(batch, steps, beta.shape[-1], 1)
        out = np.empty((batch, steps, kv_heads, group, d_v), f32)
        for t in range(steps):
            k_t, v_t = k[:, t], v[:, t]
            if gated:
                state *= gate[:, t]
            if delta:
                recalled = np.matmul(k_t[:, :, None, :], state)[:, :, 0]  # S^T k: (B, H_kv, d_v)
                v_t = rate[:, t] * (v_t - recalled)
            state += k_t[:, :, :, None] * v_t[:, :, None, :]
            out[:, t] = np.matmul(q[:, t], state)
        out *= f32(scale_attr or 1 / math.sqrt(d_k))
        output = out.reshape(batch, steps, q_heads * d_v).astype(query.dtype, copy=False)
        state_dtype = query.dtype if past_state is None else past_state.dtype
        return output, state.astype(state_dtype, copy=False)

    return kernel


# -- CausalConvWithState -------------------------------------------------------------------------


@register("CausalConvWithState", since=27)
def causal_conv_with_state(node, shapes, opset):
    activation = node.attr("activation", "none")
    if activation not in ("none", "silu", "swish"):
        raise graph_error(node, "activation", f"is {activation!r}; expected 'none', 'silu' or 'swish'")

    def kernel(x, weight, bias=None, past_state=None):
        if x.ndim != 3 or weight.ndim != 3 or weight.shape[:2] != (x.shape[1], 1) or weight.shape[2] < 1:
            raise argument_error(node, f"input {x.shape} must be (batch, channels, length) and weight {weight.shape} "
                                       f"(channels, 1, taps) with taps >= 1, a depthwise kernel per channel")
        batch, channels, length = x.shape
        taps = weight.shape[2]
        if past_state is not None and past_state.shape != (batch, channels, taps - 1):
            raise argument_error(node, f"past_state {past_state.shape} must be {(batch, channels, taps - 1)}: "
                                       f"(batch, channels, taps - 1)")
        if past_state is None:
            past_state = np.zeros((batch, channels, taps - 1), dtype=x.dtype)
        padded = np.concatenate((past_state.astype(x.dtype, copy=False), x), axis=2)
        dtype = compute_dtype(x.dtype)
        xc = padded.astype(dtype, copy=False)
        w = weight.reshape(channels, taps, 1).astype(dtype, copy=False)
        # Depthwise causal conv: output t sees padded positions t .. t + taps - 1.
        y = w[:, 0] * xc[:, :, :length]
        for j in range(1, taps):
            y += w[:, j] * xc[:, :, j:j + length]
        if bias is not None:
            y += bias.astype(dtype, copy=False)[:, None]
        if activation != "none":
            y = _silu(y)
        return y.astype(x.dtype, copy=False), padded[:, :, length:].copy()

    return kernel
