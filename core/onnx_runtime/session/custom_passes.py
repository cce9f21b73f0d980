"""Providers' graph passes (``custom_passes``) at session creation and specialization: each provider's passes
in provider order, each fusing only the nodes placement would give that provider."""

from __future__ import annotations

import inspect
import weakref

from ..contract.kernels import input_facts
from ..errors import InvalidGraphError, OnnxRuntimeError, ProviderError
from ..loader import outer_reads, topological_order
from ..provider_handle import ProviderHandle


def _ownership(graph, handles: list[ProviderHandle], index: int):
    """``owns(node)``: whether placement would give ``node`` to ``handles[index]`` — no provider
    listed before it accepts the node and it does. A provider's pass fuses only nodes it owns, so
    a fusion never pulls nodes away from a provider listed first."""
    answers: dict = {}  # node -> bool: fusion passes rescan the graph after each rewrite, so ask once per node

    def owns(node) -> bool:
        answer = answers.get(node)
        if answer is None:
            answer = answers[node] = _first_accepting(graph, handles[: index + 1], node) is handles[index]
        return answer

    return owns


def _first_accepting(graph, handles: list[ProviderHandle], node) -> ProviderHandle | None:
    shapes, dtypes, layouts = input_facts(graph, node)
    for handle in handles:
        if handle.supports_op(node, node.opset, shapes, dtypes, layouts).is_supported:
            return handle
    return None


def run_custom_passes(graph, handles: list[ProviderHandle], applied: list[str], early: bool = False) -> list[str]:
    """Each provider's ``custom_passes``, in provider order, after the optimizer passes ``applied``;
    returns the names of all passes that changed the graph. The result is re-validated (SSA, no
    cycles, every read defined) before placement. With ``early``, only the passes marked
    ``before_optimizer`` (run before the generic optimizer), else only the others."""
    changed = list(applied)
    _run_passes(graph, handles, changed, early)
    _run_in_subgraphs(graph, handles, changed, early, {})
    if changed:
        graph.nodes = _ordered(graph, changed)
    return changed


def _run_passes(graph, handles: list[ProviderHandle], changed: list[str], early: bool) -> bool:
    """Each provider's passes over ``graph`` itself; the names of those that changed it are appended to ``changed``."""
    before = len(changed)
    for index, handle in enumerate(handles):
        owns = _ownership(graph, handles, index)
        for graph_pass in handle.hook.custom_passes() or []:
            if bool(getattr(graph_pass, "before_optimizer", False)) != early:
                continue
            name = f"{handle.name}:{getattr(graph_pass, '__name__', type(graph_pass).__name__)}"
            try:
                if graph_pass(graph, owns) if _takes_owns(graph_pass) else graph_pass(graph):
                    changed.append(name)
            except OnnxRuntimeError:
                raise
            except Exception as exc:
                raise ProviderError(f"graph pass {name} failed: {type(exc).__name__}: {exc}") from exc
    return len(changed) > before


def _ordered(graph, changed: list[str]) -> list:
    try:
        return topological_order(graph, set(graph.outer_names))
    except InvalidGraphError as exc:
        raise InvalidGraphError(f"graph passes {changed} left an invalid graph: {exc}") from exc


_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def _run_in_subgraphs(graph, handles: list[ProviderHandle], changed: list[str], early: bool, outer: dict) -> bool:
    """The passes over every If branch and Loop/Scan body, depth first, so a branch a streaming model runs per call
    gets the fusions a top-level graph would. The enclosing graphs' weights are lent to the subgraph as initializers
    while its passes run (passes find constants there) and taken back after: a node that still reads one reads it
    from the outer scope, as before. Returns whether any subgraph changed."""
    visible = {**outer, **graph.initializers}
    any_changed = False
    for node in graph.nodes:
        if node.op_type not in _CONTROL_FLOW or node.domain not in ("", "ai.onnx"):
            continue  # a fused node's own subgraph (a segment's body) is the provider's, already fused
        for sub in node.subgraphs():
            lent = {name: visible[name] for name in sub.outer_names
                    if name in visible and name not in sub.initializers}
            sub.initializers.update(lent)
            marks: list[str] = []
            try:
                _run_passes(sub, handles, marks, early)
                _run_in_subgraphs(sub, handles, marks, early, visible)
            finally:
                for name, array in lent.items():
                    if sub.initializers.get(name) is array:
                        del sub.initializers[name]
            if marks:
                any_changed = True
                changed.extend(mark for mark in marks if mark not in changed)
                sub.outer_names = sorted(outer_reads(sub, set(sub.outer_names) | set(lent)))
                sub.nodes = _ordered(sub, changed)
    return any_changed


_TAKES_OWNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _takes_owns(graph_pass) -> bool:
    """Whether a provider pass takes ``owns``, asked once per pass object: inspect.signature costs tens of us,
    and every creation and specialization runs every pass."""
    try:
        return _TAKES_OWNS[graph_pass]
    except (KeyError, TypeError):  # not asked yet, or not weakly referable / hashable
        pass
    answer = len(inspect.signature(graph_pass).parameters) >= 2
    try:
        _TAKES_OWNS[graph_pass] = answer
    except TypeError:
        pass
    return answer
