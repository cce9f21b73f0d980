"""The CUDA provider under the process's memory governor (docs/memory.md): ``adopt_memory_governor`` reports the
device's memory (``cuDeviceTotalMem``, so a limit can be a fraction of it), puts the device's pinned staging
ring under the pinned host tier and this instance's validation flag words (validation.py) under the device
tier; ``raw_device_allocation_site_stats`` names the driver allocations made outside the ``allocate`` hook (the
staging ring's cuMemHostAlloc, sealed constants' uploads). Allocations with committed ranges (KV caches on
:class:`~onnx_runtime_ep_cuda.vmm.MappedGrowthBuffer`, reserved.py) are granted by the adopted governor as they
grow, role kv_cache, and given back as they are unmapped.

The stream-ordered pool needs no charge of its own: every buffer it hands out goes through ``allocate``, which
the session's account charges, and the pool is per device, shared by every session on it.
"""

from __future__ import annotations

from onnx_runtime import hookimpl
from onnx_runtime.contract.residency import HolderId, Tier

from .sealed import sealed_site_stats

__all__ = ["MemoryGovernance"]


class MemoryGovernance:
    """The governance hooks of :class:`CUDAExecutionProvider` (a mixin: it needs ``cuda_device()``)."""

    @hookimpl
    def adopt_memory_governor(self, governor, tier, holder):
        device = self.cuda_device()
        total = int(device._check(device.driver.cuDeviceTotalMem(device.device), "cuDeviceTotalMem"))  # noqa: SLF001
        if hasattr(governor, "set_total") and total > 0:
            governor.set_total(total, Tier.DEVICE)
        if hasattr(governor, "grant") and hasattr(governor, "release_mapped"):  # the core's DeviceGovernor
            label = getattr(holder, "label", str(holder)).removesuffix(" pools")
            self._growth_governance = {"governor": governor, "holder": HolderId(f"{label} mapped growth")}
        label = getattr(holder, "label", str(holder)).removesuffix(" pools")
        words = self.device_validation().govern(governor, HolderId(f"{label} validation words"))
        return device.staging.govern(governor, holder) + words

    def growth_governance(self) -> dict:
        """``governor`` and ``holder`` for a MappedGrowthBuffer of this provider (empty before adoption: the
        buffer is then ungoverned)."""
        return dict(getattr(self, "_growth_governance", None) or {})

    @hookimpl
    def raw_device_allocation_site_stats(self):
        device = self.cuda_device()
        return device.staging.site_stats() + sealed_site_stats(device)
