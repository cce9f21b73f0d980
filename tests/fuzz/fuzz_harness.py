"""Mutation fuzzing of model files: every case in a child process with a memory and a time limit.

Seeds are onnx's backend node cases (with their inputs) and the onnx wheel's light CNNs. Each case
mutates one seed, deterministically from ``(seed, index)``: flipped bytes, a truncated file, or
protobuf field mutations (attribute values and types, node inputs and outputs, opsets, declared
shapes and types, initializer contents, feed values). Workers are long-lived child processes under
``RLIMIT_AS``; a worker that dies or overruns the time limit is replaced. Each case ends as one of

- ``ok``: the session was created and ran;
- ``cancelled``: the run took more than half the time limit and stopped, typed (``RunCancelledError``), when
  the harness set its ``RunOptions.terminate`` (a model may legitimately ask for endless work, such as a Loop of
  2**62 iterations; what must not happen is a run that ignores the request);
- ``typed``: an ``OnnxRuntimeError`` that does not merely wrap an internal bug;
- ``disguised``: an ``OnnxRuntimeError`` whose cause is an internal bug (``TypeError``,
  ``AttributeError``, ``IndexError``, ...): a typed error in name only;
- ``untyped``: any other exception;
- ``runaway``: ``MemoryError`` (the allocation passed the limit) or an allocator abort;
- ``crash``: the worker died by a signal;
- ``hang``: no answer within the time limit.

Each distinct failure (outcome, exception type and raising frame) is saved once under ``--out`` as
the mutated model, its feeds and a JSON description; ``tests/fuzz/regressions`` keeps those that
were fixed, replayed by the tests.

Short run (what CI runs through tests/fuzz/test_fuzz.py)::

    python tests/fuzz/fuzz_harness.py --cases 300 --seed 1
Release run (documented in benchmarks/RESULTS.md)::

    python tests/fuzz/fuzz_harness.py --minutes 30 --workers 2 --out fuzz-findings
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import pickle
import queue
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

OUTCOMES = ("ok", "cancelled", "typed", "disguised", "untyped", "runaway", "crash", "hang")
FAILURES = ("disguised", "untyped", "runaway", "crash", "hang")
# The internal errors a typed error must not merely wrap.
INTERNAL = ("TypeError", "AttributeError", "IndexError", "KeyError", "NameError", "UnboundLocalError",
            "AssertionError", "ZeroDivisionError", "RecursionError", "NotImplementedError", "StopIteration")
MEMORY_LIMIT = 4 << 30
_memory_limit = MEMORY_LIMIT  # the worker's, set when it starts
TIME_LIMIT = 30.0  # CPU seconds per case
CANCEL_AFTER = 0.5  # of the time limit: a run still going then has its RunOptions.terminate set
FEED_LIMIT = 1 << 20  # elements of one synthesized feed; larger declared inputs are not fed


# -- seeds ----------------------------------------------------------------------------------------------
def node_seeds() -> list[tuple[str, bytes, list]]:
    """(name, model bytes, feeds in graph-input order) of onnx's backend node cases."""
    import warnings

    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    seeds = []
    for case in sorted(cases, key=lambda c: c.name):
        inputs = list(case.data_sets[0][0]) if case.data_sets else []
        seeds.append((case.name, case.model.SerializeToString(), inputs))
    return seeds


def light_seeds() -> list[tuple[str, bytes, list]]:
    import numpy as np
    import onnx

    root = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    seeds = []
    for name in sorted(f for f in os.listdir(root) if f.endswith(".onnx")):
        with open(os.path.join(root, name), "rb") as handle:
            data = handle.read()
        model = onnx.ModelProto.FromString(data)
        inits = {i.name for i in model.graph.initializer}
        feeds = []
        for vi in model.graph.input:
            if vi.name not in inits:
                shape = [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]
                feeds.append(np.random.default_rng(0).standard_normal(shape).astype(np.float32))
        seeds.append((name[:-5], data, feeds))
    return seeds


