"""Value types of the memory-governance and weight-residency hooks (contract/memory_hookspecs.py).

The seed's governor hands out *leases* (bytes charged to a holder on a tier, for one role) and
*mapped-growth grants* (bytes a provider may newly map while growing an allocation). A workspace is a
buffer together with the lease that paid for it. A provider that holds no standing pool and no
governor never sees these types: every hook that uses them has a default that answers "nothing
governed, nothing resident".

A lease whose buffer could not be freed is not released: it is kept in a process-wide quarantine
(:func:`quarantined_workspace_leases`), so the bytes stay charged rather than being handed out twice.
"""

from __future__ import annotations

import enum
import itertools
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ..errors import InvalidArgumentError, ProviderError
from ..records import FrozenRecord, Record

if TYPE_CHECKING:
    from ..devices import DeviceId
    from .buffers import DeviceBuffer, Fence, HostBytes


class MemoryRole(enum.Enum):
    """What a charged allocation holds; it decides its lifetime and which budget pays for it."""

    WEIGHTS = "weights"  # initializers and sealed constants: live as long as the model
    KV_CACHE = "kv_cache"  # growing decode state: mapped on demand
    ACTIVATIONS = "activations"  # intermediate values of one run
    WORKSPACE = "workspace"  # kernel scratch owned by an executor
    STAGING = "staging"  # pinned host memory for uploads and paging


class Tier(enum.Enum):
    """Which memory a budget divides: the device's own, or host memory standing in for it."""

    DEVICE = "device"
    PINNED_HOST = "pinned_host"
    HOST = "host"


_holder_ids = itertools.count(1)


class HolderId(FrozenRecord):
    """Who holds governed bytes (a session, a provider's residency cache, a KV pool); named in errors."""

    __slots__ = __match_args__ = ("label", "id")
    label: str
    id: int

    def __init__(self, label: str, id: int | None = None) -> None:
        object.__setattr__(self, "label", label)
        object.__setattr__(self, "id", next(_holder_ids) if id is None else id)

    def __str__(self) -> str:
        return f"{self.label}#{self.id}"


class MemoryLease:
    """Bytes charged to ``holder`` on ``tier`` for ``role``. ``release`` gives them back exactly once;
    ``on_release`` is the governor's callback (None for a lease no governor tracks)."""

    __slots__ = ("nbytes", "tier", "role", "holder", "_on_release", "_released", "_lock")

    def __init__(self, nbytes: int, tier: Tier, role: MemoryRole, holder: HolderId | None = None,
                 on_release: Callable[[MemoryLease], None] | None = None) -> None:
        if nbytes < 0:
            raise InvalidArgumentError(f"a memory lease needs a non-negative size, got {nbytes}")
        self.nbytes = nbytes
        self.tier = tier
        self.role = role
        self.holder = holder
        self._on_release = on_release
        self._released = False
        self._lock = threading.Lock()

    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        """Give the bytes back to the governor; a second call is a no-op (the first one settled it)."""
        with self._lock:
            if self._released:
                return
            self._released = True
            callback, self._on_release = self._on_release, None
        if callback is not None:
            callback(self)

    def __repr__(self) -> str:
        state = " released" if self._released else ""
        return f"MemoryLease({self.nbytes} B, {self.tier.value}, {self.role.value}, holder={self.holder}{state})"


class MappedGrowthGrant:
    """Permission to map up to ``nbytes`` more physical memory for ``role``. A provider commits what it
    actually mapped (``commit_bytes``); ``release`` returns the unused rest of the grant."""

    __slots__ = ("nbytes", "role", "committed", "_on_release", "_released")

    def __init__(self, nbytes: int, role: MemoryRole,
                 on_release: Callable[[MappedGrowthGrant], None] | None = None) -> None:
        if nbytes < 0:
            raise InvalidArgumentError(f"a mapped-growth grant needs a non-negative size, got {nbytes}")
        self.nbytes = nbytes
        self.role = role
        self.committed = 0
        self._on_release = on_release
        self._released = False

    @property
    def remaining(self) -> int:
        return self.nbytes - self.committed

    def commit_bytes(self, nbytes: int) -> None:
        """Record ``nbytes`` newly mapped under this grant; more than the grant allows is an error."""
        if self._released:
            raise ProviderError("this mapped-growth grant was already released; prepare a new one")
        if nbytes < 0 or nbytes > self.remaining:
            raise ProviderError(
                f"mapping {nbytes} bytes of {self.role.value} exceeds the mapped-growth grant "
                f"({self.remaining} of {self.nbytes} bytes left); prepare_mapped_growth for the full size")
        self.committed += nbytes

    def release(self) -> None:
        if not self._released:
            self._released = True
            if self._on_release is not None:
                self._on_release(self)


@runtime_checkable
class MemoryGovernor(Protocol):
    """The process-wide ledger a provider joins with ``adopt_memory_governor``."""

    def reserve(self, nbytes: int, tier: Tier, role: MemoryRole, holder: HolderId) -> MemoryLease:
        """Charge ``nbytes``; raise a :class:`ProviderError` naming the holder and the shortfall."""
        ...

    def available(self, tier: Tier) -> int:
        """Bytes still unclaimed on ``tier``."""
        ...


class WorkspaceAllocation(Record):
    """Executor workspace: the buffer and the compatibility lease that paid for it (None when the
    provider's allocator charges the governor itself)."""

    __slots__ = __match_args__ = ("buffer", "lease")
    buffer: DeviceBuffer
    lease: MemoryLease | None

    def __init__(self, buffer: DeviceBuffer, lease: MemoryLease | None = None) -> None:
        self.buffer = buffer
        self.lease = lease

    def into_parts(self) -> tuple[DeviceBuffer, MemoryLease | None]:
        return self.buffer, self.lease

    @property
    def size(self) -> int:
        return self.buffer.size


