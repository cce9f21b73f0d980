"""Planned steps and the loop that runs them, shared by the eager executor and the device-graph runner.

A step is one kernel call (a node's, or a copy at a device boundary) over integer value slots. The executor
(:mod:`.executor`) plans them; :func:`run_steps` runs them, for the executor's eager runs and for the node steps
a device-graph capture (:mod:`.device_graphs`) records, so both see the same results, releases and errors.
This module imports neither of them.
"""

from __future__ import annotations

import operator
import time
from typing import Protocol

import numpy as np
from numpy import ndarray

from ..contract.kernels import KernelFn
from ..errors import InvalidArgumentError, InvalidRunValueError, KernelError, OnnxRuntimeError, ProviderError
from ..ir import Graph, Node
from ..optimizer.constant_folding import NONDETERMINISTIC
from ..provider_handle import ProviderHandle
from ..records import Record
from ..tensor import Tensor
from . import shape_program, shape_rules
from .placement import Copy
from .step_code import StepCode


def shape_of(value):
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else None


class ShapeKeyedKernel:
    """Kernels of one node cached per input shapes, created on first sight of a shape tuple.

    A kernel whose ``shape_free`` attribute is true serves any input shapes (an elementwise function, say): it
    is then kept for every later call, so a decode loop, whose shapes change every step, does not create the
    node's kernel again per step. A kernel whose ``shape_key`` attribute is a function serves every input
    shapes that this function maps to the key it gives the kernel's own (an attention kernel that reads the
    keys' length per call): new shapes with that key reuse it. The caches are bounded: past ``LIMIT`` entries
    they start over; shapes that map to kernels of ``by_key`` (entries that hold no kernel of their own) up to
    ``SHARED_LIMIT``, so a later generation's every length finds its kernel without asking ``shape_key``.

    A kernel with a ``call_if_fits`` method (its call that checks the inputs' shapes itself and returns None,
    having done nothing, for shapes the kernel was not made for) has the last such method found called first,
    without a key (a decode step's attention, whose six shapes made the key at about its own Python cost); the
    cache decides only where it declines."""

    __slots__ = ("handle", "node", "graph", "cache", "shape_free", "shape_key", "by_key", "owned", "checking")

    LIMIT = 64
    SHARED_LIMIT = 4096

    def __init__(self, handle: ProviderHandle, node: Node, graph: Graph, first=None, first_key=None):
        self.handle = handle
        self.node = node
        self.graph = graph
        self.cache = {} if first is None else {first_key: first}
        self.shape_free = first if getattr(first, "shape_free", False) else None
        self.shape_key = None  # the shape_key function of the kernels in by_key
        self.by_key: dict = {}
        self.owned = len(self.cache)  # entries of ``cache`` whose kernel is not one of ``by_key``'s
        self.checking = None  # the call_if_fits of the last kernel found with one

    def __call__(self, *inputs):
        kernel = self.shape_free
        if kernel is not None:
            return kernel(*inputs)
        checking = self.checking
        if checking is not None:
            outputs = checking(*inputs)
            if outputs is not None:
                return outputs
        try:  # arrays (nearly always): their shapes are the key as they are
            key = tuple([x.shape for x in inputs])
            kernel = self.cache.get(key)
        except (AttributeError, TypeError):  # an omitted input (None), a sequence, a shape that is a list
            key = tuple(shape_of(x) for x in inputs)
            kernel = self.cache.get(key)
        if kernel is None:
            shape_key = self.shape_key
            kernel = self.by_key.get(shape_key(key)) if shape_key is not None else None
            if kernel is None or len(self.cache) >= self.SHARED_LIMIT:
                kernel = self._kernel_for(key)
            else:  # (a length-free kernel at a new length: every step of a first generation)
                self.cache[key] = kernel
        checking = getattr(kernel, "call_if_fits", None)
        if checking is not None:
            return self._checked(checking, key, inputs)
        return kernel(*inputs)

    def _checked(self, checking, key: tuple, inputs: tuple):
        """The outputs of ``checking`` (a kernel's call_if_fits) for ``inputs`` of shapes ``key``, which the kernel
        was chosen for; it is called first from now on."""
        outputs = checking(*inputs)
        if outputs is None:  # (its check and the cache's key disagree: a kernel's bug, not the caller's)
            node = self.node
            raise KernelError(f"{self.handle.name}: the kernel of node {node.name!r} ({node.op_type}) declined input "
                              f"shapes {list(key)} it was made for")
        self.checking = checking
        return outputs

    def _kernel_for(self, key: tuple):
        shape_key = self.shape_key
        kernel = self.by_key.get(shape_key(key)) if shape_key is not None else None
        shared = kernel is not None
        if kernel is None:
            kernel = make_kernel(self.handle, self.node, list(key), self.graph)
            if getattr(kernel, "shape_free", False):
                self.shape_free = kernel
                return kernel
            shape_key = getattr(kernel, "shape_key", None)
            if callable(shape_key):
                if shape_key is not self.shape_key or len(self.by_key) >= self.LIMIT:
                    self.by_key = {}
                    self.shape_key = shape_key
                    self.cache.clear()  # (its entries would keep the dropped kernels)
                    self.owned = 0
                self.by_key[shape_key(key)] = kernel
                shared = True
        # Shapes without bound (a growing sequence): start over.
        if len(self.cache) >= self.SHARED_LIMIT or (not shared and self.owned >= self.LIMIT):
            self.cache.clear()
            self.owned = 0
        self.cache[key] = kernel
        self.owned += not shared
        return kernel


