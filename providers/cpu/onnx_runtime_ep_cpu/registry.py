"""The CPU provider's operator registry, keyed by (domain, op_type) and opset range.

A kernel *factory* is registered for the opset version that introduced a behaviour; lookup picks
the newest registration whose ``since`` is <= the model's opset for that domain, like ONNX
Runtime's kernel registry. The factory runs once per (node, input shapes) at session creation
and returns the *kernel*: a plain function ``kernel(*inputs) -> tuple of outputs`` over numpy
arrays (``None`` for an omitted optional input) that the executor calls directly on the hot path.

    @register("Relu", since=6)
    def relu(node, shapes, opset):
        return lambda x: (np.maximum(x, 0),)
"""

from __future__ import annotations

import bisect
import importlib
import sys
import threading
from collections.abc import Callable
from typing import Any

# (node, input_shapes, opset) -> kernel(*inputs) -> tuple
KernelFactory = Callable[[Any, list, int], Callable[..., tuple]]

_REGISTRY: dict[tuple[str, str], list[tuple[int, KernelFactory]]] = {}
# What a factory needs beyond (node, shapes, opset), passed by keyword: "handle" (the provider's
# handle: control flow compiles subgraphs with it) and "graph" (the graph holding the node: Gradient
# differentiates other nodes of it).
NEEDS: dict[KernelFactory, tuple[str, ...]] = {}
# Extras a factory takes when the provider builds a session's kernel but can do without (keyword defaults), so a
# wrapper that builds it from (node, shapes, opset) alone still may: "graph", "config" (the session config entries).
HINTS: dict[KernelFactory, tuple[str, ...]] = {}

AI_ONNX = ""

# Kernel modules are imported at the first lookup of one of their operators, so that a session imports the
# families its model uses (declare_families). Per (domain, op_type): the modules still to import for it.
_PENDING: dict[tuple[str, str], list[str]] = {}
_PACKAGES: list[tuple[str, list[str]]] = []  # (package, its path): every module is imported on a miss
_everything_lock = threading.RLock()  # a module that looks up an undeclared operator as it imports
# (domain, op_type, since) -> the module whose import registered it (what declare_families must name)
REGISTERED_IN: dict[tuple[str, str, int], str] = {}


def _norm_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def register(op_type: str, *, domain: str = AI_ONNX, since: int = 1, needs: tuple[str, ...] = (),
             hints: tuple[str, ...] = ()):
    """Register a kernel factory for ``op_type`` from opset ``since`` onward (until the next one).

    ``needs`` names extra keyword arguments the factory takes: "handle" and/or "graph"; ``hints`` those it takes
    when the provider passes them and defaults otherwise: "graph" and/or "config".
    """
    unknown = (set(needs) - {"handle", "graph"}) | (set(hints) - {"graph", "config"})
    if unknown:
        raise ValueError(f"register({op_type!r}): unknown needs or hints {sorted(unknown)}")

    def decorate(factory: KernelFactory) -> KernelFactory:
        if needs:
            NEEDS[factory] = tuple(needs)
        if hints:
            HINTS[factory] = tuple(hints)
        key = (_norm_domain(domain), op_type)
        REGISTERED_IN[(*key, since)] = sys._getframe(1).f_globals.get("__name__", "")  # noqa: SLF001  (the module)
        entries = _REGISTRY.setdefault(key, [])
        versions = [v for v, _ in entries]
        if since in versions:
            raise ValueError(f"{op_type} (domain {domain!r}) registered twice for opset {since}")
        index = bisect.bisect(versions, since)
        entries.insert(index, (since, factory))
        return factory

    return decorate


def declare_families(package: str, path: list[str], families: dict[str, str]) -> None:
    """The kernel modules of ``package`` (its ``__path__``), each with the operators it registers ("Op" or
    "domain:Op", space-separated): a module is imported at the first lookup of one of them. A lookup of an
    operator no module declares imports every module of the package, so a module or operator missing here
    costs time, never a kernel (tests/core/test_cold_lazy_ops.py keeps the table exact)."""
    _PACKAGES.append((package, list(path)))
    for module, ops in families.items():  # (every new process's first session reads some 300 names here)
        name = f"{package}.{module}"
        for op in ops.split():
            if ":" in op:
                domain, _, op_type = op.rpartition(":")
                key = (_norm_domain(domain), op_type)
            else:
                key = ("", op)
            modules = _PENDING.get(key)
            if modules is None:
                _PENDING[key] = [name]
            else:
                modules.append(name)


def _entries(key: tuple[str, str]) -> list | None:
    if _PENDING:
        modules = _PENDING.get(key)
        if modules:
            for name in modules:  # (another thread's import of the same module is waited for by importlib)
                importlib.import_module(name)
            _PENDING.pop(key, None)  # only once imported: a concurrent lookup never sees half the versions
    entries = _REGISTRY.get(key)
    if entries is None and _PACKAGES:
        import_everything()
        entries = _REGISTRY.get(key)
    return entries


def import_everything() -> None:
    """Import every declared package's kernel modules (a lookup of an undeclared operator; registered_ops)."""
    import pkgutil  # (a session whose operators are all declared never lists the package)

    with _everything_lock:
        while _PACKAGES:
            package, path = _PACKAGES[0]
            for info in pkgutil.iter_modules(path):
                if not info.name.startswith("_"):
                    importlib.import_module(f"{package}.{info.name}")
            _PACKAGES.pop(0)
        _PENDING.clear()


def lookup(op_type: str, domain: str, opset: int) -> KernelFactory | None:
    """The factory for ``op_type`` at ``opset``, or None when no registration covers it."""
    entries = _entries((_norm_domain(domain), op_type))
    if not entries:
        return None
    chosen = None
    for since, factory in entries:
        if since <= opset:
            chosen = factory
        else:
            break
    return chosen


def registered_versions(op_type: str, domain: str = AI_ONNX) -> list[int]:
    return [v for v, _ in _entries((_norm_domain(domain), op_type)) or []]


def registered_ops() -> list[tuple[str, str]]:
    """Every (domain, op_type) with at least one kernel."""
    import_everything()
    return sorted(_REGISTRY)
