"""What a session does with the memory governor: join it, charge its device allocations, admit its weights.

At creation, for each device provider its nodes were placed on, the session lets the provider adopt the governor
(``adopt_memory_governor``, where it may report the device's memory and charge its standing pools), applies the
device limit (``session.memory_limit``: bytes or a fraction of that memory) and the pinned host one
(``session.pinned_memory_limit``), charges the handle's allocations through a :class:`DeviceAccount`, and admits
the weights its nodes read on that device (:class:`WeightResidency`): all of them, or the weight-residency budget
(``session.weight_residency_budget``) when they are paged. On the host, the weights a session holds in memory
(read, not mapped) are charged to the host tier of ``cpu:0`` (``session.host_memory_limit``), and so is what
host providers allocate through their allocator (host DeviceIoBindings, tensors made through the session).
"""

from __future__ import annotations

import weakref

import numpy as np

from ..budget import physical_memory
from ..contract.residency import HolderId, MemoryLease, MemoryRole, Tier
from ..errors import InvalidArgumentError
from .accounts import DeviceAccount
from .activations import HostActivations
from .governor import parse_byte_limit, process_governor
from .mapped import mapped_region
from .weights import WeightResidency

__all__ = ["HOST", "HOST_LIMIT_KEY", "LIMIT_KEY", "MAP_WEIGHTS_KEY", "PINNED_LIMIT_KEY", "WEIGHT_BUDGET_KEY",
           "SessionMemory", "governed"]

LIMIT_KEY = "session.memory_limit"  # the device budget (bytes, with an optional unit) of every device used
WEIGHT_BUDGET_KEY = "session.weight_residency_budget"  # weights resident at once per device; paged beyond
PINNED_LIMIT_KEY = "session.pinned_memory_limit"  # page-locked host memory (staging) a device's provider may hold
HOST_LIMIT_KEY = "session.host_memory_limit"  # host memory for weights held in memory (not mapped), all sessions
HOST = "cpu:0"  # the host's key in the governor: its HOST tier counts the weights sessions hold in memory
MAP_WEIGHTS_KEY = "session.map_external_weights"  # "0": read external data into memory instead of mapping it


