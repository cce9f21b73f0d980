"""The contract's default fallbacks (onnx_runtime.contract.defaults) as a provider sees them through
ProviderHandle, the handle's ownership rules, plugin validation, and DataType byte math."""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import onnx_runtime as ort
import pytest
from onnx_runtime import (
    CaptureRegionShapeStatus,
    DeviceBuffer,
    DeviceGraphOwner,
    DeviceGraphSlot,
    DeviceGraphToken,
    DeviceId,
    DeviceType,
    DeviceValidationOwner,
    DeviceValidationRegistration,
    DeviceValidationToken,
    EpContext,
    Fence,
    KernelMatch,
    Ownership,
    ProviderHandle,
    StructuralCaptureDecline,
    hookimpl,
)
from onnx_runtime.contract import SIGNALLED, Availability
from onnx_runtime.dtypes import MAX_BYTES, DataType, checked_expected_bytes, checked_numel
from onnx_runtime.errors import (
    InvalidArgumentError,
    NotSupportedError,
    PluginError,
    ProviderError,
    ShapeOverflowError,
)
from onnx_runtime.ir import Node

PRIMARY, VERIFY = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY


# -- providers ----------------------------------------------------------------------------------------
class Tiny:
    @hookimpl
    def name(self):
        return "TinyExecutionProvider"


class Cuda:
    """A device provider with no memory hooks: every host-only default must refuse it."""

    @hookimpl
    def name(self):
        return "FakeCudaExecutionProvider"

    @hookimpl
    def device_type(self):
        return DeviceType.CUDA


class DeallocRecorder:
    def __init__(self):
        self.freed = []

    @hookimpl
    def name(self):
        return "RecExecutionProvider"

    @hookimpl
    def deallocate(self, buffer):
        self.freed.append(buffer)


class SelfAllocating:
    @hookimpl
    def name(self):
        return "SelfAllocExecutionProvider"

    @hookimpl
    def allocate(self, size, alignment):
        arr = np.zeros(max(size, 1), np.uint8)
        return DeviceBuffer(ort.DeviceId.cpu(), size, 1, arr.ctypes.data, Ownership.OWNED, host=arr)


class GraphRecorder:
    """Implements the single-slot graph hooks and records every call."""

    def __init__(self):
        self.calls = []

    @hookimpl
    def name(self):
        return "GraphExecutionProvider"

    @hookimpl
    def begin_device_graph_capture(self, kernels):
        self.calls.append(("begin", list(kernels)))

    @hookimpl
    def end_device_graph_capture(self):
        self.calls.append(("end",))

    @hookimpl
    def abort_device_graph_capture(self):
        self.calls.append(("abort",))

    @hookimpl
    def replay_device_graph(self):
        self.calls.append(("replay",))

    @hookimpl
    def replay_device_graph_segment(self, index):
        self.calls.append(("segment", index))

    @hookimpl
    def reset_device_graph(self):
        self.calls.append(("reset",))
        return True


def tiny() -> ProviderHandle:
    return ProviderHandle(Tiny())


def host_buffer(handle, data: bytes) -> DeviceBuffer:
    buf = handle.allocate(len(data))
    handle.copy_from_host(data, buf)
    return buf


def content(handle, buf) -> bytes:
    return handle.download(buf).tobytes()


def cuda_buffer(size: int = 16) -> DeviceBuffer:
    return DeviceBuffer(DeviceId(DeviceType.CUDA, 0), size, 256, 0x7F0000001000)


# -- identity -----------------------------------------------------------------------------------------
def test_identity_defaults():
    h = tiny()
    assert h.name == "TinyExecutionProvider"
    assert h.short_name == "tiny" == h.hook.short_name()
    assert h.device_type is DeviceType.CPU
    assert h.device_id == DeviceId(DeviceType.CPU, 0)
    assert h.is_host_accessible
    assert h.matches("tiny") and h.matches("TINYExecutionProvider") and not h.matches("cpu")
    assert h.availability() == Availability.yes()


def test_short_name_of_a_bare_name_falls_back_to_the_name():
    class Bare:
        @hookimpl
        def name(self):
            return "ExecutionProvider"

    assert ProviderHandle(Bare()).short_name == "ExecutionProvider"


def test_device_id_default_follows_device_type():
    h = ProviderHandle(Cuda())
    assert h.device_type is DeviceType.CUDA
    assert h.device_id == DeviceId(DeviceType.CUDA, 0)
    assert not h.is_host_accessible


def test_failing_availability_probe_is_reported_not_raised():
    class Broken(Tiny):
        @hookimpl
        def availability(self):
            raise RuntimeError("libfoo.so missing")

    result = ProviderHandle(Broken()).availability()
    assert not result.available and "libfoo.so missing" in result.reason


# -- lifecycle ---------------------------------------------------------------------------------------
def test_initialize_accepts_no_options_by_default():
    h = tiny()
    h.initialize({})
    assert h.initialized
    h.shutdown()
    assert not h.initialized


