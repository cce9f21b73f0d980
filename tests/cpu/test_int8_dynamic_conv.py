"""onnxruntime's dynamically quantized Conv (DynamicQuantizeLinear -> ConvInteger -> Cast -> Mul by the scales'
product -> bias Add) as one DynamicQuantizeConv (dynamic_conv_fusions.py, ops/dynamic_quantize_conv.py): against
a float64 reference of the quantized arithmetic (the codes, the exact integer convolution, the rescale), the
unfused nodes and onnxruntime, on 1-D and 2-D geometries and on the zoo's ViT and Whisper exports from both torch
exporters."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx_runtime
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from reference64 import integer_conv

ZOO = Path(__file__).resolve().parents[2] / "benchmarks" / ".models" / "zoo"

# (input shape, weight shape, strides, pads, dilations): a ViT patch embedding, a Whisper Conv1d pair, a padded
# strided 3x3, a dilated 1-D one
GEOMETRIES = [
    ((1, 3, 32, 32), (16, 3, 8, 8), [8, 8], [0, 0, 0, 0], [1, 1]),
    ((1, 20, 30), (12, 20, 3), [1], [1, 1], [1]),
    ((2, 12, 30), (12, 12, 3), [2], [1, 1], [1]),
    ((2, 4, 9, 11), (8, 4, 3, 3), [2, 1], [1, 0, 2, 1], [1, 1]),
    ((1, 5, 17), (6, 5, 3), [1], [2, 0], [2]),
]


def chain_model(x_shape, w_shape, strides, pads, dilations, bias=True, zero_per_channel=False, group=1) -> bytes:
    """The nodes quantize_dynamic writes for one Conv, weights in [-64, 63] (onnxruntime's u8 x s8 kernels
    saturate pairwise sums past that)."""
    rng = np.random.default_rng(sum(w_shape))
    channels = w_shape[0]
    zero = rng.integers(-3, 4, channels).astype(np.int8) if zero_per_channel else np.int8(1)
    inits = [numpy_helper.from_array(rng.integers(-64, 64, w_shape).astype(np.int8), "w"),
             numpy_helper.from_array(np.float32(0.0123), "ws"),
             numpy_helper.from_array(zero, "wz"),
             numpy_helper.from_array(rng.standard_normal((1, channels) + (1,) * (len(w_shape) - 2))
                                     .astype(np.float32), "b")]
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
             helper.make_node("Mul", ["s", "ws"], ["scale"]),
             helper.make_node("ConvInteger", ["q", "w", "z", "wz"], ["acc"], strides=strides, pads=pads,
                              dilations=dilations, group=group),
             helper.make_node("Cast", ["acc"], ["accf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["accf", "scale"], ["y0" if bias else "y"])]
    if bias:
        nodes.append(helper.make_node("Add", ["y0", "b"], ["y"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m.SerializeToString()


def unsigned_weights(model: bytes) -> bytes:
    """chain_model's model with its int8 weight and zero points as uint8 ones 128 higher: the same taps."""
    from onnx import load_from_string

    m = load_from_string(model)
    for t in m.graph.initializer:
        if t.name in ("w", "wz"):
            t.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(t).astype(np.int16) + 128).astype(np.uint8),
                                               t.name))
    return m.SerializeToString()


def reference(x, model: bytes) -> np.ndarray:
    """The quantized arithmetic in float64 and int64: DynamicQuantizeLinear's codes, the integer convolution
    tap by tap (padding with the zero point), the rescale and the bias."""
    from onnx import load_from_string

    m = load_from_string(model)
    init = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    conv = next(n for n in m.graph.node if n.op_type == "ConvInteger")
    attrs = {a.name: list(a.ints) for a in conv.attribute}
    w, wz = init["w"].astype(np.int64), init["wz"].astype(np.int64)
    low, high = min(0.0, float(x.min())), max(0.0, float(x.max()))
    scale = np.float32((np.float32(high) - np.float32(low)) / np.float32(255))
    zero = float(np.clip(np.rint(-np.float32(low) / scale), 0, 255))
    codes = np.clip(np.rint(x / scale) + zero, 0, 255).astype(np.int64) - int(zero)
    spatial = x.ndim - 2
    if spatial == 1:
        codes, w = codes[:, :, None, :], w[:, :, None, :]
        strides, dil = [1] + attrs["strides"], [1] + attrs["dilations"]
        pads = [0, attrs["pads"][0], 0, attrs["pads"][1]]
    else:
        strides, dil, pads = attrs["strides"], attrs["dilations"], attrs["pads"]
    padded = np.pad(codes, ((0, 0), (0, 0), (pads[0], pads[2]), (pads[1], pads[3])))  # centred: pads are 0
    wc = w - (wz.reshape(-1, 1, 1, 1) if wz.ndim else wz)
    acc = integer_conv(padded, wc, strides, dil)
    y = acc * (np.float64(scale) * np.float64(init["ws"]))
    if "b" in init and any(n.op_type == "Add" for n in m.graph.node):
        y = y + init["b"].reshape(1, -1, 1, 1).astype(np.float64)
    return y.reshape(y.shape[:2] + y.shape[3:]) if spatial == 1 else y


