"""A FusedSegment's bound plan (ops/segment.py): its values in buffers allocated once per input signature,
and each node as prepared calls over them.

A node's calls come from its binder (BINDERS, by operator): ``binder(node, kernel, inputs, outputs, constant)``
gets the node's kernel for these shapes, its input and output buffers and which inputs are constants (the
segment's read-only inputs: weights), and returns ``[(function, arguments), ...]`` that write the outputs, or
None where it cannot prepare this node (then its kernel runs, and its results are copied into the buffers).
Convolution, pooling, mean and batch-normalization kernels bind themselves (their ``bind``: ops/conv.py, pool.py,
reduction.py, normalization.py): the compiled loop with the packed weights, offsets and epilogue it would be
called with. Reshapes and Flatten are views of their input's buffer, and the convolutions that write their
channels of a Concat (into_concat, conv_fusions.fuse_concat_convs) share the concatenation's buffer, each binding
its own channels of it.
"""

from __future__ import annotations

import functools
import operator
import threading

import numpy as np

from ..fused_domain import CONV_INTO, concat_part
from .activations import hard_swish_steps
from .segment_arena import Lifetimes
from .segment_blocks import squeeze_excitations
from .segment_chain import chained, read_in_place
from .segment_elementwise import split_elementwise
from .segment_layout import block_direct_runs

_VIEWS = frozenset({"Flatten", "Reshape", "Squeeze", "Unsqueeze", "Identity"})
# A plan whose unprepared nodes' outputs (copied into their buffers on every run) pass this many bytes is not
# made: the copies cost more than the Python a plan saves (ShuffleNet's grouped convolutions at 224x224).
COPY_LIMIT_BYTES = 256 << 10


class BoundPlan:
    """``run(inputs) -> outputs`` for one input signature: feeds copied into their buffers, the steps called,
    the outputs copied out. ``fits(inputs)``: the constants are the arrays it was bound to. ``ticket``: None, or
    the provisional.Ticket of a plan built while a loop it calls was served by a fallback."""

    __slots__ = ("lock", "nbytes", "arena", "ticket", "constant_slots", "_feeds", "_constant_slots", "_constants",
                 "_steps", "_results", "_calls", "_copied", "_read_in_place")

    def __init__(self, feeds, constants: dict[int, np.ndarray], steps, results, nbytes: int = 0, calls=None):
        self.lock = threading.Lock()
        self.ticket = None
        self.nbytes = nbytes  # the buffers it holds (feeds' and values')
        self.arena = None  # segment_arena.Arena: where its values live
        self._feeds = tuple(feeds)  # (slot, buffer)
        slots = self.constant_slots = tuple(constants)
        self._constant_slots = operator.itemgetter(*slots) if len(slots) > 1 else (
            (lambda inputs, s=slots[0]: (inputs[s],)) if slots else (lambda inputs: ()))
        self._constants = tuple(constants[s] for s in slots)
        self._results = tuple(results)
        # what a run calls: the steps, or the steps with runs of them chained (segment_chain.chained); the steps
        # keep the arrays a chain's table addresses. Chained steps are not linked one by one: run_chain's own
        # library holds their loops, and linking (or compiling) each loop's entry point too was a new process's
        # largest cost in its first plan.
        if calls is None:
            self._steps = self._calls = tuple([(_direct(function, arguments), arguments)
                                               for function, arguments in steps])
        else:
            self._steps = tuple(steps)
            self._calls = tuple([(_direct(function, arguments), arguments) for function, arguments in calls])
        # feeds a chained first convolution reads from the caller's array (segment_chain.read_in_place)
        self._read_in_place = tuple((slot, buffer, table, row, buffer.__array_interface__["data"][0])
                                    for slot, buffer, table, row in read_in_place(self._feeds, self._steps,
                                                                                  self._calls, self._results))
        direct = {entry[0] for entry in self._read_in_place}
        self._copied = tuple((slot, buffer) for slot, buffer in self._feeds if slot not in direct)

    @property
    def constants(self) -> tuple:
        """The read-only inputs it was bound to, in ``constant_slots`` order."""
        return self._constants

    def constant_values(self, inputs) -> tuple:
        """``inputs``' values at ``constant_slots``."""
        return self._constant_slots(inputs)

    def fits(self, inputs) -> bool:
        return all(map(operator.is_, self._constant_slots(inputs), self._constants))

    def matches(self, inputs) -> bool:
        """Whether ``inputs`` have this plan's signature: its constants, and feeds of its buffers' shapes and
        dtypes (a check of the few feeds instead of a key over every input)."""
        for slot, buffer in self._feeds:
            value = inputs[slot]
            if not isinstance(value, np.ndarray) or value.shape != buffer.shape or value.dtype != buffer.dtype:
                return False
        return self.fits(inputs)

    def describe(self) -> dict:
        """What the plan binds: its steps, those that run a node's kernel (not prepared), and whether it is
        provisional (made again once the loops that were served by fallbacks are linked)."""
        return {"steps": len(self._steps), "kernels": sum(f is _run_kernel for f, _ in self._steps),
                "calls": len(self._calls), "provisional": self.ticket is not None}

    def run(self, inputs):
        self.stage(inputs)
        for function, arguments in self._calls:
            function(*arguments)
        return tuple([result.copy() for result in self._results])

    def stage(self, inputs) -> None:
        """The feeds of ``inputs`` into the plan's buffers, or its chained first convolution pointed at them."""
        copy = np.copyto
        for slot, buffer in self._copied:
            copy(buffer, inputs[slot])
        for slot, buffer, table, row, own in self._read_in_place:  # (its shape and dtype: the plan's signature)
            value = inputs[slot]
            if value.flags.c_contiguous and value.flags.aligned:
                table[row, 1] = value.__array_interface__["data"][0]
            else:
                table[row, 1] = own
                copy(buffer, value)

    @property
    def feeds(self) -> tuple:
        """(slot, buffer) of the inputs each run copies in (not constants)."""
        return self._feeds

    @property
    def feed_slots(self) -> tuple:
        """The slots of the inputs each run copies in (not constants)."""
        return tuple(slot for slot, _ in self._feeds)

    @property
    def results(self) -> tuple:
        """The buffers a run leaves the outputs in (run returns copies)."""
        return self._results

    @property
    def calls(self) -> tuple:
        """(function, arguments) of what a run calls, in order, after staging its feeds (stage)."""
        return self._calls


