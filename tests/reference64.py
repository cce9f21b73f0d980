"""Float64 references and the rounding-error bounds float results are checked against.

A float32 result is compared with the exact (float64) value within what any correct float32
computation meets, whatever order it sums in and whichever BLAS or compiled loop it runs:
|fl(sum of n terms) - sum| <= gamma(n) * sum of |terms|, gamma(n) = n u / (1 - n u), u the unit roundoff
(Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., 3.1-3.5). Never bit for bit against
another library's rounding, which changes with its release and the host's instructions.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper


def unit_roundoff(dtype) -> float:
    """u: half the distance from 1 to the next value of ``dtype`` (2**-24 for float32)."""
    import ml_dtypes

    return float(ml_dtypes.finfo(dtype).eps) / 2


def gamma(terms: int, dtype=np.float32) -> float:
    """gamma(n) = n u / (1 - n u): the relative error bound of n rounded operations in ``dtype``."""
    nu = terms * unit_roundoff(dtype)
    return nu / (1 - nu)


def product_error_bound(a: np.ndarray, b: np.ndarray, dtype=np.float32, extra_terms: int = 0,
                        addends: tuple = ()) -> np.ndarray:
    """The bound on |fl(a @ b + addends...) - (a @ b + addends...)| for any summation order: gamma of the
    inner size plus the additions, times the sum of the magnitudes (|a| @ |b| + |addend| ...)."""
    magnitude = np.abs(np.asarray(a, np.float64)) @ np.abs(np.asarray(b, np.float64))
    for addend in addends:
        magnitude = magnitude + np.abs(np.asarray(addend, np.float64))
    return gamma(a.shape[-1] + len(addends) + extra_terms, dtype) * magnitude


def assert_within(got, exact, bound, err_msg: str = "") -> None:
    """|got - exact| <= bound elementwise where ``exact`` is finite; where it is NaN ``got`` is NaN, where it
    is infinite ``got`` is the same infinity."""
    got = np.asarray(got).astype(np.float64)
    exact = np.asarray(exact, np.float64)
    bound = np.broadcast_to(np.asarray(bound, np.float64), exact.shape)
    assert got.shape == exact.shape, f"{err_msg}: shape {got.shape}, expected {exact.shape}"
    finite = np.isfinite(exact)
    np.testing.assert_array_equal(np.isnan(got[~finite]), np.isnan(exact[~finite]), err_msg=f"{err_msg}: NaN")
    infinite = np.isinf(exact)
    np.testing.assert_array_equal(got[infinite], exact[infinite], err_msg=f"{err_msg}: infinities")
    error = np.abs(got[finite] - exact[finite])
    allowed = bound[finite]
    over = ~(error <= allowed)
    if over.any():
        worst = np.argmax(np.where(over, error - allowed, -np.inf))
        raise AssertionError(
            f"{err_msg}: {int(over.sum())} of {error.size} values off the exact result by more than the bound; "
            f"worst: {got[finite][worst]!r} vs exact {exact[finite][worst]!r}, error {error[worst]:.3g} > "
            f"bound {allowed[worst]:.3g}")


def float64_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` computing in float64 where it computes in float32 (initializers, inputs, outputs,
    value infos and tensor attributes): the exact reference float32 results are bounded against."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph

    def widen(tensor):
        if tensor.data_type == TensorProto.FLOAT:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float64), tensor.name))

    for tensor in graph.initializer:
        widen(tensor)
    for info in (*graph.input, *graph.output, *graph.value_info):
        if info.type.tensor_type.elem_type == TensorProto.FLOAT:
            info.type.tensor_type.elem_type = TensorProto.DOUBLE
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR:
                widen(attr.t)
            if node.op_type in ("Cast", "CastLike") and attr.name == "to" and attr.i == TensorProto.FLOAT:
                attr.i = TensorProto.DOUBLE
    return model


def run_float64(model: onnx.ModelProto, feeds: dict, outputs=None) -> list:
    """``model``'s outputs computed in float64 by onnx's reference evaluator (the oracle), float32 feeds
    widened."""
    from onnx.reference import ReferenceEvaluator

    wide = {k: v.astype(np.float64) if getattr(v, "dtype", None) == np.float32 else v for k, v in feeds.items()}
    return ReferenceEvaluator(float64_model(model)).run(outputs, wide)


def integer_conv(padded: np.ndarray, w: np.ndarray, strides, dilations) -> np.ndarray:
    """The exact int64 convolution (N, M, OH, OW) of already padded (N, C, H, W) codes with (M, C, KH, KW)
    weights, zero points taken off both beforehand: one einsum per tap."""
    kh, kw = w.shape[2:]
    oh = (padded.shape[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (padded.shape[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    acc = np.zeros((padded.shape[0], w.shape[0], oh, ow), np.int64)
    for i in range(kh):
        for j in range(kw):
            window = padded[:, :, i * dilations[0]:i * dilations[0] + strides[0] * (oh - 1) + 1:strides[0],
                            j * dilations[1]:j * dilations[1] + strides[1] * (ow - 1) + 1:strides[1]]
            acc += np.einsum("nchw,mc->nmhw", window.astype(np.int64), w[:, :, i, j].astype(np.int64))
    return acc


def contrib_attention(qkv: np.ndarray, heads: int, counts=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """com.microsoft Attention in float64 from its packed (batch, steps, 3 * width) Q/K/V product: heads of width /
    heads, scale 1/sqrt(head size), keys at or past each batch row's ``counts`` masked by -10000. Returns the output
    and, for error bounds, the masked scores and V."""
    qkv = np.asarray(qkv, np.float64)
    batch, steps, width = qkv.shape
    size = width // 3 // heads
    q, k, v = (qkv[..., i * heads * size:(i + 1) * heads * size].reshape(batch, steps, heads, size)
               .transpose(0, 2, 1, 3) for i in range(3))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(size)
    if counts is not None:
        scores = scores + np.where(np.arange(steps)[None, :] >= counts[:, None], -10000.0, 0.0)[:, None, None]
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    y = (weights / weights.sum(axis=-1, keepdims=True)) @ v
    return y.transpose(0, 2, 1, 3).reshape(batch, steps, heads * size), scores, v
