"""The generic graph optimizer: provider-independent rewrites run at session creation, before the
providers' ``custom_passes`` and placement.

A pass is ``pass_(graph, context) -> bool``: it rewrites an :class:`onnx_runtime.ir.Graph` in place
(nodes stay topologically ordered, ``value_info`` describes the values that exist) and says whether
it changed anything. :func:`optimize` runs the passes a level enables, in order, round after round
until a round changes nothing, then does the same in every subgraph (If/Loop/Scan bodies).
"""

from __future__ import annotations

from ..ir import Graph, Node
from ..provider_handle import ProviderHandle
from .context import PassContext
from .rewrite import visit_subgraphs

# GraphOptimizationLevel values (not imported: the session package imports this one).
ENABLE_BASIC = 1
ENABLE_EXTENDED = 2

# Each round can only shrink the graph; real models settle in two or three.
MAX_ROUNDS = 8


def _passes() -> tuple[tuple, tuple]:
    """(the basic passes, all passes), their modules imported at the first optimization: a process whose plans
    come from the plan cache runs none of them (importing the fusions costs a few ms)."""
    from .attention_fusion import fuse_attention
    from .constant_folding import fold_constants
    from .conv_fusion import fuse_batchnorm_affine, fuse_conv_add, fuse_conv_batchnorm, fuse_conv_mul
    from .elimination import collapse_reshapes, drop_empty_concat_parts, eliminate_identities, remove_dead_nodes
    from .gemm_fusion import fuse_gemm_add, fuse_matmul_add, unflatten_gemm
    from .sibling_matmul_fusion import fuse_sibling_matmuls
    from .symbolic_dims import refine_symbolic_dims

    basic = (fold_constants, drop_empty_concat_parts, eliminate_identities, remove_dead_nodes)
    return basic, basic + (
        fuse_conv_batchnorm, fuse_conv_mul, fuse_conv_add, fuse_batchnorm_affine, unflatten_gemm, fuse_matmul_add,
        fuse_gemm_add, refine_symbolic_dims, fuse_attention, fuse_sibling_matmuls, collapse_reshapes,
    )


def __getattr__(name: str):
    if name in ("BASIC_PASSES", "ALL_PASSES"):
        basic, every = _passes()
        globals().update(BASIC_PASSES=basic, ALL_PASSES=every)
        return basic if name == "BASIC_PASSES" else every
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def passes_for(level: int) -> tuple:
    """The passes ``SessionOptions.graph_optimization_level`` enables: none, the basic ones
    (folding and removals), or all of them (EXTENDED and ALL: the fusions too)."""
    if level < ENABLE_BASIC:
        return ()
    basic, every = _passes()
    return basic if level < ENABLE_EXTENDED else every


def optimize(graph: Graph, handles: list[ProviderHandle], level: int, disabled=(),
             folded: dict | None = None, specialized: bool = False) -> list[str]:
    """Optimize ``graph`` (and its subgraphs) in place; return the names (``optimizer:<pass>``) of
    the passes that changed it. ``disabled`` names passes to skip (``fold_constants`` or
    ``optimizer:fold_constants``); ``folded``, when given, receives the small values constant folding
    computed (see PassContext.folded); ``specialized`` says ``graph`` is specialized to one input signature
    (see PassContext.specialized)."""
    skipped = {name.removeprefix("optimizer:") for name in disabled}
    passes = [p for p in passes_for(level) if p.__name__ not in skipped]
    applied: list[str] = []
    if passes:
        context = PassContext(graph, handles)
        context.folded = folded
        context.specialized = specialized
        _optimize(graph, passes, context, applied)
    return [f"optimizer:{name}" for name in applied]


def _optimize(graph: Graph, passes, context: PassContext, applied: list[str]) -> None:
    if any(_reads_graph_by_name(node) for node in graph.nodes):
        return
    for _ in range(MAX_ROUNDS):
        changed = False
        for graph_pass in passes:
            if graph_pass(graph, context):
                changed = True
                if graph_pass.__name__ not in applied:
                    applied.append(graph_pass.__name__)
        if not changed:
            break
    visit_subgraphs(graph, context, lambda sub: _optimize(sub, passes, context, applied))


def _reads_graph_by_name(node: Node) -> bool:
    """Gradient differentiates nodes of its graph named in its attributes, not through its inputs:
    its graph must stay exactly as written."""
    return node.op_type == "Gradient" and node.domain == "ai.onnx.preview.training"


__all__ = ["ALL_PASSES", "BASIC_PASSES", "PassContext", "optimize", "passes_for"]
