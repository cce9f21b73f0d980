"""Every device allocation a session's provider handle makes, charged to the governor.

:class:`DeviceAccount` sits in ``ProviderHandle.allocate``/``deallocate``: it reserves the bytes before the
provider allocates (so a run that would pass the device's budget fails with the governor's error naming the
holder, before the driver is asked) and releases them once the buffer is freed. When the provider's releases
are deferred (it implements ``wait_for_deferred_releases``), the bytes stay charged until the governor settles
them. Allocations already paid for by a lease (weights under the load-time WEIGHTS lease) are made inside
:meth:`DeviceAccount.prepaid` and not charged twice. Each charge is attributed to the first caller outside the
allocation path (its file and line): the allocation-site statistics of ``onnx-runtime info --memory``.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
from collections.abc import Iterator

from ..contract.residency import HolderId, MemoryLease, MemoryRole, RawDeviceAllocationSiteStats, Tier
from .activations import HostActivations
from .governor import DeviceGovernor, MemoryBudgetError

__all__ = ["DeviceAccount"]

_CORE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Frames of the allocation path itself: the site is the first frame outside them.
_PATH_FILES = frozenset(os.path.join(_CORE, name) for name in ("tensor.py", "provider_handle.py"))


_HERE = os.path.dirname(os.path.abspath(__file__))
CHUNK = 1 << 20  # the account reserves from the governor in steps of this much, so most allocations never lock it
SITE_EXACT_BYTES = 64 << 10  # allocations this large are always attributed to their site
SITE_SAMPLE = 16  # one in this many smaller allocations is attributed, standing for this many


def _site() -> tuple[str, int]:
    frame = sys._getframe(2)  # noqa: SLF001 (the documented way to walk the caller's frames cheaply)
    while frame is not None and (frame.f_code.co_filename in _PATH_FILES or frame.f_code.co_filename.startswith(_HERE)):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>", 0
    return frame.f_code.co_filename, frame.f_lineno


def _held_here(lock) -> bool:
    """Whether the calling thread holds the reentrant ``lock`` (what threading.Condition asks it too)."""
    return lock._is_owned()  # noqa: SLF001


class DeviceAccount:
    """Charges one provider handle's allocations to ``governor`` for ``holder`` (see the module docstring).

    The account holds leases of at least :data:`CHUNK` bytes and charges buffers against them, reserving more
    only when they run out (exactly what is missing when a chunk no longer fits the budget) and giving the
    slack back once it passes two chunks or nothing is live. A provider with deferred releases gets one lease
    per buffer instead, kept charged until the governor settles the release."""

    def __init__(self, handle, governor: DeviceGovernor, holder: HolderId,
                 role: MemoryRole = MemoryRole.ACTIVATIONS, tier: Tier = Tier.DEVICE):
        self.handle = handle
        self.governor = governor
        self.holder = holder
        self.role = role
        self.tier = tier  # DEVICE for a device's memory; HOST for a host provider's allocator (the seed's Tier::Host)
        self._sizes: dict[int, int] = {}  # id(buffer) -> bytes charged for it
        self._leases: list[MemoryLease] = []  # what the account holds from the governor
        self._held = 0  # their bytes
        self._used = 0  # bytes charged to live buffers
        self.peak = 0  # the most bytes live buffers held at once (exact, unlike the governor's chunked view)
        # Deferred providers: id(buffer) -> its own leases (its allocation's, then one per committed growth).
        self._buffer_leases: dict[int, list[MemoryLease]] = {}
        self._local = threading.local()
        # Reentrant: a collection may run a finalizer (Tensor.__del__) that releases a buffer while this thread is
        # inside the lock; ``released`` keeps such a release for the thread's next call instead of waiting on itself.
        self._lock = threading.RLock()
        self._released_inside: collections.deque = collections.deque()
        self._sites: dict[tuple[str, int], list[int]] = {}  # site -> [requests, bytes]
        self._small = 0  # allocations below SITE_EXACT_BYTES so far: every SITE_SAMPLE-th is attributed
        self._deferred = bool(handle.implements("wait_for_deferred_releases"))
        self._closed: bool = False
        # A host provider's account: the session's lease for its plans' activations (memory/activations.py).
        self.activations: HostActivations | None = None

    @contextlib.contextmanager
    def prepaid(self) -> Iterator[None]:
        """Allocations in this block (on this thread) are paid for already and not charged."""
        depth = getattr(self._local, "prepaid", 0)
        self._local.prepaid = depth + 1
        try:
            yield
        finally:
            self._local.prepaid = depth

    def allocate(self, size: int, alignment: int):
        """``ProviderHandle.allocate`` under the budget: charge, allocate, remember the charge by buffer."""
        if self._closed or getattr(self._local, "prepaid", 0) > 0:
            return self.handle.allocate_unaccounted(size, alignment)
        lease = self._charge(size)
        try:
            buffer = self.handle.allocate_unaccounted(size, alignment)
        except BaseException:
            self._refund(size, lease)
            raise
        self._record(buffer, size, lease)
        return buffer

    def allocate_committed(self, size: int, alignment: int, committed_ranges):
        """``ProviderHandle.allocate_committed`` under the budget: the bytes the provider committed
        (``allocation_committed_bytes``: all of it for an eager allocation or a pool buffer) are charged, unless
        the provider charges them itself (``allocation_charged_by_provider``: mapped growth under grants).
        What a provider commits for given ranges is its own choice (whole, one granule, the ranges rounded up),
        so the charge follows the allocation; when the budget refuses it the buffer is freed before the error
        propagates."""
        hook = self.handle.hook
        buffer = self.handle.allocate_committed_unaccounted(size, alignment, committed_ranges)
        if self._closed or getattr(self._local, "prepaid", 0) > 0 or hook.allocation_charged_by_provider(
                buffer=buffer):
            return buffer
        committed = int(hook.allocation_committed_bytes(buffer=buffer))
        try:
            lease = self._charge(committed)
        except BaseException:
            self.handle.deallocate(buffer)  # not recorded yet: nothing is refunded twice
            raise
        self._record(buffer, committed, lease)
        return buffer

    def recharge(self, buffer, undo) -> None:
        """After a commit or decommit of ``buffer``'s ranges: charge its committed bytes anew. A growth the
        budget refuses is undone (``undo()``, the provider's decommit back to the old size, where it has one)
        and the governor's error propagates."""
        with self._lock:
            size = self._sizes.get(id(buffer))
            leases = self._buffer_leases.get(id(buffer))
        if size is None and leases is None:
            return  # not charged here: allocated before the account, prepaid, or charged by the provider
        committed = int(self.handle.hook.allocation_committed_bytes(buffer=buffer))
        try:
            if size is not None:
                self._recharge_pooled(buffer, size, committed)
            elif leases is not None:
                self._recharge_leases(leases, committed)
        except MemoryBudgetError:
            try:
                undo()
            except Exception:  # noqa: BLE001 (the budget error is what the caller must see)
                pass
            raise

    def _recharge_pooled(self, buffer, size: int, committed: int) -> None:
        with self._lock:
            if committed > size and self._used + committed - size > self._held:
                self._grow(self._used + committed - size - self._held)
            self._used += committed - size
            self.peak = max(self.peak, self._used)
            self._sizes[id(buffer)] = committed
            self._trim()

    def _recharge_leases(self, leases: list[MemoryLease], committed: int) -> None:
        """A deferred-release provider's buffer: a growth takes a lease of its own; a shrink gives back the
        growth leases wholly above the new size (their release deferred like the buffer's)."""
        held = sum(lease.nbytes for lease in leases)
        if committed > held:
            lease = self.governor.reserve(committed - held, self.tier, self.role, self.holder)
            with self._lock:
                leases.append(lease)
            return
        hook = self.handle.hook
        while len(leases) > 1 and held - leases[-1].nbytes >= committed:
            with self._lock:
                lease = leases.pop()
            held -= lease.nbytes
            self.governor.defer_release(lease, lambda: hook.wait_for_deferred_releases())

    def _charge(self, size: int) -> MemoryLease | None:
        """Charge ``size`` bytes: a lease of its own for a deferred-release provider, else against the chunks."""
        if self._released_inside:
            self._release_kept()
        if self._deferred:
            return self.governor.reserve(size, self.tier, self.role, self.holder)
        with self._lock:
            if self._used + size > self._held:
                self._grow(self._used + size - self._held)
            self._used += size
            if self._used > self.peak:
                self.peak = self._used
        return None

    def _refund(self, size: int, lease: MemoryLease | None) -> None:
        if lease is not None:
            lease.release()
            return
        with self._lock:
            self._used -= size
            self._trim()

    def _record(self, buffer, size: int, lease: MemoryLease | None) -> None:
        """Remember the charge by buffer and attribute it (or a sample of the small ones) to its site."""
        weight = 1
        if size < SITE_EXACT_BYTES:
            weight = SITE_SAMPLE if self._small % SITE_SAMPLE == 0 else 0
            self._small += 1  # a lost increment between threads only shifts which allocation is sampled
        site = _site() if weight else None
        with self._lock:
            if lease is not None:
                self._buffer_leases[id(buffer)] = [lease]
            else:
                self._sizes[id(buffer)] = size
            if site is not None:
                counts = self._sites.get(site)
                if counts is None:
                    counts = self._sites[site] = [0, 0]
                counts[0] += weight
                counts[1] += weight * size

    def _grow(self, missing: int) -> None:
        try:
            lease = self.governor.reserve(max(missing, CHUNK), self.tier, self.role, self.holder)
        except MemoryBudgetError:
            if missing >= CHUNK:
                raise
            lease = self.governor.reserve(missing, self.tier, self.role, self.holder)  # the budget's last bytes
        self._leases.append(lease)
        self._held += lease.nbytes

    def _trim(self) -> None:
        if self._used == 0:
            leases, self._leases, self._held = self._leases, [], 0
            for lease in leases:
                lease.release()
            return
        while self._leases and self._held - self._used >= 2 * CHUNK and \
                self._held - self._leases[-1].nbytes >= self._used:
            lease = self._leases.pop()
            self._held -= lease.nbytes
            lease.release()

    def released(self, buffer) -> None:
        """The buffer was freed (or its release was accepted): give its bytes back, or defer that."""
        if _held_here(self._lock):  # a finalizer run by a collection inside this thread's section: kept for later
            self._released_inside.append(buffer)
            return
        if self._released_inside:
            self._release_kept()
        self._release(buffer)

    def _release_kept(self) -> None:
        """The releases ``released`` kept while their thread was inside the lock."""
        while self._released_inside and not _held_here(self._lock):
            try:
                buffer = self._released_inside.popleft()
            except IndexError:  # another thread took the last one
                return
            self._release(buffer)

    def _release(self, buffer) -> None:
        with self._lock:
            size = self._sizes.pop(id(buffer), None)
            if size is not None:
                self._used -= size
                self._trim()
                self._detach_if_settled()
                return
            leases = self._buffer_leases.pop(id(buffer), ())
            self._detach_if_settled()
        hook = self.handle.hook
        for lease in leases:
            self.governor.defer_release(lease, lambda: hook.wait_for_deferred_releases())

    @property
    def charged(self) -> int:
        """Bytes charged to buffers still live."""
        if self._released_inside:
            self._release_kept()
        with self._lock:
            return self._used + sum(lease.nbytes for leases in self._buffer_leases.values() for lease in leases)

    def site_stats(self) -> list[RawDeviceAllocationSiteStats]:
        with self._lock:
            return [RawDeviceAllocationSiteStats(file, line, requests=n, requested_bytes=b)
                    for (file, line), (n, b) in sorted(self._sites.items(), key=lambda item: -item[1][1])]

    def close(self) -> None:
        """Stop charging (the session is closed); buffers still live (tensors the caller allocated through the
        session's handle) keep their charge until freed, so the account stays on the handle until then."""
        if self._released_inside:
            self._release_kept()
        with self._lock:
            self._closed = True
            self._trim()
            self._detach_if_settled()

    def _detach_if_settled(self) -> None:
        """A closed account with nothing live leaves the handle (called under the lock)."""
        if self._closed and self._used == 0 and not self._buffer_leases and self.handle.memory_account is self:
            self.handle.memory_account = None
