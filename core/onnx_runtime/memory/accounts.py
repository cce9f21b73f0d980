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

import contextlib
import os
import sys
import threading
from collections.abc import Iterator

from ..contract.residency import HolderId, MemoryLease, MemoryRole, RawDeviceAllocationSiteStats, Tier
from .governor import DeviceGovernor

__all__ = ["DeviceAccount"]

_CORE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Frames of the allocation path itself: the site is the first frame outside them.
_PATH_FILES = frozenset(os.path.join(_CORE, name) for name in ("tensor.py", "provider_handle.py"))


def _site() -> tuple[str, int]:
    frame = sys._getframe(1)  # noqa: SLF001 (the documented way to walk the caller's frames cheaply)
    while frame is not None and (frame.f_code.co_filename in _PATH_FILES
                                 or frame.f_code.co_filename.startswith(os.path.dirname(__file__))):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return "<unknown>", 0
    return frame.f_code.co_filename, frame.f_lineno


class DeviceAccount:
    """Charges one provider handle's allocations to ``governor`` for ``holder`` (see the module docstring)."""

    def __init__(self, handle, governor: DeviceGovernor, holder: HolderId,
                 role: MemoryRole = MemoryRole.ACTIVATIONS):
        self.handle = handle
        self.governor = governor
        self.holder = holder
        self.role = role
        self._leases: dict[int, MemoryLease] = {}  # id(buffer) -> the lease that paid for it
        self._local = threading.local()
        self._lock = threading.Lock()
        self._sites: dict[tuple[str, int], list[int]] = {}  # site -> [requests, bytes]
        self._deferred = bool(handle.implements("wait_for_deferred_releases"))

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
        """``ProviderHandle.allocate`` under the budget: reserve, allocate, remember the lease by buffer."""
        if getattr(self._local, "prepaid", 0):
            return self.handle.allocate_unaccounted(size, alignment)
        lease = self.governor.reserve(size, Tier.DEVICE, self.role, self.holder)
        try:
            buffer = self.handle.allocate_unaccounted(size, alignment)
        except BaseException:
            lease.release()
            raise
        site = _site()
        with self._lock:
            self._leases[id(buffer)] = lease
            counts = self._sites.setdefault(site, [0, 0])
            counts[0] += 1
            counts[1] += size
        return buffer

    def released(self, buffer) -> None:
        """The buffer was freed (or its release was accepted): give its bytes back, or defer that."""
        with self._lock:
            lease = self._leases.pop(id(buffer), None)
        if lease is None:
            return
        if self._deferred:
            hook = self.handle.hook
            self.governor.defer_release(lease, lambda: hook.wait_for_deferred_releases())
        else:
            lease.release()

    @property
    def charged(self) -> int:
        with self._lock:
            return sum(lease.nbytes for lease in self._leases.values())

    def site_stats(self) -> list[RawDeviceAllocationSiteStats]:
        with self._lock:
            return [RawDeviceAllocationSiteStats(file, line, requests=n, requested_bytes=b)
                    for (file, line), (n, b) in sorted(self._sites.items(), key=lambda item: -item[1][1])]

    def close(self) -> None:
        """Stop charging (the session is closed); buffers still live keep their charge until freed."""
