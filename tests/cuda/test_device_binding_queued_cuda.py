"""DeviceIoBinding on the CUDA simulator while work is still queued (issue 21, deferred execution as a GPU
has it): a bound feed rewritten in place between replays that have not run yet, a binding released while a
captured graph that recorded its address may still be queued, and bindings alive across a sticky kernel fault
(quarantined with the fault named, the device recovered for the next session's bindings)."""

from __future__ import annotations

import ctypes
import gc
import threading
import warnings

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from cuda_op_harness import kernel_file
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime import DataType, DeviceBindingSpec

pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
from onnx_runtime_ep_cuda.driver import CudaDeviceFaultError  # noqa: E402

CUDA = "CUDAExecutionProvider"
VOCAB, HIDDEN = 16, 8
FAULTS = r"""
extern "C" __global__ void scribble(float* p, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = 1.0f;
}
"""


@pytest.fixture
def sim(cuda_driver_mode):
    from onnx_runtime_ep_cuda.driver import simulated

    if not simulated():
        pytest.skip("deferred execution and provoked faults: simulator only")
    from onnx_runtime_ep_cuda.sim import driver as cu

    yield cu
    cu.configure(deferred=False, sticky_errors=False)


@pytest.fixture
def queued(cuda_driver_mode):
    """Work left queued when the host goes on: the simulator in deferred mode with blocks in shuffled order (seeded),
    or a GPU, where it is so anyway (scripts/gpu_check.sh runs these there)."""
    from onnx_runtime_ep_cuda.driver import simulated

    if not simulated():
        yield
        return
    from onnx_runtime_ep_cuda.sim import driver as cu

    previous = cu.configure(deferred=True, shuffle_blocks=7)
    yield
    cu.configure(**previous)


@pytest.fixture
def step_model():
    """logits = Gather(E, token) @ W: one greedy step, token int64 [1], logits [1, VOCAB]."""
    rng = np.random.default_rng(7)
    embedding = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    projection = rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["embedding", "token"], ["hidden"]),
             helper.make_node("MatMul", ["hidden", "projection"], ["logits"])]
    model = make_model(nodes, [tensor_info("token", TensorProto.INT64, [1])], [tensor_info("logits", shape=[1, VOCAB])],
                       [onnx.numpy_helper.from_array(embedding, "embedding"),
                        onnx.numpy_helper.from_array(projection, "projection")])
    return model, embedding, projection


def _session(model, capture):
    options = ort.SessionOptions()
    if capture:
        options.add_session_config_entry("session.graph_capture", "1")
    return ort.InferenceSession(model.SerializeToString(), options, providers=[CUDA])


def _bindings(sess):
    return (sess.device_io_binding(DeviceBindingSpec.input("token", np.int64, (1,))),
            sess.device_io_binding(DeviceBindingSpec.output("logits", np.float32, (1, VOCAB))))


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
def test_a_bound_feed_rewritten_in_place_between_queued_replays_feeds_each_its_own_value(queued, step_model, capture):
    """Each step's logits are copied on the device into a tensor of their own and nothing is read until the end:
    every run is still queued when the next write_logical/write_bytes rewrites the token in place, so an upload
    that overtook the queued run (or a replay reading a stale staging copy) shows as another step's logits."""
    model, embedding, projection = step_model
    sess = _session(model, capture)
    token, logits = _bindings(sess)
    tokens = [1, 5, 2, 9, 3, 7, 11, 4, 14, 0]
    kept = []
    for step, value in enumerate(tokens):
        if step % 2:
            token.write_bytes(0, np.array([VOCAB - 1], np.int64))  # overwritten before the run: never seen
            token.write_bytes(0, np.array([value], np.int64))
        else:
            token.write_logical(np.array([value], np.int64))
        sess.run_with_device_bindings([token, logits])
        copy = ort.Tensor.empty(DataType.FLOAT, (1, VOCAB), provider=logits.allocator)
        logits.snapshot_device_into(copy, logits.nbytes)
        kept.append(copy)
    if capture:
        runner = sess._executor.graphs  # noqa: SLF001  (the runner's counts: white box)
        assert sess.device_graph_status() == "replaying" and runner.captures == 1
        assert runner.replays == len(tokens) - 1  # the first run warms up; the capture launches its graph too
    for value, copy in zip(tokens, kept):
        np.testing.assert_allclose(copy.numpy(), embedding[[value]] @ projection, rtol=1e-5, atol=1e-5)
        copy.close()
    token.close()
    logits.close()


