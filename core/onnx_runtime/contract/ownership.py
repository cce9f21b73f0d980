"""Bound and managed buffer ownership: the seed's generation-checked alternative to a raw owned address.

A raw owned :class:`DeviceBuffer` trusts its provider to pair it with exactly one free. A *bound* buffer
carries the :class:`OwningAllocation` its :class:`AllocationBinding` issued: the binding's identity and the
allocation's generation. Release goes back through the binding, which refuses a foreign or stale owner, so
a handle kept past its free cannot release a later allocation that reused the address. A *managed*
allocation adds a settlement the provider signals when a deferred release has completed.

An allocation whose release failed is never reported free: the binding keeps it in quarantine with its
bytes still counted (:meth:`AllocationBinding.quarantined`) until the owner of the device reclaims it.
The owner travels in the buffer's ``provider_state``; :func:`bound_buffer` and :func:`into_bound_owner`
are the two ends.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from ..errors import InvalidArgumentError
from .buffers import DeviceBuffer, Ownership

if TYPE_CHECKING:
    from ..devices import DeviceId

_binding_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class OwningAllocation:
    """One allocation as its binding issued it; release is validated against ``binding`` and ``generation``."""

    binding: int
    generation: int
    ptr: int
    size: int
    alignment: int


@dataclass(slots=True)
class ManagedAllocation:
    """An owning allocation whose release the provider settles later (after a device fence)."""

    owner: OwningAllocation
    settled: threading.Event = field(default_factory=threading.Event)

    def settlement_wait(self, timeout: float | None = None) -> bool:
        """Wait for the release to settle; False when ``timeout`` passed first."""
        return self.settled.wait(timeout)


BoundBufferOwnership = OwningAllocation | ManagedAllocation


def owner_of(ownership: BoundBufferOwnership) -> OwningAllocation:
    return ownership.owner if isinstance(ownership, ManagedAllocation) else ownership


@dataclass(frozen=True, slots=True)
class QuarantineRecord:
    owner: OwningAllocation
    retained_bytes: int
    reason: str


class AllocationBinding:
    """Issues owning allocations for one provider memory context and validates their release."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.id = next(_binding_ids)
        self._generations = itertools.count(1)
        self._live: dict[int, int] = {}  # ptr -> generation of the live allocation there
        self._quarantine: list[QuarantineRecord] = []
        self._lock = threading.Lock()

    def issue(self, ptr: int, size: int, alignment: int) -> OwningAllocation:
        """Record a new allocation at ``ptr`` (a fresh generation even when the address is reused)."""
        if not ptr:
            raise InvalidArgumentError(f"{self.label}: an owning allocation needs a non-null address")
        with self._lock:
            if ptr in self._live:
                raise InvalidArgumentError(
                    f"{self.label}: address {ptr:#x} is already live; free it before issuing it again")
            owner = OwningAllocation(self.id, next(self._generations), ptr, size, alignment)
            self._live[ptr] = owner.generation
        return owner

    def is_live(self, owner: OwningAllocation) -> bool:
        with self._lock:
            return owner.binding == self.id and self._live.get(owner.ptr) == owner.generation

    def release(self, ownership: BoundBufferOwnership, free: Callable[[OwningAllocation], None]) -> None:
        """Validate the owner, then ``free`` it. A foreign or stale owner is refused without freeing; when
        ``free`` raises, the allocation is quarantined (its bytes stay counted) and the error propagates."""
        owner = owner_of(ownership)
        with self._lock:
            if owner.binding != self.id:
                raise InvalidArgumentError(
                    f"{self.label}: the allocation at {owner.ptr:#x} was issued by another binding "
                    f"(#{owner.binding}); release it through the provider that allocated it")
            if self._live.get(owner.ptr) != owner.generation:
                raise InvalidArgumentError(
                    f"{self.label}: stale release of the allocation at {owner.ptr:#x} (generation "
                    f"{owner.generation} was already freed); every allocation is freed exactly once")
            del self._live[owner.ptr]
        try:
            free(owner)
        except BaseException as exc:
            with self._lock:
                self._quarantine.append(QuarantineRecord(owner, owner.size, f"{type(exc).__name__}: {exc}"))
            raise
        if isinstance(ownership, ManagedAllocation):
            ownership.settled.set()

    def quarantined(self) -> list[QuarantineRecord]:
        with self._lock:
            return list(self._quarantine)

    def quarantined_bytes(self) -> int:
        with self._lock:
            return sum(record.retained_bytes for record in self._quarantine)

    def reclaim_quarantined(self, free: Callable[[OwningAllocation], None]) -> int:
        """Retry the release of every quarantined allocation; returns how many were freed (the rest stay)."""
        with self._lock:
            records, self._quarantine = self._quarantine, []
        freed = 0
        for record in records:
            try:
                free(record.owner)
                freed += 1
            except Exception:
                with self._lock:
                    self._quarantine.append(record)
        return freed


def bound_buffer(ownership: BoundBufferOwnership, device: DeviceId, host: np.ndarray | None = None) -> DeviceBuffer:
    """A buffer describing exactly the region its owner names, carrying the owner for release."""
    owner = owner_of(ownership)
    return DeviceBuffer(device, owner.size, max(owner.alignment, 1), owner.ptr, Ownership.OWNED, host=host,
                        provider_state=ownership)


def is_bound(buffer: DeviceBuffer) -> bool:
    return isinstance(buffer.provider_state, OwningAllocation | ManagedAllocation)


def into_bound_owner(buffer: DeviceBuffer) -> BoundBufferOwnership | None:
    """The owner a bound buffer carries (what a provider's ``deallocate`` releases), None for a raw or
    borrowed buffer, which the generation-checked path refuses without losing it."""
    state = buffer.provider_state
    if buffer.is_borrowed or not isinstance(state, OwningAllocation | ManagedAllocation):
        return None
    return state