def make_kernel(handle: ProviderHandle, node: Node, shapes, graph: Graph):
    try:
        kernel = handle.hook.get_kernel(node=node, shapes=shapes, opset=node.opset, graph=graph)
    except OnnxRuntimeError:
        raise
    except Exception as exc:  # a kernel factory's bug, or inputs it does not expect: typed, naming the node
        raise KernelError(f"{handle.name} could not build the kernel of node {node.name!r} ({node.op_type}) for "
                          f"input shapes {shapes}: {type(exc).__name__}: {exc}") from exc
    if kernel is None or not callable(kernel):
        raise ProviderError(
            f"{handle.name}: get_kernel returned {type(kernel).__name__} for node {node.name!r} ({node.op_type}); "
            f"it must return a callable kernel"
        )
    return kernel


# -- host conversions ---------------------------------------------------------------------------------
def to_host(value):
    if isinstance(value, Tensor):
        return value.numpy().copy() if value.provider.is_host_accessible else value.numpy()
    if isinstance(value, list):  # a sequence
        return [to_host(v) for v in value]
    if isinstance(value, np.generic):
        return np.asarray(value)
    return value


class Uploader:
    """A copy step to ``handle``'s device; the handle says where (device-graph capture hoists feed uploads)."""

    __slots__ = ("handle",)

    def __init__(self, handle: ProviderHandle):
        self.handle = handle

    def __call__(self, value) -> tuple[Tensor]:
        if isinstance(value, Tensor):
            value = to_host(value)
        return (Tensor.from_numpy(np.asarray(value), provider=self.handle),)


def downloader(value):
    return (to_host(value),)


def on_device(value):
    """An output kept where it was produced: device tensors stay, host values become arrays."""
    if isinstance(value, Tensor) and not value.provider.is_host_accessible:
        return value
    return to_host(value)


# -- steps and plans ----------------------------------------------------------------------------------
class Step(Record):
    __slots__ = __match_args__ = ("run", "inputs", "outputs", "release", "node", "provider")
    run: KernelFn  # the node's kernel, or a copy (an Uploader, or downloader)
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    release: tuple[int, ...]
    node: Node | None
    provider: str

    def __init__(self, run: KernelFn, inputs: tuple[int, ...], outputs: tuple[int, ...], release: tuple[int, ...],
                 node: Node | None, provider: str) -> None:
        self.run = run
        self.inputs = inputs
        self.outputs = outputs
        self.release = release
        self.node = node
        self.provider = provider


class ShapeValuesRun(Protocol):
    """What a plan's run asks of its shape values: a :class:`ShapeValues`, or canonical_feeds.CanonicalFeeds
    (which picks one of two per call)."""

    def run(self, env: list, profile: dict | None) -> None: ...