def _direct(function, arguments):
    """A compiled loop's overload for these arguments' types, called without numba's dispatcher: the plan's
    arguments never change, and the dispatcher's typing of each argument on every call costs about as much as a
    small loop (a wrong type is still refused: the overload's wrapper unboxes each argument). A loop not yet
    compiled for these types is linked from numba's disk cache, or compiled now where no background loader
    guards; where one does, the loop itself (its dispatcher serves the call) in a provisional plan, made again once
    the loader's child has compiled it (deferred.overload). Anything else is called as it is."""
    from ..compiled.deferred import Loop, overload

    if not isinstance(function, Loop):
        return function
    dispatcher = function.dispatcher()
    try:
        types = tuple(_argument_type(dispatcher, a) for a in arguments)
    except (TypeError, ValueError):
        return function
    found = overload(function, types)
    return function if found is None else found


def _argument_type(dispatcher, value):
    """numba's type of an argument, as its dispatcher's typeof gives it. A plain ndarray's is built here from its
    dtype, rank, layout and writeability, as numba's typeof builds it, without the masked-array check that
    typeof makes first: that check imports numpy.ma, which nothing else a worker's plans run needs (where numba
    loads in the background, its loader imports numpy.ma for the kernels that call their loops' dispatchers)."""
    if type(value) is np.ndarray:
        from numba.core import types
        from numba.core.errors import NumbaNotImplementedError
        from numba.np import numpy_support

        try:
            dtype = numpy_support.from_dtype(value.dtype)
        except NumbaNotImplementedError:  # (numba's typeof names the dtype it does not take)
            return dispatcher.typeof_pyval(value)
        return types.Array(dtype, value.ndim, numpy_support.map_layout(value), readonly=not value.flags.writeable)
    return dispatcher.typeof_pyval(value)


def _linked(function, arguments) -> bool:
    """Whether a step's call has its overload (see _direct): False where the loader's child compiles it first.
    Without a loader guarding, True at once: _direct links or compiles what the final steps call, and a node's
    steps that block_direct_runs replaces (direct tiles by blocked ones) are not linked for nothing (~60 ms of
    a new worker's CPU on a MobileNet)."""
    from ..compiled.deferred import Loop, guarding, overload

    if not isinstance(function, Loop) or not guarding():
        return True
    dispatcher = function.dispatcher()
    try:
        types = tuple(_argument_type(dispatcher, a) for a in arguments)
    except (TypeError, ValueError):
        return True
    return overload(function, types) is not None


