"""Per-session CUDA streams, the host side (issue 21): a session's sync waits for its own lane and the lanes that
wrote its memory, not for every session's; a staged host copy takes a free staging block rather than waiting for
another lane's copy; ending a borrow waits for the lanes that touched the memory; external memory bound inside a
live allocation is ordered as that allocation; and a free of memory a capture in progress reached is deferred to
the end of that capture (its graph reset, the memory freed once) instead of refused.

The simulator's deferred mode runs a stream's work only when something waits for it: a stream still holding
queued work after another session's sync shows that the sync did not wait for it, and a missing wait shows as a
wrong result.
"""

from __future__ import annotations

import ctypes
import os
import threading

import numpy as np
import onnx_runtime as ort
import pytest
from onnx_runtime.errors import InvalidArgumentError
from test_streams_lent_memory_cuda import BIAS, SHAPE, RawMemory, _consume, _feed, consumer, producer, session

cu = pytest.importorskip("onnx_runtime_ep_cuda.sim.driver", reason="the CUDA provider is not installed")

SIMULATED = os.environ.get("ONNX_RUNTIME_CUDA_TESTS", "").lower() != "real"
only_simulated = pytest.mark.skipif(not SIMULATED, reason="deferred execution is the simulator's")


@pytest.fixture(autouse=True)
def mode(cuda_driver_mode):
    pass


@pytest.fixture
def handles():
    """Five initialized CUDA provider instances (five lanes), shut down after the test."""
    from onnx_runtime import ProviderHandle
    from onnx_runtime_ep_cuda import CUDAExecutionProvider

    made = [ProviderHandle(CUDAExecutionProvider()) for _ in range(5)]
    for handle in made:
        handle.initialize({})
    yield made
    for handle in made:
        handle.shutdown()


def _queued(handle) -> bool:
    (status,) = cu.cuStreamQuery(handle.provider.cuda_device().compute)
    return status == cu.CUresult.CUDA_ERROR_NOT_READY


def _counted(device):
    from onnx_runtime_ep_cuda.driver_counts import CountingDriver

    counting = CountingDriver(device.driver)
    device.driver = counting
    return counting


# -- a session's sync ---------------------------------------------------------------------------------------------
@only_simulated
def test_a_sessions_sync_leaves_other_sessions_work_queued(deferred, handles):
    """A's sync is one stream synchronization (its compute stream; nothing was queued on its transfer stream), and
    the work other sessions queued is still queued after it; before, it synchronized both streams of every lane
    of the device and ran everybody's work."""
    a, *others = handles
    buffers = [h.allocate(256, 256) for h in handles]
    for handle, buffer in zip(handles, buffers, strict=True):
        handle.provider.fill(buffer, 5)
    device = a.provider.cuda_device().shared
    plain = device.driver
    counting = _counted(device)
    try:
        a.sync()
    finally:
        device.driver = plain
    assert counting.calls.get("cuStreamSynchronize", 0) == 1, counting.calls
    assert not _queued(a)
    assert all(_queued(h) for h in others)
    for handle, buffer in zip(handles, buffers, strict=True):
        handle.deallocate(buffer)


@only_simulated
def test_a_sessions_sync_waits_for_another_lanes_write_into_its_memory(deferred, handles):
    """B fills A's buffer (queued on B's stream); A's sync makes the bytes visible on the host (what a DLPack
    consumer reads) and still leaves C's unrelated work queued: A waited for the lane that wrote its memory, and
    only for it."""
    a, b, c = handles[:3]
    mine, theirs = a.allocate(256, 256), c.allocate(256, 256)
    c.provider.fill(theirs, 1)
    b.provider.fill(mine, 9)
    a.sync()
    assert ctypes.string_at(mine.ptr, 256) == bytes([9]) * 256
    assert _queued(c) and not _queued(b)
    before = a.provider.cuda_device().shared.ordered_waits
    a.sync()  # that write was waited for: no second wait
    assert a.provider.cuda_device().shared.ordered_waits == before
    a.deallocate(mine)
    c.deallocate(theirs)


