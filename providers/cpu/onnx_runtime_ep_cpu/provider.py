"""CPUExecutionProvider: numpy kernels behind the provider contract.

Host memory, copies, fences and allocation counters are the contract's defaults, which are exactly
right for the host; this provider adds what is CPU-specific: which operators it runs and their
kernels, chosen from the opset-versioned registry, its graph fusions, and the CPU memory arena
(see arena.py).
"""

from __future__ import annotations

import importlib
import sys
import warnings

from onnx_runtime import KernelMatch, hookimpl
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from . import fused_shapes, ops  # noqa: F401  (fill the registry and the fused operators' shape rules)
from .arena import ARENA_KEY, apply_arena_settings
from .compiled import deferred
from .registry import HINTS, NEEDS, lookup, registered_versions
from .threads import apply_thread_settings

# The fusion passes, by the module that defines each list: imported at the first use of a list (this module's
# attribute, so a test may replace one), since a session whose plan is cached (onnx_runtime/plan_cache.py) runs none.
_PASS_MODULES = {"PRECISION_PASSES": "precision_fusions", "QDQ_PASSES": "qdq_fusions", "PASSES": "fusions",
                 "DYNAMIC_CONV_PASSES": "dynamic_conv_fusions",
                 "CONV_PASSES": "conv_fusions", "DECODER_PASSES": "decoder_fusions", "HEADS_PASSES": "attention_heads",
                 "RECURRENT_PASSES": "recurrent_fusions", "SPECTRAL_PASSES": "spectral_fusions",
                 "QDQ_EPILOGUE_PASSES": "qdq_epilogues", "DYNAMIC_EPILOGUE_PASSES": "dynamic_epilogues",
                 "NORM_PASSES": "norm_projections", "LAYOUT_PASSES": "transpose_sinking"}


def __getattr__(name: str):
    module = _PASS_MODULES.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f"{__package__}.{module}"), name)
    return value


class CPUExecutionProvider:
    def __init__(self):
        self._handle = None
        self._config: dict[str, str] = {}  # the session's config entries, for the kernels that read one
        self.memory_arena = None  # ArenaStatus: whether malloc keeps freed buffers for reuse, and why

    @hookimpl
    def initialize(self, options, handle, session_config):
        session_config = dict(session_config or {})
        if _provider_options(options or {}, session_config).get("use_arena") is False:
            session_config[ARENA_KEY] = "0"
        self._handle, self._config = handle, session_config
        run = apply_thread_settings(session_config)  # the session's own count, entered at each of its runs
        if handle is not None:
            handle.set_run_scope(run.enter, run.leave)
        self.memory_arena = apply_arena_settings(session_config)
        deferred.open_session(session_config)  # first runs may use numpy while numba loads in the background

    @hookimpl
    def name(self):
        return "CPUExecutionProvider"

    @hookimpl
    def short_name(self):
        return "cpu"

    @hookimpl
    def contract_version(self):
        return "1.1"

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
        # PRECISION_PASSES run before the generic optimizer; decoder passes read what PASSES fuse, and the heads
        # pass the layout pairs decoder passes make; the roundings left then become their producers' epilogues, and
        # normalizations fold into the projections (made by the heads passes) that alone read them; Transposes
        # cancel (LAYOUT_PASSES) before PASSES fuse a residual Add that the cancelling leaves channels-last
        this = sys.modules[__name__]
        return [*this.PRECISION_PASSES, *this.QDQ_PASSES, *this.DYNAMIC_CONV_PASSES, *this.RECURRENT_PASSES,
                *this.SPECTRAL_PASSES, *this.LAYOUT_PASSES, *this.PASSES, *this.DYNAMIC_EPILOGUE_PASSES,
                *this.CONV_PASSES, *this.DECODER_PASSES, *this.HEADS_PASSES, *this.QDQ_EPILOGUE_PASSES,
                *this.NORM_PASSES]

    @hookimpl
    def get_kernel(self, node, shapes, opset, graph):
        deferred.before_kernel_build()
        factory = lookup(node.op_type, node.domain, opset)
        if factory is None:
            raise InvalidGraphError(
                f"node {node.name!r}: CPUExecutionProvider has no kernel for {node.op_type} at opset {opset}"
            )
        needs = NEEDS.get(factory, ()) + HINTS.get(factory, ())
        if needs:
            extras = {"handle": self._handle, "graph": graph, "config": self._config}
            return factory(node, shapes, opset, **{name: extras[name] for name in needs})
        return factory(node, shapes, opset)


# onnxruntime's CPU provider options. Host buffers come from malloc here (arena.py), so `use_arena` = 0 turns the
# arena thresholds off like `enable_cpu_mem_arena`, and `arena_extend_strategy` has nothing to steer: it is checked
# and accepted so scripts written for onnxruntime run unchanged.
_ARENA_STRATEGIES = ("kNextPowerOfTwo", "kSameAsRequested", "0", "1")
STRICT_OPTIONS_KEY = "session.strict_provider_options"  # "0": warn about unknown provider options, as a switch


def _provider_options(options: dict, session_config: dict) -> dict:
    """The checked CPU provider options; an unknown one is an error (a warning with the switch above set to
    "0", as onnxruntime ignores unknown options)."""
    checked: dict = {}
    for key, value in options.items():
        text = str(value).strip()
        if key == "use_arena":
            if text.lower() not in ("0", "1", "true", "false"):
                raise InvalidArgumentError(f"CPUExecutionProvider option use_arena is {value!r}; pass '0' or '1'")
            checked[key] = text.lower() in ("1", "true")
        elif key == "arena_extend_strategy":
            if text not in _ARENA_STRATEGIES:
                raise InvalidArgumentError(
                    f"CPUExecutionProvider option arena_extend_strategy is {value!r}; pass one of "
                    f"{list(_ARENA_STRATEGIES)}"
                )
            checked[key] = text
        else:
            message = (f"CPUExecutionProvider has no option {key!r}; it takes use_arena and arena_extend_strategy "
                       f"(set session config entry {STRICT_OPTIONS_KEY!r} to '0' to ignore unknown options as "
                       f"onnxruntime does)")
            if session_config.get(STRICT_OPTIONS_KEY, "1") == "0":
                warnings.warn(f"onnx-runtime: ignoring {message}", RuntimeWarning, stacklevel=2)
            else:
                raise InvalidArgumentError(message)
    return checked
