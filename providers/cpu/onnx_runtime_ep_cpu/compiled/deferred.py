"""Compiled loops that a new process may serve from numpy until numba has loaded in the background.

Importing numba and llvmlite and linking a loop's cached machine code costs a fresh process several times
what onnxruntime spends on session creation and first run, and about 95 MB of memory. So a loop is a
``Loop``: a callable that holds the Python function and builds numba's dispatcher only when needed. While a
session has opened *deferral* (the CPU provider does, unless turned off), a loop that has a numpy
equivalent of identical semantics (generic.py) runs that one and records the argument types it saw. A
thread started by the first such call waits until the runs pause or the process has spent half a second
of CPU time, lowers its priority, imports numba, builds those loops' dispatchers, links the recorded signatures
from numba's disk cache, and then switches each loop to its dispatcher. Kernels that ask ``numpy_first`` name
the job kinds their compiled path runs (``"jobs.POOL"``); the loader links those runners too. The loader thread
never compiles: what the cache misses (a new install, an edited package) is compiled by a child interpreter at
low priority (compile_child.py) into the same cache, then linked, and deferral stays open until all of it is
linked, so no run waits for a compile of something it had a numpy path for. After the switch a run's cache
miss is no compile either (``_guard``): the loader's child compiles it while the loop's numpy equivalent, or its
caller's fallback (a compiled path tried inside ``Trial``), serves; loops only helper threads call are named
where they are defined (``Loop.expect``). A process that exits sooner (one run of a command-line
tool) never loads numba at all, and one that exits while the child compiles kills it (finished entries stay).

Turned off by the environment variable ONNX_RUNTIME_COMPILE_IN_BACKGROUND=0 or a session's config entry
``session.compile_in_background`` = "0" (for the whole process: the loops are shared by every session), and
never on in a process that had imported numba before its first session (the import is paid already) or
outside sessions (direct calls of the loops, the compile-ahead command). The switch is one attribute store
per loop, so concurrent runs see either path, both correct. At exit the thread is stopped between steps and
joined: LLVM must not be mid-call while the interpreter tears down.
"""

from __future__ import annotations

import _thread
import atexit
import functools
import os
import sys
import threading
import time
from typing import Any

import numpy as np

from .. import provisional
from .reference_run import local as _reference

ENV = "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"
CONFIG_KEY = "session.compile_in_background"
QUIET_S, IDLE_SHARE = 0.05, 0.25  # the loader starts once the runs paused (see _load) ...
# ... or spent this much CPU time after the first numpy-served call: the numpy equivalents of small kernels
# cost a few times the loops, so by then they have cost about what loading numba does (ski rental)
PATIENCE_S = 0.5
_MAX_SIGNATURES = 16  # per loop: argument types recorded for the loader to link
LOADER_NAME = "onnx-runtime-compiled-loops"  # the loader's threads

_lock = threading.Lock()  # the list of loops and their recorded signatures: held for microseconds
_build_lock = threading.RLock()  # building a dispatcher (the first imports numba): held for long
_loops: list[Loop] = []
_generic = None  # generic.py's lookup of a loop's numpy twin, imported on the first deferred call
_needs: set[tuple] = set()  # job kinds named by numpy_first's callers ("jobs.POOL", or with a part's types)
_kinds_linked: set = set()  # of those, the ones the loader has dealt with
_missed: set[tuple] = set()  # (loop, numba signature) or (None, runner entry) a run's thread met uncached
provisional.bind_missing(_missed)  # (plans made while one was served wait for it: provisional.py)
_abandoned: set[tuple] = set()  # of those, what the child could not compile: compiled where called, as before
_trial = threading.local()  # depth: this thread runs a compiled path that has a fallback (see Trial)
_PACKAGE = __name__.rsplit(".", 1)[0]


class CacheMiss(RuntimeError):
    """What the background loader was to link is not in numba's disk cache (the loader never compiles)."""


class WouldCompile(Exception):
    """Raised inside a Trial where a loop or job runner the compiled path calls is not in numba's cache: the
    loader has it compiled in its child, and the caller serves this call by its fallback path meanwhile."""


