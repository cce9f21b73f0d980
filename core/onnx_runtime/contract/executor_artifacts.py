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
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ..devices import DeviceId

_executor_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class ExecutorInstanceId:
    """Process-unique identity of one executor sharing a provider; 0 (``UNSCOPED``) is for direct callers."""

    value: int
    UNSCOPED: ClassVar[ExecutorInstanceId]

    @classmethod
    def new(cls) -> ExecutorInstanceId:
        return cls(next(_executor_ids))


ExecutorInstanceId.UNSCOPED = ExecutorInstanceId(0)


@dataclass(frozen=True, slots=True)
class ExecutorArtifactProviderId:
    """The provider-instance label echoed through the artifact hooks, so a generation cannot be carried
    across a provider rebuild; 0 (``UNSCOPED``) for providers that own no executor artifacts."""

    value: int
    UNSCOPED: ClassVar[ExecutorArtifactProviderId]


ExecutorArtifactProviderId.UNSCOPED = ExecutorArtifactProviderId(0)


@dataclass(frozen=True, slots=True)
class ExecutorArtifactGeneration:
    """Process-unique generation of one executor build, assigned by the session."""

    value: int


@dataclass(frozen=True, slots=True, order=True)
class ExecutorArtifactReadinessEpoch:
    """Executor-local epoch, advanced at every kernel-cache miss; a provider is asked once per epoch."""

    value: int
    INITIAL: ClassVar[ExecutorArtifactReadinessEpoch]


ExecutorArtifactReadinessEpoch.INITIAL = ExecutorArtifactReadinessEpoch(0)


class ExecutorRouteResidencyConfig(enum.Enum):
    """Whether an executor may publish route-residency producers (resolved before it compiles)."""

    DISABLED = "disabled"
    ENABLED = "enabled"


class ExecutorKernelScope(enum.Enum):
    """Whether a kernel factory needs a session-issued executor scope (``get_kernel_for_executor``)."""

    UNSCOPED = "unscoped"
    REQUIRED = "required"


@dataclass(frozen=True, slots=True)
class ExecutorArtifactPolicy:
    """Immutable provider policy the session snapshots once before compiling an executor."""

    provider: ExecutorArtifactProviderId
    device: DeviceId
    route_residency: ExecutorRouteResidencyConfig = ExecutorRouteResidencyConfig.DISABLED


class ExecutorArtifactStateKind(enum.Enum):
    DISABLED = "disabled"  # the policy forbids artifacts
    DECLINED = "declined"  # allowed, but this graph or provider cannot support them
    REQUIRED = "required"  # the executor needs the provider's artifacts (see executor_artifact_requirement)
    PENDING = "pending"  # not yet decidable at this readiness epoch


@dataclass(frozen=True, slots=True)
class ExecutorArtifactState:
    """What a provider observed for one inspection; ``reason`` says why a PENDING state is pending
    (a node whose producer is not published yet, or provider readiness)."""

    kind: ExecutorArtifactStateKind
    reason: str = ""
    node: str | None = None

    @classmethod
    def pending(cls, reason: str, node: str | None = None) -> ExecutorArtifactState:
        if not reason:
            raise ValueError("a pending artifact state needs a reason")
        return cls(ExecutorArtifactStateKind.PENDING, reason, node)


@dataclass(frozen=True, slots=True)
class ExecutorArtifactReport:
    """A provider's untrusted report for one executor, generation and readiness epoch; the session checks
    the echoed labels against its own state before acting on it."""

    provider: ExecutorArtifactProviderId
    executor: ExecutorInstanceId
    generation: ExecutorArtifactGeneration
    readiness: ExecutorArtifactReadinessEpoch
    state: ExecutorArtifactState


@runtime_checkable
class ExecutorArtifactUseGuard(Protocol):
    """Held from the final health check through the last launch that uses the artifacts."""

    def release(self) -> None: ...


@runtime_checkable
class ExecutorArtifactRequirementState(Protocol):
    """Provider-owned state the session keeps for a REQUIRED report; the same object answers while the
    artifact is active, retiring or retired, so a baked graph fails closed after teardown."""

    def acquire_use(self) -> ExecutorArtifactUseGuard: ...
