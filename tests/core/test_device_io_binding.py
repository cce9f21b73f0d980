"""DeviceIoBinding, the seed's behaviours one by one: on the CPU provider (host memory through the contract's
defaults) and on the sample device provider (memory the host cannot read)."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import CopyCounter, make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime import DataType, DeviceBindingSpec, ExternalMemorySpec
from onnx_runtime.contract.markers import hookimpl
from onnx_runtime.errors import (
    InvalidArgumentError,
    NotSupportedError,
    ShapeOverflowError,
)
from onnx_runtime.session.device_io_binding import quarantined_allocations

CPU = "CPUExecutionProvider"
SAMPLE = "SampleDeviceExecutionProvider"
LOWEST, HIGHEST = ort.ArgmaxTieBreak.LOWEST_INDEX, ort.ArgmaxTieBreak.HIGHEST_INDEX


def _session(model, providers=(CPU,), capture=False):
    options = ort.SessionOptions()
    if capture:
        options.add_session_config_entry("session.graph_capture", "1")
    data = model if isinstance(model, bytes) else model.SerializeToString()
    return ort.InferenceSession(data, options, providers=list(providers))


@pytest.fixture
def kv_model():
    """present = Concat(past, new) on the sequence axis, and total = ReduceSum(present): a KV-cache step."""
    nodes = [helper.make_node("Concat", ["past", "new"], ["present"], axis=2),
             helper.make_node("ReduceSum", ["present"], ["total"], keepdims=0)]
    return make_model(nodes, [tensor_info("past", shape=[1, 2, "past_len", 4]), tensor_info("new", shape=[1, 2, 1, 4])],
                      [tensor_info("present", shape=[1, 2, "len", 4]), tensor_info("total", shape=[])])


@pytest.fixture
def shape_model():
    """seen = Shape(mask): what the kernels see of a binding."""
    nodes = [helper.make_node("Shape", ["mask"], ["seen"])]
    return make_model(nodes, [tensor_info("mask", TensorProto.INT64, [1, "n"])],
                      [tensor_info("seen", TensorProto.INT64, [2])])


def _kv(session, capacity=8, **options):
    return session.device_io_binding(DeviceBindingSpec.input(
        "past", np.float32, (1, 2, capacity, 4), (1, 2, 0, 4), output_name="present",
        expose_logical_input_shape=True, **options))


# -- physical and logical shapes, aliases -----------------------------------------------------------------
def test_a_kv_cache_grows_in_place_at_one_address(kv_model):
    sess = _session(kv_model)
    cache = _kv(sess)
    address, reference = cache.device_ptr, np.zeros((1, 2, 0, 4), np.float32)
    rng = np.random.default_rng(0)
    for step in range(6):
        new = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
        (total,) = sess.run_with_device_bindings([cache], {"new": new})
        reference = np.concatenate([reference, new], axis=2)
        assert cache.logical_shape == (1, 2, step + 1, 4) and cache.physical_shape == (1, 2, 8, 4)
        assert cache.device_ptr == address
        np.testing.assert_allclose(total, reference.astype(np.float64).sum(), rtol=1e-5)
    np.testing.assert_array_equal(cache.read_logical(), reference)
    assert cache.has_dynamic_logical_input_shape() and cache.exposes_logical_input_shape()


def test_an_output_beyond_the_capacity_is_refused_and_the_binding_kept(kv_model):
    sess = _session(kv_model)
    cache = _kv(sess, capacity=2)
    new = np.ones((1, 2, 1, 4), np.float32)
    sess.run_with_device_bindings([cache], {"new": new})
    sess.run_with_device_bindings([cache], {"new": 2 * new})
    before = cache.read_bytes()
    with pytest.raises(InvalidArgumentError, match=r"output 'present' has shape \[1, 2, 3, 4\], beyond the "
                                                   r"capacity \[1, 2, 2, 4\].*larger physical shape"):
        sess.run_with_device_bindings([cache], {"new": 3 * new})
    assert cache.logical_shape == (1, 2, 2, 4) and cache.read_bytes() == before


def test_kernels_see_the_capacity_unless_the_logical_shape_is_exposed(shape_model):
    sess = _session(shape_model)
    spec = dict(dtype=np.int64, physical_shape=(1, 16), logical_shape=(1, 5))
    padded = sess.device_io_binding(DeviceBindingSpec.input("mask", **spec))
    exposed = sess.device_io_binding(DeviceBindingSpec.input("mask", **spec, expose_logical_input_shape=True))
    frozen = sess.device_io_binding(DeviceBindingSpec.input("mask", **spec, expose_logical_input_shape=True,
                                                            decode_freeze_safe_mask=True))
    assert sess.run_with_device_bindings([padded])[0].tolist() == [1, 16]
    assert sess.run_with_device_bindings([exposed])[0].tolist() == [1, 5]
    assert sess.run_with_device_bindings([exposed], single_token_step=True)[0].tolist() == [1, 5]
    assert sess.run_with_device_bindings([frozen])[0].tolist() == [1, 5]  # prefill: the valid length
    assert sess.run_with_device_bindings([frozen], single_token_step=True)[0].tolist() == [1, 16]
    assert not padded.exposes_logical_input_shape() and not padded.has_dynamic_logical_input_shape()
    assert frozen.mask_decode_freeze_safe() and not exposed.mask_decode_freeze_safe()
    exposed.set_logical_shape((1, 16))  # exposing is static; dynamic follows the current shape
    assert exposed.exposes_logical_input_shape() and not exposed.has_dynamic_logical_input_shape()
    with pytest.raises(InvalidArgumentError, match=r"logical shape \[1, 17\] exceeds physical capacity \[1, 16\]"):
        exposed.set_logical_shape((1, 17))
    with pytest.raises(InvalidArgumentError, match="exceeds physical capacity"):
        exposed.set_logical_shape((16,))


def test_fixed_physical_strides_keep_every_row_at_its_address():
    """A record buffer [3 rows, capacity 5, 4]: each appended record lands at its physical offset."""
    nodes = [helper.make_node("Concat", ["past", "record"], ["present"], axis=1)]
    model = make_model(nodes, [tensor_info("past", shape=[3, "n", 4]), tensor_info("record", shape=[3, 1, 4])],
                       [tensor_info("present", shape=[3, "m", 4])])
    sess = _session(model)
    records = sess.device_io_binding(DeviceBindingSpec.input(
        "past", np.float32, (3, 5, 4), (3, 0, 4), output_name="present", expose_logical_input_shape=True,
        fixed_physical_strides=True))
    assert records.fixed_physical_strides() and not records.has_dynamic_logical_input_shape()
    reference = np.zeros((3, 0, 4), np.float32)
    for step in range(4):
        record = np.full((3, 1, 4), step + 1, np.float32) * np.arange(1, 4, dtype=np.float32).reshape(3, 1, 1)
        sess.run_with_device_bindings([records], {"record": record})
        reference = np.concatenate([reference, record], axis=1)
    np.testing.assert_array_equal(records.read_logical(), reference)
    physical = np.frombuffer(records.read_bytes(), np.float32).reshape(3, 5, 4)
    np.testing.assert_array_equal(physical[:, :4], reference)  # row r, record j at [r, j]: fixed addresses


def test_an_input_aliased_by_its_output_is_updated_in_place(device_model):
    """y = Relu(x) * x + b on the sample device, y written back into x's buffer: x <- f(x) each run."""
    sess = _session(device_model, (SAMPLE,))
    state = sess.device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 6), output_name="y"))
    x = np.random.default_rng(1).standard_normal((2, 6)).astype(np.float32)
    state.write_logical(x)
    bias = np.linspace(-1, 1, 6, dtype=np.float32).reshape(1, 6)
    for _ in range(3):
        assert sess.run_with_device_bindings([state]) == []
        x = np.maximum(x, 0) * x + bias
    np.testing.assert_allclose(state.read_logical(), x, rtol=1e-5)
    assert state.allocator.device_id == ort.DeviceId(ort.DeviceType.OTHER, 7)


