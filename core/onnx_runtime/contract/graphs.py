"""Device-graph identities and the capture-region policy types.

A provider that can record a run of kernels into a replayable device graph (CUDA graphs) owns one
graph per *slot*: ``PRIMARY`` is the shape-invariant decode step; ``VERIFY`` the fixed-width
speculative verify step, so both can be held and replayed without invalidating each other.
Several sessions may share one provider, so every graph lives in an *owner* namespace, and every
installed graph has a *generation*: a re-capture mints a new generation, and a stale token can
neither replay nor reset a newer graph, nor another owner's.
"""

from __future__ import annotations

import enum
import itertools
import threading

from ..records import FrozenRecord


class DeviceGraphSlot(enum.IntEnum):
    PRIMARY = 0  # the shape-invariant M=1 decode graph
    VERIFY = 1  # the fixed-width M=k+1 speculative verify graph

    # The number of slots, not a slot: a non-member, so iterating the class (a reset sweep) and
    # DeviceGraphSlot(2) see only real slots.
    COUNT = enum.nonmember(2)


class IdentitySpace:
    """Process-unique, never-reused identities (no ABA reuse of a retired owner)."""

    def __init__(self):
        self._next = itertools.count(1)
        self._lock = threading.Lock()

    def mint(self) -> int:
        with self._lock:
            return next(self._next)


_GRAPH_OWNERS = IdentitySpace()


class DeviceGraphOwner(FrozenRecord):
    """Identity of one executor's device-graph namespace. ``DeviceGraphOwner.new()`` mints one."""

    __slots__ = __match_args__ = ("id",)
    id: int

    def __init__(self, id: int) -> None:
        object.__setattr__(self, "id", id)

    @classmethod
    def new(cls) -> DeviceGraphOwner:
        return cls(_GRAPH_OWNERS.mint())


class DeviceGraphToken(FrozenRecord):
    """Exact identity of one installed graph generation; required by replay, liveness and reset."""

    __slots__ = __match_args__ = ("owner", "slot", "generation")
    owner: DeviceGraphOwner
    slot: DeviceGraphSlot
    generation: int

    def __init__(self, owner: DeviceGraphOwner, slot: DeviceGraphSlot, generation: int) -> None:
        object.__setattr__(self, "owner", owner)
        object.__setattr__(self, "slot", slot)
        object.__setattr__(self, "generation", generation)


class CaptureRegionShapeStatus(FrozenRecord):
    """Resolved-shape facts the capture-region policy needs for one node."""

    __slots__ = __match_args__ = ("inputs_resolved", "outputs_resolved")
    inputs_resolved: bool
    outputs_resolved: bool

    def __init__(self, inputs_resolved: bool, outputs_resolved: bool) -> None:
        object.__setattr__(self, "inputs_resolved", inputs_resolved)
        object.__setattr__(self, "outputs_resolved", outputs_resolved)


class StructuralCaptureDecline(enum.Enum):
    """Why a node is excluded from a device-graph capture region (checked in this order)."""

    HOST_CONTROL_FLOW_OR_SEQUENCE = "control-flow and sequence nodes are not device-graph capturable"
    UNRESOLVED_OUTPUT_SHAPE = "data-dependent output shape was unresolved before capture"
    UNRESOLVED_INPUT_SHAPE = "data-dependent input shape was unresolved before capture"

    @property
    def reason(self) -> str:
        return self.value


CONTROL_FLOW_AND_SEQUENCE_OPS = frozenset({
    "If", "Loop", "Scan", "SequenceEmpty", "SequenceConstruct", "SequenceInsert", "SequenceErase",
    "SequenceAt", "SequenceLength", "SplitToSequence", "ConcatFromSequence",
})


def is_control_flow_or_sequence(node) -> bool:
    """Whether ``node`` is an ai.onnx control-flow or sequence operator (host-driven semantics)."""
    return node.domain in ("", "ai.onnx") and node.op_type in CONTROL_FLOW_AND_SEQUENCE_OPS
