"""Helper threads for the compiled kernels that split their work (the packed convolution, the
packed products of matmul.py, attention.py's tiles, the few-row products of gemv.py, pooling, batch
normalization, depthwise convolution), waiting for work by spinning in compiled code.

A Python thread pool hands work over through locks and the GIL: tens of microseconds before the
helper starts, more than many convolutions take (0f3b016). Here each helper thread runs a compiled
loop (``_serve``) that watches its mailbox, an int64 array: the caller writes a job there (the
arrays' addresses and shapes, the loop's scalars, and the address of the compiled runner of its
Kind) and bumps a sequence number, the helper runs it and publishes the number back, all through
atomic loads and stores, so a job starts within a microsecond. The caller keeps every array of a job
alive until the job is done (``Helpers.run`` waits for it), which is what makes handing raw
addresses over safe.

Each Kind's runner is a C callback (numba ``cfunc``) compiled the first time a model needs it, and
the caller runs its own part through the same callback, so each kernel is compiled once; a serving
loop that called every kernel directly would compile them all, for every model, on the first run.

Posting is itself compiled (``offer``, ``collect``): ``Helpers.run`` writes each part with its
Kind's compiled writer, and the kernels with the most calls per inference (convolutions, few-row
products) post all their parts from one compiled function (jobs.split_conv, jobs.split_product),
since a job's Python costs about as much as a small convolution's arithmetic.

Measured on a 2-CPU virtual machine, and built around it:
- The spin reads the time-stamp counter; the ``pause`` instruction made the host trap the spinning
  CPU (pause-loop exiting), which slowed memory-bound work on the other CPU several times over (0f3b016).
- A helper idle for ``_SPIN_SECONDS`` sleeps in the kernel (a futex, from compiled code), so an idle
  process burns no CPU. Waking a blocked thread took up to milliseconds (the host deschedules an
  idle virtual CPU), so a caller that finds its helper asleep does the whole job itself and only
  wakes the helper for later jobs. The helper never takes the GIL after it starts: one that slept on
  a Python Event made the caller stall in GIL handoffs, whole switch intervals, on waking it (c8dc8a0).
- A helper the scheduler put on the caller's CPU is moved off it (``Helpers._spread``); until then a caller
  waiting for that helper's part gives the CPU up instead of spinning (``_wait``).
- A part its helper has not started by the time the caller has run its own is taken back (claimed
  by compare-and-swap, ``collect``) and run by the caller: such a helper is descheduled, e.g. behind
  another pool spinning on its CPU, and waiting for it cost whole time slices (7c8544f; on an idle
  machine the helper always starts first).
- A helper that started but runs slowly (its CPU shared with another busy process) is not waited for
  either where a kernel cuts each thread's share into tasks claimed one at a time (``claim_task``; the
  packed convolution, jobs.CONV; jobs.MATMUL claims shares whole): the thread that finished first claims
  the tasks the other has not.
- Another pool spinning on the same CPUs (numpy's multi-threaded BLAS keeps a worker spinning for
  ~0.1 s after each call) takes half of every helper's time slice: the models whose convolutions
  run here also run their classifier's product here (gemv.py), not in BLAS.

Helpers run on Linux x86-64 only (the futex by syscall number, the time-stamp counter: host.py); on
other platforms ``helpers`` starts none and every part runs on the calling thread.
"""

from __future__ import annotations

import inspect
import os
import sys
import threading
import time
import warnings

import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.extending import intrinsic

from . import host, jit, llvm, mailbox

