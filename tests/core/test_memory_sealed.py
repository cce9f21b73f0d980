"""Sealed constants on a third-party device (the sample provider taught ``upload_sealed_constant``): two sessions
of one model hold its weights once, charged once to the device's budget, each gives the outputs of a session
alone, and the constants and their charge go with the last session. CUDA's own is tests/cuda/test_vmm_sealed.py."""

from __future__ import annotations

import gc
import itertools
from dataclasses import dataclass

import numpy as np
import onnx_runtime as ort
import pytest
from chain_models import external_chain
from onnx_runtime import DeviceBuffer
from onnx_runtime.contract.residency import ProviderContextIdentity
from onnx_runtime.memory import process_governor
from onnx_runtime.memory.sealed import live_sealed_constants
from onnx_runtime_sample_provider import SAMPLE_DEVICE, SampleDeviceExecutionProvider

NAME = "SealingSampleExecutionProvider"
DEVICE = "other:7"
D = 1024
_SEALED: dict[int, bytearray] = {}  # the context's immutable memory, readable by every instance's kernels
_ADDRESSES = itertools.count(1 << 44, 1 << 24)


@dataclass
class _Sealed:
    ptr: int
    size: int
    device: object = SAMPLE_DEVICE
    provider_context: ProviderContextIdentity = ProviderContextIdentity(NAME, 1)
    runtime_identity: int = 1

    def release(self) -> None:
        del _SEALED[self.ptr]


class SealingSampleExecutionProvider(SampleDeviceExecutionProvider):
    @ort.hookimpl
    def name(self):
        return NAME

    @ort.hookimpl
    def short_name(self):
        return "sealing-sample"

    @ort.hookimpl
    def runtime_identity(self):
        return 1

    @ort.hookimpl
    def provider_context_identity(self):
        return ProviderContextIdentity(NAME, 1)

    @ort.hookimpl
    def upload_sealed_constant(self, data, alignment):
        address = next(_ADDRESSES)
        _SEALED[address] = bytearray(np.ascontiguousarray(data).reshape(-1).view(np.uint8).tobytes())
        return _Sealed(address, len(_SEALED[address]))

    def _bytes(self, buffer: DeviceBuffer) -> np.ndarray:
        if buffer.ptr in _SEALED:
            return np.frombuffer(_SEALED[buffer.ptr], np.uint8)[: buffer.size]
        return super()._bytes(buffer)


@pytest.fixture
def sealing():
    ort.register_provider(SealingSampleExecutionProvider)
    gc.collect()
    yield NAME
    gc.collect()
    ort.unregister_provider(NAME)


def _weights_held(governor) -> int:
    return sum(b["roles"].get("weights", 0) for b in governor.snapshot() if b["device"] == DEVICE)


def test_two_sessions_of_one_model_hold_its_weights_once_on_a_third_party_device(tmp_path, sealing):
    path = external_chain(tmp_path / "m.onnx", D)
    weights = 8 * D * 4
    governor = process_governor()
    before, constants = _weights_held(governor), live_sealed_constants()
    x = np.random.default_rng(3).standard_normal((1, D)).astype(np.float32)
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    first = ort.InferenceSession(path, providers=[sealing, "CPUExecutionProvider"])
    assert live_sealed_constants() - constants == 8 and _weights_held(governor) - before == weights
    second = ort.InferenceSession(path, providers=[sealing, "CPUExecutionProvider"])
    assert live_sealed_constants() - constants == 8 and _weights_held(governor) - before == weights  # held once
    (report,) = second.memory_report()["weights"]
    assert report["sealed"] and report["shared"] == 8
    for session in (first, second):
        np.testing.assert_array_equal(session.run(None, {"X": x})[0], want)
    first.close()
    np.testing.assert_array_equal(second.run(None, {"X": x})[0], want)  # the survivor still reads them
    assert live_sealed_constants() - constants == 8
    second.close()
    assert live_sealed_constants() == constants and _weights_held(governor) == before and not _SEALED


def test_a_paged_session_reads_the_constants_another_session_sealed_and_seals_none_itself(tmp_path, sealing):
    path = external_chain(tmp_path / "m.onnx", D)
    governor = process_governor()
    constants = live_sealed_constants()
    x = np.random.default_rng(4).standard_normal((1, D)).astype(np.float32)
    want = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"X": x})[0]
    options = ort.SessionOptions()
    options.add_session_config_entry("session.weight_residency_budget", str(2 * D * 4))  # two of eight weights
    alone = ort.InferenceSession(path, options, providers=[sealing, "CPUExecutionProvider"])
    np.testing.assert_array_equal(alone.run(None, {"X": x})[0], want)
    (report,) = alone.memory_report()["weights"]
    assert report["paged"] and report["pages"] >= 8 and report["shared"] == 0
    assert live_sealed_constants() == constants  # paging seals nothing: the constants stay within its budget
    alone.close()
    first = ort.InferenceSession(path, providers=[sealing, "CPUExecutionProvider"])  # unpaged: seals all eight
    held = governor.used(DEVICE)
    paged = ort.InferenceSession(path, options, providers=[sealing, "CPUExecutionProvider"])
    for _ in range(2):
        np.testing.assert_array_equal(paged.run(None, {"X": x})[0], want)
    (report,) = paged.memory_report()["weights"]
    assert report["paged"] and report["pages"] == 0 and report["shared"] == 8 and report["resident_bytes"] == 0
    assert governor.used(DEVICE) == held + 2 * D * 4  # its budget's lease, and no copy of the weights
    first.close()  # the paged session's references keep the constants alive
    assert live_sealed_constants() - constants == 8
    np.testing.assert_array_equal(paged.run(None, {"X": x})[0], want)
    paged.close()
    assert live_sealed_constants() == constants and not _SEALED
