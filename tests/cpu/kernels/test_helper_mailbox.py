"""The helper threads' mailboxes (compiled/mailbox.py, workers.Kind, jobs.py): each kind's writer and
reader, both generated from its one description, agree on every field (a round trip per kind, on any
x86-64 host: no kernel runs); descriptions that do not hold together are refused at import; and the
platform check of compiled/host.py, whose refusal leaves every part on the calling thread."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from onnx_runtime_ep_cpu.compiled import attention, epilogue, gemm, host, jit, jobs, mailbox, matmul, workers

KINDS = ["CONV", "MATMUL", "ATTENTION", "PRODUCT", "PAD", "POOL", "AFFINE", "DEPTHWISE"]
_DTYPES = {"float32": np.float32, "int64": np.int64, "uint64": np.uint64}


def _arguments(kind: workers.Kind) -> tuple:
    """A part's arguments for ``kind``, each field told apart: arrays of distinct sizes and values (the
    derived dimensions as their description computes them), distinct integers, flags set, pairs."""
    built, counter = {}, iter(range(2, 1000))
    for field in sorted(kind.layout.fields, key=lambda field: field.derived):  # derived shapes last
        if field.is_array:
            shape = tuple(next(counter) if dim is mailbox.STORED else eval(dim, {}, built) if isinstance(dim, str)
                          else dim for dim in field.shape)
            values = np.arange(np.prod(shape)) + 7 * next(counter)
            built[field.name] = values.astype(_DTYPES[field.kind]).reshape(shape)
        elif field.kind == "flag":
            built[field.name] = True
        elif field.kind == "pair":
            built[field.name] = (next(counter), -next(counter))
        else:
            built[field.name] = -1000 * next(counter)  # negative integers too: the slots are int64
    return tuple(built[field.name] for field in kind.layout.fields)


@pytest.mark.parametrize("name", KINDS)
def test_each_kind_reads_back_what_its_writer_wrote(name):
    kind = getattr(jobs, name)
    arguments = _arguments(kind)
    m = np.full(workers.MAILBOX_SIZE, -7, dtype=np.int64)
    kind.writer(m, *arguments)
    assert (m[:workers.ARGS] == -7).all()  # the header (sequence numbers, runner, scratch) left alone
    read = kind.reader(m)
    assert len(read) == len(arguments) == len(kind.layout.fields)
    for field, written, got in zip(kind.layout.fields, arguments, read):
        if field.is_array:
            assert got.ctypes.data == written.ctypes.data, field.name  # a view of the same memory
            assert got.shape == written.shape and got.dtype == written.dtype, field.name
            np.testing.assert_array_equal(got, written, err_msg=field.name)
        elif field.kind == "flag":
            assert got is True or got == np.True_, field.name
        else:
            assert tuple(np.atleast_1d(got)) == tuple(np.atleast_1d(written)), field.name


@pytest.mark.parametrize("name", KINDS)
def test_each_kind_fits_its_mailbox_and_keeps_the_names_compiled_callers_use(name):
    kind = getattr(jobs, name)
    assert workers.ARGS <= min(kind.layout.slots.values()) and kind.layout.end <= workers.MAILBOX_SIZE
    assert hasattr(kind.writer, "py_func") and hasattr(kind.reader, "py_func")  # numba-compiled, both
    assert getattr(jobs, f"_write_{name.lower()}") is kind.writer  # what the split_* callers post with


def test_a_flag_is_stored_as_one_or_zero():
    arguments = list(_arguments(jobs.POOL))
    m = np.zeros(workers.MAILBOX_SIZE, dtype=np.int64)
    flag = [field.name for field in jobs.POOL.layout.fields].index("is_max")
    for value, stored in ((True, 1), (False, 0), (np.bool_(True), 1), (2, 1)):
        arguments[flag] = value
        jobs.POOL.writer(m, *arguments)
        assert m[jobs.POOL.layout.slots["is_max"]] == stored
        assert bool(jobs.POOL.reader(m)[flag]) == bool(stored)


def test_the_generated_text_is_the_description_in_slots():
    layout = mailbox.Layout((mailbox.floats("a", 2), mailbox.scalar("n"), mailbox.flag("on"), mailbox.pair("hw"),
                             mailbox.ints("b", shape=(mailbox.STORED, 3)),
                             mailbox.offsets("c", shape=("a.shape[1] + 1",))), 8, 64)
    assert layout.slots == {"a": 8, "n": 11, "on": 12, "hw": 13, "b": 15, "c": 17} and layout.end == 18
    assert layout.writer_source("w").splitlines() == [
        "def w(m, a, n, on, hw, b, c):", "    m[8] = a.ctypes.data", "    m[9] = a.shape[0]", "    m[10] = a.shape[1]",
        "    m[11] = n", "    m[12] = 1 if on else 0", "    m[13] = hw[0]", "    m[14] = hw[1]",
        "    m[15] = b.ctypes.data", "    m[16] = b.shape[0]", "    m[17] = c.ctypes.data"]
    assert layout.reader_source("r").splitlines()[-2:] == [
        "    c = offset_array(m[17], (a.shape[1] + 1,))", "    return (a, n, on, hw, b, c,)"]


@pytest.mark.parametrize("fields,message", [
    ((mailbox.scalar("n"), mailbox.scalar("n")), "described twice"),
    ((mailbox.scalar("m"),), "generated code uses"),
    ((mailbox.floats("a", 60),), "past the mailbox"),
    ((mailbox.ints("a", shape=("n + 1",)), mailbox.scalar("n")), "names ['n']"),
    ((mailbox.ints("a", shape=(1.5,)),), "is not STORED"),
    ((mailbox.Field("a", "float16", (None,)),), "unknown kind"),
])
def test_a_description_that_does_not_hold_together_is_refused(fields, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        mailbox.Layout(fields, workers.ARGS, workers.MAILBOX_SIZE)


def test_a_body_that_does_not_take_the_described_fields_is_refused():
    def body(x, y, scratch):
        pass

    with pytest.raises(ValueError, match=r"parameters \['y'\] are no field, fields \['n'\] no parameter"):
        workers.Kind("t", (mailbox.floats("x"), mailbox.scalar("n")), body, home=__name__)


def test_a_kind_reads_its_scratch_size_from_the_fields_it_names():
    """The same sizes as the positions the hand-numbered writers had (channels, kh, kw at 11-13 ...)."""
    conv, product, attend = (_arguments(kind) for kind in (jobs.CONV, jobs.MATMUL, jobs.ATTENTION))
    assert jobs.CONV.scratch_floats(conv) == gemm.scratch_size(conv[11] * conv[12] * conv[13])
    assert jobs.MATMUL.scratch_floats(product) == matmul.scratch_size(product[3])
    assert jobs.ATTENTION.scratch_floats(attend) == attention.scratch_size(attend[11], attend[12], attend[10])
    assert jobs.POOL.scratch_floats(_arguments(jobs.POOL)) == 0


@jit
def _toy(x, n, scratch):
    for i in range(n):
        x[i] = scratch.shape[0]


TOY = workers.Kind("toy", (mailbox.floats("x"), mailbox.scalar("n")), _toy, scratch=lambda n: 4 * n, home=__name__)


def test_the_runner_hands_the_body_its_fields_and_the_scratch_they_ask_for():
    x = np.zeros(6, dtype=np.float32)
    TOY.here((x, 5))
    assert (x[:5] >= 20).all() and x[5] == 0
    assert workers.local_mailbox(0)[workers.BUFFER_SIZE] == x[0]  # the calling thread's, that ran it


def _affine_parts(parts: int):
    """A Relu(x * factor + shift) over 6 channels of one image (epilogue.channel_affine) in ``parts`` parts
    by channels, as BatchNormalization posts it, and its result computed directly."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 6, 10), dtype=np.float32)
    factor, shift = rng.standard_normal(6, dtype=np.float32), rng.standard_normal(6, dtype=np.float32)
    params = np.array([0, 6], dtype=np.float32)
    y, expected = np.full_like(x, np.nan), np.empty_like(x)
    epilogue.channel_affine(x, factor, shift, expected, epilogue.RELU, params)
    bounds = [6 * p // parts for p in range(parts + 1)]
    return [(x[:, a:b], factor[a:b], shift[a:b], y[:, a:b], epilogue.RELU, params)
            for a, b in zip(bounds, bounds[1:])], y, expected


def test_a_part_runs_through_the_generated_runner():
    parts, y, expected = _affine_parts(1)
    jobs.AFFINE.here(parts[0])
    np.testing.assert_array_equal(y, expected)


@pytest.mark.skipif(not host.HELPER_THREADS, reason=host.HELPERS_REFUSED or "helper threads run here")
def test_a_helper_runs_a_part_written_from_compiled_code(monkeypatch):
    """jobs.split_pad posts a part (the generated writer, compiled into it) that the helper's runner reads."""
    monkeypatch.setattr(workers, "_SPIN_SECONDS", 0.05)  # spinning past the waits below, once awake
    pool = workers.Helpers(1)
    x = np.random.default_rng(4).standard_normal((4, 5, 6), dtype=np.float32)
    expected = np.full(4 * 7 * 8 + 5, np.nan, dtype=np.float32)
    gemm.pad_planes(x, expected, 1, 1, 7, 8)
    deadline = time.monotonic() + 30  # a loaded machine may keep the new thread waiting
    while time.monotonic() < deadline:  # a helper asleep has its part run here, and is woken
        pool.mailboxes[0, workers.CPU] = -1
        out = np.full_like(expected, np.nan)
        pool.call(jobs.split_pad, (x, out, 1, 1, 7, 8), jobs.PAD.address())
        np.testing.assert_array_equal(out, expected)
        if pool.mailboxes[0, workers.CPU] >= 0:
            break
        threading.Event().wait(0.002)
    else:
        pytest.fail("the helper never took a part")


@pytest.mark.parametrize("system,machine,byteorder,bits,refused", [
    ("Linux", "x86_64", "little", 64, ""),
    ("Linux", "aarch64", "little", 64, "need Linux on x86-64"),
    ("Darwin", "x86_64", "little", 64, "not Darwin on x86_64"),
    ("Windows", "AMD64", "little", 64, "not Windows on AMD64"),
    ("Linux", "x86_64", "little", 32, "64-bit little-endian process, not 32-bit"),
    ("Linux", "", "little", 64, "an unknown machine"),
])
def test_helper_threads_run_on_linux_x86_64_only(system, machine, byteorder, bits, refused):
    refusal = host.helper_threads_refusal(system, machine, byteorder, bits)
    assert (refusal == "") if not refused else refused in refusal


@pytest.mark.parametrize("machine,features,expected", [
    ("x86_64", {"avx512f": True, "avx2": True}, True),
    ("AMD64", {"avx512f": True}, True),
    ("x86_64", {"avx512f": False, "avx2": True}, False),
    ("x86_64", {}, False),
    ("aarch64", {"avx512f": True}, False),
])
def test_the_16_lane_kernels_need_avx512f_on_x86_64(machine, features, expected):
    assert host.avx512(machine, features) is expected


def test_this_hosts_decision_is_the_one_the_kernels_read():
    assert gemm.AVAILABLE == host.AVX512
    assert host.HELPER_THREADS == (host.HELPERS_REFUSED == "")
    assert (workers.current_cpu() >= 0) == host.HELPER_THREADS  # sched_getcpu, or its stand-in's -1
    sched_getcpu, syscall = workers.system_calls(False)  # the stand-ins of a refused platform: compiled
    assert sched_getcpu() == -1 and syscall(host.SYS_FUTEX, 0, 0, 0, 0) == -1


def test_a_refused_platform_runs_every_part_on_the_calling_thread(monkeypatch):
    """As on a platform host.py refuses: the process's helpers are none (said in a warning), and the split
    kernels, posted through workers.run or from compiled code, run every part on the calling thread."""
    refusal = host.helper_threads_refusal("Darwin", "arm64", "little", 64)
    monkeypatch.setattr(host, "HELPERS_REFUSED", refusal)
    monkeypatch.setattr(host, "HELPER_THREADS", False)
    monkeypatch.setattr(workers, "_helpers", None)
    with pytest.raises(RuntimeError, match="no helper threads: the helper threads need Linux on x86-64"):
        workers.Helpers(1)
    with pytest.warns(RuntimeWarning, match="every part on the calling thread"):
        pool = workers.helpers(3)
    assert pool.mailboxes.shape == (0, workers.MAILBOX_SIZE) and pool.states.shape == (0,)
    parts, y, expected = _affine_parts(3)
    workers.run(jobs.AFFINE, parts, 3)
    np.testing.assert_array_equal(y, expected)
    parts, y, expected = _affine_parts(2)
    workers.run(jobs.AFFINE, parts, 3, long=True)
    np.testing.assert_array_equal(y, expected)
    x = np.random.default_rng(5).standard_normal((3, 4, 4), dtype=np.float32)
    out, padded = np.zeros(3 * 36 + 2, np.float32), np.zeros(3 * 36 + 2, np.float32)
    gemm.pad_planes(x, padded, 1, 1, 6, 6)
    workers.call(jobs.split_pad, (x, out, 1, 1, 6, 6), jobs.PAD.address(), 0, 3)
    np.testing.assert_array_equal(out, padded)