def test_initialize_rejects_unknown_options_naming_them():
    h = tiny()
    with pytest.raises(InvalidArgumentError) as info:
        h.initialize({"tiny.zeta": 1, "tiny.alpha": "x"})
    message = str(info.value)
    assert "TinyExecutionProvider" in message and "tiny.alpha" in message and "tiny.zeta" in message
    assert not h.initialized


# -- capability -------------------------------------------------------------------------------------------
def test_supports_op_default_is_unsupported_with_reason():
    node = Node("Relu", ["x"], ["y"], name="r")
    match = tiny().supports_op(node, 18, [(2,)], [DataType.FLOAT], [ort.TensorLayout.default()])
    assert isinstance(match, KernelMatch) and not match
    assert "TinyExecutionProvider" in match.reason and "supports_op" in match.reason


def test_supports_op_returning_a_non_kernelmatch_is_a_provider_error():
    class Sloppy(Tiny):
        @hookimpl
        def supports_op(self, node):
            return True

    with pytest.raises(ProviderError, match="KernelMatch"):
        ProviderHandle(Sloppy()).supports_op(Node("Relu", ["x"], ["y"]), 18, [None], [None], [None])


def test_get_kernel_default_raises_naming_provider_and_op():
    with pytest.raises(NotSupportedError, match="TinyExecutionProvider") as info:
        tiny().hook.get_kernel(node=Node("Gemm", ["a", "b"], ["c"]), shapes=[(1,), (1,)], opset=18, graph=None)
    assert "Gemm" in str(info.value) and "get_kernel" in str(info.value)


def test_list_defaults_are_empty():
    h = tiny()
    assert h.hook.claim_nodes(graph=None) == []
    assert h.hook.custom_passes() == []
    assert h.hook.context_source_keys() == []


# -- memory ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alignment", [1, 2, 8, 64, 256, 4096])
@pytest.mark.parametrize("size", [0, 1, 100, 4097])
def test_host_allocate_is_aligned(size, alignment):
    h = tiny()
    buf = h.allocate(size, alignment)
    assert buf.ptr % alignment == 0
    assert buf.size == size and buf.alignment == alignment
    assert buf.ownership is Ownership.OWNED and not buf.is_borrowed
    assert buf.device == h.device_id
    assert buf.host_view().size == size
    assert buf.host.ctypes.data == buf.ptr


@pytest.mark.parametrize("alignment", [0, 3, 48, -8])
def test_allocate_rejects_non_power_of_two_alignment(alignment):
    with pytest.raises(InvalidArgumentError, match="power of two"):
        tiny().allocate(16, alignment)


def test_allocate_rejects_negative_size():
    with pytest.raises(InvalidArgumentError, match="non-negative"):
        tiny().allocate(-1)


def test_allocation_counts():
    h = tiny()
    assert h.allocation_counts() == (0, 0)
    bufs = [h.allocate(8) for _ in range(3)]
    h.hook.allocate_committed(size=32, alignment=8, committed_ranges=[(0, 8)])
    h.deallocate(bufs[0])
    h.deallocate(bufs[2])
    assert h.allocation_counts() == (4, 2)
    h.deallocate(bufs[1].alias())  # a borrowed alias is not a free
    assert h.allocation_counts() == (4, 2)


def test_allocation_counts_none_when_provider_allocates():
    h = ProviderHandle(SelfAllocating())
    h.deallocate(h.allocate(8))
    assert h.allocation_counts() is None


def test_allocation_counts_none_when_provider_frees():
    h = ProviderHandle(DeallocRecorder())
    h.deallocate(h.allocate(8))
    assert h.allocation_counts() is None


def test_allocate_committed_validates_ranges():
    h = tiny()
    buf = h.hook.allocate_committed(size=64, alignment=16, committed_ranges=[(0, 16), (32, 64), (64, 64)])
    assert buf.size == 64 and buf.ptr % 16 == 0
    assert h.hook.allocate_committed(size=8, alignment=8, committed_ranges=None).size == 8
    for bad in [(-1, 4), (8, 4), (0, 65), (65, 70)]:
        with pytest.raises(InvalidArgumentError, match=f"{bad[0]}\\.\\.{bad[1]}") as info:
            h.hook.allocate_committed(size=64, alignment=16, committed_ranges=[(0, 8), bad])
        assert "TinyExecutionProvider" in str(info.value)
    assert h.allocation_counts() == (2, 0)  # rejected requests allocated nothing


def test_commit_ranges_are_bounds_checked():
    h = tiny()
    buf = h.allocate(32)
    assert h.hook.commit_allocation_range(buffer=buf, offset=0, nbytes=32) is None
    assert h.hook.commit_allocation_range(buffer=buf, offset=32, nbytes=0) is None
    with pytest.raises(InvalidArgumentError, match="0..33"):
        h.hook.commit_allocation_range(buffer=buf, offset=0, nbytes=33)
    with pytest.raises(InvalidArgumentError, match="negative"):
        h.hook.commit_allocation_range(buffer=buf, offset=-1, nbytes=4)
    h.hook.commit_allocation_ranges(ranges=[(buf, 0, 8), (buf, 8, 24)])
    with pytest.raises(InvalidArgumentError, match="24..40"):
        h.hook.commit_allocation_ranges(ranges=[(buf, 0, 8), (buf, 24, 16)])
    assert h.hook.allocation_committed_bytes(buffer=buf) == 32


