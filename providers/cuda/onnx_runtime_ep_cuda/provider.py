"""CUDAExecutionProvider: the provider contract's identity, memory, copy and ordering hooks on one CUDA device.

On a machine without cuda-python or without an NVIDIA driver the provider stays installed and
reports itself unavailable with the reason; ``ONNX_RUNTIME_CUDA_SIM=1`` runs it on the simulator.
Device memory is not host-accessible: buffers carry ``host=None`` and the device address in ``ptr``,
and every byte moves through the driver. Host buffers (the CPU provider's) may appear on either side
of ``copy``/``copy_async``; the bounds, ownership and writability checks happen here, before any
driver call. Kernels come from the operator registry (ops/registry.py); the inputs a kernel reads on the
host (shape-like inputs) are declared there, passed to its factory when they are constants, and reported
through ``host_inputs``.

Each instance runs on a lane of its own (lanes.py: a compute and a transfer stream of the shared device), so
sessions on different threads overlap on the device. A buffer another instance may have touched is ordered
by ``order_device_access`` (the session calls it for the feeds and bound outputs of a run) and by the hooks
here that take buffers, so every copy, download and decode helper waits for the lane that wrote its source.

Device graphs (graphs.py), deferred validation (validation.py) and the greedy-decoding helpers
(decode.py) are per provider instance, created on first use; ``shutdown`` destroys what is left. The
slot-level graph hooks work in a namespace of their own (an owner minted per instance): there a
``begin`` while the slot holds a graph records the graph's next segment, and ``reset`` starts over.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime import Availability, DeviceId, DeviceType, KernelMatch, hookimpl
from onnx_runtime.contract.buffers import SIGNALLED, DeviceBuffer, Ownership
from onnx_runtime.contract.defaults import check_range, check_rows, host_bytes_of, writable_host_bytes_of
from onnx_runtime.contract.graphs import DeviceGraphOwner, DeviceGraphSlot
from onnx_runtime.errors import InvalidArgumentError, ProviderError, ProviderNotAvailableError

from . import (
    decode,
    driver,
    ops,  # noqa: F401  (fills the kernel registry)
)
from .device import CudaDevice
from .governance import MemoryGovernance
from .graphs import DeviceGraphs
from .lanes import Lane
from .ops.context import KernelContext
from .ops.host_shapes import host_kernel, host_nodes
from .ops.registry import declared_host_inputs, lookup, unsupported_reason
from .reserved import ReservedAllocations
from .sealed import SealedConstants
from .validation import DeviceValidation
from .vmm import MappedGrowthBuffer

NAME = "CUDAExecutionProvider"
OPTION_KEYS = ("device_id",)


class CUDAExecutionProvider(SealedConstants, MemoryGovernance, ReservedAllocations):
    def __init__(self):
        self._device_index = 0
        self._device_id = DeviceId(DeviceType.CUDA, 0)  # made once: every allocation is stamped with it
        self._device: CudaDevice | None = None
        self._lane: Lane | None = None  # this instance's streams (opened at initialize, kept after shutdown)
        self.handle = None  # the ProviderHandle, for kernels that create Tensors on this device
        self._allocations = 0
        self._frees = 0
        self._context: KernelContext | None = None
        self._graphs: DeviceGraphs | None = None
        self._validation: DeviceValidation | None = None
        self._slot_owner = DeviceGraphOwner.new()  # the namespace of the slot-level graph hooks
        self._slot_tokens: dict[DeviceGraphSlot, object] = {}
        self._host_nodes: dict[int, tuple] = {}  # per graph: the shape computations kept on the host

    # -- identity -----------------------------------------------------------------------------------
    @hookimpl
    def name(self):
        return NAME

    @hookimpl
    def short_name(self):
        return "cuda"

    @hookimpl
    def contract_version(self):
        return "1.5"

    @hookimpl
    def device_type(self):
        return DeviceType.CUDA

    @hookimpl
    def device_id(self):
        return self._device_id

    @hookimpl
    def availability(self):
        reason = driver.probe()
        return Availability.no(reason) if reason else Availability.yes()

    # -- lifecycle ----------------------------------------------------------------------------------
    @hookimpl
    def initialize(self, options, handle):
        index = self._device_index
        for key, value in options.items():
            bare = key.removeprefix("cuda.")
            if bare not in OPTION_KEYS:
                raise InvalidArgumentError(
                    f"{NAME} does not accept option {key!r}; accepted: {list(OPTION_KEYS)}"
                )
            if bare == "device_id":
                try:
                    index = int(value)
                except ValueError:
                    raise InvalidArgumentError(f"{NAME} option device_id must be an integer, got {value!r}") from None
        reason = driver.probe()
        if reason:
            raise ProviderNotAvailableError(f"{NAME} is not available: {reason}")
        count = driver.device_count()
        if not 0 <= index < count:
            raise InvalidArgumentError(
                f"{NAME} option device_id={index} is out of range; this machine has {count} CUDA device(s)"
            )
        self._device_index = index
        self._device_id = DeviceId(DeviceType.CUDA, index)
        self._device = CudaDevice.get(index)
        self._lane = self._device.open_lane()
        self.handle = handle

    @hookimpl
    def shutdown(self):
        # The device (context, streams, pool) is shared by every instance in the process and released
        # at exit; tensors may outlive the session, so this instance keeps it to free them later.
        # Its graphs and validation words are its own: they go now (a capture left open is aborted first,
        # since synchronizing a capturing stream is an error).
        if self._graphs is not None:
            self._graphs.close()
            self._graphs = None
            self._slot_tokens.clear()
        if self._validation is not None:
            self._validation.close()
            self._validation = None
        if self._device is not None and not self._device.closed and self._lane is not None:
            self._device.close_lane(self._lane)  # synchronized; tensors outliving the session still free on it

    # -- capability ---------------------------------------------------------------------------------
    @hookimpl
    def supports_op(self, node, opset, shapes, dtypes):
        reason = unsupported_reason(node, opset, shapes, dtypes)
        if reason is not None:
            return KernelMatch.unsupported(f"{reason}; list CPUExecutionProvider after it so the node runs on the CPU")
        return KernelMatch.supported(cost=0.1)

    @hookimpl
    def get_kernel(self, node, shapes, opset, graph):
        entry = lookup(node.op_type, node.domain, opset)
        if entry is None:
            raise ProviderError(f"{NAME}: no kernel for node {node.name!r} ({node.op_type}) at opset {opset}")
        if self._context is None:
            self._context = KernelContext(self.cuda_device(), self.handle)
        mirrored = host_nodes(graph, self._host_nodes).get(node.name)
        if mirrored is not None:  # integers that decide shapes: computed on the host (ops/host_shapes.py)
            return host_kernel(node, opset, graph, self._context, mirrored)
        return entry.create(node, shapes, opset, self._context, graph)

    @hookimpl
    def host_inputs(self, node, opset):
        return declared_host_inputs(node, opset)

    # -- memory -------------------------------------------------------------------------------------
    def cuda_device(self) -> Lane:
        """This instance's :class:`Lane` of the shared :class:`CudaDevice` (for kernels: it has the device's
        calls, on this instance's streams); raises before ``initialize``."""
        if self._lane is None or self._device is None:
            raise InvalidArgumentError(f"{NAME} is not initialized; create a session (or call initialize) first")
        return self._lane

    def _order(self, reads=(), writes=()) -> None:
        """Order this instance's next work after other lanes' use of these buffers (lanes.py)."""
        lane = self.cuda_device()
        lane.order_access([_key(b) for b in reads if b is not None and b.host is None],
                          [_key(b) for b in writes if b is not None and b.host is None])

    @hookimpl
    def order_device_access(self, reads, writes):
        self._order(reads, writes)
        # What this run reads and writes: a capture that follows records it with its first segment (graphs.py).
        self.cuda_device().run_access = (tuple(_key(b) for b in reads if b is not None and b.host is None),
                                         tuple(_key(b) for b in writes if b is not None and b.host is None))

    @hookimpl
    def borrow_device_memory(self, buffer):
        if buffer.host is None and buffer.device == self.device_id():
            self.cuda_device().lend(buffer.ptr, buffer.size)

    @hookimpl
    def return_device_memory(self, buffer):
        if buffer.host is None and self._device is not None and not self._device.closed:
            self._device.end_loan(buffer.ptr)

    @hookimpl
    def allocate(self, size, alignment):
        address, base = self.cuda_device().allocate(size, alignment)
        self._allocations += 1
        return DeviceBuffer(self._device_id, size, alignment, address, host=None, provider_state=base)

    @hookimpl
    def deallocate(self, buffer):
        device = self.cuda_device()
        if buffer.provider_state is None:
            raise InvalidArgumentError(f"{NAME}: {buffer!r} was not allocated by this provider")
        if not device.closed and not self.release_reserved(buffer):  # after process exit it went with the context
            device.free(buffer.provider_state)
        self._frees += 1

    @hookimpl
    def device_allocation_counts(self):
        return (self._allocations, self._frees)

    # -- copies -------------------------------------------------------------------------------------
    def _host_view(self, buffer: DeviceBuffer, what: str) -> np.ndarray | None:
        """The host bytes of a host buffer, or None for a buffer on this provider's device."""
        if buffer.released:
            raise InvalidArgumentError(f"{NAME}: {what} uses the buffer at {buffer.ptr:#x}, which was already freed")
        if buffer.host is not None:
            return buffer.host_view()
        if buffer.device != self.device_id():
            raise InvalidArgumentError(
                f"{NAME}: {what} got a buffer on {buffer.device}, but this provider runs on {self.device_id()}; "
                f"copy through the host or use that device's provider"
            )
        return None

    def _writable(self, buffer: DeviceBuffer, what: str) -> None:
        if buffer.ownership is Ownership.BORROWED:
            raise InvalidArgumentError(
                f"{NAME}: {what} cannot write into the read-only borrowed buffer at {buffer.ptr:#x}; "
                f"borrow it writable (DeviceBuffer.alias(writable=True)) or allocate an owned one"
            )

    def _copy_operands(self, src: DeviceBuffer, dst: DeviceBuffer, size: int, what: str):
        if size < 0:
            raise InvalidArgumentError(f"{NAME}: {what} size must be non-negative, got {size}")
        if size > src.size or size > dst.size:
            raise InvalidArgumentError(
                f"{NAME}: {what} of {size} bytes exceeds the source ({src.size} B) or destination ({dst.size} B)"
            )
        source, target = self._host_view(src, what), self._host_view(dst, what)
        self._writable(dst, what)
        return source, target

    @hookimpl
    def copy(self, src, dst, size):
        source, target = self._copy_operands(src, dst, size, "copy")
        if size == 0:
            return
        device = self.cuda_device()
        self._order((src,), (dst,))
        if source is not None and target is not None:
            target[:size] = source[:size]
        elif source is not None:
            device.upload(dst.ptr, source[:size])
        elif target is not None:
            device.download(target[:size], src.ptr)
        else:
            _refuse_overlap(src.ptr, dst.ptr, size, "copy")
            device.copy_device(dst.ptr, src.ptr, size)
            device.sync()

    @hookimpl
    def copy_async(self, src, dst, size):
        source, target = self._copy_operands(src, dst, size, "copy_async")
        if source is not None and target is not None:
            target[:size] = source[:size]
            return SIGNALLED
        if source is None and target is None:
            _refuse_overlap(src.ptr, dst.ptr, size, "copy_async")
        self._order((src,), (dst,))
        return self.cuda_device().copy_async(dst.ptr if target is None else target[:size],
                                             src.ptr if source is None else source[:size], size)

    @hookimpl
    def wait_fence(self, fence):
        self.cuda_device().wait_fence(fence)

    @hookimpl
    def record_compute_fence(self):
        return self.cuda_device().record_compute_fence()

    @hookimpl
    def copy_wait_fence(self, fence):
        self.cuda_device().copy_wait_fence(fence)

    @hookimpl
    def copy_from_host(self, src, dst):
        data = host_bytes_of(src)
        if data.size > dst.size:
            raise InvalidArgumentError(
                f"{NAME}: host upload of {data.size} bytes exceeds the destination's {dst.size} bytes"
            )
        self._upload(data, dst, 0, "host upload")

    @hookimpl
    def copy_from_host_at(self, src, dst, byte_offset):
        data = host_bytes_of(src)
        check_range(NAME, "host upload", dst, byte_offset, data.size)
        self._upload(data, dst, byte_offset, "ranged host upload")

    def _upload(self, data: np.ndarray, dst: DeviceBuffer, offset: int, what: str) -> None:
        target = self._host_view(dst, what)
        self._writable(dst, what)
        if data.size == 0:
            return
        if target is not None:
            target[offset: offset + data.size] = data
        else:
            self._order((), (dst,))
            self.cuda_device().upload(dst.ptr + offset, data)

    @hookimpl
    def copy_to_host(self, src, dst):
        target = writable_host_bytes_of(dst)
        if target.size > src.size:
            raise InvalidArgumentError(
                f"{NAME}: host download of {target.size} bytes exceeds the source's {src.size} bytes"
            )
        source = self._host_view(src, "host download")
        if target.size == 0:
            return
        if source is not None:
            target[:] = source[: target.size]
        else:
            self._order((src,))
            self.cuda_device().download(target, src.ptr)

    @hookimpl
    def copy_device_to_device(self, src, src_offset, dst, dst_offset, nbytes):
        what = "device-to-device copy"
        check_range(NAME, f"{what} source", src, src_offset, nbytes)
        check_range(NAME, f"{what} destination", dst, dst_offset, nbytes)
        if self._host_view(src, what) is not None or self._host_view(dst, what) is not None:
            raise InvalidArgumentError(
                f"{NAME}: {what} needs two buffers on {self.device_id()}; use copy for host buffers"
            )
        self._writable(dst, what)
        _refuse_overlap(src.ptr + src_offset, dst.ptr + dst_offset, nbytes, what)
        self._order((src,), (dst,))
        self.cuda_device().copy_device(dst.ptr + dst_offset, src.ptr + src_offset, nbytes)

    @hookimpl
    def device_copy_rows(self, src, src_offset, src_pitch, dst, dst_offset, dst_pitch, row_bytes, rows):
        what = "device row copy"
        check_rows(NAME, src, src_offset, src_pitch, dst, dst_offset, dst_pitch, row_bytes, rows)
        if self._host_view(src, what) is not None or self._host_view(dst, what) is not None:
            raise InvalidArgumentError(f"{NAME}: {what} needs two buffers on {self.device_id()}; use copy for host "
                                       f"buffers")
        self._writable(dst, what)
        self._order((src,), (dst,))
        self.cuda_device().copy_rows(dst.ptr + dst_offset, dst_pitch, src.ptr + src_offset, src_pitch, row_bytes,
                                     rows)

    @hookimpl
    def sync(self):
        # This instance's lane, and the lanes that wrote its memory: not every session's (device.sync_session).
        if self._device is not None and self._lane is not None:
            self._device.sync_session(self._lane)

    # -- device graphs --------------------------------------------------------------------------------
    def device_graphs(self) -> DeviceGraphs:
        """This instance's :class:`DeviceGraphs` (created on first use)."""
        if self._graphs is None:
            self._graphs = DeviceGraphs(self.cuda_device(), self.device_validation())
        return self._graphs

    def _prepare_capture(self) -> None:
        # A kernel asking for the validation word must not allocate it inside the capture.
        self.device_validation().prepare()

    @hookimpl
    def begin_owned_device_graph_capture(self, owner, slot, continuation):
        self._prepare_capture()
        return self.device_graphs().begin(owner, slot, continuation)

    @hookimpl
    def end_owned_device_graph_capture(self, token):
        self.device_graphs().end(token)

    @hookimpl
    def abort_owned_device_graph_capture(self, token):
        self.device_graphs().abort(token)

    @hookimpl
    def replay_owned_device_graph(self, token):
        self.device_graphs().replay(token)

    @hookimpl
    def replay_owned_device_graph_segment(self, token, index):
        self.device_graphs().replay_segment(token, index)

    @hookimpl
    def reset_owned_device_graph(self, token):
        return self.device_graphs().reset(token)

    @hookimpl
    def retire_owned_device_graphs(self, owner):
        self.device_graphs().retire(owner)

    @hookimpl
    def has_owned_device_graph(self, token):
        return self.device_graphs().has(token)

    def _slot_token(self, slot):
        return self._slot_tokens.get(DeviceGraphs._slot(slot))

    @hookimpl
    def begin_device_graph_capture_in(self, slot):
        slot = DeviceGraphs._slot(slot)
        token = self._slot_tokens.get(slot)
        graphs = self.device_graphs()
        continuation = token if token is not None and graphs.has(token) else None
        self._prepare_capture()
        self._slot_tokens[slot] = graphs.begin(self._slot_owner, slot, continuation)

    @hookimpl
    def end_device_graph_capture_in(self, slot):
        token = self._slot_token(slot)
        if token is None:
            raise InvalidArgumentError(
                f"{NAME}: no device graph capture was begun in slot {DeviceGraphSlot(slot).name}"
            )
        self.device_graphs().end(token)

    @hookimpl
    def abort_device_graph_capture_in(self, slot):
        token = self._slot_token(slot)
        if token is not None:
            self.device_graphs().abort(token)

    @hookimpl
    def replay_device_graph_in(self, slot):
        token = self._slot_token(slot)
        if token is None:
            raise InvalidArgumentError(f"{NAME}: slot {DeviceGraphSlot(slot).name} holds no device graph; capture one")
        self.device_graphs().replay(token)

    @hookimpl
    def replay_device_graph_segment_in(self, slot, index):
        token = self._slot_token(slot)
        if token is None:
            raise InvalidArgumentError(f"{NAME}: slot {DeviceGraphSlot(slot).name} holds no device graph; capture one")
        self.device_graphs().replay_segment(token, index)

    @hookimpl
    def reset_device_graph_in(self, slot):
        token = self._slot_token(slot)
        return False if token is None else self.device_graphs().reset(token)

    @hookimpl
    def has_device_graph_in(self, slot):
        token = self._slot_token(slot)
        return token is not None and self.device_graphs().has(token)

    @hookimpl
    def begin_device_graph_capture(self):
        self.begin_device_graph_capture_in(DeviceGraphSlot.PRIMARY)

    @hookimpl
    def end_device_graph_capture(self):
        self.end_device_graph_capture_in(DeviceGraphSlot.PRIMARY)

    @hookimpl
    def abort_device_graph_capture(self):
        self.abort_device_graph_capture_in(DeviceGraphSlot.PRIMARY)

    @hookimpl
    def replay_device_graph(self):
        self.replay_device_graph_in(DeviceGraphSlot.PRIMARY)

    @hookimpl
    def replay_device_graph_segment(self, index):
        self.replay_device_graph_segment_in(DeviceGraphSlot.PRIMARY, index)

    @hookimpl
    def reset_device_graph(self):
        return self.reset_device_graph_in(DeviceGraphSlot.PRIMARY)

    # -- deferred validation --------------------------------------------------------------------------
    def device_validation(self) -> DeviceValidation:
        """This instance's :class:`DeviceValidation` (created on first use)."""
        if self._validation is None:
            self._validation = DeviceValidation(self.cuda_device())
        return self._validation

    @hookimpl
    def register_device_validation_owner(self):
        return self.device_validation().register()

    @hookimpl
    def unregister_device_validation_owner(self, registration):
        self.device_validation().unregister(registration)

    @hookimpl
    def begin_device_validation(self, registration):
        return self.device_validation().begin(registration)

    @hookimpl
    def add_device_validation_recipient(self, submission, recipient):
        return self.device_validation().add_recipient(submission, recipient)

    @hookimpl
    def activate_device_validation(self, submission):
        self.device_validation().activate(submission)

    @hookimpl
    def abort_device_validation_submission(self, submission):
        return self.device_validation().abort(submission)

    @hookimpl
    def defers_device_validation(self):
        return True

    @hookimpl
    def consume_device_validation_error(self, registration, token):
        return self.device_validation().consume(registration, token)

    # -- greedy decoding ------------------------------------------------------------------------------
    @hookimpl
    def device_argmax_supported(self):
        return True

    @hookimpl
    def device_argmax(self, logits, elements, batch, dtype, result, tie_break):
        self._order((logits,), (result,))
        decode.device_argmax(self.cuda_device(), self.device_id(), self.device_validation().current_word(),
                             logits, elements, batch, dtype, result, tie_break)

    @hookimpl
    def device_token_writer(self, result, input_ids, position_ids, attention_mask, scratch, capacity,
                            next_position, mask_len, write_position, step):
        self._order((result,), (input_ids, position_ids, attention_mask, scratch))
        decode.device_token_writer(self.cuda_device(), self.device_id(), result, input_ids, position_ids,
                                   attention_mask, scratch, capacity, next_position, mask_len, write_position,
                                   step)

    @hookimpl
    def device_token_writer_at(self, result, input_ids, position_ids, attention_mask, scratch, capacity, mask_len,
                               write_position, counter):
        self._order((result,), (input_ids, position_ids, attention_mask, scratch, counter))
        decode.device_token_writer_at(self.cuda_device(), self.device_id(), result, input_ids, position_ids,
                                      attention_mask, scratch, capacity, mask_len, write_position, counter)

    @hookimpl
    def device_copy_rows_at(self, src, src_offset, src_pitch, dst, dst_pitch, row_bytes, rows, counter, word, bias,
                            dst_unit, limit):
        self._order((src, counter), (dst,))
        decode.device_copy_rows_at(self.cuda_device(), self.device_id(), src, src_offset, src_pitch, dst, dst_pitch,
                                   row_bytes, rows, counter, word, bias, dst_unit, limit)

    # -- device helpers (not hooks) -----------------------------------------------------------------
    def fill(self, buffer: DeviceBuffer, value: int = 0, offset: int = 0, nbytes: int | None = None) -> None:
        """Set bytes ``[offset, offset+nbytes)`` of a device buffer to ``value``, stream-ordered."""
        nbytes = buffer.size - offset if nbytes is None else nbytes
        check_range(NAME, "fill", buffer, offset, nbytes)
        if self._host_view(buffer, "fill") is not None:
            raise InvalidArgumentError(f"{NAME}: fill needs a buffer on {self.device_id()}")
        self._writable(buffer, "fill")
        self._order((), (buffer,))
        self.cuda_device().fill(buffer.ptr + offset, nbytes, value)


def _key(buffer: DeviceBuffer) -> int:
    """The key ``order_access`` knows ``buffer``'s memory by: its allocation's base (aliases share it), the
    object that holds a reserved allocation, else its address (a capture arena's block, borrowed memory)."""
    state = buffer.provider_state
    return state if type(state) is int else id(state) if isinstance(state, MappedGrowthBuffer) else buffer.ptr


def _refuse_overlap(src: int, dst: int, nbytes: int, what: str) -> None:
    # The driver's device copies are undefined on overlapping ranges; say so instead of corrupting data.
    if nbytes and src < dst + nbytes and dst < src + nbytes and src != dst:
        raise InvalidArgumentError(
            f"{NAME}: {what} source {src:#x} and destination {dst:#x} overlap over {nbytes} bytes; "
            f"copy through a temporary buffer"
        )