# -- mutations ------------------------------------------------------------------------------------------
_INTS = (0, -1, 1, 2, 3, -2, 7, 2**31 - 1, -(2**31), 2**31, 2**40, 2**62, 2**63 - 1, -(2**63))
_FLOATS = (0.0, -1.0, 1.0, float("nan"), float("inf"), float("-inf"), 1e30, -1e-30, 0.5)


def _pick(rng: random.Random, values):
    return values[rng.randrange(len(values))]


def _nodes(graph):
    """Every node of ``graph`` and its subgraphs."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            if attr.type == attr.GRAPH:
                yield from _nodes(attr.g)
            for g in attr.graphs:
                yield from _nodes(g)


def _mutate_attribute(rng, model) -> str:
    import onnx

    nodes = [n for n in _nodes(model.graph) if n.attribute]
    if not nodes:
        return _mutate_input_name(rng, model)
    node = _pick(rng, nodes)
    attr = _pick(rng, node.attribute)
    choice = rng.randrange(6)
    if choice == 0:
        node.attribute.remove(attr)
        return f"drop attribute {node.op_type}.{attr.name}"
    if choice == 1:  # another type, keeping the name
        kinds = [onnx.AttributeProto.INT, onnx.AttributeProto.FLOAT, onnx.AttributeProto.INTS,
                 onnx.AttributeProto.STRING, onnx.AttributeProto.FLOATS, onnx.AttributeProto.TENSOR]
        attr.type = _pick(rng, kinds)
        if attr.type == onnx.AttributeProto.FLOAT:
            attr.f = float(attr.i)
        return f"retype attribute {node.op_type}.{attr.name}"
    _mutate_attribute_value(rng, attr, choice)
    return f"value of attribute {node.op_type}.{attr.name}"


def _mutate_attribute_value(rng, attr, choice: int) -> None:
    kind = attr.type
    if kind == attr.INT:
        attr.i = _pick(rng, _INTS)
    elif kind == attr.FLOAT:
        attr.f = _pick(rng, _FLOATS)
    elif kind == attr.INTS:
        if attr.ints and choice < 4:
            attr.ints[rng.randrange(len(attr.ints))] = _pick(rng, _INTS)
        elif attr.ints and choice == 4:
            del attr.ints[rng.randrange(len(attr.ints))]
        else:
            attr.ints.append(_pick(rng, _INTS))
    elif kind == attr.FLOATS and attr.floats:
        attr.floats[rng.randrange(len(attr.floats))] = _pick(rng, _FLOATS)
    elif kind == attr.STRING:
        attr.s = _pick(rng, (b"", b"?", b"NOTSET", b"constant", b"\xff\xfe", attr.s * 3))
    elif kind == attr.TENSOR:
        _mutate_tensor(rng, attr.t)
    elif kind == attr.GRAPH:
        _mutate_graph_io(rng, attr.g)


def _mutate_tensor(rng, tensor) -> None:
    import numpy as np
    from onnx import numpy_helper

    choice = rng.randrange(5)
    if choice == 0 and tensor.dims:
        tensor.dims[rng.randrange(len(tensor.dims))] = _pick(rng, (0, 1, 3, 2**20, -1))
        return
    if choice == 1:
        tensor.data_type = _pick(rng, (1, 2, 3, 6, 7, 9, 10, 11, 16, 8, 0, 99))
        return
    try:
        array = numpy_helper.to_array(tensor).copy()
    except Exception:
        return
    if array.size and array.dtype.kind in "iu":
        flat = array.reshape(-1)
        flat[rng.randrange(flat.size)] = np.array(_pick(rng, _INTS)).astype(array.dtype)
    elif array.size and array.dtype.kind == "f":
        flat = array.reshape(-1)
        flat[rng.randrange(flat.size)] = _pick(rng, _FLOATS)
    elif choice == 4:
        array = np.concatenate([array.reshape(-1), array.reshape(-1)]) if array.size else np.zeros(3, array.dtype)
    else:
        return
    name = tensor.name
    tensor.CopyFrom(numpy_helper.from_array(array, name))


def _mutate_input_name(rng, model) -> str:
    nodes = list(_nodes(model.graph))
    if not nodes:
        return "no node"
    node = _pick(rng, nodes)
    names = [v.name for v in model.graph.input] + [o for n in nodes for o in n.output] + ["", "nowhere"]
    choice = rng.randrange(5)
    if choice == 0 and node.input:
        node.input[rng.randrange(len(node.input))] = _pick(rng, names)
    elif choice == 1 and node.input:
        del node.input[rng.randrange(len(node.input))]
    elif choice == 2:
        node.input.append(_pick(rng, names))
    elif choice == 3 and node.output:
        if rng.random() < 0.5:
            node.output.append(_pick(rng, names + ["extra"]))
        else:
            node.output[rng.randrange(len(node.output))] = _pick(rng, names)
    else:
        node.op_type = _pick(rng, sorted({n.op_type for n in nodes} | {"Identity", "Add", "Reshape", "Loop", "If"}))
    return f"wiring of {node.op_type}"


def _mutate_graph_io(rng, graph) -> str:
    values = list(graph.input) + list(graph.output) + list(graph.value_info)
    if not values:
        return "no values"
    vi = _pick(rng, values)
    t = vi.type.tensor_type
    choice = rng.randrange(4)
    if choice == 0 and vi.type.HasField("tensor_type"):
        t.elem_type = _pick(rng, (1, 2, 3, 6, 7, 9, 10, 11, 16, 8, 0, 100))
    elif choice == 1 and t.shape.dim:
        dim = t.shape.dim[rng.randrange(len(t.shape.dim))]
        dim.dim_value = _pick(rng, (0, 1, 5, 2**20, 2**39))
    elif choice == 2:
        t.shape.dim.add().dim_value = _pick(rng, (1, 2, 7))
    else:
        vi.type.ClearField("tensor_type") if rng.random() < 0.2 else t.ClearField("shape")
    return f"declared type of {vi.name}"


def _mutate_initializer(rng, model) -> str:
    tensors = list(model.graph.initializer) + [a.t for n in _nodes(model.graph) for a in n.attribute
                                               if a.type == a.TENSOR]
    if not tensors:
        return _mutate_attribute(rng, model)
    tensor = _pick(rng, tensors)
    _mutate_tensor(rng, tensor)
    return f"tensor {tensor.name}"


def _mutate_opset(rng, model) -> str:
    if model.opset_import:
        entry = _pick(rng, model.opset_import)
        entry.version = _pick(rng, (1, 6, 7, 9, 11, 13, 17, 21, 25, 10000, 0, -1))
        return f"opset {entry.domain!r}"
    return "no opset"


def _stale_value_info(rng, model) -> str:
    nodes = list(model.graph.node)
    if not nodes:
        return "no node"
    node = _pick(rng, nodes)
    if not node.output or not node.output[0]:
        return "no output"
    from onnx import helper

    shape = [_pick(rng, (1, 2, 3, 4, 8)) for _ in range(rng.randrange(5))]
    model.graph.value_info.append(helper.make_tensor_value_info(node.output[0], _pick(rng, (1, 7, 10)), shape))
    return f"stale value_info for {node.output[0]}"


def _mutate_declared(rng, model) -> str:
    return _mutate_graph_io(rng, model.graph)


_STRUCTURAL = (_mutate_attribute, _mutate_attribute, _mutate_input_name, _mutate_declared, _mutate_initializer,
               _mutate_initializer, _mutate_opset, _stale_value_info)


def _mutate_feeds(rng, feeds: list) -> str:
    import numpy as np

    arrays = [i for i, f in enumerate(feeds) if isinstance(f, np.ndarray) and f.size and f.dtype.kind in "iuf"]
    if not arrays:
        return "no feed"
    index = _pick(rng, arrays)
    array = feeds[index].copy()
    flat = array.reshape(-1)
    if array.dtype.kind == "f":
        flat[rng.randrange(flat.size)] = _pick(rng, _FLOATS)
    else:
        value = _pick(rng, _INTS + (2**20, 2**27, -(2**20), 100000))
        info = np.iinfo(array.dtype)
        flat[rng.randrange(flat.size)] = min(max(value, info.min), info.max)
    feeds[index] = array
    return f"feed {index}"


def make_case(seed_entry, seed: int, index: int) -> tuple[bytes, list, list[str]]:
    """(mutated model bytes, feeds, what was mutated) for case ``index`` of a run with ``seed``."""
    import onnx

    _, data, feeds = seed_entry
    rng = random.Random(f"{seed}:{index}")
    feeds = list(feeds)
    kind = rng.random()
    if kind < 0.12:  # flipped bytes
        raw = bytearray(data)
        for _ in range(rng.randrange(1, 9)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return bytes(raw), feeds, ["bytes flipped"]
    if kind < 0.18:
        return data[: rng.randrange(len(data))], feeds, ["truncated"]
    model = onnx.ModelProto.FromString(data)
    done = []
    for _ in range(rng.randrange(1, 4)):
        done.append(_pick(rng, _STRUCTURAL)(rng, model))
    if rng.random() < 0.3:
        done.append(_mutate_feeds(rng, feeds))
    return model.SerializeToString(), feeds, done


# -- the worker (a child process) -----------------------------------------------------------------------
def worker_main(memory_limit: int) -> None:
    import faulthandler
    import resource

    global _memory_limit
    _memory_limit = memory_limit
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    faulthandler.enable()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # prints from libraries go to the log, not the protocol
    import warnings

    warnings.simplefilter("ignore")
    import onnx_runtime

    print("ready", file=answers, flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(f"== case {request['case']}", file=sys.stderr, flush=True)
        answer = run_case(onnx_runtime, request["model"], request["feeds"])
        print(json.dumps(answer), file=answers, flush=True)


def _frame(tb) -> str:
    """The innermost frame of ``tb`` inside this project (else the innermost), as path:line:function."""
    import traceback

    frames = traceback.extract_tb(tb)
    ours = [f for f in frames if "/core/onnx_runtime/" in f.filename or "/providers/" in f.filename]
    frame = (ours or frames or [None])[-1]
    if frame is None:
        return "?"
    path = frame.filename
    for marker in ("/core/", "/providers/"):
        if marker in path:
            path = path[path.index(marker) + 1:]
            break
    else:
        path = os.path.basename(path)
    return f"{path}:{frame.lineno}:{frame.name}"


def classify(exc: BaseException, typed_base: type) -> tuple[str, str]:
    """(outcome, signature) of an exception raised while creating or running a session."""
    chain, cause = [], exc
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or (cause.__context__ if not cause.__suppress_context__ else None)
    if any(isinstance(e, MemoryError) for e in chain):
        return "runaway", f"MemoryError@{_frame(exc.__traceback__)}"
    if isinstance(exc, typed_base) and type(exc).__name__ == "RunCancelledError":
        return "cancelled", "RunCancelledError"
    if isinstance(exc, typed_base):
        inner = next((e for e in chain[1:] if type(e).__name__ in INTERNAL), None)
        if inner is not None:
            return "disguised", f"{type(inner).__name__}@{_frame(inner.__traceback__)}"
        return "typed", type(exc).__name__
    return "untyped", f"{type(exc).__name__}@{_frame(exc.__traceback__)}"


def run_case(ort, model_path: str, feeds_path: str | None, on_error=None) -> dict:
    stage = "create"
    try:
        options = ort.SessionOptions()
        # A quarter of the address space for one value: a larger one must be refused, typed, by the budget.
        options.add_session_config_entry("session.max_value_bytes", str(_memory_limit // 4))
        session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
        stage = "run"
        feeds = _feeds_for(session, feeds_path)
        if feeds is not None:
            run_options = ort.RunOptions()
            with _Watchdog(run_options, TIME_LIMIT * CANCEL_AFTER):
                session.run(None, feeds, run_options)
    except BaseException as exc:  # noqa: BLE001 (the point is to classify everything)
        if isinstance(exc, KeyboardInterrupt):
            raise
        if on_error is not None:
            on_error()
        outcome, signature = classify(exc, ort.errors.OnnxRuntimeError)
        return {"outcome": outcome, "stage": stage, "signature": signature,
                "message": f"{type(exc).__name__}: {exc}"[:600]}
    return {"outcome": "ok", "stage": stage, "signature": "ok", "message": ""}


class _Watchdog:
    """Sets ``run_options.terminate`` once this process has used ``seconds`` of CPU time inside the block."""

    def __init__(self, run_options, seconds: float):
        self.run_options, self.seconds = run_options, seconds
        self.done = threading.Event()

    def _watch(self) -> None:
        start = time.process_time()
        while not self.done.wait(0.1):
            if time.process_time() - start > self.seconds:
                self.run_options.terminate = True
                return

    def __enter__(self):
        self.thread = threading.Thread(target=self._watch, name="fuzz-watchdog", daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


_NUMPY_OF = {"float": "float32", "double": "float64", "float16": "float16", "int64": "int64", "int32": "int32",
             "int8": "int8", "uint8": "uint8", "int16": "int16", "uint16": "uint16", "uint32": "uint32",
             "uint64": "uint64", "bool": "bool", "string": "object"}


def _feeds_for(session, feeds_path: str | None) -> dict | None:
    """The case's feeds by input name, kept where they still fit the declared input, else synthesized
    (small values of the declared type, symbolic dims 2); None when an input cannot be synthesized."""
    import numpy as np

    given = []
    if feeds_path:
        with open(feeds_path, "rb") as handle:
            given = pickle.load(handle)
    feeds = {}
    for i, arg in enumerate(session.get_inputs()):
        value = given[i] if i < len(given) else None
        if isinstance(value, np.ndarray) and arg.type == _type_name(value):
            feeds[arg.name] = value
            continue
        if value is not None and not isinstance(value, np.ndarray) and not arg.type.startswith("tensor("):
            feeds[arg.name] = value
            continue
        dtype = _NUMPY_OF.get(arg.type[len("tensor("):-1]) if arg.type.startswith("tensor(") else None
        shape = [d if isinstance(d, int) and d >= 0 else 2 for d in arg.shape]
        if dtype is None or int(np.prod(shape, dtype=np.float64)) > FEED_LIMIT:
            return None
        rng = np.random.default_rng(i)
        feeds[arg.name] = (rng.integers(0, 3, size=shape).astype(dtype) if dtype != "object"
                           else np.full(shape, "a", dtype=object))
    return feeds


def _type_name(array) -> str:
    for onnx_name, numpy_name in _NUMPY_OF.items():
        if array.dtype == numpy_name or (numpy_name == "object" and array.dtype.kind in "OU"):
            return f"tensor({onnx_name})"
    return f"tensor({array.dtype})"


# -- the parent -----------------------------------------------------------------------------------------
class Worker:
    """One child process answering cases; replaced after it dies or overruns."""

    def __init__(self, folder: str, memory_limit: int, name: str):
        self.folder, self.memory_limit, self.name = folder, memory_limit, name
        self.log_path = os.path.join(folder, f"{name}.log")
        self.proc = None
        self._buffer = b""

    def _start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker",
                                      "--memory-limit", str(self.memory_limit)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        log.close()
        self._buffer = b""
        if self._read_line(120.0) != "ready":
            self.stop()
            raise RuntimeError(f"fuzz worker did not start; see {self.log_path}")

    def _cpu_seconds(self) -> float:
        """The CPU time of the worker's main thread, which runs the cases: the CPU provider's background thread
        that loads (on a cold cache, compiles) its kernels is not a case's work."""
        try:
            with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return 0.0

    def _read_line(self, timeout: float) -> str | None:
        """The worker's next answer; None when it died or overran: ``timeout`` seconds of its main thread's CPU
        time (a loaded host stretches the wall clock), or 8 times that of wall time (a wait that uses no CPU, or
        work on other threads)."""
        started, cpu_start = time.monotonic(), self._cpu_seconds()
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if time.monotonic() - started > 8 * timeout or self._cpu_seconds() - cpu_start > timeout:
                return None
            if not select.select([fd], [], [], 0.5)[0]:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def run(self, case: int, model_path: str, feeds_path: str | None, time_limit: float) -> dict:
        return self._run(case, model_path, feeds_path, time_limit)

    def _run(self, case: int, model_path: str, feeds_path: str | None, time_limit: float) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        log_start = os.path.getsize(self.log_path)
        self.proc.stdin.write((json.dumps({"case": case, "model": model_path, "feeds": feeds_path}) + "\n").encode())
        self.proc.stdin.flush()
        line = self._read_line(time_limit)
        if line is not None:
            return json.loads(line)
        try:  # a worker that crashed closes its output before it has exited: not a hang
            self.proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            pass
        timed_out = self.proc.poll() is None
        self.stop()
        with open(self.log_path, "rb") as handle:
            handle.seek(log_start)
            tail = handle.read().decode(errors="replace")
        if timed_out:
            return {"outcome": "hang", "stage": "?", "signature": "hang", "message": tail[-600:]}
        code = self.proc.returncode
        memory = any(word in tail for word in ("bad_alloc", "MemoryError", "Cannot allocate memory",
                                                "out of memory"))
        tail = tail[tail.find("Fatal Python error"):] if "Fatal Python error" in tail else tail[-1500:]
        outcome = "runaway" if memory else "crash"
        return {"outcome": outcome, "stage": "?", "signature": f"{outcome}:{code}@{_crash_frame(tail)}",
                "message": tail[:3000]}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()


