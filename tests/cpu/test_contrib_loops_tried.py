"""The contrib kernels' compiled calls (ContribPackedAttention's loops, EmbedLayerNormalization's, RotaryEmbedding's)
run inside a deferred.Trial until one ran whole: a loop numba's cache misses after the loader's switch raises
WouldCompile there, the kernel's numpy path answers that call (no compile on the run's thread) and the next call
tries the compiled path again. Each compiled call is replaced by one that misses once, then runs the real loop;
every answer is checked against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.ops import contrib_normalization, contrib_transformer

RNG = np.random.default_rng(53)
CONTRIB = "com.microsoft"


def _proto(node, inputs, inits):
    graph = helper.make_graph([node], "one", inputs, [helper.make_tensor_value_info(node.output[0],
                                                                                   TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(CONTRIB, 1)])
    proto.ir_version = 8
    return proto


def _attention():
    hidden = 32
    inits = {"w": (RNG.standard_normal((hidden, 3 * hidden)) * 0.3).astype(np.float32),
             "b": RNG.standard_normal(3 * hidden).astype(np.float32)}
    node = helper.make_node("Attention", ["x", "w", "b", "mask"], ["y"], domain=CONTRIB, num_heads=2)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 11, hidden]),
              helper.make_tensor_value_info("mask", TensorProto.INT32, [2])]
    feeds = {"x": RNG.standard_normal((2, 11, hidden)).astype(np.float32), "mask": np.array([11, 6], np.int32)}
    return _proto(node, inputs, inits), feeds


def _embedding():
    hidden = 16
    inits = {"word": RNG.standard_normal((20, hidden)).astype(np.float32),
             "position": RNG.standard_normal((12, hidden)).astype(np.float32),
             "segment": RNG.standard_normal((2, hidden)).astype(np.float32),
             "gamma": RNG.standard_normal(hidden).astype(np.float32),
             "beta": RNG.standard_normal(hidden).astype(np.float32)}
    node = helper.make_node("EmbedLayerNormalization", ["ids", "segments", "word", "position", "segment", "gamma",
                                                        "beta", "mask"], ["y", "mask_index"], domain=CONTRIB)
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT32, [2, 9]) for name in ("ids", "segments", "mask")]
    feeds = {"ids": RNG.integers(0, 20, (2, 9)).astype(np.int32),
             "segments": RNG.integers(0, 2, (2, 9)).astype(np.int32),
             "mask": np.array([[1] * 9, [1] * 5 + [0] * 4], np.int32)}
    return _proto(node, inputs, inits), feeds


def _rotary():
    inits = {"cos": RNG.standard_normal((16, 4)).astype(np.float32),
             "sin": RNG.standard_normal((16, 4)).astype(np.float32)}
    node = helper.make_node("RotaryEmbedding", ["x", "positions", "cos", "sin"], ["y"], domain=CONTRIB)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 5, 8]),
              helper.make_tensor_value_info("positions", TensorProto.INT64, [2, 5])]
    feeds = {"x": RNG.standard_normal((2, 3, 5, 8)).astype(np.float32),
             "positions": RNG.integers(0, 16, (2, 5)).astype(np.int64)}
    return _proto(node, inputs, inits), feeds


def _packed_loop_owner():
    from onnx_runtime_ep_cpu.compiled import packed_attention

    return packed_attention, "product_in_lanes_" if contrib_transformer.tiled_attention.few_rows_loops()[0] \
        is not None else "packed_self_attention_"


CASES = {
    "attention": (_attention, _packed_loop_owner),
    "embedding": (_embedding, lambda: (contrib_normalization, "fused_embed_norm")),
    "rotary": (_rotary, lambda: (contrib_transformer, "_compiled_rotary")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_cache_miss_is_served_by_the_numpy_path_then_the_loop_is_tried_again(case, monkeypatch):
    import onnxruntime

    build, owner = CASES[case]
    module, name = owner()
    real = getattr(module, name)
    calls: list[bool] = []  # per call of the compiled entry: whether inside a Trial

    def missing_once(*args):
        calls.append(deferred.in_trial())
        if len(calls) == 1:
            raise deferred.WouldCompile(name)
        return real(*args)

    monkeypatch.setattr(module, name, missing_once)
    for target in (contrib_transformer, contrib_normalization):
        monkeypatch.setattr(target, "numpy_first", lambda *kinds: False)
    monkeypatch.setattr(deferred.state, "deferring", False)
    proto, feeds = build()
    session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
    oracle = onnxruntime.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = oracle.run(None, feeds)[0]
    for _ in range(3):
        np.testing.assert_allclose(session.run(None, feeds)[0], expected, rtol=3e-5, atol=3e-5)
    # the miss and the first whole run inside a Trial; after it, called directly
    assert calls == [True, True, False], calls
