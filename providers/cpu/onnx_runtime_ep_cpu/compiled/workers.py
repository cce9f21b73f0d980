"""Helper threads for the packed convolution (and the few-row products of gemv.py) that wait for
work by spinning in compiled code.

A Python thread pool hands work over through locks and the GIL: ~50 µs on this kind of machine
before the helper starts, more than many convolutions take. Here each helper thread runs a compiled
loop (``_serve``) that watches its mailbox, an int64 array: the caller writes a job there (the
arrays' addresses and shapes, and the loop's scalars) and bumps a sequence number, the helper runs
it and publishes the number back, all through atomic loads and stores, so a job starts within a
microsecond. The caller keeps every array of a job alive until the job is done (``run`` waits for
it), which is what makes handing raw addresses over safe.

Measured on a 2-CPU virtual machine, and built around it:
- The spin reads the time-stamp counter; the ``pause`` instruction made the host trap the spinning
  CPU (pause-loop exiting), which slowed memory-bound work on the other CPU fivefold.
- A helper idle for ``_SPIN_SECONDS`` blocks on an Event, so an idle process burns no CPU. Waking a
  blocked thread took up to milliseconds (the host deschedules an idle virtual CPU), so a caller
  that finds its helper asleep does the whole job itself and only wakes the helper for later jobs.
- A helper the scheduler put on the caller's CPU is moved off it (``Helpers._spread``).
- Another pool spinning on the same CPUs (numpy's multi-threaded BLAS keeps a worker spinning for
  ~0.1 s after each call) takes half of every helper's time slice: the models whose convolutions
  run here also run their classifier's product here (gemv.py), not in BLAS.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from . import depthwise, epilogue, gemm, gemv, jit, pooling

# Mailbox slots. Sequence numbers: POSTED is bumped by the caller, DONE set by the helper.
POSTED, DONE, SLEEPING, CPU, KIND = 0, 1, 2, 3, 4  # CPU: where the helper ran its last job
_ARGS = 8  # job arguments from here on, see _post_conv and _post_product
# Kinds of job: gemm.conv_tasks, gemv's two loops, pooling.pool_2d, epilogue.channel_affine,
# depthwise._depthwise.
CONV, PRODUCT, PRODUCT_TRANSPOSED, POOL, AFFINE, DEPTHWISE = 0, 1, 2, 3, 4, 5
_MAILBOX_SIZE = 64
_SPIN_SECONDS = 5e-3


@intrinsic
def _atomic_load(typingctx, array, index):
    """array[index] (int64), sequentially consistent: never reordered with the other atomics."""
    signature = types.int64(array, index)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.load_atomic(builder.gep(data, [args[1]]), "seq_cst", 8)

    return signature, codegen


@intrinsic
def _atomic_store(typingctx, array, index, value):
    """array[index] = value (int64), sequentially consistent."""
    signature = types.void(array, index, value)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        builder.store_atomic(args[2], builder.gep(data, [args[1]]), "seq_cst", 8)
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def _cycles(typingctx):
    """The CPU's time-stamp counter: a clock read in a few nanoseconds, to bound the spin-waits."""
    signature = types.int64()

    def codegen(context, builder, sig, args):
        module = builder.module
        name = "llvm.readcyclecounter"
        read = module.globals.get(name) or ir.Function(module, ir.FunctionType(ir.IntType(64), []), name)
        return builder.call(read, [])

    return signature, codegen


_sched_getcpu = types.ExternalFunction("sched_getcpu", types.int32())


def _pointer_intrinsic(element):
    @intrinsic
    def as_pointer(typingctx, address):
        signature = types.CPointer(element)(types.int64)

        def codegen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

        return signature, codegen

    return as_pointer


_float_pointer = _pointer_intrinsic(types.float32)
_int_pointer = _pointer_intrinsic(types.int64)
_offset_pointer = _pointer_intrinsic(types.uint64)