class Steps:
    """Steps in run order, with the hot loop's view of them. ``shape_values``: where the leading steps compute
    only what the feeds' shapes determine, the cache that skips them (see :class:`ShapeValues`). From the
    second run on, the steps run as one straight-line function (``code``, :mod:`.step_code`); the first run
    takes the loop, so a plan run once (a creation's warm-up, a capture) builds nothing."""

    shape_values: ShapeValuesRun | None = None
    code: StepCode | None = None
    runs = 0  # loop runs so far (until ``code`` is built)

    def __init__(self, steps: list[Step]):
        self.steps = steps
        # A C-level getter for the inputs (a one-slot slice for a single input, so it still yields a sequence)
        # and plain tuples instead of attribute lookups.
        self.fast = [
            (
                step.run,
                operator.itemgetter(*step.inputs) if len(step.inputs) > 1
                else operator.itemgetter(slice(step.inputs[0], step.inputs[0] + 1)) if step.inputs
                else operator.itemgetter(slice(0, 0)),
                step.outputs[0] if len(step.outputs) == 1 else None,
                step.outputs,
                step.release,
            )
            for step in steps
        ]


# Operators whose output shapes follow from their inputs' shapes and their attributes alone, never from values
# (elementwise arithmetic, products, layout with attribute shapes, normalizations, attention): a Shape of what
# they compute from the feeds is known once the feeds' shapes are. Reshape, Expand, Slice, Range and the like
# read sizes from values: not listed. A provider's own fused operators declare theirs in shape_rules.
_SHAPE_FROM_SHAPES = frozenset({
    "Identity", "Cast", "Neg", "Abs", "Sqrt", "Reciprocal", "Exp", "Log", "Erf", "Tanh", "Sigmoid", "Relu", "Gelu",
    "Softmax", "Not", "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Where", "And", "Or", "Equal", "Less",
    "Greater", "LessOrEqual", "GreaterOrEqual", "MatMul", "FusedMatMul", "Gemm", "Concat", "Transpose", "Gather",
    "Sin", "Cos", "Floor", "Ceil", "Round", "Sign", "Mod", "Swish", "HardSigmoid", "HardSwish", "LeakyRelu",
    "LayerNormalization", "RMSNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
    "Attention", "MatMulNBits", "DynamicQuantizeMatMul",  # com.microsoft products of a weight (4-bit, int8)
    "MatMulIntegerToFloat", "MatMulInteger", "DynamicQuantizeLinear", "QLinearMatMul",  # a product's rows and
    "DequantizeLinear", "QuantizeLinear",  # a weight's columns, or one scale and zero point
})


def _shape_from_shapes(node: Node) -> bool:
    return node.op_type in _SHAPE_FROM_SHAPES if node.domain in ("", "ai.onnx", "com.microsoft") \
        else shape_rules.from_shapes(node.domain, node.op_type)


def shape_only_steps(steps: list[Step], tensor_feeds: set[int], constants: set[int], outputs: set[int],
                     assumed: frozenset[int] = frozenset()) -> set[int]:
    """Indices of the ``steps`` whose outputs depend only on the shapes of the feeds (``tensor_feeds``' slots)
    and on ``constants``: ``Shape``/``Size`` of a value whose shape the feeds' shapes fix, and what is computed
    from those and constants alone (the positions, masks and relative-position buckets of a decode step whose
    lengths a symbolic specialization kept unknown). Steps that produce graph ``outputs`` are left out (a
    caller gets fresh arrays), as are random operators and control flow. ``assumed``: feeds whose values count as
    their shapes' (a caller that checks them: :mod:`.canonical_feeds`)."""
    derived: set[int] = set(assumed)  # values the feeds' shapes determine
    shaped = set(tensor_feeds) | constants  # values whose shapes the feeds' shapes determine
    found: set[int] = set()
    for index, step in enumerate(steps):
        node = step.node
        read = [slot for slot in step.inputs if slot]
        if node is None or not read or node.subgraphs():
            continue
        if node.op_type in ("Shape", "Size") and node.domain in ("", "ai.onnx"):
            shape_only = read[0] in shaped
        elif node.op_type in NONDETERMINISTIC:  # fresh values each run: never kept
            shape_only = False
        else:
            shape_only = all(slot in derived or slot in constants for slot in read) \
                and any(slot in derived for slot in read)
        if shape_only and not outputs.intersection(step.outputs):
            found.add(index)
            derived.update(step.outputs)
            shaped.update(step.outputs)
        elif _shape_from_shapes(node) and all(slot in shaped for slot in read) \
                or _shape_from_sizes(node, step.inputs, shaped, derived | constants):
            shaped.update(step.outputs)
    return found


