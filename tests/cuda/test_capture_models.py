"""Whole models captured into device graphs on the CUDA provider, and the constant host inputs that make it possible.

Shape-like inputs (Reshape's shape, Slice's starts, Tile's repeats, a ReduceMean axes input...) are declared
``host_inputs`` of the CUDA kernels: a constant one reaches the kernel factory as a host array, so a run reads
nothing back from the device and can be captured; one computed at run time is read back at every call, and the
session says so as the reason it runs eagerly.

Runs on the simulator (``ONNX_RUNTIME_CUDA_SIM=1``) by default; with ``ONNX_RUNTIME_CUDA_TESTS=real`` the same
tests run against the real driver on a GPU machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime import DataType

driver = pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
from onnx_runtime_ep_cuda.device import CudaDevice  # noqa: E402
from onnx_runtime_ep_cuda.ops.registry import register  # noqa: E402

CUDA = "CUDAExecutionProvider"
CUDA_FIRST = [CUDA, "CPUExecutionProvider"]
DOMAIN = "test.capture_models"
LLAMA = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / ".models").glob("llama_decode_*.onnx"))

pytestmark = pytest.mark.usefixtures("cuda_driver_mode")


# -- a test operator whose output shape is a host input's value ------------------------------------------------------
factory_constants = []  # what the Head factory was given for input 1, per kernel made


@register("Head", domain=DOMAIN, dtypes={DataType.FLOAT}, host_inputs=(1,))
def _head(node, shapes, opset, ctx, host):
    """y = x[:n] along axis 0, n the one value of input 1. No schema, so shape inference cannot tell y's shape."""
    factory_constants.append(host.constant(1))

    def kernel(x, count):
        (n,) = host.ints(1, count)
        y = ctx.empty(x.dtype, (n, *x.shape[1:]))
        ctx.device.copy_device(y.device_ptr, x.device_ptr, y.nbytes)
        return (y,)

    return kernel


