"""The process-wide memory governor: one budget per device and tier, shared by every session and provider.

A budget is a ledger, not an allocator. Whoever takes memory first reserves it here and gets a
:class:`~onnx_runtime.contract.residency.MemoryLease` (bytes charged to a holder for a role); releasing the lease
gives the bytes back. A reservation that does not fit raises :class:`MemoryBudgetError` naming the holder, the
shortfall and the holders that own the rest, so a model that does not fit fails at load time, where the session
charges its weights, rather than at an unrelated allocation later.

Releases a provider cannot settle at once (a stream-ordered free) are *deferred*: the lease stays charged until
the release is settled, either by :meth:`DeviceGovernor.wait_for_deferred_releases` or by a reservation that
would otherwise fail (it settles the deferred ones first, then retries).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable

from ..contract.residency import HolderId, MappedGrowthGrant, MemoryLease, MemoryRole, Tier
from ..errors import InvalidArgumentError, ProviderError
from ..records import Record

__all__ = ["DeviceGovernor", "MemoryBudgetError", "ProcessMemoryGovernor", "parse_byte_limit", "process_governor"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


class MemoryBudgetError(ProviderError):
    """A reservation does not fit its device's budget: the message names the holder, the shortfall and who
    holds the rest."""


def parse_byte_limit(value: str | int | float, key: str, total: int | None = None) -> int | None:
    """A byte count from ``value``: an integer with an optional unit (``512MiB``, ``2GB``), or a fraction in
    (0, 1] of ``total`` (the device's memory). "" and "0" mean unbounded (None). ``key`` names the setting in
    errors."""
    text = str(value).strip().lower().replace("_", "")
    if text in ("", "0", "none", "unbounded"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text)
    if match is None or match.group(2) not in _UNITS:
        raise InvalidArgumentError(
            f"{key} is {value!r}; give a byte count with an optional unit (e.g. 536870912, 512MiB, 2GB) or a "
            f"fraction of the device's memory between 0 and 1 (e.g. 0.5)")
    number, unit = float(match.group(1)), match.group(2)
    if unit == "" and 0 < number <= 1 and "." in match.group(1):
        if total is None:
            raise InvalidArgumentError(
                f"{key} is the fraction {value!r}, but this device does not report its total memory; give the "
                f"limit in bytes (e.g. 512MiB)")
        return max(1, int(number * total))
    if unit == "" and "." in match.group(1):
        raise InvalidArgumentError(f"{key} is {value!r}; a fraction must lie in (0, 1] and a byte count is whole "
                                   f"(e.g. 0.5, 536870912 or 512MiB)")
    return int(number * _UNITS[unit])


class _Deferred(Record):
    __match_args__ = ("lease", "settle")
    lease: MemoryLease
    settle: Callable[[], None]  # blocks until the release is done (e.g. a stream synchronize)

    def __init__(self, lease: MemoryLease, settle: Callable[[], None]) -> None:
        self.lease = lease
        self.settle = settle


class _Budget(Record):
    """One device tier's ledger."""

    __match_args__ = ("limit", "used", "high_water", "by_holder", "by_role", "deferred", "refused")
    limit: int | None
    used: int
    high_water: int
    by_holder: dict[HolderId, int]
    by_role: dict[MemoryRole, int]
    deferred: list[_Deferred]
    refused: int  # reservations refused for lack of budget

    def __init__(self,
                 limit: int | None = None, used: int = 0, high_water: int = 0,
                 by_holder: dict[HolderId, int] | None = None, by_role: dict[MemoryRole, int] | None = None,
                 deferred: list[_Deferred] | None = None, refused: int = 0) -> None:
        self.limit = limit
        self.used = used
        self.high_water = high_water
        self.by_holder = {} if by_holder is None else by_holder
        self.by_role = {} if by_role is None else by_role
        self.deferred = [] if deferred is None else deferred
        self.refused = refused


def _debit(budget: _Budget, holder: HolderId | None, role: MemoryRole, nbytes: int) -> None:
    budget.used -= nbytes
    if holder is not None:
        left = budget.by_holder.get(holder, 0) - nbytes
        if left > 0:
            budget.by_holder[holder] = left
        else:
            budget.by_holder.pop(holder, None)
    budget.by_role[role] = budget.by_role.get(role, 0) - nbytes


class ProcessMemoryGovernor:
    """Budgets by device key (``"cuda:0"``, ``"cpu:0"``) and tier. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._budgets: dict[tuple[str, Tier], _Budget] = {}
        self._totals: dict[tuple[str, Tier], int] = {}  # the memory devices reported having (fractional limits)
        # Leases of committed mapped growth, by (device, tier, role, holder), returned by release_mapped.
        self._mapped: dict[tuple[str, Tier, MemoryRole, HolderId], list[MemoryLease]] = {}

    def device(self, device: str) -> DeviceGovernor:
        """The view of one device a provider adopts (satisfies the contract's ``MemoryGovernor``)."""
        return DeviceGovernor(self, str(device))

    def _budget(self, device: str, tier: Tier) -> _Budget:
        key = (device, tier)
        budget = self._budgets.get(key)
        if budget is None:
            budget = self._budgets[key] = _Budget()
        return budget

    # -- limits -------------------------------------------------------------------------------------
    def set_limit(self, device: str, limit: int | None, tier: Tier = Tier.DEVICE) -> None:
        """Bound ``device``'s ``tier`` to ``limit`` bytes (None: unbounded). A limit below what is already
        charged is refused: those bytes are in use."""
        if limit is not None and limit < 0:
            raise InvalidArgumentError(f"the memory limit of {device} must be non-negative, got {limit}")
        with self._lock:
            budget = self._budget(device, tier)
            if limit is not None and budget.used > limit:
                self._settle_deferred(budget)
            if limit is not None and budget.used > limit:
                raise MemoryBudgetError(
                    f"cannot limit {device} ({tier.value}) to {limit} bytes: {budget.used} are already held "
                    f"({self._holders(budget)}); close those sessions first or choose a larger limit")
            budget.limit = limit

    def limit(self, device: str, tier: Tier = Tier.DEVICE) -> int | None:
        with self._lock:
            return self._budget(device, tier).limit

    def set_total(self, device: str, nbytes: int, tier: Tier = Tier.DEVICE) -> None:
        """Record the memory ``device`` has on ``tier`` (its provider reports it when it adopts the governor), so
        a limit can be given as a fraction of it."""
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidArgumentError(f"the total memory reported for {device} ({tier.value}) must be a positive "
                                       f"byte count, got {nbytes!r}")
        with self._lock:
            self._totals[(device, tier)] = nbytes

    def total(self, device: str, tier: Tier = Tier.DEVICE) -> int | None:
        """The memory ``device`` reported on ``tier``, or None when its provider has not said."""
        with self._lock:
            return self._totals.get((device, tier))

    # -- reservations -------------------------------------------------------------------------------
    def reserve(self, device: str, nbytes: int, tier: Tier, role: MemoryRole, holder: HolderId) -> MemoryLease:
        """Charge ``nbytes`` to ``holder``; raise :class:`MemoryBudgetError` when the budget cannot take them
        even after settling deferred releases."""
        if nbytes < 0:
            raise InvalidArgumentError(f"{holder} asked {device} for {nbytes} bytes; a reservation is non-negative")
        with self._lock:
            budget = self._budget(device, tier)
            if budget.limit is not None and budget.used + nbytes > budget.limit and budget.deferred:
                self._settle_deferred(budget)
            if budget.limit is not None and budget.used + nbytes > budget.limit:
                budget.refused += 1
                free = budget.limit - budget.used
                raise MemoryBudgetError(
                    f"{holder} needs {nbytes} bytes of {role.value} on {device} ({tier.value}) but only {free} of "
                    f"its {budget.limit}-byte budget are free: {nbytes - free} bytes short; held: "
                    f"{self._holders(budget)}. Raise the limit (session config 'session.memory_limit'), bound the "
                    f"weights with 'session.weight_residency_budget' so they are paged on demand, or close "
                    f"other sessions on the device")
            budget.used += nbytes
            budget.high_water = max(budget.high_water, budget.used)
            budget.by_holder[holder] = budget.by_holder.get(holder, 0) + nbytes
            budget.by_role[role] = budget.by_role.get(role, 0) + nbytes
        return MemoryLease(nbytes, tier, role, holder, on_release=lambda lease: self._credit(device, lease))

    def _credit(self, device: str, lease: MemoryLease) -> None:
        with self._lock:
            _debit(self._budget(device, lease.tier), lease.holder, lease.role, lease.nbytes)

    def grant(self, device: str, nbytes: int, role: MemoryRole, holder: HolderId,
              tier: Tier = Tier.DEVICE) -> MappedGrowthGrant:
        """Permission to map up to ``nbytes`` more for ``role``: reserved now; bytes committed under the grant
        stay charged to ``holder`` (returned by :meth:`release_mapped`), the unused rest returns on
        ``grant.release()``."""
        lease = self.reserve(device, nbytes, tier, role, holder)

        def settle(grant: MappedGrowthGrant) -> None:
            with self._lock:
                unused = grant.nbytes - grant.committed
                lease.nbytes -= unused
                _debit(self._budget(device, tier), holder, role, unused)
                if lease.nbytes:
                    self._mapped.setdefault((device, tier, role, holder), []).append(lease)
                else:
                    lease.release()  # nothing was mapped under it

        return MappedGrowthGrant(nbytes, role, on_release=settle)

    def release_mapped(self, device: str, nbytes: int, role: MemoryRole, holder: HolderId,
                       tier: Tier = Tier.DEVICE) -> None:
        """Return ``nbytes`` of mapped growth committed under ``holder``'s grants (after an unmap)."""
        with self._lock:
            leases = self._mapped.get((device, tier, role, holder), [])
            charged = sum(lease.nbytes for lease in leases)
            if nbytes > charged:
                raise InvalidArgumentError(
                    f"{holder} returns {nbytes} mapped bytes of {role.value} on {device}, but only {charged} were "
                    f"committed under its grants; return what was mapped, once")
            left = nbytes
            while left:
                lease = leases[-1]
                take = min(left, lease.nbytes)
                piece = MemoryLease(take, tier, role, holder, on_release=lambda part: self._credit(device, part))
                lease.nbytes -= take
                left -= take
                if lease.nbytes == 0:
                    leases.pop()
                    lease.release()  # now zero bytes: only marks it settled
                piece.release()

    def defer_release(self, device: str, lease: MemoryLease, settle: Callable[[], None]) -> None:
        """Keep ``lease`` charged until ``settle`` (which blocks until the provider's release is done) has run."""
        with self._lock:
            self._budget(device, lease.tier).deferred.append(_Deferred(lease, settle))

    def wait_for_deferred_releases(self, device: str | None = None) -> int:
        """Settle every deferred release (of ``device``, or all); returns the bytes given back."""
        freed = 0
        with self._lock:
            for (key, _), budget in list(self._budgets.items()):
                if device is None or key == device:
                    freed += self._settle_deferred(budget)
        return freed

    def _settle_deferred(self, budget: _Budget) -> int:
        freed = 0
        pending, budget.deferred = budget.deferred, []
        for index, item in enumerate(pending):
            try:
                item.settle()
            except BaseException:
                budget.deferred.extend(pending[index:])  # unsettled: still charged
                raise
            freed += item.lease.nbytes
            item.lease.release()
        return freed

    # -- reports ------------------------------------------------------------------------------------
    def _holders(self, budget: _Budget) -> str:
        if not budget.by_holder:
            return "nobody"
        return ", ".join(f"{holder} {nbytes} B" for holder, nbytes in
                         sorted(budget.by_holder.items(), key=lambda item: -item[1]))

    def snapshot(self) -> list[dict]:
        """Each budget: device, tier, limit, used, high-water mark, per holder and per role, deferred bytes."""
        with self._lock:
            return [{"device": device, "tier": tier.value, "limit": b.limit, "used": b.used,
                     "high_water": b.high_water, "refused": b.refused,
                     "deferred": sum(d.lease.nbytes for d in b.deferred),
                     "holders": {str(h): n for h, n in b.by_holder.items()},
                     "roles": {r.value: n for r, n in b.by_role.items() if n}}
                    for (device, tier), b in sorted(self._budgets.items(), key=lambda kv: (kv[0][0], kv[0][1].value))]

    def high_water(self, device: str, tier: Tier = Tier.DEVICE) -> int:
        with self._lock:
            return self._budget(device, tier).high_water

    def used(self, device: str, tier: Tier = Tier.DEVICE) -> int:
        with self._lock:
            return self._budget(device, tier).used

    def reset_high_water(self, device: str, tier: Tier = Tier.DEVICE) -> None:
        with self._lock:
            budget = self._budget(device, tier)
            budget.high_water = budget.used


class DeviceGovernor:
    """One device's budgets: what ``adopt_memory_governor`` hands a provider (the contract's
    ``MemoryGovernor`` protocol: ``reserve`` and ``available``) plus grants and deferred releases."""

    __slots__ = ("process", "device")

    def __init__(self, process: ProcessMemoryGovernor, device: str) -> None:
        self.process = process
        self.device = device

    def reserve(self, nbytes: int, tier: Tier, role: MemoryRole, holder: HolderId) -> MemoryLease:
        return self.process.reserve(self.device, nbytes, tier, role, holder)

    def set_total(self, nbytes: int, tier: Tier = Tier.DEVICE) -> None:
        """The provider reports the device's memory (e.g. ``cuDeviceTotalMem``): limits may then be fractions."""
        self.process.set_total(self.device, nbytes, tier)

    def total(self, tier: Tier = Tier.DEVICE) -> int | None:
        return self.process.total(self.device, tier)

    def available(self, tier: Tier) -> int:
        """Unclaimed bytes of ``tier`` (a very large number when it is unbounded)."""
        limit = self.process.limit(self.device, tier)
        if limit is None:
            return 1 << 62
        return max(0, limit - self.process.used(self.device, tier))

    def grant(self, nbytes: int, role: MemoryRole, holder: HolderId) -> MappedGrowthGrant:
        return self.process.grant(self.device, nbytes, role, holder)

    def release_mapped(self, nbytes: int, role: MemoryRole, holder: HolderId) -> None:
        self.process.release_mapped(self.device, nbytes, role, holder)

    def defer_release(self, lease: MemoryLease, settle: Callable[[], None]) -> None:
        self.process.defer_release(self.device, lease, settle)

    def wait_for_deferred_releases(self) -> int:
        return self.process.wait_for_deferred_releases(self.device)

    def __repr__(self) -> str:
        return f"DeviceGovernor({self.device})"


_PROCESS = ProcessMemoryGovernor()


def process_governor() -> ProcessMemoryGovernor:
    """The one governor of this process: every session and provider charges it."""
    return _PROCESS