# Mailbox slots. Sequence numbers: POSTED is bumped by the caller, DONE set by the helper. RUNNER:
# the address of the job's compiled runner (a Kind's); BUFFER, BUFFER_SIZE: the runner's scratch.
POSTED, DONE, SLEEPING, CPU, RUNNER, BUFFER, BUFFER_SIZE = 0, 1, 2, 3, 4, 5, 6  # CPU: of the last job
CLAIMED = 7  # the sequence number of the last job claimed, by the helper or by a caller taking it back
ARGS = 8  # the job's arguments from here on, where its Kind's layout puts them (mailbox.py)
MAILBOX_SIZE = 64
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
def _atomic_swap_if(typingctx, array, index, expected, value):
    """array[index] = value if it holds ``expected`` (int64, compare-and-swap, sequentially consistent);
    returns whether it did."""
    signature = types.boolean(array, index, expected, value)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        outcome = builder.cmpxchg(builder.gep(data, [args[1]]), args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(outcome, 1)

    return signature, codegen


@intrinsic
def _atomic_add(typingctx, array, index, value):
    """array[index] += value (int64, one atomic read-modify-write, sequentially consistent); returns the
    value before."""
    signature = types.int64(array, index, value)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[0])(context, builder, args[0]).data
        return builder.atomic_rmw("add", builder.gep(data, [args[1]]), args[2], "seq_cst")

    return signature, codegen


@jit
def claim_task(claims, ranges, part, cursor):
    """The next task for part ``part``'s thread, where share s holds tasks ranges[s] .. ranges[s + 1] given
    out through claims[s] (an atomic add: each number goes to exactly one thread): its own share's in
    order, then the unclaimed ones of the shares after it, so a thread that finished its own takes the
    tasks of a helper that fell behind (descheduled, or on a CPU the host slowed) instead of waiting for
    it; -1 once none is left. ``cursor``: one int64, zero at first, the shares this thread has emptied."""
    parts = claims.shape[0]
    while cursor[0] < parts:
        share = (part + cursor[0]) % parts
        t = _atomic_add(claims, share, 1)
        if t < ranges[share + 1] - ranges[share]:
            return ranges[share] + t
        cursor[0] += 1
    return -1


@intrinsic
def _cycles(typingctx):
    """The CPU's time-stamp counter: a clock read in a few nanoseconds, to bound the spin-waits."""
    signature = types.int64()

    def codegen(context, builder, sig, args):
        read = llvm.declare(builder.module, "llvm.readcyclecounter", ir.FunctionType(llvm.I64, []))
        return builder.call(read, [])

    return signature, codegen


@jit
def _no_cpu():
    """sched_getcpu's stand-in where no helper thread runs: -1, no CPU known."""
    return np.int32(-1)


@jit
def _no_syscall(number, a, b, c, d):
    """syscall's stand-in where no helper thread runs (never called there: no helper sleeps)."""
    return -1


def system_calls(helper_threads: bool) -> tuple:
    """(sched_getcpu, syscall) for compiled code: the C library's where helper threads run
    (host.HELPER_THREADS), else compiled stand-ins, so that the compiled callers (offer, collect) still
    link on a platform whose C library lacks them, where they run every part on the calling thread."""
    if not helper_threads:
        return _no_cpu, _no_syscall
    return (types.ExternalFunction("sched_getcpu", types.int32()),
            types.ExternalFunction("syscall", types.int64(types.int64, types.int64, types.int64, types.int64,
                                                          types.int64)))


_sched_getcpu, _syscall = system_calls(host.HELPER_THREADS)


@intrinsic
def _call_runner(typingctx, address, mailbox):
    """Call the compiled runner at ``address`` (a ``void(int64*)`` C function) on ``mailbox``'s data."""
    signature = types.void(address, mailbox)

    def codegen(context, builder, sig, args):
        data = context.make_array(sig.args[1])(context, builder, args[1]).data
        runner_type = ir.FunctionType(ir.VoidType(), [data.type])
        builder.call(builder.inttoptr(args[0], runner_type.as_pointer()), [data])
        return context.get_dummy_value()

    return signature, codegen


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
_double_pointer = _pointer_intrinsic(types.float64)
_int32_pointer = _pointer_intrinsic(types.int32)
_byte_pointer = _pointer_intrinsic(types.uint8)
_signed_byte_pointer = _pointer_intrinsic(types.int8)


