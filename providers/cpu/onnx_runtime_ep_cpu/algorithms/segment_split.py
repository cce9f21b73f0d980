"""A FusedSegment's batch split across the helper threads (ops/segment.py), image ranges in parallel.

At one thread a CNN's segment plan is one compiled call (segment_chain's run_chain over blocked layouts) that
runs the batch one image after another. With more threads its convolutions and pools would each split their
own work, but the splits break the chain (a pool split across threads is no longer a blocked step), each adds
a hand-off per layer, and the small layers of a light CNN do not split at all: a ResNet-18-like segment ran a
batch slower on two threads than on one. Here, where the batch has at least two images and the segment's plan
for a range of images has a chained call, each range gets a plan of its own (made as one thread makes it, over its
own buffers) and the ranges' chained calls run as conv_chain.CHAIN jobs: one on the calling thread, the others on
the helpers, which a caller takes back and runs itself where a helper has not started (workers.Helpers.run); the
calls between them (a half-precision input's rounding, a classifier's product) run range by range on the calling
thread.

Splitting by images is only right where no image reads another's values. That is proved from the graph, not from
the values of one run (identical warm-up images would hide a batch mean): every value the segment computes keeps
the batch as its first axis at the batch's size (a C-order reshape that does so keeps each image's elements within
the image), and every node is one whose output image n reads only input image n (per_image): a convolution, pool or
activation of its data input with constant parameters, an elementwise product or sum whose constants do not run
along the batch, a mean over other axes, a classifier's Gemm. The split plan is checked, as any plan, against the
node-by-node run it was made from.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from ..fused_domain import CONV_INTO, CONV_RESIDUAL
from ..threads import helper_count, kernel_threads, one_thread

_STANDARD = ("", "ai.onnx")
# Nodes whose output image n reads only image n of their first input, their other inputs being parameters (a
# FusedConv's residual aside: see per_image)
_IMAGEWISE = frozenset({"Conv", "FusedConv", "Relu", "HardSigmoid", "HardSwish", "Sigmoid", "Swish", "Tanh",
                        "GlobalAveragePool", "MaxPool", "AveragePool", "Clip", "LeakyRelu", "BatchNormalization",
                        "FusedBatchNormalization", "LRN", "Dropout", "Identity", "RoundToHalf", "Flatten",
                        "Reshape", "Squeeze", "Unsqueeze"})
_ELEMENTWISE = frozenset({"Add", "Sub", "Mul", "Div"})


def batch_of(segment, env, constant_slots) -> int:
    """The batch every value of the segment's node-by-node run ``env`` keeps as its first axis (constants
    aside), or 0 where some value does not (or is not an array)."""
    batch = 0
    for slot, value in enumerate(env):
        if slot in constant_slots:
            continue
        if not isinstance(value, np.ndarray) or value.ndim == 0:
            return 0
        if batch == 0:
            batch = value.shape[0]
        elif value.shape[0] != batch:
            return 0
    return batch


def per_image(segment, env, constant_slots) -> bool:
    """Whether every node of the segment computes its output's image n from image n of its inputs alone, given
    that every computed value keeps the batch first (batch_of)."""
    for inner in segment.inner:
        node = inner.node
        if node.domain not in _STANDARD and node.op_type not in ("FusedConv", "FusedBatchNormalization",
                                                                 "RoundToHalf"):
            return False
        check = _CHECKS.get(node.op_type)
        if check is None or not check(node, inner.inputs, env[inner.outputs[0]], env, constant_slots):
            return False  # (Pad, QuantizeDequantize and the rest: not proved; the batch runs whole)
    return True


def _data(slots, constant_slots) -> list[int]:
    return [s for s in slots if s >= 0 and s not in constant_slots]


def _imagewise(node, slots, out, env, constant_slots) -> bool:
    """Its first input's image n (a FusedConv's residual and concatenation so far image n too, of the output's rank);
    parameters besides."""
    allowed = {slots[0]}
    for position in (CONV_RESIDUAL, CONV_INTO) if node.op_type == "FusedConv" else ():
        if len(slots) > position and slots[position] >= 0:
            if env[slots[position]].ndim != out.ndim:
                return False
            allowed.add(slots[position])
    return all(s in allowed for s in _data(slots, constant_slots))


def _elementwise(node, slots, out, env, constant_slots) -> bool:
    """Data of the output's rank (the batch axes aligned); constants that do not run along the batch (they are
    not cut by range)."""
    for s in slots:
        value = env[s]
        if s in constant_slots:
            if value.ndim >= out.ndim and value.shape[0] != 1:
                return False
        elif value.ndim != out.ndim:
            return False
    return True


def _mean(node, slots, out, env, constant_slots) -> bool:
    """A mean over named axes, the batch's not among them."""
    axes = node.attr("axes")
    if axes is None and len(slots) > 1 and slots[1] >= 0:
        axes = env[slots[1]].tolist()
    rank = env[slots[0]].ndim
    return bool(axes) and all(int(a) % rank != 0 for a in axes) and _data(slots[1:], constant_slots) == []