# Layout operators whose output shape is input 0's shape and the values of the inputs listed (their sizes or
# axes): known once those values are, as shape-only or constant ones are (a Reshape of a product by a size
# computed from a Shape, where a QDQ graph's quantization pairs kept the fusions from making it a
# ReshapeTranspose).
_SHAPE_FROM_SIZES = {
    "Reshape": (1,), "Expand": (1,), "Unsqueeze": (1,), "Squeeze": (1,), "Tile": (1,), "Split": (1,),
    "Slice": (1, 2, 3, 4), "Flatten": (), "ReduceMean": (1,), "ReduceSum": (1,), "ReduceMax": (1,),
    "ReduceMin": (1,), "ReduceProd": (1,), "ReduceL2": (1,), "ReduceSumSquare": (1,),
}


def _shape_from_sizes(node: Node, inputs: tuple[int, ...], shaped: set[int], sized: set[int]) -> bool:
    sizes = _SHAPE_FROM_SIZES.get(node.op_type)
    if sizes is None or node.domain not in ("", "ai.onnx") or not inputs or inputs[0] not in shaped:
        return False
    return all(i >= len(inputs) or not node.inputs[i] or inputs[i] in sized for i in sizes)


class ShapeValues:
    """The values of a plan's shape-only steps, kept per shapes of the feeds: a run whose feeds have shapes
    seen before sets those values and runs the other steps only (``body``); a new one runs every step
    (``full``, which keeps those values to the end of the run). Where a specialization keeps a decode step's
    lengths symbolic, tens of small Shape, Range, Unsqueeze and comparison nodes would otherwise run on every
    call. Kept values are frozen (read-only, as initializers are: kernels take a frozen array's identity for
    its contents); the cache is bounded in entries, in bytes per entry and in bytes in all, and starts over past
    its bound. It holds every past length of a generation up to about a thousand tokens (an entry is a few
    small arrays as long as the sequence), so the next generation through those lengths skips the steps.

    The first generation meets new shapes every step: from the second new shapes on, the steps are evaluated
    once symbolically for the class of shapes the two make (:mod:`.shape_program`), and each later new shape of
    that class instantiates the values and runs only the steps the evaluation left (``residual``)."""

    __slots__ = ("full", "body", "keys", "kept", "values", "held", "shape_only", "static_shapes", "programs",
                 "previous", "assumed")

    LIMIT = 1024
    BYTES = 1 << 20
    TOTAL_BYTES = 8 << 20
    PROGRAMS = 4  # classes of feed shapes with a symbolic program (or a failed attempt) kept

    def __init__(self, full: list[Step] | Steps, body: list[Step], keys: tuple[int, ...], kept: tuple[int, ...],
                 static_shapes: dict[int, tuple] | None = None):
        self.full = full if isinstance(full, Steps) else Steps(full)  # (another ShapeValues' may be shared)
        full = self.full.steps
        self.body = Steps(body)
        self.keys = keys
        self.kept = kept
        self.values: dict[tuple, tuple] = {}
        self.held = 0  # bytes of the kept values
        in_body = {id(step.node) for step in body}
        self.shape_only = {index for index, step in enumerate(full) if id(step.node) not in in_body}
        self.static_shapes = static_shapes or {}  # slot -> the plan's declared static shape
        self.programs: list[tuple] = []  # (Template, Program | None, residual Steps | None)
        self.previous: tuple | None = None  # the last new feed shapes
        self.assumed: dict = {}  # feed slot -> the value its shapes make it (shape_program.build's ``assumed``)

    def run(self, env: list, profile: dict | None) -> None:
        try:
            key = tuple([env[slot].shape for slot in self.keys])
        except AttributeError:  # a feed without a shape: the kernels will say what is wrong with it
            key = None
        values = self.values.get(key) if key is not None else None
        if values is not None:
            for slot, value in zip(self.kept, values):
                env[slot] = value
            _run(self.body, env, profile)
            return
        built = None
        if key is not None:
            found = self._program(key, env)
            if found is not None and found[1]:
                values = tuple([env[slot] for slot in self.kept])  # (the body releases them at their last reader)
                _run(self.body, env, profile)
                self.previous = key
                self._keep(key, values)
                return
            built = found[0] if found is not None else None
        before = list(env) if built is not None else None  # (what the full run releases, the check reads)
        _run(self.full, env, profile)
        values = tuple(env[slot] for slot in self.kept)
        if built is not None and before is not None and key is not None:
            self._verify(built, key, before, values)
        for slot in self.kept:  # released here rather than at their last reader
            env[slot] = None
        if key is not None:
            self.previous = key
            self._keep(key, values)

    def _keep(self, key: tuple, values: tuple) -> None:
        # (a first generation keeps at every step: one loop, no generators)
        size = 0
        for value in values:
            if not isinstance(value, ndarray):
                return
            size += value.nbytes
        if size <= self.BYTES:
            for value in values:
                value.setflags(write=False)  # (the method: a flags object made per value costs more)
            if len(self.values) >= self.LIMIT or self.held + size > self.TOTAL_BYTES:
                self.values.clear()
                self.held = 0
            self.values[key] = values
            self.held += size

    def _program(self, key: tuple, env: list) -> tuple | None:
        """For new feed shapes ``key``: (the class's entry, True) once its program set the shape-only values in
        ``env`` (and ran the steps it leaves); (a program built just now, False): the steps run this time and
        the program is checked against them; None: the steps run."""
        for entry in list(self.programs):  # (a copy: runs of one plan may overlap)
            template, program, residual = entry
            point = template.coordinates(key)
            if point is None:
                continue
            if program is None:
                return None
            if program.instantiate(env, point):
                if residual.steps:
                    _run(residual, env, None)
                return entry, True
            try:  # past the bases' margin: built again around here
                self.programs.remove(entry)
            except ValueError:  # another run of this plan removed it meanwhile
                pass
            return self._build(template, key, env)
        if self.previous is None or not self.PROGRAMS:
            return None
        template = shape_program.Template.between(self.previous, key)
        if template is None or not template.symbols:
            return None
        return self._build(template, key, env)

    def _build(self, template, key: tuple, env: list) -> tuple | None:
        point = template.point(key)
        read_later = {slot for step in self.body.steps for slot in step.inputs}
        try:
            built = shape_program.build(self.full.steps, self.shape_only, self.keys, template, point, env,
                                        self.static_shapes, read_later, self.assumed)
        except Exception:  # noqa: BLE001 (an optimization: the steps still run)
            built = None
        while len(self.programs) >= self.PROGRAMS:
            self.programs.pop(0)
        if built is None:
            self.programs.append((template, None, None))
            return None
        program, residual = built
        steps = [self.full.steps[index].replace(release=()) for index in residual]
        entry = (template, program, Steps(steps))
        self.programs.append(entry)
        return entry, False

    def _verify(self, entry: tuple, key: tuple, scratch: list, values: tuple) -> None:
        """Compare a new program with the steps it replaces, at the shapes it was built for (``scratch``: the
        run's slots before the steps ran; ``values``: what the steps computed); one that differs (a declared
        shape that was stale, say) is dropped for its class."""
        template, program, residual = entry
        try:
            same = program.instantiate(scratch, template.point(key))
            if same and residual.steps:
                _run(residual, scratch, None)
            same = same and all(
                type(a) is type(b) and getattr(a, "dtype", None) == getattr(b, "dtype", None)
                and np.array_equal(a, b) for a, b in zip((scratch[slot] for slot in self.kept), values))
        except Exception:  # noqa: BLE001
            same = False
        if not same:
            try:
                self.programs[self.programs.index(entry)] = (template, None, None)
            except ValueError:  # another run of this plan dropped it meanwhile
                pass


