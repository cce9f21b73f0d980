"""Greedy decoding helpers behind ``device_argmax`` and ``device_token_writer`` (kernels/decode.cu).

Both only check their arguments on the host and launch one kernel on the compute stream: no allocation
and no host synchronization, so they can run inside a captured decode step. Every buffer must be a
live device buffer of this provider, large enough for what the kernel touches; the checks say which
one is not.
"""

from __future__ import annotations

import ctypes

from onnx_runtime import ArgmaxTieBreak, DataType
from onnx_runtime.contract.buffers import DeviceBuffer, Ownership
from onnx_runtime.errors import InvalidArgumentError

NAME = "CUDAExecutionProvider"
SOURCE = "decode.cu"
ARGMAX_THREADS = 256  # kernels/decode.cu's ARGMAX_THREADS
MAX_GRID = 65535  # rows beyond this are grid-strided
MAX_ROW = 0xFFFFFFFF - 1  # indices are uint32 and 0xFFFFFFFF marks "no element" in the kernel
ARGMAX_SUFFIX = {DataType.FLOAT: "f32", DataType.FLOAT16: "f16", DataType.BFLOAT16: "bf16"}


def _device_buffer(buffer, what: str, device_id, nbytes: int, writable: bool = False) -> int:
    """The address of ``buffer`` after checking it is a live device buffer of ours holding ``nbytes``."""
    if not isinstance(buffer, DeviceBuffer):
        raise InvalidArgumentError(f"{NAME}: {what} must be a DeviceBuffer, got {type(buffer).__name__}")
    if buffer.released:
        raise InvalidArgumentError(f"{NAME}: {what} at {buffer.ptr:#x} was already freed")
    if buffer.host is not None or buffer.device != device_id:
        raise InvalidArgumentError(
            f"{NAME}: {what} must be a buffer on {device_id}, got one on {buffer.device}; copy it to the device"
        )
    if writable and buffer.ownership is Ownership.BORROWED:
        raise InvalidArgumentError(f"{NAME}: {what} is a read-only borrowed buffer; the kernel writes it")
    if buffer.size < nbytes:
        raise InvalidArgumentError(f"{NAME}: {what} holds {buffer.size} bytes, the kernel needs {nbytes}")
    return buffer.ptr


