"""A decode step's attention-mask chain, computed once per mask and kept.

Decoder exports turn the ``attention_mask`` feed into the additive bias their attention reads with a chain of
small steps that the shape-only cache (:class:`.steps.ShapeValues`) cannot skip, since they read the mask's
values: ``Cast -> GatherND -> And -> Expand -> Where`` (dynamo, gathering ``mask[batch, key]`` by shape-derived
indices), ``Cast -> Flatten -> Gather -> Reshape -> Cast -> And -> Expand -> Where`` (TorchScript), and the like.
A generation loop feeds the same mask for a given length every time it passes that length, so the chain's
results are a function of the mask's bytes and of the other values the chain reads: constants (by identity)
and the kept shape-only values (small: by their bytes too).

:func:`grouped` replaces the steps of a plan's body that read only mask feeds, constants, kept values and each
other's outputs (pure operators, no graph outputs) with one step, :class:`MaskChain`, whose kernel returns the
kept results of an earlier call with the same masks, kept values and constants, and otherwise runs the
steps and keeps read-only copies of their results, as the shape-only cache keeps its values.
"""

from __future__ import annotations

import operator
import threading

import numpy as np

from ..errors import KernelError, OnnxRuntimeError
from ..ir import Node
from .steps import Step, StepFailure, Steps, node_error, run_loop

ENABLED = True  # (off: the chain's steps run every call, as before; same-process A/B)

# Pure operators a mask chain is made of (elementwise, comparisons, logic, layout, gathers), ONNX domain only.
CHAIN_OPS = frozenset({
    "Cast", "CastLike", "Identity", "Not", "And", "Or", "Xor", "Where", "Equal", "Less", "LessOrEqual", "Greater",
    "GreaterOrEqual", "Add", "Sub", "Mul", "Neg", "Min", "Max", "Expand", "Reshape", "Flatten", "Unsqueeze",
    "Squeeze", "Transpose", "Slice", "Concat", "Gather", "GatherND", "GatherElements", "Tile", "CumSum",
    "ReduceMax", "ReduceMin", "ReduceSum", "Div", "Cos", "Sin", "Exp", "Pow", "Sqrt", "Reciprocal", "Abs",
})


_INTEGERS = frozenset({"BOOL", "INT8", "INT16", "INT32", "INT64", "UINT8", "UINT16", "UINT32", "UINT64"})


def mask_feeds(graph) -> set[str]:
    """Names of the graph's integer or boolean tensor inputs named as masks (``attention_mask``,
    ``encoder_attention_mask``, ``padding_mask``) or positions (``position_ids``): feeds a loop repeats for a
    given length (the rotary angles or position embeddings of a position are a chain of their own)."""
    names = set()
    for info in graph.inputs:
        dtype = info.type.dtype
        if info.type.is_tensor and dtype is not None and info.name.lower().endswith(("mask", "position_ids")) \
                and dtype.name in _INTEGERS:
            names.add(info.name)
    return names


