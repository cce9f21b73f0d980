"""A driver module wrapped to count its calls by name: what tests and benchmarks read to say how many host
synchronizations, event waits, host transfers and graph launches a step costs (simulator or GPU alike)."""

from __future__ import annotations

import threading


class CountingDriver:
    """The driver module with a count per ``cu*`` call name; every other attribute passes through. Sessions on
    several threads share one driver: the counts are taken under a lock so none is lost."""

    def __init__(self, driver):
        self._driver = driver
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name):
        attribute = getattr(self._driver, name)
        if not name.startswith("cu") or not callable(attribute):
            return attribute

        def counted(*args, **kwargs):
            with self._lock:
                self.calls[name] = self.calls.get(name, 0) + 1
            return attribute(*args, **kwargs)
        return counted

    def syncs(self) -> int:
        """cu*Synchronize calls: the host waiting for the device."""
        return sum(n for name, n in self.calls.items() if "Synchronize" in name)

    def host_transfers(self) -> int:
        """cuMemcpyHtoD*/DtoH* calls."""
        return sum(n for name, n in self.calls.items() if name.startswith(("cuMemcpyHtoD", "cuMemcpyDtoH")))

    def summary(self) -> dict[str, int]:
        """Syncs, stream waits on events, host transfers and graph launches."""
        return {"syncs": self.syncs(), "waits": self.calls.get("cuStreamWaitEvent", 0),
                "transfers": self.host_transfers(), "launches": self.calls.get("cuGraphLaunch", 0)}
