"""Per-session CUDA streams (issue 21): every provider instance runs on a lane of its own (a compute and a
transfer stream), a buffer one session wrote is read by another only after an event recorded on the writer's
stream (the contract's ``order_device_access``, called by the session for a run's device feeds and bound
outputs), and a free waits for the lanes that read the memory. The simulator's deferred mode runs a stream's
work only when something waits for it, so a missing wait shows as a wrong result, and its stream trace says
which stream each operation went to (asserted on, never timing).
"""

from __future__ import annotations

import os
import threading

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

cu = pytest.importorskip("onnx_runtime_ep_cuda.sim.driver", reason="the CUDA provider is not installed")

CUDA = "CUDAExecutionProvider"
SIMULATED = os.environ.get("ONNX_RUNTIME_CUDA_TESTS", "").lower() != "real"
only_simulated = pytest.mark.skipif(not SIMULATED, reason="deferred execution and stream traces are the simulator's")
SHAPE = (4, 16)


@pytest.fixture(autouse=True)
def mode(cuda_driver_mode):
    pass


@pytest.fixture
def maybe_deferred():
    """Deferred with a trace on the simulator; nothing on a real driver."""
    previous = cu.configure(deferred=True, trace=True) if SIMULATED else None
    yield
    if previous is not None:
        cu.configure(**previous)


def _model(nodes, inputs, outputs, initializers) -> bytes:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in inputs],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE) for n in outputs],
                              initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def producer(seed: int = 0) -> tuple[bytes, np.ndarray]:
    """h = Relu(x @ w), and its weight."""
    w = (np.random.default_rng(seed).standard_normal((16, 16)) / 4).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Relu", ["t"], ["h"])]
    return _model(nodes, ["x"], ["h"], {"w": w}), w


def consumer() -> tuple[bytes, np.ndarray]:
    """z = Tanh(h + b), and its bias."""
    b = np.linspace(-1, 1, 16, dtype=np.float32)
    nodes = [helper.make_node("Add", ["h", "b"], ["s"]), helper.make_node("Tanh", ["s"], ["z"])]
    return _model(nodes, ["h"], ["z"], {"b": b}), b


def session(model: bytes, capture: bool = False, providers=(CUDA,)) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if capture:
        options.add_session_config_entry("session.graph_capture", "1")
    return ort.InferenceSession(model, options, providers=list(providers))


def lane_of(sess: ort.InferenceSession):
    return sess.provider_handle(CUDA).provider.cuda_device()


