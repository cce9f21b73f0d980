"""Memory governance for the core: one process-wide budget per device shared by every session and provider
(:mod:`.governor`), allocations charged per session (:mod:`.accounts`), weights memory-mapped from external
data (:mod:`.mapped`) and paged to devices under a residency budget (:mod:`.weights`), wired into a session by
:mod:`.session`. docs/memory.md describes the model for provider authors."""

from ..contract.residency import Tier
from .governor import DeviceGovernor, MemoryBudgetError, ProcessMemoryGovernor, parse_byte_limit, process_governor

__all__ = ["DeviceGovernor", "MemoryBudgetError", "ProcessMemoryGovernor", "parse_byte_limit", "process_governor",
           "set_device_memory_limit"]


def set_device_memory_limit(device: str, limit: int | float | str | None, tier: Tier = Tier.DEVICE) -> None:
    """Bound what this process takes from ``device`` (``"cuda:0"``) on ``tier``: bytes, a size with a unit
    ("8GiB"), a fraction of the device's memory (0.5, once a session on it reported its total), or None for no
    bound. Sessions' ``session.memory_limit`` sets the device tier's budget, ``session.pinned_memory_limit`` the
    pinned host tier's."""
    governor = process_governor()
    value = None if limit is None else parse_byte_limit(limit, "the device memory limit",
                                                         governor.total(str(device), tier))
    governor.set_limit(str(device), value, tier)