class Trial:
    """``with Trial():`` around a compiled path whose caller has another (numpy, BLAS, node by node) for the
    same call: while deferral's guard is on (``guarding()``), a loop without a numpy equivalent or a job runner
    that misses numba's cache raises WouldCompile instead of compiling on this thread. Outside a trial such a
    miss compiles where it is called, as it must (there is nothing else to run)."""

    __slots__ = ()

    def __enter__(self):
        _trial.depth = getattr(_trial, "depth", 0) + 1
        return self

    def __exit__(self, *exc):
        _trial.depth -= 1
        return False


def tried(owner, flag: str, function, *args):
    """``function(*args)`` in a Trial, for a caller whose compiled path is untried while ``owner``'s attribute
    ``flag`` is false: set once a call after deferral returned a result (one during deferral may have taken its
    numpy path); None (the caller's other path) on WouldCompile."""
    compiled = not state.deferring
    try:
        with Trial():
            result = function(*args)
    except WouldCompile:
        return None
    if result is not None and compiled:
        setattr(owner, flag, True)
    return result


def in_trial() -> bool:
    """Whether this thread runs inside a Trial."""
    return getattr(_trial, "depth", 0) > 0


def guarding() -> bool:
    """Whether a run's compiled paths should be tried in a Trial (deferral was opened in this process)."""
    return state.guarding


class _State:
    deferring = False  # numpy-served first calls allowed now
    disabled = False  # by the environment or a session's config: for the rest of the process
    ready = False  # the loader finished: every later first call builds its dispatcher
    first_generic = 0.0  # the process's CPU time at the first numpy-served call
    # native ids of the threads that ran numpy equivalents (None where /proc/self/task is not there)
    callers: set | None = set() if os.path.isdir("/proc/self/task") else None
    last_cpu = (0.0, 0.0)  # (process CPU, monotonic) at the last look, where callers is None
    thread: _Thread | None = None
    stop = threading.Event()
    typeof_registered = False
    numba_imported = False  # by ensure_numba
    loader_ident = 0
    importing = False  # the loader is importing numba (kernel factories wait: before_kernel_build)
    child: Any = None  # the compile process (compile_child.py, a Popen) while it runs
    compiled_in_child = 0  # rounds that needed it
    child_errors = ""  # the end of its stderr, where it failed
    guarding = False  # deferral was opened: a run's thread hands its cache misses to the loader (see guard)
    rounds: _Thread | None = None  # the loader's rounds for misses met after it finished
    wanted = False  # a miss came since the last round began


state = _State()


def open_session(config: dict | None) -> None:
    """Called by the CPU provider for each session: opens deferral unless turned off (see the module doc)."""
    config = config or {}
    if os.environ.get(ENV, "1").strip() == "0" or str(config.get(CONFIG_KEY, "1")).strip() == "0":
        disable()
        return
    if state.disabled or state.ready or state.deferring:
        return
    if "numba" in sys.modules:  # imported already: nothing left to save; load as before
        return
    state.deferring = state.guarding = True


def disable() -> None:
    """Serve every later call compiled (a running loader still switches what it loaded)."""
    state.disabled = True
    state.deferring = state.guarding = False