class Plan(Steps):
    """The steps of one run over a template of slots: feeds go in by name, outputs come out of their slots."""

    def __init__(self, steps: list[Step], template: list, feed_slots: dict[str, int], output_slots: list[int],
                 copies: list[Copy], device_feeds: frozenset[str] = frozenset()):
        super().__init__(steps)
        self.copies = copies
        self.device_feeds = device_feeds  # feeds that arrive as Tensors on the device that reads them
        self.template = template
        self.feed_slots = feed_slots
        self.output_slots = output_slots


# -- running ------------------------------------------------------------------------------------------
def run_steps(steps: Steps, env: list, profile: dict | None = None) -> None:
    """Run ``steps`` in order over ``env`` (the values by slot): gather inputs, call the kernel, store outputs,
    drop dead values. A failure is re-raised as its step's :func:`node_error`. With ``profile`` (a dict), add
    each operator's (seconds, calls) to it. Shape-only steps whose values are kept for these feeds' shapes
    (``steps.shape_values``) are skipped."""
    if steps.shape_values is not None:
        steps.shape_values.run(env, profile)
    else:
        _run(steps, env, profile)


# Loop runs of a step list before it is built into straight-line code; longer lists keep the loop (a function of
# that many lines costs more to compile than the loop loses in a few runs).
STRAIGHT_AFTER = 1
STRAIGHT_MAX_STEPS = 20000