# -- specs: typed errors ----------------------------------------------------------------------------------
def test_bad_specs_get_typed_errors_naming_the_fix(kv_model):
    sess = _session(kv_model)
    owner = np.zeros(64, np.float32)
    ptr = owner.ctypes.data
    cases = [
        (ExternalMemorySpec.input("past", None, np.float32, (1, 2, 2, 4), (1, 2, 2, 4), ptr + 2, 200),
         InvalidArgumentError, r"address 0x[0-9a-f]+, which is not a multiple of the 4-byte alignment FLOAT"),
        (ExternalMemorySpec.input("past", None, np.float32, (1, 2, 8, 4), (1, 2, 0, 4), ptr, 255),
         InvalidArgumentError, r"is 255 bytes but \[1, 2, 8, 4\] of FLOAT needs 256"),
        (ExternalMemorySpec.input("past", None, np.float32, (1, 2, 2, 4), (1, 2, 2, 4), 0, 256),
         InvalidArgumentError, "is null"),
        (DeviceBindingSpec.input("past", np.float32, (1, 2, 2, 4), (1, 2, 3, 4)),
         InvalidArgumentError, r"logical shape \[1, 2, 3, 4\] exceeds physical capacity \[1, 2, 2, 4\]"),
        (DeviceBindingSpec.input("pats", np.float32, (1, 2, 2, 4)), InvalidArgumentError,
         r"unknown input 'pats'; the model's inputs are \['past', 'new'\]"),
        (DeviceBindingSpec.output("presnt", np.float32, (1, 2, 2, 4)), InvalidArgumentError, "unknown output"),
        (DeviceBindingSpec.input("past", np.float16, (1, 2, 2, 4)), InvalidArgumentError,
         r"input 'past' is tensor\(float\).*dtype is FLOAT16"),
        (DeviceBindingSpec.input("past", np.float32, (1, 2, -1, 4)), InvalidArgumentError, "negative dimension"),
        (DeviceBindingSpec.input("past", np.float32, (1 << 40, 1 << 40, 1, 4)), ShapeOverflowError, "address space"),
        (DeviceBindingSpec.input("past", np.float32, (1, 2, 2, 4), allocation_bytes=8), InvalidArgumentError,
         "allocation_bytes is 8 but physical shape"),
        (DeviceBindingSpec(np.float32, (4,), "", True), InvalidArgumentError, "names none"),
        (DeviceBindingSpec(np.float32, (4,), "", False), InvalidArgumentError, "needs a name"),
    ]
    for spec, error, message in cases:
        with pytest.raises(error, match=message):
            sess.device_io_binding(spec)