@jit
def _publish(m):
    sequence = _atomic_load(m, POSTED) + 1
    _atomic_store(m, POSTED, sequence)
    return sequence, _atomic_load(m, SLEEPING) != 0  # (the load after the store: see _serve)


# Sleeping and waking through a futex on the SLEEPING slot (its low 32 bits: x86-64 is little-endian),
# from compiled code: a helper that waited on a Python Event needed the GIL to wake, and the caller's
# thread, made to hand the GIL over, stalled for whole switch intervals after each idle spell (c8dc8a0).
# Linux x86-64 only (host.py); the futex wait has no timeout.
_SYS_FUTEX, _FUTEX_WAIT_PRIVATE, _FUTEX_WAKE_PRIVATE = host.SYS_FUTEX, host.FUTEX_WAIT_PRIVATE, host.FUTEX_WAKE_PRIVATE
_SYS_SCHED_YIELD = host.SYS_SCHED_YIELD


@jit
def _serve(mailbox, spin_cycles):
    """Run the jobs posted to ``mailbox``, for ever; after ``spin_cycles`` time-stamp cycles without
    one, sleep (SLEEPING set, blocked in the kernel) until ``wake`` is called."""
    sleeping = mailbox.ctypes.data + SLEEPING * 8
    _atomic_store(mailbox, SLEEPING, 0)
    seen = _atomic_load(mailbox, DONE)
    idle_since = _cycles()
    while True:
        posted = _atomic_load(mailbox, POSTED)
        if posted != seen:
            if _claim(mailbox, posted):  # else the caller took the job back (collect) and ran it
                mailbox[CPU] = _sched_getcpu()
                _call_runner(mailbox[RUNNER], mailbox)
            seen = posted
            _atomic_store(mailbox, DONE, posted)
            idle_since = _cycles()
            continue
        _relax()
        if _cycles() - idle_since > spin_cycles:
            _atomic_store(mailbox, SLEEPING, 1)
            # A job posted before SLEEPING was set is seen here; one posted after sees SLEEPING and wakes
            # this thread (sequentially consistent stores and loads on both sides, see _publish).
            if _atomic_load(mailbox, POSTED) == seen:
                while _atomic_load(mailbox, SLEEPING) != 0:
                    _syscall(_SYS_FUTEX, sleeping, _FUTEX_WAIT_PRIVATE, 1, 0)  # returns at once unless still 1
            _atomic_store(mailbox, SLEEPING, 0)
            idle_since = _cycles()


@jit
def _claim(mailbox, sequence):
    """Claim job ``sequence`` of ``mailbox`` for the calling thread: True for exactly one of the helper
    and the caller that try (sequence numbers only grow, so an earlier job's claim cannot be mistaken
    for this one's)."""
    claimed = _atomic_load(mailbox, CLAIMED)
    return claimed < sequence and _atomic_swap_if(mailbox, CLAIMED, claimed, sequence)


@jit
def wake(mailbox):
    """Wake the helper serving ``mailbox`` if it sleeps."""
    if _atomic_load(mailbox, SLEEPING) != 0:
        _atomic_store(mailbox, SLEEPING, 0)
        _syscall(_SYS_FUTEX, mailbox.ctypes.data + SLEEPING * 8, _FUTEX_WAKE_PRIVATE, 1, 0)


@jit
def _relax():
    """One step of a spin-wait: ~200 cycles of reading the time-stamp counter. Not the ``pause``
    instruction: on a virtual machine it makes the host trap the spinning CPU (pause-loop exiting),
    which was measured to slow memory-bound work on the other CPU fivefold."""
    start = _cycles()
    while _cycles() - start < 200:
        pass


@jit
def _wait(mailbox, sequence):
    """Until the helper has done job ``sequence``: spinning, or, while the helper runs on the caller's CPU,
    giving that CPU up (sched_yield): the helper can only go on when the caller leaves it, and a caller spinning
    there held it off until the scheduler preempted the caller (30 ms of spinning seen on a loaded host)."""
    while _atomic_load(mailbox, DONE) != sequence:
        if mailbox[CPU] == _sched_getcpu():
            _syscall(_SYS_SCHED_YIELD, 0, 0, 0, 0)
        else:
            _relax()