def _straight(steps: Steps) -> StepCode | None:
    code = steps.code
    if code is None:
        steps.runs += 1
        if steps.runs == STRAIGHT_AFTER + 1 and len(steps.steps) <= STRAIGHT_MAX_STEPS:
            try:
                code = steps.code = StepCode(steps.steps)
            except (RecursionError, MemoryError, SyntaxError):  # (the compiler's limits): the loop serves
                code = None
    return code


def _run(steps: Steps, env: list, profile: dict | None) -> None:
    code = None
    try:
        if profile is not None:
            _run_profiled(steps, env, profile)
        elif (code := _straight(steps)) is not None:
            code.run(env)
        else:
            run_loop(steps, env)
    except StepFailure as wrapped:
        exc, index = wrapped.args
        raise node_error(steps.steps[index], exc, type(exc) if isinstance(exc, OnnxRuntimeError) else KernelError) \
            from exc
    except Exception as exc:
        if code is None:  # (the loops wrap theirs in StepFailure)
            raise
        index, own = code.step_at(exc)
        if index is None:  # not a step's line (the code's own stores): nothing a node did
            raise
        reported: Exception = exc
        kind = type(exc) if isinstance(exc, OnnxRuntimeError) else KernelError
        if own and isinstance(exc, ValueError):  # the line's unpacking of a result shorter than the node's outputs
            count = len(steps.steps[index].outputs)
            reported = KernelError(f"kernel returned fewer outputs than the node has ({count})")
        raise node_error(steps.steps[index], reported, kind) from exc


def run_loop(steps: Steps, env: list) -> None:
    """Run ``steps`` over ``env``; a failing step leaves as a ``StepFailure`` carrying its index."""
    index = 0
    try:
        for index, (run, fetch, single, outs, release) in enumerate(steps.fast):  # noqa: B007 (read on error)
            results = run(*fetch(env))
            if single is not None:
                env[single] = results[0]
            else:
                if len(results) < len(outs):
                    raise KernelError(f"kernel returned {len(results)} outputs, the node has {len(outs)}")
                for slot, value in zip(outs, results):
                    env[slot] = value
            for slot in release:
                env[slot] = None
    except Exception as exc:
        raise StepFailure(exc, index) from exc


def _run_profiled(steps: Steps, env: list, profile: dict) -> None:
    """The run loop with a clock around every step; totals go to ``profile`` per operator."""
    clock = time.perf_counter
    record = getattr(profile, "record_node", None)  # a session Profile also keeps each node's trace event
    for index, (step, (run, fetch, _single, outs, release)) in enumerate(zip(steps.steps, steps.fast)):
        args = fetch(env)
        start = clock()
        try:
            results = run(*args)
        except Exception as exc:
            raise StepFailure(exc, index) from exc
        elapsed = clock() - start
        key = step.node.op_type if step.node is not None else "copy"
        total, calls = profile.get(key, (0.0, 0))
        profile[key] = (total + elapsed, calls + 1)
        if record is not None:
            record(step, start, elapsed, args, results)
        for slot, value in zip(outs, results):
            env[slot] = value
        for slot in release:
            env[slot] = None


class StepFailure(Exception):
    """Carries a step failure and its index out of a loop."""


def node_error(step: Step | None, exc: Exception, kind: type) -> Exception:
    """The error that reports ``exc``, raised by ``step``, as a ``kind`` naming the step's node and provider. It
    carries the step as ``step`` (the device-graph runner names the node a capture failed at)."""
    if step is None:
        return kind(str(exc))
    if step.node is None:
        error = kind(f"{step.provider} failed: {type(exc).__name__}: {exc}")
    else:
        node = step.node
        message = f"node {node.name!r} ({node.op_type}) on {step.provider} failed: {type(exc).__name__}: {exc}"
        if kind is InvalidArgumentError:  # a node's bad value at run time: onnxruntime's Fail too
            kind = InvalidRunValueError
        try:
            error = kind(message)
        except TypeError:
            error = KernelError(message)
    error.step = step
    return error
