"""DeviceIoBinding on the CUDA provider (the simulator by default): a KV cache grown in place on the device,
deferred validation consumed at the binding's next host read, device-to-device snapshots, on-device argmax and
token writer in a greedy loop that never crosses to the host, external device memory, and safe release."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import CopyCounter, make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime import DataType, DeviceBindingSpec, ExternalMemorySpec
from onnx_runtime.errors import DeviceValidationError, InvalidArgumentError

CUDA = "CUDAExecutionProvider"
VOCAB, HIDDEN = 16, 8


@pytest.fixture(autouse=True)
def mode(cuda_driver_mode):
    yield


def _session(model, capture=False):
    options = ort.SessionOptions()
    if capture:
        options.add_session_config_entry("session.graph_capture", "1")
    return ort.InferenceSession(model.SerializeToString(), options, providers=[CUDA])


def test_a_kv_cache_grows_in_place_on_the_device():
    nodes = [helper.make_node("Concat", ["past", "new"], ["present"], axis=2)]
    model = make_model(nodes, [tensor_info("past", shape=[1, 2, "n", 4]), tensor_info("new", shape=[1, 2, 1, 4])],
                       [tensor_info("present", shape=[1, 2, "m", 4])])
    sess = _session(model)
    cache = sess.device_io_binding(DeviceBindingSpec.input("past", np.float32, (1, 2, 6, 4), (1, 2, 0, 4),
                                                           output_name="present", expose_logical_input_shape=True))
    new = sess.device_io_binding(DeviceBindingSpec.input("new", np.float32, (1, 2, 1, 4)))
    assert cache.allocator.name == CUDA and cache.buffer.host is None
    address, reference = cache.device_ptr, np.zeros((1, 2, 0, 4), np.float32)
    rng = np.random.default_rng(0)
    for _ in range(5):
        step = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
        new.write_logical(step)
        assert sess.run_with_device_bindings([cache, new]) == []
        reference = np.concatenate([reference, step], axis=2)
    assert cache.device_ptr == address and cache.logical_shape == (1, 2, 5, 4)
    np.testing.assert_array_equal(cache.read_logical(), reference)
    assert cache.transfer_stats == ort.DeviceBindingTransferStats(0, 0, 1, reference.nbytes)


@pytest.fixture
def gather_model():
    table = np.arange(VOCAB * HIDDEN, dtype=np.float32).reshape(VOCAB, HIDDEN)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0),
             helper.make_node("ReduceSum", ["rows"], ["total"], keepdims=0)]
    model = make_model(nodes, [tensor_info("ids", TensorProto.INT64, [2])],
                       [tensor_info("rows", shape=[2, HIDDEN]), tensor_info("total", shape=[])],
                       [onnx.numpy_helper.from_array(table, "table")])
    return model, table


def test_validation_is_consumed_at_the_next_host_read_of_the_output(gather_model):
    model, table = gather_model
    sess = _session(model)
    ids = sess.device_io_binding(DeviceBindingSpec.input("ids", np.int64, (2,)))
    rows = sess.device_io_binding(DeviceBindingSpec.output("rows", np.float32, (2, HIDDEN)))
    ids.write_logical(np.array([3, VOCAB + 5], np.int64))  # the second index is out of range
    sess.run_with_device_bindings([ids, rows], output_names=[])  # no host output: nothing read, nothing raised
    with pytest.raises(DeviceValidationError, match=r"flags=0x1.*device binding 'rows'"):
        rows.read_logical()
    with pytest.raises(DeviceValidationError):
        rows.read_bytes_range(0, 4)  # sticky until a run rewrites the binding
    ids.write_logical(np.array([3, 4], np.int64))
    sess.run_with_device_bindings([ids, rows], output_names=[])
    np.testing.assert_array_equal(rows.read_logical(), table[[3, 4]])
    ids.write_logical(np.array([VOCAB, 0], np.int64))
    with pytest.raises(DeviceValidationError):  # a host output is a host read: raised by the run itself
        sess.run_with_device_bindings([ids, rows], output_names=["total"])
    with pytest.warns(RuntimeWarning, match=r"'rows' was released with a failed device validation \(flags=0x1\)"):
        rows.close()  # its recipient token of that run is consumed on release
    with pytest.raises(DeviceValidationError):  # outside bound runs the provider's hooks are as they were
        sess.run(["total"], {"ids": np.array([0, VOCAB], np.int64)})
    assert sess.run(["total"], {"ids": np.array([0, 1], np.int64)})[0] == table[[0, 1]].sum()


def test_snapshot_and_restore_never_touch_the_host(gather_model):
    model, table = gather_model
    sess = _session(model)
    ids = sess.device_io_binding(DeviceBindingSpec.input("ids", np.int64, (2,)))
    rows = sess.device_io_binding(DeviceBindingSpec.output("rows", np.float32, (2, HIDDEN)))
    ids.write_logical(np.array([1, 2], np.int64))
    sess.run_with_device_bindings([ids, rows], output_names=[])
    scratch = ort.Tensor.empty(DataType.FLOAT, (2, HIDDEN), provider=rows.allocator)
    counter = CopyCounter(rows.allocator)
    rows.snapshot_device_into(scratch, rows.nbytes)
    ids.write_logical(np.array([7, 9], np.int64))
    sess.run_with_device_bindings([ids, rows], output_names=[])
    uploads_before = counter.uploads
    rows.restore_device_from(scratch, rows.nbytes)
    assert counter.uploads == uploads_before and counter.downloads == 0
    np.testing.assert_array_equal(rows.read_logical(), table[[1, 2]])


@pytest.fixture
def step_model():
    """logits = Gather(E, token) @ W: one greedy step, token int64 [1], logits [1, VOCAB]."""
    rng = np.random.default_rng(0)
    embedding = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    projection = rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["embedding", "token"], ["hidden"]),
             helper.make_node("MatMul", ["hidden", "projection"], ["logits"])]
    model = make_model(nodes, [tensor_info("token", TensorProto.INT64, [1])], [tensor_info("logits", shape=[1, VOCAB])],
                       [onnx.numpy_helper.from_array(embedding, "embedding"),
                        onnx.numpy_helper.from_array(projection, "projection")])
    return model, embedding, projection


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
def test_a_greedy_loop_stays_on_the_device(step_model, capture):
    model, embedding, projection = step_model
    sess = _session(model, capture)
    steps = 6
    token = sess.device_io_binding(DeviceBindingSpec.input("token", np.int64, (1,)))
    logits = sess.device_io_binding(DeviceBindingSpec.output("logits", np.float32, (1, VOCAB)))
    result = sess.device_io_binding(DeviceBindingSpec.scratch("argmax", np.uint32, (2,)))
    mask = sess.device_io_binding(DeviceBindingSpec.scratch("mask", np.int64, (1, steps + 1)))
    scratch = sess.device_io_binding(DeviceBindingSpec.scratch("tokens", np.uint32, (steps + 1,)))
    token.write_logical(np.array([3], np.int64))
    mask.write_logical(np.zeros((1, steps + 1), np.int64))
    scratch.write_logical(np.zeros(steps + 1, np.uint32))
    bindings = [token, logits, result, mask, scratch]
    before = [b.transfer_stats for b in bindings]
    counter = CopyCounter(token.allocator)
    assert logits.device_argmax_supported()
    for step in range(steps):
        sess.run_with_device_bindings([token, logits])
        logits.device_argmax(VOCAB, 1, result)
        result.device_token_writer(token, None, mask, scratch, capacity=steps, next_position=step, mask_len=steps + 1,
                                   step=step)
    assert counter.host_copies == 0 and [b.transfer_stats for b in bindings] == before
    want, last = [], 3
    for _ in range(steps):
        last = int(np.argmax(embedding[last] @ projection))
        want.append(last)
    drained = scratch.read_logical()
    assert drained[:steps].tolist() == want and drained[steps] == 0  # the tokens, then a clean error word
    assert mask.read_logical().tolist() == [[1] * steps + [0]]
    if capture:
        assert sess.device_graph_status() == "replaying" and token.device_graph_token is not None


def test_external_device_memory_is_checked_and_never_freed(step_model):
    model, embedding, projection = step_model
    sess = _session(model)
    device = sess.provider_handle(CUDA)
    owner = ort.Tensor.zeros(DataType.FLOAT, (1, VOCAB), provider=device)
    with pytest.raises(InvalidArgumentError, match="not a multiple of the 4-byte alignment"):
        sess.device_io_binding(ExternalMemorySpec.output("logits", np.float32, (1, VOCAB), (1, VOCAB),
                                                         owner.device_ptr + 2, owner.nbytes))
    with pytest.raises(InvalidArgumentError, match="is 63 bytes but"):
        sess.device_io_binding(ExternalMemorySpec.output("logits", np.float32, (1, VOCAB), (1, VOCAB),
                                                         owner.device_ptr, 63))
    logits = sess.device_io_binding(ExternalMemorySpec.output("logits", np.float32, (1, VOCAB), (1, VOCAB),
                                                              owner.device_ptr, owner.nbytes))
    sess.run_with_device_bindings([logits], {"token": np.array([5], np.int64)})
    logits.close()
    np.testing.assert_allclose(owner.numpy(), embedding[[5]] @ projection, rtol=1e-5, atol=1e-5)
    owner.close()  # the caller's: freed once, by the caller


def test_release_frees_once_and_resets_the_graph_that_recorded_the_address(step_model):
    model, *_ = step_model
    sess = _session(model, capture=True)
    device = sess.provider_handle(CUDA)
    token = sess.device_io_binding(DeviceBindingSpec.input("token", np.int64, (1,)))
    logits = sess.device_io_binding(DeviceBindingSpec.output("logits", np.float32, (1, VOCAB)))
    token.write_logical(np.array([1], np.int64))
    for _ in range(3):
        sess.run_with_device_bindings([token, logits])
    graph = token.device_graph_token
    assert sess.device_graph_status() == "replaying" and graph is not None
    assert device.hook.has_owned_device_graph(token=graph)
    token.close()
    assert not device.hook.has_owned_device_graph(token=graph)
    logits.close()
    sess.close()
    gc.collect()
    allocations, frees = device.allocation_counts() or (0, 0)
    assert allocations == frees


def test_a_growing_logical_length_replays_one_graph_at_capacity():
    """The issue's 0 captures for a growing length: bindings that show kernels their capacity keep one feed
    signature, so a loop whose valid length grows each step captures once and then replays."""
    capacity = 8
    nodes = [helper.make_node("Mul", ["cache", "mask"], ["masked"]),
             helper.make_node("ReduceSum", ["masked"], ["total"], axes=[1], keepdims=0)]
    model = make_model(nodes, [tensor_info("cache", shape=[1, capacity]), tensor_info("mask", shape=[1, capacity])],
                       [tensor_info("total", shape=[1])], opset=11)
    sess = _session(model, capture=True)
    cache = sess.device_io_binding(DeviceBindingSpec.input("cache", np.float32, (1, capacity), (1, 0)))
    mask = sess.device_io_binding(DeviceBindingSpec.input("mask", np.float32, (1, capacity), (1, 0)))
    total = sess.device_io_binding(DeviceBindingSpec.output("total", np.float32, (1,)))
    cache.write_logical(np.zeros((1, capacity), np.float32))
    mask.write_logical(np.zeros((1, capacity), np.float32))
    values = np.arange(1, capacity + 1, dtype=np.float32)
    for step in range(capacity):
        cache.write_bytes(4 * step, values[step: step + 1])  # the step's new entry, at its place
        mask.write_bytes(4 * step, np.ones(1, np.float32))
        cache.set_logical_shape((1, step + 1))
        mask.set_logical_shape((1, step + 1))
        sess.run_with_device_bindings([cache, mask, total])
        assert total.read_logical().tolist() == [values[: step + 1].sum()]
    runner = sess._executor.graphs  # noqa: SLF001  (the runner's counts: white box)
    assert (runner.captures, runner.replays) == (1, capacity - 1)  # sized, captured once, replayed after


def test_a_verification_step_captures_in_the_verify_slot_beside_the_decode_step():
    """A draft of 3 tokens verified in one run (VERIFY) between single-token steps (PRIMARY): each shape keeps
    its graph, and the bindings record the token of the slot that last ran them."""
    nodes = [helper.make_node("Gather", ["embedding", "ids"], ["rows"]),
             helper.make_node("MatMul", ["rows", "projection"], ["logits"])]
    rng = np.random.default_rng(4)
    embedding = rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32)
    projection = rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32)
    model = make_model(nodes, [tensor_info("ids", TensorProto.INT64, ["n"])],
                       [tensor_info("logits", shape=["n", VOCAB])],
                       [onnx.numpy_helper.from_array(embedding, "embedding"),
                        onnx.numpy_helper.from_array(projection, "projection")])
    sess = _session(model, capture=True)
    step_ids = sess.device_io_binding(DeviceBindingSpec.input("ids", np.int64, (1,)))
    step_logits = sess.device_io_binding(DeviceBindingSpec.output("logits", np.float32, (1, VOCAB)))
    draft_ids = sess.device_io_binding(DeviceBindingSpec.input("ids", np.int64, (3,)))
    draft_logits = sess.device_io_binding(DeviceBindingSpec.output("logits", np.float32, (3, VOCAB)))
    verify = ort.RunOptions()
    verify.add_run_config_entry("device_graph.slot", "verify")
    for round_ in range(4):
        step_ids.write_logical(np.array([round_], np.int64))
        sess.run_with_device_bindings([step_ids, step_logits])
        draft_ids.write_logical(np.array([round_, 5, 9], np.int64))
        sess.run_with_device_bindings([draft_ids, draft_logits], run_options=verify)
        np.testing.assert_allclose(step_logits.read_logical(), embedding[[round_]] @ projection, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(draft_logits.read_logical(), embedding[[round_, 5, 9]] @ projection, rtol=1e-5,
                                   atol=1e-5)
    assert step_ids.device_graph_token.slot == ort.DeviceGraphSlot.PRIMARY
    assert draft_ids.device_graph_token.slot == ort.DeviceGraphSlot.VERIFY
    runner = sess._executor.graphs  # noqa: SLF001  (the runner's counts: white box)
    assert runner.captures == 2 and sess.device_graph_status() == "replaying"


def _counting_driver(sess, monkeypatch):
    from test_device_graphs import CountingDriver

    device = sess.provider_handle(CUDA).provider.cuda_device()
    counting = CountingDriver(device.driver)
    monkeypatch.setattr(device, "driver", counting)
    return counting


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "captured"])
def test_a_bound_decode_step_neither_synchronizes_nor_transfers(step_model, capture, monkeypatch):
    """The issue's target for a replayed step: no host synchronization and no host transfer, counted at the
    driver. The run's validation is left to the output binding; opening the next step's submission used to read
    the previous one's flags back (a download and a synchronization per step), now it copies them on the device
    into the binding's own word."""
    model, embedding, projection = step_model
    sess = _session(model, capture)
    steps = 6
    token = sess.device_io_binding(DeviceBindingSpec.input("token", np.int64, (1,)))
    logits = sess.device_io_binding(DeviceBindingSpec.output("logits", np.float32, (1, VOCAB)))
    result = sess.device_io_binding(DeviceBindingSpec.scratch("argmax", np.uint32, (2,)))
    mask = sess.device_io_binding(DeviceBindingSpec.scratch("mask", np.int64, (1, steps + 1)))
    scratch = sess.device_io_binding(DeviceBindingSpec.scratch("tokens", np.uint32, (steps + 1,)))
    token.write_logical(np.array([3], np.int64))
    mask.write_logical(np.zeros((1, steps + 1), np.int64))
    scratch.write_logical(np.zeros(steps + 1, np.uint32))
    counting = _counting_driver(sess, monkeypatch)
    per_step = []
    for step in range(steps):
        counting.calls.clear()
        sess.run_with_device_bindings([token, logits])
        logits.device_argmax(VOCAB, 1, result)
        result.device_token_writer(token, None, mask, scratch, capacity=steps, next_position=step, mask_len=steps + 1,
                                   step=step)
        per_step.append((counting.syncs(), counting.host_transfers(), dict(counting.calls)))
    for syncs, transfers, calls in per_step[2:]:
        assert (syncs, transfers) == (0, 0), calls
        if capture:
            assert calls.get("cuGraphLaunch") == 1, calls
    want, last = [], 3
    for _ in range(steps):
        last = int(np.argmax(embedding[last] @ projection))
        want.append(last)
    np.testing.assert_allclose(logits.read_logical(), embedding[[want[-2]]] @ projection, rtol=1e-5, atol=1e-5)
    assert scratch.read_logical()[:steps].tolist() == want