@jit
def _post_conv(mailbox, xp, weights, bias, y, residual, flags, bounds, m_rows, oh, ow, grid, channels, kh, kw, sh,
               sw, dh, dw, wp, plane, taps, packed, tasks):
    """Write a conv_tasks job into ``mailbox`` and publish it; returns its sequence number and whether
    the helper had gone to sleep (then it needs waking)."""
    m = mailbox
    a = _ARGS
    m[a + 0], m[a + 1], m[a + 2] = xp.ctypes.data, xp.shape[0], xp.shape[1]
    m[a + 3], m[a + 4], m[a + 5], m[a + 6] = weights.ctypes.data, weights.shape[0], weights.shape[1], weights.shape[2]
    m[a + 7], m[a + 8], m[a + 9] = bias.ctypes.data, bias.shape[0], bias.shape[1]
    m[a + 10], m[a + 11], m[a + 12] = y.ctypes.data, y.shape[0], y.shape[1]
    m[a + 13], m[a + 14], m[a + 15] = residual.ctypes.data, residual.shape[0], residual.shape[1]
    m[a + 16] = bounds.ctypes.data
    m[a + 17], m[a + 18] = taps.ctypes.data, taps.shape[0]
    m[a + 19], m[a + 20] = packed.ctypes.data, packed.shape[0]
    m[a + 21], m[a + 22] = tasks.ctypes.data, tasks.shape[0]
    m[a + 23], m[a + 24], m[a + 25], m[a + 26], m[a + 27] = flags, m_rows, oh, ow, grid
    m[a + 28], m[a + 29], m[a + 30], m[a + 31], m[a + 32] = channels, kh, kw, sh, sw
    m[a + 33], m[a + 34], m[a + 35], m[a + 36] = dh, dw, wp, plane
    m[KIND] = CONV
    return _publish(m)


@jit
def _publish(m):
    sequence = _atomic_load(m, POSTED) + 1
    _atomic_store(m, POSTED, sequence)
    return sequence, _atomic_load(m, SLEEPING) != 0  # (the load after the store: see _serve)


@jit
def _post_product(mailbox, transposed, a, w, y, first, end):
    """Write a gemv job (rows_times or rows_times_transposed over columns first .. end) into
    ``mailbox`` and publish it, as _post_conv."""
    m = mailbox
    s = _ARGS
    m[s + 0], m[s + 1], m[s + 2] = a.ctypes.data, a.shape[0], a.shape[1]
    m[s + 3], m[s + 4], m[s + 5] = w.ctypes.data, w.shape[0], w.shape[1]
    m[s + 6], m[s + 7], m[s + 8] = y.ctypes.data, y.shape[0], y.shape[1]
    m[s + 9], m[s + 10] = first, end
    m[KIND] = PRODUCT_TRANSPOSED if transposed else PRODUCT
    return _publish(m)


@jit
def _run_product(m):
    s = _ARGS
    a = carray(_float_pointer(m[s + 0]), (m[s + 1], m[s + 2]))
    w = carray(_float_pointer(m[s + 3]), (m[s + 4], m[s + 5]))
    y = carray(_float_pointer(m[s + 6]), (m[s + 7], m[s + 8]))
    if m[KIND] == PRODUCT_TRANSPOSED:
        gemv.rows_times_transposed(a, w, y, m[s + 9], m[s + 10])
    else:
        gemv.rows_times(a, w, y, m[s + 9], m[s + 10])


@jit
def _post_pool(mailbox, planes, rows, kh, kw, sh, sw, dh, dw, ph, pw, is_max, lo_h, hi_h, lo_w, hi_w):
    """Write a pooling.pool_2d job into ``mailbox`` and publish it, as _post_conv."""
    m = mailbox
    s = _ARGS
    m[s + 0], m[s + 1], m[s + 2], m[s + 3] = planes.ctypes.data, planes.shape[0], planes.shape[1], planes.shape[2]
    m[s + 4], m[s + 5], m[s + 6], m[s + 7] = rows.ctypes.data, rows.shape[0], rows.shape[1], rows.shape[2]
    m[s + 8], m[s + 9], m[s + 10], m[s + 11], m[s + 12], m[s + 13] = kh, kw, sh, sw, dh, dw
    m[s + 14], m[s + 15], m[s + 16] = ph, pw, is_max
    m[s + 17], m[s + 18], m[s + 19], m[s + 20] = lo_h, hi_h, lo_w, hi_w
    m[KIND] = POOL
    return _publish(m)


@jit
def _run_pool(m):
    s = _ARGS
    planes = carray(_float_pointer(m[s + 0]), (m[s + 1], m[s + 2], m[s + 3]))
    rows = carray(_float_pointer(m[s + 4]), (m[s + 5], m[s + 6], m[s + 7]))
    pooling.pool_2d(planes, rows, m[s + 8], m[s + 9], m[s + 10], m[s + 11], m[s + 12], m[s + 13], m[s + 14],
                    m[s + 15], m[s + 16] != 0, m[s + 17], m[s + 18], m[s + 19], m[s + 20])


