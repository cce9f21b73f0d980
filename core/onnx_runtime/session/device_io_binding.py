"""``DeviceIoBinding``: a persistent buffer on a provider's device bound to a graph input, output, or both.

The session side of the seed's decode loop: state that stays on the device step after step (KV cache,
mask, token ids, logits), read and written by runs in place and crossing to the host only when the
caller asks. Create one with :meth:`InferenceSession.device_io_binding` and run with
:meth:`InferenceSession.run_with_device_bindings` (see :mod:`.device_binding_run`).

Shapes. A binding has a *physical* shape (its capacity: what the allocation holds) and a *logical*
shape (the valid part, each dimension at most the physical one). An input binding shows kernels its
physical shape unless the spec sets ``expose_logical_input_shape``: then kernels see the logical
shape. The valid part is laid out compactly from the start of the allocation (the logical tensor's own
row-major layout), so a growing logical length keeps the same buffer at the same address; with
``fixed_physical_strides`` it is instead laid out at the physical strides, so every row keeps a fixed
address as the record cursor grows (the binding's runs gather and scatter the rows). A mask marked
``decode_freeze_safe_mask`` is shown at capacity on a single-token step even when it exposes its
logical shape, which keeps the step's shapes stable for device-graph capture.

Aliases. A binding with both an input and an output name is read by the run and then receives that
output (a KV cache updated in place): its logical shape becomes the output's, which must fit the
capacity. The output is written after the run's kernels (stream-ordered), so no kernel reads a half
written input.

Memory. :meth:`DeviceIoBinding.allocate` allocates through the provider, with optional committed
ranges (providers that reserve address space commit only those); :meth:`from_external_memory` borrows
caller-owned memory, checked for null, size and the dtype's alignment, and never frees it (the provider holds
the binding's instance as its owner from ``borrow_device_memory`` to ``return_device_memory`` at release).

Host traffic. Only ``write_bytes``/``read_bytes*`` (and outputs a host node had to produce) cross to
or from the host; :attr:`transfer_stats` counts every such transfer. Device-to-device snapshot and
restore, on-device argmax and the token writer never do.

Validation. On a provider that defers device validation, a run whose outputs all stay in bindings
does not read the flags: each output binding receives the run's recipient token and consumes it at its
next host-visible read, which raises :class:`DeviceValidationError` if the run's kernels met invalid data.

Release (:meth:`DeviceIoBinding.close`, or garbage collection): synchronize the provider, consume any
pending validation, reset the device graph that recorded this buffer's address, then free the buffer
(owned) or just forget it (borrowed). If any step fails the allocation is quarantined (kept, never
freed: in-flight work or a graph may still use it) and a warning says why.
"""

from __future__ import annotations

import ctypes
import math
import sys
import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import budget
from ..contract.buffers import DeviceBuffer, Ownership
from ..contract.graphs import DeviceGraphToken
from ..contract.host_decode import ARGMAX_DTYPES
from ..contract.kernels import ArgmaxTieBreak
from ..contract.validation import DeviceValidationRegistration, DeviceValidationToken
from ..dtypes import DataType, checked_expected_bytes
from ..errors import DeviceValidationError, InvalidArgumentError, ShapeOverflowError
from ..provider_handle import ProviderHandle
from ..tensor import DEFAULT_ALIGNMENT, Tensor

_QUARANTINE: list[tuple[ProviderHandle, DeviceBuffer]] = []  # allocations a failed release kept alive
# Bindings a session made -> that session, so that closing it releases them (see release_session_bindings).
_LIVE: weakref.WeakKeyDictionary[DeviceIoBinding, weakref.ref] = weakref.WeakKeyDictionary()
RELEASES = [0]  # releases so far (bumped once closed): a loop's bindings are looked at when it moves


def track(binding: DeviceIoBinding, session: object) -> DeviceIoBinding:
    """Note that ``session`` made ``binding``: :func:`release_session_bindings` releases it with the session."""
    _LIVE[binding] = weakref.ref(session)
    return binding


def release_session_bindings(session: object) -> None:
    """Release the live bindings ``session`` made, before its providers shut down (their memory goes with them)."""
    for binding, owner in list(_LIVE.items()):
        if owner() is session:
            binding.close()


def quarantined_allocations() -> list[tuple[ProviderHandle, DeviceBuffer]]:
    """The (provider, buffer) pairs of bindings whose release could not be made safe: never freed."""
    return list(_QUARANTINE)


@dataclass(frozen=True)
class DeviceBindingTransferStats:
    """Host traffic through one binding: calls and bytes, each direction."""

    host_upload_calls: int = 0
    host_upload_bytes: int = 0
    host_download_calls: int = 0
    host_download_bytes: int = 0