def _gemm(node, slots, out, env, constant_slots) -> bool:
    """A classifier: data rows times constants, a bias without a row per image."""
    if node.attr("transA", 0) or _data(slots, constant_slots) != [slots[0]]:
        return False
    return not (len(slots) > 2 and slots[2] >= 0 and env[slots[2]].ndim == 2 and env[slots[2]].shape[0] != 1)


def _along(node, slots, out, env, constant_slots) -> bool:
    """A softmax or concatenation along an axis other than the batch's, over data of the output's rank."""
    default = 1 if node.op_type == "Concat" or node.opset < 13 else -1
    inputs = [s for s in slots if s >= 0]
    return int(node.attr("axis", default)) % out.ndim != 0 and all(env[s].ndim == out.ndim for s in inputs) \
        and (node.op_type != "Concat" or not any(s in constant_slots for s in inputs))


def _transpose(node, slots, out, env, constant_slots) -> bool:
    perm = node.attr("perm")
    return perm is not None and int(list(perm)[0]) == 0


_CHECKS = {**dict.fromkeys(_IMAGEWISE, _imagewise), **dict.fromkeys(_ELEMENTWISE, _elementwise),
           "ReduceMean": _mean, "Gemm": _gemm, "Softmax": _along, "Concat": _along, "Transpose": _transpose}


