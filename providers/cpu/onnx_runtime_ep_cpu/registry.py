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
from collections.abc import Callable
from typing import Any

# (node, input_shapes, opset) -> kernel(*inputs) -> tuple
KernelFactory = Callable[[Any, list, int], Callable[..., tuple]]

_REGISTRY: dict[tuple[str, str], list[tuple[int, KernelFactory]]] = {}
# What a factory needs beyond (node, shapes, opset), passed by keyword: "handle" (the provider's
# handle: control flow compiles subgraphs with it) and "graph" (the graph holding the node: Gradient
# differentiates other nodes of it).
NEEDS: dict[KernelFactory, tuple[str, ...]] = {}

AI_ONNX = ""


def _norm_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def register(op_type: str, *, domain: str = AI_ONNX, since: int = 1, needs: tuple[str, ...] = ()):
    """Register a kernel factory for ``op_type`` from opset ``since`` onward (until the next one).

    ``needs`` names extra keyword arguments the factory takes: "handle" and/or "graph".
    """
    unknown = set(needs) - {"handle", "graph"}
    if unknown:
        raise ValueError(f"register({op_type!r}): unknown needs {sorted(unknown)}")

    def decorate(factory: KernelFactory) -> KernelFactory:
        if needs:
            NEEDS[factory] = tuple(needs)
        entries = _REGISTRY.setdefault((_norm_domain(domain), op_type), [])
        versions = [v for v, _ in entries]
        if since in versions:
            raise ValueError(f"{op_type} (domain {domain!r}) registered twice for opset {since}")
        index = bisect.bisect(versions, since)
        entries.insert(index, (since, factory))
        return factory

    return decorate


def lookup(op_type: str, domain: str, opset: int) -> KernelFactory | None:
    """The factory for ``op_type`` at ``opset``, or None when no registration covers it."""
    entries = _REGISTRY.get((_norm_domain(domain), op_type))
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
    return [v for v, _ in _REGISTRY.get((_norm_domain(domain), op_type), [])]


def registered_ops() -> list[tuple[str, str]]:
    """Every (domain, op_type) with at least one kernel."""
    return sorted(_REGISTRY)
