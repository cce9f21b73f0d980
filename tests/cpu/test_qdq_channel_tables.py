"""A QDQ chain with constants of one value per channel (qdq_tables.fuse_channel_tables): DenseNet's pre-activation
layer, a rounded activation -> BatchNormalization -> rounding -> Mul by a per-channel scale -> rounding -> Add of a
per-channel shift, runs as one ChannelGridTable (each channel's table made by the chain's own kernels), bit for bit
the unfused nodes' values and within one code of onnxruntime; constants that broadcast along another axis keep the
nodes."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import onnxruntime
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu import provider, qdq_fusions
from onnx_runtime_ep_cpu.compiled import generic_int8, quantize

C, H, W = 8, 12, 12


def _rounding(name, scale, zero, out):
    return [helper.make_node("QuantizeLinear", [name, scale, zero], [f"{out}_q"]),
            helper.make_node("DequantizeLinear", [f"{out}_q", scale, zero], [out])]


def _model(mul_shape=(1, C, 1, 1)):
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(v, n) for v, n in (
        (np.array(0.04, np.float32), "s0"), (np.array(120, np.uint8), "z0"),
        (np.array(0.03, np.float32), "s1"), (np.array(128, np.uint8), "z1"),
        (np.array(0.05, np.float32), "s2"), (np.array(100, np.uint8), "z2"),
        (np.array(0.06, np.float32), "s3"), (np.array(90, np.uint8), "z3"),
        (rng.uniform(0.5, 1.5, C).astype(np.float32), "gamma"), (rng.standard_normal(C).astype(np.float32), "beta"),
        (rng.standard_normal(C).astype(np.float32) * 0.3, "mean"), (rng.uniform(0.5, 2, C).astype(np.float32), "var"),
        (rng.uniform(0.5, 2, mul_shape).astype(np.float32), "k"),
        (rng.standard_normal((C, 1, 1)).astype(np.float32), "b"))]
    nodes = [*_rounding("x", "s0", "z0", "r0"),
             helper.make_node("BatchNormalization", ["r0", "gamma", "beta", "mean", "var"], ["bn"], epsilon=1e-5),
             *_rounding("bn", "s1", "z1", "r1"), helper.make_node("Mul", ["r1", "k"], ["m"]),
             *_rounding("m", "s2", "z2", "r2"), helper.make_node("Add", ["r2", "b"], ["a"]),
             *_rounding("a", "s3", "z3", "r3"),
             helper.make_node("ReduceSum", ["r3"], ["y"], keepdims=1)]  # (a reader the chain serves)
    return make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [2, C, H, W])],
                      [tensor_info("y", TensorProto.FLOAT, None), tensor_info("r2", TensorProto.FLOAT, None)],
                      inits, opset=13)


def _session(model, monkeypatch=None):
    options = ort.SessionOptions()
    options.add_session_config_entry("session.plan_cache", "0")
    if monkeypatch is not None:  # the chain's nodes as they are
        monkeypatch.setattr(provider, "QDQ_PASSES", [p for p in qdq_fusions.QDQ_PASSES
                                                     if p is not qdq_fusions.fuse_channel_tables])
    return ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])


def test_a_pre_activation_chain_is_one_table_with_the_nodes_bits(monkeypatch):
    model = _model()
    x = (np.random.default_rng(1).standard_normal((2, C, H, W)) * 3).astype(np.float32)
    x[0, 0, 0, :3] = [np.nan, 1e9, -np.inf]
    fused = _session(model)
    ops = [n.op_type for n in fused.placement()]
    assert "ChannelGridTable" in ops and "BatchNormalization" not in ops
    got = [fused.run(None, {"x": x}) for _ in range(3)]  # (the first runs may take the numpy lookup)
    want = _session(model, monkeypatch)
    assert "ChannelGridTable" not in [n.op_type for n in want.placement()]
    expected = want.run(None, {"x": x})
    for outputs in got:
        for a, b in zip(outputs, expected):
            np.testing.assert_array_equal(a, b)
    oracle = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    np.testing.assert_allclose(got[-1][1], oracle[1], atol=0.05 + 1e-6)  # (r2: within one code of its grid)


def test_constants_along_another_axis_keep_their_nodes(monkeypatch):
    # A Mul by one value per column broadcasts along the width, not the channels: it stays a node between the
    # tables of the chain's parts before and after it, with the same bits.
    model = _model(mul_shape=(W,))
    fused = _session(model)
    ops = [n.op_type for n in fused.placement()]
    assert ops.count("ChannelGridTable") == 2 and "MulRounded" in ops
    x = np.random.default_rng(3).standard_normal((2, C, H, W)).astype(np.float32)
    got = fused.run(None, {"x": x})
    for a, b in zip(got, _session(model, monkeypatch).run(None, {"x": x})):
        np.testing.assert_array_equal(a, b)


def test_the_lookup_and_its_numpy_twin_agree():
    rng = np.random.default_rng(2)
    x = ((rng.integers(0, 256, (2, 5, 37)).astype(np.float32) - 128) * np.float32(0.05))
    x[0, 0, :4] = [np.nan, 1e9, -np.inf, np.float32(0.05) * np.float32(2.5)]
    table = rng.standard_normal((5, 256)).astype(np.float32)
    outs = [np.empty_like(x), np.empty_like(x)]
    generic_int8.channel_grid_lookup(x, 0.05, 128.0, 0.0, 255.0, table, outs[0])
    quantize.channel_grid_lookup(x, 0.05, 128.0, 0.0, 255.0, table, outs[1])
    np.testing.assert_array_equal(outs[0], outs[1])
    assert outs[1][0, 0, 0] == table[0, 128] and outs[1][0, 0, 1] == table[0, 255]
    assert outs[1][0, 0, 2] == table[0, 0] and outs[1][0, 0, 3] == table[0, 130]  # (2.5 rounds to even)



def _conv_model(float_reader: bool = False):
    """x -> rounding -> Mul and Add per channel (a batch normalization as quant_pre_process leaves it), rounding
    between, Relu -> QuantizeLinear -> DequantizeLinear -> Conv (int8 weights, 10.6M multiply-adds: an integer group
    where the host has VNNI) -> QuantizeLinear -> DequantizeLinear -> y: DenseNet's pre-activation before its
    bottleneck convolution; ``float_reader``: the rounded activation is an output too."""
    rng = np.random.default_rng(4)
    channels, out_channels, size = 32, 64, 24
    inits = [numpy_helper.from_array(v, n) for v, n in (
        (np.array(0.04, np.float32), "s0"), (np.array(120, np.uint8), "z0"),
        (np.array(0.03, np.float32), "s1"), (np.array(0, np.uint8), "z1"),
        (np.array(0.05, np.float32), "s2"), (np.array(100, np.uint8), "z2"),
        (rng.uniform(0.5, 2, (channels, 1, 1)).astype(np.float32), "k"),
        (rng.standard_normal((channels, 1, 1)).astype(np.float32), "b"),
        (rng.integers(-127, 128, (out_channels, channels, 3, 3)).astype(np.int8), "w"),
        (np.array(0.01, np.float32), "ws"), (np.array(0, np.int8), "wz"),
        (np.array(0.2, np.float32), "ys"), (np.array(128, np.uint8), "yz"))]
    nodes = [*_rounding("x", "s0", "z0", "r0"),
             helper.make_node("Mul", ["r0", "k"], ["m"]), *_rounding("m", "s2", "z2", "r2"),
             helper.make_node("Add", ["r2", "b"], ["a"]), helper.make_node("Relu", ["a"], ["bn"]),
             *_rounding("bn", "s1", "z1", "r1"),
             helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wf"]),
             helper.make_node("Conv", ["r1", "wf"], ["c"], pads=[1, 1, 1, 1]),
             *_rounding("c", "ys", "yz", "y")]
    outputs = [tensor_info("y", TensorProto.FLOAT, None)] + ([tensor_info("r1", TensorProto.FLOAT, None)]
                                                               if float_reader else [])
    return make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [1, channels, size, size])], outputs, inits,
                      opset=13), (1, channels, size, size)


def _without_codes(monkeypatch):
    monkeypatch.setattr(provider, "QDQ_PASSES", [p for p in qdq_fusions.QDQ_PASSES
                                                 if getattr(p, "__name__", "") != "channel_tables_to_codes"])


def test_a_table_before_integer_groups_writes_their_codes(monkeypatch):
    # The table's entries quantized once to the convolution's grid: the node writes uint8 codes, the group reads them
    # as they are (quantize_a 0), and the output has the bits of the float table quantized by the group per call.
    from onnx_runtime_ep_cpu.compiled import qgemm_quads

    model, shape = _conv_model()
    x = (np.random.default_rng(5).standard_normal(shape) * 3).astype(np.float32)
    x[0, 0, 0, :3] = [np.nan, 1e9, -np.inf]
    fused = _session(model)
    nodes = fused.graph_for({"x": x}).nodes
    tables = [n for n in nodes if n.op_type == "ChannelGridTable"]
    assert len(tables) == 1
    got = [fused.run(None, {"x": x})[0] for _ in range(3)]
    if qgemm_quads.AVAILABLE:  # (elsewhere the convolution stays float and the table keeps float values)
        conv = next(n for n in nodes if n.op_type == "QuantizedConv")
        assert tables[0].attrs["codes_zero"] == 0 and conv.inputs[0] == tables[0].outputs[0]
        assert conv.attrs["quantize_a"] == 0
    _without_codes(monkeypatch)
    want = _session(model).run(None, {"x": x})[0]
    for value in got:
        np.testing.assert_array_equal(value, want)
    oracle = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x})[0]
    assert np.abs(got[-1] - oracle).max() <= 0.2 + 1e-6  # (within one code of the output grid)


def test_a_table_with_a_float_reader_keeps_float_values():
    model, shape = _conv_model(float_reader=True)
    x = np.random.default_rng(6).standard_normal(shape).astype(np.float32)
    fused = _session(model)
    tables = [n for n in fused.graph_for({"x": x}).nodes if n.op_type == "ChannelGridTable"]
    assert tables and all("codes_scale" not in n.attrs for n in tables)
    y, r1 = fused.run(None, {"x": x})
    assert r1.dtype == np.float32 and np.all(r1 >= 0)  # (z1 = 0: the rounded values from the grid's lowest code)


def test_table_codes_quantize_as_the_groups_do():
    from onnx_runtime_ep_cpu.ops.grid_table import codes_of_table

    table = np.array([[-1, 0, 0.5, 0.015, 0.025, 100, np.nan, -0.004]], np.float32)
    np.testing.assert_array_equal(codes_of_table(table, 0.01, 0, False), [[0, 0, 50, 2, 2, 255, 0, 0]])
    np.testing.assert_array_equal(codes_of_table(table, 0.01, -5, True), [[-105, -5, 45, -3, -3, 127, -128, -5]])