_QUARANTINE_LOCK = threading.Lock()
_QUARANTINED_LEASES: list[MemoryLease] = []


def quarantine_failed_workspace_lease(lease: MemoryLease, provider: str) -> None:
    """Keep the lease of a workspace whose release failed: its bytes were never proven free, so they
    stay charged instead of being granted twice."""
    print(f"{provider}: workspace deallocation failed before the release was proven; keeping its "
          f"{lease.nbytes}-byte {lease.role.value} lease in quarantine", file=sys.stderr)
    with _QUARANTINE_LOCK:
        _QUARANTINED_LEASES.append(lease)


def quarantined_workspace_leases() -> list[MemoryLease]:
    """The leases kept by :func:`quarantine_failed_workspace_lease` (a copy)."""
    with _QUARANTINE_LOCK:
        return list(_QUARANTINED_LEASES)


class RawDeviceAllocationSiteStats(FrozenRecord):
    """Device allocations made outside the ``allocate`` hook, attributed to their source site."""

    __slots__ = __match_args__ = ("file", "line", "requests", "requested_bytes",
                                  "driver_allocations", "driver_bytes", "pool_hits", "pool_hit_bytes")
    file: str
    line: int
    requests: int
    requested_bytes: int
    driver_allocations: int
    driver_bytes: int
    pool_hits: int
    pool_hit_bytes: int

    def __init__(self,
                 file: str, line: int, requests: int = 0, requested_bytes: int = 0, driver_allocations: int = 0,
                 driver_bytes: int = 0, pool_hits: int = 0, pool_hit_bytes: int = 0) -> None:
        object.__setattr__(self, "file", file)
        object.__setattr__(self, "line", line)
        object.__setattr__(self, "requests", requests)
        object.__setattr__(self, "requested_bytes", requested_bytes)
        object.__setattr__(self, "driver_allocations", driver_allocations)
        object.__setattr__(self, "driver_bytes", driver_bytes)
        object.__setattr__(self, "pool_hits", pool_hits)
        object.__setattr__(self, "pool_hit_bytes", pool_hit_bytes)


# -- identity, staging, sealed constants ----------------------------------------------------------
class ExecutionProviderCapabilities(FrozenRecord):
    """What an executor may hand the provider beyond resident tensors. Stock providers advertise none."""

    __slots__ = __match_args__ = ("lazy_weight_inputs",)
    lazy_weight_inputs: bool  # kernels accept a PagedWeight in place of a resident initializer

    def __init__(self, lazy_weight_inputs: bool = False) -> None:
        object.__setattr__(self, "lazy_weight_inputs", lazy_weight_inputs)

    @classmethod
    def stock(cls) -> ExecutionProviderCapabilities:
        return cls()


class ProviderContextIdentity(FrozenRecord):
    """The provider memory context (e.g. a CUDA context) that owns sealed constants."""

    __slots__ = __match_args__ = ("provider", "context")
    provider: str
    context: int

    def __init__(self, provider: str, context: int) -> None:
        object.__setattr__(self, "provider", provider)
        object.__setattr__(self, "context", context)


@runtime_checkable
class SealedDeviceAllocation(Protocol):
    """Immutable provider-owned device memory holding a graph constant, shared by every session of the
    model on that context; a kernel checks both identities before using it."""

    @property
    def ptr(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def device(self) -> DeviceId: ...

    @property
    def provider_context(self) -> ProviderContextIdentity: ...

    @property
    def runtime_identity(self) -> int: ...

    def release(self) -> None:
        """Free the memory (the core's registry calls it once, when no session holds the constant)."""
        ...


@runtime_checkable
class HostToDeviceCopier(Protocol):
    """A synchronous uploader an executor keeps (without the provider) to stage host inputs: on return
    the bytes are resident at ``dst_ptr``, which must be a live allocation of at least ``len(src)``."""

    def copy_host_to_device(self, src: HostBytes, dst_ptr: int) -> None: ...


# -- lazy weights -----------------------------------------------------------------------------------
class LazyWeight(FrozenRecord):
    """An initializer left in its file: ``nbytes`` at ``offset`` of the region source."""

    __slots__ = __match_args__ = ("name", "offset", "nbytes", "dtype", "shape")
    name: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]

    def __init__(self, name: str, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "offset", offset)
        object.__setattr__(self, "nbytes", nbytes)
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", shape)


@runtime_checkable
class MmapRegionSource(Protocol):
    """Read-only access to memory-mapped model bytes (the model file or its external data)."""

    def region(self, offset: int, nbytes: int) -> memoryview: ...


class PagedWeight(Record):
    """A lazy weight made resident: the executor substitutes ``buffer`` for the initializer and keeps
    this object for the kernel's lifetime; ``fence`` orders the kernel after the upload."""

    __slots__ = __match_args__ = ("key", "buffer", "fence")
    key: int
    buffer: DeviceBuffer
    fence: Fence | None

    def __init__(self, key: int, buffer: DeviceBuffer, fence: Fence | None = None) -> None:
        self.key = key
        self.buffer = buffer
        self.fence = fence


class RoutedResidencyRequirement(enum.Enum):
    """What a mixture-of-experts dispatch can prove about its routing before launch."""

    FUSED_ROUTING_UNKNOWN = "fused_routing_unknown"  # the routed experts are chosen on the device


# Weight name -> the byte ranges of that weight's expert regions.
WeightRegionCatalog = Mapping[str, Sequence[tuple[int, int]]]


@runtime_checkable
class RoutedResidencyGuard(Protocol):
    """Kept alive by the executor for a kernel's lifetime; ``release`` lets the residency go."""

    def release(self) -> None: ...