def test_eight_sessions_on_eight_threads_each_sync_only_their_own_stream():
    """Eight sessions, a thread each, run a device-resident step (input and output on the device) and synchronize
    their outputs after every step: each synchronization is one stream synchronization of the session's own lane
    (before, two per lane of the device for every one), and every result is right."""
    steps, count = 5, 8
    sessions = [session(consumer()) for _ in range(count)]
    feeds = [_feed(60 + k) for k in range(count)]
    bindings = []
    for sess, x in zip(sessions, feeds, strict=True):
        handle = sess.provider_handle("CUDAExecutionProvider")
        binding = sess.io_binding()
        binding.bind_ortvalue_input("h", ort.OrtValue(ort.Tensor.from_numpy(x, provider=handle)))
        binding.bind_output("z", "cuda")
        sess.run_with_iobinding(binding)  # warm: constants uploaded, kernels built
        binding.synchronize_outputs()
        bindings.append(binding)
    device = sessions[0].provider_handle("CUDAExecutionProvider").provider.cuda_device().shared
    barrier = threading.Barrier(count)

    def work(index: int) -> None:
        barrier.wait()
        for _ in range(steps):
            sessions[index].run_with_iobinding(bindings[index])
            bindings[index].synchronize_outputs()

    plain = device.driver
    counting = _counted(device)
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        device.driver = plain
    assert counting.calls.get("cuStreamSynchronize", 0) == count * steps, counting.calls
    for binding, x in zip(bindings, feeds, strict=True):
        (z,) = binding.copy_outputs_to_cpu()
        np.testing.assert_allclose(z, np.tanh(x.astype(np.float64) + BIAS), rtol=1e-5, atol=1e-6)


@only_simulated
def test_a_staged_read_takes_a_free_block_instead_of_waiting_for_another_lane(deferred, handles):
    """B's upload holds a staging block whose copy is still queued on B's stream; A's downloads take a block whose
    copy is complete, so B's work stays queued and A's reads are right; before, A took the ring's next block and
    waited for B's copy (running B's stream)."""
    a, b = handles[:2]
    mine, theirs = a.allocate(256, 256), b.allocate(256, 256)
    a.provider.fill(mine, 4)
    b.copy_from_host(np.full(256, 2, np.uint8), theirs)
    out = np.empty(256, np.uint8)
    for _ in range(6):  # more reads than the ring has blocks
        a.copy_to_host(mine, out)
        assert (out == 4).all()
    assert _queued(b)
    b.copy_to_host(theirs, out)
    assert (out == 2).all()
    a.deallocate(mine)
    b.deallocate(theirs)


@only_simulated
@pytest.mark.parametrize("blocks", [1.5, 5.25], ids=["within-the-ring", "past-the-ring"])
def test_a_large_async_download_is_staged_and_returns_before_the_copy_ran(deferred, handles, blocks):
    """copy_async into a host array larger than a staging block goes through pinned blocks, a chunk each: it returns
    with the copy (past a whole ring, its last chunks) still queued on the lane's transfer stream, and the array
    holds the bytes after the lane's sync. Before, a download larger than a block went to pageable memory, which a
    GPU copies synchronously (the simulator ran the stream at once)."""
    a = handles[0]
    lane = a.provider.cuda_device()
    block = lane.shared.staging.block_bytes
    count = int(blocks * block) // 4 + 3
    source = np.arange(count, dtype=np.float32)
    buffer = a.allocate(source.nbytes, 256)
    a.copy_from_host(source.view(np.uint8), buffer)
    lane.sync()
    out = np.zeros(count, np.float32)
    lane.copy_async(out.view(np.uint8), buffer.ptr, out.nbytes)
    (status,) = cu.cuStreamQuery(lane.transfer)
    assert status == cu.CUresult.CUDA_ERROR_NOT_READY  # past the ring: its last chunks are still queued
    a.sync()
    np.testing.assert_array_equal(out, source)
    assert lane.shared.staging.allocated <= 4
    a.deallocate(buffer)


@only_simulated
def test_too_many_live_fences_wait_for_the_lane_that_holds_them(deferred, handles):
    """A lane records fences far ahead of its queued work: once the device holds over a thousand live events and
    none has completed, it synchronizes the lane holding them, not every lane (B's queued work stays queued), and
    the event count stays bounded. Before, it synchronized every lane of the device."""
    a, b = handles[:2]
    lane = a.provider.cuda_device()
    mine, theirs = a.allocate(256, 256), b.allocate(256, 256)
    b.provider.fill(theirs, 1)
    a.provider.fill(mine, 2)
    for _ in range(1100):
        lane.record_compute_fence()
    assert len(lane.shared._events) <= 1025  # noqa: SLF001
    assert _queued(b)
    a.deallocate(mine)
    b.deallocate(theirs)