def _feed(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def _run_on_two_threads(sessions, feeds, expected) -> dict[int, int]:
    """Session i runs every feed on thread i, both threads released together; each output agrees with
    ``expected[i]``. The threads' idents, by index."""
    barrier = threading.Barrier(2)
    got: dict[int, list] = {}
    threads: dict[int, int] = {}

    def work(index: int) -> None:
        threads[index] = threading.get_ident()
        barrier.wait()
        got[index] = [sessions[index].run(None, {"x": f})[0] for f in feeds]

    workers = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for index in (0, 1):
        for y, want in zip(got[index], expected[index], strict=True):
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    return threads


def test_two_sessions_on_two_threads_run_on_two_streams(maybe_deferred):
    """Each session's kernels go to its own stream, from its own thread, and both get the CPU provider's
    results; before, every session enqueued on the device's one compute stream."""
    models = [producer(seed)[0] for seed in (1, 2)]
    feeds = [_feed(10 + k) for k in range(5)]
    expected = [[session(m, providers=("CPUExecutionProvider",)).run(None, {"x": f})[0] for f in feeds]
                for m in models]
    sessions = [session(m) for m in models]
    threads = _run_on_two_threads(sessions, feeds, expected)
    if SIMULATED:
        lanes = [int(lane_of(s).compute) for s in sessions]
        assert lanes[0] != lanes[1]
        launches = [(stream, thread) for call, stream, thread in cu.stream_trace() if call == "cuLaunchKernel"]
        for index in (0, 1):
            streams = {stream for stream, thread in launches if thread == threads[index]}
            assert streams == {lanes[index]}, (index, streams, lanes)


@only_simulated
def test_one_session_finishes_while_anothers_work_is_still_queued(deferred):
    """Deferred execution: session A's run leaves its kernels queued on A's stream (its output stays bound on the
    device); session B then runs to the end and reads its result, and A's work is still queued: B's stream never
    waited for A's. On one shared stream, B's read would have run A's work first."""
    model_a, w = producer()
    model_b, _ = consumer()
    a, b = session(model_a), session(model_b)
    kept = a.device_io_binding(ort.DeviceBindingSpec.output("h", np.float32, SHAPE))
    a.run_with_device_bindings([kept], input_feed={"x": _feed(1)}, output_names=[])
    (z,) = b.run(None, {"h": np.zeros(SHAPE, np.float32)})
    np.testing.assert_allclose(z, np.tanh(np.linspace(-1, 1, 16, dtype=np.float32))[None].repeat(4, 0), rtol=1e-6)
    (pending,) = cu.cuStreamQuery(lane_of(a).compute)
    assert pending == cu.CUresult.CUDA_ERROR_NOT_READY  # A's work has not run yet
    np.testing.assert_allclose(kept.read_logical(), np.maximum(_feed(1) @ w, 0), rtol=1e-5, atol=1e-6)
    kept.close()


def _hand_over(a, b, kept, x) -> np.ndarray:
    """A writes its DeviceIoBinding ``kept``; B reads it in place (IO binding) and downloads its result."""
    a.run_with_device_bindings([kept], input_feed={"x": x}, output_names=[])
    binding = b.io_binding()
    view = ort.Tensor(ort.DataType.FLOAT, SHAPE, kept.buffer.alias(0, kept.nbytes), kept.allocator)
    binding.bind_ortvalue_input("h", ort.OrtValue(view))
    binding.bind_output("z")
    b.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


@only_simulated
@pytest.mark.parametrize("ordered", [True, False], ids=["ordered", "hook-call-removed"])
def test_a_device_binding_output_handed_to_another_session_is_read_after_its_writer(deferred, ordered, monkeypatch):
    """B's run reads A's bound output only after an event recorded on A's stream (B's stream waits on it); with
    the session's ``order_device_access`` call removed, the simulator shows B reading the buffer before A's
    kernels wrote it (new device memory holds 0xFF bytes: NaN), so the test fails without the call."""
    from onnx_runtime.session.executor import Executor

    if not ordered:
        monkeypatch.setattr(Executor, "_order_access", lambda self, feeds, feed_devices, writes: None)
    model_a, w = producer()
    model_b, bias = consumer()
    a, b = session(model_a), session(model_b)
    kept = a.device_io_binding(ort.DeviceBindingSpec.output("h", np.float32, SHAPE))
    x = _feed(3)
    z = _hand_over(a, b, kept, x)
    want = np.tanh(np.maximum(x.astype(np.float64) @ w, 0) + bias)
    if not ordered:
        assert not np.allclose(z, want, rtol=1e-5, atol=1e-6)  # the stale read the hook call prevents
        kept.close()
        return
    np.testing.assert_allclose(z, want, rtol=1e-5, atol=1e-6)
    lane_a, lane_b = int(lane_of(a).compute), int(lane_of(b).compute)
    trace = cu.stream_trace()
    waits = [i for i, (call, stream, _t) in enumerate(trace) if call == "cuStreamWaitEvent" and stream == lane_b]
    records = [i for i, (call, stream, _t) in enumerate(trace) if call == "cuEventRecord" and stream == lane_a]
    reads = [i for i, (call, stream, _t) in enumerate(trace) if call == "cuLaunchKernel" and stream == lane_b]
    assert waits and records and records[0] < waits[0] < reads[0], (records[:3], waits[:3], reads[:3])
    kept.close()


@only_simulated
def test_a_free_waits_for_the_lanes_that_read_the_memory(deferred):
    """A buffer of instance A read by instance B (a copy queued on B's stream) and then freed by A: the free waits
    on an event recorded on B's stream, once, so B's queued read runs before the memory goes back to the pool
    (the simulator reports a use after free otherwise)."""
    from onnx_runtime import ProviderHandle
    from onnx_runtime_ep_cuda import CUDAExecutionProvider

    a, b = ProviderHandle(CUDAExecutionProvider()), ProviderHandle(CUDAExecutionProvider())
    a.initialize({})
    b.initialize({})
    device = a.provider.cuda_device().shared
    source, target = a.allocate(256, 256), b.allocate(256, 256)
    a.provider.fill(source, 7)
    b.hook.copy_device_to_device(src=source, src_offset=0, dst=target, dst_offset=0, nbytes=256)  # B reads it
    before = device.cross_stream_frees
    a.deallocate(source)
    assert device.cross_stream_frees == before + 1
    out = np.empty(256, np.uint8)
    b.copy_to_host(target, out)
    assert (out == 7).all()
    a.provider.cuda_device().sync()  # the free ran after B's read: no fault
    b.deallocate(target)
    a.shutdown()
    b.shutdown()


def test_two_sessions_capture_at_once(maybe_deferred):
    """Two instances capture device graphs at the same time on two threads (no process-wide capture lock): the
    second capture begins and ends while the first is still open, and each graph replays its own work."""
    from onnx_runtime import DeviceGraphOwner, DeviceGraphSlot, ProviderHandle
    from onnx_runtime_ep_cuda import CUDAExecutionProvider

    handles = [ProviderHandle(CUDAExecutionProvider()) for _ in range(2)]
    for handle in handles:
        handle.initialize({})
    buffers = [h.allocate(64, 256) for h in handles]
    for handle, buffer in zip(handles, buffers, strict=True):
        handle.provider.fill(buffer, 0)
    first_open, second_done = threading.Event(), threading.Event()
    tokens: dict[int, object] = {}

    def capture(index: int, value: int) -> None:
        handle = handles[index]
        token = handle.hook.begin_owned_device_graph_capture(owner=DeviceGraphOwner.new(),
                                                             slot=DeviceGraphSlot.PRIMARY, continuation=None,
                                                             kernels=[])
        handle.provider.fill(buffers[index], value)
        if index == 0:
            first_open.set()
            assert second_done.wait(10)  # the other capture ran to its end meanwhile
        handle.hook.end_owned_device_graph_capture(token=token)
        tokens[index] = token
        if index == 1:
            second_done.set()

    first = threading.Thread(target=capture, args=(0, 5))
    first.start()
    assert first_open.wait(10)
    second = threading.Thread(target=capture, args=(1, 9))
    second.start()
    second.join(10)
    first.join(10)
    assert set(tokens) == {0, 1}
    out = np.empty(64, np.uint8)
    for index, value in ((0, 5), (1, 9)):
        handle = handles[index]
        handle.copy_to_host(buffers[index], out)
        assert (out == 0).all()  # captured, not run
        handle.hook.replay_owned_device_graph(token=tokens[index])
        handle.copy_to_host(buffers[index], out)
        assert (out == value).all()
    for handle, buffer in zip(handles, buffers, strict=True):
        handle.deallocate(buffer)
        handle.shutdown()


def test_capturing_sessions_on_two_threads_replay_and_match_the_cpu_provider():
    models = [producer(seed)[0] for seed in (4, 5)]
    feeds = [_feed(20 + k) for k in range(6)]
    expected = [[session(m, providers=("CPUExecutionProvider",)).run(None, {"x": f})[0] for f in feeds]
                for m in models]
    sessions = [session(m, capture=True) for m in models]
    _run_on_two_threads(sessions, feeds, expected)
    for index in (0, 1):
        assert sessions[index].device_graph_status() == "replaying"
        assert sessions[index]._executor.graphs.captures == 1  # noqa: SLF001 - the runner's count


@only_simulated
def test_hand_overs_free_every_allocation_once_and_leak_no_event(deferred):
    """Twenty hand-overs between two sessions: the simulator's event count does not grow with them (ordering
    events go back to the device's idle list at once), and closing everything frees every allocation once."""
    model_a, w = producer()
    model_b, bias = consumer()
    a, b = session(model_a), session(model_b)
    device = lane_of(a).shared
    kept = a.device_io_binding(ort.DeviceBindingSpec.output("h", np.float32, SHAPE))
    counts = []
    for step in range(20):
        x = _feed(step)
        z = _hand_over(a, b, kept, x)
        np.testing.assert_allclose(z, np.tanh(np.maximum(x.astype(np.float64) @ w, 0) + bias), rtol=1e-5,
                                   atol=1e-6)
        counts.append(cu.live_events())
    assert counts[-1] == counts[2], counts
    assert device.ordered_waits >= 20
    kept.close()
    for sess in (a, b):
        sess.close()
    device.sync()
    assert device.allocations - device.frees == len(device._live)  # noqa: SLF001 - every free counted once