@jit
def finished(mailbox):
    """The sequence number of the last job the helper serving ``mailbox`` has done (or seen taken back)."""
    return _atomic_load(mailbox, DONE)


@jit
def _load(mailbox, slot):
    return _atomic_load(mailbox, slot)


@jit
def current_cpu():
    """The CPU the calling thread runs on."""
    return _sched_getcpu()


cycles = _cycles  # (compiled callers timing their parts: conv_chain.run_chain_split)


@jit
def _read_cycles():
    return _cycles()


_read_cycles.expect()  # the helpers' loops, which no numpy path calls: the loader links them (deferred.py)
_serve.expect(np.zeros(MAILBOX_SIZE, dtype=np.int64), 1)


def _cycles_per_second() -> float:
    start, clock = _read_cycles(), time.perf_counter()
    time.sleep(0.005)
    return (_read_cycles() - start) / (time.perf_counter() - clock)


# Posting from compiled code (a kernel whose per-call Python overhead would cost as much as its work,
# e.g. a decode step's matrix-vector products): the caller holds the helpers (Helpers.call), writes
# a part's arguments into a helper's mailbox with its Kind's writer, then ``offer``s it; after running
# its own part it ``collect``s the others. What compiled code cannot do (move a helper off the
# caller's CPU: its affinity) is left to Helpers.settle.
_SPREAD = 1  # collect's result: a helper ran on the caller's CPU


@jit
def offer(mailboxes, states, helper, runner):
    """Post the job written in mailboxes[helper] to that helper if it is spinning (states[helper] = the
    job's sequence number), and return True; a sleeping helper is woken for later jobs and False
    returned (the caller runs the part). A helper that fell asleep just as the job came is woken to
    run it."""
    mailbox = mailboxes[helper]
    if _atomic_load(mailbox, SLEEPING) != 0:
        wake(mailbox)  # waking takes up to milliseconds: not for this job
        states[helper] = 0
        return False
    mailbox[RUNNER] = runner  # (the helper's scratch stays in BUFFER: see Helpers._ensure_scratch)
    sequence, asleep = _publish(mailbox)
    if asleep:
        wake(mailbox)
    states[helper] = sequence
    return True


@jit
def collect(mailboxes, states, helpers):
    """Wait for the parts offered to helpers < ``helpers``, running here those a helper has not started
    yet (the caller has run its own part meanwhile, so that helper is not running: descheduled, e.g.
    by another process's spinning threads on its CPU, where waiting would cost the caller whole time
    slices); returns 0, or _SPREAD when Helpers.settle must move a helper off the caller's CPU."""
    here = _sched_getcpu()
    result = 0
    for helper in range(helpers):
        sequence = states[helper]
        if sequence > 0:
            mailbox = mailboxes[helper]
            if _claim(mailbox, sequence):
                _call_runner(mailbox[RUNNER], mailbox)  # with the helper's scratch: it is not running
            else:
                _wait(mailbox, sequence)
                if mailbox[CPU] == here:
                    result |= _SPREAD
            states[helper] = 0
    return result


# Runner signature: the mailbox's data.
RUNNER_SIGNATURE = types.void(types.CPointer(types.int64))


@jit
def mailbox_view(pointer):
    """The mailbox a runner receives, as an array (for compiled runners)."""
    return carray(pointer, (MAILBOX_SIZE,))


@jit
def float_array(address, shape):
    """The float32 array at ``address`` (for compiled runners)."""
    return carray(_float_pointer(address), shape)


@jit
def int_array(address, shape):
    """The int64 array at ``address`` (for compiled runners)."""
    return carray(_int_pointer(address), shape)


@jit
def offset_array(address, shape):
    """The uint64 array at ``address`` (for compiled runners)."""
    return carray(_offset_pointer(address), shape)


@jit
def double_array(address, shape):
    """The float64 array at ``address`` (for compiled runners)."""
    return carray(_double_pointer(address), shape)


