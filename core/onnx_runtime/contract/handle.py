"""The provider handle as the contract sees it.

A hook implementation receives the handle it is dispatched through (``initialize``), and the defaults call
the provider's other hooks through it. The handle itself (:class:`onnx_runtime.ProviderHandle`) is built from
the specification and the defaults, so naming it here, even for type checkers only, would tie the contract
and the handle into an import cycle. This Protocol names what the contract uses instead; ``ProviderHandle``
satisfies it structurally.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import pluggy


class ContractHandle(Protocol):
    """One provider instance behind its own plugin manager: ``handle.hook.<name>(...)`` reaches the single
    implementation of a hook (the provider's, else the core's default)."""

    @property
    def provider(self) -> object:
        """The provider instance the handle dispatches to."""
        ...

    @property
    def name(self) -> str:
        """The provider's ``name`` hook, asked once when the handle was created."""
        ...

    @property
    def hook(self) -> pluggy.HookRelay:
        """The hooks, each called with keyword arguments."""
        ...

    def implements(self, hook: str) -> bool:
        """Whether the provider itself implements ``hook`` (rather than the core default)."""
        ...

    def set_run_scope(self, enter: Callable[[], object], leave: Callable[[object], None]) -> None:
        """Have every run of the session call ``enter()`` on the running thread before its first step and
        ``leave(token)`` after its last (onnx_runtime/run_scope.py)."""
        ...
