"""Sessions on one CUDA device run from any thread: eight threads over several capturing sessions (each session
also run by several threads at once, each session on a stream of its own) get the single-threaded results, and
every session still captures and replays. Before, the threads broke each other's captures
(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED or INVALIDATED, the signature left eager) and one session's concurrent runs
made its validation tokens stale.
"""

from __future__ import annotations

import threading

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")

CUDA = "CUDAExecutionProvider"
THREADS = 8


@pytest.fixture(autouse=True)
def mode(cuda_driver_mode):
    pass


def mlp(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((16, 16)).astype(np.float32) / 4
    b = rng.standard_normal(16).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t0"]), helper.make_node("Add", ["t0", "b"], ["t1"]),
             helper.make_node("Relu", ["t1"], ["t2"]), helper.make_node("MatMul", ["t2", "w"], ["t3"]),
             helper.make_node("Tanh", ["t3"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
                              initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def capturing(model: bytes) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    return ort.InferenceSession(model, options, providers=[CUDA])


def test_eight_threads_over_capturing_sessions_get_single_threaded_results():
    models = [mlp(seed) for seed in range(4)]
    feeds = [np.random.default_rng(100 + k).standard_normal((4, 16)).astype(np.float32) for k in range(THREADS)]
    expected = []
    for model in models:  # single-threaded, on sessions of their own
        reference = capturing(model)
        expected.append([reference.run(None, {"x": feed})[0] for feed in feeds])
    sessions = [capturing(model) for model in models]
    barrier = threading.Barrier(THREADS)
    failures: list[str] = []

    def work(thread: int) -> None:
        barrier.wait()
        for step in range(6):
            for index, session in enumerate(sessions):
                k = (thread + step) % THREADS
                try:
                    (y,) = session.run(None, {"x": feeds[k]})
                except Exception as exc:  # noqa: BLE001 - every failure is reported below
                    failures.append(f"thread {thread} session {index}: {type(exc).__name__}: {exc}")
                    continue
                if not np.array_equal(y, expected[index][k]):
                    failures.append(f"thread {thread} session {index} feed {k}: wrong result")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:3]
    for session in sessions:
        runner = session._executor.graphs  # noqa: SLF001 - the capture and replay counts
        assert session.device_graph_status() == "replaying"
        assert runner.captures == 1 and runner.replays >= THREADS * 6 - 2


def test_a_capture_holds_its_own_lane_only(cuda_handle):
    """Each provider instance runs on a lane of its own: another instance's kernel runs at once while this one
    captures, outside the graph, and this instance's lane used from another thread waits at the lane's gate
    until the capture ends instead of landing in the graph."""
    from onnx_runtime import DeviceGraphOwner, DeviceGraphSlot, ProviderHandle
    from onnx_runtime_ep_cuda import CUDAExecutionProvider

    other = ProviderHandle(CUDAExecutionProvider())
    other.initialize({})
    mine, later, theirs = cuda_handle.allocate(64, 256), cuda_handle.allocate(64, 256), other.allocate(64, 256)
    for buffer, handle in ((mine, cuda_handle), (later, cuda_handle), (theirs, other)):
        handle.provider.fill(buffer, 0)
    token = cuda_handle.hook.begin_owned_device_graph_capture(owner=DeviceGraphOwner.new(),
                                                              slot=DeviceGraphSlot.PRIMARY, continuation=None,
                                                              kernels=[])
    cuda_handle.provider.fill(mine, 1)
    filled, held = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (other.provider.fill(theirs, 2), filled.set()))
    waiter = threading.Thread(target=lambda: (cuda_handle.provider.fill(later, 4), held.set()))
    worker.start()
    assert filled.wait(5)  # another lane: not held by the capture
    waiter.start()
    assert not held.wait(0.3)  # the capturing lane, from another thread: held at its gate
    cuda_handle.hook.end_owned_device_graph_capture(token=token)
    worker.join(5)
    waiter.join(5)
    assert held.is_set()
    out = np.empty(64, np.uint8)
    other.copy_to_host(theirs, out)
    assert (out == 2).all()  # it ran, outside the graph
    other.provider.fill(theirs, 0)
    cuda_handle.provider.fill(later, 0)
    cuda_handle.hook.replay_owned_device_graph(token=token)
    other.copy_to_host(theirs, out)
    assert (out == 0).all()  # and the replay repeats neither
    cuda_handle.copy_to_host(later, out)
    assert (out == 0).all()
    cuda_handle.copy_to_host(mine, out)
    assert (out == 1).all()
    for buffer in (mine, later):
        cuda_handle.deallocate(buffer)
    other.deallocate(theirs)
    other.shutdown()


def test_a_free_on_the_capturing_thread_is_not_recorded_into_the_graph(cuda_handle):
    """A tensor garbage-collected on the capturing thread (any session's) frees its memory there: recorded into
    the graph, every replay would free it again (the simulator fails the launch; a GPU corrupts its pool)."""
    from onnx_runtime import DeviceGraphOwner, DeviceGraphSlot

    device = cuda_handle.provider.cuda_device()
    mine, stale = cuda_handle.allocate(64, 256), cuda_handle.allocate(64, 256)
    frees = device.frees
    token = cuda_handle.hook.begin_owned_device_graph_capture(owner=DeviceGraphOwner.new(),
                                                              slot=DeviceGraphSlot.PRIMARY, continuation=None,
                                                              kernels=[])
    cuda_handle.provider.fill(mine, 3)
    cuda_handle.deallocate(stale)  # what a finalizer does mid-capture
    cuda_handle.hook.end_owned_device_graph_capture(token=token)
    assert device.frees == frees + 1  # counted once, and freed once the capture ended
    for _ in range(2):
        cuda_handle.hook.replay_owned_device_graph(token=token)
    out = np.empty(64, np.uint8)
    cuda_handle.copy_to_host(mine, out)
    assert (out == 3).all()
    cuda_handle.deallocate(mine)