class MaskChain:
    """The kernel of a grouped chain: ``inputs`` (slots, in the call's argument order) of which the first
    ``by_value`` (the mask feeds and the kept shape-only values: small, and made anew whenever the shape-only
    cache starts over) are keyed by their shapes and bytes, the rest (constants, which live and stay as they are
    for the plan's life) by identity. ``steps`` run on a miss; ``outputs`` are the slots the rest of the plan
    reads. Entries are bounded in count and bytes; results larger than an entry may hold are not kept. Inputs of
    shapes met for the first time are not keyed (nor kept): a first generation meets a new length every step, and
    keying and keeping what only a later generation could read cost it about 8 us a step."""

    LIMIT = 1024
    KEY_BYTES = 64 << 10  # larger keyed inputs: the steps run, nothing kept
    ENTRY_BYTES = 256 << 10
    TOTAL_BYTES = 8 << 20

    def __init__(self, steps: list[Step], inputs: tuple[int, ...], by_value: int, outputs: tuple[int, ...]):
        self.steps = steps
        self.inputs = inputs
        self.by_value = by_value
        self.outputs = outputs
        self.kept: dict[tuple, tuple] = {}
        self.seen: set[tuple] = set()  # the keyed inputs' shapes met so far: keys are made from the second on
        self.held = 0
        self.runs = 0  # the steps' runs (tests: a repeated mask runs none)
        self._lock = threading.Lock()
        # A miss runs the plan's own loop over a list of the chain's slots numbered densely, the inputs first (the
        # call's arguments are its head) and a slot that stays None for omitted inputs: a first generation misses
        # at every step, and a table by the plan's slot numbers cost more per chain step.
        local = {slot: index for index, slot in enumerate(inputs)}
        for step in steps:
            for slot in step.outputs:
                local.setdefault(slot, len(local))
        none = local.setdefault(0, len(local))  # (slot 0: an omitted input)
        self._local = Steps([step.replace(inputs=tuple(local.get(slot, none) for slot in step.inputs),
                                                 outputs=tuple(local[slot] for slot in step.outputs), release=())
                             for step in steps])
        self._tail = (None,) * (len(local) - len(inputs))
        self._results = operator.itemgetter(*(local[slot] for slot in outputs)) if len(outputs) > 1 else None
        self._result = local[outputs[0]] if outputs else None

    def __call__(self, *args):
        keyed = args[:self.by_value]
        try:  # (the session checked the feeds' dtypes; a kept value's dtype is the plan's: shape and bytes suffice)
            shapes = tuple([a.shape for a in keyed])
            if shapes not in self.seen:  # a length new to this plan (a first generation's every step): run only
                if len(self.seen) >= 4 * self.LIMIT:
                    self.seen.clear()
                self.seen.add(shapes)
                key = None
            elif sum([a.nbytes for a in keyed]) > self.KEY_BYTES:  # (a prefill's causal mask at 1024)
                key = None
            else:  # (every later generation's step makes one: the shapes once, then the bytes and identities)
                key = (shapes, *[a.tobytes() for a in keyed], *[id(a) for a in args[self.by_value:]])
        except AttributeError:  # not an array: the steps say what is wrong with it
            key = None
        if key is not None:
            entry = self.kept.get(key)
            if entry is not None:
                return entry
        results = self.compute(args)
        if key is not None:
            self._keep(key, results)
        return results

    def compute(self, args) -> tuple:
        """The chain's steps over ``args`` (a miss: every step of a first generation), over a table of the slots
        they use. (A plain loop: building them into straight-line code costs a compile, 1-2 ms, that the few misses
        of a plan's first generations would not earn back.)"""
        self.runs += 1
        env = [*args, *self._tail]
        try:
            run_loop(self._local, env)
        except StepFailure as wrapped:  # named after the node that failed, as the plan's own loop names it
            exc, index = wrapped.args
            raise node_error(self.steps[index], exc, type(exc) if isinstance(exc, OnnxRuntimeError) else KernelError) \
                from exc
        if self._results is not None:
            return self._results(env)
        return (env[self._result],) if self._result is not None else ()

    def _keep(self, key: tuple, results: tuple) -> None:
        size = 0
        for result in results:
            if not isinstance(result, np.ndarray):
                return
            size += result.nbytes
        if size > self.ENTRY_BYTES:
            return
        # Copies, read-only and shared by every later call with this key: a result may view a feed's buffer (the
        # caller rewrites it), and this call's own results stay as the steps made them (a kernel that keeps what
        # it derives from a read-only input by identity would do that for every new mask of a first generation).
        copies = []
        for result in results:
            result = result.copy()
            result.flags.writeable = False
            copies.append(result)
        results = tuple(copies)
        with self._lock:
            if len(self.kept) >= self.LIMIT or self.held + size > self.TOTAL_BYTES:
                self.kept.clear()
                self.held = 0
            self.kept[key] = results
            self.held += size


def grouped(steps: list[Step], masks: set[int], kept: set[int], constants: set[int]) -> list[Step]:
    """``steps`` (a plan body whose releases are assigned) with the steps that compute from the ``masks`` feed
    slots, ``constants``' and ``kept`` slots and each other alone as one :class:`MaskChain` step at the first
    one's place (everything it reads is in the table before the body runs); ``steps`` itself where fewer than
    two such steps exist."""
    if not masks:
        return steps
    derived = set(masks)
    members: list[int] = []
    for index, step in enumerate(steps):
        node = step.node
        read = [slot for slot in step.inputs if slot]
        if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in CHAIN_OPS \
                or node.subgraphs() or not read:
            continue
        if all(slot in derived or slot in kept or slot in constants for slot in read) \
                and any(slot in derived for slot in read):
            members.append(index)
            derived.update(step.outputs)
    if len(members) < 2:
        return steps
    chosen = set(members)
    made = {slot for index in members for slot in steps[index].outputs}
    outside_reads = {slot for index, step in enumerate(steps) if index not in chosen for slot in step.inputs}
    outputs = tuple(slot for index in members for slot in steps[index].outputs if slot in outside_reads)
    if not outputs:
        return steps
    external: list[int] = []
    for index in members:
        for slot in steps[index].inputs:
            if slot and slot not in made and slot not in external:
                external.append(slot)
    by_value = [slot for slot in external if slot not in constants]  # masks and kept values
    inputs = tuple(by_value + [slot for slot in external if slot in constants])
    inner = [steps[index].replace(release=()) for index in members]
    release = tuple(dict.fromkeys(slot for index in members for slot in steps[index].release if slot not in made))
    first = steps[members[0]].node
    node = Node("MaskChain", [], [], name=f"{first.name}/mask_chain" if first is not None else "mask_chain")
    chain = Step(MaskChain(inner, inputs, len(by_value), outputs), inputs, outputs, release, node,
                 steps[members[0]].provider)
    out = [step for index, step in enumerate(steps) if index not in chosen]
    out.insert(members[0], chain)
    return out
