"""The CUDA provider's deferred-validation flag words (validation.py) under the memory governor: each word is
charged to the device tier (role workspace, holder "... validation words") before it is allocated, a budget that
cannot take one refuses it before the driver is asked, and every charge comes back exactly once when the word is
freed (an owner unregistered, the provider shut down), also for words made before the governor was adopted."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper
from onnx_runtime import ProviderHandle
from onnx_runtime.contract.residency import HolderId
from onnx_runtime.memory import MemoryBudgetError, ProcessMemoryGovernor, process_governor, set_device_memory_limit

WORD = 8  # a flag word and its carry word (validation.py), one allocation


@pytest.fixture
def handle(cuda_driver_mode):
    from onnx_runtime_ep_cuda import CUDAExecutionProvider

    h = ProviderHandle(CUDAExecutionProvider())
    h.initialize({})
    yield h
    h.shutdown()


def _workspace(governor) -> int:
    return next((b["roles"].get("workspace", 0) for b in governor.snapshot()
                 if b["device"] == "cuda:0" and b["tier"] == "device"), 0)


def _adopt(handle, governor):
    """What the provider's adopt_memory_governor does for its words (the hook itself would also put the device's
    shared staging ring under this private governor, away from the process's)."""
    handle.provider.device_validation().govern(governor.device("cuda:0"), HolderId("CUDAExecutionProvider#9 "
                                                                                   "validation words"))


def test_words_are_charged_before_allocation_and_given_back_once(handle):
    governor = ProcessMemoryGovernor()
    validation = handle.provider.device_validation()
    early = handle.hook.register_device_validation_owner()
    token = handle.hook.begin_device_validation(registration=early)  # a word made before adoption
    handle.hook.activate_device_validation(submission=token)
    assert handle.hook.consume_device_validation_error(registration=early, token=token) == 0
    _adopt(handle, governor)
    assert _workspace(governor) == WORD == validation.charged  # taken over at adoption
    _adopt(handle, governor)  # adopting the same governor again charges nothing
    assert _workspace(governor) == WORD
    other = ProcessMemoryGovernor()
    _adopt(handle, other)  # another governor takes the charges over
    assert _workspace(other) == WORD and _workspace(governor) == 0
    _adopt(handle, governor)
    owners = [handle.hook.register_device_validation_owner() for _ in range(3)]
    for owner in owners:
        handle.hook.begin_device_validation(registration=owner)
    validation.current_word()  # the innermost open generation's word: no new one
    assert _workspace(governor) == 4 * WORD
    assert "validation words" in next(h for h in governor.snapshot()[0]["holders"] if "validation" in h)
    allocations = handle.provider.cuda_device().allocations
    governor.set_limit("cuda:0", governor.used("cuda:0") + WORD - 1)  # no room for one more word
    late = handle.hook.register_device_validation_owner()
    with pytest.raises(MemoryBudgetError, match=r"validation words.*short"):
        handle.hook.begin_device_validation(registration=late)
    assert handle.provider.cuda_device().allocations == allocations  # refused before the driver was asked
    governor.set_limit("cuda:0", None)
    for owner in owners:
        handle.hook.unregister_device_validation_owner(registration=owner)
        handle.hook.unregister_device_validation_owner(registration=owner)  # a second retirement frees nothing
    assert _workspace(governor) == WORD == validation.charged
    handle.hook.unregister_device_validation_owner(registration=late)
    validation.close()  # provider shutdown: the last word's charge comes back, once
    validation.close()
    assert _workspace(governor) == 0 and governor.used("cuda:0") == 0


@pytest.fixture
def gather_model(tmp_path) -> str:
    graph = helper.make_graph([helper.make_node("Gather", ["D", "I"], ["Y"], axis=0)], "gather",
                              [helper.make_tensor_value_info("D", TensorProto.FLOAT, [8, 4]),
                               helper.make_tensor_value_info("I", TensorProto.INT64, [3])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 4])])
    path = tmp_path / "gather.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


def test_a_sessions_words_are_charged_to_the_process_governor_and_returned_at_close(cuda_driver_mode, gather_model):
    gc.collect()
    governor = process_governor()
    before = _workspace(governor)
    session = ort.InferenceSession(gather_model, providers=["CUDAExecutionProvider"])
    data = np.arange(32, dtype=np.float32).reshape(8, 4)
    out = session.run(None, {"D": data, "I": np.array([7, 0, 3])})[0]
    np.testing.assert_allclose(out, data[[7, 0, 3]], rtol=0, atol=0)
    charged = session.provider_handle("CUDAExecutionProvider").provider.device_validation().charged
    assert charged >= WORD and _workspace(governor) - before == charged
    session.close()
    gc.collect()
    assert _workspace(governor) == before
    set_device_memory_limit("cuda:0", None)