def test_run_errors_name_the_binding_and_the_fix(kv_model, shape_model):
    sess, other = _session(kv_model), _session(kv_model)
    cache, foreign = _kv(sess), _kv(other)
    new = {"new": np.zeros((1, 2, 1, 4), np.float32)}
    with pytest.raises(InvalidArgumentError, match="not to a provider of this session"):
        sess.run_with_device_bindings([foreign], new)
    with pytest.raises(InvalidArgumentError, match="input 'past' is bound by two device bindings"):
        sess.run_with_device_bindings([cache, _kv(sess)], new)
    with pytest.raises(InvalidArgumentError, match="both fed and bound"):
        sess.run_with_device_bindings([cache], {**new, "past": np.zeros((1, 2, 0, 4), np.float32)})
    with pytest.raises(InvalidArgumentError, match="output 'present' is bound to device binding"):
        sess.run_with_device_bindings([cache], new, output_names=["present"])
    with pytest.raises(InvalidArgumentError, match="missing inputs 'new'"):
        sess.run_with_device_bindings([cache])
    shape_sess = _session(shape_model)
    wrong_rank = shape_sess.device_io_binding(DeviceBindingSpec.input("mask", np.int64, (2, 3)))
    with pytest.raises(InvalidArgumentError, match=r"input 'mask' dimension 0 must be 1"):
        shape_sess.run_with_device_bindings([wrong_rank])
    scratch = sess.device_io_binding(DeviceBindingSpec.scratch("tokens", np.uint32, (4,)))
    with pytest.raises(InvalidArgumentError, match=r"'tokens' \(scratch\) is bound to no input or output"):
        sess.run_with_device_bindings([cache, scratch], new)
    cache.close()
    with pytest.raises(InvalidArgumentError, match="was released"):
        sess.run_with_device_bindings([cache], new)