@dataclass
class DeviceBindingSpec:
    """What :meth:`InferenceSession.device_io_binding` allocates (see the module docstring).

    ``logical_shape`` defaults to the physical shape; ``allocation_bytes`` reserves more than the
    physical shape needs (a later :meth:`DeviceIoBinding.set_physical_and_logical_shapes` may grow into
    it); ``committed_ranges`` lists the (start, stop) byte ranges to commit now (default: all).
    """

    dtype: Any
    physical_shape: tuple[int, ...]
    input_name: str = ""
    bind_input: bool = True
    output_name: str | None = None
    logical_shape: tuple[int, ...] | None = None
    expose_logical_input_shape: bool = False
    decode_freeze_safe_mask: bool = False
    fixed_physical_strides: bool = False
    allocation_bytes: int | None = None
    committed_ranges: list[tuple[int, int]] | None = None

    @classmethod
    def input(cls, input_name: str, dtype, physical_shape, logical_shape=None, output_name: str | None = None,
              **options) -> DeviceBindingSpec:
        """A buffer bound as graph input ``input_name``, optionally also receiving output ``output_name``."""
        return cls(dtype, tuple(physical_shape), input_name, True, output_name,
                   None if logical_shape is None else tuple(logical_shape), **options)

    @classmethod
    def output(cls, output_name: str, dtype, physical_shape, logical_shape=None, **options) -> DeviceBindingSpec:
        """A buffer the graph only writes (output ``output_name``)."""
        return cls(dtype, tuple(physical_shape), "", False, output_name,
                   None if logical_shape is None else tuple(logical_shape), **options)

    @classmethod
    def scratch(cls, name: str, dtype, physical_shape, logical_shape=None, **options) -> DeviceBindingSpec:
        """A buffer no graph value is bound to (argmax results, token scratch, snapshots), called ``name``."""
        return cls(dtype, tuple(physical_shape), name, False, None,
                   None if logical_shape is None else tuple(logical_shape), **options)


@dataclass
class ExternalMemorySpec:
    """Caller-owned memory (``ptr``, ``len_bytes`` on the session's device) to bind; never freed here."""

    input_name: str
    bind_input: bool
    output_name: str | None
    dtype: Any
    physical_shape: tuple[int, ...]
    logical_shape: tuple[int, ...]
    ptr: int
    len_bytes: int
    expose_logical_input_shape: bool = False
    decode_freeze_safe_mask: bool = False
    fixed_physical_strides: bool = False

    @classmethod
    def input(cls, input_name: str, output_name: str | None, dtype, physical_shape, logical_shape, ptr: int,
              len_bytes: int, **options) -> ExternalMemorySpec:
        return cls(input_name, True, output_name, dtype, tuple(physical_shape), tuple(logical_shape), ptr,
                   len_bytes, **options)

    @classmethod
    def output(cls, output_name: str, dtype, physical_shape, logical_shape, ptr: int, len_bytes: int,
               **options) -> ExternalMemorySpec:
        return cls("", False, output_name, dtype, tuple(physical_shape), tuple(logical_shape), ptr, len_bytes,
                   **options)