def head_model(constant: bool) -> bytes:
    """x [6, 4] -> Head(x, n) -> Mul 2 -> y; n = 3 as an initializer, or a feed when not ``constant``."""
    nodes = [helper.make_node("Head", ["x", "n"], ["h"], name="head", domain=DOMAIN),
             helper.make_node("Mul", ["h", "two"], ["y"], name="double")]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6, 4])]
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    if constant:
        inits.append(numpy_helper.from_array(np.array([3], np.int64), "n"))
    else:
        inputs.append(helper.make_tensor_value_info("n", TensorProto.INT64, [1]))
    graph = helper.make_graph(nodes, "head", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=inits)
    opsets = [helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


def capture_session(model, providers=(CUDA,), capture=True):
    options = ort.SessionOptions()
    if capture:
        options.add_session_config_entry("session.graph_capture", "1")
    return ort.InferenceSession(model, options, providers=list(providers))


@pytest.fixture
def downloads(monkeypatch):
    """Counts device-to-host reads (CudaDevice.download), the synchronizing copies a capture cannot record; the
    validation flag word, read once per run after the outputs (at the host boundary), is not counted."""
    count = [0]
    original = CudaDevice.download

    def counted(self, dst, src, **kwargs):
        caller = sys._getframe(1)
        if caller.f_code.co_filename.endswith("lanes.py"):  # a provider instance's lane: who called it
            caller = caller.f_back
        if not caller.f_code.co_filename.endswith("validation.py"):
            count[0] += 1
        return original(self, dst, src, **kwargs)

    monkeypatch.setattr(CudaDevice, "download", counted)
    return count


def test_a_constant_host_input_reaches_the_factory_and_nothing_is_read_back(downloads):
    session = capture_session(head_model(constant=True), capture=False)
    assert [str(v) for v in factory_constants[-1:]] == ["[3]"]
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    before = downloads[0]
    (y,) = session.run(None, {"x": x})
    np.testing.assert_array_equal(y, 2 * x[:3])
    assert downloads[0] - before == 1  # the output; n came from the factory, not from the device
    assert session.provider_handle("cuda").hook.host_inputs(node=session.model.graph.nodes[0], opset=1) == (1,)
    session.close()


def test_a_host_input_computed_at_run_time_is_read_back_and_keeps_the_run_eager(downloads):
    session = capture_session(head_model(constant=False))
    x = np.arange(24, dtype=np.float32).reshape(6, 4)
    for n in (2, 5, 2):
        before = downloads[0]
        (y,) = session.run(None, {"x": x, "n": np.array([n], np.int64)})
        np.testing.assert_array_equal(y, 2 * x[:n])
        assert downloads[0] - before == 2  # n, then the output
    assert factory_constants[-1] is None
    status = session.device_graph_status()
    assert status.startswith("eager: node 'head' (Head) reads input 1 ('n') on the host"), status
    assert "not a constant" in status
    assert session._executor.graphs.captures == 0
    session.close()


def test_an_output_shape_inference_left_open_is_resolved_from_the_constant_host_inputs():
    """Head has no schema: only its declaration (host input 1, a constant) fixes y's shape for the capture."""
    session = capture_session(head_model(constant=True))
    assert session.model.graph.type_of("h") is None or session.model.graph.type_of("h").static_shape is None
    rng = np.random.default_rng(0)
    statuses = []
    for _ in range(4):
        x = rng.standard_normal((6, 4)).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_array_equal(y, 2 * x[:3])
        statuses.append(session.device_graph_status())
    assert statuses[0].startswith("eager: warming up") and statuses[1:] == ["replaying"] * 3, statuses
    session.close()


# -- a small transformer decode step built from standard operators ---------------------------------------------------
D, HEADS, KV_HEADS, HEAD_DIM, PAST, VOCAB, HIDDEN, LAYERS = 32, 4, 2, 8, 6, 50, 64, 2


def _rms_norm(nodes, x, weight, out, p):
    n = helper.make_node
    nodes += [n("Pow", [x, "two"], [p + "sq"], name=p + "pow"),
              n("ReduceMean", [p + "sq", "last_axis"], [p + "ms"], name=p + "mean", keepdims=1),
              n("Add", [p + "ms", "eps"], [p + "mse"], name=p + "eps"),
              n("Sqrt", [p + "mse"], [p + "rms"], name=p + "sqrt"),
              n("Div", [x, p + "rms"], [p + "normed"], name=p + "div"),
              n("Mul", [p + "normed", weight], [out], name=p + "scale")]


def _heads(nodes, x, heads, out, p):
    """[1, 1, heads * HEAD_DIM] -> [1, heads, 1, HEAD_DIM]; the reshape target is computed from Shape, as exporters
    write it (constant folding turns it into an initializer)."""
    n = helper.make_node
    nodes += [n("Shape", [x], [p + "shape"], name=p + "shape"),
              n("Slice", [p + "shape", "zero1", "two1"], [p + "lead"], name=p + "lead"),
              n("Concat", [p + "lead", f"heads_{heads}", "head_dim1"], [p + "target"], name=p + "target", axis=0),
              n("Reshape", [x, p + "target"], [p + "split"], name=p + "reshape"),
              n("Transpose", [p + "split"], [out], name=p + "transpose", perm=[0, 2, 1, 3])]


def _rotary(nodes, x, out, p):
    """x * cos + rotate_half(x) * sin, the halves cut at a Shape-derived index (folded to a constant)."""
    n = helper.make_node
    nodes += [n("Shape", [x], [p + "xshape"], name=p + "xshape"),
              n("Gather", [p + "xshape", "three"], [p + "dim"], name=p + "dim", axis=0),
              n("Div", [p + "dim", "two_i"], [p + "half"], name=p + "half"),
              n("Unsqueeze", [p + "half", "zero1"], [p + "half1"], name=p + "half1"),
              n("Slice", [x, "zero1", p + "half1", "minus1"], [p + "x1"], name=p + "x1"),
              n("Slice", [x, p + "half1", "big1", "minus1"], [p + "x2"], name=p + "x2"),
              n("Neg", [p + "x2"], [p + "nx2"], name=p + "neg"),
              n("Concat", [p + "nx2", p + "x1"], [p + "rot"], name=p + "rot", axis=-1),
              n("Mul", [x, "cos4"], [p + "xc"], name=p + "xcos"),
              n("Mul", [p + "rot", "sin4"], [p + "rs"], name=p + "rsin"),
              n("Add", [p + "xc", p + "rs"], [out], name=p + "rotary")]


def decode_step_model(seed=0) -> bytes:
    """One decode step of a LLaMA-like model: token and position in, logits and the grown KV cache out, with the
    shape-like inputs of Reshape, Slice, Split, Unsqueeze, Squeeze, Expand, Tile and ReduceMean as constants."""
    rng = np.random.default_rng(seed)
    n = helper.make_node
    group = HEADS // KV_HEADS

    def w(*shape, scale=None):
        return (rng.standard_normal(shape) * (scale if scale is not None else shape[0] ** -0.5)).astype(np.float32)

    angles = np.arange(64)[:, None] / 10000 ** (np.arange(HEAD_DIM // 2) / (HEAD_DIM // 2))
    angles = np.concatenate([angles, angles], axis=-1)
    weights = {
        "wte": w(VOCAB, D, scale=1.0), "wout": w(D, VOCAB), "norm_f": np.ones(D, np.float32),
        "cos_table": np.cos(angles).astype(np.float32), "sin_table": np.sin(angles).astype(np.float32),
        "two": np.array(2.0, np.float32), "eps": np.array(1e-5, np.float32),
        "scale": np.array(HEAD_DIM ** -0.5, np.float32),
        "last_axis": np.array([-1], np.int64), "zero1": np.array([0], np.int64), "two1": np.array([2], np.int64),
        "three": np.array(3, np.int64), "two_i": np.array(2, np.int64), "minus1": np.array([-1], np.int64),
        "big1": np.array([1 << 30], np.int64), "axis1": np.array([1], np.int64), "axis2": np.array([2], np.int64),
        "head_dim1": np.array([HEAD_DIM], np.int64), f"heads_{HEADS}": np.array([HEADS], np.int64),
        f"heads_{KV_HEADS}": np.array([KV_HEADS], np.int64),
        "qkv_sizes": np.array([D, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], np.int64),
        "mlp_sizes": np.array([HIDDEN, HIDDEN], np.int64),
        "expand_to": np.array([1, KV_HEADS, group, PAST + 1, HEAD_DIM], np.int64),
        "tile_by": np.array([1, 1, group, 1, 1], np.int64),
        "attn_heads": np.array([1, HEADS, PAST + 1, HEAD_DIM], np.int64),
        "model_dim": np.array([1, 1, D], np.int64),
    }
    nodes = [n("Gather", ["wte", "input_ids"], ["h0"], name="embed", axis=0),
             n("Gather", ["cos_table", "position_ids"], ["cos"], name="cos", axis=0),
             n("Gather", ["sin_table", "position_ids"], ["sin"], name="sin", axis=0),
             n("Unsqueeze", ["cos", "axis1"], ["cos4"], name="cos4"),
             n("Unsqueeze", ["sin", "axis1"], ["sin4"], name="sin4")]
    h, outputs = "h0", []
    for i in range(LAYERS):
        p = f"l{i}_"
        weights.update({f"norm1_{i}": np.ones(D, np.float32), f"norm2_{i}": np.ones(D, np.float32),
                        f"wqkv_{i}": w(D, D + 2 * KV_HEADS * HEAD_DIM), f"wo_{i}": w(D, D),
                        f"wgu_{i}": w(D, 2 * HIDDEN), f"wdown_{i}": w(HIDDEN, D)})
        _rms_norm(nodes, h, f"norm1_{i}", p + "a", p + "n1_")
        nodes += [n("MatMul", [p + "a", f"wqkv_{i}"], [p + "qkv"], name=p + "qkv"),
                  n("Split", [p + "qkv", "qkv_sizes"], [p + "q0", p + "k0", p + "v0"], name=p + "split", axis=-1)]
        _heads(nodes, p + "q0", HEADS, p + "q1", p + "q_")
        _heads(nodes, p + "k0", KV_HEADS, p + "k1", p + "k_")
        _heads(nodes, p + "v0", KV_HEADS, p + "v1", p + "v_")
        _rotary(nodes, p + "q1", p + "q", p + "rq_")
        _rotary(nodes, p + "k1", p + "k", p + "rk_")
        nodes += [
            n("Concat", [f"past_key_{i}", p + "k"], [f"present_key_{i}"], name=p + "cat_k", axis=2),
            n("Concat", [f"past_value_{i}", p + "v1"], [f"present_value_{i}"], name=p + "cat_v", axis=2),
            # Grouped-query attention: each key/value head serves HEADS / KV_HEADS query heads.
            n("Unsqueeze", [f"present_key_{i}", "axis2"], [p + "k5"], name=p + "k5"),
            n("Expand", [p + "k5", "expand_to"], [p + "kx"], name=p + "k_expand"),
            n("Reshape", [p + "kx", "attn_heads"], [p + "kh"], name=p + "k_heads"),
            n("Unsqueeze", [f"present_value_{i}", "axis2"], [p + "v5"], name=p + "v5"),
            n("Tile", [p + "v5", "tile_by"], [p + "vx"], name=p + "v_tile"),
            n("Reshape", [p + "vx", "attn_heads"], [p + "vh"], name=p + "v_heads"),
            n("Transpose", [p + "kh"], [p + "kt"], name=p + "kt", perm=[0, 1, 3, 2]),
            n("MatMul", [p + "q", p + "kt"], [p + "s"], name=p + "qk"),
            n("Mul", [p + "s", "scale"], [p + "ss"], name=p + "scores"),
            n("Softmax", [p + "ss"], [p + "pr"], name=p + "softmax", axis=-1),
            n("MatMul", [p + "pr", p + "vh"], [p + "ctx"], name=p + "pv"),
            n("Transpose", [p + "ctx"], [p + "ctx_t"], name=p + "ctx_t", perm=[0, 2, 1, 3]),
            n("Reshape", [p + "ctx_t", "model_dim"], [p + "ctx_d"], name=p + "ctx_d"),
            n("MatMul", [p + "ctx_d", f"wo_{i}"], [p + "o"], name=p + "o"),
            n("Add", [h, p + "o"], [p + "h1"], name=p + "res1"),
        ]
        _rms_norm(nodes, p + "h1", f"norm2_{i}", p + "m", p + "n2_")
        nodes += [n("MatMul", [p + "m", f"wgu_{i}"], [p + "gu"], name=p + "gate_up"),
                  n("Split", [p + "gu", "mlp_sizes"], [p + "g", p + "u"], name=p + "mlp_split", axis=-1),
                  n("Sigmoid", [p + "g"], [p + "sg"], name=p + "sigmoid"),
                  n("Mul", [p + "g", p + "sg"], [p + "silu"], name=p + "silu"),
                  n("Mul", [p + "silu", p + "u"], [p + "act"], name=p + "act"),
                  n("MatMul", [p + "act", f"wdown_{i}"], [p + "dn"], name=p + "down"),
                  n("Add", [p + "h1", p + "dn"], [p + "h2"], name=p + "res2")]
        h = p + "h2"
        outputs += [f"present_key_{i}", f"present_value_{i}"]
    _rms_norm(nodes, h, "norm_f", "hf", "nf_")
    nodes += [n("MatMul", ["hf", "wout"], ["logits3"], name="lm_head"),
              n("Squeeze", ["logits3", "axis1"], ["logits"], name="squeeze")]
    cache = [1, KV_HEADS, PAST, HEAD_DIM]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, 1]),
              helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, 1])]
    inputs += [helper.make_tensor_value_info(f"past_{kind}_{i}", TensorProto.FLOAT, cache)
               for i in range(LAYERS) for kind in ("key", "value")]
    graph = helper.make_graph(
        nodes, "decode_step", inputs,
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, VOCAB])]
        + [helper.make_tensor_value_info(name, TensorProto.FLOAT, None) for name in outputs],
        initializer=[numpy_helper.from_array(v, k) for k, v in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9).SerializeToString()