# -- external memory ----------------------------------------------------------------------------------------
def test_external_memory_is_written_in_place_and_never_freed(kv_model):
    sess = _session(kv_model)
    owner = np.zeros((1, 2, 4, 4), np.float32)
    cache = sess.device_io_binding(ExternalMemorySpec.input(
        "past", "present", np.float32, owner.shape, (1, 2, 0, 4), owner.ctypes.data, owner.nbytes,
        expose_logical_input_shape=True))
    assert cache.is_external and cache.device_ptr == owner.ctypes.data
    new = np.arange(8, dtype=np.float32).reshape(1, 2, 1, 4)
    sess.run_with_device_bindings([cache], {"new": new})
    np.testing.assert_array_equal(owner.reshape(-1)[:8], new.reshape(-1))  # compact at the start of the memory
    cache.close()
    owner[...] = 5  # still the caller's: writable, not freed
    assert owner.sum() == 5 * owner.size


# -- committed ranges ---------------------------------------------------------------------------------------
class ReservingProvider:
    """A host provider that reserves address space and commits ranges on request (recorded)."""

    def __init__(self):
        self.calls = []
        self.committed: dict[int, set] = {}

    @hookimpl
    def name(self):
        return "ReservingExecutionProvider"

    @hookimpl
    def allocate_committed(self, size, alignment, committed_ranges):
        from onnx_runtime.contract.defaults import allocate_host

        buffer = allocate_host(ort.DeviceId(ort.DeviceType.CPU, 0), size, alignment)
        self.committed[buffer.ptr] = {page for start, stop in committed_ranges for page in range(start, stop)}
        self.calls.append(("allocate", size, list(committed_ranges)))
        return buffer

    @hookimpl
    def commit_allocation_range(self, buffer, offset, nbytes):
        self.committed[buffer.ptr].update(range(offset, offset + nbytes))
        self.calls.append(("commit", offset, nbytes))

    @hookimpl
    def decommit_allocation_range(self, buffer, offset, nbytes):
        self.committed[buffer.ptr].difference_update(range(offset, offset + nbytes))
        self.calls.append(("decommit", offset, nbytes))

    @hookimpl
    def allocation_committed_bytes(self, buffer):
        return len(self.committed[buffer.ptr])


def test_committed_ranges_reach_the_provider():
    provider = ReservingProvider()
    handle = ort.ProviderHandle(provider)
    from onnx_runtime.session.device_io_binding import DeviceIoBinding

    spec = DeviceBindingSpec.input("kv", np.float32, (4, 64), allocation_bytes=4096, committed_ranges=[(0, 256)])
    binding = DeviceIoBinding.allocate(handle, spec)
    assert provider.calls == [("allocate", 4096, [(0, 256)])] and binding.committed_bytes() == 256
    binding.commit_range(256, 256)
    other = DeviceIoBinding.allocate(handle, DeviceBindingSpec.input("kv", np.float32, (4,), committed_ranges=[]))
    binding.commit_binding_ranges([(binding, 512, 512), (other, 0, 16)])
    assert binding.committed_bytes() == 1024 and other.committed_bytes() == 16
    binding.decommit_range(512, 512)
    assert binding.committed_bytes() == 512
    binding.set_physical_and_logical_shapes((16, 64), (8, 64))  # grows into the reserved bytes
    with pytest.raises(InvalidArgumentError, match="needs 4100 bytes but the allocation has 4096"):
        binding.set_physical_and_logical_shapes((1025,), (1,))


