"""Shape computations on the host (ops/host_shapes.py): the integers that only decide shapes (Shape, Gather,
Unsqueeze, Concat, arithmetic, ... ending in Reshape's shape or Range's bounds) are computed with numpy on the
host, so a run reads nothing back from the device for them; a value some device kernel also reads is mirrored on
the device. Results against numpy, transfers counted at the provider's copy hooks and at the driver."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import CopyCounter, make_model, tensor_info
from onnx import TensorProto, helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
CUDA = "CUDAExecutionProvider"


@pytest.fixture(autouse=True)
def mode(cuda_driver_mode):
    yield


def _const(name, values):
    return onnx.numpy_helper.from_array(np.asarray(values, np.int64), name)


def shape_model() -> onnx.ModelProto:
    """y = Reshape(x, [rows * 2, -1]) + 1 and z = ids + rows, with rows = Shape(x)[0]: the reshape target is a host
    value only, ``rows`` is also read by a device Add (mirrored), and Range(0, rows) reads it as a host input."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"], name="shape"),
        helper.make_node("Gather", ["shape", "zero"], ["rows"], name="rows", axis=0),
        helper.make_node("Mul", ["rows", "two"], ["twice"], name="twice"),
        helper.make_node("Unsqueeze", ["twice", "axes"], ["first"], name="first"),
        helper.make_node("Concat", ["first", "minus_one"], ["target"], name="target", axis=0),
        helper.make_node("Reshape", ["x", "target"], ["reshaped"], name="reshape"),
        helper.make_node("Add", ["reshaped", "one"], ["y"], name="add"),
        helper.make_node("Add", ["ids", "rows"], ["z"], name="offset"),
        helper.make_node("Range", ["zero", "rows", "step"], ["r"], name="range"),
    ]
    initializers = [_const("zero", 0), _const("two", 2), _const("axes", [0]), _const("minus_one", [-1]),
                    _const("step", 1), onnx.numpy_helper.from_array(np.float32(1.0).reshape(()), "one")]
    return make_model(nodes, [tensor_info("x", shape=["n", 8]), tensor_info("ids", TensorProto.INT64, [3])],
                      [tensor_info("y", shape=None), tensor_info("z", TensorProto.INT64, [3]),
                       tensor_info("r", TensorProto.INT64, None)], initializers)


def test_shape_values_are_computed_on_the_host_and_mirrored_where_the_device_reads_them():
    from onnx_runtime_ep_cuda.ops.host_shapes import host_nodes

    sess = ort.InferenceSession(shape_model().SerializeToString(), providers=[CUDA])
    graph = sess._executor.graph  # noqa: SLF001  (the analysis of the session's graph: white box)
    assert host_nodes(graph, {}) == {"shape": False, "rows": True, "twice": False, "first": False, "target": False}
    assert all(p.provider == CUDA for p in sess.placement())  # the nodes stay CUDA nodes: no seams, no copies
    handle = sess.provider_handle(CUDA)
    counter = CopyCounter(handle)
    rng = np.random.default_rng(0)
    ids = np.array([3, 5, 7], np.int64)
    seen = set()
    for rows in (2, 3, 2, 5, 3):
        x = rng.standard_normal((rows, 8)).astype(np.float32)
        results: list = []
        uploads, downloads, _ = counter.per_call(
            lambda x=x, results=results: results.extend(sess.run(None, {"x": x, "ids": ids})))
        y, z, r = results
        np.testing.assert_array_equal(y, x.reshape(rows * 2, -1) + 1)
        np.testing.assert_array_equal(z, ids + rows)
        np.testing.assert_array_equal(r, np.arange(rows))
        assert downloads == 3, downloads  # the three outputs; before, the reshape target and Range's limit as well
        # The two feeds, and the first time a mirrored value is met its upload (later runs copy it on the device).
        assert uploads == (2 if rows in seen else 3), uploads
        seen.add(rows)


def test_a_device_value_keeps_its_node_on_the_device():
    """A Gather whose indices are a feed (device data) is no host node, and neither is what reads its output;
    the Reshape then reads its target back, as before."""
    from onnx_runtime_ep_cuda.ops.host_shapes import host_nodes

    nodes = [helper.make_node("Shape", ["x"], ["shape"], name="shape"),
             helper.make_node("Gather", ["shape", "which"], ["dims"], name="dims", axis=0),
             helper.make_node("Reshape", ["x", "dims"], ["y"], name="reshape")]
    model = make_model(nodes, [tensor_info("x", shape=["a", 3, 4]), tensor_info("which", TensorProto.INT64, [3])],
                       [tensor_info("y", shape=None)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=[CUDA])
    assert host_nodes(sess._executor.graph, {}) == {"shape": True}  # noqa: SLF001
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    (y,) = sess.run(None, {"x": x, "which": np.array([2, 1, 0], np.int64)})
    np.testing.assert_array_equal(y, x.reshape(4, 3, 2))


@pytest.mark.parametrize("name", ["gpt2.dynamo.fp32", "llama.torchscript.fp32"])
def test_a_generate_step_reads_back_no_shape(name, monkeypatch):
    """The issue's executor readbacks in the generate loop: a decode step of the zoo's exports downloads nothing
    (each of their reshape targets used to be read back: 20 and 22 downloads per step), tokens unchanged."""
    from onnx_runtime.generate import Generator, _Bindings
    from test_device_graphs import CountingDriver
    from test_generate import PROMPT, _model, onnxruntime_greedy

    path = _model(name)
    sess = ort.InferenceSession(path, providers=[CUDA, "CPUExecutionProvider"])
    device = sess.provider_handle(CUDA).provider.cuda_device()
    counting = CountingDriver(device.driver)
    monkeypatch.setattr(device, "driver", counting)
    downloads = []
    choose = _Bindings._choose  # noqa: SLF001  (wrapped to count each step's driver calls)

    def counted(self, *args):
        choose(self, *args)
        downloads.append(sum(n for call, n in counting.calls.items() if call.startswith("cuMemcpyDtoH")))
        counting.calls.clear()

    monkeypatch.setattr(_Bindings, "_choose", counted)
    tokens = Generator(sess).generate(PROMPT, 5).tokens
    assert tokens == onnxruntime_greedy(path, PROMPT, 5)
    # Per step after the first: nothing (gpt2.dynamo's GatherND, a CPU seam that read back, now runs on CUDA).
    assert all(p.provider == CUDA for p in sess.placement())
    assert all(n == 0 for n in downloads[2:]), downloads