def test_flags_of_a_run_left_unread_reach_its_binding_without_a_host_read(gather_model, monkeypatch):
    """A run with an index out of range writes binding ``a``; the next run writes ``b`` from valid indices. Opening
    the second run's submission carries the first's flags into ``a``'s own word on the device (no host read);
    ``a`` raises at its read, ``b`` does not."""
    model, table = gather_model
    sess = _session(model)
    ids = sess.device_io_binding(DeviceBindingSpec.input("ids", np.int64, (2,)))
    a = sess.device_io_binding(DeviceBindingSpec.output("rows", np.float32, (2, HIDDEN)))
    b = sess.device_io_binding(DeviceBindingSpec.output("rows", np.float32, (2, HIDDEN)))
    ids.write_logical(np.array([3, VOCAB + 5], np.int64))
    sess.run_with_device_bindings([ids, a], output_names=[])
    ids.write_logical(np.array([1, 2], np.int64))
    counting = _counting_driver(sess, monkeypatch)
    sess.run_with_device_bindings([ids, b], output_names=[])
    assert (counting.syncs(), counting.host_transfers()) == (0, 0), counting.calls
    np.testing.assert_array_equal(b.read_logical(), table[[1, 2]])
    with pytest.raises(DeviceValidationError, match=r"flags=0x1.*device binding 'rows'"):
        a.read_logical()
    with pytest.raises(DeviceValidationError):
        a.read_bytes_range(0, 4)  # sticky until a run rewrites it
    ids.write_logical(np.array([0, VOCAB], np.int64))
    sess.run_with_device_bindings([ids, b], output_names=[])  # invalid, then carried by a valid run into b's word
    ids.write_logical(np.array([4, 4], np.int64))
    sess.run_with_device_bindings([ids, a], output_names=[])
    np.testing.assert_array_equal(a.read_logical(), table[[4, 4]])
    with pytest.raises(DeviceValidationError, match="flags=0x1"):
        b.read_logical()


