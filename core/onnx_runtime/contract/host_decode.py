"""The greedy-decoding hooks (``device_argmax``, ``device_token_writer``) over host-accessible memory.

They are the contract's defaults for providers whose "device" memory is host memory (the CPU provider),
so a decode loop written against the contract runs unchanged there. Semantics are the CUDA kernels'
(providers/cuda kernels/decode.cu): NaN ranks above every number, ties resolve to the lowest index (or
the highest with ``HIGHEST_INDEX``), and the second result word is the latched validation word, which a
host provider never raises (0).
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DataType
from ..errors import InvalidArgumentError
from .buffers import DeviceBuffer, Ownership
from .kernels import ArgmaxTieBreak

ARGMAX_DTYPES = (DataType.FLOAT, DataType.FLOAT16, DataType.BFLOAT16)


def _count(provider: str, value, what: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise InvalidArgumentError(f"{provider}: {what} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _view(provider: str, buffer, what: str, nbytes: int, writable: bool = False) -> np.ndarray:
    if not isinstance(buffer, DeviceBuffer):
        raise InvalidArgumentError(f"{provider}: {what} must be a DeviceBuffer, got {type(buffer).__name__}")
    if buffer.size < nbytes:
        raise InvalidArgumentError(f"{provider}: {what} holds {buffer.size} bytes, the operation needs {nbytes}")
    if writable and buffer.ownership is Ownership.BORROWED:
        raise InvalidArgumentError(f"{provider}: {what} is a read-only borrowed buffer; the operation writes it")
    return buffer.host_view()


def host_argmax(provider: str, logits: DeviceBuffer, elements, batch, dtype, result: DeviceBuffer,
                tie_break) -> None:
    """Argmax of ``batch`` rows of ``elements`` values into ``result`` (two uint32 words per row)."""
    elements = _count(provider, elements, "elements", 1)
    batch = _count(provider, batch, "batch")
    dtype = DataType.parse(dtype)
    if dtype not in ARGMAX_DTYPES:
        raise InvalidArgumentError(f"{provider}: device argmax takes float32, float16 or bfloat16 logits, got {dtype}")
    tie_break = ArgmaxTieBreak.checked(tie_break, provider)
    source = _view(provider, logits, "logits", elements * batch * dtype.numpy.itemsize)
    words = _view(provider, result, "result", 8 * batch, writable=True)[: 8 * batch].view(np.uint32)
    if batch == 0:
        return
    rows = source[: elements * batch * dtype.numpy.itemsize].view(dtype.numpy).reshape(batch, elements)
    if dtype is not DataType.FLOAT:
        rows = rows.astype(np.float32)
    # numpy's argmax takes the first maximum and ranks NaN above every number, as the CUDA kernel does.
    index = elements - 1 - np.argmax(rows[:, ::-1], axis=1) if tie_break.select_last_index else np.argmax(rows, axis=1)
    words[0::2] = index
    words[1::2] = 0


def host_token_writer(provider: str, result: DeviceBuffer, input_ids: DeviceBuffer, position_ids: DeviceBuffer,
                      attention_mask: DeviceBuffer, scratch: DeviceBuffer, capacity, next_position, mask_len,
                      write_position, step) -> None:
    """Fold ``result`` word 0 into the decode bindings (see the ``device_token_writer`` hook)."""
    capacity = _count(provider, capacity, "capacity")
    mask_len = _count(provider, mask_len, "mask_len")
    next_position = _count(provider, next_position, "next_position")
    step = _count(provider, step, "step")
    if step >= capacity:
        raise InvalidArgumentError(
            f"{provider}: step {step} is outside the scratch's {capacity} token slots (scratch[capacity] is the "
            f"error word)"
        )
    words = _view(provider, result, "result", 8)[:8].view(np.uint32)
    ids = _view(provider, input_ids, "input_ids", 8, writable=True)[:8].view(np.int64)
    positions = _view(provider, position_ids, "position_ids", 8, writable=bool(write_position))[:8].view(np.int64)
    mask = _view(provider, attention_mask, "attention_mask", 8 * mask_len, writable=True)[: 8 * mask_len].view(np.int64)
    tokens = _view(provider, scratch, "scratch", 4 * (capacity + 1), writable=True)[: 4 * (capacity + 1)]
    tokens = tokens.view(np.uint32)
    token, flags = int(words[0]), int(words[1])
    ids[0] = token
    if write_position:
        positions[0] = next_position
    if next_position < mask_len:
        mask[next_position] = 1
    tokens[step] = token
    tokens[capacity] |= flags


def host_token_writer_at(provider: str, result: DeviceBuffer, input_ids: DeviceBuffer, position_ids: DeviceBuffer,
                         attention_mask: DeviceBuffer, scratch: DeviceBuffer, capacity, mask_len, write_position,
                         counter: DeviceBuffer) -> None:
    """:func:`host_token_writer` with the step and position read from ``counter`` (two int64 words), which it
    then advances (see the ``device_token_writer_at`` hook)."""
    capacity = _count(provider, capacity, "capacity", 1)
    words = _view(provider, counter, "counter", 16, writable=True)[:16].view(np.int64)
    step, position = int(words[0]), int(words[1])
    if not 0 <= step < capacity or position < 0:
        tokens = _view(provider, scratch, "scratch", 4 * (capacity + 1), writable=True)[: 4 * (capacity + 1)]
        tokens.view(np.uint32)[capacity] |= STEP_OVERFLOW
        return
    host_token_writer(provider, result, input_ids, position_ids, attention_mask, scratch, capacity,
                      position, mask_len, write_position, step)
    words[0], words[1] = step + 1, position + 1


STEP_OVERFLOW = 0x80000000  # scratch[capacity] bit: a counter outside the token slots (kernels/decode.cu's too)


def host_copy_rows_at(provider: str, src: DeviceBuffer, src_offset, src_pitch, dst: DeviceBuffer, dst_pitch,
                      row_bytes, rows, counter: DeviceBuffer, word, bias, dst_unit, limit) -> None:
    """Rows from ``src`` to ``dst`` at the row index ``counter[word] + bias`` (see the ``device_copy_rows_at``
    hook): every index in ``[0, limit)`` is checked to name a destination inside ``dst``; others copy nothing."""
    src_offset, src_pitch, dst_pitch, row_bytes, rows, dst_unit, limit = (
        _count(provider, value, what) for value, what in (
            (src_offset, "src_offset"), (src_pitch, "src_pitch"), (dst_pitch, "dst_pitch"), (row_bytes, "row_bytes"),
            (rows, "rows"), (dst_unit, "dst_unit"), (limit, "limit")))
    if word not in (0, 1) or isinstance(word, bool) or isinstance(bias, bool) or not isinstance(bias, int | np.integer):
        raise InvalidArgumentError(f"{provider}: word is 0 (step) or 1 (position) and bias an integer; got "
                                   f"{word!r} and {bias!r}")
    if rows > 1 and min(src_pitch, dst_pitch) < row_bytes:
        raise InvalidArgumentError(
            f"{provider}: a row copy needs pitches of at least the row's {row_bytes} bytes; got {src_pitch} (source) "
            f"and {dst_pitch} (destination)")
    if not rows or not row_bytes or not limit:
        return
    src_span, dst_span = (rows - 1) * src_pitch + row_bytes, (limit - 1) * dst_unit + (rows - 1) * dst_pitch + row_bytes
    source = _view(provider, src, "row copy source", src_offset + src_span)
    target = _view(provider, dst, "row copy destination", dst_span, writable=True)
    start, end = src.ptr + src_offset, dst.ptr
    if start < end + dst_span and end < start + src_span:
        raise InvalidArgumentError(
            f"{provider}: the row copy's source overlaps a destination the counter can name (rows 0..{limit - 1}); "
            f"copy through a scratch buffer")
    index = int(_view(provider, counter, "counter", 16)[:16].view(np.int64)[word]) + int(bias)
    if not 0 <= index < limit:
        return
    for row in range(rows):
        at, to = src_offset + row * src_pitch, index * dst_unit + row * dst_pitch
        target[to: to + row_bytes] = source[at: at + row_bytes]