def _crash_frame(log: str) -> str:
    """The innermost frame of faulthandler's dump in ``log`` (its first 'File ...' line)."""
    for line in log.splitlines():
        line = line.strip()
        if line.startswith("File ") and "line" in line:
            return line.split("/")[-1].replace('", line ', ":")[:120]
    return "?"


class _Run:
    """One fuzzing run: the cases, their answers, the distinct failures."""

    def __init__(self, seed: int, out: str | None, time_limit: float, light_share: float, log):
        self.seed, self.out, self.time_limit, self.light_share, self.log = seed, out, time_limit, light_share, log
        self.nodes, self.lights = node_seeds(), light_seeds()
        self.rng = random.Random(seed)
        self.counts: collections.Counter = collections.Counter()
        self.distinct: dict[str, dict] = {}
        self.lock = threading.Lock()
        self.work: queue.Queue = queue.Queue()
        self.deadline: float | None = None

    def enqueue(self, start: int, count: int) -> None:
        """Cases ``start``.. get their seed entries from the run's generator, in index order."""
        for index in range(start, start + count):
            pick_light = self.rng.random() < self.light_share
            pool = self.lights if pick_light else self.nodes
            self.work.put((index, pool[self.rng.randrange(len(pool))]))

    def serve(self, worker: Worker, folder: str) -> None:
        while self.deadline is None or time.monotonic() < self.deadline:
            try:
                index, entry = self.work.get_nowait()
            except queue.Empty:
                return
            data, feeds, mutations = make_case(entry, self.seed, index)
            model_path = os.path.join(folder, f"{worker.name}.onnx")
            feeds_path = os.path.join(folder, f"{worker.name}.pkl")
            with open(model_path, "wb") as handle:
                handle.write(data)
            with open(feeds_path, "wb") as handle:
                pickle.dump(feeds, handle)
            answer = worker.run(index, model_path, feeds_path, self.time_limit)
            answer.update(case=index, seed_model=entry[0], mutations=mutations)
            if answer["outcome"] == "hang":  # no traceback to tell hangs apart: keep one per seed model
                answer["signature"] = f"hang@{entry[0]}"
            self.record(answer, data, feeds)

    def record(self, answer: dict, data: bytes, feeds: list) -> None:
        with self.lock:
            self.counts[answer["outcome"]] += 1
            if answer["outcome"] not in FAILURES or answer["signature"] in self.distinct:
                return
            self.distinct[answer["signature"]] = answer
            if self.out:
                _save(self.out, answer, data, feeds)
            if self.log:
                self.log(f"[{answer['case']}] {answer['outcome']} {answer['signature']} ({answer['seed_model']}: "
                         f"{'; '.join(answer['mutations'])}): {answer['message'][:300]}")


