"""The core's own host allocator: backs user-created tensors without importing any provider.

It is a provider with only a ``name`` hook: every other hook (host allocation, copies, counters)
is the contract's default, which is exactly what host memory needs.
"""

from __future__ import annotations

from .contract.markers import hookimpl
from .provider_handle import ProviderHandle


class HostMemory:
    @hookimpl
    def name(self):
        return "HostMemory"


_HOST: ProviderHandle | None = None


def host_allocator() -> ProviderHandle:
    """The process-wide host allocator (host memory is global: any host buffer can be freed here)."""
    global _HOST
    if _HOST is None:
        _HOST = ProviderHandle(HostMemory(), source="onnx_runtime core")
        _HOST.initialize({})
    return _HOST
