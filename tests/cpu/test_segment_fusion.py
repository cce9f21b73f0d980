"""FusedSegment (segment_fusions.py, ops/segment.py): a run of CNN nodes as one kernel whose later runs call
prepared steps over buffers allocated once. Checked against onnxruntime and a float64 reference over
several runs (the first node by node, the later ones through the bound plan), on a MobileNetV3-style block
(both HardSwish placements, squeeze-excitation, residual, 5x5 depthwise, classifier head) and an
EfficientNet-style one (SiLU written as Sigmoid and Mul, a sigmoid-gated squeeze-excitation)."""

from __future__ import annotations

import os
import threading

import numpy as np
import onnx
import onnx_runtime as ort
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.loader import load_model
from onnx_runtime_ep_cpu.algorithms import segment_steps
from onnx_runtime_ep_cpu.compiled import deferred, host
from onnx_runtime_ep_cpu.conv_fusions import CONV_PASSES
from onnx_runtime_ep_cpu.fusions import PASSES
from onnx_runtime_ep_cpu.ops.segment import Segment
from reference64 import run_float64


def _block_model(channels: int = 8, size: int = 12, gate: str = "HardSigmoid", pool: str = "GlobalAveragePool",
                 opset: int = 17) -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    inits, nodes = [], []

    def weight(name, *shape, scale=0.3):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name))
        return name

    def conv(x, y, cin, cout, k, stride=1, group=1):
        nodes.append(helper.make_node("Conv", [x, weight(f"{y}_w", cout, cin // group, k, k),
                                               weight(f"{y}_b", cout)], [y], kernel_shape=[k, k],
                                      strides=[stride, stride], pads=[k // 2] * 4, group=group))

    def silu(x, y):  # as exporters write it: Sigmoid and Mul (the CPU fusions make it one Swish)
        nodes.append(helper.make_node("Sigmoid", [x], [f"{y}_sigmoid"]))
        nodes.append(helper.make_node("Mul", [x, f"{y}_sigmoid"], [y]))

    conv("x", "c1", 3, channels, 3)
    if gate == "Sigmoid":
        silu("c1", "a1")
    else:
        nodes.append(helper.make_node("HardSwish", ["c1"], ["a1"]))
    conv("a1", "d1", channels, channels, 3, stride=2, group=channels)
    nodes.append(helper.make_node("Relu", ["d1"], ["r1"]))
    if pool == "ReduceMean":  # the dynamo exporter's spelling (opset 18: the axes an input)
        inits.append(numpy_helper.from_array(np.array([-1, -2], np.int64), "plane_axes"))
        nodes.append(helper.make_node("ReduceMean", ["r1", "plane_axes"], ["p1"], keepdims=1))
    else:
        nodes.append(helper.make_node("GlobalAveragePool", ["r1"], ["p1"]))
    conv("p1", "s1", channels, 4, 1)
    if gate == "Sigmoid":  # EfficientNet's squeeze-excitation: SiLU inside, a sigmoid gate
        silu("s1", "s1r")
    else:
        nodes.append(helper.make_node("Relu", ["s1"], ["s1r"]))
    conv("s1r", "s2", 4, channels, 1)
    nodes.append(helper.make_node("HardSigmoid", ["s2"], ["gate"], alpha=1 / 6, beta=0.5) if gate == "HardSigmoid"
                 else helper.make_node("Sigmoid", ["s2"], ["gate"]))
    nodes.append(helper.make_node("Mul", ["r1", "gate"], ["se"]))
    conv("se", "pw", channels, channels, 1)
    nodes.append(helper.make_node("Add", ["pw", "r1"], ["res"]))
    conv("res", "d2", channels, channels, 5, group=channels)
    nodes.append(helper.make_node("HardSwish", ["d2"], ["a2"]))
    nodes.append(helper.make_node("GlobalAveragePool", ["a2"], ["p2"]))
    nodes.append(helper.make_node("Flatten", ["p2"], ["flat"]))
    nodes.append(helper.make_node("Gemm", ["flat", weight("fc_w", 5, channels), weight("fc_b", 5)], ["logits"],
                                  transB=1))
    graph = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                             ["batch", 3, size, size])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("res", TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ours(model):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _oracle(model, x):
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    sess = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


@pytest.mark.parametrize("gate", ["HardSigmoid", "Sigmoid"])
@pytest.mark.parametrize("batch", [1, 2])
def test_segment_runs_match_onnxruntime_and_float64(batch, gate):
    model = _block_model(gate=gate)
    sess = _ours(model)
    rng = np.random.default_rng(batch)
    for run in range(4):  # the first node by node, the second builds and checks the plan, then the plan
        x = rng.standard_normal((batch, 3, 12, 12)).astype(np.float32)
        got = sess.run(None, {"x": x})
        exact = run_float64(model, {"x": x})
        for ours, theirs, wide in zip(got, _oracle(model, x), exact):
            assert ours.shape == wide.shape and ours.dtype == np.float32
            bound = 1e-5 * (1 + np.abs(wide).max())
            assert np.abs(ours - wide).max() <= bound, run
            assert np.abs(ours - theirs).max() <= bound, run
        if run == 0:
            deferred.wait_ready(240)  # later runs take the compiled kernels (and so the bound plan)


def _segment_and_feeds(model, x):
    """The FusedSegment the CPU passes make of ``model`` (its kernel) and its inputs: weights read-only."""
    graph = load_model(model).graph
    for graph_pass in [*PASSES, *CONV_PASSES]:  # the CPU provider's order (fuse_silu among PASSES)
        graph_pass(graph, None)
    (node,) = [n for n in graph.nodes if n.op_type == "FusedSegment"]
    assert [n.op_type for n in graph.nodes] == ["FusedSegment"]
    feeds = []
    for name in node.inputs:
        if name == "x":
            feeds.append(x)
        else:
            value = np.array(graph.initializers[name])
            value.setflags(write=False)
            feeds.append(value)
    return Segment(node), feeds


def segment_matches_references(model, segment, feeds, shape, rng, runs: int = 2, tolerance: float = 2e-5) -> None:
    """``runs`` inputs of ``shape`` (the graph input "x"; each run's values larger) through ``segment``: every output
    within ``tolerance`` (relative to the largest reference value, plus itself) of a float64 reference and of
    onnxruntime on one thread."""
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1
    oracle = onnxruntime.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    for run in range(runs):
        x = rng.standard_normal(shape).astype(np.float32) * (run + 1)
        fed = [x if f.shape == x.shape and f.flags.writeable else f for f in feeds]
        got = dict(zip(segment.output_names, segment(*fed)))
        exact = dict(zip(names, run_float64(model, {"x": x})))
        theirs = dict(zip(names, oracle.run(None, {"x": x})))
        for name, wide in exact.items():
            bound = tolerance * (1 + np.abs(wide).max())
            assert got[name].shape == wide.shape and got[name].dtype == np.float32, (name, run)
            assert np.abs(got[name] - wide).max() <= bound, (name, run)
            assert np.abs(got[name] - theirs[name]).max() <= bound, (name, run)


def _settled(segment, feeds) -> None:
    """A first run plans the segment; on a cold numba cache the loops it binds may be compiled by the loader's
    child meanwhile (a provisional plan): after wait_ready they are linked and the plan final."""
    segment(*feeds)
    deferred.wait_ready(240)
    assert all(p is None or not p.describe()["provisional"] for ps in segment.plans.values() for p in ps or [None])


def segment_outputs(segment):
    return segment.output_names


@pytest.mark.parametrize("gate, pool", [("HardSigmoid", "GlobalAveragePool"), ("Sigmoid", "GlobalAveragePool"),
                                        ("HardSigmoid", "ReduceMean")])
def test_segment_binds_every_node_and_reuses_its_plan(gate, pool):
    model = _block_model(gate=gate, pool=pool, opset=18 if pool == "ReduceMean" else 17)
    x = np.random.default_rng(3).standard_normal((1, 3, 12, 12)).astype(np.float32)
    deferred.wait_ready(240)
    segment, feeds = _segment_and_feeds(model, x)
    _settled(segment, feeds)
    first = segment(*feeds)
    ((plan,),) = segment.plans.values()
    second = segment(*feeds)
    kernels = [a for f, a in plan._steps if f is segment_steps._run_kernel]  # noqa: SLF001
    assert not kernels or not host.AVX2  # every node of the block is prepared (the tiles need AVX2)
    called = [getattr(f, "__name__", "") for f, _ in plan._steps]  # noqa: SLF001
    assert called.count("squeeze_excite") == 1  # the squeeze-excitation block, one call
    x2 = x * 2 - 1
    feeds = [x2 if f is x else f for f in feeds]
    third = dict(zip(segment_outputs(segment), segment(*feeds)))
    expected = _oracle(model, x2)
    np.testing.assert_allclose(third["logits"], expected[0], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(third["res"], expected[1], rtol=1e-4, atol=1e-5)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)  # the plan's values from the first run on


def test_a_plan_that_disagrees_is_dropped(monkeypatch):
    """A binder that computes something else (here Gemm without its bias) fails the plan's check against
    the node-by-node run: the signature keeps running node by node, with the right values."""
    model = _block_model()
    x = np.random.default_rng(4).standard_normal((1, 3, 12, 12)).astype(np.float32)
    deferred.wait_ready(240)
    wrong = dict(segment_steps.BINDERS, Gemm=lambda node, kernel, inputs, outputs, constant: [
        (np.matmul, (inputs[0], np.ascontiguousarray(inputs[1].T), outputs[0]))])
    monkeypatch.setattr(segment_steps, "BINDERS", wrong)
    segment, feeds = _segment_and_feeds(model, x)
    segment(*feeds)
    got = segment(*feeds)
    assert list(segment.plans.values()) == [None]
    got = dict(zip(segment_outputs(segment), got))
    np.testing.assert_allclose(got["logits"], _oracle(model, x)[0], rtol=1e-4, atol=1e-5)


def test_a_busy_plan_gets_a_copy_with_the_same_values():
    model = _block_model()
    x = np.random.default_rng(5).standard_normal((1, 3, 12, 12)).astype(np.float32)
    deferred.wait_ready(240)
    segment, feeds = _segment_and_feeds(model, x)
    _settled(segment, feeds)
    expected = segment(*feeds)
    ((plan,),) = segment.plans.values()
    results = []
    with plan.lock:  # another thread is inside the plan
        worker = threading.Thread(target=lambda: results.append(segment(*feeds)))
        worker.start()
        worker.join(30)
    (plans,) = segment.plans.values()
    assert len(plans) == 2 and plans[0] is plan
    for got, want in zip(results[0], expected):
        np.testing.assert_array_equal(got, want)  # whichever copy ran it


def test_wrong_channels_name_the_inner_node():
    model = _block_model()
    segment, feeds = _segment_and_feeds(model, np.zeros((1, 3, 12, 12), np.float32))
    feeds = [np.zeros((1, 4, 12, 12), np.float32) if f.shape == (1, 3, 12, 12) else f for f in feeds]
    with pytest.raises(InvalidArgumentError, match=r"\(FusedConv\): input has 4 channels but the weight .* of segment"):
        segment(*feeds)


def test_one_convolution_is_not_a_segment():
    """A lone convolution (a transformer's patch embedding) stays a node of its own."""
    conv = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[2, 2], strides=[2, 2])
    relu = helper.make_node("Relu", ["y"], ["z"])
    graph = helper.make_graph([conv, relu], "patch", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                    [1, 3, 8, 8])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
                              [numpy_helper.from_array(np.ones((4, 3, 2, 2), np.float32), "w")])
    ir = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])).graph
    for graph_pass in CONV_PASSES:
        graph_pass(ir)
    assert [n.op_type for n in ir.nodes] == ["FusedConv"]


