"""What host providers' kernels allocate for a run's intermediates and outputs, charged to the host tier.

Host kernels return numpy arrays from malloc, not from an allocator the runtime owns, so charging each array as
it is made would put a ledger operation on every step of every run. The charge is taken per *plan* instead,
where the executor builds one (at session creation for the session's graph, at the first run of each input
signature for its specialization): the plan's steps and their releases say which values are live together, and
the inferred shapes of the graph say how large each is, so the peak of live intermediates and outputs is known
before any kernel allocates them. The session's lease on the host tier of ``cpu:0`` (holder "session ...
activations on host") grows to the largest plan's peak and is given back when the session closes: a host memory
limit (``session.host_memory_limit``) that cannot hold a model's activations fails there, at load or at the
first run of the signature, naming the holder and the shortfall, rather than at some later allocation.

A specialization whose dimensions stay symbolic (a template serving every length of a decode loop) is sized at
the signature that asked for it. What the shapes do not fix (a symbolic dimension of the session's generic plan,
an output sized from data, a kernel's own scratch) is not in the estimate: each such value is bounded by the
session's value budget (``session.max_value_bytes``). Kernels that return a view of their input (Reshape,
Squeeze, ...) take nothing; the values inside a node's subgraph (a fused segment's buffers, a control-flow body)
are counted as live during that node's step.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator

from ..contract.residency import HolderId, MemoryLease, MemoryRole, Tier
from ..errors import OnnxRuntimeError
from .governor import MemoryBudgetError, process_governor

__all__ = ["HostActivations", "admit_plan", "plan_peak_bytes", "symbols_bound"]

HOST = "cpu:0"
# Operators whose CPU kernels return a view of their first input: their outputs take no new memory.
VIEW_OPS = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Flatten", "Identity"})


def _value_bytes(graph, name: str) -> int | None:
    """The bytes of ``name`` when its inferred type fixes them, else None."""
    info = graph.type_of(name) if name else None
    if info is None or not info.is_tensor or info.dtype is None:
        return None
    shape = info.shape
    if shape is None:
        return None
    bound = _SYMBOLS.get()
    numel = 1
    for dim in shape:
        if not isinstance(dim, int):
            dim = bound.get(dim) if bound is not None and isinstance(dim, str) else None
            if dim is None:
                return None
        numel *= max(dim, 0)
    try:
        return info.dtype.checked_storage_bytes(numel)
    except OnnxRuntimeError:  # a string tensor (no fixed size) or a shape past the address space
        return None


# Symbolic dimensions of the plan being built and their values at the signature that asked for it (a shape
# specialization's template is planned at the first run whose shapes it serves).
_SYMBOLS: contextvars.ContextVar[dict[str, int] | None] = contextvars.ContextVar("activation_symbols", default=None)


@contextlib.contextmanager
def symbols_bound(dims: tuple, signature: tuple, prefix: str) -> Iterator[None]:
    """Plans built in this block size a dimension ``(k,)`` of ``dims`` (per input, per axis: an int or a symbol's
    index as a 1-tuple) as the named symbol ``f"{prefix}{k}"`` with the value ``signature`` (the feeds' shapes) has
    there."""
    values = {f"{prefix}{dim[0]}": int(got) for shape, shape_got in zip(dims, signature)
              for dim, got in zip(shape, shape_got) if not isinstance(dim, int)}
    token = _SYMBOLS.set(values)
    try:
        yield
    finally:
        _SYMBOLS.reset(token)


def _inner_bytes(graph, node) -> int:
    """The values a node's subgraphs produce, the largest subgraph's (a fused segment holds them in buffers)."""
    widest = 0
    for body in node.subgraphs():
        total = 0
        for inner in body.nodes:
            for name in inner.outputs:
                size = _value_bytes(body, name) if name else None
                if size is None and name:
                    size = _value_bytes(graph, name)
                total += size or 0
        widest = max(widest, total)
    return widest


def plan_peak_bytes(steps, graph, host_providers: frozenset[str]) -> tuple[int, int]:
    """(peak bytes of live values the host steps of ``steps`` produce, count of values whose size the shapes
    leave open). Values are live from their step to the step that releases them; outputs are never released."""
    live = peak = unknown = 0
    sizes: dict[int, int] = {}
    for step in steps:
        node = step.node
        if node is not None and step.provider in host_providers:
            made = 0
            if node.op_type not in VIEW_OPS:
                for name, slot in zip(node.outputs, step.outputs):
                    if not name:
                        continue
                    size = _value_bytes(graph, name)
                    if size is None:
                        unknown += 1
                        continue
                    sizes[slot] = size
                    made += size
            inner = _inner_bytes(graph, node) if node.attrs else 0
            live += made
            peak = max(peak, live + inner)
        for slot in step.release:
            live -= sizes.pop(slot, 0)
    return peak, unknown


class HostActivations:
    """One session's lease on the host tier for its plans' activations (see the module docstring)."""

    def __init__(self, label: str):
        self.holder = HolderId(f"{label} activations on host")
        self.leases: list[MemoryLease] = []  # one per growth
        self.charged = 0  # the largest plan's peak, what the lease holds
        self.unknown = 0  # values of the largest plans whose size the shapes left open
        self.plans = 0
        self._lock = threading.Lock()
        self._closed = False

    def admit(self, nbytes: int, unknown: int, what: str) -> None:
        """Grow the lease to ``nbytes`` (a plan's peak) when it is larger than what the session holds."""
        with self._lock:
            if self._closed:
                return
            self.plans += 1
            if nbytes <= self.charged:
                return
            try:
                lease = process_governor().reserve(HOST, nbytes - self.charged, Tier.HOST, MemoryRole.ACTIVATIONS,
                                                   self.holder)
            except MemoryBudgetError as error:
                raise MemoryBudgetError(
                    f"{what} needs {nbytes} bytes of intermediates and outputs at its peak, more than the host "
                    f"budget has left: {error}. For the host, the limit is 'session.host_memory_limit'; smaller "
                    f"inputs need less") from None
            self.leases.append(lease)
            self.charged, self.unknown = nbytes, unknown

    def close(self) -> None:
        with self._lock:
            self._closed = True
            leases, self.leases, self.charged = self.leases, [], 0
        for lease in leases:
            lease.release()

    def stats(self) -> dict:
        return {"holder": str(self.holder), "charged": self.charged, "plans": self.plans,
                "unsized_values": self.unknown}


def admit_plan(plan, graph, assignment: dict) -> None:
    """Charge ``plan``'s peak of host values to the session that owns its host providers (the executor calls
    this once per plan it builds; a session without governance charges nothing)."""
    activations = None
    hosts = set()
    for handle in {id(h): h for h in assignment.values()}.values():
        if handle.is_host_accessible:
            hosts.add(handle.name)
            activations = activations or getattr(handle.memory_account, "activations", None)
    if activations is None:
        return
    peak, unknown = plan_peak_bytes(plan.steps, graph, frozenset(hosts))
    if peak:
        activations.admit(peak, unknown, f"{activations.holder} (a plan of graph {graph.name!r})")
