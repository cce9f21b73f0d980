"""``device_copy_rows`` (contract 1.2) through the contract's default: one ``copy_device_to_device`` per row, with
bounds, pitch and overlap checks, so every provider serves the generate loop's one call per KV cache."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime.errors import InvalidArgumentError


@pytest.fixture
def cpu():
    from onnx_runtime import ProviderHandle
    from onnx_runtime_ep_cpu import CPUExecutionProvider

    handle = ProviderHandle(CPUExecutionProvider())
    handle.initialize({})
    yield handle
    handle.shutdown()


def _rows_copied(handle, data: np.ndarray, **kwargs) -> np.ndarray:
    src, dst = handle.allocate(data.nbytes, 64), handle.allocate(data.nbytes, 64)
    try:
        handle.copy_from_host(data, src)
        handle.copy_from_host(np.zeros_like(data), dst)
        handle.hook.device_copy_rows(src=src, dst=dst, **kwargs)
        return handle.download(dst, data.nbytes)
    finally:
        handle.deallocate(src)
        handle.deallocate(dst)


def test_the_default_copies_each_row_at_both_pitches(cpu):
    """A KV cache's move: 4 heads, rows at index 9 of a present of 10 rows per head into row 3 of a cache of 8."""
    assert not cpu.implements("device_copy_rows")  # served by the default
    heads, row = 4, 16 * 4
    present = np.random.default_rng(0).integers(0, 255, heads * 10 * row, dtype=np.uint8)
    out = _rows_copied(cpu, present, src_offset=9 * row, src_pitch=10 * row, dst_offset=3 * row,
                       dst_pitch=8 * row, row_bytes=row, rows=heads)
    want = np.zeros_like(present)
    for head in range(heads):
        start = (head * 8 + 3) * row
        want[start:start + row] = present[(head * 10 + 9) * row:(head * 10 + 10) * row]
    np.testing.assert_array_equal(out, want)


def test_a_device_provider_of_only_the_synchronous_copy_is_served_row_by_row():
    """The sample device provider (contract 1.1, memory the host cannot read, only ``copy``): the default copies
    each row through aliases of the two buffers."""
    from onnx_runtime import ProviderHandle
    from onnx_runtime_sample_provider import SampleDeviceExecutionProvider

    handle = ProviderHandle(SampleDeviceExecutionProvider())
    handle.initialize({})
    try:
        assert not handle.implements("copy_device_to_device") and not handle.is_host_accessible
        data = np.arange(3 * 48, dtype=np.uint8)
        out = _rows_copied(handle, data, src_offset=8, src_pitch=48, dst_offset=0, dst_pitch=16, row_bytes=16,
                           rows=3)
        np.testing.assert_array_equal(out[:48], np.concatenate([data[8 + 48 * r: 24 + 48 * r] for r in range(3)]))
        assert not out[48:].any()
    finally:
        handle.shutdown()


def test_nothing_to_copy_is_no_copy(cpu):
    data = np.arange(64, dtype=np.uint8)
    out = _rows_copied(cpu, data, src_offset=0, src_pitch=0, dst_offset=0, dst_pitch=0, row_bytes=0, rows=5)
    assert not out.any()


@pytest.mark.parametrize("kwargs, message", [
    ({"src_pitch": 8, "dst_pitch": 16, "row_bytes": 16, "rows": 2}, "pitches of at least"),
    ({"src_pitch": 16, "dst_pitch": 16, "row_bytes": 16, "rows": 5}, "exceeds"),
    ({"src_pitch": 16, "dst_pitch": 16, "row_bytes": -1, "rows": 2}, "non-negative"),
])
def test_bad_rows_are_typed_errors_naming_what_to_fix(cpu, kwargs, message):
    data = np.arange(64, dtype=np.uint8)
    with pytest.raises(InvalidArgumentError, match=message):
        _rows_copied(cpu, data, src_offset=0, dst_offset=0, **kwargs)


def test_overlapping_regions_are_refused(cpu):
    buffer = cpu.allocate(256, 64)
    try:
        with pytest.raises(InvalidArgumentError, match="overlap"):
            cpu.hook.device_copy_rows(src=buffer, src_offset=0, src_pitch=64, dst=buffer, dst_offset=32,
                                      dst_pitch=64, row_bytes=32, rows=3)
    finally:
        cpu.deallocate(buffer)


def test_the_contract_check_of_the_hook_passes_on_the_default(cpu):
    from onnx_runtime.testing.contract import check_for

    check_for("device_copy_rows")(cpu, "device_copy_rows")
