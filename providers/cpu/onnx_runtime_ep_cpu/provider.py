"""CPUExecutionProvider: numpy kernels behind the provider contract.

Host memory, copies, fences and allocation counters are the contract's defaults, which are exactly
right for the host; this provider adds what is CPU-specific: which operators it runs and their
kernels, chosen from the opset-versioned registry, its graph fusions, and the CPU memory arena
(see arena.py).
"""

from __future__ import annotations

from onnx_runtime import KernelMatch, hookimpl
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from . import ops  # noqa: F401  (fills the registry)
from .arena import apply_arena_settings
from .conv_fusions import CONV_PASSES
from .decoder_fusions import DECODER_PASSES
from .fusions import PASSES
from .precision_fusions import PRECISION_PASSES
from .qdq_fusions import QDQ_PASSES
from .registry import NEEDS, lookup, registered_versions
from .threads import apply_thread_settings


class CPUExecutionProvider:
    def __init__(self):
        self._handle = None
        self.memory_arena = None  # ArenaStatus: whether malloc keeps freed buffers for reuse, and why

    @hookimpl
    def initialize(self, options, handle, session_config):
        if options:
            raise InvalidArgumentError(
                f"CPUExecutionProvider accepts no provider options, got {sorted(options)}; remove them"
            )
        self._handle = handle
        apply_thread_settings(session_config)
        self.memory_arena = apply_arena_settings(session_config)

    @hookimpl
    def name(self):
        return "CPUExecutionProvider"

    @hookimpl
    def short_name(self):
        return "cpu"

    @hookimpl
    def supports_op(self, node, opset):
        if lookup(node.op_type, node.domain, opset) is not None:
            return KernelMatch.supported(cost=1.0)
        domain = node.domain or "ai.onnx"
        versions = registered_versions(node.op_type, node.domain)
        if versions:
            return KernelMatch.unsupported(
                f"CPUExecutionProvider implements {domain}::{node.op_type} from opset {versions[0]}, the model "
                f"uses opset {opset}; re-export the model with a newer opset"
            )
        return KernelMatch.unsupported(
            f"CPUExecutionProvider has no kernel for {domain}::{node.op_type}; use a provider that implements "
            f"it or replace the operator in the model"
        )

    @hookimpl
    def custom_passes(self):
        # PRECISION_PASSES run before the generic optimizer; decoder passes read what PASSES fuse
        return [*PRECISION_PASSES, *QDQ_PASSES, *PASSES, *CONV_PASSES, *DECODER_PASSES]

    @hookimpl
    def get_kernel(self, node, shapes, opset, graph):
        factory = lookup(node.op_type, node.domain, opset)
        if factory is None:
            raise InvalidGraphError(
                f"node {node.name!r}: CPUExecutionProvider has no kernel for {node.op_type} at opset {opset}"
            )
        needs = NEEDS.get(factory)
        if needs:
            extras = {"handle": self._handle, "graph": graph}
            return factory(node, shapes, opset, **{name: extras[name] for name in needs})
        return factory(node, shapes, opset)