def test_eager_providers_commit_everything_and_refuse_decommit(kv_model):
    cache = _kv(_session(kv_model))
    assert cache.committed_bytes() == cache.nbytes == 256
    cache.commit_range(0, 256)
    with pytest.raises(InvalidArgumentError, match="commit range 200..300 exceeds the 256-byte buffer"):
        cache.commit_range(200, 100)
    with pytest.raises(NotSupportedError, match="partial decommit.*CPUExecutionProvider"):
        cache.decommit_range(0, 64)


# -- device-to-device snapshot and restore, host bytes ------------------------------------------------------
@pytest.mark.parametrize("provider", [CPU, SAMPLE])
def test_snapshot_and_restore_stay_on_the_device(device_model, provider):
    sess = _session(device_model, (provider,))
    state = sess.device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 6), output_name="y"))
    x = np.random.default_rng(2).standard_normal((2, 6)).astype(np.float32)
    state.write_logical(x)
    scratch = ort.Tensor.empty(DataType.FLOAT, (2, 6), provider=state.allocator)
    counter = CopyCounter(state.allocator)
    state.snapshot_device_into(scratch, state.nbytes)
    sess.run_with_device_bindings([state])  # overwrites the state
    assert not np.array_equal(state.read_logical(), x)
    before = counter.host_copies
    state.restore_device_from(scratch.buffer, state.nbytes)
    assert counter.host_copies == before  # device to device: no host transfer
    np.testing.assert_array_equal(state.read_logical(), x)
    with pytest.raises(InvalidArgumentError, match="exceeds the 48-byte allocation"):
        state.snapshot_device_into(scratch, 49)
    small = ort.Tensor.empty(DataType.FLOAT, (2,), provider=state.allocator)
    with pytest.raises(InvalidArgumentError, match="exceeds the 8-byte scratch"):
        state.restore_device_from(small, 48)
    if provider == SAMPLE:
        with pytest.raises(InvalidArgumentError, match="allocate it with binding.allocator"):
            state.snapshot_device_into(ort.Tensor.empty(DataType.FLOAT, (2, 6)), 48)


@pytest.mark.parametrize("provider", [CPU, SAMPLE])
def test_host_bytes_are_counted_every_transfer(device_model, provider):
    state = _session(device_model, (provider,)).device_io_binding(
        DeviceBindingSpec.input("x", np.float32, (2, 6)))
    assert state.transfer_stats == ort.DeviceBindingTransferStats()
    state.write_bytes(0, np.arange(12, dtype=np.float32))
    state.write_bytes(8, b"\0\0\0\0")
    assert np.frombuffer(state.read_bytes(), np.float32)[:4].tolist() == [0, 1, 0, 3]
    assert np.frombuffer(state.read_bytes_range(44, 4), np.float32).tolist() == [11]
    into = np.empty(3, np.float32)
    state.read_bytes_into(into)
    assert into.tolist() == [0, 1, 0]
    assert state.transfer_stats == ort.DeviceBindingTransferStats(2, 52, 3, 48 + 4 + 12)
    with pytest.raises(InvalidArgumentError, match="read range 40..52 is outside the 48-byte allocation"):
        state.read_bytes_range(40, 12)
    with pytest.raises(InvalidArgumentError, match="44..52 exceeds"):
        state.write_bytes(44, b"12345678")
    assert state.transfer_stats.host_upload_calls == 2  # failed transfers are not counted