@jit
def _post_affine(mailbox, x, factor, shift, out, kind, params):
    """Write an epilogue.channel_affine job into ``mailbox`` and publish it, as _post_conv."""
    m = mailbox
    s = _ARGS
    m[s + 0], m[s + 1], m[s + 2], m[s + 3] = x.ctypes.data, x.shape[0], x.shape[1], x.shape[2]
    m[s + 4], m[s + 5], m[s + 6] = factor.ctypes.data, shift.ctypes.data, out.ctypes.data
    m[s + 7], m[s + 8] = kind, params.ctypes.data
    m[KIND] = AFFINE
    return _publish(m)


@jit
def _run_affine(m):
    s = _ARGS
    shape = (m[s + 1], m[s + 2], m[s + 3])
    x = carray(_float_pointer(m[s + 0]), shape)
    factor = carray(_float_pointer(m[s + 4]), (m[s + 2],))
    shift = carray(_float_pointer(m[s + 5]), (m[s + 2],))
    out = carray(_float_pointer(m[s + 6]), shape)
    epilogue.channel_affine(x, factor, shift, out, m[s + 7], carray(_float_pointer(m[s + 8]), (2,)))


@jit
def _post_depthwise(mailbox, x, weights, bias, y, n_images, channels, in_shape, out, strides, begin, taps, rows, width,
                    size, inputs, places, grid):
    """Write a depthwise._depthwise job into ``mailbox`` and publish it, as _post_conv."""
    m = mailbox
    s = _ARGS
    m[s + 0], m[s + 1], m[s + 2], m[s + 3] = x.ctypes.data, x.shape[0], weights.ctypes.data, weights.shape[0]
    m[s + 4], m[s + 5], m[s + 6], m[s + 7] = bias.ctypes.data, bias.shape[0], y.ctypes.data, y.shape[0]
    m[s + 8], m[s + 9] = n_images, channels
    m[s + 10], m[s + 11], m[s + 12], m[s + 13] = in_shape[0], in_shape[1], out[0], out[1]
    m[s + 14], m[s + 15], m[s + 16], m[s + 17] = strides[0], strides[1], begin[0], begin[1]
    m[s + 18], m[s + 19], m[s + 20], m[s + 21], m[s + 22] = taps.ctypes.data, taps.shape[0], rows, width, size
    m[s + 23], m[s + 24], m[s + 25] = inputs.ctypes.data, places.ctypes.data, inputs.shape[0]
    m[s + 26], m[s + 27] = grid.ctypes.data, grid.shape[0]
    m[KIND] = DEPTHWISE
    return _publish(m)


@jit
def _run_depthwise(m):
    s = _ARGS
    depthwise.run(carray(_float_pointer(m[s + 0]), (m[s + 1],)), carray(_float_pointer(m[s + 2]), (m[s + 3],)),
                  carray(_float_pointer(m[s + 4]), (m[s + 5],)), carray(_float_pointer(m[s + 6]), (m[s + 7],)),
                  m[s + 8], m[s + 9], (m[s + 10], m[s + 11]), (m[s + 12], m[s + 13]), (m[s + 14], m[s + 15]),
                  (m[s + 16], m[s + 17]), carray(_offset_pointer(m[s + 18]), (m[s + 19],)), m[s + 20], m[s + 21],
                  m[s + 22], carray(_offset_pointer(m[s + 23]), (m[s + 25],)),
                  carray(_offset_pointer(m[s + 24]), (m[s + 25],)), carray(_offset_pointer(m[s + 26]), (m[s + 27],)))