def ranges(batch: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``parts`` ranges of images covering ``batch``, as even as they go."""
    bounds = [batch * p // parts for p in range(parts + 1)]
    return tuple((a, b) for a, b in zip(bounds, bounds[1:]) if b > a)


def part_count(batch: int) -> int:
    """The ranges a batch splits into: one per thread of the run (the caller and its helpers), at most one per
    image (1: none)."""
    return max(1, min(kernel_threads(), 1 + helper_count(), batch))


def sliced(inputs, feed_slots, start: int, end: int) -> list:
    """``inputs`` with each feed cut to images ``start`` .. ``end`` (views: the batch is the first axis)."""
    part = list(inputs)
    for slot in feed_slots:
        part[slot] = inputs[slot][start:end]
    return part


def build_split(segment, inputs, feed_slots, batch: int, reference, build):
    """The SplitPlan of a batch of ``batch`` images, or None where the ranges' plans have no chained call or chain
    a different number of times. ``reference(part_inputs) -> (env, outputs)``: the node-by-node run;
    ``build(env) -> BoundPlan | None``."""
    parts = part_count(batch)
    if parts < 2:
        return None
    plans = []
    spans = ranges(batch, parts)
    with one_thread():  # (each range runs on one thread: its convolutions and pools planned as at one thread)
        for start, end in spans:
            env, _ = reference(sliced(inputs, feed_slots, start, end))
            plan = build(env)
            if plan is None or plan.feed_slots != tuple(feed_slots) \
                    or any(r.ndim == 0 or r.shape[0] != end - start for r in plan.results):
                return None
            plans.append(plan)
    stages = _stages(plans)
    return None if stages is None else SplitPlan(plans, spans, tuple(feed_slots), stages)


def _chained(call) -> bool:
    return getattr(call[0], "__name__", "") == "run_chain" and len(call[1]) == 2


def _stages(plans) -> tuple | None:
    """What a run of the ranges does, in order: (True, [each range's (table, reals)]) for the ranges' k-th chained
    calls, one job per range; (False, [(function, arguments), ...]) for the calls between them, range after range.
    None where no call is chained or the ranges chain a different number of times."""
    chains, between = [], []
    for plan in plans:
        own, groups = [], [[]]
        for call in plan.calls:
            if _chained(call):
                own.append(call[1])
                groups.append([])
            else:
                groups[-1].append(call)
        chains.append(own)
        between.append(groups)
    count = len(chains[0])
    if count == 0 or any(len(own) != count for own in chains):
        return None
    stages: list = []
    for k in range(count + 1):
        here = [call for groups in between for call in groups[k]]
        if here:
            stages.append((False, here))
        if k < count:
            stages.append((True, [own[k] for own in chains]))
    return tuple(stages)


# Ranges' chained calls that took this long (the helpers' spin before they sleep, workers._SPIN_SECONDS) are posted
# to sleeping helpers too the next time, which wakes them and waits (workers.Helpers.run's ``long``): a helper idle
# that long sleeps, and a caller that runs a sleeping helper's part itself keeps it asleep at every later run (a
# batch of 32 EfficientNet-style images ran on one thread, 15 ms a range). Shorter ones run on the caller while a
# sleeping helper wakes, where the wait would cost more than the part.
LONG_STAGE_SECONDS = 5e-3


class SplitPlan:
    """A bound plan (segment_steps.BoundPlan's interface) that runs ranges of a batch's images in parallel, each
    with a BoundPlan of its own: their chained calls as jobs, one per range, the others range by range here
    (``stages``: _stages)."""

    __slots__ = ("lock", "ticket", "nbytes", "arena", "constant_slots", "_plans", "_spans", "_feeds", "_stages",
                 "_shapes", "_helpers", "_run", "_chain", "_long")

    def __init__(self, plans, spans, feed_slots, stages):
        from ..compiled import workers  # (bound once here: an import statement costs each run microseconds)
        from ..compiled.conv_chain import CHAIN

        self._run, self._chain = workers.run, CHAIN
        self.lock = threading.Lock()
        self.ticket = None
        self.nbytes = sum(plan.nbytes for plan in plans)
        self.arena = None
        first = plans[0]
        self.constant_slots = first.constant_slots
        self._plans = tuple(plans)
        self._spans = tuple(spans)
        self._feeds = feed_slots
        self._stages = stages
        batch = spans[-1][1]
        self._shapes = tuple((slot, (batch, *buffer.shape[1:]), buffer.dtype) for slot, buffer in first.feeds)
        self._helpers = helper_count()
        self._long = False  # the last parallel stage took LONG_STAGE_SECONDS: its jobs wait for sleeping helpers

    @property
    def parts(self) -> tuple:
        """The ranges' BoundPlans, in image order."""
        return self._plans

    @property
    def constants(self) -> tuple:
        return self._plans[0].constants

    def constant_values(self, inputs) -> tuple:
        return self._plans[0].constant_values(inputs)

    def fits(self, inputs) -> bool:
        return self._plans[0].fits(inputs)

    def matches(self, inputs) -> bool:
        for slot, shape, dtype in self._shapes:
            value = inputs[slot]
            if not isinstance(value, np.ndarray) or value.shape != shape or value.dtype != dtype:
                return False
        return self.fits(inputs)

    def describe(self) -> dict:
        """The first range's plan's description (the ranges are planned alike), with the ranges' sizes."""
        return {**self._plans[0].describe(), "split": [end - start for start, end in self._spans]}

    def run(self, inputs):
        feeds = self._feeds
        for plan, (start, end) in zip(self._plans, self._spans):
            plan.stage(sliced(inputs, feeds, start, end))
        for parallel, calls in self._stages:
            if parallel:
                start = time.perf_counter()
                self._run(self._chain, calls, self._helpers, self._long)
                self._long = time.perf_counter() - start > LONG_STAGE_SECONDS
            else:
                for function, arguments in calls:
                    function(*arguments)
        results = [plan.results for plan in self._plans]
        return tuple([np.concatenate(parts) for parts in zip(*results)])