def ops(session) -> list[str]:
    return [n.op_type for n in session.placement()]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: "x".join(map(str, g[1])) if len(g) > 3 else None)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("zero_per_channel", [False, True])
def test_fused_conv_matches_reference_and_onnxruntime(geometry, bias, zero_per_channel):
    model = chain_model(*geometry, bias=bias, zero_per_channel=zero_per_channel)
    session = onnx_runtime.InferenceSession(model, providers=["cpu"])
    assert ops(session) == ["DynamicQuantizeConv"]
    # onnxruntime's ConvInteger takes a per-tensor weight zero point only
    oracle = None if zero_per_channel else onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    for scale, shift in ((1.0, 0.0), (3.0, 2.0), (0.5, -1.0)):
        x = (rng.standard_normal(geometry[0]) * scale + shift).astype(np.float32)
        ours = session.run(None, {"x": x})[0]
        exact = reference(x, model)
        assert ours.shape == exact.shape
        # one float32 rounding of the rescaled sum (and of the bias addition) apart from the float64 value
        bound = 4 * np.finfo(np.float32).eps * (np.abs(exact).max() + 1)
        np.testing.assert_allclose(ours, exact, rtol=0, atol=bound)
        if oracle is not None:
            np.testing.assert_allclose(ours, oracle.run(None, {"x": x})[0], rtol=0, atol=2 * bound)


def shared_model(branches: list[bytes], codes_read_elsewhere: bool = False) -> bytes:
    """chain_model's branches on one DynamicQuantizeLinear (a residual block's convolution and its strided
    shortcut, as quantize_dynamic writes them): each branch's nodes and constants renamed apart, outputs y0,
    y1, ...; with ``codes_read_elsewhere`` the codes are a graph output too."""
    from onnx import load_from_string

    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"])]
    inits, outputs = [], []
    shared = {"x", "q", "s", "z"}
    for i, branch in enumerate(branches):
        m = load_from_string(branch)
        rename = {name: name if name in shared else f"{name}_{i}" for node in m.graph.node
                  for name in list(node.input) + list(node.output)}
        rename["y"] = f"y{i}"
        for node in m.graph.node:
            if node.op_type != "DynamicQuantizeLinear":
                copy = helper.make_node(node.op_type, [rename[n] for n in node.input], [rename[n] for n in node.output])
                copy.attribute.extend(node.attribute)
                nodes.append(copy)
        for t in m.graph.initializer:
            inits.append(numpy_helper.from_array(numpy_helper.to_array(t), f"{t.name}_{i}"))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None))
    if codes_read_elsewhere:
        outputs.append(helper.make_tensor_value_info("q", TensorProto.UINT8, None))
    x_shape = [d.dim_value for d in load_from_string(branches[0]).graph.input[0].type.tensor_type.shape.dim]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              outputs, initializer=inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m.SerializeToString()


@pytest.mark.parametrize("codes_read_elsewhere", [False, True])
def test_convolutions_sharing_a_quantized_input_fuse_each(codes_read_elsewhere):
    # a bottleneck's 1x1 convolution and its strided 1x1 shortcut, and a padded 3x3, on one quantized input
    branches = [chain_model((1, 8, 10, 10), (6, 8, 1, 1), [1, 1], [0, 0, 0, 0], [1, 1]),
                chain_model((1, 8, 10, 10), (12, 8, 1, 1), [2, 2], [0, 0, 0, 0], [1, 1], bias=False),
                chain_model((1, 8, 10, 10), (5, 8, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1], zero_per_channel=True)]
    model = shared_model(branches, codes_read_elsewhere)
    session = onnx_runtime.InferenceSession(model, providers=["cpu"])
    if codes_read_elsewhere:  # the codes must still be made: nothing fuses
        assert "DynamicQuantizeConv" not in ops(session) and ops(session).count("ConvInteger") == 3
    else:
        assert ops(session) == ["DynamicQuantizeConv"] * 3
    x = (np.random.default_rng(5).standard_normal((1, 8, 10, 10)) * 2 + 0.5).astype(np.float32)
    outputs = session.run(None, {"x": x})
    for y, branch in zip(outputs, branches):
        exact = reference(x, branch)
        bound = 4 * np.finfo(np.float32).eps * (np.abs(exact).max() + 1)
        np.testing.assert_allclose(y, exact, rtol=0, atol=bound)


