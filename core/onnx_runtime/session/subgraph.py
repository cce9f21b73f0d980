"""Subgraphs (If branches, Loop and Scan bodies) compiled for the control-flow kernels that run them.

A control-flow kernel lives in a provider, but running a graph is the session's job: placement,
function expansion, planning and the executor. :class:`Subgraph` packages that for a kernel. The
values a subgraph reads from enclosing scopes arrive as the control-flow node's implicit inputs
(after its explicit ones, in :func:`onnx_runtime.loader.implicit_inputs` order), and the kernel
passes them to :meth:`Subgraph.run` by name.
"""

from __future__ import annotations

from ..functions import FunctionExpander
from ..ir import Graph, TypeInfo
from ..provider_handle import ProviderHandle
from .executor import Executor
from .placement import place


class Subgraph:
    def __init__(self, graph: Graph, handles: list[ProviderHandle], functions: dict | None = None):
        placement, assignment = place(graph, handles, FunctionExpander(functions))
        self.graph = graph
        self.placement = placement
        self.executor = Executor(graph, assignment, placement)
        self.input_names = [vi.name for vi in graph.inputs]
        self.output_names = tuple(vi.name for vi in graph.outputs)
        self.outer_names = list(graph.outer_names)
        self.executor.plan(self.output_names)

    @property
    def output_types(self) -> list[TypeInfo]:
        return [vi.type for vi in self.graph.outputs]

    def run(self, inputs: list, outer: dict | None = None) -> list:
        """Run with positional ``inputs`` (the subgraph's formal inputs) and outer-scope values."""
        feeds = dict(outer or {})
        feeds.update(zip(self.input_names, inputs))
        return self.executor.run(feeds, self.output_names)
