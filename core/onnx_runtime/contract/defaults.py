"""The contract's default fallbacks: one plugin, registered per provider instance for every hook
the provider does not implement itself.

These mirror the seed trait's default methods: host allocation and copies for host-accessible
devices (bounds and overflow checked), slot routing (PRIMARY goes to the single-slot hook, other
slots are rejected naming the provider and slot, resetting a never-installed slot returns False),
validation defaults (owners and tokens, nothing deferred), the capture-region policy, signalled
fences, and "not supported by <provider>" errors for device-only features.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..devices import DeviceId, DeviceType
from ..errors import InvalidArgumentError, NotSupportedError
from .buffers import SIGNALLED, DeviceBuffer, Ownership
from .graphs import DeviceGraphSlot, DeviceGraphToken, StructuralCaptureDecline, is_control_flow_or_sequence
from .host_decode import host_argmax, host_copy_rows_at, host_token_writer, host_token_writer_at
from .kernels import Availability, KernelMatch
from .markers import hookimpl
from .memory_defaults import MemoryDefaults
from .validation import DeviceValidationOwner, DeviceValidationRegistration, DeviceValidationToken
from .version import FIRST_VERSION

if TYPE_CHECKING:
    from ..ir import Node
    from .buffers import Fence, HostBytes, WritableHostBytes
    from .graphs import CaptureRegionShapeStatus, DeviceGraphOwner
    from .handle import ContractHandle
    from .kernels import EpContext, GraphPass, Kernel


def host_bytes_of(src: HostBytes) -> np.ndarray:
    """A flat uint8 view of host data (bytes, bytearray, memoryview, or C-contiguous array)."""
    if isinstance(src, np.ndarray):
        if not src.flags.c_contiguous:
            raise InvalidArgumentError("host data must be C-contiguous; pass np.ascontiguousarray(data)")
        return src.reshape(-1).view(np.uint8)
    return np.frombuffer(src, dtype=np.uint8)


def _slot(slot: Any, provider: str) -> DeviceGraphSlot:
    try:
        return DeviceGraphSlot(slot)
    except ValueError:
        raise InvalidArgumentError(f"{provider}: {slot!r} is not a device graph slot; use PRIMARY or VERIFY") from None


def writable_host_bytes_of(dst: WritableHostBytes) -> np.ndarray:
    view = host_bytes_of(dst)
    if not view.flags.writeable:
        raise InvalidArgumentError("the host destination is read-only; pass a bytearray or a writable array")
    return view


class DefaultFallbacks(MemoryDefaults):
    """Default implementations, bound to one provider instance's :class:`ProviderHandle` (the memory-governance
    and residency defaults come from :class:`onnx_runtime.contract.memory_defaults.MemoryDefaults`)."""

    def __init__(self, handle: ContractHandle) -> None:
        self._handle = handle
        self._allocations = 0
        self._frees = 0
        # Owner-scoped graphs on a provider that implements only the slot hooks (see below).
        self._graph_lock = threading.RLock()
        self._installed_graphs: dict[DeviceGraphSlot, DeviceGraphToken] = {}
        self._capturing_graphs: dict[DeviceGraphSlot, DeviceGraphToken] = {}
        self._graph_generations: dict[tuple[DeviceGraphOwner, DeviceGraphSlot], int] = {}

    # -- helpers --------------------------------------------------------------------------------
    @property
    def _name(self) -> str:
        return self._handle.name

    def _unsupported(self, feature: str, hook: str) -> NotSupportedError:
        return NotSupportedError(
            f"{feature} is not supported by {self._name}; use a provider that implements the "
            f"`{hook}` hook (or implement it in {self._name})"
        )

    def _device(self) -> DeviceId:
        return self._handle.hook.device_id()

    def _require_host(self, buffer: DeviceBuffer, what: str, hook: str) -> np.ndarray:
        if buffer.released:
            raise InvalidArgumentError(
                f"{self._name}: {what} uses the buffer at {buffer.ptr:#x}, which was already freed"
            )
        if not buffer.device.is_host_accessible or buffer.host is None:
            raise self._unsupported(f"{what} for non-host-accessible device {buffer.device}", hook)
        return buffer.host_view()

    # -- identity -------------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def contract_version(self) -> str:
        return FIRST_VERSION

    @hookimpl(trylast=True)
    def selected_by_default(self) -> bool:
        return True

    @hookimpl(trylast=True)
    def short_name(self) -> str:
        return self._handle.hook.name().replace("ExecutionProvider", "").lower() or self._handle.hook.name()

    @hookimpl(trylast=True)
    def device_type(self) -> DeviceType:
        return DeviceType.CPU

    @hookimpl(trylast=True)
    def device_id(self) -> DeviceId:
        return DeviceId(self._handle.hook.device_type(), 0)

    @hookimpl(trylast=True)
    def availability(self) -> Availability:
        return Availability.yes()

    # -- lifecycle --------------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def initialize(self, options: dict[str, str]) -> None:
        if options:
            raise InvalidArgumentError(
                f"{self._name} accepts no provider options, got {sorted(options)}; remove them"
            )

    @hookimpl(trylast=True)
    def shutdown(self) -> None:
        return None

    # -- capability -------------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def supports_op(self, node: Node) -> KernelMatch:
        return KernelMatch.unsupported(
            f"{self._name} implements no operators (it has no `supports_op` hook)"
        )

    @hookimpl(trylast=True)
    def get_kernel(self, node: Node) -> Kernel:
        raise self._unsupported(f"creating a kernel for {node.op_type}", "get_kernel")

    @hookimpl(trylast=True)
    def host_inputs(self) -> tuple[int, ...] | None:
        return None  # undeclared: the capture-region analysis assumes nothing about the node's inputs

    @hookimpl(trylast=True)
    def claim_nodes(self) -> list[str]:
        return []

    @hookimpl(trylast=True)
    def custom_passes(self) -> list[GraphPass]:
        return []

    @hookimpl(trylast=True)
    def plan_capture_region(
        self, node: Node, shape_status: CaptureRegionShapeStatus
    ) -> StructuralCaptureDecline | None:
        if is_control_flow_or_sequence(node):
            return StructuralCaptureDecline.HOST_CONTROL_FLOW_OR_SEQUENCE
        if not shape_status.outputs_resolved:
            return StructuralCaptureDecline.UNRESOLVED_OUTPUT_SHAPE
        if not shape_status.inputs_resolved:
            return StructuralCaptureDecline.UNRESOLVED_INPUT_SHAPE
        return None

    # -- memory -----------------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def allocate(self, size: int, alignment: int) -> DeviceBuffer:
        device = self._device()
        if not device.is_host_accessible:
            raise self._unsupported(f"allocating memory on {device}", "allocate")
        buffer = allocate_host(device, size, alignment)
        self._allocations += 1
        return buffer

    @hookimpl(trylast=True)
    def allocate_committed(
        self, size: int, alignment: int, committed_ranges: Sequence[tuple[int, int]] | None
    ) -> DeviceBuffer:
        for start, stop in committed_ranges or ():
            if not 0 <= start <= stop <= size:
                raise InvalidArgumentError(
                    f"{self._name}: committed range {start}..{stop} is outside the {size}-byte allocation"
                )
        return self._handle.hook.allocate(size=size, alignment=alignment)

    @hookimpl(trylast=True)
    def commit_allocation_range(self, buffer: DeviceBuffer, offset: int, nbytes: int) -> None:
        check_range(self._name, "commit", buffer, offset, nbytes)

    @hookimpl(trylast=True)
    def commit_allocation_ranges(self, ranges: Sequence[tuple[DeviceBuffer, int, int]]) -> None:
        for buffer, offset, nbytes in ranges:
            self._handle.hook.commit_allocation_range(buffer=buffer, offset=offset, nbytes=nbytes)

    @hookimpl(trylast=True)
    def decommit_allocation_range(self, buffer: DeviceBuffer, offset: int, nbytes: int) -> None:
        check_range(self._name, "decommit", buffer, offset, nbytes)
        raise self._unsupported("partial decommit (reserving address space)", "decommit_allocation_range")

    @hookimpl(trylast=True)
    def allocation_committed_bytes(self, buffer: DeviceBuffer) -> int:
        return buffer.size

    @hookimpl(trylast=True)
    def deallocate(self, buffer: DeviceBuffer) -> None:
        if buffer.host is None and not buffer.device.is_host_accessible:
            raise self._unsupported(f"freeing memory on {buffer.device}", "deallocate")
        self._frees += 1

    @hookimpl(trylast=True)
    def device_allocation_counts(self) -> tuple[int, int] | None:
        if self._handle.implements("allocate") or self._handle.implements("deallocate"):
            return None  # the provider manages (part of) its memory itself; these counts would be partial
        return (self._allocations, self._frees)

    # -- copies -----------------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def copy(self, src: DeviceBuffer, dst: DeviceBuffer, size: int) -> None:
        if size < 0:
            raise InvalidArgumentError(f"{self._name}: copy size must be non-negative, got {size}")
        source = self._require_host(src, "copy", "copy")
        target = self._require_host(dst, "copy", "copy")
        if size > src.size or size > dst.size:
            raise InvalidArgumentError(
                f"{self._name}: copy of {size} bytes exceeds the source ({src.size} B) or destination "
                f"({dst.size} B)"
            )
        _check_writable(self._name, dst)
        target[:size] = source[:size]

    @hookimpl(trylast=True)
    def copy_async(self, src: DeviceBuffer, dst: DeviceBuffer, size: int) -> Fence:
        self._handle.hook.copy(src=src, dst=dst, size=size)
        return SIGNALLED

    @hookimpl(trylast=True)
    def wait_fence(self, fence: Fence) -> None:
        return None

    @hookimpl(trylast=True)
    def record_compute_fence(self) -> Fence:
        return SIGNALLED

    @hookimpl(trylast=True)
    def copy_wait_fence(self, fence: Fence) -> None:
        return None

    @hookimpl(trylast=True)
    def copy_from_host(self, src: HostBytes, dst: DeviceBuffer) -> None:
        data = host_bytes_of(src)
        if data.size > dst.size:
            raise InvalidArgumentError(
                f"{self._name}: host upload of {data.size} bytes exceeds the destination's {dst.size} bytes"
            )
        if data.size == 0:
            return None
        target = self._require_host(dst, "host upload", "copy_from_host")
        _check_writable(self._name, dst)
        target[: data.size] = data

    @hookimpl(trylast=True)
    def copy_from_host_at(self, src: HostBytes, dst: DeviceBuffer, byte_offset: int) -> None:
        data = host_bytes_of(src)
        check_range(self._name, "host upload", dst, byte_offset, data.size)
        if data.size == 0:
            return None
        if dst.host is None and self._handle.implements("copy_from_host"):  # the provider's upload, into a range
            return self._handle.hook.copy_from_host(src=data, dst=dst.alias(byte_offset, data.size, writable=True))
        target = self._require_host(dst, "ranged host upload", "copy_from_host_at")
        _check_writable(self._name, dst)
        target[byte_offset: byte_offset + data.size] = data

    @hookimpl(trylast=True)
    def copy_to_host(self, src: DeviceBuffer, dst: WritableHostBytes) -> None:
        target = writable_host_bytes_of(dst)
        if target.size > src.size:
            raise InvalidArgumentError(
                f"{self._name}: host download of {target.size} bytes exceeds the source's {src.size} bytes"
            )
        if target.size == 0:
            return None
        target[:] = self._require_host(src, "host download", "copy_to_host")[: target.size]

    @hookimpl(trylast=True)
    def copy_device_to_device(
        self, src: DeviceBuffer, src_offset: int, dst: DeviceBuffer, dst_offset: int, nbytes: int
    ) -> None:
        check_range(self._name, "device-to-device copy source", src, src_offset, nbytes)
        check_range(self._name, "device-to-device copy destination", dst, dst_offset, nbytes)
        source = self._require_host(src, "device-to-device copy", "copy_device_to_device")
        target = self._require_host(dst, "device-to-device copy", "copy_device_to_device")
        _check_writable(self._name, dst)
        target[dst_offset: dst_offset + nbytes] = source[src_offset: src_offset + nbytes]

    @hookimpl(trylast=True)
    def device_copy_rows(self, src: DeviceBuffer, src_offset: int, src_pitch: int, dst: DeviceBuffer,
                         dst_offset: int, dst_pitch: int, row_bytes: int, rows: int) -> None:
        check_rows(self._name, src, src_offset, src_pitch, dst, dst_offset, dst_pitch, row_bytes, rows)
        hook = self._handle.hook
        # A device provider of only the synchronous ``copy`` is served through aliases of each row.
        ordered = self._handle.implements("copy_device_to_device") or src.device.is_host_accessible
        for row in range(rows if row_bytes else 0):
            start, end = src_offset + row * src_pitch, dst_offset + row * dst_pitch
            if ordered:
                hook.copy_device_to_device(src=src, src_offset=start, dst=dst, dst_offset=end, nbytes=row_bytes)
            else:
                hook.copy(src=src.alias(start, row_bytes), dst=dst.alias(end, row_bytes, writable=True), size=row_bytes)

    @hookimpl(trylast=True)
    def sync(self) -> None:
        return None

    @hookimpl(trylast=True)
    def order_device_access(self, reads, writes) -> None:
        return None  # one stream per device: its order is already the host's

    @hookimpl(trylast=True)
    def borrow_device_memory(self, buffer: DeviceBuffer) -> None:
        return None  # one stream per device: borrowed memory needs no owner

    @hookimpl(trylast=True)
    def return_device_memory(self, buffer: DeviceBuffer) -> None:
        return None

    # -- decode helpers ---------------------------------------------------------------------------
    # On host memory these run in numpy (contract/host_decode.py), so decode loops need no device.
    @hookimpl(trylast=True)
    def device_argmax_supported(self) -> bool:
        return self._device().is_host_accessible

    @hookimpl(trylast=True)
    def device_argmax(self, logits: DeviceBuffer, elements: int, batch: int, dtype: Any, result: DeviceBuffer,
                      tie_break: Any = None) -> None:
        for buffer in (logits, result):
            self._require_host(buffer, "device argmax", "device_argmax")
        host_argmax(self._name, logits, elements, batch, dtype, result, tie_break)

    @hookimpl(trylast=True)
    def device_token_writer(self, result: DeviceBuffer, input_ids: DeviceBuffer, position_ids: DeviceBuffer,
                            attention_mask: DeviceBuffer, scratch: DeviceBuffer, capacity: int, next_position: int,
                            mask_len: int, write_position: bool, step: int) -> None:
        for buffer in (result, input_ids, position_ids, attention_mask, scratch):
            self._require_host(buffer, "the device token writer", "device_token_writer")
        host_token_writer(self._name, result, input_ids, position_ids, attention_mask, scratch, capacity,
                          next_position, mask_len, write_position, step)

    @hookimpl(trylast=True)
    def device_token_writer_at(self, result: DeviceBuffer, input_ids: DeviceBuffer, position_ids: DeviceBuffer,
                               attention_mask: DeviceBuffer, scratch: DeviceBuffer, capacity: int, mask_len: int,
                               write_position: bool, counter: DeviceBuffer) -> None:
        for buffer in (result, input_ids, position_ids, attention_mask, scratch, counter):
            self._require_host(buffer, "the device token writer", "device_token_writer_at")
        host_token_writer_at(self._name, result, input_ids, position_ids, attention_mask, scratch, capacity, mask_len,
                             write_position, counter)

    @hookimpl(trylast=True)
    def device_copy_rows_at(self, src: DeviceBuffer, src_offset: int, src_pitch: int, dst: DeviceBuffer,
                            dst_pitch: int, row_bytes: int, rows: int, counter: DeviceBuffer, word: int, bias: int,
                            dst_unit: int, limit: int) -> None:
        for buffer in (src, dst, counter):
            self._require_host(buffer, "a row copy at a device index", "device_copy_rows_at")
        host_copy_rows_at(self._name, src, src_offset, src_pitch, dst, dst_pitch, row_bytes, rows, counter, word, bias,
                          dst_unit, limit)

    # -- device graphs: single slot ---------------------------------------------------------------
    @hookimpl(trylast=True)
    def begin_device_graph_capture(self) -> None:
        raise self._unsupported("device graph capture", "begin_device_graph_capture")

    @hookimpl(trylast=True)
    def end_device_graph_capture(self) -> None:
        raise self._unsupported("device graph capture", "end_device_graph_capture")

    @hookimpl(trylast=True)
    def abort_device_graph_capture(self) -> None:
        return None

    @hookimpl(trylast=True)
    def replay_device_graph(self) -> None:
        raise self._unsupported("device graph replay", "replay_device_graph")

    @hookimpl(trylast=True)
    def replay_device_graph_segment(self) -> None:
        raise self._unsupported("segmented device graph replay", "replay_device_graph_segment")

    @hookimpl(trylast=True)
    def reset_device_graph(self) -> bool:
        return False

    # -- device graphs: slot routing ----------------------------------------------------------------
    def _route(self, slot: DeviceGraphSlot, hook: str, **kwargs: Any) -> Any:
        if _slot(slot, self._name) is DeviceGraphSlot.PRIMARY:
            return getattr(self._handle.hook, hook)(**kwargs)
        raise NotSupportedError(
            f"{self._name}: device graph slot {DeviceGraphSlot(slot).name} is not supported "
            f"({self._name} owns only the PRIMARY slot)"
        )

    @hookimpl(trylast=True)
    def begin_device_graph_capture_in(self, slot: DeviceGraphSlot, kernels: Sequence[Kernel]) -> None:
        return self._route(slot, "begin_device_graph_capture", kernels=kernels)

    @hookimpl(trylast=True)
    def end_device_graph_capture_in(self, slot: DeviceGraphSlot) -> None:
        return self._route(slot, "end_device_graph_capture")

    @hookimpl(trylast=True)
    def abort_device_graph_capture_in(self, slot: DeviceGraphSlot) -> None:
        return self._route(slot, "abort_device_graph_capture")

    @hookimpl(trylast=True)
    def replay_device_graph_in(self, slot: DeviceGraphSlot) -> None:
        return self._route(slot, "replay_device_graph")

    @hookimpl(trylast=True)
    def replay_device_graph_segment_in(self, slot: DeviceGraphSlot, index: int) -> None:
        return self._route(slot, "replay_device_graph_segment", index=index)

    @hookimpl(trylast=True)
    def reset_device_graph_in(self, slot: DeviceGraphSlot) -> bool:
        if _slot(slot, self._name) is DeviceGraphSlot.PRIMARY:
            return self._handle.hook.reset_device_graph()
        return False  # nothing is ever installed in a slot a single-slot provider does not own

    @hookimpl(trylast=True)
    def has_device_graph_in(self, slot: DeviceGraphSlot) -> bool:
        return True

    # -- device graphs: owner-scoped ------------------------------------------------------------------
    # A provider without these hooks holds one graph per slot, whoever captured it. The defaults keep the
    # token of the graph each slot holds, so a graph replaced by a later capture (another owner, or the
    # same owner's other feed signature) is reported dead to its old token: it can neither be replayed
    # (it would run the newer graph) nor reset the newer graph, and its owner captures again.
    def _graph_token(self, token: DeviceGraphToken) -> DeviceGraphToken:
        if not isinstance(token, DeviceGraphToken):
            raise InvalidArgumentError(f"{self._name}: {token!r} is not a DeviceGraphToken")
        return token

    def _stale(self, token: DeviceGraphToken) -> InvalidArgumentError:
        return InvalidArgumentError(
            f"{self._name}: device graph token (owner {token.owner.id}, slot {token.slot.name}, generation "
            f"{token.generation}) does not name the graph its slot holds (a later capture replaced it, or it "
            f"was reset); capture again"
        )

    @hookimpl(trylast=True)
    def begin_owned_device_graph_capture(
        self,
        owner: DeviceGraphOwner,
        slot: DeviceGraphSlot,
        continuation: DeviceGraphToken | None,
        kernels: Sequence[Kernel],
    ) -> DeviceGraphToken:
        slot = _slot(slot, self._name)
        with self._graph_lock:
            installed = self._installed_graphs.get(slot)
            if continuation is not None:  # a later segment extends the graph the slot holds
                if self._graph_token(continuation) != installed or continuation.owner != owner:
                    raise self._stale(continuation)
                token = continuation
            else:
                if installed is not None:
                    # The new capture replaces the slot's graph: destroy it first, so a provider that would
                    # extend an installed graph (a next segment) records a graph of its own.
                    del self._installed_graphs[slot]
                    self._handle.hook.reset_device_graph_in(slot=slot)
                token = DeviceGraphToken(owner, slot, self._graph_generations.get((owner, slot), 0) + 1)
            self._handle.hook.begin_device_graph_capture_in(slot=slot, kernels=kernels)
            self._graph_generations[(owner, slot)] = max(token.generation,
                                                         self._graph_generations.get((owner, slot), 0))
            self._capturing_graphs[slot] = token
            return token

    @hookimpl(trylast=True)
    def end_owned_device_graph_capture(self, token: DeviceGraphToken) -> None:
        token = self._graph_token(token)
        with self._graph_lock:
            if self._capturing_graphs.get(token.slot) != token:
                raise InvalidArgumentError(
                    f"{self._name}: no device graph capture of owner {token.owner.id} is in progress in slot "
                    f"{token.slot.name}"
                )
            self._handle.hook.end_device_graph_capture_in(slot=token.slot)
            del self._capturing_graphs[token.slot]
            self._installed_graphs[token.slot] = token

    @hookimpl(trylast=True)
    def abort_owned_device_graph_capture(self, token: DeviceGraphToken) -> None:
        token = self._graph_token(token)
        with self._graph_lock:
            if self._capturing_graphs.get(token.slot) == token:  # a stale token ends nobody's capture
                del self._capturing_graphs[token.slot]
                self._handle.hook.abort_device_graph_capture_in(slot=token.slot)

    @hookimpl(trylast=True)
    def replay_owned_device_graph(self, token: DeviceGraphToken) -> None:
        if self._installed_graphs.get(self._graph_token(token).slot) != token:
            raise self._stale(token)
        return self._handle.hook.replay_device_graph_in(slot=token.slot)

    @hookimpl(trylast=True)
    def replay_owned_device_graph_segment(self, token: DeviceGraphToken, index: int) -> None:
        if self._installed_graphs.get(self._graph_token(token).slot) != token:
            raise self._stale(token)
        return self._handle.hook.replay_device_graph_segment_in(slot=token.slot, index=index)

    @hookimpl(trylast=True)
    def reset_owned_device_graph(self, token: DeviceGraphToken) -> bool:
        token = self._graph_token(token)
        with self._graph_lock:
            if self._installed_graphs.get(token.slot) != token:
                return False  # a stale token never resets the newer graph
            del self._installed_graphs[token.slot]
            return bool(self._handle.hook.reset_device_graph_in(slot=token.slot))

    @hookimpl(trylast=True)
    def retire_owned_device_graphs(self, owner: DeviceGraphOwner) -> None:
        with self._graph_lock:
            for slot, token in list(self._installed_graphs.items()):
                if token.owner == owner:  # nothing can replay it any more
                    del self._installed_graphs[slot]
                    self._handle.hook.reset_device_graph_in(slot=slot)
            for key in [key for key in self._graph_generations if key[0] == owner]:
                del self._graph_generations[key]

    @hookimpl(trylast=True)
    def has_owned_device_graph(self, token: DeviceGraphToken) -> bool:
        if self._installed_graphs.get(self._graph_token(token).slot) != token:
            return False
        return bool(self._handle.hook.has_device_graph_in(slot=token.slot))

    # -- validation -------------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def register_device_validation_owner(self) -> DeviceValidationRegistration:
        return DeviceValidationRegistration(DeviceValidationOwner.new())

    @hookimpl(trylast=True)
    def unregister_device_validation_owner(self, registration: DeviceValidationRegistration) -> None:
        return None

    @hookimpl(trylast=True)
    def begin_device_validation(self, registration: DeviceValidationRegistration) -> DeviceValidationToken:
        return DeviceValidationToken(registration.owner, 0)

    @hookimpl(trylast=True)
    def add_device_validation_recipient(
        self, submission: DeviceValidationToken, recipient: DeviceValidationRegistration
    ) -> DeviceValidationToken:
        return DeviceValidationToken(recipient.owner, submission.generation)

    @hookimpl(trylast=True)
    def activate_device_validation(self, submission: DeviceValidationToken) -> None:
        return None

    @hookimpl(trylast=True)
    def abort_device_validation_submission(self, submission: DeviceValidationToken) -> int:
        return 0

    @hookimpl(trylast=True)
    def defers_device_validation(self) -> bool:
        return False

    @hookimpl(trylast=True)
    def consume_device_validation_error(
        self, registration: DeviceValidationRegistration, token: DeviceValidationToken
    ) -> int:
        return 0

    # -- compiled contexts --------------------------------------------------------------------------
    @hookimpl(trylast=True)
    def context_source_keys(self) -> list[str]:
        return []

    @hookimpl(trylast=True)
    def save_context(self) -> EpContext:
        raise self._unsupported("saving a compiled EPContext", "save_context")

    @hookimpl(trylast=True)
    def load_context(self, context: EpContext) -> None:
        raise self._unsupported("loading a compiled EPContext", "load_context")


def allocate_host(device: DeviceId, size: int, alignment: int) -> DeviceBuffer:
    """An owned, ``alignment``-aligned host buffer (over-allocates and offsets into numpy memory)."""
    if alignment <= 0 or alignment & (alignment - 1):
        raise InvalidArgumentError(f"alignment must be a power of two, got {alignment}")
    if size < 0:
        raise InvalidArgumentError(f"allocation size must be non-negative, got {size}")
    raw = np.empty(max(size, 1) + alignment, dtype=np.uint8)
    offset = (-raw.ctypes.data) % alignment
    host = raw[offset: offset + max(size, 1)]
    return DeviceBuffer(device, size, alignment, host.ctypes.data, Ownership.OWNED, host=host)


def check_range(provider: str, what: str, buffer: DeviceBuffer, offset: int, nbytes: int) -> None:
    if offset < 0 or nbytes < 0:
        raise InvalidArgumentError(f"{provider}: {what} range has a negative offset or length")
    end = offset + nbytes
    if end > buffer.size:
        raise InvalidArgumentError(
            f"{provider}: {what} range {offset}..{end} exceeds the {buffer.size}-byte buffer"
        )


def check_rows(provider: str, src: DeviceBuffer, src_offset: int, src_pitch: int, dst: DeviceBuffer,
               dst_offset: int, dst_pitch: int, row_bytes: int, rows: int) -> None:
    """The arguments of a row copy (``device_copy_rows``): pitches of at least a row, both regions inside their
    buffers (the last row's end bounds each), and not overlapping."""
    if min(src_pitch, dst_pitch, row_bytes, rows) < 0 or (rows > 1 and min(src_pitch, dst_pitch) < row_bytes):
        raise InvalidArgumentError(
            f"{provider}: a row copy needs non-negative sizes and pitches of at least the row's {row_bytes} bytes; "
            f"got pitches {src_pitch} (source) and {dst_pitch} (destination) for {rows} rows"
        )
    if not rows or not row_bytes:
        return
    src_span, dst_span = (rows - 1) * src_pitch + row_bytes, (rows - 1) * dst_pitch + row_bytes
    check_range(provider, "row copy source", src, src_offset, src_span)
    check_range(provider, "row copy destination", dst, dst_offset, dst_span)
    start, end = src.ptr + src_offset, dst.ptr + dst_offset
    if start < end + dst_span and end < start + src_span:
        raise InvalidArgumentError(
            f"{provider}: a row copy's source and destination regions overlap; copy through a scratch buffer"
        )


def _check_writable(provider: str, buffer: DeviceBuffer) -> None:
    if buffer.ownership is Ownership.BORROWED:
        raise InvalidArgumentError(
            f"{provider}: cannot write into a read-only borrowed buffer at {buffer.ptr:#x}; "
            f"borrow it writable (DeviceBuffer.alias(writable=True)) or allocate an owned one"
        )
