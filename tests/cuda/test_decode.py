"""Greedy decoding on the device: ``device_argmax`` and ``device_token_writer`` (kernels/decode.cu).

Runs on the simulator (``ONNX_RUNTIME_CUDA_SIM=1``) by default; with ``ONNX_RUNTIME_CUDA_TESTS=real``
the same tests run against the real driver on a GPU machine.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
from onnx_runtime import ArgmaxTieBreak, DataType, DeviceGraphOwner, DeviceGraphSlot, Tensor
from onnx_runtime.errors import InvalidArgumentError

driver = pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
from onnx_runtime_ep_cuda.validation import INDEX_OUT_OF_RANGE  # noqa: E402

REAL = os.environ.get("ONNX_RUNTIME_CUDA_TESTS", "").lower() == "real"
LOWEST, HIGHEST = ArgmaxTieBreak.LOWEST_INDEX, ArgmaxTieBreak.HIGHEST_INDEX
NUMPY = {DataType.FLOAT: np.float32, DataType.FLOAT16: np.float16, DataType.BFLOAT16: ml_dtypes.bfloat16}


@pytest.fixture
def handle(cuda_handle):
    return cuda_handle


def argmax(h, logits: np.ndarray, tie_break=LOWEST, dtype=None) -> np.ndarray:
    """``device_argmax`` over the rows of ``logits``; returns the (batch, 2) uint32 result words."""
    batch, elements = logits.shape
    device_logits = Tensor.from_numpy(logits, provider=h)
    result = Tensor.zeros(DataType.UINT32, (batch, 2), provider=h)
    assert h.hook.device_argmax_supported() is True
    h.hook.device_argmax(logits=device_logits.buffer, elements=elements, batch=batch,
                         dtype=dtype or DataType.from_numpy(logits.dtype), result=result.buffer, tie_break=tie_break)
    return result.numpy()


def reference(logits: np.ndarray, tie_break) -> np.ndarray:
    as_float = logits.astype(np.float32)
    if tie_break is LOWEST:
        return np.argmax(as_float, axis=1)
    return as_float.shape[1] - 1 - np.argmax(as_float[:, ::-1], axis=1)


@pytest.mark.parametrize("dtype", list(NUMPY), ids=lambda d: d.name.lower())
@pytest.mark.parametrize("tie_break", [LOWEST, HIGHEST], ids=["lowest", "highest"])
def test_ties_resolve_both_ways_in_every_float_type(handle, dtype, tie_break):
    logits = np.array([
        [1, 5, 5, 2, 5, 0],  # a three-way tie
        [3, 3, 3, 3, 3, 3],  # all equal
        [-7, -2, -9, -2, -3, -8],  # negative maximum
        [0, 0, 1, 0, 0, 1],
    ], dtype=NUMPY[dtype])
    out = argmax(handle, logits, tie_break)
    expected = {LOWEST: [1, 0, 1, 2], HIGHEST: [4, 5, 3, 5]}[tie_break]
    np.testing.assert_array_equal(out[:, 0], expected)
    np.testing.assert_array_equal(out[:, 1], 0)  # no validation flag raised


@pytest.mark.parametrize("dtype", list(NUMPY), ids=lambda d: d.name.lower())
def test_batched_rows_longer_than_a_block(handle, dtype):
    rng = np.random.default_rng(7)
    # Few distinct values so that ties between threads' partial maxima are common.
    logits = rng.integers(-20, 20, size=(5, 3001)).astype(NUMPY[dtype])
    logits[2, 2999] = 40  # the last element
    logits[3, 0] = 40  # the first element
    for tie_break in (LOWEST, HIGHEST):
        out = argmax(handle, logits, tie_break)
        np.testing.assert_array_equal(out[:, 0], reference(logits, tie_break))
    assert out[2, 0] == 2999 and out[3, 0] == 0


def test_nan_ranks_above_every_number(handle):
    logits = np.array([[1, np.nan, 3, np.nan], [np.inf, 2, -np.inf, 0], [-np.inf, -np.inf, -np.inf, -np.inf]],
                      np.float32)
    np.testing.assert_array_equal(argmax(handle, logits, LOWEST)[:, 0], [1, 0, 0])
    np.testing.assert_array_equal(argmax(handle, logits, HIGHEST)[:, 0], [3, 0, 3])


def test_the_second_word_carries_the_latched_validation_flags(handle):
    registration = handle.hook.register_device_validation_owner()
    token = handle.hook.begin_device_validation(registration=registration)
    flags = handle.provider.device_validation().current_word()
    # A kernel earlier on the stream raised a flag (here: a device-side write of the bit).
    handle.copy_from_host(np.array([INDEX_OUT_OF_RANGE], np.uint32), _borrowed_word(handle, flags))
    out = argmax(handle, np.array([[0, 1], [2, 1]], np.float32))
    np.testing.assert_array_equal(out, [[1, INDEX_OUT_OF_RANGE], [0, INDEX_OUT_OF_RANGE]])
    handle.hook.activate_device_validation(submission=token)
    assert handle.hook.consume_device_validation_error(registration=registration, token=token) == INDEX_OUT_OF_RANGE
    handle.hook.unregister_device_validation_owner(registration=registration)


def _borrowed_word(h, address):
    from onnx_runtime.contract.buffers import DeviceBuffer, Ownership

    return DeviceBuffer(h.device_id, 4, 4, address, Ownership.BORROWED_MUT)


def test_argmax_arguments_are_checked(handle):
    logits = Tensor.from_numpy(np.zeros((2, 4), np.float32), provider=handle)
    result = Tensor.zeros(DataType.UINT32, (2, 2), provider=handle)
    host = Tensor.from_numpy(np.zeros((2, 4), np.float32))

    def call(**changes):
        kwargs = dict(logits=logits.buffer, elements=4, batch=2, dtype=DataType.FLOAT, result=result.buffer,
                      tie_break=LOWEST)
        kwargs.update(changes)
        handle.hook.device_argmax(**kwargs)

    with pytest.raises(InvalidArgumentError, match="float32, float16 or bfloat16"):
        call(dtype=DataType.INT32)
    with pytest.raises(InvalidArgumentError, match="logits holds 32 bytes, the kernel needs 40"):
        call(elements=5)
    with pytest.raises(InvalidArgumentError, match="result holds 16 bytes, the kernel needs 24"):
        call(batch=3, elements=2)
    with pytest.raises(InvalidArgumentError, match="elements must be an integer >= 1"):
        call(elements=0)
    with pytest.raises(InvalidArgumentError, match="must be a buffer on"):
        call(logits=host.buffer)
    with pytest.raises(InvalidArgumentError, match="tie_break"):
        call(tie_break="middle")
    call(batch=0)  # nothing to do
    call(tie_break=None)  # the default: lowest index


# -- token writer ---------------------------------------------------------------------------------------------------
class Bindings:
    def __init__(self, h, capacity=4, mask_len=6):
        self.h = h
        self.capacity = capacity
        self.result = Tensor.from_numpy(np.array([0, 0], np.uint32), provider=h)
        self.input_ids = Tensor.from_numpy(np.array([-1], np.int64), provider=h)
        self.position_ids = Tensor.from_numpy(np.array([-1], np.int64), provider=h)
        self.mask = Tensor.from_numpy(np.array([1, 1, 0, 0, 0, 0, 9, 9], np.int64), provider=h)  # 2 beyond mask_len
        self.scratch = Tensor.zeros(DataType.UINT32, (capacity + 1,), provider=h)
        self.mask_len = mask_len

    def set_result(self, token, error=0):
        self.h.copy_from_host(np.array([token, error], np.uint32), self.result.buffer)

    def write(self, next_position, step, write_position=True, position_ids=None):
        self.h.hook.device_token_writer(
            result=self.result.buffer, input_ids=self.input_ids.buffer,
            position_ids=(position_ids or self.position_ids).buffer, attention_mask=self.mask.buffer,
            scratch=self.scratch.buffer, capacity=self.capacity, next_position=next_position,
            mask_len=self.mask_len, write_position=write_position, step=step)


def test_the_token_writer_folds_the_token_into_the_bindings(handle):
    b = Bindings(handle)
    b.set_result(17)
    b.write(next_position=2, step=0)
    assert b.input_ids.numpy().tolist() == [17]
    assert b.position_ids.numpy().tolist() == [2]
    assert b.mask.numpy().tolist() == [1, 1, 1, 0, 0, 0, 9, 9]
    assert b.scratch.numpy().tolist() == [17, 0, 0, 0, 0]

    b.set_result(4, error=INDEX_OUT_OF_RANGE)
    b.write(next_position=3, step=1, write_position=False, position_ids=b.input_ids)  # no position binding
    assert b.input_ids.numpy().tolist() == [4]
    assert b.position_ids.numpy().tolist() == [2]  # untouched
    assert b.mask.numpy().tolist() == [1, 1, 1, 1, 0, 0, 9, 9]
    b.set_result(99, error=2)
    b.write(next_position=6, step=3)  # at mask_len: the mask write is guarded off
    assert b.mask.numpy().tolist() == [1, 1, 1, 1, 0, 0, 9, 9]
    assert b.position_ids.numpy().tolist() == [6]
    # scratch[step] holds each token; scratch[capacity] ORs every step's error word.
    assert b.scratch.numpy().tolist() == [17, 4, 0, 99, INDEX_OUT_OF_RANGE | 2]


def test_token_writer_arguments_are_checked(handle):
    b = Bindings(handle)
    with pytest.raises(InvalidArgumentError, match="step 4 is outside the scratch's 4 token slots"):
        b.write(next_position=0, step=4)
    with pytest.raises(InvalidArgumentError, match="attention_mask holds 64 bytes, the kernel needs 72"):
        b.mask_len = 9
        b.write(next_position=0, step=0)
    b.mask_len = 6
    with pytest.raises(InvalidArgumentError, match="next_position must be an integer >= 0"):
        b.write(next_position=-1, step=0)
    b.capacity = 5
    with pytest.raises(InvalidArgumentError, match="scratch holds 20 bytes, the kernel needs 24"):
        b.write(next_position=0, step=0)


def test_argmax_and_token_writer_replay_from_a_device_graph(handle):
    """Neither allocates nor synchronizes, so a decode step's tail can be captured and replayed."""
    b = Bindings(handle)
    logits = Tensor.from_numpy(np.array([[0.5, 3.0, 3.0, -1.0]], np.float16), provider=handle)
    # Run both once first, as a decode loop's warm-up step does: kernels are loaded outside the capture.
    handle.hook.device_argmax(logits=logits.buffer, elements=4, batch=1, dtype=DataType.FLOAT16,
                              result=b.result.buffer, tie_break=HIGHEST)
    b.write(next_position=0, step=0)
    handle.copy_from_host(np.zeros(5, np.uint32), b.scratch.buffer)
    owner = DeviceGraphOwner.new()
    token = handle.hook.begin_owned_device_graph_capture(owner=owner, slot=DeviceGraphSlot.PRIMARY,
                                                         continuation=None, kernels=[])
    handle.hook.device_argmax(logits=logits.buffer, elements=4, batch=1, dtype=DataType.FLOAT16,
                              result=b.result.buffer, tie_break=HIGHEST)
    b.write(next_position=2, step=1)
    handle.hook.end_owned_device_graph_capture(token=token)
    assert b.scratch.numpy().tolist() == [0] * 5  # nothing ran yet
    handle.hook.replay_owned_device_graph(token=token)
    assert b.result.numpy().tolist() == [2, 0]
    assert b.input_ids.numpy().tolist() == [2] and b.position_ids.numpy().tolist() == [2]
    assert b.scratch.numpy().tolist() == [0, 2, 0, 0, 0]
    handle.copy_from_host(np.array([[9.0, 1.0, 1.0, 1.0]], np.float16), logits.buffer)
    handle.hook.replay_owned_device_graph(token=token)  # replays read the logits' current contents
    assert b.scratch.numpy().tolist() == [0, 0, 0, 0, 0]
    handle.hook.retire_owned_device_graphs(owner=owner)
