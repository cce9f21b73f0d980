"""Providers' graph passes (``custom_passes``) at session creation and specialization: each provider's passes
in provider order, each fusing only the nodes placement would give that provider."""

from __future__ import annotations

import inspect
import weakref

from ..contract.kernels import input_facts
from ..errors import InvalidGraphError, OnnxRuntimeError, ProviderError
from ..loader import topological_order
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
    if changed:
        try:
            graph.nodes = topological_order(graph, set(graph.outer_names))
        except InvalidGraphError as exc:
            raise InvalidGraphError(f"graph passes {changed} left an invalid graph: {exc}") from exc
    return changed


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
