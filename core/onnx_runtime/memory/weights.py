"""A session's weights on a device: charged to the governor at load time, and, under a weight-residency budget,
paged in on first use and evicted by the plan's order.

Unbounded (no budget), every weight a device node reads is uploaded once when the plan is made, under one
WEIGHTS lease reserved for all of them first, so a model that does not fit fails at load with the governor's
error. With ``session.weight_residency_budget``, the lease is the budget: the executor plans a *page step*
before each node that reads a weight, which returns the resident tensor or uploads it from the host array
(memory-mapped external data, so the host reads only the pages it copies), evicting first the weight the plan
needs again last among those no value of the run still holds. The next node's weights are prefetched (the
kernel's read-ahead of the mapped pages, and the provider's ``prefetch_lazy_weight``) while this one runs.
A weight another session sealed on the device (memory/sealed.py) is read from its sealed constant instead.

A provider that keeps its own residency cache answers ``page_lazy_weight``; the core then asks it for every
page and keeps no copy of its own.
"""

from __future__ import annotations

import bisect
import sys
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterable

import numpy as np

from ..contract.residency import HolderId, LazyWeight, MemoryLease, MemoryRole, PagedWeight, Tier
from ..dtypes import DataType
from ..errors import InvalidArgumentError
from ..tensor import Tensor
from .accounts import DeviceAccount
from .governor import DeviceGovernor, MemoryBudgetError
from .mapped import mapped_region
from .sealed import SealedWeights, provider_seals

__all__ = ["WeightResidency", "weight_bytes"]


def weight_bytes(array: np.ndarray) -> int:
    """Bytes a weight takes on a device (at least one, as an empty tensor's buffer)."""
    return max(int(np.asarray(array).nbytes), 1)