# -- greedy decoding helpers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("numpy_type", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("tie_break", [LOWEST, HIGHEST], ids=["lowest", "highest"])
def test_device_argmax_breaks_ties_as_asked(numpy_type, tie_break):
    rows = np.array([[1, 5, 5, 2, 5, 0], [3, 3, 3, 3, 3, 3], [-7, -2, -9, -2, -3, -8], [0, np.nan, 1, np.nan, 0, 9]],
                    dtype=np.float32).astype(numpy_type)
    from onnx_runtime.session.device_io_binding import DeviceIoBinding

    handle = _session(make_model([helper.make_node("Identity", ["x"], ["y"])], [tensor_info("x", shape=[1])],
                                 [tensor_info("y", shape=[1])])).provider_handle(CPU)
    logits = DeviceIoBinding.allocate(handle, DeviceBindingSpec.input("x", numpy_type, rows.shape))
    result = DeviceIoBinding.allocate(handle, DeviceBindingSpec.input("r", np.uint32, (4, 2)))
    logits.write_logical(rows)
    assert logits.device_argmax_supported()
    logits.device_argmax_with_tie_break(6, 4, result, tie_break)
    expected = {LOWEST: [1, 0, 1, 1], HIGHEST: [4, 5, 3, 3]}[tie_break]  # NaN ranks above every number
    assert result.read_logical().tolist() == [[e, 0] for e in expected]
    logits.device_argmax(6, 1, result, element_offset=12)  # the third row alone
    assert result.read_logical()[0].tolist() == [1, 0]


def test_device_argmax_gates_dtypes_and_providers(device_model):
    from onnx_runtime.session.device_io_binding import DeviceIoBinding

    cpu = _session(device_model).device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 6))).allocator
    ids = DeviceIoBinding.allocate(cpu, DeviceBindingSpec.input("ids", np.int64, (4,)))
    result = DeviceIoBinding.allocate(cpu, DeviceBindingSpec.input("r", np.uint32, (2,)))
    assert not ids.device_argmax_supported()  # a provider that can, but not int64 logits
    with pytest.raises(InvalidArgumentError, match="float32/float16/bfloat16 logits and a uint32 result"):
        ids.device_argmax(4, 1, result)
    logits = DeviceIoBinding.allocate(cpu, DeviceBindingSpec.input("x", np.float32, (4,)))
    with pytest.raises(InvalidArgumentError, match="uint32 result, got FLOAT"):
        logits.device_argmax(4, 1, logits)
    sample = _session(device_model, (SAMPLE,)).device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 6)))
    sample_result = DeviceIoBinding.allocate(sample.allocator, DeviceBindingSpec.input("r", np.uint32, (2,)))
    assert not sample.device_argmax_supported()
    with pytest.raises(NotSupportedError, match="device argmax.*SampleDeviceExecutionProvider"):
        sample.device_argmax(12, 1, sample_result)
    with pytest.raises(InvalidArgumentError, match="every binding must belong to the same provider"):
        logits.device_argmax(4, 1, sample_result)


def test_the_token_writer_folds_the_token_into_the_bindings():
    from onnx_runtime.session.device_io_binding import DeviceIoBinding

    handle = ort.ProviderHandle(ReservingProvider())  # any host provider: the contract's defaults do the work

    def binding(name, dtype, shape):
        made = DeviceIoBinding.allocate(handle, DeviceBindingSpec.input(name, dtype, shape))
        made.write_logical(np.zeros(shape, dtype))
        return made

    result, ids = binding("r", np.uint32, (2,)), binding("ids", np.int64, (1, 1))
    positions = binding("p", np.int64, (1, 1))
    mask, scratch = binding("mask", np.int64, (1, 8)), binding("scratch", np.uint32, (5,))
    result.write_bytes(0, np.array([42, 0], np.uint32))
    result.device_token_writer(ids, positions, mask, scratch, capacity=4, next_position=3, mask_len=8, step=0)
    result.write_bytes(0, np.array([7, 2], np.uint32))
    result.device_token_writer(ids, None, mask, scratch, capacity=4, next_position=9, mask_len=8, step=1)
    assert ids.read_logical().tolist() == [[7]] and positions.read_logical().tolist() == [[3]]
    assert mask.read_logical().tolist() == [[0, 0, 0, 1, 0, 0, 0, 0]]  # position 9 lies beyond the mask
    assert scratch.read_logical().tolist() == [42, 7, 0, 0, 2]  # tokens, then the OR-ed error word
    with pytest.raises(InvalidArgumentError, match="step 4 is outside the scratch's 4 token slots"):
        result.device_token_writer(ids, None, mask, scratch, capacity=4, next_position=0, mask_len=8, step=4)
    with pytest.raises(InvalidArgumentError, match="writes int64 ids"):
        result.device_token_writer(scratch, None, mask, scratch, capacity=4, next_position=0, mask_len=8, step=0)


