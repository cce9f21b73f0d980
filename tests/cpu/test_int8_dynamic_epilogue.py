"""A DynamicQuantizeMatMul's Gelu and residual Add as its epilogue (dynamic_epilogues.py,
ops/dynamic_quantize_fused.py), and the kept calls of DynamicQuantizeMatMul and its group: each output equals a
float64 reference of the quantized math and Gelu within float32 rounding, the unfused nodes' bits, and
onnxruntime's; both torch exporters' int8_dynamic BERT take the epilogues."""

from __future__ import annotations

import math

import numpy as np
import onnx_runtime
import pytest
from model_helpers import zoo_model
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import dynamic_epilogues
from onnx_runtime_ep_cpu.compiled import deferred

onnxruntime = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")

MS = "com.microsoft"
K, HIDDEN, WIDTH = 32, 48, 32


def _weights(rng, k: int, n: int, i: int) -> list:
    # weights within [-64, 63]: onnxruntime's u8 x s8 kernels saturate pairwise sums past that
    w = rng.integers(-64, 64, (k, n)).astype(np.int8)
    return [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.float32(0.02), f"ws{i}"),
            numpy_helper.from_array(np.int8(1), f"wz{i}"),
            numpy_helper.from_array(np.float32(rng.standard_normal(n)), f"b{i}")]