# -- copies ----------------------------------------------------------------------------------------------------
def test_copy_and_bounds():
    h = tiny()
    src, dst = host_buffer(h, bytes(range(16))), host_buffer(h, bytes(16))
    h.hook.copy(src=src, dst=dst, size=10)
    assert content(h, dst) == bytes(range(10)) + bytes(6)
    small = h.allocate(4)
    for a, b in [(src, small), (small, dst)]:
        with pytest.raises(InvalidArgumentError, match="exceeds"):
            h.hook.copy(src=a, dst=b, size=8)
    with pytest.raises(InvalidArgumentError, match="non-negative"):
        h.hook.copy(src=src, dst=dst, size=-1)
    assert content(h, dst) == bytes(range(10)) + bytes(6)


def test_copy_async_returns_signalled_fence():
    h = tiny()
    src, dst = host_buffer(h, b"abcdefgh"), h.allocate(8)
    fence = h.hook.copy_async(src=src, dst=dst, size=8)
    assert isinstance(fence, Fence) and fence.is_signalled and fence.id == 0 and fence == SIGNALLED
    assert content(h, dst) == b"abcdefgh"
    with pytest.raises(InvalidArgumentError, match="exceeds"):
        h.hook.copy_async(src=src, dst=dst, size=9)


def test_copy_from_host_accepts_bytes_like_and_arrays():
    h = tiny()
    buf = h.allocate(16)
    h.copy_from_host(b"\x01\x02", buf)
    h.copy_from_host(memoryview(bytearray(b"\x07")), buf)
    assert content(h, buf)[:2] == b"\x07\x02"
    h.copy_from_host(np.arange(4, dtype=np.int32), buf)
    assert np.array_equal(h.download(buf).view(np.int32), np.arange(4, dtype=np.int32))


def test_copy_from_host_bounds_and_empty_source():
    h = tiny()
    buf = host_buffer(h, b"12345678")
    with pytest.raises(InvalidArgumentError, match="9 bytes exceeds the destination's 8"):
        h.copy_from_host(b"x" * 9, buf)
    h.copy_from_host(b"", buf)
    assert content(h, buf) == b"12345678"
    with pytest.raises(InvalidArgumentError, match="C-contiguous"):
        h.copy_from_host(np.arange(8, dtype=np.uint8)[::2], buf)


def test_copy_from_host_at():
    h = tiny()
    buf = host_buffer(h, b"........")
    h.hook.copy_from_host_at(src=b"ab", dst=buf, byte_offset=3)
    h.hook.copy_from_host_at(src=b"z", dst=buf, byte_offset=7)
    assert content(h, buf) == b"...ab..z"


@pytest.mark.parametrize(("data", "offset", "pattern"), [
    (b"abc", sys.maxsize, "exceeds"),  # offset + len past any address: overflow is not a wrap-around
    (b"abc", 6, "6..9 exceeds the 8-byte"),
    (b"x" * 9, 0, "0..9"),
    (b"a", -1, "negative"),
    (b"", 9, "9..9"),  # an empty source still needs an in-range offset
])
def test_copy_from_host_at_rejects(data, offset, pattern):
    h = tiny()
    buf = host_buffer(h, b"........")
    with pytest.raises(InvalidArgumentError, match=pattern):
        h.hook.copy_from_host_at(src=data, dst=buf, byte_offset=offset)
    assert content(h, buf) == b"........"


def test_copy_from_host_at_empty_source_at_end_is_a_noop():
    h = tiny()
    buf = host_buffer(h, b"abcd")
    assert h.hook.copy_from_host_at(src=b"", dst=buf, byte_offset=4) is None
    assert content(h, buf) == b"abcd"


def test_copy_to_host():
    h = tiny()
    buf = host_buffer(h, b"abcdefgh")
    out = bytearray(5)
    h.copy_to_host(buf, out)
    assert bytes(out) == b"abcde"
    arr = np.zeros(8, np.uint8)
    h.copy_to_host(buf, arr)
    assert arr.tobytes() == b"abcdefgh"
    h.copy_to_host(buf, bytearray())
    with pytest.raises(InvalidArgumentError, match="9 bytes exceeds the source's 8"):
        h.copy_to_host(buf, bytearray(9))
    with pytest.raises(InvalidArgumentError, match="read-only"):
        h.copy_to_host(buf, b"\0" * 4)


def test_copy_device_to_device():
    h = tiny()
    src, dst = host_buffer(h, b"0123456789"), host_buffer(h, b"----------")
    h.hook.copy_device_to_device(src=src, src_offset=2, dst=dst, dst_offset=5, nbytes=4)
    assert content(h, dst) == b"-----2345-"
    h.hook.copy_device_to_device(src=src, src_offset=0, dst=src, dst_offset=2, nbytes=6)  # overlap: memmove
    assert content(h, src) == b"0101234589"


