"""Executor identities and the provider-artifact report (the executor hooks of contract/memory_hookspecs.py).

A session may run several executors over one provider instance (base decode, verify). Artifacts whose
lifetime follows an executor (kernels compiled for it, reservations it owns) are keyed by
:class:`ExecutorInstanceId`, not by graph node ids, which collide across sibling executors. Every
identity here is routing data, not authority: a provider checks the labels it receives against its own
state and rejects foreign or stale ones.
"""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

from ..records import FrozenRecord

if TYPE_CHECKING:
    from ..devices import DeviceId

_executor_ids = itertools.count(1)


class ExecutorInstanceId(FrozenRecord):
    """Process-unique identity of one executor sharing a provider; 0 (``UNSCOPED``) is for direct callers."""

    __slots__ = __match_args__ = ("value",)
    value: int
    UNSCOPED: ClassVar[ExecutorInstanceId]

    def __init__(self, value: int) -> None:
        object.__setattr__(self, "value", value)

    @classmethod
    def new(cls) -> ExecutorInstanceId:
        return cls(next(_executor_ids))


ExecutorInstanceId.UNSCOPED = ExecutorInstanceId(0)


class ExecutorArtifactProviderId(FrozenRecord):
    """The provider-instance label echoed through the artifact hooks, so a generation cannot be carried
    across a provider rebuild; 0 (``UNSCOPED``) for providers that own no executor artifacts."""

    __slots__ = __match_args__ = ("value",)
    value: int
    UNSCOPED: ClassVar[ExecutorArtifactProviderId]

    def __init__(self, value: int) -> None:
        object.__setattr__(self, "value", value)


ExecutorArtifactProviderId.UNSCOPED = ExecutorArtifactProviderId(0)


class ExecutorArtifactGeneration(FrozenRecord):
    """Process-unique generation of one executor build, assigned by the session."""

    __slots__ = __match_args__ = ("value",)
    value: int

    def __init__(self, value: int) -> None:
        object.__setattr__(self, "value", value)


class ExecutorArtifactReadinessEpoch(FrozenRecord):
    """Executor-local epoch, advanced at every kernel-cache miss; a provider is asked once per epoch."""

    __slots__ = __match_args__ = ("value",)
    value: int
    INITIAL: ClassVar[ExecutorArtifactReadinessEpoch]

    def __init__(self, value: int) -> None:
        object.__setattr__(self, "value", value)

    # ordered by value, as a dataclass with order=True
    def __lt__(self, other: ExecutorArtifactReadinessEpoch) -> bool:
        return self.value < other.value if other.__class__ is self.__class__ else NotImplemented

    def __le__(self, other: ExecutorArtifactReadinessEpoch) -> bool:
        return self.value <= other.value if other.__class__ is self.__class__ else NotImplemented

    def __gt__(self, other: ExecutorArtifactReadinessEpoch) -> bool:
        return self.value > other.value if other.__class__ is self.__class__ else NotImplemented

    def __ge__(self, other: ExecutorArtifactReadinessEpoch) -> bool:
        return self.value >= other.value if other.__class__ is self.__class__ else NotImplemented


ExecutorArtifactReadinessEpoch.INITIAL = ExecutorArtifactReadinessEpoch(0)


class ExecutorRouteResidencyConfig(enum.Enum):
    """Whether an executor may publish route-residency producers (resolved before it compiles)."""

    DISABLED = "disabled"
    ENABLED = "enabled"


class ExecutorKernelScope(enum.Enum):
    """Whether a kernel factory needs a session-issued executor scope (``get_kernel_for_executor``)."""

    UNSCOPED = "unscoped"
    REQUIRED = "required"


class ExecutorArtifactPolicy(FrozenRecord):
    """Immutable provider policy the session snapshots once before compiling an executor."""

    __slots__ = __match_args__ = ("provider", "device", "route_residency")
    provider: ExecutorArtifactProviderId
    device: DeviceId
    route_residency: ExecutorRouteResidencyConfig

    def __init__(self,
                 provider: ExecutorArtifactProviderId, device: DeviceId,
                 route_residency: ExecutorRouteResidencyConfig = ExecutorRouteResidencyConfig.DISABLED) -> None:
        object.__setattr__(self, "provider", provider)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "route_residency", route_residency)


class ExecutorArtifactStateKind(enum.Enum):
    DISABLED = "disabled"  # the policy forbids artifacts
    DECLINED = "declined"  # allowed, but this graph or provider cannot support them
    REQUIRED = "required"  # the executor needs the provider's artifacts (see executor_artifact_requirement)
    PENDING = "pending"  # not yet decidable at this readiness epoch


class ExecutorArtifactState(FrozenRecord):
    """What a provider observed for one inspection; ``reason`` says why a PENDING state is pending
    (a node whose producer is not published yet, or provider readiness)."""

    __slots__ = __match_args__ = ("kind", "reason", "node")
    kind: ExecutorArtifactStateKind
    reason: str
    node: str | None

    def __init__(self, kind: ExecutorArtifactStateKind, reason: str = "", node: str | None = None) -> None:
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "node", node)

    @classmethod
    def pending(cls, reason: str, node: str | None = None) -> ExecutorArtifactState:
        if not reason:
            raise ValueError("a pending artifact state needs a reason")
        return cls(ExecutorArtifactStateKind.PENDING, reason, node)


class ExecutorArtifactReport(FrozenRecord):
    """A provider's untrusted report for one executor, generation and readiness epoch; the session checks
    the echoed labels against its own state before acting on it."""

    __slots__ = __match_args__ = ("provider", "executor", "generation", "readiness", "state")
    provider: ExecutorArtifactProviderId
    executor: ExecutorInstanceId
    generation: ExecutorArtifactGeneration
    readiness: ExecutorArtifactReadinessEpoch
    state: ExecutorArtifactState

    def __init__(self,
                 provider: ExecutorArtifactProviderId, executor: ExecutorInstanceId,
                 generation: ExecutorArtifactGeneration, readiness: ExecutorArtifactReadinessEpoch,
                 state: ExecutorArtifactState) -> None:
        object.__setattr__(self, "provider", provider)
        object.__setattr__(self, "executor", executor)
        object.__setattr__(self, "generation", generation)
        object.__setattr__(self, "readiness", readiness)
        object.__setattr__(self, "state", state)


@runtime_checkable
class ExecutorArtifactUseGuard(Protocol):
    """Held from the final health check through the last launch that uses the artifacts."""

    def release(self) -> None: ...


@runtime_checkable
class ExecutorArtifactRequirementState(Protocol):
    """Provider-owned state the session keeps for a REQUIRED report; the same object answers while the
    artifact is active, retiring or retired, so a baked graph fails closed after teardown."""

    def acquire_use(self) -> ExecutorArtifactUseGuard: ...