@pytest.mark.parametrize("weight_type", [np.int8, np.uint8])
@pytest.mark.parametrize("zero_per_channel", [False, True])
def test_byte_products_and_pairs_give_the_same_bits(monkeypatch, weight_type, zero_per_channel):
    # The compiled call on VNNI's byte products (QuadWeight: signed codes, the zero points' terms after the
    # product) and on int16 pairs (WeightSide) make the same int32 sums: equal outputs, and both within one
    # rounding of the float64 reference. uint8 weights shift to signed with their zero points.
    from onnx_runtime_ep_cpu.compiled import deferred, qgemm_quads
    from onnx_runtime_ep_cpu.ops import dynamic_quantize_conv as module

    # the compiled call from the first run, not numpy's while numba loads
    monkeypatch.setattr(deferred.state, "disabled", True)
    monkeypatch.setattr(deferred.state, "deferring", False)
    geometry = ((2, 3, 13, 11), (20, 3, 5, 5), [2, 1], [2, 1, 2, 3], [1, 1])  # odd depth: rows padded to quads
    model = chain_model(*geometry, zero_per_channel=zero_per_channel)
    if weight_type is np.uint8:  # the same taps as unsigned codes, the zero points with them
        model = unsigned_weights(model)
    x = (np.random.default_rng(11).standard_normal(geometry[0]) * 1.5 - 0.3).astype(np.float32)
    calls = []
    real = module.compiled_call
    monkeypatch.setattr(module, "compiled_call",
                        lambda x, g, side: calls.append(type(side).__name__) or real(x, g, side))
    outputs = {}
    for quads in ([True] if qgemm_quads.AVAILABLE else []) + [False]:
        monkeypatch.setattr(module, "quads_available", lambda quads=quads: quads)
        session = onnx_runtime.InferenceSession(model, providers=["cpu"])
        outputs[quads] = session.run(None, {"x": x})[0]
        assert session.run(None, {"x": x})[0].tobytes() == outputs[quads].tobytes()
        assert calls and calls[-1] == ("QuadWeight" if quads else "WeightSide")
    exact = reference(x, model)
    bound = 4 * np.finfo(np.float32).eps * (np.abs(exact).max() + 1)
    for y in outputs.values():
        np.testing.assert_allclose(y, exact, rtol=0, atol=bound)
    if len(outputs) == 2:
        np.testing.assert_array_equal(outputs[True], outputs[False])


@pytest.mark.parametrize("geometry", [
    ((2, 5, 19, 17), (22, 5, 3, 3), [1, 2], [1, 2, 0, 1], [1, 1]),  # two images, blocks of positions and a tail
    ((1, 8, 7, 7), (42, 8, 3, 3), [1, 1], [1, 1, 1, 1], [1, 1]),  # one block: the output channels split instead
    ((1, 20, 150), (12, 20, 3), [1], [1, 1], [2]),  # 1-D, dilated
], ids=["blocks", "channels", "1d"])
@pytest.mark.parametrize("weight_type", [np.int8, np.uint8])
def test_threads_share_the_call_with_the_same_bits(monkeypatch, geometry, weight_type):
    # The byte products' phases (range, codes, patches, products) as tasks the calling thread and a helper claim,
    # split even where small (split_macs 1) over more parts than threads (a part without a helper: its tasks
    # claimed by the caller): the same outputs as the one-thread call, bit for bit, within a rounding of float64.
    from onnx_runtime_ep_cpu import tuning
    from onnx_runtime_ep_cpu.compiled import deferred, qgemm_quads
    from onnx_runtime_ep_cpu.ops import dynamic_quantize_conv as module

    if not qgemm_quads.AVAILABLE:
        pytest.skip("the byte products need AVX-512 VNNI")
    monkeypatch.setattr(deferred.state, "disabled", True)
    monkeypatch.setattr(deferred.state, "deferring", False)
    model = chain_model(*geometry, zero_per_channel=True)
    if weight_type is np.uint8:
        model = unsigned_weights(model)
    x = (np.random.default_rng(5).standard_normal(geometry[0]) * 2 + 0.4).astype(np.float32)
    splits = []
    real = module.threaded_call
    monkeypatch.setattr(module, "threaded_call", lambda *a: splits.append(a[-1]) or real(*a))
    outputs = {}
    for threads in (1, 2, 3):
        with tuning.override(split_macs=1, threads=threads):
            session = onnx_runtime.InferenceSession(model, providers=["cpu"])
            outputs[threads] = session.run(None, {"x": x})[0]
    assert splits == [2, 3]
    exact = reference(x, model)
    np.testing.assert_allclose(outputs[1], exact, rtol=0, atol=4 * np.finfo(np.float32).eps * (np.abs(exact).max() + 1))
    for threads in (2, 3):
        assert outputs[threads].tobytes() == outputs[1].tobytes()