@pytest.mark.parametrize(("src_offset", "dst_offset", "nbytes", "pattern"), [
    (7, 0, 4, "source range 7..11"),
    (0, 8, 3, "destination range 8..11"),
    (-1, 0, 1, "negative"),
    (0, 0, -1, "negative"),
])
def test_copy_device_to_device_bounds(src_offset, dst_offset, nbytes, pattern):
    h = tiny()
    src, dst = host_buffer(h, b"0123456789"), host_buffer(h, b"----------")
    with pytest.raises(InvalidArgumentError, match=pattern):
        h.hook.copy_device_to_device(src=src, src_offset=src_offset, dst=dst, dst_offset=dst_offset, nbytes=nbytes)
    assert content(h, dst) == b"----------"


@pytest.mark.parametrize("write", [
    lambda h, src, ro: h.copy_from_host(b"xy", ro),
    lambda h, src, ro: h.hook.copy_from_host_at(src=b"xy", dst=ro, byte_offset=1),
    lambda h, src, ro: h.hook.copy(src=src, dst=ro, size=2),
    lambda h, src, ro: h.hook.copy_async(src=src, dst=ro, size=2),
    lambda h, src, ro: h.hook.copy_device_to_device(src=src, src_offset=0, dst=ro, dst_offset=0, nbytes=2),
], ids=["copy_from_host", "copy_from_host_at", "copy", "copy_async", "copy_device_to_device"])
def test_writing_into_read_only_borrowed_buffer_is_rejected(write):
    h = tiny()
    owner, src = host_buffer(h, b"abcd"), host_buffer(h, b"WXYZ")
    ro = owner.alias()
    assert ro.ownership is Ownership.BORROWED
    with pytest.raises(InvalidArgumentError, match="read-only borrowed"):
        write(h, src, ro)
    assert content(h, owner) == b"abcd"


def test_writable_borrowed_buffer_accepts_writes():
    h = tiny()
    owner = host_buffer(h, b"abcd")
    rw = owner.alias(offset=1, size=2, writable=True)
    h.copy_from_host(b"XY", rw)
    assert content(h, owner) == b"aXYd"


def test_copies_from_or_into_a_freed_buffer_are_rejected():
    h = tiny()
    live, freed = host_buffer(h, b"abcd"), host_buffer(h, b"efgh")
    h.deallocate(freed)
    with pytest.raises(InvalidArgumentError, match="already freed"):
        h.hook.copy(src=freed, dst=live, size=4)
    with pytest.raises(InvalidArgumentError, match="already freed"):
        h.copy_to_host(freed, bytearray(4))
    with pytest.raises(InvalidArgumentError, match="already freed"):
        h.copy_from_host(b"zz", freed)
    assert content(h, live) == b"abcd"


# -- deallocate ----------------------------------------------------------------------------------------------
def test_deallocate_frees_exactly_once():
    rec = DeallocRecorder()
    h = ProviderHandle(rec)
    buf = h.allocate(16)
    h.deallocate(buf)
    assert buf.released and buf.host is None
    assert rec.freed == [buf]
    with pytest.raises(InvalidArgumentError, match="already freed"):
        h.deallocate(buf)
    assert rec.freed == [buf]


def test_borrowed_buffers_never_reach_the_deallocate_hook():
    rec = DeallocRecorder()
    h = ProviderHandle(rec)
    owner = host_buffer(h, b"abcdefgh")
    ro, rw = owner.alias(), owner.alias(offset=4, writable=True)
    h.deallocate(ro)
    h.deallocate(rw)
    assert rec.freed == []
    assert ro.released and rw.released
    with pytest.raises(InvalidArgumentError, match="already freed"):
        h.deallocate(ro)
    assert content(h, owner) == b"abcdefgh"  # the owner is untouched by releasing its aliases
    foreign = DeviceBuffer.from_host_array(np.ones(4, np.float32), DeviceId(DeviceType.CPU, 3), Ownership.BORROWED)
    h.deallocate(foreign)
    assert rec.freed == []
    h.deallocate(owner)
    assert rec.freed == [owner]


def test_deallocate_refuses_a_buffer_of_another_device():
    rec = DeallocRecorder()
    h = ProviderHandle(rec)
    other = DeviceBuffer.from_host_array(np.zeros(8, np.uint8), DeviceId(DeviceType.CPU, 1), Ownership.OWNED)
    with pytest.raises(InvalidArgumentError, match="cpu:1") as info:
        h.deallocate(other)
    assert "RecExecutionProvider" in str(info.value) and "cpu:0" in str(info.value)
    assert not other.released and rec.freed == []
    with pytest.raises(InvalidArgumentError, match="cuda:0"):
        h.deallocate(cuda_buffer())