def test_a_binding_released_under_a_queued_replay_resets_its_graph_and_the_next_binding_captures_again(queued,
                                                                                                      step_model):
    """A replay is queued (deferred) when the output binding its graph recorded is closed: the release resets that
    graph and frees the memory once, nothing quarantined; a new output binding is captured afresh and never written
    through the old graph, and memory allocated after the release is not written by the queued replay."""
    from onnx_runtime.session.device_io_binding import quarantined_allocations

    model, embedding, projection = step_model
    sess = _session(model, capture=True)
    device = sess.provider_handle(CUDA)
    quarantined = len(quarantined_allocations())
    token, logits = _bindings(sess)
    for value in (1, 2, 3):
        token.write_logical(np.array([value], np.int64))
        sess.run_with_device_bindings([token, logits])
    graph, address = logits.device_graph_token, logits.device_ptr
    assert sess.device_graph_status() == "replaying" and device.hook.has_owned_device_graph(token=graph)
    token.write_logical(np.array([6], np.int64))
    sess.run_with_device_bindings([token, logits])  # queued, not run
    logits.close()
    assert not device.hook.has_owned_device_graph(token=graph)
    assert len(quarantined_allocations()) == quarantined
    # Memory at the freed address, written by the host: a replay running after the free would overwrite it.
    other = ort.Tensor.zeros(DataType.FLOAT, (1, VOCAB), provider=token.allocator)
    fresh = sess.device_io_binding(DeviceBindingSpec.output("logits", np.float32, (1, VOCAB)))
    runner = sess._executor.graphs  # noqa: SLF001  (the runner's counts: white box)
    captures = runner.captures
    for value in (4, 8, 12, 15):
        token.write_logical(np.array([value], np.int64))
        sess.run_with_device_bindings([token, fresh])
        np.testing.assert_allclose(fresh.read_logical(), embedding[[value]] @ projection, rtol=1e-5, atol=1e-5)
    assert runner.captures == captures + 1 and sess.device_graph_status() == "replaying"
    assert fresh.device_ptr != address or not np.any(other.numpy())
    assert not np.any(other.numpy())
    other.close()
    token.close()
    fresh.close()
    sess.close()
    gc.collect()
    allocations, frees = device.allocation_counts() or (0, 0)
    assert allocations == frees


@pytest.mark.parametrize("deferred", [False, True], ids=["immediate", "deferred"])
def test_bindings_alive_across_a_sticky_fault_are_refused_then_quarantined_and_the_device_recovers(
        sim, step_model, deferred, tmp_path_factory):
    """A kernel faults while a session replays on bindings: every use of those bindings (run, read, write) is the
    typed fault error naming the kernel, their release quarantines the memory of the dead context with a warning
    naming the binding (never a free on it), and a new session's bindings on the recovered device capture and
    replay the right values."""
    from onnx_runtime.session.device_io_binding import quarantined_allocations

    model, embedding, projection = step_model
    path = kernel_file(tmp_path_factory, "faults.cu", FAULTS)
    sim.configure(deferred=deferred, sticky_errors=True)
    sess = _session(model, capture=True)
    token, logits = _bindings(sess)
    for value in (1, 2, 3):
        token.write_logical(np.array([value], np.int64))
        sess.run_with_device_bindings([token, logits])
    assert sess.device_graph_status() == "replaying"
    device = sess.provider_handle(CUDA).provider.cuda_device()
    with pytest.raises(CudaDeviceFaultError, match="faults.cu:scribble"):
        function = device.function(device.load(path), "scribble")
        device.launch(function, 1, 32, [(64, ctypes.c_void_p), (8, ctypes.c_int)])  # an address nothing maps
        device.sync()
    uses = {"run": lambda: sess.run_with_device_bindings([token, logits]),
            "read": logits.read_logical,
            "write": lambda: token.write_logical(np.array([4], np.int64))}
    for use in uses.values():
        with pytest.raises(CudaDeviceFaultError, match="faults.cu:scribble"):
            use()
    quarantined = len(quarantined_allocations())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        token.close()
        logits.close()
    messages = [str(w.message) for w in caught]
    for name in ("token", "logits"):
        assert any(f"'{name}'" in m and "faults.cu:scribble" in m and "quarantined" in m for m in messages), messages
    assert len(quarantined_allocations()) == quarantined + 2
    sess.close()
    after = _session(model, capture=True)
    token, logits = _bindings(after)
    for value in (5, 6, 7, 10):
        token.write_logical(np.array([value], np.int64))
        after.run_with_device_bindings([token, logits])
        np.testing.assert_allclose(logits.read_logical(), embedding[[value]] @ projection, rtol=1e-5, atol=1e-5)
    assert after.device_graph_status() == "replaying"
    token.close()
    logits.close()