# -- borrowed memory --------------------------------------------------------------------------------------------
@only_simulated
def test_ending_a_borrow_waits_for_the_lanes_that_read_it(deferred):
    """A writes external memory it borrowed; B's read of it at an offset is still queued when A's binding is
    released. The caller may then overwrite the memory at once: the release waited for B's read (A's own sync no
    longer runs B's stream), so B's result is the value A wrote."""
    model_a, w = producer()
    a, b = session(model_a), session(consumer((2, 16)))
    device = a.provider_handle("CUDAExecutionProvider").provider.cuda_device().shared
    memory = RawMemory(device, 4 * 16 * 4)
    kept = a.device_io_binding(ort.ExternalMemorySpec.output("h", np.float32, SHAPE, SHAPE, memory.ptr,
                                                             memory.nbytes))
    x = _feed(2)
    a.run_with_device_bindings([kept], input_feed={"x": x}, output_names=[])
    z = _consume(b, ort.Tensor(ort.DataType.FLOAT, (2, 16), kept.buffer.alias(128, 128), kept.allocator))
    kept.close()
    ctypes.memset(memory.ptr, 0, memory.nbytes)  # the caller reuses its memory
    want = np.tanh(np.maximum(x.astype(np.float64) @ w, 0)[2:] + BIAS)
    np.testing.assert_allclose(z.numpy(), want, rtol=1e-5, atol=1e-6)
    z.close()
    memory.close()