def feed_forward(approximate: str, residual: bool = True, seed: int = 5) -> bytes:
    """x (m, K) -> DynamicQuantizeMatMul -> Gelu -> DynamicQuantizeMatMul [-> + r]: a feed-forward layer as
    onnxruntime's dynamic quantization and qdq_fusions.py leave it."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("DynamicQuantizeMatMul", ["x", "w0", "ws0", "wz0", "b0"], ["h"], domain=MS),
             helper.make_node("Gelu", ["h"], ["g"], approximate=approximate),
             helper.make_node("DynamicQuantizeMatMul", ["g", "w1", "ws1", "wz1", "b1"], ["p" if residual else "y"],
                              domain=MS)]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", K])]
    if residual:
        nodes.append(helper.make_node("Add", ["r", "p"], ["y"]))
        inputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, ["m", WIDTH]))
    graph = helper.make_graph(nodes, "ffn", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=_weights(rng, K, HIDDEN, 0) + _weights(rng, HIDDEN, WIDTH, 1))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(MS, 1)])
    m.ir_version = 9
    return m.SerializeToString()


def without_epilogues(data, monkeypatch):
    """Our session of ``data`` with the epilogue pass left out (the unfused nodes)."""
    with monkeypatch.context() as patch:
        patch.setattr(dynamic_epilogues, "DYNAMIC_EPILOGUE_PASSES", [])
        import onnx_runtime_ep_cpu.provider as provider

        patch.setattr(provider, "DYNAMIC_EPILOGUE_PASSES", [], raising=False)
        return onnx_runtime.InferenceSession(data, providers=["cpu"])


def ops(session) -> list[str]:
    return [n.op_type for n in session.placement()]


def _dynamic_product(x: np.ndarray, w: np.ndarray, scale, zero, bias) -> np.ndarray:
    """DynamicQuantizeMatMul in float64 and exact integers, as the ONNX spec writes DynamicQuantizeLinear."""
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    a_scale = np.float32((np.float32(high) - np.float32(low)) / np.float32(255)) if high > low else np.float32(1)
    a_zero = np.clip(np.rint(np.float32(0) - np.float32(low) / a_scale), 0, 255)
    codes = np.clip(np.rint(x / a_scale) + a_zero, 0, 255).astype(np.int64)
    acc = (codes - int(a_zero)) @ (w.astype(np.int64) - int(zero))
    return (acc.astype(np.float64) * (np.float64(a_scale) * np.float64(scale))).astype(np.float32) + bias


def reference(data: bytes, x: np.ndarray, r: np.ndarray | None, approximate: str) -> np.ndarray:
    import onnx

    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load_from_string(data).graph.initializer}
    h = _dynamic_product(x, *(inits[n] for n in ("w0", "ws0", "wz0", "b0"))).astype(np.float64)
    if approximate == "none":
        g = 0.5 * h * (1 + np.vectorize(math.erf)(h / math.sqrt(2)))
    else:
        g = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h ** 3)))
    # (the second product quantizes the float32 Gelu, as the model does)
    y = _dynamic_product(g.astype(np.float32), *(inits[n] for n in ("w1", "ws1", "wz1", "b1")))
    return y.astype(np.float64) if r is None else y.astype(np.float64) + r


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("residual", [True, False])
def test_epilogue_equals_the_nodes_reference_and_onnxruntime(approximate, residual, monkeypatch):
    data = feed_forward(approximate, residual)
    fused = onnx_runtime.InferenceSession(data, providers=["cpu"])
    assert ops(fused).count("DynamicQuantizeFusedMatMul") == (2 if residual else 1)
    assert "Gelu" not in ops(fused) and "Add" not in ops(fused)
    plain = without_epilogues(data, monkeypatch)
    assert "DynamicQuantizeFusedMatMul" not in ops(plain) and "Gelu" in ops(plain)
    oracle = onnxruntime.InferenceSession(data, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(11)
    for rows in (1, 7, 16, 7, 300):  # (a repeat after another shape; 300 x 48 Gelu values: several loop rows)
        feeds = {"x": np.float32(rng.standard_normal((rows, K)) * 2)}
        if residual:
            feeds["r"] = np.float32(rng.standard_normal((rows, WIDTH)))
        for _ in range(3):  # the first call, then the kept ones
            (y,) = fused.run(None, feeds)
            (y_plain,) = plain.run(None, feeds)
            np.testing.assert_array_equal(y, y_plain)
        expected = reference(data, feeds["x"], feeds.get("r"), approximate)
        # the Gelu's float32 loop is within a few ulp; the second product's codes may round one step apart
        np.testing.assert_allclose(y, expected, rtol=0, atol=2e-2 * np.abs(expected).max())
        np.testing.assert_allclose(y, oracle.run(None, feeds)[0], rtol=0, atol=2e-2 * np.abs(expected).max())


def test_broadcast_residual_and_shared_product_stay_correct(monkeypatch):
    # A residual of one row broadcast over the product takes the Add's broadcast after the epilogue's Gelu.
    data = feed_forward("none")
    import onnx

    m = onnx.load_from_string(data)
    m.graph.input[1].type.tensor_type.shape.dim[0].dim_value = 1
    data = m.SerializeToString()
    fused = onnx_runtime.InferenceSession(data, providers=["cpu"])
    plain = without_epilogues(data, monkeypatch)
    feeds = {"x": np.float32(np.random.default_rng(2).standard_normal((5, K))),
             "r": np.float32(np.random.default_rng(3).standard_normal((1, WIDTH)))}
    np.testing.assert_array_equal(fused.run(None, feeds)[0], plain.run(None, feeds)[0])
    # The first product's output also a graph output: its Gelu stays a node of its own, the residual still folds.
    m = onnx.load_from_string(feed_forward("none"))
    m.graph.output.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, None))
    data = m.SerializeToString()
    session = onnx_runtime.InferenceSession(data, providers=["cpu"])
    assert ops(session).count("Gelu") == 1 and ops(session).count("DynamicQuantizeFusedMatMul") == 1
    plain = without_epilogues(data, monkeypatch)
    for y, y_plain in zip(session.run(None, {**feeds, "r": feeds["r"].repeat(5, 0)}),
                          plain.run(None, {**feeds, "r": feeds["r"].repeat(5, 0)})):
        np.testing.assert_array_equal(y, y_plain)


def test_repeated_calls_keep_their_loop_call():
    """DynamicQuantizeMatMul's and its group's kept call (the loop's entry point, no checks): taken on a repeat
    of the last call's shape and constants, and each output still the reference's for alternating shapes."""
    from onnx_runtime_ep_cpu.algorithms.repeat_call import RepeatCall
    from onnx_runtime_ep_cpu.ops.contrib_integer_matmul import dynamic_quantize_matmul
    from onnx_runtime_ep_cpu.ops.dynamic_quantize_group import dynamic_quantize_matmul_group

    rng = np.random.default_rng(4)
    w = rng.integers(-64, 64, (K, WIDTH)).astype(np.int8)
    scale, zero, bias = np.array(0.02, np.float32), np.array(1, np.int8), np.float32(rng.standard_normal(WIDTH))
    for value in (w, scale, zero, bias):
        value.flags.writeable = False  # as initializers are
    single = helper.make_node("DynamicQuantizeMatMul", ["x", "w", "s", "z", "b"], ["y"], domain=MS)
    group = helper.make_node("DynamicQuantizeMatMulGroup", ["x", "w", "s", "z", "b", "w", "s", "z", "b"],
                             ["y0", "y1"], domain="ai.onnx_runtime.cpu")
    from onnx_runtime.ir import Node

    def made() -> list:
        return [dynamic_quantize_matmul(Node(single.op_type, list(single.input), list(single.output), domain=MS),
                                        None, 1),
                dynamic_quantize_matmul_group(Node(group.op_type, list(group.input), list(group.output),
                                                   domain=group.domain), None, 1)]

    x = np.float32(rng.standard_normal((1, 3, K)))
    made()[0](x, w, scale, zero, bias)
    made()[1](x, w, scale, zero, bias, w, scale, zero, bias)
    deferred.wait_ready(300)  # (the loader links or compiles what a first call missed: a kernel then binds it)
    kernels = made()
    for kernel in kernels:
        kept = next(c.cell_contents for c in kernel.__closure__ if isinstance(c.cell_contents, RepeatCall))
        args = (w, scale, zero, bias) * (2 if kernel is kernels[1] else 1)
        for rows in (3, 3, 3, 8, 8, 3):
            x = np.float32(rng.standard_normal((1, rows, K)))
            outputs = kernel(x, *args)
            for y in outputs:
                assert y.shape == (1, rows, WIDTH)
                np.testing.assert_allclose(y[0], _dynamic_product(x[0], w, scale, zero, bias), rtol=1e-6, atol=1e-5)
            if len(outputs) == 2:
                assert not np.shares_memory(outputs[0], outputs[1])
        assert kept.match(x, args) is not None  # the last call's shape and constants are kept


@pytest.mark.parametrize("exporter", ["torchscript", "dynamo"])
def test_zoo_bert_takes_the_epilogues(exporter, monkeypatch):
    entry, path = zoo_model(f"bert.{exporter}.int8_dynamic")
    import zoo_feeds

    feeds = zoo_feeds.make_feeds(entry["calls"]["default"])
    ours = onnx_runtime.InferenceSession(path, providers=["cpu"])
    # each layer's attention output (+ residual), intermediate (Gelu) and output (+ residual) products
    assert ops(ours).count("DynamicQuantizeFusedMatMul") == 6 and "Gelu" not in ops(ours)
    plain = without_epilogues(path, monkeypatch)
    assert "DynamicQuantizeFusedMatMul" not in ops(plain)
    theirs = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    for y, y_plain, y_ort in zip(ours.run(None, feeds), plain.run(None, feeds), theirs.run(None, feeds)):
        np.testing.assert_array_equal(y, y_plain)
        np.testing.assert_allclose(y, y_ort, rtol=0, atol=1e-3 * max(1.0, float(np.abs(y_ort).max())))