@jit
def int32_array(address, shape):
    """The int32 array at ``address`` (for compiled runners)."""
    return carray(_int32_pointer(address), shape)


@jit
def byte_array(address, shape):
    """The uint8 array at ``address`` (for compiled runners)."""
    return carray(_byte_pointer(address), shape)


@jit
def signed_byte_array(address, shape):
    """The int8 array at ``address`` (for compiled runners)."""
    return carray(_signed_byte_pointer(address), shape)


def _parameters(function) -> list[str]:
    """The parameter names of ``function`` (a numba dispatcher's: of its Python function)."""
    return list(inspect.signature(getattr(function, "py_func", function)).parameters)


class Kind:
    """A kind of job, described once by its ``fields`` (a mailbox.Layout from slot ARGS on), from which
    come its ``writer(mailbox, *arguments)`` and ``reader(mailbox) -> arguments`` (both compiled) and its
    runner: a numba ``cfunc`` (compiled on first use, cached on disk) that reads a part's arguments and
    calls ``body`` with them by parameter name, the body's ``scratch`` being the mailbox's scratch buffer
    (BUFFER). ``scratch``: the float32 scratch floats a part needs, a function of the fields its
    parameters name (None: no scratch). ``home``: the name of the module that describes the kind, whose
    code the generated functions count as (numba caches them next to it, while its text is unchanged)."""

    def __init__(self, name: str, fields, body, scratch=None, *, home: str):
        layout = self.layout = mailbox.Layout(fields, ARGS, MAILBOX_SIZE)
        names = [field.name for field in layout.fields]
        self._scratch = scratch
        self._scratch_fields = [names.index(parameter) for parameter in _parameters(scratch)] if scratch else []
        namespace = {"__name__": home, "mailbox_view": mailbox_view, "_body": body,
                     **{reader: globals()[reader] for reader in mailbox.ARRAY_READERS.values()}}
        writer, reader, entry = f"_write_{name}", f"_read_{name}", f"_{name}_entry"
        buffer = f"float_array(m[{BUFFER}], (m[{BUFFER_SIZE}],))"
        sources = (layout.writer_source(writer), layout.reader_source(reader),
                   layout.entry_source(entry, reader, "_body", _parameters(body), {"scratch": buffer}))
        self.source = "\n".join(sources)  # what the kind compiles, to read
        filename = sys.modules[home].__file__
        self.writer = jit(mailbox.define(sources[0], writer, namespace, filename))
        self.reader = namespace[reader] = jit(mailbox.define(sources[1], reader, namespace, filename))
        self._entry = mailbox.define(sources[2], entry, namespace, filename)
        self._runner = None
        self._lock = threading.Lock()

    def address(self) -> int:
        """The address of the compiled runner (compiled on first use)."""
        runner = self._runner
        if runner is None:
            with self._lock:
                if self._runner is None:
                    self._runner = compile_runner(self._entry)
                runner = self._runner
        return runner.address

    def write(self, mailbox, scratch_owner, arguments) -> None:
        """The part's arguments and runner into ``mailbox``, whose owner's scratch (``scratch_owner``: a
        _Helper or the calling thread's locals) is grown as the part needs."""
        mailbox[RUNNER] = self.address()
        if self._scratch is not None:
            _grow_scratch(scratch_owner, mailbox, self.scratch_floats(arguments))
        self.writer(mailbox, *arguments)

    def scratch_floats(self, arguments) -> int:
        """The float32 scratch a part of these arguments needs."""
        return self._scratch(*[arguments[i] for i in self._scratch_fields]) if self._scratch is not None else 0

    def here(self, arguments) -> None:
        """Run one part on the calling thread (through the same compiled runner)."""
        local = _local_mailbox()
        self.write(local.mailbox, local, arguments)
        run_here(self.address(), local.mailbox)


