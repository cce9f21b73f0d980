"""What ``supports_op`` answers, what ``get_kernel`` returns, and the small value types of the
contract that are not memory or graph identities."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ..devices import TensorLayout
from ..errors import InvalidArgumentError
from ..records import FrozenRecord, Record


class KernelMatch(FrozenRecord):
    """A provider's answer to "can you run this node?".

    ``KernelMatch.supported(cost)``: yes, at a relative cost (lower is better).
    ``KernelMatch.unsupported(reason)``: no, and the reason must be actionable: say what the
    provider accepts and how to change the model or the registration.
    """

    __slots__ = __match_args__ = ("is_supported", "cost", "reason")
    is_supported: bool
    cost: float
    reason: str

    def __init__(self, is_supported: bool, cost: float = 1.0, reason: str = "") -> None:
        object.__setattr__(self, "is_supported", is_supported)
        object.__setattr__(self, "cost", cost)
        object.__setattr__(self, "reason", reason)

    @classmethod
    def supported(cls, cost: float = 1.0) -> KernelMatch:
        # Asked once per node at placement; the answer is immutable, so one instance per cost serves.
        match = _SUPPORTED.get(cost)
        if match is None or type(match) is not cls:
            match = cls(True, cost=cost)
            if cls is KernelMatch:
                _SUPPORTED[cost] = match
        return match

    @classmethod
    def unsupported(cls, reason: str) -> KernelMatch:
        if not reason:
            raise ValueError("an unsupported KernelMatch needs an actionable reason")
        return cls(False, reason=reason)

    def __bool__(self) -> bool:
        return self.is_supported


_SUPPORTED: dict[float, KernelMatch] = {}


@runtime_checkable
class Kernel(Protocol):
    """A compiled kernel: ``kernel(*inputs) -> tuple of outputs``.

    Host-accessible providers exchange numpy arrays; other providers exchange
    :class:`onnx_runtime.Tensor` objects resident on their device. ``None`` stands for an omitted
    optional input. The executor calls kernels directly on the hot path, never through a hook.
    A kernel object may also carry ``capturable = True`` when it may be recorded into a device graph.
    """

    def __call__(self, *inputs: Any) -> tuple: ...


KernelFn = Callable[..., tuple]


class Availability(FrozenRecord):
    """Whether an installed provider can run on this machine, and if not, why (and what to do)."""

    __slots__ = __match_args__ = ("available", "reason")
    available: bool
    reason: str

    def __init__(self, available: bool, reason: str = "") -> None:
        object.__setattr__(self, "available", available)
        object.__setattr__(self, "reason", reason)

    @classmethod
    def yes(cls) -> Availability:
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> Availability:
        return cls(False, reason)


class ArgmaxTieBreak(enum.Enum):
    """Which index ``device_argmax`` returns when several elements share the maximum.

    LOWEST_INDEX matches ONNX ArgMax with select_last_index=0 (the greedy-decode default);
    HIGHEST_INDEX matches select_last_index=1.
    """

    LOWEST_INDEX = "lowest"
    HIGHEST_INDEX = "highest"

    @property
    def select_last_index(self) -> bool:
        return self is ArgmaxTieBreak.HIGHEST_INDEX

    @classmethod
    def checked(cls, value, provider: str) -> ArgmaxTieBreak:
        """``value`` (None: LOWEST_INDEX) as a tie-break, or an InvalidArgumentError naming ``provider``."""
        try:
            return cls.LOWEST_INDEX if value is None else cls(value)
        except ValueError:
            raise InvalidArgumentError(
                f"{provider}: tie_break must be an ArgmaxTieBreak (LOWEST_INDEX or HIGHEST_INDEX), got {value!r}"
            ) from None


class EpContext(Record):
    """A provider's compiled-context blob (the ``EPContext`` node payload) keyed by its source."""

    __slots__ = __match_args__ = ("source", "payload", "metadata")
    source: str
    payload: bytes
    metadata: dict[str, str]

    def __init__(self, source: str, payload: bytes, metadata: dict[str, str] | None = None) -> None:
        self.source = source
        self.payload = payload
        self.metadata = {} if metadata is None else metadata


# A graph pass: takes an onnx_runtime.ir.Graph (and, optionally, the ``owns(node)`` predicate of
# ``custom_passes``), rewrites it in place, returns True if it changed.
GraphPass = Callable[..., bool]


def input_facts(graph, node) -> tuple[list, list, list]:
    """Per input of ``node``: its shape, dtype and layout as ``graph`` knows them (``supports_op``'s arguments)."""
    shapes, dtypes, layouts = [], [], []
    for name in node.inputs:
        info = graph.type_of(name) if name else None
        shapes.append(info.shape if info is not None and info.is_tensor else None)
        dtypes.append(info.dtype if info is not None else None)
        layouts.append(TensorLayout.default())
    return shapes, dtypes, layouts