# -- release --------------------------------------------------------------------------------------------------
def test_owned_memory_is_freed_exactly_once_and_borrowed_never(device_model):
    sess = _session(device_model, (SAMPLE,))
    device = sess.provider_handle(SAMPLE)
    start = device.allocation_counts()
    state = sess.device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 6), output_name="y"))
    sess.run_with_device_bindings([state])
    state.close()
    state.close()  # idempotent
    owner = ort.Tensor.zeros(DataType.FLOAT, (2, 6), provider=device)
    borrowed = sess.device_io_binding(ExternalMemorySpec.input("x", "y", np.float32, (2, 6), (2, 6),
                                                               owner.device_ptr, owner.nbytes))
    sess.run_with_device_bindings([borrowed])
    del borrowed
    gc.collect()
    assert owner.numpy().tolist() == np.tile(np.linspace(-1, 1, 6, dtype=np.float32), (2, 1)).tolist()
    owner.close()  # the caller's free: the binding never freed it
    sess.close()
    gc.collect()
    allocations, frees = device.allocation_counts()
    assert allocations - start[0] >= 2 and allocations == frees and device.provider.memory == {}


class _Loans:
    """A plugin on a device provider's handle recording the contract's borrow hooks (1.5); optionally a failing
    sync, so a release is quarantined."""

    def __init__(self):
        self.calls: list[tuple[str, int, int]] = []
        self.fail_sync = False

    @hookimpl(tryfirst=True)
    def borrow_device_memory(self, buffer):
        self.calls.append(("borrow", buffer.ptr, buffer.size))

    @hookimpl(tryfirst=True)
    def return_device_memory(self, buffer):
        self.calls.append(("return", buffer.ptr, buffer.size))

    @hookimpl(tryfirst=True)
    def sync(self):
        if self.fail_sync:
            raise RuntimeError("device lost")


def test_each_borrow_of_device_memory_is_announced_and_returned_once(device_model):
    """External device memory is announced to its provider when bound (its instance owns it for ordering) and
    returned once at release, after the sync; allocated bindings are neither, and a quarantined release keeps
    the borrow. The sample provider (contract 1.1) gets the no-op defaults and still binds and releases it."""
    sess = _session(device_model, (SAMPLE,))
    device = sess.provider_handle(SAMPLE)
    loans = _Loans()
    device.pm.register(loans, name="loans")
    try:
        owned = sess.device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 6), output_name="y"))
        owner = ort.Tensor.zeros(DataType.FLOAT, (2, 6), provider=device)
        borrowed = sess.device_io_binding(ExternalMemorySpec.input("x", "y", np.float32, (2, 6), (2, 6),
                                                                   owner.device_ptr, owner.nbytes))
        assert loans.calls == [("borrow", owner.device_ptr, 48)]
        sess.run_with_device_bindings([borrowed])
        borrowed.close()
        borrowed.close()
        owned.close()
        assert loans.calls == [("borrow", owner.device_ptr, 48), ("return", owner.device_ptr, 48)]
        kept = sess.device_io_binding(ExternalMemorySpec.input("x", "y", np.float32, (2, 6), (2, 6),
                                                               owner.device_ptr, owner.nbytes))
        loans.fail_sync = True
        with pytest.warns(RuntimeWarning, match="quarantined"):
            kept.close()
        assert [call[0] for call in loans.calls] == ["borrow", "return", "borrow"]
        loans.fail_sync = False
    finally:
        device.pm.unregister(loans)
    np.testing.assert_array_equal(owner.numpy(), np.tile(np.linspace(-1, 1, 6, dtype=np.float32), (2, 1)))
    owner.close()
    sess.close()


