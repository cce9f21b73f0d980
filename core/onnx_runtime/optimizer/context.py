"""What passes need beyond the graph: the session's providers (to evaluate and place nodes), fresh value
names, and, in a subgraph, what the enclosing graphs know (their constants and value types)."""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np

from ..devices import TensorLayout
from ..dtypes import DataType
from ..ir import Graph, Node, ValueInfo
from ..provider_handle import ProviderHandle


class FreshNames:
    """Value and node names no graph of the model uses yet (subgraphs included, so no body sees one shadowed)."""

    def __init__(self, graph: Graph):
        self._names = _all_names(graph)

    def __call__(self, base: str) -> str:
        name, index = base, 0
        while name in self._names:
            index += 1
            name = f"{base}_{index}"
        self._names.add(name)
        return name


class PassContext:
    def __init__(self, graph: Graph, handles: list[ProviderHandle]):
        self.handles = list(handles)
        self._fresh = FreshNames(graph)
        # Constants and value infos of the enclosing graphs while a pass runs on a subgraph (empty at the top):
        # a branch reads its graph's shapes and constants by name, and folds with them.
        self.outer_constants: Mapping[str, np.ndarray] = {}
        self.outer_types: Mapping[str, ValueInfo] = {}
        # Where set, constant folding records here the small values it computed (by name, in any graph):
        # shape specialization tells onnx inference about them (session/specialize.py).
        self.folded: dict[str, np.ndarray] | None = None
        # Set for a graph specialized to one input signature (session/specialize.py): its static shapes are what
        # inference computed for those shapes, and no later inference round reads its values by name, so passes
        # may rest rewrites on them (a Slice over a whole static axis is then an identity). Off inside subgraphs:
        # a loop body's inferred shapes may hold for its first iteration only.
        self.specialized = False
        # How many subgraphs deep the pass runs (0: the model's main graph, whose nodes every run executes).
        self.depth = 0
        # Bytes of large generated constants folded so far in this optimization (constant_folding.py bounds them).
        self.generated_resident = 0

    @contextmanager
    def inside(self, parent: Graph) -> Iterator[None]:
        """Passes run meanwhile on a subgraph of ``parent``: its constants and types become the outer ones."""
        saved = self.outer_constants, self.outer_types, self.specialized
        self.outer_constants = ChainMap(parent.initializers, saved[0])  # type: ignore[arg-type]
        self.outer_types = ChainMap(parent.value_info, saved[1])  # type: ignore[arg-type]
        self.specialized = False
        self.depth += 1
        try:
            yield
        finally:
            self.outer_constants, self.outer_types, self.specialized = saved
            self.depth -= 1

    def fresh(self, base: str) -> str:
        """A value or node name no graph of the model uses yet (so no subgraph can see it shadowed)."""
        return self._fresh(base)

    def provider_for(self, node: Node, graph: Graph, host_only: bool = False) -> ProviderHandle | None:
        """The first provider (session priority order) that accepts ``node``, as placement would choose."""
        shapes, dtypes = [], []
        for name in node.inputs:
            info = graph.type_of(name) if name else None
            shapes.append(info.shape if info is not None and info.is_tensor else None)
            dtypes.append(info.dtype if info is not None else None)
        return self._first_supporting(node, shapes, dtypes, host_only)

    def evaluate(self, node: Node, graph: Graph, inputs: list[np.ndarray | None]) -> tuple | None:
        """Run ``node`` once on constant ``inputs`` with a host provider's kernel; None when no host
        provider runs it or it fails (the run then reports the failure as it would have)."""
        shapes = [None if a is None else tuple(a.shape) for a in inputs]
        dtypes = [None if a is None else _dtype(a) for a in inputs]
        try:
            handle = self._first_supporting(node, shapes, dtypes, host_only=True)
            if handle is None:
                return None
            kernel = handle.hook.get_kernel(node=node, shapes=shapes, opset=node.opset, graph=graph)
            results = kernel(*inputs)
        except Exception:
            return None
        return tuple(results) if isinstance(results, (tuple, list)) else None

    def _first_supporting(self, node, shapes, dtypes, host_only) -> ProviderHandle | None:
        layouts = [TensorLayout.default()] * len(node.inputs)
        for handle in self.handles:
            if host_only and not handle.is_host_accessible:
                continue
            if handle.supports_op(node, node.opset, shapes, dtypes, layouts):
                return handle
        return None


def _dtype(array: np.ndarray) -> DataType | None:
    try:
        return DataType.from_numpy(array.dtype)
    except Exception:
        return None


def _all_names(graph: Graph) -> set[str]:
    names = set(graph.initializers) | set(graph.value_info) | {vi.name for vi in graph.inputs + graph.outputs}
    for node in graph.nodes:
        names.add(node.name)
        names.update(node.inputs)
        names.update(node.outputs)
        for sub in node.subgraphs():
            names |= _all_names(sub)
    return names