def _shape(shape, what: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{what} must be a sequence of integers, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise InvalidArgumentError(f"{what} {list(dims)} has a negative dimension")
    return dims


def _check_logical(label: str, physical: tuple[int, ...], logical: tuple[int, ...]) -> None:
    if len(physical) != len(logical) or any(valid > capacity for capacity, valid in zip(physical, logical)):
        raise InvalidArgumentError(
            f"device binding {label}: logical shape {list(logical)} exceeds physical capacity {list(physical)} "
            f"(same rank, each dimension at most the capacity); allocate a larger physical shape"
        )


def binding_dtype(value) -> DataType:
    """A spec's element type as a DataType; refuses strings and non-types with a typed error."""
    try:
        dtype = DataType.parse(value)
    except Exception:
        raise InvalidArgumentError(f"{value!r} is not a tensor element type; pass e.g. np.float32") from None
    if dtype in (DataType.STRING, DataType.UNDEFINED):
        raise InvalidArgumentError(f"device bindings hold numeric tensors, not {dtype.name}")
    return dtype


def strided_runs(physical: tuple[int, ...], logical: tuple[int, ...], itemsize: int) -> list[tuple[int, int, int]]:
    """(physical byte offset, compact byte offset, bytes) of each contiguous run of the logical window."""
    if 0 in logical:
        return []
    last = max((axis for axis, (p, q) in enumerate(zip(physical, logical)) if p != q), default=-1)
    if last < 0:
        return [(0, 0, math.prod(physical) * itemsize)]
    run = math.prod(logical[last:]) * itemsize
    strides = np.cumprod((1,) + physical[::-1][:-1])[::-1] * itemsize  # physical byte strides
    runs = []
    for position, index in enumerate(np.ndindex(*logical[:last])):
        runs.append((int(sum(i * s for i, s in zip(index, strides))), position * run, run))
    return runs


class DeviceIoBinding:
    """See the module docstring. Made by :meth:`InferenceSession.device_io_binding`."""

    def __init__(self, allocator: ProviderHandle, buffer: DeviceBuffer, dtype: DataType, input_name: str,
                 bind_input: bool, output_name: str | None, physical: tuple[int, ...], logical: tuple[int, ...],
                 expose_logical: bool, freeze_safe_mask: bool, fixed_strides: bool):
        self.dtype = dtype
        self._allocator = allocator
        self._buffer: DeviceBuffer | None = buffer
        self._input_name = input_name
        self._bind_input = bind_input
        self._output_name = output_name
        self._physical = physical
        self._logical = logical
        self._expose_logical = expose_logical
        self._freeze_safe_mask = freeze_safe_mask
        self._fixed_strides = fixed_strides
        self._stats = DeviceBindingTransferStats()
        self._device_graph_token: DeviceGraphToken | None = None
        self._device_validation: DeviceValidationToken | None = None
        self._validation_nodes: Sequence[str] = ()
        self._registration: DeviceValidationRegistration | None = None
        self._argmax: bool | None = None
        self._host_array: np.ndarray | None = None
        self._lent = False  # external device memory the provider recorded a borrow of (returned at release)
        try:
            self._registration = allocator.hook.register_device_validation_owner()
        except Exception:
            if not buffer.is_borrowed:
                allocator.deallocate(buffer)
            raise

    # -- construction ---------------------------------------------------------------------------------
    @classmethod
    def allocate(cls, allocator: ProviderHandle, spec: DeviceBindingSpec) -> DeviceIoBinding:
        dtype, physical, logical, label = _geometry(spec)
        required = max(_bytes(dtype, physical, label), 1)
        size = required if spec.allocation_bytes is None else int(spec.allocation_bytes)
        if size < required:
            raise InvalidArgumentError(
                f"device binding {label}: allocation_bytes is {size} but physical shape {list(physical)} of "
                f"{dtype.name} needs {required}; pass at least that or leave it unset"
            )
        budget.check(size, 1, f"device binding {label}")  # the session's max_value_bytes, before the device is asked
        ranges = None if spec.committed_ranges is None else [(int(a), int(b)) for a, b in spec.committed_ranges]
        # Through the handle: its committed bytes are charged to the session's memory account (memory/accounts.py).
        buffer = allocator.allocate_committed(size, DEFAULT_ALIGNMENT, [(0, size)] if ranges is None else ranges)
        return cls(allocator, buffer, dtype, spec.input_name, spec.bind_input, spec.output_name, physical, logical,
                   spec.expose_logical_input_shape, spec.decode_freeze_safe_mask, spec.fixed_physical_strides)

    @classmethod
    def from_external_memory(cls, allocator: ProviderHandle, spec: ExternalMemorySpec) -> DeviceIoBinding:
        """Borrow caller-owned memory. The caller keeps it alive, unaliased, for the binding's lifetime and
        for every run (and captured graph) that uses it; this binding never frees it."""
        dtype, physical, logical, label = _geometry(spec)
        required = max(_bytes(dtype, physical, label), 1)
        ptr, length = int(spec.ptr or 0), int(spec.len_bytes)
        if not ptr:
            raise InvalidArgumentError(f"external memory for {label} is null; pass the address of a real allocation")
        if length < required:
            raise InvalidArgumentError(
                f"external memory for {label} is {length} bytes but {list(physical)} of {dtype.name} needs "
                f"{required}; pass a buffer at least that large or reduce the physical shape"
            )
        alignment = dtype.numpy.alignment
        if ptr % alignment:
            raise InvalidArgumentError(
                f"external memory for {label} is at address {ptr:#x}, which is not a multiple of the "
                f"{alignment}-byte alignment {dtype.name} requires; allocate it with at least that alignment"
            )
        host = None
        if allocator.is_host_accessible:  # host memory the caller owns: view it so host kernels read it in place
            host = np.ctypeslib.as_array((ctypes.c_uint8 * required).from_address(ptr))
        buffer = DeviceBuffer(allocator.device_id, required, alignment, ptr, Ownership.BORROWED_MUT, host=host)
        binding = cls(allocator, buffer, dtype, spec.input_name, spec.bind_input, spec.output_name, physical, logical,
                      spec.expose_logical_input_shape, spec.decode_freeze_safe_mask, spec.fixed_physical_strides)
        if host is None:  # the provider records this binding's instance as the memory's owner until close
            allocator.hook.borrow_device_memory(buffer=buffer)
            binding._lent = True
        return binding

    # -- description ----------------------------------------------------------------------------------
    @property
    def input_name(self) -> str:
        return self._input_name

    @property
    def output_name(self) -> str | None:
        return self._output_name

    @property
    def binds_input(self) -> bool:
        return self._bind_input

    @property
    def physical_shape(self) -> tuple[int, ...]:
        return self._physical

    @property
    def logical_shape(self) -> tuple[int, ...]:
        return self._logical

    @property
    def label(self) -> str:
        return _label(self._input_name, self._bind_input, self._output_name)

    def kernel_input_shape(self, single_token_step: bool = False) -> tuple[int, ...]:
        """The shape kernels see when this binding is fed (see the module docstring)."""
        if self._expose_logical and not (single_token_step and self.mask_decode_freeze_safe()):
            return self._logical
        return self._physical

    def has_dynamic_logical_input_shape(self) -> bool:
        """Whether kernels see a logical window whose shape differs from the capacity now."""
        return (self._bind_input and self._expose_logical and not self._fixed_strides
                and self._logical != self._physical)

    def exposes_logical_input_shape(self) -> bool:
        """Whether kernels see the logical shape (a static property of the binding, unlike the above)."""
        return self._bind_input and self._expose_logical

    def mask_decode_freeze_safe(self) -> bool:
        return self._bind_input and self._freeze_safe_mask

    def fixed_physical_strides(self) -> bool:
        return self._fixed_strides

    @property
    def is_external(self) -> bool:
        return self.buffer.is_borrowed

    @property
    def allocator(self) -> ProviderHandle:
        """The provider owning the memory: allocate snapshot scratch with it."""
        return self._allocator

    @property
    def buffer(self) -> DeviceBuffer:
        if self._buffer is None:
            raise InvalidArgumentError(f"device binding {self.label} was released; create a new one")
        return self._buffer

    @property
    def device_ptr(self) -> int:
        return self.buffer.ptr

    @property
    def nbytes(self) -> int:
        """The allocation's length in bytes (at least the physical shape's)."""
        return self.buffer.size

    @property
    def closed(self) -> bool:
        return self._buffer is None

    def host_array(self) -> np.ndarray | None:
        """The whole allocation as a flat array of this dtype when its memory is host memory (the CPU
        provider's), else None: host kernels and a host decode loop read and write it in place, with no
        transfer (made once: the buffer never moves)."""
        array = self._host_array
        if array is None and self.buffer.host is not None:
            itemsize = self.dtype.numpy.itemsize
            array = self._host_array = self.buffer.host[: self.buffer.size // itemsize * itemsize].view(
                self.dtype.numpy)
        return array

    @property
    def transfer_stats(self) -> DeviceBindingTransferStats:
        return self._stats

    @property
    def device_graph_token(self) -> DeviceGraphToken | None:
        """The latest captured graph generation that recorded this buffer's address."""
        return self._device_graph_token

    def logical_nbytes(self, shape: tuple[int, ...] | None = None) -> int:
        return math.prod(self._logical if shape is None else shape) * self.dtype.numpy.itemsize

    def __repr__(self) -> str:
        state = "released" if self._buffer is None else f"{self._allocator.device_id}, ptr={self._buffer.ptr:#x}"
        return (f"DeviceIoBinding({self.label}, {self.dtype.name}, physical={list(self._physical)}, "
                f"logical={list(self._logical)}, {state})")

    # -- shapes ---------------------------------------------------------------------------------------
    def set_logical_shape(self, shape) -> None:
        shape = tuple(shape)
        if shape == self._logical:  # a decode loop sets the same shape most steps
            return
        physical = self._physical
        if len(shape) == len(physical) and all([type(n) is int and 0 <= n <= most for n, most in zip(shape, physical)]):
            self._logical = shape  # the common case, checked without building the messages' label
            return
        shape = _shape(shape, f"logical shape of {self.label}")
        _check_logical(self.label, physical, shape)
        self._logical = shape

    def set_appended_shape(self, shape: tuple[int, ...]) -> None:
        """set_logical_shape for a shape within capacity by construction (kv_append.py's windows, a decode mask)."""
        self._logical = shape

    def set_physical_and_logical_shapes(self, physical_shape, logical_shape) -> None:
        physical = _shape(physical_shape, f"physical shape of {self.label}")
        logical = _shape(logical_shape, f"logical shape of {self.label}")
        _check_logical(self.label, physical, logical)
        required = _bytes(self.dtype, physical, self.label)
        if required > self.buffer.size:
            raise InvalidArgumentError(
                f"device binding {self.label}: shape {list(physical)} needs {required} bytes but the allocation "
                f"has {self.buffer.size}; allocate with allocation_bytes of at least {required}"
            )
        self._physical, self._logical = physical, logical

    # -- committed ranges -----------------------------------------------------------------------------
    def commit_range(self, byte_offset: int, nbytes: int) -> None:
        self._allocator.commit_allocation_range(self.buffer, int(byte_offset), int(nbytes))

    def commit_binding_ranges(self, ranges) -> None:
        """Commit ``[(binding, offset, nbytes), ...]`` (bindings of this provider) as one transaction."""
        buffers = []
        for binding, offset, nbytes in ranges:
            if not isinstance(binding, DeviceIoBinding) or binding.allocator is not self._allocator:
                raise InvalidArgumentError(f"commit_binding_ranges takes bindings of {self._allocator.name}'s memory, "
                                           f"got {binding!r}")
            buffers.append((binding.buffer, int(offset), int(nbytes)))
        self._allocator.commit_allocation_ranges(buffers)

    def decommit_range(self, byte_offset: int, nbytes: int) -> None:
        self._allocator.decommit_allocation_range(self.buffer, int(byte_offset), int(nbytes))

    def committed_bytes(self) -> int:
        return int(self._allocator.hook.allocation_committed_bytes(buffer=self.buffer))

    # -- device-to-device -----------------------------------------------------------------------------
    def _scratch(self, scratch, nbytes: int, what: str) -> DeviceBuffer:
        buffer = scratch.buffer if isinstance(scratch, Tensor | DeviceIoBinding) else scratch
        if not isinstance(buffer, DeviceBuffer):
            raise InvalidArgumentError(f"{what} takes a DeviceBuffer, Tensor or DeviceIoBinding, got {scratch!r}")
        if buffer.device != self._allocator.device_id:
            raise InvalidArgumentError(
                f"{what} of {self.label}: the scratch is on {buffer.device}, the binding on "
                f"{self._allocator.device_id}; allocate it with binding.allocator"
            )
        if nbytes < 0 or nbytes > self.buffer.size:
            raise InvalidArgumentError(f"{what} of {nbytes} bytes exceeds the {self.buffer.size}-byte allocation of "
                                       f"{self.label}")
        if nbytes > buffer.size:
            raise InvalidArgumentError(f"{what} of {nbytes} bytes exceeds the {buffer.size}-byte scratch")
        return buffer

    def snapshot_device_into(self, scratch, nbytes: int) -> None:
        """Copy this buffer's first ``nbytes`` into ``scratch`` on the device (no host round trip)."""
        target = self._scratch(scratch, nbytes, "device snapshot")
        device_copy(self._allocator, self.buffer, 0, target, 0, nbytes)

    def restore_device_from(self, scratch, nbytes: int) -> None:
        """Copy ``scratch``'s first ``nbytes`` back into this buffer on the device; shapes unchanged, so a
        graph that recorded this address stays valid."""
        source = self._scratch(scratch, nbytes, "device restore")
        device_copy(self._allocator, source, 0, self.buffer, 0, nbytes)

    # -- host traffic ---------------------------------------------------------------------------------
    def _count(self, upload: bool, nbytes: int) -> None:
        s = self._stats
        if upload:
            self._stats = DeviceBindingTransferStats(s.host_upload_calls + 1, s.host_upload_bytes + nbytes,
                                                     s.host_download_calls, s.host_download_bytes)
        else:
            self._stats = DeviceBindingTransferStats(s.host_upload_calls, s.host_upload_bytes,
                                                     s.host_download_calls + 1, s.host_download_bytes + nbytes)

    def write_bytes(self, byte_offset: int, data) -> None:
        """Upload host bytes at ``byte_offset`` (bounds checked)."""
        view = _host_bytes(data)
        self._allocator.hook.copy_from_host_at(src=view, dst=self.buffer, byte_offset=int(byte_offset))
        self._count(True, int(view.size))

    def read_bytes(self) -> bytes:
        """The whole allocation, after the pending validation of the run that wrote it."""
        out = bytearray(self.buffer.size)
        self.read_bytes_into(out)
        return bytes(out)

    def read_bytes_into(self, out) -> None:
        target = _writable(out)
        if target.size > self.buffer.size:
            raise InvalidArgumentError(
                f"read of {target.size} bytes exceeds the {self.buffer.size}-byte allocation of {self.label}"
            )
        if target.size == 0:
            self._allocator.sync()
        else:
            self._allocator.copy_to_host(self.buffer, target)
        self._check_validation()
        self._count(False, int(target.size))

    def read_bytes_range(self, byte_offset: int, nbytes: int) -> bytes:
        byte_offset, nbytes = int(byte_offset), int(nbytes)
        if byte_offset < 0 or nbytes < 0 or byte_offset + nbytes > self.buffer.size:
            raise InvalidArgumentError(
                f"read range {byte_offset}..{byte_offset + nbytes} is outside the {self.buffer.size}-byte "
                f"allocation of {self.label}"
            )
        out = np.empty(nbytes, np.uint8)
        if nbytes == 0:
            self._allocator.sync()
        else:
            self._allocator.copy_to_host(self.buffer.alias(byte_offset, nbytes), out)
        self._check_validation()
        self._count(False, nbytes)
        return out.tobytes()

    def write_logical(self, array) -> None:
        """Upload ``array`` (this dtype, any shape within the capacity) as the valid part; the logical shape
        becomes its shape. One upload per contiguous run (one unless the strides are fixed)."""
        array = np.ascontiguousarray(array)
        if DataType.from_numpy(array.dtype) is not self.dtype:
            raise InvalidArgumentError(
                f"device binding {self.label} holds {self.dtype.name}, got a {array.dtype} array; convert it "
                f"with .astype(np.{self.dtype.numpy.name})"
            )
        shape = tuple(array.shape)
        _check_logical(self.label, self._physical, shape)
        raw = array.reshape(-1).view(np.uint8)
        for physical, compact, nbytes in self._runs(shape):
            self.write_bytes(physical, raw[compact: compact + nbytes])
        self._logical = shape

    def read_logical(self) -> np.ndarray:
        """Download the valid part as an array of the logical shape (after pending validation)."""
        shape = self._logical
        out = np.empty(shape, self.dtype.numpy)
        raw = out.reshape(-1).view(np.uint8)
        runs = self._runs(shape)
        if not runs:
            self.read_bytes_into(bytearray(0))
        for physical, compact, nbytes in runs:
            raw[compact: compact + nbytes] = np.frombuffer(self.read_bytes_range(physical, nbytes), np.uint8)
        return out

    def _runs(self, shape: tuple[int, ...]) -> list[tuple[int, int, int]]:
        itemsize = self.dtype.numpy.itemsize
        if self._fixed_strides and shape != self._physical:
            return strided_runs(self._physical, shape, itemsize)
        nbytes = self.logical_nbytes(shape)
        return [(0, 0, nbytes)] if nbytes else []

    # -- what a run records (device_binding_run.py) ----------------------------------------------------
    @property
    def validation_registration(self) -> DeviceValidationRegistration | None:
        """This binding's validation owner on its provider (output bindings become run recipients)."""
        return self._registration

    def set_device_validation(self, token: DeviceValidationToken, nodes=()) -> None:
        """The recipient token of the run that last wrote this binding: consumed at the next host read. ``nodes``
        names the run's nodes on the provider, which a failure names."""
        self._device_validation, self._validation_nodes = token, nodes

    def set_device_graph_token(self, token: DeviceGraphToken) -> None:
        """The captured graph generation that recorded this buffer's address: reset on release."""
        self._device_graph_token = token

    # -- deferred validation --------------------------------------------------------------------------
    def _check_validation(self) -> None:
        token = self._device_validation
        if token is None:
            return
        flags = self._allocator.hook.consume_device_validation_error(registration=self._registration, token=token)
        if flags:
            nodes = self._validation_nodes
            shown = ", ".join(nodes[:8]) + (f" and {len(nodes) - 8} more" if len(nodes) > 8 else "")
            raise DeviceValidationError(
                f"{self._allocator.name}: device validation failed (flags=0x{flags:x}) for the run that wrote "
                f"device binding {self.label}: a device kernel met invalid input data (e.g. an index out of "
                f"range), so its contents are not valid; check that run's inputs"
                + (f" of the nodes on {self._allocator.name}: {shown}" if shown else "")
            )

    # -- greedy decoding on the device ----------------------------------------------------------------
    def device_argmax_supported(self) -> bool:
        """Whether :meth:`device_argmax` can run: the provider's kernel, and float32/16/bf16 logits."""
        if self._argmax is None:  # a capability of the provider: asked once
            self._argmax = bool(self._allocator.hook.device_argmax_supported()) and self.dtype in ARGMAX_DTYPES
        return self._argmax

    def device_argmax(self, elements: int, batch: int, result: DeviceIoBinding, element_offset: int = 0) -> None:
        self.device_argmax_with_tie_break(elements, batch, result, ArgmaxTieBreak.LOWEST_INDEX, element_offset)

    def device_argmax_with_tie_break(self, elements: int, batch: int, result: DeviceIoBinding, tie_break,
                                     element_offset: int = 0) -> None:
        """Argmax of ``batch`` rows of ``elements`` logits starting at ``element_offset`` into ``result``
        (uint32: index, then the latched validation word, per row); on the device, no host sync."""
        if not isinstance(result, DeviceIoBinding):
            raise InvalidArgumentError(f"device argmax writes into a DeviceIoBinding, got {type(result).__name__}")
        if self.dtype not in ARGMAX_DTYPES or result.dtype is not DataType.UINT32:
            raise InvalidArgumentError(
                f"device argmax needs float32/float16/bfloat16 logits and a uint32 result, got {self.dtype.name} "
                f"({self.label}) and {result.dtype.name} ({result.label})"
            )
        self._same_provider(result, "device argmax")
        itemsize = self.dtype.numpy.itemsize
        offset = int(element_offset) * itemsize
        if offset < 0 or offset > self.buffer.size:
            raise InvalidArgumentError(f"element_offset {element_offset} is outside {self.label}")
        logits = self.buffer if offset == 0 else self.buffer.alias(offset)
        self._allocator.hook.device_argmax(logits=logits, elements=elements, batch=batch, dtype=self.dtype,
                                           result=result.buffer, tie_break=ArgmaxTieBreak(tie_break))

    def device_token_writer(self, input_ids: DeviceIoBinding, position_ids: DeviceIoBinding | None,
                            attention_mask: DeviceIoBinding, scratch: DeviceIoBinding, capacity: int,
                            next_position: int, mask_len: int, step: int) -> None:
        """Fold the token this argmax result holds into the decode bindings on the device (see the
        ``device_token_writer`` hook): ids, position, mask bit, ``scratch[step]`` and the error word."""
        position = self._writer_bindings(input_ids, position_ids, attention_mask, scratch)
        self._allocator.hook.device_token_writer(
            result=self.buffer, input_ids=input_ids.buffer, position_ids=position.buffer,
            attention_mask=attention_mask.buffer, scratch=scratch.buffer, capacity=int(capacity),
            next_position=int(next_position), mask_len=int(mask_len), write_position=position_ids is not None,
            step=int(step))

    def device_token_writer_at(self, input_ids: DeviceIoBinding, position_ids: DeviceIoBinding | None,
                               attention_mask: DeviceIoBinding, scratch: DeviceIoBinding, capacity: int,
                               mask_len: int, counter: DeviceIoBinding) -> None:
        """:meth:`device_token_writer` with the step and position read from ``counter`` (int64: step, next
        position) and advanced on the device (the ``device_token_writer_at`` hook): the same launch at every
        step, so a captured decode step replays it."""
        position = self._writer_bindings(input_ids, position_ids, attention_mask, scratch)
        self._same_provider(counter, "the device token writer")
        if counter.dtype is not DataType.INT64 or counter.buffer.size < 16:
            raise InvalidArgumentError(f"the token writer's counter holds two int64 words; {counter.label} does not")
        self._allocator.hook.device_token_writer_at(
            result=self.buffer, input_ids=input_ids.buffer, position_ids=position.buffer,
            attention_mask=attention_mask.buffer, scratch=scratch.buffer, capacity=int(capacity),
            mask_len=int(mask_len), write_position=position_ids is not None, counter=counter.buffer)

    def _writer_bindings(self, input_ids: DeviceIoBinding, position_ids: DeviceIoBinding | None,
                         attention_mask: DeviceIoBinding, scratch: DeviceIoBinding) -> DeviceIoBinding:
        """The token writer's bindings checked; the position binding (``input_ids`` standing in for none)."""
        if self.dtype is not DataType.UINT32 or scratch.dtype is not DataType.UINT32:
            raise InvalidArgumentError(
                f"the device token writer needs a uint32 result and scratch, got {self.dtype.name} and "
                f"{scratch.dtype.name}"
            )
        position = position_ids if position_ids is not None else input_ids  # a stand-in the kernel never writes
        for binding, dtype in ((input_ids, DataType.INT64), (position, DataType.INT64),
                               (attention_mask, DataType.INT64)):
            self._same_provider(binding, "the device token writer")
            if binding.dtype is not dtype:
                raise InvalidArgumentError(
                    f"the device token writer writes int64 ids, positions and mask; {binding.label} is "
                    f"{binding.dtype.name}"
                )
        self._same_provider(scratch, "the device token writer")
        return position

    def _same_provider(self, other: DeviceIoBinding, what: str) -> None:
        if other._allocator is not self._allocator:
            raise InvalidArgumentError(
                f"{what}: {other.label} belongs to {other._allocator.name}, {self.label} to "
                f"{self._allocator.name}; every binding must belong to the same provider"
            )

    # -- release --------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release safely (see the module docstring); idempotent. A session releases the bindings it made
        when it closes."""
        buffer, self._buffer = self._buffer, None
        if buffer is None:
            return
        RELEASES[0] += 1
        self._host_array = None
        _LIVE.pop(self, None)
        allocator = self._allocator
        problems = self._settle(buffer)
        if problems:
            _QUARANTINE.append((allocator, buffer))
            warnings.warn(f"device binding {self.label}: {'; '.join(problems)}; its allocation is quarantined "
                          f"(kept, never freed) rather than released under work that may still use it",
                          RuntimeWarning, stacklevel=2)
        else:
            allocator.deallocate(buffer)  # a borrowed buffer is only forgotten
        if self._registration is not None:
            try:
                allocator.hook.unregister_device_validation_owner(registration=self._registration)
                self._registration = None
            except Exception as exc:
                warnings.warn(f"device binding {self.label}: could not unregister its validation owner ({exc})",
                              RuntimeWarning, stacklevel=2)

    def _settle(self, buffer: DeviceBuffer) -> list[str]:
        """Synchronize, consume pending validation and reset the graph that recorded the address; what failed."""
        allocator = self._allocator
        problems: list[str] = []
        try:
            allocator.sync()
        except Exception as exc:
            problems.append(f"could not synchronize pending device work ({exc})")
        if not problems and self._device_validation is not None:
            try:
                flags = allocator.hook.consume_device_validation_error(registration=self._registration,
                                                                       token=self._device_validation)
                if flags:
                    warnings.warn(f"device binding {self.label} was released with a failed device validation "
                                  f"(flags=0x{flags:x}) nobody read", RuntimeWarning, stacklevel=3)
            except Exception as exc:
                problems.append(f"could not consume its deferred validation ({exc})")
        self._device_validation = None
        if self._device_graph_token is not None:
            try:
                allocator.hook.reset_owned_device_graph(token=self._device_graph_token)
            except Exception as exc:
                problems.append(f"could not reset the device graph that recorded its address ({exc})")
            self._device_graph_token = None
        if self._lent and not problems:  # synchronized: the caller may reuse the memory once this returns
            try:
                allocator.hook.return_device_memory(buffer=buffer)
                self._lent = False
            except Exception as exc:
                problems.append(f"its provider could not end the borrow of its memory ({exc})")
        return problems

    def __del__(self):
        if sys.is_finalizing():  # the process is ending: its devices may be gone already, and the memory with them
            return
        try:
            self.close()
        except Exception:  # never raise from a finalizer; a failed release leaks, never double-frees
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _geometry(spec) -> tuple[DataType, tuple[int, ...], tuple[int, ...], str]:
    if not isinstance(spec, DeviceBindingSpec | ExternalMemorySpec):
        raise InvalidArgumentError(
            f"expected a DeviceBindingSpec or ExternalMemorySpec, got {type(spec).__name__}"
        )
    label = _label(spec.input_name, spec.bind_input, spec.output_name)
    if spec.bind_input and not spec.input_name:
        raise InvalidArgumentError(f"device binding {label} binds an input but names none; set input_name")
    if not spec.bind_input and not spec.output_name and not spec.input_name:
        raise InvalidArgumentError("a device binding needs a name: an input, an output, or a scratch name")
    dtype = binding_dtype(spec.dtype)
    physical = _shape(spec.physical_shape, f"physical shape of {label}")
    logical = physical if spec.logical_shape is None else _shape(spec.logical_shape, f"logical shape of {label}")
    _check_logical(label, physical, logical)
    return dtype, physical, logical, label


def _label(input_name: str, bind_input: bool, output_name: str | None) -> str:
    if not bind_input and not output_name:
        return f"{input_name!r} (scratch)"
    return " -> ".join(repr(n) for n in (input_name if bind_input else "", output_name) if n)


def _bytes(dtype: DataType, shape: tuple[int, ...], label: str) -> int:
    try:
        return checked_expected_bytes(dtype, shape)
    except ShapeOverflowError as exc:
        raise ShapeOverflowError(f"device binding {label}: {exc}") from None


def _host_bytes(data) -> np.ndarray:
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, np.uint8)


def _writable(out) -> np.ndarray:
    view = out.reshape(-1).view(np.uint8) if isinstance(out, np.ndarray) else np.frombuffer(out, np.uint8)
    if not view.flags.writeable:
        raise InvalidArgumentError("read_bytes_into needs writable memory (a bytearray or a writable array)")
    return view


def device_copy(handle: ProviderHandle, src: DeviceBuffer, src_offset: int, dst: DeviceBuffer, dst_offset: int,
                nbytes: int) -> None:
    """A device-to-device copy on ``handle``: its stream-ordered hook where it has one (or host memory,
    where the default serves it), else its synchronous ``copy`` over aliases of the two ranges."""
    if nbytes and (handle.implements("copy_device_to_device") or handle.is_host_accessible):
        handle.hook.copy_device_to_device(src=src, src_offset=src_offset, dst=dst, dst_offset=dst_offset, nbytes=nbytes)
    elif nbytes:
        handle.hook.copy(src=src.alias(src_offset, nbytes), dst=dst.alias(dst_offset, nbytes, writable=True),
                         size=nbytes)