class FailingSyncProvider(ReservingProvider):
    @hookimpl
    def name(self):
        return "FailingSyncExecutionProvider"

    @hookimpl
    def sync(self):
        raise RuntimeError("device lost")


def test_a_release_that_cannot_sync_quarantines_the_allocation():
    from onnx_runtime.session.device_io_binding import DeviceIoBinding

    handle = ort.ProviderHandle(FailingSyncProvider())
    binding = DeviceIoBinding.allocate(handle, DeviceBindingSpec.input("x", np.float32, (4,)))
    buffer = binding.buffer
    with pytest.warns(RuntimeWarning, match=r"could not synchronize pending device work \(device lost\).*quarantined"):
        binding.close()
    assert not buffer.released and any(b is buffer for _h, b in quarantined_allocations())


def test_release_resets_the_captured_graph_that_recorded_its_address(device_model):
    sess = _session(device_model, (SAMPLE,), capture=True)
    device = sess.provider_handle(SAMPLE)
    state = sess.device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 6), output_name="y"))
    state.write_logical(np.ones((2, 6), np.float32))
    counter = CopyCounter(state.allocator)
    for _ in range(4):  # size, capture, replay, replay
        sess.run_with_device_bindings([state])
    graph = state.device_graph_token
    assert sess.device_graph_status() == "replaying" and device.hook.has_owned_device_graph(token=graph)
    assert counter.per_call(lambda: sess.run_with_device_bindings([state]))[:2] == (0, 0)  # no host transfer
    x = np.ones((2, 6), np.float32)
    bias = np.linspace(-1, 1, 6, dtype=np.float32).reshape(1, 6)
    for _ in range(5):
        x = np.maximum(x, 0) * x + bias
    np.testing.assert_allclose(state.read_logical(), x, rtol=1e-5)
    launches = device.provider.graph_launches
    state.close()
    assert not device.hook.has_owned_device_graph(token=graph)  # the graph that used the freed address is gone
    with pytest.raises(InvalidArgumentError, match="no device graph is installed"):
        device.hook.replay_device_graph()
    assert device.provider.graph_launches == launches
    sess.close()


def test_closing_the_session_releases_its_bindings_first(device_model):
    sess = _session(device_model, (SAMPLE,))
    device = sess.provider_handle(SAMPLE)
    state = sess.device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 6), output_name="y"))
    sess.run_with_device_bindings([state])
    sess.close()  # the provider's memory goes with the session: the binding is released before it
    assert state.closed and device.provider.memory == {}
    with pytest.raises(InvalidArgumentError, match="was released"):
        state.read_bytes()
    state.close()  # still idempotent


@pytest.mark.parametrize("provider", [CPU, SAMPLE])
def test_fixed_strides_gather_and_scatter_rows_on_the_device(device_model, provider):
    """x [2, 6] read from rows of 8 and y written back into rows of 8: the padding columns are never touched."""
    sess = _session(device_model, (provider,))
    x = sess.device_io_binding(DeviceBindingSpec.input("x", np.float32, (2, 8), (2, 6), expose_logical_input_shape=True,
                                                       fixed_physical_strides=True))
    y = sess.device_io_binding(DeviceBindingSpec.output("y", np.float32, (2, 8), (2, 0), fixed_physical_strides=True))
    padded = np.full((2, 8), -9, np.float32)
    padded[:, :6] = np.random.default_rng(3).standard_normal((2, 6))
    x.write_bytes(0, padded)
    y.write_bytes(0, np.full((2, 8), 7, np.float32))
    sess.run_with_device_bindings([x, y])
    expected = np.maximum(padded[:, :6], 0) * padded[:, :6] + np.linspace(-1, 1, 6, dtype=np.float32)
    np.testing.assert_allclose(y.read_logical(), expected, rtol=1e-6)
    rows = np.frombuffer(y.read_bytes(), np.float32).reshape(2, 8)
    assert (rows[:, 6:] == 7).all()  # the scatter wrote 6 of each row's 8 places