def _run_kernel(kernel, inputs, outputs) -> None:
    """The step of a node no binder prepares: its kernel, its results copied into their buffers."""
    for buffer, value in zip(outputs, kernel(*inputs)):
        np.copyto(buffer, value)


def is_constant(segment, slot: int, value) -> bool:
    """Whether the segment's input ``slot`` holding ``value`` is bound as it is (a read-only weight), not copied in
    at each run (a feed, or a read-only input seen to change: segment.fed)."""
    return isinstance(value, np.ndarray) and not value.flags.writeable and slot not in segment.fed


def _input_buffers(segment, env):
    """(buffers, constants, feeds, bytes) for the segment's inputs: a read-only input (a weight) is bound as it
    is, the others get a buffer that each run copies them into; None where an input is not an array."""
    buffers: dict[int, np.ndarray] = {}
    constants: dict[int, np.ndarray] = {}
    feeds = []
    total = 0
    for slot in range(segment.feeds):
        value = env[slot]
        if not isinstance(value, np.ndarray):
            return None
        if is_constant(segment, slot, value):
            constants[slot] = buffers[slot] = value
        else:
            buffers[slot] = np.empty(value.shape, value.dtype)
            feeds.append((slot, buffers[slot]))
            total += value.nbytes
    return buffers, constants, feeds, total


def _is_view(inner, env) -> bool:
    """Whether the node is a reshape whose output can be a view of its input's buffer."""
    if inner.node.op_type not in _VIEWS or inner.node.domain not in ("", "ai.onnx") or not inner.inputs \
            or inner.inputs[0] < 0:
        return False
    x, y = env[inner.inputs[0]], env[inner.outputs[0]]
    return isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.size == y.size and x.dtype == y.dtype


def _fills_concat(segment, inner, env) -> bool:
    """Whether the node is a convolution writing its channels into the concatenation that the convolutions before it
    in the segment began (conv_fusions.fuse_concat_convs): its output is its ``into`` input's buffer. An ``into``
    from outside the segment (a feed: the plan's copy of it) is left to the node's kernel."""
    if not concat_part(inner.node) or len(inner.inputs) <= CONV_INTO or inner.inputs[CONV_INTO] < segment.feeds:
        return False
    into, y = env[inner.inputs[CONV_INTO]], env[inner.outputs[0]]
    return isinstance(into, np.ndarray) and isinstance(y, np.ndarray) and into.shape == y.shape \
        and into.dtype == y.dtype


def aliased(segment):
    """``aliased(inner, env) -> position | None``: the input whose buffer the node's output is (a reshape's view of
    its input, a concatenation's part filling its ``into``), for segment_arena.Lifetimes."""
    def position(inner, env):
        if _is_view(inner, env):
            return 0
        return CONV_INTO if _fills_concat(segment, inner, env) else None

    return position


def build_plan(segment, env: list, limit_bytes: int) -> BoundPlan | None:
    """The bound plan of ``segment`` (ops/segment.Segment) for the signature whose node-by-node run left every
    value in ``env`` (by slot); None where a value is not an array or the buffers would pass ``limit_bytes``.
    Bound twice: once to learn each value's lifetime, then over one arena shared by liveness (segment_arena)."""
    lifetimes = Lifetimes(segment, env, aliased(segment))
    first = _bind_all(segment, env, lifetimes)
    if first is None:
        return None
    arena = lifetimes.arena(first[0], first[1])
    if arena.nbytes + first[2] > limit_bytes:
        return None
    second = _bind_all(segment, env, arena)
    if second is None:
        return None
    steps, results, other_bytes, feeds, constants = second
    copied = sum(a[2][0].nbytes for f, a in steps if f is _run_kernel)
    if copied > COPY_LIMIT_BYTES or all(f is _run_kernel for f, _ in steps):
        return None  # (its kernels' outputs copied into the buffers would cost more than the plan saves)
    # (chained first: a chain's elementwise rows are shared with the helpers by its own split, segment_chain.py)
    calls = split_elementwise(chained(steps, _linked))
    plan = BoundPlan(feeds, constants, steps, results, arena.nbytes + other_bytes, None if calls is steps else calls)
    plan.arena = arena
    return plan