@jit
def _run_posted(m, buf):
    kind = m[KIND]
    if kind == DEPTHWISE:
        _run_depthwise(m)
        return
    if kind == POOL:
        _run_pool(m)
        return
    if kind == AFFINE:
        _run_affine(m)
        return
    if kind != CONV:
        _run_product(m)
        return
    a = _ARGS
    xp = carray(_float_pointer(m[a + 0]), (m[a + 1], m[a + 2]))
    weights = carray(_float_pointer(m[a + 3]), (m[a + 4], m[a + 5], m[a + 6]))
    bias = carray(_float_pointer(m[a + 7]), (m[a + 8], m[a + 9]))
    y = carray(_float_pointer(m[a + 10]), (m[a + 11], m[a + 12]))
    residual = carray(_float_pointer(m[a + 13]), (m[a + 14], m[a + 15]))
    bounds = carray(_float_pointer(m[a + 16]), (3,))
    taps = carray(_int_pointer(m[a + 17]), (m[a + 18],))
    packed = carray(_int_pointer(m[a + 19]), (m[a + 20],))
    tasks = carray(_int_pointer(m[a + 21]), (m[a + 22], 6))
    gemm.conv_tasks(xp, weights, bias, y, residual, m[a + 23], bounds, m[a + 24], m[a + 25], m[a + 26], m[a + 27],
                    m[a + 28], m[a + 29], m[a + 30], m[a + 31], m[a + 32], m[a + 33], m[a + 34], m[a + 35],
                    m[a + 36], taps, packed, tasks, buf)