def _grow_scratch(owner, mailbox, floats: int) -> None:
    """``owner.scratch`` (a float32 buffer) at least ``floats`` long; its address and size stay in the
    mailbox's BUFFER slots, where runners find it."""
    buffer = owner.scratch
    if floats and (buffer is None or buffer.size < floats):
        buffer = owner.scratch = np.empty(floats, dtype=np.float32)
        mailbox[BUFFER], mailbox[BUFFER_SIZE] = buffer.ctypes.data, buffer.size


def local_mailbox(floats: int) -> np.ndarray:
    """The calling thread's mailbox, through which it runs its own parts of split jobs, with at least
    ``floats`` of scratch: for compiled callers (run_here)."""
    local = _local_mailbox()
    _grow_scratch(local, local.mailbox, floats)
    return local.mailbox


@jit
def run_here(runner, mailbox):
    """Run the job written in ``mailbox`` (the caller's own) with the compiled runner at ``runner``."""
    _call_runner(runner, mailbox)


_locals = threading.local()  # per calling thread: a mailbox and its scratch


def _local_mailbox():
    local = _locals.__dict__
    if "mailbox" not in local:
        _locals.mailbox = np.zeros(MAILBOX_SIZE, dtype=np.int64)
        _locals.scratch = None
    return _locals


def compile_runner(entry):
    """``entry`` (a module-level function of a mailbox pointer) as a cached C callback."""
    from . import cached_cfunc

    return cached_cfunc(RUNNER_SIGNATURE, entry)


class _Helper:
    """One helper thread and its mailbox (a row of Helpers.mailboxes)."""

    def __init__(self, mailbox: np.ndarray, spin_cycles: int):
        self.mailbox = mailbox
        self.mailbox[CPU] = -1
        self.scratch = None
        self.thread = threading.Thread(target=_serve, args=(self.mailbox, spin_cycles), name="onnx-runtime-helper",
                                       daemon=True)
        self.thread.start()

    def post(self, kind: Kind, arguments) -> int:
        """Post a part whether or not the helper is spinning (a sleeping one is woken to run it)."""
        kind.write(self.mailbox, self, arguments)
        sequence, asleep = _publish(self.mailbox)
        if asleep:
            wake(self.mailbox)
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
        if count and not host.HELPER_THREADS:
            raise RuntimeError(f"onnx-runtime: no helper threads: {host.HELPERS_REFUSED}")
        self.cycles_per_second = _cycles_per_second() if count else 1.0  # (the time-stamp counter's rate)
        spin_cycles = max(1, int(self.cycles_per_second * _SPIN_SECONDS))
        self._cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        self.mailboxes = np.zeros((count, MAILBOX_SIZE), dtype=np.int64)  # for compiled callers: see offer
        self.states = np.zeros(count, dtype=np.int64)
        self._helpers = [_Helper(self.mailboxes[i], spin_cycles) for i in range(count)]
        self._busy = threading.Lock()
        self._scratch_floats = 0  # what _ensure_scratch has given every helper

    def call(self, function, arguments: tuple, runner: int, scratch: int = 0) -> int | None:
        """``function(*arguments, mailboxes, states, runner)``, a compiled caller that posts its parts with
        offer/collect and returns collect's result, while it holds the helpers (each given ``scratch``
        floats first), then settle; None, without calling it, when another caller holds them."""
        if not self._busy.acquire(blocking=False):
            return None
        try:
            self._ensure_scratch(scratch)
            result = function(*arguments, self.mailboxes, self.states, runner)
            if result:
                self.settle(result)
            return result
        finally:
            self._busy.release()

    def _ensure_scratch(self, floats: int) -> None:
        """Every helper's scratch at least ``floats`` long, for parts posted from compiled code (offer);
        only while the helpers are held (idle)."""
        if floats > self._scratch_floats:
            for helper in self._helpers:
                _grow_scratch(helper, helper.mailbox, floats)
            self._scratch_floats = floats

    def settle(self, result: int) -> None:
        """What a compiled caller's ``collect`` left to Python (its non-zero ``result``): move helpers off
        the caller's CPU."""
        if result & _SPREAD:
            self._spread()

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

    def run(self, kind: Kind, parts, long: bool = False) -> None:
        """One job of ``kind`` per part: parts[0] on the calling thread, the others on the helpers;
        returns when all are done. A caller that finds the helpers busy (sessions run from several
        threads) runs every part itself, and so does it with the parts of sleeping helpers (while
        they wake up), unless the parts are ``long`` (milliseconds each): those are posted anyway and
        wait for the helper to wake (a helper that woke during a long job run alone would go back to
        sleep before the next one)."""
        if not self._busy.acquire(blocking=False):
            for part in parts:
                kind.here(part)
            return
        try:
            if long:
                self._run_long(kind, parts)
                return
            # Posted as compiled callers do (offer/collect), each part's arguments written by the kind's
            # compiled writer: a few microseconds per job (a Python hand-off measured ~50).
            runner, count = kind.address(), min(len(parts) - 1, len(self._helpers))
            here = [parts[0], *parts[1 + count:]]
            for index in range(count):
                helper = self._helpers[index]
                kind.write(helper.mailbox, helper, parts[index + 1])
                if not offer(self.mailboxes, self.states, index, runner):
                    here.append(parts[index + 1])
            try:
                for part in here:
                    kind.here(part)
            finally:
                result = collect(self.mailboxes, self.states, count)
                if result:
                    self.settle(result)
        finally:
            self._busy.release()

    def _run_long(self, kind: Kind, parts) -> None:
        """Parts of milliseconds: posted to sleeping helpers too, waiting for them to wake."""
        self._spread()
        posted = [(helper, helper.post(kind, part)) for helper, part in zip(self._helpers, parts[1:])]
        try:
            for part in [parts[0], *parts[1 + len(posted):]]:  # beyond the helpers' count: here
                kind.here(part)
        finally:
            for helper, sequence in posted:
                helper.wait(sequence)