def test_all_zero_input_and_extreme_values():
    model = chain_model(*GEOMETRIES[1])
    session = onnx_runtime.InferenceSession(model, providers=["cpu"])
    oracle = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    for x in (np.zeros((1, 20, 30), np.float32), np.full((1, 20, 30), 1e30, np.float32),
              np.linspace(-5, 0, 600, dtype=np.float32).reshape(1, 20, 30)):
        np.testing.assert_allclose(session.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0],
                                   rtol=1e-5, atol=1e-5 * (np.abs(x).max() + 1))


def test_grouped_conv_stays_unfused():
    model = chain_model((1, 4, 10), (4, 2, 3), [1], [1, 1], [1], group=2)
    session = onnx_runtime.InferenceSession(model, providers=["cpu"])
    assert "DynamicQuantizeConv" not in ops(session) and "ConvInteger" in ops(session)
    x = np.random.default_rng(3).standard_normal((1, 4, 10)).astype(np.float32)
    oracle = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(None, {"x": x})[0], oracle.run(None, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_kernel_names_a_wrong_input_type():
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.ops.dynamic_quantize_conv import dynamic_quantize_conv

    node = Node("DynamicQuantizeConv", ["x", "w", "s", "z"], ["y"], name="patch", domain="ai.onnx_runtime.cpu",
                attrs={"strides": [1], "pads": [0, 0], "dilations": [1]}, opset=1)
    kernel = dynamic_quantize_conv(node, [None] * 4, 1)
    w, scale, zero = np.ones((2, 3, 3), np.int8), np.float32(0.1), np.int8(0)
    with pytest.raises(InvalidArgumentError, match="'X' is float64; expected float32"):
        kernel(np.ones((1, 3, 8)), w, np.asarray(scale), np.asarray(zero))
    with pytest.raises(InvalidArgumentError, match="bias is float32.*expected 2 float32 values"):
        kernel(np.ones((1, 3, 8), np.float32), w, np.asarray(scale), np.asarray(zero), np.ones(5, np.float32))


def test_declared_huge_pads_do_not_size_the_scratch():
    # pads of 2**40 (a fuzz case of ConvInteger): the compiled call is not taken, the unfused path answers
    from onnx_runtime.errors import OnnxRuntimeError

    model = chain_model((1, 2, 5), (2, 2, 3), [1], [1, 1 << 40], [1])
    try:
        session = onnx_runtime.InferenceSession(model, providers=["cpu"])
        session.run(None, {"x": np.ones((1, 2, 5), np.float32)})
    except OnnxRuntimeError:
        pass


def _zoo(name: str) -> Path:
    path = ZOO / f"{name}.onnx"
    if not path.exists():
        pytest.skip(f"{path} is not built (scripts/build_zoo.sh)")
    return path


@pytest.mark.parametrize("name", ["vit.torchscript", "vit.dynamo", "whisper_encoder.torchscript",
                                  "whisper_encoder.dynamo"])
def test_zoo_exports_fuse_and_match_onnxruntime(name):
    path = _zoo(f"{name}.int8_dynamic")
    manifest = json.loads((ZOO / "manifest.json").read_text())
    call = next(m for m in manifest["models"] if m["name"] == f"{name}.int8_dynamic")["calls"]["default"]
    feeds = {f["name"]: np.random.default_rng(1).standard_normal(f["shape"]).astype(np.float32)
             for f in call["feeds"]}
    session = onnx_runtime.InferenceSession(str(path), providers=["cpu"])
    ours = session.run(None, feeds)
    convs = 1 if name.startswith("vit") else 2
    assert ops(session).count("DynamicQuantizeConv") == convs and "ConvInteger" not in ops(session)
    theirs = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    for y, t in zip(ours, theirs):
        np.testing.assert_allclose(y, t, rtol=1e-3, atol=1e-3 * (np.abs(t).max() + 1))