@jit
def _serve(mailbox, spin_cycles):
    """Run the jobs posted to ``mailbox`` until none came for ``spin_cycles`` time-stamp cycles; then
    mark the helper asleep and return (unless a job arrived meanwhile)."""
    _atomic_store(mailbox, SLEEPING, 0)
    buf = np.empty(0, dtype=np.float32)
    seen = _atomic_load(mailbox, DONE)
    idle_since = _cycles()
    while True:
        posted = _atomic_load(mailbox, POSTED)
        if posted != seen:
            depth = mailbox[_ARGS + 28] * mailbox[_ARGS + 29] * mailbox[_ARGS + 30]
            size = max(depth * gemm.NR, gemm._CHUNK_BYTES // 4)
            if mailbox[KIND] == CONV and buf.shape[0] < size:
                buf = np.empty(size, dtype=np.float32)
            mailbox[CPU] = _sched_getcpu()
            _run_posted(mailbox, buf)
            seen = posted
            _atomic_store(mailbox, DONE, posted)
            idle_since = _cycles()
            continue
        _relax()
        if _cycles() - idle_since > spin_cycles:
            _atomic_store(mailbox, SLEEPING, 1)
            if _atomic_load(mailbox, POSTED) == seen:
                return
            _atomic_store(mailbox, SLEEPING, 0)
            idle_since = _cycles()


@jit
def _relax():
    """One step of a spin-wait: ~200 cycles of reading the time-stamp counter, then a yield of the CPU
    to any other runnable thread (BLAS's threads, which the scheduler may have put on this CPU, would
    otherwise wait for the end of a time slice). Not the ``pause`` instruction: on a virtual machine
    it makes the host trap the spinning CPU (pause-loop exiting), which was measured to slow
    memory-bound work on the other CPU fivefold."""
    start = _cycles()
    while _cycles() - start < 200:
        pass


@jit
def _wait(mailbox, sequence):
    while _atomic_load(mailbox, DONE) != sequence:
        _relax()


@jit
def _load(mailbox, slot):
    return _atomic_load(mailbox, slot)


@jit
def current_cpu():
    """The CPU the calling thread runs on."""
    return _sched_getcpu()


@jit
def _read_cycles():
    return _cycles()


def _cycles_per_second() -> float:
    start, clock = _read_cycles(), time.perf_counter()
    time.sleep(0.005)
    return (_read_cycles() - start) / (time.perf_counter() - clock)


class _Helper:
    """One helper thread and its mailbox."""

    def __init__(self, spin_cycles: int):
        self.mailbox = np.zeros(_MAILBOX_SIZE, dtype=np.int64)
        self.mailbox[CPU] = -1
        self.wake = threading.Event()
        self._spin_cycles = spin_cycles
        self.thread = threading.Thread(target=self._loop, name="onnx-runtime-conv", daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            _serve(self.mailbox, self._spin_cycles)
            self.wake.wait()
            self.wake.clear()

    def awake(self) -> bool:
        """Whether the helper is spinning for work; if not, wake it (for later jobs: waking takes up
        to milliseconds on a virtual machine whose idle CPU the host has descheduled)."""
        if _load(self.mailbox, SLEEPING):
            self.wake.set()
            return False
        return True

    def post(self, poster, arguments) -> int:
        sequence, asleep = poster(self.mailbox, *arguments)
        if asleep:  # it went to sleep after awake(): the job waits for it
            self.wake.set()
        return sequence

    def wait(self, sequence: int) -> None:
        _wait(self.mailbox, sequence)


class Helpers:
    """The helper threads of the process, ``count`` of them, used by one caller at a time.

    The scheduler tends to keep a thread it wakes on the waker's CPU, so a helper woken after an idle
    spell can end up sharing the caller's CPU (and stay there while both spin): the two halves of each
    job then run one after the other. Before posting, a helper found on the caller's CPU is moved to
    the other CPUs (its affinity; the caller's own is never changed)."""

    def __init__(self, count: int):
        spin_cycles = max(1, int(_cycles_per_second() * _SPIN_SECONDS))
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self._helpers = [_Helper(spin_cycles) for _ in range(count)]
        self._busy = threading.Lock()

    def _spread(self) -> None:
        """Move helpers off the caller's CPU: helper i to the i-th of the other CPUs."""
        here = current_cpu()
        if all(helper.mailbox[CPU] != here for helper in self._helpers):
            return
        others = [cpu for cpu in self._cpus if cpu != here]
        for i, helper in enumerate(self._helpers):
            if others:
                try:
                    os.sched_setaffinity(helper.thread.native_id, {others[i % len(others)]})
                except OSError:  # the CPU left the process's set meanwhile: leave the helper be
                    pass
            helper.mailbox[CPU] = -1

    def run(self, poster, parts, run_here) -> None:
        """One job per part: parts[0] by ``run_here(*part)`` on the calling thread, the others posted to
        the helpers by ``poster(mailbox, *part)`` (_post_conv, _post_product); returns when all are
        done. A caller that finds the helpers busy (sessions run from several threads) runs every
        part itself, and so does it with the parts of sleeping helpers (while they wake up)."""
        if not self._busy.acquire(blocking=False):
            for part in parts:
                run_here(*part)
            return
        try:
            self._spread()
            ready = [helper for helper in self._helpers if helper.awake()]
            posted = [(helper, helper.post(poster, part)) for helper, part in zip(ready, parts[1:])]
            try:
                for part in [parts[0], *parts[1 + len(posted):]]:  # beyond the helpers' count: here
                    run_here(*part)
            finally:
                for helper, sequence in posted:
                    helper.wait(sequence)
        finally:
            self._busy.release()


_helpers: Helpers | None = None
_helpers_lock = threading.Lock()


def helpers(count: int) -> Helpers:
    """The process's helpers (``count`` threads, started on first use)."""
    global _helpers
    with _helpers_lock:
        if _helpers is None:
            _helpers = Helpers(count)
        return _helpers


def run_conv(parts, run_here, count: int) -> None:
    """gemm.conv_tasks on every part (see Helpers.run), ``count`` helpers in the process."""
    helpers(count).run(_post_conv, parts, run_here)


def run_product(parts, count: int) -> None:
    """gemv's loops on every part, (transposed, a, w, y, first, end) each (see Helpers.run)."""
    helpers(count).run(_post_product, parts, product_here)


def product_here(transposed, a, w, y, first, end) -> None:
    """One gemv part on the calling thread."""
    (gemv.rows_times_transposed if transposed else gemv.rows_times)(a, w, y, first, end)


def run_pool(parts, count: int) -> None:
    """pooling.pool_2d on every part, (planes, rows, kh, ..., hi_w) each (see Helpers.run)."""
    helpers(count).run(_post_pool, parts, pool_here)


def pool_here(planes, rows, kh, kw, sh, sw, dh, dw, ph, pw, is_max, lo_h, hi_h, lo_w, hi_w) -> None:
    """One pooling part on the calling thread."""
    pooling.pool_2d(planes, rows, kh, kw, sh, sw, dh, dw, ph, pw, bool(is_max), lo_h, hi_h, lo_w, hi_w)


def run_affine(parts, count: int) -> None:
    """epilogue.channel_affine on every part, (x, factor, shift, out, kind, params) each (see Helpers.run)."""
    helpers(count).run(_post_affine, parts, epilogue.channel_affine)


def run_depthwise(parts, count: int) -> None:
    """depthwise.run on every part of DepthwisePlan.channel_parts (see Helpers.run)."""
    helpers(count).run(_post_depthwise, parts, depthwise.run)