def test_a_replayed_decode_step_moves_no_host_bytes_by_transfer_stats_and_the_driver(queued, step_model, monkeypatch):
    """Issue 21's target, asserted from both sides at once with the work queued (deferred): each replayed greedy step
    (run, device argmax, device token writer) leaves every binding's transfer_stats as they were and makes no
    host synchronization, no host transfer and one graph launch at the driver; the caller's single read at the end
    is the only host traffic, counted once on the binding read."""
    from test_device_graphs import CountingDriver

    model, embedding, projection = step_model
    sess = _session(model, capture=True)
    steps = 8
    token, logits = _bindings(sess)
    result = sess.device_io_binding(DeviceBindingSpec.scratch("argmax", np.uint32, (2,)))
    mask = sess.device_io_binding(DeviceBindingSpec.scratch("mask", np.int64, (1, steps + 1)))
    tokens = sess.device_io_binding(DeviceBindingSpec.scratch("tokens", np.uint32, (steps + 1,)))
    bindings = [token, logits, result, mask, tokens]
    token.write_logical(np.array([3], np.int64))
    mask.write_logical(np.zeros((1, steps + 1), np.int64))
    tokens.write_logical(np.zeros(steps + 1, np.uint32))
    device = sess.provider_handle(CUDA).provider.cuda_device()
    counting = CountingDriver(device.driver)
    monkeypatch.setattr(device, "driver", counting)
    per_step = []
    for step in range(steps):
        stats = [b.transfer_stats for b in bindings]
        counting.calls.clear()
        sess.run_with_device_bindings([token, logits])
        logits.device_argmax(VOCAB, 1, result)
        result.device_token_writer(token, None, mask, tokens, capacity=steps, next_position=step, mask_len=steps + 1,
                                   step=step)
        per_step.append((counting.syncs(), counting.host_transfers(), counting.calls.get("cuGraphLaunch", 0),
                         [b.transfer_stats for b in bindings] == stats))
    assert sess.device_graph_status() == "replaying"
    assert all(step == (0, 0, 1, True) for step in per_step[2:]), per_step
    before = tokens.transfer_stats
    drained = tokens.read_logical()
    assert tokens.transfer_stats == ort.DeviceBindingTransferStats(
        before.host_upload_calls, before.host_upload_bytes, before.host_download_calls + 1,
        before.host_download_bytes + tokens.nbytes)
    want, last = [], 3
    for _ in range(steps):
        last = int(np.argmax(embedding[last] @ projection))
        want.append(last)
    assert drained[:steps].tolist() == want
    for binding in bindings:
        binding.close()


@pytest.mark.parametrize("shared", [False, True], ids=["a-session-each", "one-session"])
def test_eight_threads_run_greedy_loops_on_bindings_with_work_queued_and_blocks_shuffled(queued, step_model, shared):
    """Eight threads on one device, each a greedy loop on its own bindings (run, device argmax, device token
    writer, captured then replayed) with deferred execution and blocks in shuffled order: on sessions of their own
    (a lane each) and all on one session (its run lock), every thread's tokens are its single-threaded tokens."""
    model, embedding, projection = step_model
    threads, steps = 8, 8
    one = _session(model, capture=True) if shared else None
    sessions, failures = [], []
    barrier = threading.Barrier(threads)

    def loop(start: int) -> None:
        sess = one or _session(model, capture=True)
        sessions.append(sess)
        token, logits = _bindings(sess)
        result = sess.device_io_binding(DeviceBindingSpec.scratch("argmax", np.uint32, (2,)))
        mask = sess.device_io_binding(DeviceBindingSpec.scratch("mask", np.int64, (1, steps + 1)))
        tokens = sess.device_io_binding(DeviceBindingSpec.scratch("tokens", np.uint32, (steps + 1,)))
        token.write_logical(np.array([start], np.int64))
        mask.write_logical(np.zeros((1, steps + 1), np.int64))
        tokens.write_logical(np.zeros(steps + 1, np.uint32))
        barrier.wait()
        try:
            for step in range(steps):
                sess.run_with_device_bindings([token, logits])
                logits.device_argmax(VOCAB, 1, result)
                result.device_token_writer(token, None, mask, tokens, capacity=steps, next_position=step,
                                           mask_len=steps + 1, step=step)
            want, last = [], start
            for _ in range(steps):
                last = int(np.argmax(embedding[last] @ projection))
                want.append(last)
            got = tokens.read_logical()[:steps].tolist()
            if got != want:
                failures.append(f"thread {start}: {got} != {want}")
        except Exception as exc:  # noqa: BLE001 - every failure is reported below
            failures.append(f"thread {start}: {type(exc).__name__}: {exc}")
        finally:
            for binding in (token, logits, result, mask, tokens):
                binding.close()

    workers = [threading.Thread(target=loop, args=(start,)) for start in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not failures, failures[:3]
    for sess in {id(s): s for s in sessions}.values():
        runner = sess._executor.graphs  # noqa: SLF001  (the runner's counts: white box)
        assert sess.device_graph_status() == "replaying"
        assert runner.replays == (threads if shared else 1) * (steps - 1)  # every run after each warm-up replayed
