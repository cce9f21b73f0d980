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
from .steps import run_steps, to_host


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

    def runner(self, names: list[str]):
        """``run(values) -> outputs``: this subgraph (one without formal inputs: an If branch) run with
        ``values`` as the outer-scope values ``names``. The plan and its feed slots are resolved here, once,
        so a call fills the slots and runs the steps (no feed dict, no plan lookup): a streaming model runs
        its branches on every call."""
        executor = self.executor
        plan = executor.plan(self.output_names)
        slots = [(plan.feed_slots[name], index) for index, name in enumerate(names) if name in plan.feed_slots]
        output_slots = plan.output_slots

        def run(values) -> list:
            if self.input_names or not executor.runs_plain:
                return self.run([], dict(zip(names, values)))
            env = list(plan.template)
            for slot, index in slots:
                env[slot] = values[index]
            run_steps(plan, env)
            return [to_host(env[slot]) for slot in output_slots]

        return run