# -- external memory inside a live allocation ---------------------------------------------------------------------
@only_simulated
def test_external_memory_inside_a_live_allocation_is_ordered_as_that_allocation(deferred):
    """A's bound output is a live allocation; B binds its last two rows as external memory (an address inside it).
    B's read waits for A's write of the whole, and A's read of the whole waits for B's write through the external
    binding; no loan is made for memory an allocation already holds. Before, the inner address was a memory of its
    own, homed on B: B read it unwritten, and A read it before B wrote it."""
    model_a, w = producer()
    a = session(model_a)
    device = a.provider_handle("CUDAExecutionProvider").provider.cuda_device().shared
    kept = a.device_io_binding(ort.DeviceBindingSpec.output("h", np.float32, SHAPE))
    x = _feed(3)
    a.run_with_device_bindings([kept], input_feed={"x": x}, output_names=[])
    reader = session(consumer((2, 16)))
    rows = reader.device_io_binding(ort.ExternalMemorySpec.input("h", None, np.float32, (2, 16), (2, 16),
                                                                 kept.device_ptr + 128, 128))
    out = reader.device_io_binding(ort.DeviceBindingSpec.output("z", np.float32, (2, 16)))
    assert not device._lent  # noqa: SLF001 - part of A's allocation, not a loan
    reader.run_with_device_bindings([rows, out], output_names=[])
    h = np.maximum(x.astype(np.float64) @ w, 0)
    np.testing.assert_allclose(out.read_logical(), np.tanh(h[2:] + BIAS), rtol=1e-5, atol=1e-6)

    writer = session(consumer((2, 16)))
    into = writer.device_io_binding(ort.ExternalMemorySpec.output("z", np.float32, (2, 16), (2, 16),
                                                                  kept.device_ptr + 128, 128))
    y = _feed(4)[:2]
    writer.run_with_device_bindings([into], input_feed={"h": y}, output_names=[])
    got = kept.read_logical()
    np.testing.assert_allclose(got[:2], h[:2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[2:], np.tanh(y.astype(np.float64) + BIAS), rtol=1e-5, atol=1e-6)
    for binding in (into, out, rows, kept):
        binding.close()
    assert not device._lent  # noqa: SLF001


@only_simulated
def test_external_memory_inside_a_reserved_allocation_is_ordered_as_that_allocation(deferred, handles):
    """B borrows an address inside A's reserved (mapped-growth) allocation, a KV cache's kind, and copies from it
    while A's fill of the allocation is still queued: B waits for A's write, and no loan is made. Before, the inner
    address was a loan homed on B, and B copied the bytes before A wrote them."""
    from onnx_runtime_ep_cuda.vmm import granularity

    a, b = handles[:2]
    device = a.provider.cuda_device().shared
    reserved = a.hook.allocate_committed(size=4 * granularity(a.provider.cuda_device()), alignment=256,
                                         committed_ranges=[(0, 4096)])
    a.provider.fill(reserved, 5, 0, 4096)
    inner = ort.DeviceBuffer(a.device_id, 256, 256, reserved.ptr + 512, ort.Ownership.BORROWED_MUT)
    b.hook.borrow_device_memory(buffer=inner)
    assert not device._lent  # noqa: SLF001
    target = b.allocate(256, 256)
    b.hook.copy_device_to_device(src=inner, src_offset=0, dst=target, dst_offset=0, nbytes=256)
    out = np.empty(256, np.uint8)
    b.copy_to_host(target, out)
    assert (out == 5).all()
    b.hook.return_device_memory(buffer=inner)
    b.deallocate(target)
    a.deallocate(reserved)
    assert not device._ranges  # noqa: SLF001 - forgotten with the allocation


# -- a free during a capture that reached the memory ----------------------------------------------------------------
def _capture_pair():
    from onnx_runtime import ProviderHandle
    from onnx_runtime_ep_cuda import CUDAExecutionProvider

    a, b = ProviderHandle(CUDAExecutionProvider()), ProviderHandle(CUDAExecutionProvider())
    a.initialize({})
    b.initialize({})
    return a, b


def _begin(b):
    from onnx_runtime import DeviceGraphOwner, DeviceGraphSlot

    return b.hook.begin_owned_device_graph_capture(owner=DeviceGraphOwner.new(), slot=DeviceGraphSlot.PRIMARY,
                                                   continuation=None, kernels=[])


def test_a_free_on_the_capturing_thread_waits_for_the_end_of_the_capture():
    """B's capture copies from A's buffer, and the capturing thread frees that buffer before ending the capture:
    the free is held until the capture's graph is recorded, then the memory is freed once and B's new graph (which
    recorded the address) is reset, so it never replays on freed memory. Before, the free was refused with a typed
    error."""
    a, b = _capture_pair()
    device = a.provider.cuda_device().shared
    source, target = a.allocate(256, 256), b.allocate(256, 256)
    a.provider.fill(source, 3)
    frees, base, target_base = device.frees, source.provider_state, target.provider_state
    token = _begin(b)
    b.hook.copy_device_to_device(src=source, src_offset=0, dst=target, dst_offset=0, nbytes=256)
    a.deallocate(source)  # held: the capture recorded its address
    assert device.frees == frees and base in device._live  # noqa: SLF001
    b.hook.end_owned_device_graph_capture(token=token)
    assert device.frees == frees + 1 and base not in device._live  # noqa: SLF001
    assert not b.hook.has_owned_device_graph(token=token)
    with pytest.raises(InvalidArgumentError, match="does not name an installed graph"):
        b.hook.replay_owned_device_graph(token=token)
    b.deallocate(target)
    a.sync()
    b.sync()
    if SIMULATED:
        live = cu.live_allocations()
        assert base not in live and target_base not in live
    assert device.allocations - device.frees == len(device._live)  # noqa: SLF001 - every free counted once
    a.shutdown()
    b.shutdown()


def test_a_free_from_another_thread_during_a_capture_is_held_until_it_ends():
    """Thread 1 captures B reading A's buffer; thread 2 frees the buffer meanwhile: the free returns at once, the
    memory stays until thread 1 ends its capture, which then frees it once and resets the graph. A capture that
    did not reach the buffer would not hold it (checked with a second buffer, freed at once). Before, thread 2's
    free was refused."""
    a, b = _capture_pair()
    device = a.provider.cuda_device().shared
    source, other, target = a.allocate(256, 256), a.allocate(256, 256), b.allocate(256, 256)
    a.provider.fill(source, 6)
    frees, base = device.frees, source.provider_state
    capturing, freed = threading.Event(), threading.Event()
    tokens = []

    def capture() -> None:
        token = _begin(b)
        b.hook.copy_device_to_device(src=source, src_offset=0, dst=target, dst_offset=0, nbytes=256)
        capturing.set()
        assert freed.wait(10)
        b.hook.end_owned_device_graph_capture(token=token)
        tokens.append(token)

    worker = threading.Thread(target=capture)
    worker.start()
    assert capturing.wait(10)
    try:
        _free_during(a, device, source, other, base)
    finally:
        freed.set()
        worker.join(10)
    assert device.frees == frees + 2 and base not in device._live  # noqa: SLF001
    assert tokens and not b.hook.has_owned_device_graph(token=tokens[0])
    b.deallocate(target)
    assert device.allocations - device.frees == len(device._live)  # noqa: SLF001 - every free counted once
    a.shutdown()
    b.shutdown()


def _free_during(a, device, source, other, base) -> None:
    """On this thread, while another captures: ``other`` is freed at once, ``source`` (captured) is held."""
    frees = device.frees
    a.deallocate(other)
    assert device.frees == frees + 1
    a.deallocate(source)
    assert device.frees == frees + 1 and base in device._live  # noqa: SLF001


def _elsewhere(action) -> None:
    """Run ``action`` on another thread and wait for it: the thread that captures may not synchronize or release
    (an H200 refuses cuStreamSynchronize there), so another session's work during a capture comes from elsewhere."""
    failures = []

    def run():
        try:
            action()
        except BaseException as error:  # noqa: BLE001 - re-raised on the test's thread
            failures.append(error)

    worker = threading.Thread(target=run)
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "the other thread's work did not finish within 30 s"
    if failures:
        raise failures[0]


def test_ending_a_borrow_a_capture_reached_waits_for_the_end_of_the_capture(handles):
    """B's capture copies from memory A borrowed; A's binding is released meanwhile (the borrow returned): the loan
    is forgotten and B's new graph reset once the capture's graph is recorded. Before, the return was refused with
    a typed error (a DeviceIoBinding's release quarantined its memory with a warning)."""
    a, b = handles[:2]
    device = a.provider.cuda_device().shared
    memory = RawMemory(device, 256)
    lent = ort.DeviceBuffer(a.device_id, 256, 256, memory.ptr, ort.Ownership.BORROWED_MUT)
    a.hook.borrow_device_memory(buffer=lent)
    a.provider.fill(lent, 7)
    target = b.allocate(256, 256)
    token = _begin(b)
    b.hook.copy_device_to_device(src=lent, src_offset=64, dst=target, dst_offset=0, nbytes=128)

    def give_back():
        a.sync()
        a.hook.return_device_memory(buffer=lent)

    _elsewhere(give_back)
    assert memory.ptr in device._lent  # noqa: SLF001 - held until the graph is recorded
    b.hook.end_owned_device_graph_capture(token=token)
    assert memory.ptr not in device._lent  # noqa: SLF001
    assert not b.hook.has_owned_device_graph(token=token)
    b.deallocate(target)
    memory.close()


def test_a_reserved_release_a_capture_reached_waits_for_the_end_of_the_capture(handles):
    """B's capture copies from A's reserved (mapped-growth) allocation, and A releases it meanwhile: the unmap waits
    for the capture's graph to be recorded, which it resets. Before, the release was refused with a typed error."""
    from onnx_runtime_ep_cuda.vmm import MappedGrowthBuffer, granularity

    a, b = handles[:2]
    size = 4 * granularity(a.provider.cuda_device())
    reserved = a.hook.allocate_committed(size=size, alignment=256, committed_ranges=[(0, 256)])
    growth = reserved.provider_state
    assert isinstance(growth, MappedGrowthBuffer)
    a.provider.fill(reserved, 5, 0, 256)
    target = b.allocate(256, 256)
    token = _begin(b)
    b.hook.copy_device_to_device(src=reserved, src_offset=0, dst=target, dst_offset=0, nbytes=256)
    _elsewhere(lambda: a.deallocate(reserved))
    assert not growth._closed  # noqa: SLF001 - still mapped: the capture recorded its address
    b.hook.end_owned_device_graph_capture(token=token)
    assert growth._closed  # noqa: SLF001
    assert not b.hook.has_owned_device_graph(token=token)
    b.deallocate(target)


def test_a_session_run_survives_a_free_deferred_by_another_sessions_capture():
    """End to end: B (capturing) reads A's output in place; A frees that output while nothing captures, which resets
    B's graph; the next runs on a new output capture afresh and replay, with right results throughout."""
    model_a, w = producer()
    a, b = session(model_a), session(consumer(), capture=True)
    for step in range(3):
        (h,) = a.run(None, {"x": _feed(step)})
        produced = ort.Tensor.from_numpy(h, provider=a.provider_handle("CUDAExecutionProvider"))
        for _ in range(3):
            z = _consume(b, produced)
            np.testing.assert_allclose(z.numpy(), np.tanh(h.astype(np.float64) + BIAS), rtol=1e-5, atol=1e-6)
            z.close()
        produced.close()
    assert b.device_graph_status() == "replaying"