def _count(value, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgumentError(f"{NAME}: {what} must be an integer >= {minimum}, got {value!r}")
    return value


def device_argmax(device, device_id, flags_address: int, logits, elements, batch, dtype, result, tie_break) -> None:
    """Launch the argmax of ``batch`` rows of ``elements`` ``dtype`` logits into ``result`` (2 uint32 per row)."""
    elements = _count(elements, "elements", 1)
    batch = _count(batch, "batch")
    if elements > MAX_ROW:
        raise InvalidArgumentError(f"{NAME}: device argmax rows hold at most {MAX_ROW} elements, got {elements}")
    try:
        dtype = DataType.parse(dtype)
    except Exception:
        dtype = None
    if dtype not in ARGMAX_SUFFIX:
        raise InvalidArgumentError(f"{NAME}: device argmax takes float32, float16 or bfloat16 logits, got {dtype}")
    tie_break = ArgmaxTieBreak.checked(tie_break, NAME)
    logits_ptr = _device_buffer(logits, "logits", device_id, elements * batch * dtype.numpy.itemsize)
    result_ptr = _device_buffer(result, "result", device_id, 8 * batch, writable=True)
    if batch == 0:
        return
    function = device.function(device.load(SOURCE), f"argmax_{ARGMAX_SUFFIX[dtype]}")
    device.launch(function, min(batch, MAX_GRID), ARGMAX_THREADS, [
        (logits_ptr, ctypes.c_void_p), (elements, ctypes.c_int64), (batch, ctypes.c_int64),
        (result_ptr, ctypes.c_void_p), (flags_address, ctypes.c_void_p), (int(tie_break.select_last_index),
                                                                           ctypes.c_int),
    ])


def device_token_writer(device, device_id, result, input_ids, position_ids, attention_mask, scratch, capacity,
                        next_position, mask_len, write_position, step) -> None:
    """Launch the token writer (see kernels/decode.cu and the ``device_token_writer`` hook)."""
    capacity = _count(capacity, "capacity")
    mask_len = _count(mask_len, "mask_len")
    next_position = _count(next_position, "next_position")
    step = _count(step, "step")
    if step >= capacity:
        raise InvalidArgumentError(
            f"{NAME}: step {step} is outside the scratch's {capacity} token slots (scratch[capacity] is the "
            f"error word)"
        )
    if step > 0xFFFFFFFF:
        raise InvalidArgumentError(f"{NAME}: step {step} does not fit the kernel's uint32")
    args = [
        (_device_buffer(result, "result", device_id, 8), ctypes.c_void_p),
        (_device_buffer(input_ids, "input_ids", device_id, 8, writable=True), ctypes.c_void_p),
        # Without a position binding the seed passes input_ids as a stand-in the kernel never writes.
        (_device_buffer(position_ids, "position_ids", device_id, 8, writable=bool(write_position)),
         ctypes.c_void_p),
        (_device_buffer(attention_mask, "attention_mask", device_id, 8 * mask_len, writable=True), ctypes.c_void_p),
        (_device_buffer(scratch, "scratch", device_id, 4 * (capacity + 1), writable=True), ctypes.c_void_p),
        (capacity, ctypes.c_int64), (next_position, ctypes.c_int64), (mask_len, ctypes.c_int64),
        (int(bool(write_position)), ctypes.c_int), (step, ctypes.c_uint32),
    ]
    device.launch(device.function(device.load(SOURCE), "token_writer"), 1, 1, args)


COPY_THREADS = 256


def device_token_writer_at(device, device_id, result, input_ids, position_ids, attention_mask, scratch, capacity,
                           mask_len, write_position, counter) -> None:
    """Launch the counter-driven token writer (see kernels/decode.cu and the ``device_token_writer_at`` hook):
    the step and position are the two int64 words of ``counter``, which the kernel advances."""
    capacity = _count(capacity, "capacity", 1)
    mask_len = _count(mask_len, "mask_len")
    args = [
        (_device_buffer(result, "result", device_id, 8), ctypes.c_void_p),
        (_device_buffer(input_ids, "input_ids", device_id, 8, writable=True), ctypes.c_void_p),
        (_device_buffer(position_ids, "position_ids", device_id, 8, writable=bool(write_position)),
         ctypes.c_void_p),
        (_device_buffer(attention_mask, "attention_mask", device_id, 8 * mask_len, writable=True), ctypes.c_void_p),
        (_device_buffer(scratch, "scratch", device_id, 4 * (capacity + 1), writable=True), ctypes.c_void_p),
        (capacity, ctypes.c_int64), (mask_len, ctypes.c_int64), (int(bool(write_position)), ctypes.c_int),
        (_device_buffer(counter, "counter", device_id, 16, writable=True), ctypes.c_void_p),
    ]
    device.launch(device.function(device.load(SOURCE), "token_writer_at"), 1, 1, args)


def device_copy_rows_at(device, device_id, src, src_offset, src_pitch, dst, dst_pitch, row_bytes, rows, counter,
                        word, bias, dst_unit, limit) -> None:
    """Launch the row copy whose destination row is read from ``counter`` (see the ``device_copy_rows_at``
    hook). Every destination the counter can name, rows ``[0, limit)``, is checked against ``dst`` here."""
    src_offset, src_pitch, dst_pitch = (_count(src_offset, "src_offset"), _count(src_pitch, "src_pitch"),
                                        _count(dst_pitch, "dst_pitch"))
    row_bytes, rows, dst_unit, limit = (_count(row_bytes, "row_bytes"), _count(rows, "rows"),
                                        _count(dst_unit, "dst_unit"), _count(limit, "limit"))
    if word not in (0, 1) or isinstance(word, bool):
        raise InvalidArgumentError(f"{NAME}: word selects counter word 0 (step) or 1 (position), got {word!r}")
    if isinstance(bias, bool) or not isinstance(bias, int):
        raise InvalidArgumentError(f"{NAME}: bias must be an integer, got {bias!r}")
    if rows > 1 and min(src_pitch, dst_pitch) < row_bytes:
        raise InvalidArgumentError(
            f"{NAME}: a row copy needs pitches of at least the row's {row_bytes} bytes; got {src_pitch} (source) "
            f"and {dst_pitch} (destination)")
    if not rows or not row_bytes or not limit:
        return
    src_span = (rows - 1) * src_pitch + row_bytes
    dst_span = (limit - 1) * dst_unit + (rows - 1) * dst_pitch + row_bytes  # the farthest row the counter can name
    source = _device_buffer(src, "row copy source", device_id, src_offset + src_span) + src_offset
    target = _device_buffer(dst, "row copy destination", device_id, dst_span, writable=True)
    if source < target + dst_span and target < source + src_span:
        raise InvalidArgumentError(
            f"{NAME}: the row copy's source overlaps a destination the counter can name (rows 0..{limit - 1}); "
            f"copy through a scratch buffer")
    args = [(source, ctypes.c_void_p), (src_pitch, ctypes.c_int64), (target, ctypes.c_void_p),
            (dst_pitch, ctypes.c_int64), (row_bytes, ctypes.c_int64), (rows, ctypes.c_int64),
            (_device_buffer(counter, "counter", device_id, 16), ctypes.c_void_p), (word, ctypes.c_int),
            (bias, ctypes.c_int64), (dst_unit, ctypes.c_int64), (limit, ctypes.c_int64)]
    device.launch(device.function(device.load(SOURCE), "copy_rows_at"), min(rows, MAX_GRID),
                  min(COPY_THREADS, max(1, row_bytes // 4 if row_bytes % 4 == 0 else row_bytes)), args)