def _bind_all(segment, env, pool):
    """(steps, results, bytes outside the arena, feeds, constants) of the segment bound over ``pool``'s
    buffers (segment_arena's Lifetimes or Arena); None where a value is not an array."""
    inputs_bound = _input_buffers(segment, env)
    if inputs_bound is None:
        return None
    buffers, constants, feeds, total = inputs_bound
    steps: list = []
    blocks = squeeze_excitations(segment, env, constants)
    skipped: set[int] = set()
    spans: dict[int, tuple[int, int]] = {}  # node index -> its steps
    for index, inner in enumerate(segment.inner):
        pool.at(index)
        first = len(steps)
        if index in blocks:  # the whole block as one step at its first node (it reads x only)
            _bind_block(blocks[index], env, buffers, steps, skipped, pool)
        elif index not in skipped and not _bind_node(segment, inner, env, buffers, constants, steps, pool):
            return None
        spans[index] = (first, len(steps))
    steps, scratch = block_direct_runs(segment, steps, spans, env, blocks, pool)
    return steps, [buffers[s] for s in segment.results], total + scratch, feeds, constants


def _bind_node(segment, inner, env, buffers, constants, steps, pool) -> bool:
    """The steps of one node into ``steps``, its outputs' buffers into ``buffers``; False where an output is not
    an array."""
    inputs = [None if s < 0 else buffers[s] for s in inner.inputs]
    examples = [env[s] for s in inner.outputs]
    if not all(isinstance(v, np.ndarray) for v in examples):
        return False
    if _is_view(inner, env):
        buffers[inner.outputs[0]] = inputs[0].reshape(examples[0].shape)
        return True
    if _fills_concat(segment, inner, env):
        outputs = [inputs[CONV_INTO]]  # (its channels of the concatenation, written where the Concat would copy them)
    else:
        outputs = [pool.take(slot, v.shape, v.dtype) for slot, v in zip(inner.outputs, examples)]
    for slot, buffer in zip(inner.outputs, outputs):
        buffers[slot] = buffer
    constant = [s in constants for s in inner.inputs]
    kernel = inner.kernel(inputs)
    op = inner.node.op_type
    binder = BINDERS.get(op) if inner.node.domain in ("", "ai.onnx", "ai.onnx_runtime.cpu") else None
    bound = binder(inner.node, kernel, inputs, outputs, constant) if binder is not None else None
    if bound is not None and not all(_linked(function, arguments) for function, arguments in bound):
        bound = None  # (its kernel, with its own fallback, until the loader's child has compiled the loop)
    steps.extend(bound if bound is not None else [(_run_kernel, (kernel, inputs, outputs))])
    return True


def _bind_block(block, env, buffers, steps, skipped, pool) -> None:
    """A block of segment_blocks.py as one step."""
    members, last, bind = block
    output = pool.take(last, env[last].shape, env[last].dtype)
    buffers[last] = output
    steps.append(bind(buffers, output))
    skipped.update(members)


# -- binders ----------------------------------------------------------------------------------------------
def _bind_own(node, kernel, inputs, outputs, constant):
    """Kernels that prepare their own calls (their ``bind``: convolutions, ops/conv.py; pools, ops/pool.py;
    trailing-axes means, ops/reduction.py)."""
    bind = getattr(kernel, "bind", None)
    return bind(inputs, outputs, constant) if bind is not None else None


def _floats(*arrays) -> bool:
    return all(a is not None and a.dtype in (np.float32, np.float64) for a in arrays)


def _bind_relu(node, kernel, inputs, outputs, constant):
    x, y = inputs[0], outputs[0]
    if not _floats(x) or x.shape != y.shape or x.dtype != y.dtype:
        return None
    return [(functools.partial(np.maximum, out=y), (x, x.dtype.type(0)))]


def _bind_hard_sigmoid(node, kernel, inputs, outputs, constant):
    """max(0, min(1, alpha * x + beta)) in x's dtype, the kernel's operations in its order, in one loop."""
    from ..compiled.segment_loops import hard_sigmoid_into

    x, y = inputs[0], outputs[0]
    if not _floats(x) or x.shape != y.shape or x.dtype != y.dtype:
        return None
    t = x.dtype.type
    return [(hard_sigmoid_into, (x.reshape(-1), y.reshape(-1), t(node.attr("alpha", 0.2)), t(node.attr("beta", 0.5)),
                                 False))]


def _bind_hard_swish(node, kernel, inputs, outputs, constant):
    """x * max(0, min(1, x / 6 + 1 / 2)), as algorithms/activations.hard_swish_in_place computes it."""
    x, y = inputs[0], outputs[0]
    if not _floats(x) or x.shape != y.shape or x.dtype != y.dtype:
        return None
    return hard_swish_steps(x, y)


