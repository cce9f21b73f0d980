"""A provider described before it is imported: what discovery needs (name, device, contract version, whether
it can run here) without the import of the provider's package, which for a device provider pulls in its kernels
and ops (a noticeable share of a fresh process's start) that a session asking only for other providers never uses.

A plugin's ``onnx_runtime_providers`` hook may return a :class:`DeferredProvider` in place of a provider class.
The class is imported at the first session that creates the provider (or when its hooks are listed); discovery
then checks that the class says the same name as its description.
"""

from __future__ import annotations

from collections.abc import Callable

from ..records import FrozenRecord
from .kernels import Availability


class DeferredProvider(FrozenRecord):
    """A provider class to be imported on first use, and what is known of it until then.

    ``load`` returns the provider class (it does the import); ``probe`` answers the ``availability`` question
    without that import (e.g. the driver probe alone); ``device`` is the device id as text ("cuda:0") before
    initialization.
    """

    __slots__ = __match_args__ = ("name", "short_name", "device", "contract_version", "load", "probe",
                                  "selected_by_default")
    name: str
    short_name: str
    device: str
    contract_version: str
    load: Callable[[], Callable[[], object]]
    probe: Callable[[], Availability] | None
    selected_by_default: bool

    def __init__(self,
                 name: str, short_name: str, device: str, contract_version: str,
                 load: Callable[[], Callable[[], object]], probe: Callable[[], Availability] | None = None,
                 selected_by_default: bool = True) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "short_name", short_name)
        object.__setattr__(self, "device", device)
        object.__setattr__(self, "contract_version", contract_version)
        object.__setattr__(self, "load", load)
        object.__setattr__(self, "probe", probe)
        object.__setattr__(self, "selected_by_default", selected_by_default)

    def __call__(self) -> object:
        """A fresh instance of the provider class (imports it on the first call)."""
        return self.load()()

    def availability(self) -> Availability:
        if self.probe is None:
            return Availability.yes()
        try:
            result = self.probe()
        except Exception as exc:  # a probe must never take the process down
            return Availability.no(f"availability probe failed: {exc}")
        return result if isinstance(result, Availability) else Availability.yes()
