"""One provider instance and its hooks: the object the session talks to.

Each hook has exactly one implementation, the provider's or, where it implements none, the core's
default; ``handle.hook.<name>(...)`` calls it directly (hook_table.py), or through pluggy's manager
for providers pluggy must read and once plugins are registered on the handle (``pm``). The handle
also enforces the memory rules that every provider gets for free: a buffer is freed at most once,
only by the provider of its device, and borrowed buffers never.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np

from .contract.buffers import DeviceBuffer
from .contract.defaults import DefaultFallbacks
from .contract.hookspecs import HOOK_NAMES, ExecutionProviderSpec
from .contract.kernels import Availability, KernelMatch
from .contract.markers import PROJECT
from .contract.memory_defaults import release_buffer
from .contract.version import incompatibility
from .devices import DeviceId, DeviceType
from .errors import PluginError, ProviderError
from .hook_table import HookTable, provider_hooks
from .run_scope import Scope

if TYPE_CHECKING:
    import pluggy

_DISCOVERY_HOOKS = {"onnx_runtime_providers"}


class ProviderHandle:
    """Dispatches the contract for one provider instance. See the module docstring."""

    def __init__(self, provider, source: str = "in-process"):
        self.provider = provider
        self.source = source
        label = f"{type(provider).__name__} ({source})"
        self._label = label
        self._pm: pluggy.PluginManager | None = None
        known = provider_hooks(provider)  # hook_table.py: None where pluggy's manager must read the provider
        if known is None:
            implemented = self._register_provider()
        else:
            implemented = set(known)
        unknown = sorted(implemented - set(HOOK_NAMES) - _DISCOVERY_HOOKS)
        if unknown:
            import difflib  # (only for this error)

            hints = {u: difflib.get_close_matches(u, HOOK_NAMES, n=1) for u in unknown}
            detail = ", ".join(f"{u!r}" + (f" (did you mean {h[0]!r}?)" if h else "") for u, h in hints.items())
            raise PluginError(f"provider {label} implements unknown hooks: {detail}")
        unmarked = sorted(n for n in HOOK_NAMES if n not in implemented and callable(getattr(provider, n, None)))
        if unmarked:  # a method named as a hook but not marked would be silently replaced by the default
            raise PluginError(
                f"provider {label} defines {', '.join(unmarked)} without the @hookimpl marker, so the core would "
                f"never call them; decorate each with `@hookimpl` (from onnx_runtime import hookimpl), or rename "
                f"the ones that are not hooks")
        if "name" not in implemented:
            raise PluginError(f"provider {label} must implement the `name` hook (e.g. 'MyExecutionProvider')")
        self._implemented = frozenset(implemented & set(HOOK_NAMES))
        self._defaults = DefaultFallbacks(self)
        table = HookTable(provider, known or {}, self._defaults)
        table.bind_manager(lambda: self.pm)
        # Each hook resolved once into its implementation (hook_table.py), or pluggy's caller where needed.
        self.hook: Any = table
        if self._pm is not None:
            self._register_defaults(self._pm)
            table.attach(self._pm)
        self.name: str = self.hook.name()
        if not isinstance(self.name, str) or not self.name:
            raise PluginError(f"provider {label}: the `name` hook must return a non-empty string")
        self.short_name: str = self.hook.short_name()
        self.contract_version: str = self.hook.contract_version()
        try:
            self._incompatible = incompatibility(self.contract_version)
        except ValueError as exc:
            raise PluginError(f"provider {label}: the `contract_version` hook returned an invalid version: {exc}") \
                from None
        self.initialized = False
        # The session's charge of this handle's allocations to the memory governor (memory/accounts.py), or None.
        self.memory_account = None
        self.run_scope: Scope | None = None  # (enter, leave) that each run of the session calls (set_run_scope)
        self._refresh_device()

    @property
    def pm(self) -> pluggy.PluginManager:
        """The provider and the defaults behind pluggy's manager, built at the first ask (for plugins registered
        on this handle, which then take part in every hook call)."""
        if self._pm is None:
            self._register_provider()
            assert self._pm is not None
            self._register_defaults(self._pm)
            self.hook.attach(self._pm)
        return self._pm

    @property
    def manager_built(self) -> bool:
        """Whether pluggy's manager was made (a provider pluggy must read, or ``pm`` asked for)."""
        return self._pm is not None

    def _register_provider(self) -> set[str]:
        """Make the manager with the contract's specification and register the provider; the hooks it
        implements (pluggy validates them: an invalid one raises PluginError)."""
        import pluggy

        from .plugin_manager import ContractManager  # (pluggy loads with the first manager a process builds)

        pm = ContractManager(PROJECT)
        pm.add_hookspecs(ExecutionProviderSpec)
        try:
            pm.register(self.provider, name="provider")
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"provider {self._label} has an invalid hook implementation: {exc}") from None
        self._pm = pm
        # What register found (pluggy keeps a hook without a spec as an unverified caller): read
        # back rather than parsed twice, a cost every session creation paid (measured in 50054a1).
        return {caller.name for caller in pm.get_hookcallers(self.provider) or ()}

    def _register_defaults(self, pm: pluggy.PluginManager) -> None:
        fallbacks = SimpleNamespace(**{n: getattr(self._defaults, n) for n in HOOK_NAMES
                                       if n not in self._implemented and hasattr(self._defaults, n)})
        pm.register(fallbacks, name="defaults")

    def implements(self, hook: str) -> bool:
        """Whether the provider itself implements ``hook`` (rather than the core default)."""
        return hook in self._implemented

    def set_run_scope(self, enter: Callable[[], object], leave: Callable[[object], None]) -> None:
        """Have every run of this handle's session call ``enter()`` on the running thread before its first step
        and ``leave(token)`` with what it returned after its last (run_scope.py): for session settings the
        provider's kernels read at run time, such as the CPU provider's ``intra_op_num_threads``."""
        self.run_scope = (enter, leave)

    def _refresh_device(self) -> None:
        self.device_type: DeviceType = self.hook.device_type()
        self.device_id: DeviceId = self.hook.device_id()
        # Asked per node and value at planning and per copy at run time: kept, not derived each time.
        self.is_host_accessible: bool = self.device_id.is_host_accessible

    def matches(self, name: str) -> bool:
        lowered = name.lower()
        return lowered in (self.name.lower(), self.short_name.lower())

    # -- lifecycle ------------------------------------------------------------------------------
    @property
    def implemented_hooks(self) -> list[str]:
        """The hooks the provider implements itself, in the contract's order (the rest are the core's defaults)."""
        return [n for n in HOOK_NAMES if n in self._implemented]

    def availability(self) -> Availability:
        if self._incompatible is not None:
            return Availability.no(self._incompatible)
        try:
            result = self.hook.availability()
        except Exception as exc:  # a probe must never take the process down
            return Availability.no(f"availability probe failed: {exc}")
        return result if isinstance(result, Availability) else Availability.yes()

    def initialize(self, options: dict | None = None, session_config: dict | None = None) -> None:
        options = {str(k): str(v) for k, v in (options or {}).items()}
        self.hook.initialize(options=options, handle=self, session_config=dict(session_config or {}))
        self.initialized = True
        self._refresh_device()

    def shutdown(self) -> None:
        if self.initialized:
            self.initialized = False
            self.hook.shutdown()

    # -- capability -----------------------------------------------------------------------------
    def supports_op(self, node, opset, shapes, dtypes, layouts) -> KernelMatch:
        match = self.hook.supports_op(node=node, opset=opset, shapes=shapes, dtypes=dtypes, layouts=layouts)
        if not isinstance(match, KernelMatch):
            raise ProviderError(
                f"{self.name}: supports_op must return a KernelMatch, got {type(match).__name__}"
            )
        return match

    # -- memory with the core's ownership rules --------------------------------------------------
    def allocate(self, size: int, alignment: int = 64) -> DeviceBuffer:
        if self.memory_account is not None:
            return self.memory_account.allocate(int(size), int(alignment))
        return self.allocate_unaccounted(size, alignment)

    def allocate_unaccounted(self, size: int, alignment: int = 64) -> DeviceBuffer:
        """``allocate`` without the governor's charge (for bytes a lease already paid for)."""
        buffer = self.hook.allocate(size=int(size), alignment=int(alignment))
        if not isinstance(buffer, DeviceBuffer):
            raise ProviderError(f"{self.name}: allocate must return a DeviceBuffer, got {type(buffer).__name__}")
        return buffer

    def prepaid(self) -> contextlib.AbstractContextManager:
        """A block whose allocations on this thread are paid for already (carved from a charged arena, or under a
        lease): the session's memory account does not charge them again."""
        account = self.memory_account
        return contextlib.nullcontext() if account is None else account.prepaid()

    def allocate_committed(self, size: int, alignment: int = 64, committed_ranges=None) -> DeviceBuffer:
        """``allocate_committed`` (reserve ``size`` bytes, commit ``committed_ranges``), its committed bytes
        charged to the governor like ``allocate``'s (memory/accounts.py)."""
        if self.memory_account is not None:
            return self.memory_account.allocate_committed(int(size), int(alignment), committed_ranges)
        return self.allocate_committed_unaccounted(size, alignment, committed_ranges)

    def allocate_committed_unaccounted(self, size: int, alignment: int = 64, committed_ranges=None) -> DeviceBuffer:
        buffer = self.hook.allocate_committed(size=int(size), alignment=int(alignment),
                                              committed_ranges=committed_ranges)
        if not isinstance(buffer, DeviceBuffer):
            raise ProviderError(f"{self.name}: allocate_committed must return a DeviceBuffer, got "
                                f"{type(buffer).__name__}")
        return buffer

    def commit_allocation_range(self, buffer: DeviceBuffer, offset: int, nbytes: int) -> None:
        """Commit ``buffer[offset:offset+nbytes]``; what it newly commits is charged (a growth the budget refuses
        is decommitted again and the governor's error raised)."""
        before = int(self.hook.allocation_committed_bytes(buffer=buffer)) if self.memory_account else 0
        self.hook.commit_allocation_range(buffer=buffer, offset=int(offset), nbytes=int(nbytes))
        self._recharge(buffer, before)

    def commit_allocation_ranges(self, ranges) -> None:
        """Commit ``[(buffer, offset, nbytes), ...]`` as one transaction, each buffer's growth charged."""
        ranges = [(buffer, int(offset), int(nbytes)) for buffer, offset, nbytes in ranges]
        account = self.memory_account
        before: dict[int, tuple[DeviceBuffer, int]] = {} if account is None else {
            id(b): (b, int(self.hook.allocation_committed_bytes(buffer=b))) for b, _, _ in ranges}
        self.hook.commit_allocation_ranges(ranges=ranges)
        for buffer, size in before.values():
            self._recharge(buffer, size)

    def decommit_allocation_range(self, buffer: DeviceBuffer, offset: int, nbytes: int) -> None:
        """Decommit ``buffer[offset:offset+nbytes]``; its charge goes down with it."""
        self.hook.decommit_allocation_range(buffer=buffer, offset=int(offset), nbytes=int(nbytes))
        self._recharge(buffer, None)

    def _recharge(self, buffer: DeviceBuffer, before: int | None) -> None:
        account = self.memory_account
        if account is None:
            return

        def undo() -> None:  # back to what was committed before a growth the budget refused
            if before is not None and before < buffer.size:
                self.hook.decommit_allocation_range(buffer=buffer, offset=before, nbytes=buffer.size - before)

        account.recharge(buffer, undo)

    def deallocate(self, buffer: DeviceBuffer) -> None:
        """Free ``buffer`` exactly once; borrowed buffers are never freed (contract.memory_defaults.release_buffer,
        which the workspace defaults use too)."""
        release_buffer(self, buffer)

    def copy_from_host(self, src, dst: DeviceBuffer) -> None:
        self.hook.copy_from_host(src=src, dst=dst)

    def copy_to_host(self, src: DeviceBuffer, dst) -> None:
        self.hook.copy_to_host(src=src, dst=dst)

    def download(self, src: DeviceBuffer, nbytes: int | None = None) -> np.ndarray:
        out = np.empty(src.size if nbytes is None else nbytes, np.uint8)
        self.hook.copy_to_host(src=src, dst=out)
        return out

    def sync(self) -> None:
        self.hook.sync()

    def allocation_counts(self) -> tuple[int, int] | None:
        return self.hook.device_allocation_counts()

    def __repr__(self) -> str:
        return f"ProviderHandle({self.name}, {self.device_id})"