# -- non-host device without memory hooks -------------------------------------------------------------------------
NON_HOST_CALLS = {
    "allocate": lambda h: h.allocate(64),
    "allocate_committed": lambda h: h.hook.allocate_committed(size=64, alignment=64, committed_ranges=[]),
    "copy_to_host": lambda h: h.copy_to_host(cuda_buffer(), bytearray(8)),
    "copy_from_host": lambda h: h.copy_from_host(b"abc", cuda_buffer()),
    "copy": lambda h: h.hook.copy(src=cuda_buffer(), dst=cuda_buffer(), size=4),
    "copy_device_to_device": lambda h: h.hook.copy_device_to_device(
        src=cuda_buffer(), src_offset=0, dst=cuda_buffer(), dst_offset=0, nbytes=4),
    "deallocate": lambda h: h.deallocate(cuda_buffer()),
    "device_argmax": lambda h: h.hook.device_argmax(
        logits=cuda_buffer(), elements=4, batch=1, dtype=DataType.FLOAT, result=cuda_buffer(),
        tie_break=ort.ArgmaxTieBreak.LOWEST_INDEX),
    "device_token_writer": lambda h: h.hook.device_token_writer(
        result=cuda_buffer(), input_ids=cuda_buffer(), position_ids=cuda_buffer(), attention_mask=cuda_buffer(),
        scratch=cuda_buffer(), capacity=4, next_position=0, mask_len=4, write_position=True, step=0),
    "begin_device_graph_capture": lambda h: h.hook.begin_device_graph_capture(kernels=[]),
    "end_device_graph_capture": lambda h: h.hook.end_device_graph_capture(),
    "replay_device_graph": lambda h: h.hook.replay_device_graph(),
    "replay_device_graph_segment": lambda h: h.hook.replay_device_graph_segment(index=0),
    "save_context": lambda h: h.hook.save_context(),
    "load_context": lambda h: h.hook.load_context(context=EpContext("fake", b"blob")),
}


@pytest.mark.parametrize("call", NON_HOST_CALLS.values(), ids=NON_HOST_CALLS.keys())
def test_non_host_provider_without_memory_hooks_is_refused(call):
    h = ProviderHandle(Cuda())
    with pytest.raises(NotSupportedError, match="FakeCudaExecutionProvider"):
        call(h)
    assert h.allocation_counts() == (0, 0)


def test_non_host_provider_simple_defaults():
    h = ProviderHandle(Cuda())
    assert h.hook.device_argmax_supported() is False
    assert h.hook.abort_device_graph_capture() is None
    assert h.hook.reset_device_graph() is False
    assert h.hook.sync() is None


# -- slot routing --------------------------------------------------------------------------------------------------
def test_primary_routes_to_single_slot_hooks():
    rec = GraphRecorder()
    h = ProviderHandle(rec)
    kernel = object()
    h.hook.begin_device_graph_capture_in(slot=PRIMARY, kernels=[kernel])
    h.hook.end_device_graph_capture_in(slot=PRIMARY)
    h.hook.abort_device_graph_capture_in(slot=PRIMARY)
    h.hook.replay_device_graph_in(slot=PRIMARY)
    h.hook.replay_device_graph_segment_in(slot=0, index=3)  # a plain int names the slot too
    assert h.hook.reset_device_graph_in(slot=PRIMARY) is True
    assert rec.calls == [("begin", [kernel]), ("end",), ("abort",), ("replay",), ("segment", 3), ("reset",)]


VERIFY_CALLS = {
    "begin": lambda h: h.hook.begin_device_graph_capture_in(slot=VERIFY, kernels=[]),
    "end": lambda h: h.hook.end_device_graph_capture_in(slot=VERIFY),
    "abort": lambda h: h.hook.abort_device_graph_capture_in(slot=VERIFY),
    "replay": lambda h: h.hook.replay_device_graph_in(slot=VERIFY),
    "segment": lambda h: h.hook.replay_device_graph_segment_in(slot=VERIFY, index=0),
}


@pytest.mark.parametrize("call", VERIFY_CALLS.values(), ids=VERIFY_CALLS.keys())
def test_verify_slot_is_rejected_naming_provider_and_slot(call):
    rec = GraphRecorder()
    h = ProviderHandle(rec)
    with pytest.raises(NotSupportedError) as info:
        call(h)
    assert "GraphExecutionProvider" in str(info.value) and "VERIFY" in str(info.value)
    assert rec.calls == []


def test_reset_verify_returns_false_without_touching_primary():
    rec = GraphRecorder()
    h = ProviderHandle(rec)
    assert h.hook.reset_device_graph_in(slot=VERIFY) is False
    assert rec.calls == []


def test_reset_primary_default_is_false_and_graphs_assumed_present():
    h = tiny()
    assert h.hook.reset_device_graph_in(slot=PRIMARY) is False
    assert h.hook.reset_device_graph() is False
    assert h.hook.has_device_graph_in(slot=PRIMARY) is True
    assert h.hook.has_device_graph_in(slot=VERIFY) is True
    assert h.hook.abort_device_graph_capture_in(slot=PRIMARY) is None


def test_cpu_provider_graph_capture_default_unsupported():
    with pytest.raises(NotSupportedError, match="TinyExecutionProvider"):
        tiny().hook.begin_device_graph_capture_in(slot=PRIMARY, kernels=[])


