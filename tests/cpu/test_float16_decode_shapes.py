"""A decoder step in a generation loop whose positions and causal mask read the lengths off Shape of its past and
of the present (Concat of the past and the new entries), where the model is not plain float32: a float16 model
with float32 edges (onnxruntime's float16 tool, keep_io_types: the past is rounded on the way in, RoundToHalf in
precision_fusions.py), or new entries made by a 4-bit (MatMulNBits) or dynamic int8 (DynamicQuantizeMatMul)
product. Those steps must be recognized as shape-only, as in the float32 model, so that a step with a new past
length instantiates them (session/shape_program.py) instead of running them; the results stay onnxruntime's
(the oracle)."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper

HEADS, DIM = 2, 4
_SHAPE_STEPS = ("Shape", "Gather", "Range", "Unsqueeze", "LessOrEqual", "Where", "Sub")


def _decoder_step(product: str = "float16"):
    """new = x @ w (``product``: how); present = Concat(past, new); scores = new @ present^T + causal bias, the
    bias from Range(past length, total) against Range(0, total), both lengths read by Shape (of the past and the
    present)."""
    converter = pytest.importorskip("onnxruntime.transformers.float16")
    rng = np.random.default_rng(21)
    consts = {"w": (rng.standard_normal((DIM, DIM)) * 0.5).astype(np.float32), "zero": np.array(0, np.int64),
              "one": np.array(1, np.int64), "two": np.array(2, np.int64), "ax0": np.array([0], np.int64),
              "ax1": np.array([1], np.int64), "nil": np.array(0.0, np.float32), "neg": np.array(-1e4, np.float32)}
    n = helper.make_node
    nodes = [n("MatMul", ["x", "w"], ["new"]) if product == "float16" else _weight_product(product, consts),
             n("Concat", ["past", "new"], ["present"], axis=2),
             n("Shape", ["past"], ["past_shape"]),
             n("Gather", ["past_shape", "two"], ["past_len"], axis=0),
             n("Shape", ["present"], ["present_shape"]),
             n("Gather", ["present_shape", "two"], ["total"], axis=0),
             n("Range", ["past_len", "total", "one"], ["q_pos"]),
             n("Range", ["zero", "total", "one"], ["k_pos"]),
             n("Unsqueeze", ["k_pos", "ax0"], ["k_row"]),
             n("Unsqueeze", ["q_pos", "ax1"], ["q_col"]),
             n("LessOrEqual", ["k_row", "q_col"], ["causal"]),
             n("Where", ["causal", "nil", "neg"], ["bias"]),
             n("Transpose", ["present"], ["present_t"], perm=[0, 1, 3, 2]),
             n("MatMul", ["new", "present_t"], ["raw"]),
             n("Add", ["raw", "bias"], ["scores"])]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [1, HEADS, "seq", DIM]),
                               tensor_info("past", TensorProto.FLOAT, [1, HEADS, "past", DIM])],
                       [tensor_info("scores", TensorProto.FLOAT, None),
                        tensor_info("present", TensorProto.FLOAT, None)],
                       [numpy_helper.from_array(value, name) for name, value in consts.items()])
    if product != "float16":
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
        return model.SerializeToString()
    return converter.convert_float_to_float16(model, keep_io_types=True).SerializeToString()


def _weight_product(product: str, consts: dict):
    """x @ w as com.microsoft MatMulNBits (4-bit blocks of 16, one block per column) or DynamicQuantizeMatMul."""
    rng = np.random.default_rng(22)
    if product == "matmul_nbits":
        codes = rng.integers(0, 16, (DIM, 16), dtype=np.uint8)  # (N, block): K = DIM codes used, the rest padding
        consts["packed"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(DIM, 1, 8)
        consts["scales"] = rng.uniform(0.05, 0.2, DIM).astype(np.float32)
        return helper.make_node("MatMulNBits", ["x", "packed", "scales"], ["new"], domain="com.microsoft", K=DIM,
                                N=DIM, bits=4, block_size=16)
    consts["w8"] = rng.integers(-100, 100, (DIM, DIM), dtype=np.int8)
    consts["w_scale"], consts["w_zero"] = np.array([0.01], np.float32), np.array([0], np.int8)
    return helper.make_node("DynamicQuantizeMatMul", ["x", "w8", "w_scale", "w_zero"], ["new"],
                            domain="com.microsoft")


def _feeds(steps: int):
    """A prefill of three tokens, then one token per step, the present fed back as the past."""
    rng = np.random.default_rng(5)
    past = np.zeros((1, HEADS, 0, DIM), np.float32)
    x = rng.standard_normal((1, HEADS, 3, DIM)).astype(np.float32)
    for _ in range(steps + 1):
        yield {"x": x, "past": past}
        past = np.concatenate([past, x], axis=2)  # the present, up to its float16 rounding
        x = rng.standard_normal((1, HEADS, 1, DIM)).astype(np.float32)


@pytest.mark.parametrize("product", ["float16", "matmul_nbits", "dynamic_int8"])
def test_a_new_past_length_instantiates_the_shape_steps(product, tmp_path):
    model = _decoder_step(product)
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "profile")
    ours = ort.InferenceSession(model, options, providers=["cpu"])
    oracle = pytest.importorskip("onnxruntime").InferenceSession(model, providers=["CPUExecutionProvider"])
    later = 3  # the steps after the first decode steps (the program is built from the second new shape)
    for index, feeds in enumerate(_feeds(steps=3 + later)):
        if index == 3:
            ours.end_profiling()  # a new profile: the later steps alone
        got, want = ours.run(None, feeds), oracle.run(None, feeds)
        for a, b in zip(got, want):
            assert a.shape == b.shape
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-2 * max(1.0, float(np.abs(b).max())))
    ran = ours.profile_summary()
    assert ran["MatMul"][1] >= later, ran  # the profile did see the later steps
    assert not [op for op in _SHAPE_STEPS if op in ran], ran  # their shape work was instantiated, not run


def test_the_rounding_of_a_growing_past_is_made_once(monkeypatch):
    """RoundToHalf reads no planned shape: one kernel serves every past length (a kernel per length walked the whole
    graph at each new step)."""
    from onnx_runtime.session import steps

    made = []
    original = steps.make_kernel

    def counting(handle, node, shapes, graph):
        made.append(node.op_type)
        return original(handle, node, shapes, graph)

    monkeypatch.setattr(steps, "make_kernel", counting)
    model = _decoder_step("float16")
    ours = ort.InferenceSession(model, providers=["cpu"])
    oracle = pytest.importorskip("onnxruntime").InferenceSession(model, providers=["CPUExecutionProvider"])
    for index, feeds in enumerate(_feeds(steps=12)):
        if index == 5:
            made.clear()  # (the template of the decode steps is made by now)
        got, want = ours.run(None, feeds), oracle.run(None, feeds)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=1e-2 * max(1.0, float(np.abs(b).max())))
    assert "RoundToHalf" not in made, made