# numpy's copy through the permuted view beat the kernel's call and copy: ConvNeXt's layout changes around its
# convolutions, and ShuffleNet's 5-D channel shuffle (4 x 34 x 28 x 28: 11.3 against 12.1 us).
def _bind_transpose(node, kernel, inputs, outputs, constant):
    """A permutation (a 4-D map's layout change, a channel shuffle's 5-D swap of groups and channels) as the input's
    buffer copied through its permuted view (made once) into the output's, without the kernel's call, its view and
    the copy of its result per run."""
    x, y = inputs[0], outputs[0]
    perm = tuple(int(p) for p in node.attr("perm", ()))
    if sorted(perm) != list(range(x.ndim)) or x.dtype != y.dtype or x.transpose(perm).shape != y.shape:
        return None
    return [(np.copyto, (y, x.transpose(perm)))]


def _binary(ufunc):
    def bind(node, kernel, inputs, outputs, constant):
        a, b, y = inputs[0], inputs[1], outputs[0]
        if not _floats(a, b) or a.dtype != b.dtype or y.dtype != a.dtype \
                or np.broadcast_shapes(a.shape, b.shape) != y.shape:
            return None
        return [(ufunc, (a, b, y))]

    return bind


def _bind_global_average_pool(node, kernel, inputs, outputs, constant):
    from .pooling import pool_loops

    x, y = inputs[0], outputs[0]
    loops = pool_loops()
    size = int(np.prod(x.shape[2:])) if x.ndim > 2 else 0
    if not _floats(x) or x.ndim <= 2 or not 0 < size <= loops.PLANE_SUM_LIMIT or y.dtype != x.dtype:
        return None
    return [(loops.plane_means, (x.reshape(-1, size), y.reshape(-1), size))]


def _bind_gemm(node, kernel, inputs, outputs, constant):
    """A (rows, K) @ B (+ C) with alpha and beta 1 and B a constant (read through a transposed view for transB)."""
    a, b, y = inputs[0], inputs[1], outputs[0]
    c = inputs[2] if len(inputs) > 2 else None
    if not _floats(a, b) or node.attr("transA", 0) or float(node.attr("alpha", 1.0)) != 1 or not constant[1] \
            or (c is not None and float(node.attr("beta", 1.0)) != 1) or a.ndim != 2 or b.ndim != 2 \
            or b.dtype != a.dtype or y.dtype != a.dtype:
        return None
    weights = b.T if node.attr("transB", 0) else b  # a view: BLAS reads either layout as fast; a copy doubled it
    if (a.shape[0], weights.shape[1]) != y.shape or weights.shape[0] != a.shape[1]:
        return None
    small = _small_gemm(node, a, b, c, y, constant)
    if small is not None:
        return small
    steps = [(np.matmul, (a, weights, y))]
    if c is not None:
        if c.dtype != a.dtype or np.broadcast_shapes(c.shape, y.shape) != y.shape:
            return None
        steps.append((np.add, (y, c, y)))
    return steps


def _small_gemm(node, a, b, c, y, constant):
    """A float32 classifier (a few rows by constant weights of at most linalg.SMALL_GEMM_MACS multiply-adds, C none or
    a constant row) as the loop the Gemm kernel itself keeps bound (compiled/small_gemm.py): product and bias in
    one call, where np.matmul and the bias add were two (1.1 + 0.8 us for ResNet's 1x128 by 128x10 head)."""
    from ..compiled import small_gemm
    from ..ops.linalg import SMALL_GEMM_MACS

    trans_b = bool(node.attr("transB", 0))
    rows, depth = a.shape
    columns = y.shape[1]
    bias = np.empty(0, np.float32) if c is None else c.reshape(-1)
    bias.flags.writeable = False  # (as the kernel's bias: the loop's overload for read-only weights and bias)
    if a.dtype != np.float32 or (c is not None and c.dtype != np.float32) or rows * depth * columns > SMALL_GEMM_MACS \
            or not (trans_b or rows <= 2) \
            or (c is not None and (not constant[2] or c.shape not in ((columns,), (1, columns)))) \
            or not all(v.flags.c_contiguous for v in (a, b, bias, y)):
        return None
    loop = small_gemm.rows_by_transposed_bias_ if trans_b else small_gemm.rows_by_weights_bias_
    return [(loop, (a, b, bias, y))]