# -- owned tokens ----------------------------------------------------------------------------------------------------
def test_begin_owned_capture_mints_generation_one_or_continues():
    rec = GraphRecorder()
    h = ProviderHandle(rec)
    owner = DeviceGraphOwner.new()
    token = h.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=None, kernels=["k"])
    assert token == DeviceGraphToken(owner, PRIMARY, 1)
    assert isinstance(token.slot, DeviceGraphSlot)
    h.hook.end_owned_device_graph_capture(token=token)
    # A later segment continues the installed generation.
    again = h.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=token, kernels=[])
    assert again is token
    h.hook.end_owned_device_graph_capture(token=again)
    assert rec.calls == [("begin", ["k"]), ("end",), ("begin", []), ("end",)]
    # A continuation that is not the installed graph is refused before the provider sees it.
    with pytest.raises(InvalidArgumentError, match="does not name the graph its slot holds"):
        h.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY,
                                                continuation=DeviceGraphToken(owner, PRIMARY, 7), kernels=[])
    with pytest.raises(NotSupportedError, match="VERIFY"):
        h.hook.begin_owned_device_graph_capture(owner=owner, slot=VERIFY, continuation=None, kernels=[])
    assert len(rec.calls) == 4
    # A fresh capture destroys the installed graph first and mints the next generation.
    newer = h.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=None, kernels=[])
    assert newer == DeviceGraphToken(owner, PRIMARY, 2)
    assert rec.calls[4:] == [("reset",), ("begin", [])]


def test_owned_hooks_route_through_token_slot():
    rec = GraphRecorder()
    h = ProviderHandle(rec)
    owner = DeviceGraphOwner.new()
    primary = h.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=None, kernels=[])
    h.hook.abort_owned_device_graph_capture(token=primary)
    primary = h.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=None, kernels=[])
    h.hook.end_owned_device_graph_capture(token=primary)
    h.hook.replay_owned_device_graph(token=primary)
    h.hook.replay_owned_device_graph_segment(token=primary, index=2)
    assert h.hook.reset_owned_device_graph(token=primary) is True
    assert rec.calls == [("begin", []), ("abort",), ("begin", []), ("end",), ("replay",), ("segment", 2), ("reset",)]
    verify = DeviceGraphToken(owner, VERIFY, 1)
    for call in (h.hook.end_owned_device_graph_capture, h.hook.replay_owned_device_graph):
        with pytest.raises(InvalidArgumentError):  # never captured: refused before reaching the provider
            call(token=verify)
    with pytest.raises(InvalidArgumentError):
        h.hook.replay_owned_device_graph_segment(token=verify, index=0)
    h.hook.abort_owned_device_graph_capture(token=verify)
    assert h.hook.reset_owned_device_graph(token=verify) is False
    assert len(rec.calls) == 7
    assert h.hook.retire_owned_device_graphs(owner=owner) is None
    with pytest.raises(InvalidArgumentError, match="not a DeviceGraphToken"):
        h.hook.replay_owned_device_graph(token="not a token")


def test_has_owned_device_graph_is_the_installed_token_and_asks_the_slot():
    rec = GraphRecorder()
    h = ProviderHandle(rec)
    never = DeviceGraphToken(DeviceGraphOwner.new(), VERIFY, 1)
    assert h.hook.has_owned_device_graph(token=never) is False

    class Emptied(GraphRecorder):
        def __init__(self):
            super().__init__()
            self.present = True

        @hookimpl
        def has_device_graph_in(self, slot):
            return self.present

    provider = Emptied()
    h = ProviderHandle(provider)
    token = h.hook.begin_owned_device_graph_capture(owner=DeviceGraphOwner.new(), slot=PRIMARY, continuation=None,
                                                    kernels=[])
    h.hook.end_owned_device_graph_capture(token=token)
    assert h.hook.has_owned_device_graph(token=token) is True
    assert h.hook.has_owned_device_graph(token=DeviceGraphToken(token.owner, PRIMARY, 2)) is False
    provider.present = False  # reset out of band by the provider
    assert h.hook.has_owned_device_graph(token=token) is False


# -- validation ------------------------------------------------------------------------------------------------------
def test_validation_defaults():
    h = tiny()
    a = h.hook.register_device_validation_owner()
    b = h.hook.register_device_validation_owner()
    assert isinstance(a, DeviceValidationRegistration) and isinstance(a.owner, DeviceValidationOwner)
    assert a.owner != b.owner
    submission = h.hook.begin_device_validation(registration=a)
    assert submission == DeviceValidationToken(a.owner, 0)
    recipient = h.hook.add_device_validation_recipient(submission=DeviceValidationToken(a.owner, 9), recipient=b)
    assert recipient == DeviceValidationToken(b.owner, 9)
    assert h.hook.activate_device_validation(submission=submission) is None
    assert h.hook.consume_device_validation_error(registration=a, token=submission) == 0
    assert h.hook.abort_device_validation_submission(submission=submission) == 0
    assert h.hook.defers_device_validation() is False
    assert h.hook.unregister_device_validation_owner(registration=a) is None


