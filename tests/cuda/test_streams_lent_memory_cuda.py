"""Per-session CUDA streams, continued (issue 21): memory no allocation holds, memory sessions share, and device
graphs that reach another session's memory.

Borrowed memory (a ``DeviceIoBinding`` made from ``ExternalMemorySpec``) belongs to the instance that borrowed it
from ``borrow_device_memory`` to ``return_device_memory`` (contract 1.5): a reader at an offset of it waits for
the borrower's write of the whole, and ending the borrow forgets it. A captured graph records the buffers its
capture ordered and each launch orders them again, so a buffer a replay writes waits for another session's read
of it; freeing memory another session's graph recorded resets that graph, and waits for the end of a capture that
reached it.
The simulator's deferred mode runs a stream's work only when something waits for it, so a missing wait shows as
a wrong result.
"""

from __future__ import annotations

import gc
import os

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.session.device_step import StepEpilogue

cu = pytest.importorskip("onnx_runtime_ep_cuda.sim.driver", reason="the CUDA provider is not installed")

CUDA = "CUDAExecutionProvider"
SIMULATED = os.environ.get("ONNX_RUNTIME_CUDA_TESTS", "").lower() != "real"
only_simulated = pytest.mark.skipif(not SIMULATED, reason="deferred execution is the simulator's")
SHAPE = (4, 16)
BIAS = np.linspace(-1, 1, 16, dtype=np.float32)


@pytest.fixture(autouse=True)
def mode(cuda_driver_mode):
    pass


def _model(nodes, name_in, name_out, shape, initializers) -> bytes:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(name_in, TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info(name_out, TensorProto.FLOAT, shape)],
                              initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def producer() -> tuple[bytes, np.ndarray]:
    """h = Relu(x @ w), and its weight."""
    w = (np.random.default_rng(0).standard_normal((16, 16)) / 4).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Relu", ["t"], ["h"])]
    return _model(nodes, "x", "h", SHAPE, {"w": w}), w


def consumer(shape=SHAPE) -> bytes:
    """z = Tanh(h + BIAS)."""
    nodes = [helper.make_node("Add", ["h", "b"], ["s"]), helper.make_node("Tanh", ["s"], ["z"])]
    return _model(nodes, "h", "z", shape, {"b": BIAS})


def session(model: bytes, capture: bool = False) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if capture:
        options.add_session_config_entry("session.graph_capture", "1")
    return ort.InferenceSession(model, options, providers=[CUDA])


def device_of(sess: ort.InferenceSession):
    return sess.provider_handle(CUDA).provider.cuda_device().shared