class _HostSource:
    """The contract's ``MmapRegionSource`` over a weight that lives in memory (not mapped from a file)."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray) -> None:
        self.array = np.ascontiguousarray(array)

    def region(self, offset: int, nbytes: int) -> memoryview:
        return self.array.reshape(-1).view(np.uint8).data[offset:offset + nbytes]


class WeightResidency:
    """The weights of one session's nodes on one device provider (see the module docstring)."""

    def __init__(self, handle, governor: DeviceGovernor, account: DeviceAccount | None, holder: HolderId,
                 weights: dict[str, np.ndarray], budget: int | None, node_sets: Iterable[tuple[str, ...]] = ()):
        self.handle = handle
        self.governor = governor
        self.account = account
        self.holder = holder
        self.budget = budget
        self._arrays = weights
        self._sizes = {name: weight_bytes(array) for name, array in weights.items()}
        self._resident: OrderedDict[str, Tensor] = OrderedDict()
        self._resident_bytes = 0
        self._lock = threading.RLock()
        self._order: list[str] = []  # weights in the order page steps were planned: the prefetch lookahead
        self._next: dict[str, str] = {}
        self._uses: dict[str, list[int]] = {}  # weight -> its positions in _order
        self._cursor = 0  # the position in _order of the page step running now
        self.pages = self.evictions = self.prefetches = 0
        self.paged_bytes = 0
        self.high_water = 0
        total = sum(self._sizes.values())
        if budget is None:
            need = total
        else:
            widest = max((sum(self._sizes[n] for n in set(names) if n in self._sizes) for names in node_sets),
                         default=0)
            if widest > budget:
                raise MemoryBudgetError(
                    f"{holder}: one node of the model reads {widest} bytes of weights at once on {governor.device}, "
                    f"more than the weight-residency budget of {budget} bytes; raise "
                    f"'session.weight_residency_budget' to at least {widest}")
            need = min(budget, total)
        self._provider_pages = bool(handle.implements("page_lazy_weight"))
        self.sealed: SealedWeights | None = None
        self._sealed_keys: dict[str, tuple] = {}
        if budget is None and not self._provider_pages and provider_seals(handle):
            # Shared with every session of the model on this device: only the constants no session sealed yet
            # need room, and the registry charges them once (memory/sealed.py).
            self.sealed = SealedWeights(handle, governor)
            self._sealed_keys = {name: self.sealed.key(array) for name, array in weights.items()}
            need = sum(self._sizes[n] for n, key in self._sealed_keys.items() if not self.sealed.is_sealed(key))
            governor.reserve(need, Tier.DEVICE, MemoryRole.WEIGHTS, holder).release()  # fails at load if short
            need = 0
        # A paged session seals nothing (sealed constants stay outside its budget), but it reads the constants
        # another session of the model sealed on the device instead of paging copies of its own.
        self._shared: SealedWeights | None = None
        self._borrowed: dict[str, Tensor] = {}
        self._shared_keys: dict[str, tuple] = {}
        if budget is not None and not self._provider_pages and provider_seals(handle):
            self._shared = SealedWeights(handle, governor)
        # Admission at load time: the whole need, before anything is uploaded.
        self.lease: MemoryLease | None = governor.reserve(need, Tier.DEVICE, MemoryRole.WEIGHTS, holder)
        self.reserved = need

    # -- what the executor asks -----------------------------------------------------------------------
    @property
    def paged(self) -> bool:
        """Whether weights are paged per node (a budget below the weights, or the provider's own cache)."""
        return self._provider_pages or (self.budget is not None and self.budget < sum(self._sizes.values()))

    def upload(self, name: str, array: np.ndarray) -> Tensor:
        """The once-uploaded weight of an unpaged session (prepaid by the load-time lease), or its sealed
        constant shared with the other sessions of the model on the device."""
        if self.sealed is not None:
            return self.sealed.acquire(array, self._sealed_keys.get(name))
        return self._upload(array)

    def pager(self, name: str) -> Callable[[], tuple[Tensor]]:
        """A page step's kernel: the resident tensor of ``name`` (as a kernel's one output), paged in when it
        is not."""
        if name not in self._arrays:
            raise InvalidArgumentError(f"{name!r} is not a weight of {self.holder}")
        if self._order:
            self._next.setdefault(self._order[-1], name)
        self._uses.setdefault(name, []).append(len(self._order))
        self._order.append(name)

        def page() -> tuple[Tensor]:
            return (self.acquire(name),)
        page.__qualname__ = f"page {name}"
        return page

    def acquire(self, name: str) -> Tensor:
        if self._provider_pages:
            return self._page_by_provider(name)
        with self._lock:
            self._cursor = self._next_use(name, self._cursor)
            tensor = self._resident.get(name) or self._borrowed.get(name) or self._borrow_sealed(name)
            if tensor is None:
                size = self._sizes[name]
                self._make_room(size, name)
                tensor = self._upload(self._arrays[name])
                self._resident[name] = tensor
                self._resident_bytes += size
                self.high_water = max(self.high_water, self._resident_bytes)
                self.pages += 1
                self.paged_bytes += size
            following = self._next.get(name)
        if following is not None:
            self.prefetch(following)
        return tensor

    def _borrow_sealed(self, name: str) -> Tensor | None:
        """The constant another session sealed for ``name`` on this device, referenced for this session's life
        (it takes nothing of the budget), or None when none is sealed. Called under the lock."""
        if self._shared is None:
            return None
        key = self._shared_keys.get(name)
        if key is None:  # (a digest of the bytes for a weight not mapped from a file: computed once)
            key = self._shared_keys[name] = self._shared.key(self._arrays[name])
        tensor = self._shared.borrow(self._arrays[name], key)
        if tensor is not None:
            self._borrowed[name] = tensor
        return tensor

    def _next_use(self, name: str, after: int) -> int:
        """The first position of ``name`` in the planned order at or after ``after``, cyclically (the plan
        runs again next run); past the end of the order when it is not planned."""
        uses = self._uses.get(name)
        if not uses:
            return len(self._order) * 2
        index = bisect.bisect_left(uses, after)
        return uses[index] if index < len(uses) else uses[0] + len(self._order)

    def _make_room(self, size: int, name: str) -> None:
        """Evict until ``size`` more bytes fit: the weight needed again last goes first (the plan's order is
        known, and runs repeat it, so this is Belady's choice; least-recently-used would evict every weight
        of a model larger than the budget each run)."""
        if self.budget is None or self._resident_bytes + size <= self.budget:
            return
        after = self._cursor + 1
        for victim in sorted(self._resident, key=lambda n: -self._next_use(n, after)):
            if self._resident_bytes + size <= self.budget:
                return
            tensor = self._resident[victim]
            # Held by a value of the run in progress (the cache, this loop and getrefcount's argument hold
            # three references): in use, not evictable.
            if sys.getrefcount(tensor) > 3:
                continue
            del self._resident[victim]
            self._resident_bytes -= self._sizes[victim]
            self.evictions += 1
            tensor.close()
        if self._resident_bytes + size > self.budget:
            raise MemoryBudgetError(
                f"{self.holder}: paging {name!r} ({size} bytes) needs more than the weight-residency budget of "
                f"{self.budget} bytes, with {self._resident_bytes} bytes held by values still in use; raise "
                f"'session.weight_residency_budget'")

    def _upload(self, array: np.ndarray) -> Tensor:
        if self.account is None:
            return Tensor.from_numpy(array, provider=self.handle)
        with self.account.prepaid():  # the WEIGHTS lease already charged these bytes
            return Tensor.from_numpy(array, provider=self.handle)

    def _lazy(self, name: str) -> tuple[int, LazyWeight, object]:
        array = self._arrays[name]
        region = mapped_region(array)
        source: object
        if region is not None:
            source, offset = region
        else:
            source, offset = _HostSource(array), 0
        key = zlib.crc32(f"{id(self)}:{name}".encode())
        return key, LazyWeight(name, offset, int(array.nbytes), str(array.dtype), tuple(array.shape)), source

    def _page_by_provider(self, name: str) -> Tensor:
        key, weight, source = self._lazy(name)
        paged: PagedWeight | None = self.handle.hook.page_lazy_weight(key=key, weight=weight, source=source)
        if paged is None:
            raise InvalidArgumentError(f"{self.handle.name} implements page_lazy_weight but did not page {name!r}")
        self.pages += 1
        array = self._arrays[name]
        # The provider's cache owns the buffer: the tensor borrows it for the node.
        return Tensor(DataType.from_numpy(array.dtype), array.shape, paged.buffer.alias(), self.handle)

    def prefetch(self, name: str) -> bool:
        """Start reading ``name``'s bytes ahead of its page step: the mapped file's read-ahead, and the
        provider's ``prefetch_lazy_weight``; True when anything was started."""
        with self._lock:
            if name in self._resident:
                return False
        started = False
        array = self._arrays[name]
        region = mapped_region(array)
        if region is not None:
            source, offset = region
            started = source.will_need(offset, int(array.nbytes))
        key, weight, lazy_source = self._lazy(name)
        if self.handle.hook.prefetch_lazy_weight(key=key, weight=weight, source=lazy_source):
            started = True
        if started:
            self.prefetches += 1
        return started

    # -- reports and teardown -------------------------------------------------------------------------
    def stats(self) -> dict:
        with self._lock:
            sealing = self.sealed or self._shared
            return {"device": self.governor.device, "holder": str(self.holder), "weights": len(self._sizes),
                    "sealed": self.sealed is not None, "shared": sealing.shared if sealing else 0,
                    "weight_bytes": sum(self._sizes.values()), "budget": self.budget, "reserved": self.reserved,
                    "paged": self.paged, "resident_bytes": self._resident_bytes, "high_water": self.high_water,
                    "pages": self.pages, "evictions": self.evictions, "prefetches": self.prefetches,
                    "paged_bytes": self.paged_bytes}

    def close(self) -> None:
        with self._lock:
            resident, self._resident = self._resident, OrderedDict()
            self._resident_bytes = 0
            borrowed, self._borrowed = self._borrowed, {}
        for tensor in [*resident.values(), *borrowed.values()]:
            tensor.close()
        for sealing in (self.sealed, self._shared):
            if sealing is not None:
                sealing.close()
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()
