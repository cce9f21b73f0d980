"""A decode step's attention-mask chain, computed once per mask and kept.

Decoder exports turn the ``attention_mask`` feed into the additive bias their attention reads with a chain of
small steps that the shape-only cache (:class:`.steps.ShapeValues`) cannot skip, since they read the mask's
values: ``Cast -> GatherND -> And -> Expand -> Where`` (dynamo, gathering ``mask[batch, key]`` by shape-derived
indices), ``Cast -> Flatten -> Gather -> Reshape -> Cast -> And -> Expand -> Where`` (TorchScript), and the like.
A generation loop feeds the same mask for a given length every time it passes that length, so the chain's
results are a function of the mask's bytes and of the other values the chain reads: constants and the kept
shape-only values (read-only arrays, whose identity stands for their contents as long as they are held).

:func:`grouped` replaces the steps of a plan's body that read only mask feeds, constants, kept values and each
other's outputs (pure operators, no graph outputs) with one step, :class:`MaskChain`, whose kernel returns the
kept results of an earlier call with the same mask bytes and the same read-only inputs, and otherwise runs the
steps. Its results are read-only, as the shape-only cache's are.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from ..errors import KernelError, OnnxRuntimeError
from ..ir import Node
from .steps import Step, node_error

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
    ``masks`` are mask feeds, keyed by their bytes; the rest read-only (constants, kept values), keyed by
    identity while an entry holds them. ``steps`` run over a local table on a miss; ``outputs`` are the slots
    the rest of the plan reads. Entries are bounded in count and bytes; a call whose inputs are not all
    read-only arrays, or whose results are larger than an entry may hold, runs the steps without keeping."""

    LIMIT = 1024
    ENTRY_BYTES = 256 << 10
    TOTAL_BYTES = 8 << 20

    def __init__(self, steps: list[Step], inputs: tuple[int, ...], masks: int, outputs: tuple[int, ...]):
        self.steps = steps
        self.inputs = inputs
        self.masks = masks
        self.outputs = outputs
        self.kept: dict[tuple, tuple] = {}
        self.held = 0
        self.runs = 0  # the steps' runs (tests: a repeated mask runs none)
        self._lock = threading.Lock()

    def __call__(self, *args):
        masks = self.masks
        try:  # (the session checked the feeds' dtypes: shape and bytes tell masks apart)
            key = [(a.shape, a.tobytes()) for a in args[:masks]]
            for a in args[masks:]:
                if a.flags.writeable:
                    key = None
                    break
                key.append(id(a))
        except AttributeError:  # not an array: the steps say what is wrong with it
            key = None
        if key is not None:
            key = tuple(key)
            entry = self.kept.get(key)
            if entry is not None:
                return entry[0]
        results = self.compute(args)
        if key is not None:
            self._keep(key, args[masks:], results)
        return results

    def compute(self, args) -> tuple:
        """The chain's steps over ``args`` (a miss)."""
        self.runs += 1
        env = dict(zip(self.inputs, args))
        for step in self.steps:
            try:
                values = step.run(*[env.get(slot) for slot in step.inputs])
            except Exception as exc:  # named after the node that failed, as the plan's own loop names it
                raise node_error(step, exc, type(exc) if isinstance(exc, OnnxRuntimeError) else KernelError) \
                    from exc
            for slot, value in zip(step.outputs, values):
                env[slot] = value
        return tuple(env[slot] for slot in self.outputs)

    def _keep(self, key: tuple, held: tuple, results: tuple) -> None:
        if not all(isinstance(r, np.ndarray) for r in results):
            return
        size = sum(r.nbytes for r in results)
        if size > self.ENTRY_BYTES:
            return
        for result in results:  # shared by every later call with this key
            result.flags.writeable = False
        with self._lock:
            if len(self.kept) >= self.LIMIT or self.held + size > self.TOTAL_BYTES:
                self.kept.clear()
                self.held = 0
            self.kept[key] = (results, held)  # (held: the keyed inputs stay alive, so their ids stay theirs)
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
    mask_inputs = [slot for slot in external if slot in masks]
    inputs = tuple(mask_inputs + [slot for slot in external if slot not in masks])
    inner = [dataclasses.replace(steps[index], release=()) for index in members]
    release = tuple(dict.fromkeys(slot for index in members for slot in steps[index].release if slot not in made))
    first = steps[members[0]].node
    node = Node("MaskChain", [], [], name=f"{first.name}/mask_chain" if first is not None else "mask_chain")
    chain = Step(MaskChain(inner, inputs, len(mask_inputs), outputs), inputs, outputs, release, node,
                 steps[members[0]].provider)
    out = [step for index, step in enumerate(steps) if index not in chosen]
    out.insert(members[0], chain)
    return out
