"""``device_copy_rows`` on the CUDA provider: one cuMemcpy2DAsync per call, and the generate loop's capacity bindings
move each step's appended KV rows with one such copy per cache (issue 21: it was one cuMemcpyDtoDAsync per head)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from onnx_runtime.errors import InvalidArgumentError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_generate import PROMPT, _model, onnxruntime_greedy  # noqa: E402

CUDA = "CUDAExecutionProvider"


def test_a_pitched_copy_is_one_driver_call(cuda_handle, monkeypatch):
    from test_device_graphs import CountingDriver

    device = cuda_handle.provider.cuda_device()
    counting = CountingDriver(device.driver)
    monkeypatch.setattr(device, "driver", counting)
    data = np.random.default_rng(1).integers(0, 255, 4 * 10 * 64, dtype=np.uint8)
    src, dst = cuda_handle.allocate(data.nbytes, 256), cuda_handle.allocate(data.nbytes, 256)
    try:
        cuda_handle.copy_from_host(data, src)
        cuda_handle.copy_from_host(np.zeros_like(data), dst)
        counting.calls.clear()
        cuda_handle.hook.device_copy_rows(src=src, src_offset=9 * 64, src_pitch=10 * 64, dst=dst, dst_offset=3 * 64,
                                          dst_pitch=8 * 64, row_bytes=64, rows=4)
        assert counting.calls == {"cuMemcpy2DAsync": 1}, counting.calls
        out = cuda_handle.download(dst, data.nbytes)
        with pytest.raises(InvalidArgumentError, match="pitches of at least"):
            cuda_handle.hook.device_copy_rows(src=src, src_offset=0, src_pitch=32, dst=dst, dst_offset=0,
                                              dst_pitch=64, row_bytes=64, rows=4)
    finally:
        cuda_handle.deallocate(src)
        cuda_handle.deallocate(dst)
    want = np.zeros_like(data)
    for head in range(4):
        want[(head * 8 + 3) * 64:(head * 8 + 4) * 64] = data[(head * 10 + 9) * 64:(head * 10 + 10) * 64]
    np.testing.assert_array_equal(out, want)


def test_the_contract_check_of_the_hook_passes_on_cuda(cuda_handle):
    from onnx_runtime.contract import VERSION
    from onnx_runtime.testing.contract import check_for

    assert cuda_handle.implements("device_copy_rows") and cuda_handle.contract_version == VERSION
    check_for("device_copy_rows")(cuda_handle, "device_copy_rows")


@pytest.mark.parametrize("name", ["gpt2.torchscript.fp32", "llama.dynamo.fp32"])
def test_capacity_bindings_move_each_cache_with_one_pitched_copy(name, cuda_driver_mode, monkeypatch):
    """On a provider without the counter hooks (contract 1.3, hidden here) every step moves its rows after the run;
    with them the decode steps move theirs inside the captured step (test_decode_step_counter_cuda) and only the
    prefill's rows are moved this way."""
    import onnx_runtime as ort
    from onnx_runtime.generate import Generator, _CapacityBindings
    from test_device_graphs import CountingDriver

    path = _model(name)
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    session = ort.InferenceSession(path, options, providers=[CUDA, "CPUExecutionProvider"])
    handle = session.provider_handle(CUDA)
    implements = handle.implements
    monkeypatch.setattr(handle, "implements", lambda hook: not hook.endswith("_at") and implements(hook))
    device = handle.provider.cuda_device()
    counting = CountingDriver(device.driver)
    monkeypatch.setattr(device, "driver", counting)
    per_step = []
    ran = _CapacityBindings._ran  # noqa: SLF001  (wrapped to count each step's driver calls)

    def counted(self, step, length):
        counting.calls.clear()
        ran(self, step, length)
        per_step.append(dict(counting.calls))

    monkeypatch.setattr(_CapacityBindings, "_ran", counted)
    new = 8
    generator = Generator(session)
    caches = len(generator.layout.caches)
    assert generator.generate(PROMPT, new).tokens == onnxruntime_greedy(path, PROMPT, new)
    # Per step: one pitched copy per cache, and the mask bits' one copy; no host sync or transfer.
    assert per_step == [{"cuMemcpy2DAsync": caches, "cuMemcpyDtoDAsync": 1}] * new, per_step