def _residual_model() -> onnx.ModelProto:
    """A ResNet-style stem and block: 7x7/2 convolution, MaxPool, two 3x3 convolutions and the residual sum, a
    third convolution, AveragePool, Flatten and Gemm."""
    rng = np.random.default_rng(11)
    inits = []

    def weight(name, *shape):
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) * 0.2).astype(np.float32), name))
        return name

    nodes = [
        helper.make_node("Conv", ["x", weight("w0", 16, 3, 7, 7), weight("b0", 16)], ["c0"], kernel_shape=[7, 7],
                         strides=[2, 2], pads=[3, 3, 3, 3]),
        helper.make_node("Relu", ["c0"], ["r0"]),
        helper.make_node("MaxPool", ["r0"], ["p0"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["p0", weight("w1", 16, 16, 3, 3)], ["c1"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("Conv", ["r1", weight("w2", 16, 16, 3, 3), weight("b2", 16)], ["c2"], kernel_shape=[3, 3],
                         pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "p0"], ["s2"]),
        helper.make_node("Relu", ["s2"], ["r2"]),
        helper.make_node("Conv", ["r2", weight("w3", 16, 16, 3, 3)], ["c3"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
        helper.make_node("AveragePool", ["c3"], ["a2"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["a2"], ["flat"]),
        helper.make_node("Gemm", ["flat", weight("fc", 16 * 4 * 4, 6)], ["logits"]),
    ]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])
    logits = helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)
    graph = helper.make_graph(nodes, "residual", [x], [logits], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_residual_block_with_pools_runs_prepared_against_onnxruntime():
    model = _residual_model()
    x = np.random.default_rng(12).standard_normal((1, 3, 32, 32)).astype(np.float32)
    deferred.wait_ready(240)
    segment, feeds = _segment_and_feeds(model, x)
    _settled(segment, feeds)
    got = segment(*feeds)
    ((plan,),) = segment.plans.values()
    called = [getattr(f, "__name__", "") for f, _ in plan._steps]  # noqa: SLF001
    pools = called.count("pool_2d") + called.count("max_pool_blocked")  # (a max pool between direct convolutions)
    assert pools == 2 and ("_run_kernel" not in called or not host.AVX2)
    # Its values (in one arena shared by liveness, segment_arena.py: at most what a buffer per value size held):
    # the stem's 16x16 planes, four of 8x8 (pool, three convolutions), the 4x4 average, the logits;
    # the third convolution's output takes the first's buffer (read for the last time by the second); and where
    # the direct tiles run, the values between the stem and the average pool again, channel-blocked
    # (segment_layout.py): the stem's output, the max pool's and two convolutions', and the pool's padded block
    # (17 x 17 pixels and a tile's reach) and narrow-row tile.
    blocked = 4 * 16 * (16 * 16 + 3 * 8 * 8 + 17 * 17 + 4 * 2 + 4) if "max_pool_blocked" in called else 0
    assert plan.nbytes - x.nbytes <= 4 * 16 * (16 * 16 + 3 * 8 * 8 + 4 * 4) + 4 * 6 + blocked
    expected = _oracle(model, x)[0]
    exact = run_float64(model, {"x": x})[0]
    bound = 1e-5 * (1 + np.abs(exact).max())
    assert np.abs(got[0] - exact).max() <= bound and np.abs(got[0] - expected).max() <= bound
    again = segment(*[x * 0.5 if f is x else f for f in feeds])  # the plan, on new values
    np.testing.assert_allclose(again[0], _oracle(model, x * 0.5)[0], rtol=1e-4, atol=1e-5)


def test_the_environment_variable_turns_segments_off(monkeypatch):
    monkeypatch.setenv("ONNX_RUNTIME_SEGMENTS", "0")
    ir = load_model(_residual_model()).graph
    for graph_pass in CONV_PASSES:
        graph_pass(ir)
    assert "FusedSegment" not in [n.op_type for n in ir.nodes] and len(ir.nodes) > 5


def test_new_weight_arrays_are_copied_in_like_feeds():
    """Read-only inputs that change between runs (weights fed as inputs, or a feed from Arrow) are copied in like
    feeds after one replan: the segment keeps a bound plan instead of running node by node from then on."""
    model = _residual_model()
    x = np.random.default_rng(13).standard_normal((1, 3, 32, 32)).astype(np.float32)
    deferred.wait_ready(240)
    segment, feeds = _segment_and_feeds(model, x)
    expected = _oracle(model, x)[0]
    segment(*feeds)
    ((first,),) = segment.plans.values()

    def copies():  # the same weights as new read-only arrays, as a caller feeding them would pass
        fresh = []
        for f in feeds:
            copy = np.array(f)
            copy.setflags(write=f is x)
            fresh.append(copy)
        return fresh

    for _ in range(4):
        got = segment(*copies())
        np.testing.assert_allclose(got[0], expected, rtol=1e-4, atol=1e-5)
    ((again,),) = segment.plans.values()
    assert first is not None and again is not first and not again.constant_slots
    assert segment.fed == {slot for slot, f in enumerate(feeds) if f is not x}


AVX2_SCRIPT = r"""
import gc, json, sys
import numpy as np
from onnx_runtime_ep_cpu.compiled import deferred, host
host.AVX512 = False  # the AVX2 kernels (direct tiles, depthwise lanes) on an AVX-512 host too
import onnx_runtime as ort
from onnx_runtime_ep_cpu.algorithms import segment_steps
from onnx_runtime_ep_cpu.ops.segment import Segment
options = ort.SessionOptions()
options.intra_op_num_threads = 1
sess = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
x = np.load(sys.argv[2])
outputs = [sess.run(None, {"x": x}) for _ in range(1)]
deferred.wait_ready(900)
outputs += [sess.run(None, {"x": x}) for _ in range(1)]
# on a cold cache the AVX2 loops miss after the switch: the plan made meanwhile is provisional until wait_ready
ready = deferred.wait_ready(900)
outputs += [sess.run(None, {"x": x}) for _ in range(2)]
plans = [p for s in gc.get_objects() if isinstance(s, Segment) for ps in s.plans.values() for p in ps or [None]]
kernels = [a for p in plans if p is not None for f, a in p._steps if f is segment_steps._run_kernel]
flat = [np.concatenate([o.reshape(-1) for o in run]) for run in outputs]
np.save(sys.argv[2].replace("x.npy", "y.npy"), np.stack(flat))
print(json.dumps({"plans": len([p for p in plans if p is not None]), "kernels": len(kernels), "ready": ready}))
"""


def test_avx2_kernels_bind_too(tmp_path):
    """On AVX2 hosts (forced here in a fresh process) the depthwise convolutions take the depthwise lanes, which
    bind as the tiles do: every node prepared, the same values as onnxruntime."""
    import json
    import subprocess
    import sys

    if not host.AVX2:
        pytest.skip("the AVX2 kernels need an AVX2 host")
    model = _block_model()
    path = tmp_path / "block.onnx"
    onnx.save(model, path)
    x = np.random.default_rng(21).standard_normal((1, 3, 12, 12)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}  # the loader on
    done = subprocess.run([sys.executable, "-c", AVX2_SCRIPT, str(path), str(tmp_path / "x.npy")], capture_output=True,
                          text=True, timeout=2400, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"plans": 1, "kernels": 0, "ready": True}
    expected = np.concatenate([o.reshape(-1) for o in _oracle(model, x)])
    for run in np.load(tmp_path / "y.npy"):
        np.testing.assert_allclose(run, expected, rtol=1e-4, atol=1e-5)