class SessionMemory:
    """The governor's view of one session (see the module docstring)."""

    def __init__(self, label: str, graph, assignment: dict, config: dict[str, str]):
        self.label = label
        self.accounts: list[DeviceAccount] = []
        self.weights: dict[int, WeightResidency] = {}
        self.pools: dict[str, int] = {}  # provider -> bytes its own pools put under the governor
        self.host_lease: MemoryLease | None = None
        self.activations: HostActivations | None = None  # host kernels' intermediates and outputs, per plan
        governor = process_governor()
        self._admit_host_weights(graph, config)
        try:
            self._account_host_allocations(assignment)
        except BaseException:
            self.close()
            raise
        devices = {id(h): h for h in assignment.values() if not h.is_host_accessible}
        if not devices:
            return
        budget = parse_byte_limit(config.get(WEIGHT_BUDGET_KEY, ""), WEIGHT_BUDGET_KEY)
        by_handle: dict[int, list] = {key: [] for key in devices}
        for node in graph.nodes:
            handle = assignment.get(node.name)
            if handle is not None and id(handle) in by_handle:
                by_handle[id(handle)].append(node)
        try:
            for key, handle in devices.items():
                device = str(handle.device_id)
                view = governor.device(device)
                # Adopted first: the provider reports the device's memory then, which a fractional limit needs.
                self.pools[handle.name] = int(handle.hook.adopt_memory_governor(
                    governor=view, tier=Tier.DEVICE, holder=HolderId(f"{handle.name} pools")) or 0)
                for key_name, tier in ((LIMIT_KEY, Tier.DEVICE), (PINNED_LIMIT_KEY, Tier.PINNED_HOST)):
                    limit = parse_byte_limit(config.get(key_name, ""), f"{key_name} (on {device})",
                                             governor.total(device, tier))
                    if limit is not None and limit != governor.limit(device, tier):
                        governor.set_limit(device, limit, tier)
                account = DeviceAccount(handle, view, HolderId(f"{label} activations on {handle.name}"))
                nodes = by_handle[key]
                names = {n for node in nodes for n in node.inputs if n in graph.initializers}
                weights = {n: graph.initializers[n] for n in sorted(names)}
                node_sets = [tuple(n for n in node.inputs if n in weights) for node in nodes]
                provider_budget = handle.hook.set_weight_residency_budget(budget_bytes=budget) \
                    if budget is not None else None
                self.weights[key] = WeightResidency(
                    handle, view, account, HolderId(f"{label} weights on {handle.name}"), weights,
                    budget if provider_budget is None else int(provider_budget), node_sets)
                handle.memory_account = account
                self.accounts.append(account)
        except BaseException:
            self.close()
            raise

    def _admit_host_weights(self, graph, config: dict[str, str]) -> None:
        """Charge the weights held in host memory (read, not mapped: a mapped weight's pages are the page cache's,
        which the kernel reclaims) to the host tier of ``cpu:0``, bounded by ``session.host_memory_limit``: a model
        whose weights do not fit beside the other sessions' fails here, at load."""
        governor = process_governor()
        # What a fractional host limit is a share of (where the platform does not say, fractions are refused).
        physical = physical_memory() if governor.total(HOST, Tier.HOST) is None else None
        if physical:
            governor.set_total(HOST, physical, Tier.HOST)
        limit = parse_byte_limit(config.get(HOST_LIMIT_KEY, ""), HOST_LIMIT_KEY, governor.total(HOST, Tier.HOST))
        if limit is not None and limit != governor.limit(HOST, Tier.HOST):
            governor.set_limit(HOST, limit, Tier.HOST)
        held = sum(int(getattr(array, "nbytes", 0)) for array in graph.initializers.values()
                   if isinstance(array, np.ndarray) and mapped_region(array) is None)
        self.host_lease = governor.reserve(HOST, held, Tier.HOST, MemoryRole.WEIGHTS,
                                           HolderId(f"{self.label} weights in host memory"))

    def _account_host_allocations(self, assignment: dict) -> None:
        """Charge what host providers allocate through their allocator (``ProviderHandle.allocate`` and
        ``allocate_committed``: tensors made on the host through the session, DeviceIoBindings such as a KV cache
        kept in host memory) to the host tier of ``cpu:0``, beside the weights: the seed's host allocator charges
        ``Tier::Host`` the same way. Kernel intermediates numpy allocates itself are not charged one by one
        but per plan, at the peak its inferred shapes give (memory/activations.py), through the account's
        ``activations``."""
        view = process_governor().device(HOST)
        for handle in {id(h): h for h in assignment.values() if h.is_host_accessible}.values():
            account = DeviceAccount(handle, view, HolderId(f"{self.label} host allocations on {handle.name}"),
                                    tier=Tier.HOST)
            if self.activations is None:
                self.activations = HostActivations(self.label)
            account.activations = self.activations  # what the plans' kernels allocate, charged per plan
            handle.memory_account = account
            self.accounts.append(account)

    def attach(self, executor) -> None:
        """Route ``executor``'s weight uploads through the residency (before it plans)."""
        executor.weights = dict(self.weights)

    def close(self) -> None:
        lease, self.host_lease = self.host_lease, None
        if lease is not None:
            lease.release()
        weights, self.weights = self.weights, {}
        for residency in weights.values():
            residency.close()
        for account in self.accounts:
            account.close()  # leaves the handle once the buffers it charged are freed
        self.accounts = []
        if self.activations is not None:
            self.activations.close()

    def report(self) -> dict:
        """The budgets of the devices this session runs on (shared with every session there), its weight
        residency and its allocation sites (for ``onnx-runtime info --memory``)."""
        governor = process_governor()
        devices = {account.governor.device for account in self.accounts} | {HOST}
        return {
            "budgets": [budget for budget in governor.snapshot() if budget["device"] in devices],
            "weights": [residency.stats() for residency in self.weights.values()],
            "activations": [{"device": a.governor.device, "holder": str(a.holder), "charged": a.charged, "peak": a.peak,
                             "sites": [{"file": s.file, "line": s.line, "requests": s.requests,
                                        "bytes": s.requested_bytes} for s in a.site_stats()]}
                            for a in self.accounts],
            "pools": dict(self.pools),
            "host_activations": self.activations.stats() if self.activations is not None else None,
            "provider_sites": {a.handle.name: [{"file": s.file, "line": s.line, "requests": s.requests,
                                                "bytes": s.requested_bytes}
                                               for s in a.handle.hook.raw_device_allocation_site_stats() or ()]
                               for a in self.accounts},
        }


def governed(session, label: str, graph, assignment: dict, config: dict[str, str]) -> SessionMemory:
    """A :class:`SessionMemory` for ``session`` whose charges go back when the session is closed or dropped."""
    if config.get(WEIGHT_BUDGET_KEY) and config.get("session.graph_capture", "0") == "1":
        raise InvalidArgumentError(
            f"'{WEIGHT_BUDGET_KEY}' pages weights between runs, which device graphs cannot replay (they keep the "
            f"addresses they captured); drop 'session.graph_capture' or the weight budget")
    memory = SessionMemory(label, graph, assignment, config)
    weakref.finalize(session, memory.close)
    return memory