def wait_ready(timeout: float | None = None) -> bool:
    """Wait for the loader (True once it has switched the loops it loaded, and linked what the runs missed
    since; at once if none runs) and make the plans made while those were served again (provisional.py)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    thread = state.thread
    if thread is not None:
        thread.join(timeout)
    for _ in range(8):  # (a plan made again may meet misses of its own: a few rounds)
        while (rounds := state.rounds) is not None and rounds.is_alive():
            rounds.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if deadline is not None and time.monotonic() >= deadline:
                break
        if state.rounds is not None or (thread is not None and thread.is_alive()) or not provisional.settle_held():
            break
    return (state.ready or thread is None) and state.rounds is None


def numpy_first(*kinds: str | tuple) -> bool:
    """Whether a kernel with a numpy or BLAS path of its own beside a compiled one that imports numba (the
    AVX-512 products and attention tiles) should take its own path for this call: while deferral is open.
    Starts the loader as a numpy-served loop call does, so that later calls find numba loaded and the
    compiled path taken; the caller must decide per call (a choice made once would keep the slow path).
    ``kinds``: the job kinds its compiled path runs, as "jobs.NAME" (compiled/jobs.py), whose runners the
    loader has ready (compiled in its child where the cache misses them) before it closes deferral; or as
    ("jobs.NAME", arguments), a part's arguments as the compiled path would post them, for the kind's writer
    too (its types are the arguments')."""
    if not state.deferring:
        return getattr(_reference, "depth", 0) > 0  # (a ReferenceRun: numpy's path, nothing recorded)
    if kinds:
        key = tuple(k if isinstance(k, str) else (k[0], tuple(_describe(a) for a in k[1])) for k in kinds)
        if key not in _needs:
            with _lock:
                _needs.add(key)
    _note_caller()
    return True


def loading_only() -> bool:
    """Whether this thread is the loader, which links from numba's cache and never compiles (see CacheMiss)."""
    return state.loader_ident == threading.get_ident()


def _note_caller() -> None:
    callers = state.callers
    if callers is not None and threading.get_native_id() not in callers:
        callers.add(threading.get_native_id())
    if state.thread is None:
        _start(time.process_time())


def _unbuilt(*args):
    raise RuntimeError("a compiled loop was called before its construction finished")


def _describe(value):
    """What numba's typeof needs of an argument, without keeping the argument alive; None if unknown."""
    if isinstance(value, np.ndarray):
        flags = value.flags
        layout = "C" if flags.c_contiguous else "F" if flags.f_contiguous else "A"
        return ("array", value.dtype, value.ndim, layout, not flags.writeable)
    if isinstance(value, (bool, int, float, np.generic)):
        return ("value", value)
    return None


class Loop(functools.partial):
    """A compiled loop: calls go to numba's dispatcher once built, or to the numpy equivalent while deferring.

    A partial without arguments, so that a call reaches its target (``func``) in C: a Python ``__call__``
    would add a frame to every call of a compiled kernel (a third of a small loop's dispatch). Switching
    swaps the target (``__setstate__``); the first target stays referenced, as a call may be inside it."""

    def __new__(cls, function, build):
        self = super().__new__(cls, _unbuilt)
        self.py_func = function
        self._build_dispatcher = build  # function -> numba dispatcher (compiled/__init__.py's settings)
        self._dispatcher = None
        self._generic = False  # not looked up yet
        self._signatures: set = set()
        self._first_call = self._first
        self.__name__ = function.__name__
        self.__qualname__ = function.__qualname__
        self.__module__ = function.__module__
        self.__doc__ = function.__doc__
        self.__wrapped__ = function
        self.switch(self._first_call)
        with _lock:
            _loops.append(self)
        return self

    def __getattr__(self, name):
        # numba's own attributes (stats, signatures, ...) once the dispatcher exists; never builds it
        dispatcher = self.__dict__.get("_dispatcher")
        if dispatcher is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(dispatcher, name)

    def __repr__(self):
        return f"<compiled loop {self.__module__}.{self.__qualname__}>"

    @property
    def key(self) -> str:
        return f"{self.__module__}.{self.__qualname__}"

    def generic(self):
        """The numpy equivalent (generic.py), or None."""
        if self._generic is False:
            global _generic
            if _generic is None:
                from .generic import twin

                _generic = twin
            self._generic = _generic(self.key)
        return self._generic

    def dispatcher(self):
        """numba's dispatcher for this loop, built on first use (imports numba)."""
        if self._dispatcher is None:
            ensure_numba()
            from numba.core.compiler_lock import global_compiler_lock

            # numba's lock, re-entrant: compiling a loop types the loops it calls (building them) under it
            with global_compiler_lock:
                if self._dispatcher is None:
                    dispatcher = self._build_dispatcher(self.py_func)
                    _guard(self, dispatcher)
                    self._dispatcher = dispatcher
        return self._dispatcher

    def _first(self, *args):
        if state.deferring or getattr(_reference, "depth", 0):
            generic = self.generic()
            if generic is not None:
                if state.deferring:
                    self._record(args)
                with np.errstate(all="ignore"):  # the loops give inf/NaN silently (error_model="numpy")
                    return generic(*args)
        target = self.dispatcher()
        self.switch(target)
        return target(*args)

    def expect(self, *args) -> None:
        """Record a call's argument types that only compiled paths make (no numpy path calls the loop), where the
        loop is defined, so that the loader links them (its child compiles them first where the cache misses)
        before deferral closes, as it does for what numpy-served calls recorded."""
        described = tuple(_describe(a) for a in args)
        if None not in described:
            with _lock:
                self._signatures.add(described)
            if state.ready:  # defined after the loader finished: a round of its own
                _request_round()

    def pending(self) -> bool:
        """Served from numpy so far, with argument types recorded for the loader."""
        return bool(self._signatures) and not self.switched

    def recorded(self) -> list:
        """The argument descriptions recorded so far."""
        with _lock:
            return list(self._signatures)

    def link_recorded(self, stop: threading.Event):
        """The dispatcher, with the recorded signatures linked from numba's disk cache (the loader's step)."""
        from numba.core.compiler_lock import global_compiler_lock

        with global_compiler_lock:  # no compile or link of another thread's meanwhile
            dispatcher = self.dispatcher()
            with _lock:
                signatures = list(self._signatures)
            for described in signatures:
                if stop.is_set():
                    break
                try:
                    _link_cached(dispatcher, tuple(_numba_type(d) for d in described))
                except Exception:  # noqa: BLE001  (an odd argument type: the first compiled call links it)
                    pass
        return dispatcher

    def switch(self, target) -> None:
        """Calls go to ``target`` from now on."""
        self.__setstate__((target, (), None, self.__dict__))

    @property
    def switched(self) -> bool:
        """Calls go to numba's dispatcher."""
        return self._dispatcher is not None and self.func is self._dispatcher

    def _record(self, args) -> None:
        if len(self._signatures) < _MAX_SIGNATURES:
            described = tuple(_describe(a) for a in args)
            if None not in described:
                with _lock:
                    self._signatures.add(described)
        _note_caller()


def _register_typeof() -> None:
    """A loop called from inside another compiled loop is typed as its dispatcher (numba types globals)."""
    if state.typeof_registered:
        return
    from numba.core import types
    from numba.extending import typeof_impl

    @typeof_impl.register(Loop)
    def _typeof_loop(value, context):
        return types.Dispatcher(value.dispatcher())

    state.typeof_registered = True


def _callers_asleep() -> bool:
    """Whether every thread that ran a numpy equivalent sleeps (Linux: /proc's task states; a thread that ended
    counts as asleep). Elsewhere: whether the process used under IDLE_SHARE of a core since
    the last look."""
    if state.callers is None:
        cpu, now = time.process_time(), time.monotonic()
        idle = cpu - state.last_cpu[0] < IDLE_SHARE * (now - state.last_cpu[1])
        state.last_cpu = (cpu, now)
        return idle
    for tid in list(state.callers):
        try:
            with open(f"/proc/self/task/{tid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if fields and fields[0] != b"S":  # running, runnable, or in an uninterruptible wait (a page fault)
            return False
    return True


def _start(cpu: float) -> None:
    with _lock:
        if state.thread is not None:
            return
        state.first_generic = cpu
        state.thread = _Thread(_load)
    state.thread.start()


class _Thread:
    """A daemon thread of the loader's, started without waiting for the OS to run it: threading.Thread.start
    blocks its caller until then, and the loader starts inside a first run (on a loaded host that wait was
    milliseconds of the run's wall time). ``is_alive`` (from its making to its target's end) and ``join`` as
    threading's; the thread takes its name."""

    def __init__(self, target) -> None:
        self.target, self.done = target, threading.Event()

    def start(self) -> None:
        try:
            _thread.start_new_thread(self._run, ())
        except BaseException:
            self.done.set()  # never ran: no exit or wait_ready waits for it
            raise

    def _run(self) -> None:
        threading.current_thread().name = LOADER_NAME  # (threading's stand-in for a thread it did not start)
        try:
            self.target()
        finally:
            self.done.set()

    def is_alive(self) -> bool:
        return not self.done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self.done.wait(timeout)


def _numba_type(description):
    import numba
    from numba.np import numpy_support

    if description[0] == "array":
        _, dtype, ndim, layout, readonly = description
        return numba.types.Array(numpy_support.from_dtype(dtype), ndim, layout, readonly=readonly)
    return numba.typeof(description[1])


def ensure_numba() -> None:
    """numba and the parts of it the loader and the loops' first calls use, imported by one thread at a time
    (numba's package imports circularly, and breaks when two threads import it at once), with Loop typed for
    numba: anything that compiles code calling a loop (a cfunc as well as a loop) must call this first."""
    if state.numba_imported:
        return
    with _build_lock:
        if state.numba_imported:
            return
        state.importing = True
        try:
            import numba  # noqa: F401
            import numba.core.caching  # noqa: F401
            import numba.core.compiler_lock  # noqa: F401
            import numba.cpython.hashing  # noqa: F401
            import numba.np.numpy_support  # noqa: F401

            _register_typeof()
            state.numba_imported = True
        finally:
            state.importing = False


def before_kernel_build() -> None:
    """Called before a kernel factory runs (it may import modules that import numba): waits while another
    thread imports numba (see ensure_numba)."""
    if state.importing:
        with _build_lock:
            pass


def _link_cached(dispatcher, signature: tuple) -> None:
    """Link one signature from numba's disk cache into the dispatcher, as Dispatcher.compile does before it
    would compile; a miss is left to the first call."""
    from numba.core.compiler_lock import global_compiler_lock

    cache, hits = getattr(dispatcher, "_cache", None), getattr(dispatcher, "_cache_hits", None)
    if cache is None or hits is None:
        return
    with global_compiler_lock:
        if dispatcher.overloads.get(signature) is not None:
            return
        cres = cache.load_overload(signature, dispatcher.targetctx)
        if cres is None:
            return
        hits[signature] += 1
        if not cres.objectmode:
            dispatcher.targetctx.insert_user_function(cres.entry_point, cres.fndesc, [cres.library])
        dispatcher.add_overload(cres)


def _guard(loop: Loop, dispatcher) -> None:
    """Route the dispatcher's cache misses on a run's thread (numba calls ``_compile_for_args`` when no linked
    signature fits the arguments, then what it returns): while guarding, one numba's cache holds is linked
    (milliseconds); else the miss goes to the loader, whose child compiles it, and this call is served by the
    loop's numpy equivalent, or, inside a Trial, by the caller's fallback (WouldCompile). Otherwise, or where
    the child could not compile it, it compiles here, as numba would."""
    compile_for_args = dispatcher._compile_for_args  # noqa: SLF001

    def guarded(*args, **kwargs):
        if not state.guarding or kwargs or threading.get_ident() == state.loader_ident:
            return compile_for_args(*args, **kwargs)
        try:
            key = (loop, tuple(dispatcher.typeof_pyval(a) for a in args))
        except Exception:  # noqa: BLE001  (numba names what it cannot type)
            return compile_for_args(*args)
        if key in _abandoned:
            return compile_for_args(*args)
        if key not in _missed:
            _link_cached(dispatcher, key[1])
            if dispatcher.overloads.get(key[1]) is not None:
                return compile_for_args(*args)  # finds what was linked
        generic = loop.generic()
        if generic is None and not getattr(_trial, "depth", 0):
            return compile_for_args(*args)
        _miss(key)
        provisional.note(key)
        if generic is None:
            raise WouldCompile(loop.key)
        return functools.partial(_quietly, generic)  # (numba calls what this returns with the arguments)

    dispatcher._compile_for_args = guarded  # noqa: SLF001  (an instance attribute: numba's C call looks it up)


def _quietly(generic, *args):
    with np.errstate(all="ignore"):  # the loops give inf/NaN silently (error_model="numpy")
        return generic(*args)


def overload(loop: Loop, types: tuple):
    """``loop``'s entry point for numba ``types``: linked from the cache, or compiled where the guard is off; None
    where guarding and the cache misses it: the loader's child compiles it, the caller's plan is provisional."""
    dispatcher = loop.dispatcher()
    key, found = (loop, types), dispatcher.overloads.get(types)
    if found is not None:
        return found.entry_point
    if not state.guarding or threading.get_ident() == state.loader_ident or key in _abandoned:
        return dispatcher.compile(types)
    if key not in _missed:
        _link_cached(dispatcher, types)
        found = dispatcher.overloads.get(types)
        if found is not None:
            return found.entry_point
    _miss(key)
    provisional.note(key)
    return None


def must_not_compile() -> bool:
    """Whether a job runner that misses the cache must raise WouldCompile here (a run's thread in a Trial)."""
    return state.guarding and getattr(_trial, "depth", 0) > 0 and threading.get_ident() != state.loader_ident


def runner_missed(entry) -> WouldCompile:
    """The error for a job runner's entry function that missed the cache inside a Trial; the loader has it
    compiled."""
    key = (None, entry)
    if key in _abandoned:
        return WouldCompile(f"{entry.__module__}.{entry.__qualname__} (not compiled by the loader's child)")
    _miss(key)
    provisional.note(key)
    return WouldCompile(f"{entry.__module__}.{entry.__qualname__}")


def _miss(key: tuple) -> None:
    with _lock:
        if key in _missed:
            return
        _missed.add(key)
    _request_round()


def _request_round() -> None:
    """Have the loader deal with the misses: the running loader's next round, or a new round thread."""
    with _lock:
        state.wanted = True
        if not state.ready or state.rounds is not None or state.stop.is_set():
            return  # the loader (or the round thread) looks again before it ends
        state.rounds = _Thread(_rounds)
    state.rounds.start()


def _rounds() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass
    state.loader_ident = threading.get_ident()
    try:
        while not state.stop.is_set():
            with _lock:
                if not state.wanted:
                    state.rounds = None
                    return
                state.wanted = False
            _settle()
    finally:
        state.loader_ident = 0
        with _lock:
            state.rounds = None


def _settle_misses(fresh: list) -> tuple[list, list]:
    """Link the misses ``fresh`` from the cache; returns (loops, runners) still missing, as the child's request."""
    loops, runners = [], []
    for loop, signature in fresh:
        if loop is None:
            try:
                from . import cached_cfunc
                from .workers import RUNNER_SIGNATURE

                cached_cfunc(RUNNER_SIGNATURE, signature)
            except CacheMiss:
                runners.append(signature)
            except Exception:  # noqa: BLE001  (it fails where it is called, and says why)
                pass
            continue
        try:
            _link_cached(loop.dispatcher(), signature)
        except Exception:  # noqa: BLE001
            continue
        if loop.dispatcher().overloads.get(signature) is None:
            loops.append((loop, signature))
    return loops, runners


def _after_child(fresh: list) -> None:
    """Link what the child compiled; what it could not is left to where it is called (abandoned)."""
    loops, runners = _settle_misses(fresh)
    with _lock:
        _abandoned.update(loops)
        _abandoned.update((None, entry) for entry in runners)
        _missed.difference_update(fresh)
    provisional.advance()


def _linked(dispatcher, described) -> bool:
    try:
        return dispatcher.overloads.get(tuple(_numba_type(d) for d in described)) is not None
    except Exception:  # noqa: BLE001  (an odd argument type: the first compiled call links or compiles it)
        return True


def _link_kind(name: str) -> bool:
    """The runner of the job kind ``name`` ("jobs.POOL") linked from the cache; False on a miss."""
    try:
        _kind(name).address()
    except CacheMiss:
        return False
    except Exception:  # noqa: BLE001  (no such kind: its first call says so)
        pass
    _kinds_linked.add(name)
    return True


def _kind(name: str):
    module, _, attribute = name.rpartition(".")
    return getattr(__import__(f"{_PACKAGE}.{module}", fromlist=[attribute]), attribute)


def _posting_loops(needs: list) -> list:
    """(loop, description) of what posts a part of each kind named with its arguments: the kind's writer (the
    mailbox, then the part's arguments) and workers.run_here (a runner's address and a mailbox)."""
    from . import workers

    mailbox = ("array", np.dtype(np.int64), 1, "C", False)
    found = []
    for name, described in needs:
        try:
            found.append((_kind(name).writer, (mailbox, *described)))
        except Exception:  # noqa: BLE001  (no such kind: its first call says so)
            continue
        found.append((workers.run_here, (("value", 0), mailbox)))
    return found


def _compile_in_child(misses: list, kinds: list, signatures: tuple | list = (), runners: tuple | list = ()) -> bool:
    """Compile ``misses`` ((loop, description)) and the runners of ``kinds`` into numba's cache in a child
    interpreter (compile_child.py), and what the runs missed: ``signatures`` ((loop, numba signature)) and
    ``runners`` (job runners' entry functions); False where it failed or the process is exiting (the child
    killed)."""
    from .child_process import encode, pickled, run_child  # (only the loader's misses start a child)

    request = {"loops": [[loop.__module__, loop.__qualname__, [encode(d) for d in described]]
                         for loop, described in misses],
               "kinds": [[f"{_PACKAGE}.{name.rpartition('.')[0]}", name.rpartition(".")[2]] for name in kinds],
               "signatures": [[loop.__module__, loop.__qualname__, pickled(signature)]
                              for loop, signature in signatures if pickled(signature)],
               "runners": [[entry.__module__, entry.__qualname__] for entry in runners]}
    return run_child(request, state, ENV)


def _link_posting(posting: list) -> list:
    """Link _posting_loops' signatures from the cache; returns those it misses."""
    misses = []
    for loop, described in posting:
        try:
            _link_cached(loop.dispatcher(), tuple(_numba_type(d) for d in described))
        except Exception:  # noqa: BLE001  (an odd argument type: the first compiled call links or compiles it)
            continue
        if not _linked(loop.dispatcher(), described):
            misses.append((loop, described))
    return misses


def _settle() -> bool:
    """One round of the loader: link what the runs recorded and named, compile the misses in the child, link
    them, switch the loops whose every recorded signature is linked. False when nothing was pending."""
    with _lock:
        loops = [loop for loop in _loops if loop.pending()]
        named = {k if isinstance(k, str) else k[0] for needs in _needs for k in needs}
        posted = [k for needs in _needs for k in needs if not isinstance(k, str) and k not in _kinds_linked]
        kinds = sorted(named - _kinds_linked)
        fresh = list(_missed)  # what the runs met uncached (see _guard)
    if not loops and not kinds and not posted and not fresh:
        return False
    _kinds_linked.update(posted)
    posting = _posting_loops(posted)
    loaded = [(loop, loop.link_recorded(state.stop)) for loop in loops if not state.stop.is_set()]
    missing = [name for name in kinds if not state.stop.is_set() and not _link_kind(name)]
    misses = [(loop, d) for loop, dispatcher in loaded for d in loop.recorded() if not _linked(dispatcher, d)]
    misses += _link_posting(posting)
    signatures, runners = _settle_misses(fresh)
    if (misses or missing or signatures or runners) and not state.stop.is_set():
        state.compiled_in_child += 1
        # where it failed, what it did not compile is compiled at first call
        _compile_in_child(misses, missing, signatures, runners)
        if state.stop.is_set():
            return False
        loaded = [(loop, loop.link_recorded(state.stop)) for loop in loops if not state.stop.is_set()]
        _link_posting(posting)
        for name in missing:
            if not _link_kind(name):
                _kinds_linked.add(name)  # not cached after all (no writable cache): its first call compiles
    if state.stop.is_set():
        return False
    _after_child(fresh)
    for loop, dispatcher in loaded:
        loop.switch(dispatcher)
    return True


def _load() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread only (Linux)
    except (AttributeError, OSError):
        pass
    # Wait for the runs to pause (every thread that ran a numpy equivalent asleep at a look, every QUIET_S), or
    # for PATIENCE_S of CPU time spent since the first numpy-served call (steady back-to-back runs never pause;
    # CPU time, not wall time, which a loaded host stretches).
    while not state.stop.wait(QUIET_S):
        if _callers_asleep() or time.process_time() - state.first_generic >= PATIENCE_S:
            break
    if state.stop.is_set():  # the process exits (_stop_at_exit) before the runs paused: numba is never needed
        return
    from .import_wait import WaitWhileImporting

    finder = WaitWhileImporting(state, _build_lock)
    state.loader_ident = threading.get_ident()
    sys.meta_path.insert(0, finder)
    try:
        ensure_numba()
        # numba's typeof of an array type its dispatcher has not seen reads np.ma, which numpy imports at its
        # first access (~25 ms): here, not in the first run of the compiled paths that calls a loop directly
        import numpy.ma  # noqa: F401

        sys.meta_path.remove(finder)
        # rounds until one finds nothing new: the runs go on recording on numpy while a round compiles
        while not state.stop.is_set() and _settle():
            pass
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
        state.deferring = False
        state.loader_ident = 0
        state.ready = True
    if _missed:  # met after this loader's last round looked
        _request_round()


def _stop_at_exit() -> None:
    state.stop.set()
    for thread in (state.thread, state.rounds):
        if thread is not None and thread.is_alive():
            thread.join(30)


def _after_fork_in_child() -> None:
    # the loader thread did not survive the fork (nor its hold on the locks): let the child start its own
    global _lock, _build_lock
    _lock, _build_lock = threading.Lock(), threading.RLock()
    state.importing = False
    state.thread = state.rounds = None
    state.child = None
    state.loader_ident = 0
    if state.callers is not None:
        state.callers = set()
    state.stop = threading.Event()


atexit.register(_stop_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