def test_owner_identities_are_unique():
    graph_owners = {DeviceGraphOwner.new() for _ in range(50)}
    validation_owners = {DeviceValidationOwner.new() for _ in range(50)}
    assert len(graph_owners) == 50 and len(validation_owners) == 50


# -- capture-region policy ---------------------------------------------------------------------------------------------
RESOLVED = CaptureRegionShapeStatus(inputs_resolved=True, outputs_resolved=True)
NOTHING = CaptureRegionShapeStatus(inputs_resolved=False, outputs_resolved=False)
INPUT_ONLY = CaptureRegionShapeStatus(inputs_resolved=False, outputs_resolved=True)
OUTPUT_ONLY = CaptureRegionShapeStatus(inputs_resolved=True, outputs_resolved=False)
D = StructuralCaptureDecline


@pytest.mark.parametrize(("op", "domain", "status", "expected"), [
    ("If", "", NOTHING, D.HOST_CONTROL_FLOW_OR_SEQUENCE),
    ("Loop", "ai.onnx", RESOLVED, D.HOST_CONTROL_FLOW_OR_SEQUENCE),
    ("SequenceAt", "", INPUT_ONLY, D.HOST_CONTROL_FLOW_OR_SEQUENCE),
    ("ConcatFromSequence", "", RESOLVED, D.HOST_CONTROL_FLOW_OR_SEQUENCE),
    ("Relu", "", NOTHING, D.UNRESOLVED_OUTPUT_SHAPE),
    ("Relu", "", OUTPUT_ONLY, D.UNRESOLVED_OUTPUT_SHAPE),
    ("Relu", "", INPUT_ONLY, D.UNRESOLVED_INPUT_SHAPE),
    ("Relu", "", RESOLVED, None),
    ("If", "com.example", RESOLVED, None),
    ("If", "com.example", NOTHING, D.UNRESOLVED_OUTPUT_SHAPE),
    ("Loop", "com.microsoft", INPUT_ONLY, D.UNRESOLVED_INPUT_SHAPE),
])
def test_plan_capture_region_default(op, domain, status, expected):
    node = Node(op, ["x"], ["y"], name="n", domain=domain)
    assert tiny().hook.plan_capture_region(node=node, shape_status=status) is expected


def test_capture_declines_have_reasons():
    assert all(isinstance(d.reason, str) and d.reason for d in D)


# -- fences ------------------------------------------------------------------------------------------------------------
def test_fence_defaults():
    h = tiny()
    assert SIGNALLED.id == 0 and SIGNALLED.is_signalled and Fence.signalled() is SIGNALLED
    assert not Fence(5).is_signalled
    fence = h.hook.record_compute_fence()
    assert fence.is_signalled and fence.id == 0
    assert h.hook.wait_fence(fence=Fence(5)) is None
    assert h.hook.copy_wait_fence(fence=Fence(5)) is None


# -- plugin validation -----------------------------------------------------------------------------------------------
def test_unknown_hook_name_suggests_the_close_one():
    class Typo(Tiny):
        @hookimpl
        def alocate(self, size, alignment):
            raise AssertionError("never called")

    with pytest.raises(PluginError, match="alocate") as info:
        ProviderHandle(Typo())
    assert "did you mean 'allocate'" in str(info.value)


def test_unknown_hook_name_without_close_match():
    class Odd(Tiny):
        @hookimpl
        def zzzqqq(self):
            return 1

    with pytest.raises(PluginError, match="zzzqqq") as info:
        ProviderHandle(Odd())
    assert "did you mean" not in str(info.value)


def test_hookimpl_argument_not_in_spec():
    class Extra(Tiny):
        @hookimpl
        def allocate(self, size, alignment, flavor):
            raise AssertionError("never called")

    with pytest.raises(PluginError, match="flavor"):
        ProviderHandle(Extra())


def test_missing_name_hook():
    class Nameless:
        @hookimpl
        def device_type(self):
            return DeviceType.CPU

    with pytest.raises(PluginError, match="`name`"):
        ProviderHandle(Nameless())


def test_empty_name_is_rejected():
    class Blank:
        @hookimpl
        def name(self):
            return ""

    with pytest.raises(PluginError, match="non-empty"):
        ProviderHandle(Blank())


def test_overriding_one_hook_keeps_the_other_defaults():
    class Second(Tiny):
        @hookimpl
        def device_id(self):
            return DeviceId(DeviceType.CPU, 2)

    h = ProviderHandle(Second())
    assert h.device_id == DeviceId(DeviceType.CPU, 2)
    assert h.implements("device_id") and h.implements("name")
    assert not h.implements("device_type") and not h.implements("allocate") and not h.implements("short_name")
    assert h.device_type is DeviceType.CPU and h.short_name == "tiny"
    buf = h.allocate(8)
    assert buf.device == DeviceId(DeviceType.CPU, 2)  # the default allocator honours the overridden device
    h.deallocate(buf)
    assert h.allocation_counts() == (1, 1)
    assert not tiny().implements("device_id")