def fuzz(seed: int = 1, cases: int = 300, workers: int = 2, minutes: float | None = None,
         out: str | None = None, memory_limit: int = MEMORY_LIMIT, time_limit: float = TIME_LIMIT,
         light_share: float = 0.05, log=None) -> dict:
    """Run ``cases`` mutated cases (or as many as ``minutes`` allow); return the counts per outcome and the
    distinct failures (signature -> its first case). Reproducers go under ``out`` when given."""
    total = cases if minutes is None else 10**9
    run = _Run(seed, out, time_limit, light_share, log)
    started = time.monotonic()
    run.deadline = None if minutes is None else started + minutes * 60
    index = 0
    with tempfile.TemporaryDirectory(prefix="onnx-runtime-fuzz-") as folder:
        pool = [Worker(folder, memory_limit, f"w{i}") for i in range(workers)]
        try:
            while index < total and (run.deadline is None or time.monotonic() < run.deadline):
                batch = min(total - index, 500)
                run.enqueue(index, batch)
                index += batch
                threads = [threading.Thread(target=run.serve, args=(w, folder), daemon=True) for w in pool]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
        finally:
            for worker in pool:
                worker.stop()
    return {"seed": seed, "cases": sum(run.counts.values()), "seconds": round(time.monotonic() - started, 1),
            "counts": {k: run.counts.get(k, 0) for k in OUTCOMES}, "distinct": run.distinct}