def _bind_swish(node, kernel, inputs, outputs, constant):
    """x / (1 + exp(-alpha * x)) (the SiLU that fusions.fuse_silu makes of Sigmoid and Mul): for float32 one
    vectorized pass (compiled/segment_loops.swish_float32_into), else the kernel's formula as ufuncs with
    ``out=``."""
    from ..compiled.segment_loops import swish_float32_into

    x, y = inputs[0], outputs[0]
    if not _floats(x) or x.shape != y.shape or x.dtype != y.dtype:
        return None
    t = x.dtype.type
    if x.dtype == np.float32 and x.flags.c_contiguous and y.flags.c_contiguous:
        return [(swish_float32_into, (x.reshape(-1), y.reshape(-1), t(node.attr("alpha", 1.0))))]
    return [(np.multiply, (x, t(-float(node.attr("alpha", 1.0))), y)), (_quiet_exp, (y,)), (np.add, (y, t(1), y)),
            (np.divide, (x, y, y))]


def _quiet_exp(y) -> None:
    """exp in place; overflow to inf (the limit the Swish formula wants) without a warning."""
    with np.errstate(over="ignore"):
        np.exp(y, out=y)


_SMALL_SIGMOID = 4096  # values: up to here compiled/sigmoid.py's loop, beyond numpy's vectorized exp (the kernel's)


def _bind_sigmoid(node, kernel, inputs, outputs, constant):
    """The logistic sigmoid in one loop: float32 vectorized (segment_loops.sigmoid_float32_into), a small
    float64 tensor (a squeeze-excitation gate outside a matched block) by compiled/sigmoid.py."""
    from ..compiled.segment_loops import sigmoid_float32_into
    from ..compiled.sigmoid import sigmoid_into

    x, y = inputs[0], outputs[0]
    if x is not None and x.dtype == np.float32 and x.shape == y.shape and y.dtype == x.dtype \
            and x.flags.c_contiguous and y.flags.c_contiguous:
        return [(sigmoid_float32_into, (x.reshape(-1), y.reshape(-1)))]
    if not _floats(x) or x.shape != y.shape or x.dtype != y.dtype or x.size > _SMALL_SIGMOID:
        return None
    return [(sigmoid_into, (x.reshape(-1), y.reshape(-1)))]


def _bind_concat(node, kernel, inputs, outputs, constant):
    """Concat into its buffer in one call (the inputs' own buffers are read in place)."""
    y = outputs[0]
    if any(x is None or x.dtype != y.dtype or x.ndim != y.ndim for x in inputs):
        return None
    axis = int(node.attr("axis", 0)) % y.ndim
    if sum(x.shape[axis] for x in inputs) != y.shape[axis]:
        return None
    return [(functools.partial(np.concatenate, axis=axis, out=y), (tuple(inputs),))]


def _bind_round_to_half(node, kernel, inputs, outputs, constant):
    """A half-precision model's input rounding (precision_fusions.py) as the segment's first step: the compiled
    rounding straight into its buffer, without the executor's step and the fresh array of a node of its own."""
    from onnx_runtime.dtypes import DataType

    from ..compiled import precision

    x, y = inputs[0], outputs[0]
    to = int(node.attr("to", int(DataType.FLOAT16)))
    loop = {int(DataType.FLOAT16): precision.round_to_float16, int(DataType.BFLOAT16): precision.round_to_bfloat16}
    if len(inputs) != 1 or x is None or x.dtype != np.float32 or y.dtype != x.dtype or x.shape != y.shape \
            or to not in loop or not x.flags.c_contiguous or not y.flags.c_contiguous:
        return None
    return [(loop[to], (x.reshape(-1), y.reshape(-1)))]


BINDERS = {
    "Conv": _bind_own, "FusedConv": _bind_own, "MaxPool": _bind_own, "AveragePool": _bind_own, "ReduceMean": _bind_own,
    "Relu": _bind_relu,
    "HardSigmoid": _bind_hard_sigmoid,
    "HardSwish": _bind_hard_swish, "Mul": _binary(np.multiply), "Add": _binary(np.add),
    "GlobalAveragePool": _bind_global_average_pool, "Gemm": _bind_gemm, "Swish": _bind_swish,
    "Sigmoid": _bind_sigmoid, "Concat": _bind_concat, "Sub": _binary(np.subtract),
    "QuantizeDequantize": _bind_own,  # ops/quantization.py
    "RoundToHalf": _bind_round_to_half, "Transpose": _bind_transpose,
    "BatchNormalization": _bind_own, "FusedBatchNormalization": _bind_own,  # ops/normalization.py
}