def test_subset_of_spec_arguments_is_enough():
    class Partial(Tiny):
        @hookimpl
        def supports_op(self, node):
            return KernelMatch.supported(2.5) if node.op_type == "Relu" else KernelMatch.unsupported("only Relu")

    h = ProviderHandle(Partial())
    assert h.supports_op(Node("Relu", ["x"], ["y"]), 18, [None], [None], [None]).cost == 2.5
    assert h.supports_op(Node("Abs", ["x"], ["y"]), 18, [None], [None], [None]).reason == "only Relu"


def test_allocate_returning_a_non_buffer_is_a_provider_error():
    class Bad(Tiny):
        @hookimpl
        def allocate(self, size):
            return bytearray(size)

    with pytest.raises(ProviderError, match="DeviceBuffer"):
        ProviderHandle(Bad()).allocate(8)


# -- DataType byte math ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("dtype", "numel", "nbytes"), [
    (DataType.INT4, 0, 0), (DataType.INT4, 1, 1), (DataType.INT4, 2, 1), (DataType.INT4, 3, 2),
    (DataType.UINT4, 7, 4), (DataType.FLOAT4E2M1, 5, 3), (DataType.INT2, 5, 2), (DataType.UINT2, 8, 2),
    (DataType.FLOAT, 3, 12), (DataType.FLOAT16, 3, 6), (DataType.BOOL, 3, 3), (DataType.COMPLEX128, 2, 32),
    (DataType.FLOAT8E5M2, 9, 9),
])
def test_storage_bytes(dtype, numel, nbytes):
    assert dtype.storage_bytes(numel) == nbytes
    assert dtype.checked_storage_bytes(numel) == nbytes


def test_packed_types():
    assert {d for d in DataType if d.is_packed} == {
        DataType.INT4, DataType.UINT4, DataType.FLOAT4E2M1, DataType.INT2, DataType.UINT2, DataType.FLOAT6E2M3,
        DataType.FLOAT6E3M2}
    assert DataType.INT4.bits == 4 and DataType.INT2.bits == 2 and DataType.FLOAT.bits == 32
    assert DataType.FLOAT6E2M3.bits == 6 and DataType.FLOAT6E3M2.checked_storage_bytes(4) == 3


def test_storage_overflow_raises():
    with pytest.raises(ShapeOverflowError):
        DataType.FLOAT.checked_storage_bytes(MAX_BYTES)
    assert DataType.INT4.checked_storage_bytes(2 * MAX_BYTES) == MAX_BYTES  # packing halves the bytes
    with pytest.raises(ShapeOverflowError):
        DataType.INT4.checked_storage_bytes(2 * MAX_BYTES + 2)
    with pytest.raises(ShapeOverflowError):
        checked_numel((2**40, 2**40))
    with pytest.raises(ShapeOverflowError):
        checked_expected_bytes(DataType.DOUBLE, (2**31, 2**31))
    assert checked_expected_bytes(DataType.INT4, (3, 3)) == 5
    assert checked_numel((2**40, 2**40, 0)) == 0


def test_negative_counts_and_dims_are_rejected():
    with pytest.raises(InvalidArgumentError, match="non-negative"):
        DataType.FLOAT.storage_bytes(-1)
    with pytest.raises(InvalidArgumentError, match="negative dimension") as info:
        checked_numel((2, -1, 3))
    assert not isinstance(info.value, ShapeOverflowError)
    with pytest.raises(InvalidArgumentError, match="negative dimension"):
        checked_expected_bytes(DataType.FLOAT, (0, -2))


@pytest.mark.parametrize("dtype", [d for d in DataType if d not in (DataType.UNDEFINED, DataType.STRING)],
                         ids=lambda d: d.name)
def test_every_dtype_maps_to_numpy_and_back(dtype):
    np_dtype = dtype.numpy
    assert isinstance(np_dtype, np.dtype)
    assert DataType.from_numpy(np_dtype) is dtype
    assert DataType.from_numpy(np.zeros(2, np_dtype).dtype) is dtype
    assert DataType.parse(int(dtype)) is dtype and DataType.parse(dtype.name.lower()) is dtype
    if not dtype.is_packed:
        assert dtype.bits == np_dtype.itemsize * 8


def test_dtype_edges():
    with pytest.raises(InvalidArgumentError, match="UNDEFINED"):
        _ = DataType.UNDEFINED.numpy
    with pytest.raises(InvalidArgumentError, match="string"):
        _ = DataType.STRING.bits
    assert DataType.from_numpy(np.dtype(object)) is DataType.STRING
    assert DataType.from_numpy(np.array(["a"]).dtype) is DataType.STRING
    with pytest.raises(InvalidArgumentError, match="no ONNX tensor type"):
        DataType.from_numpy(np.dtype("datetime64[s]"))
    assert DataType.parse("tensor(float)") is DataType.FLOAT
    assert DataType.parse("float32") is DataType.FLOAT and DataType.parse("half") is DataType.FLOAT16
    assert DataType.parse(np.float64) is DataType.DOUBLE
    assert DataType.from_numpy(ml_dtypes.bfloat16) is DataType.BFLOAT16
    assert DataType.FLOAT.ort_type == "tensor(float)"