def _save(out: str, answer: dict, data: bytes, feeds: list) -> None:
    key = hashlib.sha1(answer["signature"].encode()).hexdigest()[:12]
    folder = os.path.join(out, answer["outcome"])
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{key}.onnx"), "wb") as handle:
        handle.write(data)
    with open(os.path.join(folder, f"{key}.pkl"), "wb") as handle:
        pickle.dump(feeds, handle)
    with open(os.path.join(folder, f"{key}.json"), "w") as handle:
        json.dump(answer, handle, indent=1)


def replay(model_path: str, memory_limit: int = MEMORY_LIMIT) -> int:
    """Run one reproducer here (faulthandler on, the memory limit set) and print its answer and traceback."""
    import faulthandler
    import resource
    import traceback

    global _memory_limit
    _memory_limit = memory_limit
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    faulthandler.enable()
    import onnx_runtime

    feeds_path = model_path[: -len(".onnx")] + ".pkl"
    answer = run_case(onnx_runtime, model_path, feeds_path if os.path.exists(feeds_path) else None,
                      on_error=traceback.print_exc)
    print(json.dumps(answer, indent=1))
    return 0 if answer["outcome"] in ("ok", "cancelled", "typed") else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cases", type=int, default=300)
    parser.add_argument("--minutes", type=float, default=None, help="run for this long instead of --cases")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--memory-limit", type=int, default=MEMORY_LIMIT, help="bytes of address space per worker")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT, help="seconds per case")
    parser.add_argument("--light-share", type=float, default=0.05)
    parser.add_argument("--out", default=None, help="folder for the reproducers of distinct failures")
    parser.add_argument("--replay", default=None, help="run one saved reproducer (its .onnx) in this process")
    args = parser.parse_args(argv)
    if args.worker:
        worker_main(args.memory_limit)
        return 0
    if args.replay:
        return replay(args.replay, args.memory_limit)
    report = fuzz(args.seed, args.cases, args.workers, args.minutes, args.out, args.memory_limit, args.time_limit,
                  args.light_share, log=lambda line: print(line, flush=True))
    print(json.dumps({k: v for k, v in report.items() if k != "distinct"}))
    print(f"distinct failures: {len(report['distinct'])}")
    return 1 if any(report["counts"][k] for k in FAILURES if k != "disguised") else 0


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())
