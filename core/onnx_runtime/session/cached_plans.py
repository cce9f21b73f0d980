"""A session's side of the plan cache (plan_cache.py): its optimized graph read or written at creation, and
its specializations per input signature read or written at their first run.

Whatever fails while reading a plan (a file that passed its checksums but does not convert, a reference the
model no longer holds) costs a warning and the full path, never a wrong session.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import onnx

from .. import plan_cache
from ..errors import OnnxRuntimeError
from ..ir import Graph, Model
from ..loader import SHAPE_VALUE_LIMIT, SerializedModel, initializer_arrays, model_of, read_model
from ..memory import MemoryBudgetError
from ..plan_cache import PlanCache
from ..records import Record
from .executor import Executor
from .specialize import Specializer

# Options that change nothing a plan holds (names, logging, profiling, the optimized model's file).
_NOT_KEYED = frozenset({"logid", "log_severity_level", "log_verbosity_level", "enable_profiling",
                        "profile_file_prefix", "optimized_model_filepath", "_sealed"})


def open_plans(options, config: dict[str, str], source, handles, provider_options: dict,
               disabled) -> PlanCache | None:
    """The plan cache of a session, or None (off, or a source the cache does not key)."""
    keyed = dict(config)
    keyed.update((f"option:{name}", repr(value)) for name, value in sorted(vars(options).items())
                 if name not in _NOT_KEYED)
    keyed["providers:options"] = repr(sorted((name, sorted(opts.items())) for name, opts in provider_options.items()))
    keyed["disabled_optimizers"] = repr(sorted(disabled or ()))
    return plan_cache.open_cache(keyed, source, handles)


class CachedCreation(Record):
    __match_args__ = ("model", "applied", "folded", "placed")
    model: Model
    applied: list[str]
    folded: dict[str, np.ndarray]
    placed: list[str] | None  # the providers the writer's generic placement used (written after it placed)

    def __init__(self,
                 model: Model, applied: list[str], folded: dict[str, np.ndarray],
                 placed: list[str] | None = None) -> None:
        self.model = model
        self.applied = applied
        self.folded = folded
        self.placed = placed


def read_creation(plans: PlanCache, source, map_weights: bool) -> CachedCreation | None:
    """The model with its cached optimized graph, the passes that made it and the constants creation folded;
    None when no usable plan is cached."""
    found = plans.load("graph")
    if found is None:
        return None
    meta, sections = found
    proto, path, mapped = read_model(source, map_weights)  # the loader's own errors, as without a cache
    try:
        references = list(meta["references"])
        weights = initializer_arrays(proto, mapped, references)
        # (its nodes converted at their first use: a signature plan read from the cache needs none of them)
        graph = plan_cache.decode_graph(sections["graph"], references, weights, lazy=True)
        # (parsed at its first read: the specializer reads it only for a signature the cache misses)
        light = SerializedModel(sections["inference"]) if "inference" in sections else None
        folded = plan_cache.decode_arrays(sections["folded"])
        placed = [str(name) for name in meta["placed"]] if isinstance(meta.get("placed"), list) else None
        return CachedCreation(model_of(proto, path, graph, light), [str(p) for p in meta["applied"]], folded, placed)
    except Exception as exc:  # a plan that does not read back: the full path makes the session
        _unusable(plans, "graph", exc)
        return None


def encode_creation(plans: PlanCache, model: Model, weights: dict[str, np.ndarray], applied: list[str],
                    folded: dict[str, np.ndarray]) -> tuple[dict, dict[str, bytes]] | None:
    """(meta, sections) of the session's optimized graph, encoded before placement (which may expand function
    calls in place); None where it is not cached. ``weights``: the model's initializers as loaded."""
    try:
        encoded = plan_cache.encode_graph(model, model.graph, weights, plans.max_plan_bytes)
    except OnnxRuntimeError:
        return None  # an attribute ONNX cannot hold (a provider's object): this plan is not cached
    if encoded is None:
        return None
    data, references = encoded
    sections = {"graph": data, "folded": plan_cache.encode_arrays(
        {name: value for name, value in folded.items()
         if isinstance(value, np.ndarray) and value.size <= SHAPE_VALUE_LIMIT and value.dtype.kind in "biuf"})}
    if model.inference_proto is not None:
        sections["inference"] = model.inference_proto.SerializeToString()
    return {"references": references, "applied": list(applied)}, sections


def store_creation(plans: PlanCache, encoded: tuple[dict, dict[str, bytes]] | None, placed: list[str]) -> None:
    """Write what ``encode_creation`` made once the session placed (and planned) its graph, with the providers
    placement used: a cached graph is one that placed, so a later session may defer its generic placement."""
    if encoded is not None:
        meta, sections = encoded
        plans.store("graph", {**meta, "placed": list(placed)}, sections)


def _unusable(plans: PlanCache, part: str, exc: Exception) -> None:
    warnings.warn(f"onnx-runtime: the cached plan {plans.path(part)!r} could not be used ({type(exc).__name__}: "
                  f"{exc}); planning anew", RuntimeWarning, stacklevel=3)


class CachedSpecializer(Specializer):
    """A :class:`Specializer` whose specialized graphs (after the optimizer and the providers' passes) are read
    from the plan cache when cached and written to it when made."""

    def __init__(self, graph: Graph, inputs: list[str], proto: onnx.ModelProto | SerializedModel, handles, model: Model,
                 optimize: Callable[[Graph], Graph], plan: Callable[[Graph], Executor], plans: PlanCache,
                 folded: dict | None = None):
        super().__init__(graph, inputs, proto, handles, None, folded)
        self._model = model
        self._weights = dict(graph.initializers)  # shared by every specialization (clone_graph keeps arrays)
        self._optimize = optimize
        self._plan = plan
        self._plans = plans
        self._encoded: tuple[bytes, list[str]] | None = None

    def prepare(self, graph: Graph) -> Executor:
        """The optimizer and the providers' passes, the result written to the plan cache, then the plan."""
        graph = self._optimize(graph)
        try:  # written as the passes left it: placement may expand function calls in place
            self._encoded = plan_cache.encode_graph(self._model, graph, self._weights, self._plans.max_plan_bytes)
        except OnnxRuntimeError:
            self._encoded = None  # an attribute ONNX cannot hold (a provider's object): not cached
        return self._plan(graph)

    def _build(self, dims: tuple) -> Executor | None:
        part = plan_cache.signature_part(dims)
        found = self._plans.load(part)
        if found is not None:
            meta, sections = found
            try:
                return self._plan(plan_cache.decode_graph(sections["graph"], list(meta["references"]),
                                                          self._weights))
            except MemoryBudgetError:  # the plan is sound; its activations do not fit the host budget
                raise
            except Exception as exc:  # the full path below makes it (and rewrites the file)
                _unusable(self._plans, part, exc)
        self._encoded = None
        executor = super()._build(dims)
        if executor is not None and self._encoded is not None:
            data, references = self._encoded
            self._plans.store(part, {"references": references}, {"graph": data})
        self._encoded = None
        return executor