def test_committed_ranges_reserve_address_space_and_grow_it_in_place():
    """A spec with committed_ranges gets a mapped-growth allocation (providers/cuda reserved.py): the address is
    reserved at the capacity, memory is mapped as ranges are committed (from the start), a tail can be decommitted,
    and the address never moves, so what was written stays. Without the ranges the pool serves it whole."""
    from onnx_runtime.errors import NotSupportedError
    from onnx_runtime_ep_cuda.vmm import MappedGrowthBuffer

    nodes = [helper.make_node("Concat", ["past", "new"], ["present"], axis=2)]
    model = make_model(nodes, [tensor_info("past", shape=[1, 2, "n", 4]), tensor_info("new", shape=[1, 2, 1, 4])],
                       [tensor_info("present", shape=[1, 2, "m", 4])])
    sess = _session(model)
    rows = 1 << 17  # 4 MiB of float32 rows of 8 values: more than one 2 MiB granule
    cache = sess.device_io_binding(DeviceBindingSpec.input("past", np.float32, (1, 2, rows, 4), (1, 2, 0, 4),
                                                           output_name="present", committed_ranges=[(0, 64)]))
    reserved = cache.buffer.provider_state
    assert isinstance(reserved, MappedGrowthBuffer) and cache.nbytes == 8 * rows * 4
    granule = reserved.granularity
    assert cache.committed_bytes() == granule < cache.nbytes
    address = cache.device_ptr
    cache.write_bytes(0, np.arange(16, dtype=np.float32))
    cache.commit_range(granule, 16)  # up to the end of the second granule
    assert cache.committed_bytes() == 2 * granule and cache.device_ptr == address
    np.testing.assert_array_equal(np.frombuffer(cache.read_bytes_range(0, 64), np.float32), np.arange(16))
    with pytest.raises(InvalidArgumentError, match="only its tail"):
        cache.decommit_range(0, 64)
    cache.decommit_range(granule, cache.nbytes - granule)
    assert cache.committed_bytes() == granule and reserved.unmaps == 1
    whole = sess.device_io_binding(DeviceBindingSpec.input("new", np.float32, (1, 2, 1, 4)))
    assert not isinstance(whole.buffer.provider_state, MappedGrowthBuffer) and whole.committed_bytes() == 32
    with pytest.raises(NotSupportedError, match="nothing to decommit"):
        whole.decommit_range(0, 32)
    cache.close()
    assert reserved.unmaps == reserved.maps and reserved._closed  # noqa: SLF001