def _feed(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def _consume(sess, tensor: ort.Tensor) -> ort.Tensor:
    """``sess`` (a consumer) reads ``tensor`` in place; its output stays on the device (read it later)."""
    handle = sess.provider_handle(CUDA)
    out = ort.Tensor.empty(ort.DataType.FLOAT, tuple(tensor.shape), handle)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("h", ort.OrtValue(tensor))
    binding.bind_ortvalue_output("z", ort.OrtValue(out))
    sess.run_with_iobinding(binding)
    return out


class RawMemory:
    """Device memory the caller owns, from the driver itself (no allocation of the provider holds it)."""

    def __init__(self, device, nbytes: int):
        self.device = device
        device._bind()  # noqa: SLF001 - this thread's context current, as the device's own calls make it
        self.ptr = int(device._check(device.driver.cuMemAlloc(nbytes), "cuMemAlloc"))  # noqa: SLF001
        self.nbytes = nbytes

    def close(self) -> None:
        self.device.sync()
        self.device._check(self.device.driver.cuMemFree(self.ptr), "cuMemFree")  # noqa: SLF001


# -- memory sessions share -------------------------------------------------------------------------------------
@only_simulated
def test_a_constant_another_session_uploaded_is_read_after_its_upload(deferred):
    """Two sessions of one model share its constants (sealed, uploaded once by the first session on its stream).
    The second session's kernels read them on its own stream, which nothing ordered after that upload: the
    upload is now complete before the constant is handed out (before, the second session read the bias while
    the first session's upload was still queued: NaN)."""
    first, second = session(consumer()), session(consumer())
    x = _feed(5)
    (z,) = second.run(None, {"h": x})
    np.testing.assert_allclose(z, np.tanh(x.astype(np.float64) + BIAS), rtol=1e-5, atol=1e-6)
    (z,) = first.run(None, {"h": x})
    np.testing.assert_allclose(z, np.tanh(x.astype(np.float64) + BIAS), rtol=1e-5, atol=1e-6)


@only_simulated
def test_eight_sessions_of_one_model_on_eight_threads_deferred(deferred):
    """Eight capturing sessions of one model (sharing its constants), each run by a thread of its own while the
    simulator defers every stream's work until something waits for it: every result is right."""
    import threading

    sessions = [session(consumer(), capture=True) for _ in range(8)]
    feeds = [_feed(40 + k) for k in range(6)]
    barrier = threading.Barrier(8)
    failures: list[str] = []

    def work(index: int) -> None:
        barrier.wait()
        for step, x in enumerate(feeds):
            (z,) = sessions[index].run(None, {"h": x})
            if not np.allclose(z, np.tanh(x.astype(np.float64) + BIAS), rtol=1e-5, atol=1e-6):
                failures.append(f"session {index} step {step}")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures, failures[:4]
    assert all(s.device_graph_status() == "replaying" for s in sessions)


# -- borrowed memory --------------------------------------------------------------------------------------------
@only_simulated
def test_a_reader_at_an_offset_of_borrowed_memory_waits_for_the_borrowers_write(deferred):
    """Session A writes external memory it borrowed; session B reads its last two rows (an alias at an offset).
    The offset is the same memory as the whole, so B waits for A's write; before, an address inside borrowed
    memory was a memory of its own whose first orderer (B, a reader) stood as its writer: B read it unwritten."""
    model_a, w = producer()
    a, b = session(model_a), session(consumer((2, 16)))
    memory = RawMemory(device_of(a), 4 * 16 * 4)
    kept = a.device_io_binding(ort.ExternalMemorySpec.output("h", np.float32, SHAPE, SHAPE, memory.ptr,
                                                             memory.nbytes))
    x = _feed(1)
    a.run_with_device_bindings([kept], input_feed={"x": x}, output_names=[])
    rows = ort.Tensor(ort.DataType.FLOAT, (2, 16), kept.buffer.alias(128, 128), kept.allocator)
    z = _consume(b, rows).numpy()
    want = np.tanh(np.maximum(x.astype(np.float64) @ w, 0)[2:] + BIAS)
    np.testing.assert_allclose(z, want, rtol=1e-5, atol=1e-6)
    kept.close()
    memory.close()


@only_simulated
def test_the_borrower_not_the_first_reader_is_the_owner(deferred):
    """A reader that orders borrowed memory first waits for the borrower's lane, where the borrower's work on it
    is queued; before, the first lane to order it became its writer, so the read waited for nothing."""
    from onnx_runtime import ProviderHandle
    from onnx_runtime_ep_cuda import CUDAExecutionProvider

    a, b = ProviderHandle(CUDAExecutionProvider()), ProviderHandle(CUDAExecutionProvider())
    a.initialize({})
    b.initialize({})
    lane_a, lane_b = a.provider.cuda_device(), b.provider.cuda_device()
    device = lane_a.shared
    memory = RawMemory(device, 256)
    lent = ort.DeviceBuffer(a.device_id, 256, 256, memory.ptr, ort.Ownership.BORROWED_MUT)
    a.hook.borrow_device_memory(buffer=lent)
    lane_a.fill(memory.ptr, 256, 7)  # the borrower's own work on it, queued on its stream
    before = device.ordered_waits
    assert lane_b.order_access(reads=[memory.ptr + 64]) == 1  # an address inside: the whole memory's owner
    assert device.ordered_waits == before + 1
    out = np.empty(64, np.uint8)
    lane_b.download(out, memory.ptr + 64)
    lane_b.sync()
    assert (out == 7).all()
    a.hook.return_device_memory(buffer=lent)
    memory.close()
    a.shutdown()
    b.shutdown()


@only_simulated
def test_ending_each_borrow_forgets_the_memory(deferred):
    """Ten external bindings at ten addresses, each written by A and read by B at an offset, each released: what
    the device remembers of them (marks, homes, loans) is back to where it started; before, the marks of every
    address ordered stayed for the life of the process, still naming the lanes that touched them."""
    model_a, w = producer()
    a, b = session(model_a), session(consumer((2, 16)))
    device = device_of(a)
    blocks = [RawMemory(device, 512) for _ in range(10)]

    def remembered() -> tuple[int, int, int, int]:
        gc.collect()  # earlier tests' garbage, freed whenever a collection runs, would shrink the tables mid-loop
        return len(device._marks), len(device._homes), len(device._loose), len(device._lent)  # noqa: SLF001

    start = None  # after the first round, which allocates what the sessions keep
    for step, memory in enumerate(blocks):
        kept = a.device_io_binding(ort.ExternalMemorySpec.output("h", np.float32, SHAPE, SHAPE, memory.ptr,
                                                                 memory.nbytes))
        x = _feed(step)
        a.run_with_device_bindings([kept], input_feed={"x": x}, output_names=[])
        z = _consume(b, ort.Tensor(ort.DataType.FLOAT, (2, 16), kept.buffer.alias(128, 128), kept.allocator))
        np.testing.assert_allclose(z.numpy(), np.tanh(np.maximum(x.astype(np.float64) @ w, 0)[2:] + BIAS),
                                   rtol=1e-5, atol=1e-6)
        z.close()
        kept.close()
        start = remembered() if start is None else start
        assert remembered() == start, (step, start, remembered())
    assert not device._lent  # noqa: SLF001
    for memory in blocks:
        memory.close()


# -- device graphs that reach another session's memory ------------------------------------------------------------
@only_simulated
def test_a_replay_that_writes_a_buffer_another_session_reads_waits_for_the_read(deferred):
    """Session B's captured decode-like step ends with an epilogue that copies its output into a scratch binding
    (inside the graph). Session A reads that scratch after each step; B's next step must not overwrite it before
    A's queued read ran. The per-run ordering names only B's feeds and bound outputs, not the epilogue's scratch:
    the graph's own record of it orders each replay after A's read (before, A read the next step's value)."""
    a, b = session(consumer()), session(consumer(), capture=True)
    state = b.device_io_binding(ort.DeviceBindingSpec.input("h", np.float32, SHAPE))
    out = b.device_io_binding(ort.DeviceBindingSpec.output("z", np.float32, SHAPE))
    scratch = b.device_io_binding(ort.DeviceBindingSpec.scratch("s", np.float32, SHAPE))
    nbytes = scratch.nbytes
    epilogue = StepEpilogue(lambda: out.snapshot_device_into(scratch, nbytes),
                            ("copy", out.device_ptr, scratch.device_ptr, nbytes), (scratch,))
    view = ort.Tensor(ort.DataType.FLOAT, SHAPE, scratch.buffer.alias(0, nbytes), scratch.allocator)
    pending = None
    for step in range(6):
        x = _feed(10 + step)
        state.write_logical(x)
        b.run_with_device_bindings([state, out], output_names=[], epilogue=epilogue)
        np.testing.assert_allclose(out.read_logical(), np.tanh(x.astype(np.float64) + BIAS), rtol=1e-5, atol=1e-6)
        if pending is not None:  # A's read of the previous step's scratch, queued before this step ran
            got, previous = pending
            np.testing.assert_allclose(got.numpy(), np.tanh(np.tanh(previous + BIAS) + BIAS), rtol=1e-5, atol=1e-6)
            got.close()
        pending = (_consume(a, view), x.astype(np.float64))
    assert b._executor.graphs.counts["captures"] == 1  # noqa: SLF001 - the runner's counts
    assert b.device_graph_status() == "replaying"
    pending[0].close()
    for binding in (state, out, scratch):
        binding.close()


def test_freeing_memory_another_sessions_graph_recorded_resets_that_graph():
    """B captures a run that reads A's tensor in place. A frees the tensor: B's graph is reset (not left to replay
    on memory the pool hands out again), and B's next runs on a new tensor capture afresh and are right."""
    model_a, w = producer()
    a, b = session(model_a), session(consumer(), capture=True)
    handle_a = a.provider_handle(CUDA)
    x = _feed(3)
    produced = ort.Tensor.from_numpy(np.maximum(x @ w, 0).astype(np.float32), provider=handle_a)
    for _ in range(3):
        z = _consume(b, produced)
        np.testing.assert_allclose(z.numpy(), np.tanh(np.maximum(x.astype(np.float64) @ w, 0) + BIAS), rtol=1e-5,
                                   atol=1e-6)
        z.close()
    graphs = b._executor.graphs  # noqa: SLF001 - the runner and its entries
    assert graphs.counts["captures"] == 1 and b.device_graph_status() == "replaying"
    (entry,) = graphs._entries[ort.DeviceGraphSlot.PRIMARY].values()  # noqa: SLF001
    handle_b = b.provider_handle(CUDA)
    assert handle_b.hook.has_owned_device_graph(token=entry.token)
    produced.close()  # A's free
    assert not handle_b.hook.has_owned_device_graph(token=entry.token)
    fresh = ort.Tensor.from_numpy(np.full(SHAPE, 0.25, np.float32), provider=handle_a)
    for _ in range(3):
        z = _consume(b, fresh)
        np.testing.assert_allclose(z.numpy(), np.tanh(0.25 + BIAS.astype(np.float64))[None].repeat(4, 0),
                                   rtol=1e-5, atol=1e-6)
        z.close()
    assert graphs.counts["captures"] == 2 and b.device_graph_status() == "replaying"
    fresh.close()


class _ResetBeforeReplay:
    """On B's handle: the first replay finds its graph reset just before it launches, as a free of memory it
    recorded does from another thread between the runner's check and its launch."""

    def __init__(self, provider):
        self.provider, self.fired = provider, False

    @ort.hookimpl(tryfirst=True)
    def replay_owned_device_graph(self, token):
        if not self.fired:
            self.fired = True
            self.provider.device_graphs().reset(token)


def test_a_graph_reset_between_the_check_and_the_launch_runs_eagerly():
    """The run whose graph another thread reset after the runner's check runs eagerly with the right result (before,
    it raised the stale token's error to the caller), and the next runs capture afresh."""
    a, b = session(consumer()), session(consumer(), capture=True)
    x = _feed(6)
    feed = ort.Tensor.from_numpy(x, provider=a.provider_handle(CUDA))
    want = np.tanh(np.tanh(x.astype(np.float64) + BIAS) + BIAS)
    middle = _consume(a, feed)  # A's output, read by B in place
    handle_b = b.provider_handle(CUDA)
    hooks = _ResetBeforeReplay(handle_b.provider)
    for step in range(7):
        if step == 3:
            handle_b.pm.register(hooks, name="reset-before-replay")
        z = _consume(b, middle)
        np.testing.assert_allclose(z.numpy(), want, rtol=1e-5, atol=1e-6)
        z.close()
    handle_b.pm.unregister(hooks)
    assert hooks.fired and b._executor.graphs.counts["captures"] == 2  # noqa: SLF001
    assert b.device_graph_status() == "replaying"
    for tensor in (middle, feed):
        tensor.close()


def test_a_free_of_memory_a_capture_in_progress_reads_waits_for_its_end():
    """B's capture copies from A's buffer; A's free of it during that capture is held until the capture ends (the
    graph would record freed memory), then the memory is freed and B's new graph reset: its token no longer
    replays. (test_streams_session_sync_cuda covers the free from another thread and the counts.)"""
    from onnx_runtime import DeviceGraphOwner, DeviceGraphSlot, ProviderHandle
    from onnx_runtime_ep_cuda import CUDAExecutionProvider

    a, b = ProviderHandle(CUDAExecutionProvider()), ProviderHandle(CUDAExecutionProvider())
    a.initialize({})
    b.initialize({})
    source, target = a.allocate(256, 256), b.allocate(256, 256)
    a.provider.fill(source, 3)
    token = b.hook.begin_owned_device_graph_capture(owner=DeviceGraphOwner.new(), slot=DeviceGraphSlot.PRIMARY,
                                                    continuation=None, kernels=[])
    b.hook.copy_device_to_device(src=source, src_offset=0, dst=target, dst_offset=0, nbytes=256)
    a.deallocate(source)
    b.hook.end_owned_device_graph_capture(token=token)
    assert not b.hook.has_owned_device_graph(token=token)
    with pytest.raises(InvalidArgumentError, match="does not name an installed graph"):
        b.hook.replay_owned_device_graph(token=token)
    b.deallocate(target)
    a.shutdown()
    b.shutdown()