_helpers: Helpers | None = None
_helpers_lock = threading.Lock()


def _forget_helpers() -> None:
    # A forked child has none of the parent's threads: it starts its own helpers when it needs them.
    global _helpers, _helpers_lock
    _helpers, _helpers_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_helpers)


def helpers(count: int) -> Helpers:
    """The process's helpers (``count`` threads, started on first use; none, with a warning, on a
    platform that cannot run them: see host.py)."""
    global _helpers
    pool = _helpers  # one read: set once per process (a forked child starts afresh)
    if pool is not None:
        return pool
    with _helpers_lock:
        if _helpers is None:
            _helpers = Helpers(_allowed(count, host.HELPERS_REFUSED))
        return _helpers


def _allowed(count: int, refusal: str) -> int:
    """The helper threads to start: ``count``, or none (said once, in a RuntimeWarning) where ``refusal``
    (host.HELPERS_REFUSED) says why the platform cannot run them."""
    if count and refusal:
        warnings.warn(f"onnx-runtime: {refusal}; the split kernels run every part on the calling thread",
                      RuntimeWarning, stacklevel=4)
        return 0
    return count


NO_HELPERS = (np.zeros((0, MAILBOX_SIZE), dtype=np.int64), np.zeros(0, dtype=np.int64))  # (mailboxes, states)


def call(function, arguments: tuple, runner: int, scratch: int, count: int) -> None:
    """``function(*arguments, mailboxes, states, runner)``, a compiled caller that posts its parts (jobs.split_*),
    with the process's ``count`` helpers (started on first use; 0: none); every part on the calling thread
    when there are none or another caller holds them. ``scratch``: the floats each helper's part needs."""
    if count and helpers(count).call(function, arguments, runner, scratch) is not None:
        return
    function(*arguments, *NO_HELPERS, runner)


def run(kind: Kind, parts, count: int, long: bool = False) -> None:
    """One job of ``kind`` per part, split across the calling thread and ``count`` helpers (one part
    runs on the calling thread alone); ``long``: see Helpers.run."""
    if len(parts) == 1:
        kind.here(parts[0])
    else:
        helpers(count).run(kind, parts, long)