def decode_feeds(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    feeds = {"input_ids": np.array([[3 + 7 * step]], np.int64), "position_ids": np.array([[PAST + step]], np.int64)}
    for i in range(LAYERS):
        for kind in ("key", "value"):
            feeds[f"past_{kind}_{i}"] = rng.standard_normal((1, KV_HEADS, PAST, HEAD_DIM)).astype(np.float32)
    return feeds


def check_capture_replays_like_eager(model, feeds_of, steps: int, rtol: float, atol: float, downloads) -> None:
    """Warm-up, capture, replays: each run's outputs equal an eager CUDA session's (the same kernels) and match the
    CPU provider's; no run reads anything back but its outputs."""
    captured = capture_session(model, CUDA_FIRST)
    off = [(p.node, p.op_type, p.rejected) for p in captured.placement() if p.provider != CUDA]
    assert not off, f"nodes placed off CUDA: {off}"
    eager = capture_session(model, CUDA_FIRST, capture=False)
    cpu = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    names = [o.name for o in captured.get_outputs()]
    statuses = []
    for step in range(steps):
        feeds = feeds_of(step)
        before = downloads[0]
        got = captured.run(None, feeds)
        assert downloads[0] - before == len(names), "a run read a device value back besides its outputs"
        statuses.append(captured.device_graph_status())
        for name, replayed, reference, expected in zip(names, got, eager.run(None, feeds), cpu.run(None, feeds)):
            np.testing.assert_array_equal(replayed, reference, err_msg=f"{name}: replay != eager at step {step}")
            np.testing.assert_allclose(replayed, expected, rtol=rtol, atol=atol, err_msg=f"{name} vs CPU")
    assert statuses[0].startswith("eager: warming up"), statuses
    assert statuses[1:] == ["replaying"] * (steps - 1), statuses
    runner = captured._executor.graphs
    assert runner.captures == 1 and runner.replays == steps - 1
    for session in (captured, eager, cpu):
        session.close()


def test_a_transformer_decode_step_is_captured_and_replayed(downloads):
    check_capture_replays_like_eager(decode_step_model(), decode_feeds, steps=4, rtol=1e-4, atol=1e-5,
                                     downloads=downloads)


def test_a_shape_input_computed_at_run_time_names_the_node_that_keeps_the_step_eager():
    """The same step with the first attention Reshape's target a feed: it runs (reading the target back every
    run) as an eager seam between captured segments, and the status names that node and input as the reason."""
    import onnx

    model = onnx.load_from_string(decode_step_model())
    graph = model.graph
    (node,) = [node for node in graph.node if node.name == "l0_k_heads"]
    node.input[1] = "k_heads_target"
    graph.input.append(helper.make_tensor_value_info("k_heads_target", TensorProto.INT64, [4]))
    session = capture_session(model.SerializeToString(), CUDA_FIRST)
    feeds = {**decode_feeds(0), "k_heads_target": np.array([1, HEADS, PAST + 1, HEAD_DIM], np.int64)}
    expected = ort.InferenceSession(decode_step_model(), providers=["CPUExecutionProvider"]).run(None, decode_feeds(0))
    for _ in range(3):
        got = session.run(None, feeds)
        np.testing.assert_allclose(got[0], expected[0], rtol=1e-4, atol=1e-5)
    status = session.device_graph_status()
    assert status.startswith("replaying 3 graph segments with eager seams (node 'l0_k_heads' (Reshape) reads input 1 "
                             "('k_heads_target') on the host"), status
    session.close()


@pytest.mark.skipif(not LLAMA, reason="benchmarks/.models/llama_decode_*.onnx is not here (bench_models.py exports it)")
def test_the_exported_llama_decode_step_is_captured_and_replayed(downloads):
    """torch's export of benchmarks/torch_models.py's LLaMA decode step: Shape-computed reshapes, rotary Slices whose
    output shapes inference left open, GQA Tiles; after constant folding every shape input is a constant."""
    import onnx

    proto = onnx.load(str(LLAMA[0]), load_external_data=False)
    cache = [[d.dim_value for d in i.type.tensor_type.shape.dim] for i in proto.graph.input[2:]]
    position = cache[0][2]

    def feeds(step):
        rng = np.random.default_rng(step)
        values = {"input_ids": np.array([[11 + step]], np.int64), "position_ids": np.array([[position]], np.int64)}
        for info, shape in zip(proto.graph.input[2:], cache):
            values[info.name] = rng.standard_normal(shape).astype(np.float32)
        return values

    check_capture_replays_like_eager(str(LLAMA[0]), feeds, steps=3, rtol=1e-3, atol=1e-4, downloads=downloads)
