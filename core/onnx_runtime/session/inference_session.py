"""``InferenceSession``: the onnxruntime Python API over the plugin runtime."""

from __future__ import annotations

import threading
import time
import weakref
from operator import itemgetter

import numpy as np

from .. import budget, run_scope
from ..dtypes import DataType
from ..errors import InvalidArgumentError
from ..functions import FunctionExpander
from ..ir import Model, TypeInfo
from ..loader import load_model
from ..logs import SessionLog
from ..memory.session import MAP_WEIGHTS_KEY, governed
from ..optimizer import optimize
from ..ort_value import OrtValue, device_handle
from ..provider_handle import ProviderHandle
from ..tensor import Tensor
from .cached_plans import CachedSpecializer, encode_creation, open_plans, read_creation, store_creation
from .collector import creation_paused, largest_weights, session_dropped, witness
from .custom_passes import run_custom_passes
from .executor import Executor, graph_slot_of
from .feed_types import check_type_and_shape
from .io_binding import IOBinding
from .model_info import ModelMetadata, NodeArg
from .options import RunOptions, SessionOptions
from .placement import Placement, place
from .profiling import Profile
from .provider_setup import FALLBACK_KEY, create_handles, resolve_providers
from .specialize import Specializer
from .strict import STRICT_KEY


def session_config(options: SessionOptions) -> dict[str, str]:
    """The session-wide settings providers may honour (``initialize``'s ``session_config``): thread
    counts, determinism and the CPU memory arena under onnxruntime's config-key names, plus every
    config entry."""
    config = {
        "session.intra_op_num_threads": str(int(options.intra_op_num_threads)),
        "session.inter_op_num_threads": str(int(options.inter_op_num_threads)),
        "session.use_deterministic_compute": "1" if options.use_deterministic_compute else "0",
        "session.enable_cpu_mem_arena": "1" if options.enable_cpu_mem_arena else "0",
    }
    config.update(options.config())
    return config


def _weak(method):
    """``method`` called through a weak reference to its session: the specializer the session holds calls back
    into it without a reference cycle (which would keep a dropped session's memory until a cyclic collection)."""
    ref = weakref.WeakMethod(method)

    def call(graph):
        bound = ref()
        assert bound is not None  # (the session, whose specializer calls this, is alive while it does)
        return bound(graph)

    return call


class InferenceSession:
    """Load a model, place its nodes on providers, and run it (the onnxruntime API)."""

    def __init__(self, path_or_bytes, sess_options: SessionOptions | None = None, providers=None,
                 provider_options=None, **kwargs):
        # (weak references only, held by the finalizer; each generic executor adds its own, _place_generic)
        self._witnesses: list = []
        with creation_paused():
            self._create(path_or_bytes, sess_options, providers, provider_options, kwargs)
        weights = sum(getattr(value, "nbytes", 0) for value in self._model.graph.initializers.values())
        witness(self._witnesses, self._specializer, *largest_weights(self._model.graph))
        weakref.finalize(self, session_dropped, weights, self._witnesses)

    def _create(self, path_or_bytes, sess_options, providers, provider_options, kwargs) -> None:
        unknown = set(kwargs) - {"disabled_optimizers"}
        if unknown:
            raise InvalidArgumentError(f"unexpected InferenceSession arguments {sorted(unknown)}")
        self._sess_options = sess_options or SessionOptions()
        self._max_value_bytes = budget.parse_budget(self._sess_options.config())
        self._source = path_or_bytes  # set_providers re-creates the session from it
        self._profiling_start_ns = time.time_ns()
        self._profile: Profile | None = Profile() if self._sess_options.enable_profiling else None
        began = time.perf_counter()
        requested = resolve_providers(providers, provider_options)
        self._handles = create_handles(requested, session_config(self._sess_options))
        self._run_scopes = tuple(handle.run_scope for handle in self._handles if handle.run_scope is not None)
        # Keyed by each handle's full name, whichever name (full or short) the caller used.
        self._provider_options = {handle.name: dict(opts) for handle in self._handles
                                  for name, opts in requested if handle.matches(name)}
        self._disabled = kwargs.get("disabled_optimizers") or ()
        map_weights = _config_flag(self._sess_options, MAP_WEIGHTS_KEY, default="1")
        self._plans = open_plans(self._sess_options, session_config(self._sess_options), path_or_bytes,
                                 self._handles, self._provider_options, self._disabled)
        try:  # the optimized graph as an earlier process made it (plan_cache.py), else the model as loaded
            cached = read_creation(self._plans, path_or_bytes, map_weights) if self._plans is not None else None
            self._model = cached.model if cached is not None else load_model(
                path_or_bytes, free_dims=self._sess_options.free_dimension_overrides(), map_weights=map_weights)
        except BaseException:
            for handle in self._handles:  # made first: the plan cache's key names them
                handle.shutdown()
            raise
        if cached is not None:
            self._applied_passes, folded = cached.applied, cached.folded
        loaded = time.perf_counter()
        self._model_path = path_or_bytes if isinstance(path_or_bytes, str) else None
        graph = self._model.graph
        encoded = None
        if cached is None:
            weights, folded = dict(graph.initializers), {}
            early = run_custom_passes(graph, self._handles, [], early=True)
            optimized = optimize(graph, self._handles, self._sess_options.graph_optimization_level,
                                 disabled=self._disabled, folded=folded)
            self._applied_passes = run_custom_passes(graph, self._handles, early + optimized)
            if self._plans is not None:
                encoded = encode_creation(self._plans, self._model, weights, self._applied_passes, folded)
        self._specializer = self._specializer_for(graph, folded)
        self._strict = _config_flag(self._sess_options, STRICT_KEY)
        self._generic: tuple[Placement, Executor] | None = None
        self._generic_lock = threading.Lock()
        # A cached graph that specializes per signature runs the generic plan only where a signature misses, and
        # the process that wrote it placed it: its placement waits for that use (or for placement()).
        placed = cached.placed if cached is not None and self._specializer is not None else None
        if placed is None:
            assignment = self._place_generic()
        else:
            assignment = {handle.name: handle for handle in self._handles if handle.name in placed}
        self._memory = governed(self, f"session {id(self):x}", graph, assignment, session_config(self._sess_options))
        if self._generic is not None:
            self._memory.attach(self._generic[1])
        if _config_flag(self._sess_options, GRAPH_CAPTURE_KEY):
            from .device_graphs import DeviceGraphRunner  # only sessions that ask for capture load it
            self._executor.graphs = DeviceGraphRunner(self._executor)
        self._inputs = [NodeArg.of(vi) for vi in graph.inputs]
        self._outputs = [NodeArg.of(vi) for vi in graph.outputs]
        self._input_types = {vi.name: vi.type for vi in graph.inputs}
        self._accepted_feeds: set[tuple] = set()  # (name, dtype, shape) of arrays _check_feed passed as they are
        self._feed_checks = {name: check for name, info in self._input_types.items()
                             if (check := _array_check(info)) is not None}
        self._all_feeds_check = _all_feeds_check(self._input_types)
        self._output_types = {vi.name: vi.type for vi in graph.outputs}
        self._output_names = tuple(vi.name for vi in graph.outputs)
        # Plan the full run now, as onnxruntime does: kernels are created and copies decided at
        # session creation, so their errors surface here and placement() shows the copies. A cached plan
        # (made by an earlier process) with specializations runs them instead: its generic kernels wait for a use.
        if cached is None or self._specializer is None:
            self._placement.copies = self._executor.plan(self._output_names).copies
        if encoded is not None and self._plans is not None:  # placed and planned: its creation went through
            store_creation(self._plans, encoded, sorted({handle.name for handle in assignment.values()}))
        if self._sess_options.optimized_model_filepath:
            from ..serialize import save_model  # only sessions that ask for the file load the writer
            save_model(self._model, self._sess_options.optimized_model_filepath)
        self._log = SessionLog(self._sess_options.log_severity_level,
                               self._sess_options.logid or f"InferenceSession-{id(self):x}")
        if self._log.enabled(1):
            self._log_creation(path_or_bytes, time.perf_counter() - began)
        if self._profile is not None:
            source = "model_loading_uri" if isinstance(path_or_bytes, str) else "model_loading_array"
            self._profile.session_event(source, began, loaded - began)
            self._profile.session_event("session_initialization", loaded, time.perf_counter() - loaded)
        self._closed = False

    def _place_generic(self) -> dict[str, ProviderHandle]:
        """Place the session's graph and make its generic executor (unplanned); the assignment."""
        if self._specializer is not None:
            self._specializer.snapshot()  # its copy of the graph as the passes left it, before placement changes it
        placement, assignment = place(self._model.graph, self._handles, FunctionExpander(self._model.functions))
        executor = Executor(self._model.graph, assignment, placement)
        executor.strict = self._strict
        self._generic = (placement, executor)
        witness(self._witnesses, executor)
        return assignment

    def _generic_plan(self) -> tuple[Placement, Executor]:
        """The generic placement and executor, made at first use where creation deferred them."""
        generic = self._generic
        if generic is None:
            with self._generic_lock:
                if self._generic is None:
                    self._place_generic()
                    assert self._generic is not None
                    self._memory.attach(self._generic[1])
                generic = self._generic
        return generic

    @property
    def _executor(self) -> Executor:
        return self._generic_plan()[1]

    @property
    def _placement(self) -> Placement:
        return self._generic_plan()[0]

    def _log_creation(self, source, seconds: float) -> None:
        log, graph = self._log, self._model.graph
        label = repr(source) if isinstance(source, str) else "(from bytes)"
        log.info("created from model %s in %.1f ms: %d nodes, opsets %s", label, seconds * 1e3, len(graph.nodes),
                 dict(self._model.opsets))
        log.info("providers: %s; graph passes applied: %s", self.get_providers(), self._applied_passes or "none")
        counts: dict[str, int] = {}
        for placed in self._placement:
            counts[placed.provider] = counts.get(placed.provider, 0) + 1
        log.info("placement: %s; %d copies inserted", counts, len(self._placement.copies))
        if log.enabled(0):
            for placed in self._placement:
                declined = "".join(f"; {name} declined: {why}" for name, why in placed.rejected.items())
                log.verbose("node %r (%s) runs on %s%s", placed.node, placed.op_type, placed.provider, declined)

    def _specializer_for(self, graph, folded: dict) -> Specializer | None:
        """Shape specialization (session/specialize.py) for a graph whose inputs have symbolic dimensions,
        when the optimizer runs, every provider works on the host and the config does not turn it off
        (``session.specialize_shapes`` = "0")."""
        if self._model.inference_proto is None or self._sess_options.graph_optimization_level < 1 \
                or not _config_flag(self._sess_options, SPECIALIZE_KEY, default="1") \
                or _config_flag(self._sess_options, GRAPH_CAPTURE_KEY) \
                or not all(handle.is_host_accessible for handle in self._handles) \
                or all(vi.type.static_shape is not None or not vi.type.is_tensor for vi in graph.inputs):
            return None
        inputs = [vi.name for vi in graph.inputs]
        if self._plans is not None:
            return CachedSpecializer(graph, inputs, self._model.inference_proto, self._handles, self._model,
                                     _weak(self._optimize_specialized), _weak(self._plan_specialized), self._plans,
                                     folded)
        return Specializer(graph, inputs, self._model.inference_proto, self._handles, _weak(self._specialize), folded)

    def _specialize(self, graph) -> Executor:
        """The optimizer, the providers' passes, placement and a planned executor over ``graph`` (a copy of
        this session's graph with the shapes of one input signature)."""
        return self._plan_specialized(self._optimize_specialized(graph))

    def _optimize_specialized(self, graph):
        early = run_custom_passes(graph, self._handles, [], early=True)
        applied = optimize(graph, self._handles, self._sess_options.graph_optimization_level, disabled=self._disabled,
                           specialized=True)
        run_custom_passes(graph, self._handles, early + applied)
        return graph

    def _plan_specialized(self, graph) -> Executor:
        placement, assignment = place(graph, self._handles, FunctionExpander(self._model.functions))
        executor = Executor(graph, assignment, placement)
        executor.strict = self._strict
        executor.plan(self._output_names)  # kernels made now, as at session creation
        return executor

    def graph_for(self, input_feed: dict):
        """The graph a run with ``input_feed`` executes: its specialization for these inputs' shapes (made now
        if new), or the session's graph (``model.graph``)."""
        return self._executor_for(self._validate_feeds(input_feed)).graph

    def _executor_for(self, feeds: dict) -> Executor:
        if self._specializer is None:
            return self._executor
        return self._specializer.executor_for(feeds) or self._executor

    def _executor_for_signature(self, signature: tuple) -> Executor:
        if self._specializer is None:
            return self._executor
        return self._specializer.executor_for_signature(signature) or self._executor

    def _signature_order(self, names: tuple[str, ...]):
        """Where a bound run's inputs ``names`` are the model's: what takes their shapes, in that order, to
        _executor_for_signature's signature (else None: the run asks _executor_for with its feeds)."""
        return None if self._specializer is None else self._specializer.signature_order(names)

    # -- the onnxruntime API --------------------------------------------------------------------
    def get_inputs(self) -> list[NodeArg]:
        return list(self._inputs)

    def get_outputs(self) -> list[NodeArg]:
        return list(self._outputs)

    def get_overridable_initializers(self) -> list[NodeArg]:
        return []

    def get_providers(self) -> list[str]:
        return [h.name for h in self._handles]

    def get_provider_options(self) -> dict[str, dict]:
        return {h.name: dict(self._provider_options.get(h.name, {})) for h in self._handles}

    def get_session_options(self) -> SessionOptions:
        return self._sess_options

    def get_modelmeta(self) -> ModelMetadata:
        m = self._model
        return ModelMetadata(
            producer_name=m.producer_name, graph_name=m.graph.name, domain=m.domain,
            description=m.doc_string, graph_description=m.graph.doc, version=m.model_version,
            custom_metadata_map=dict(m.metadata),
        )

    def provider_handle(self, name: str) -> ProviderHandle:
        """The handle of a provider this session uses (by full or short name)."""
        for handle in self._handles:
            if handle.matches(name):
                return handle
        raise InvalidArgumentError(f"this session does not use provider {name!r}; it uses {self.get_providers()}")

    def applied_passes(self) -> list[str]:
        """Names of the graph passes that changed this session's graph: the optimizer's
        (``optimizer:<pass>``, per ``graph_optimization_level``), then the providers' (``provider:pass``)."""
        return list(self._applied_passes)

    def placement(self) -> Placement:
        """Each node's provider, every declining provider's reason, and the inserted copies."""
        return self._placement

    def memory_report(self) -> dict:
        """The device budgets of the process, this session's weight residency and its allocation sites
        (memory/session.py)."""
        return self._memory.report()

    def device_graph_status(self) -> str:
        """How the last run executed: "replaying" (a device graph), or "eager: <why not a graph>".

        Capture is enabled with ``SessionOptions.add_session_config_entry("session.graph_capture", "1")``.
        """
        return self._executor.device_graph_status()

    @property
    def model(self) -> Model:
        return self._model

    def run(self, output_names, input_feed: dict, run_options: RunOptions | None = None) -> list:
        """Run the model; return the requested outputs (all when ``output_names`` is None) as numpy arrays."""
        token = budget.enter(self._max_value_bytes, run_options)  # what one value may take; terminate mid-run
        scopes = run_scope.enter(self._run_scopes)  # the providers' per-session settings (intra-op threads)
        try:
            return self._run(output_names, input_feed, run_options)
        finally:
            run_scope.leave(scopes)
            budget.leave(token)

    def _run(self, output_names, input_feed: dict, run_options: RunOptions | None = None) -> list:
        self._check_runnable(run_options)
        names = self._output_names
        if output_names:  # (only names the caller gave need checking)
            names = tuple(output_names)
            for name in names:
                if name not in self._output_names:
                    raise InvalidArgumentError(
                        f"unknown output {name!r}; the model's outputs are {list(self._output_names)}"
                    )
        feeds = self._validate_feeds(input_feed)
        executor = self._executor_for(feeds)
        if executor.ran:
            return self._execute(executor, feeds, names, run_options)
        # A plan's first run links and binds its kernels (thousands of objects that live as long as the plan):
        # paused and promoted as creation is, so that no later collection of the young generations scans them
        # inside a run (a one-off 0.2-0.7 ms in a 0.1 ms call).
        executor.ran = True
        with creation_paused():
            return self._execute(executor, feeds, names, run_options)

    def _execute(self, executor: Executor, feeds: dict, names: tuple, run_options: RunOptions | None) -> list:
        slot = graph_slot_of(run_options)
        logged = self._log.severity == 0 or (run_options is not None and run_options.log_severity_level == 0)
        if self._profile is None and not logged:
            return executor.run(feeds, names, slot=slot)
        start = time.perf_counter()
        outputs = executor.run(feeds, names, self._profile, slot=slot)
        if self._profile is not None:
            self._profiled_run(start)
        if logged:
            self._log_run(names, outputs, run_options, time.perf_counter() - start)
        return outputs

    def _log_run(self, names: tuple, outputs: list, run_options: RunOptions | None, seconds: float) -> None:
        tag = f" {run_options.run_tag!r}" if run_options is not None and run_options.run_tag else ""
        log = self._log if self._log.severity == 0 or run_options is None \
            else SessionLog(0, run_options.logid or self._log.logid)
        shapes = {n: list(np.shape(v)) for n, v in zip(names, outputs)}
        log.verbose("run%s: %.3f ms, outputs %s", tag, seconds * 1e3, shapes)

    def _profiled_run(self, start: float) -> None:
        profile = self._profile
        assert profile is not None
        seconds = time.perf_counter() - start
        profile.runs.append(seconds)
        profile.session_event("model_run", start, seconds)

    def run_with_ort_values(self, output_names, input_dict_ort_values: dict, run_options: RunOptions | None = None
                            ) -> list[OrtValue]:
        """Run on ``OrtValue`` feeds; return the outputs as host ``OrtValue`` objects (onnxruntime's method)."""
        if not isinstance(input_dict_ort_values, dict):
            raise InvalidArgumentError("input_dict_ort_values must be a dict of input name -> OrtValue")
        for name, value in input_dict_ort_values.items():
            if not isinstance(value, OrtValue):
                raise InvalidArgumentError(
                    f"input {name!r} is a {type(value).__name__}; run_with_ort_values takes OrtValue feeds "
                    f"(OrtValue.ortvalue_from_numpy(array)), run() takes arrays"
                )
        outputs = self.run(output_names, input_dict_ort_values, run_options)
        return [OrtValue(Tensor.from_numpy(np.asarray(value))) for value in outputs]

    def run_async(self, output_names, input_feed: dict, callback, user_data=None,
                  run_options: RunOptions | None = None) -> None:
        """Run on another thread and call ``callback(results, user_data, error)`` there, as onnxruntime does:
        ``error`` is "" on success, else the failure's message (and ``results`` is None)."""
        if not callable(callback):
            raise InvalidArgumentError(f"callback must be callable, got {type(callback).__name__}")

        def work() -> None:
            try:
                results = self.run(output_names, input_feed, run_options)
            except Exception as exc:  # reported to the callback, as onnxruntime reports a status string
                callback(None, user_data, f"{type(exc).__name__}: {exc}")
                return
            callback(results, user_data, "")

        threading.Thread(target=work, name="onnx-runtime-run-async", daemon=True).start()

    def set_providers(self, providers=None, provider_options=None) -> None:
        """Re-create this session on other providers (onnxruntime's method): the model is loaded, optimized and
        placed again from the path or bytes it was created from."""
        source = self._source
        self.close()
        with creation_paused():
            self._create(source, self._sess_options, providers, provider_options,
                         {"disabled_optimizers": self._disabled} if self._disabled else {})

    def disable_fallback(self) -> None:
        """onnxruntime's switch for its retry on the CPU provider when a provider fails at creation; it maps to
        the session config entry ``session.provider_fallback`` read when the session is (re-)created."""
        self._sess_options.add_session_config_entry(FALLBACK_KEY, "0")

    def enable_fallback(self) -> None:
        self._sess_options.add_session_config_entry(FALLBACK_KEY, "1")

    def get_profiling_start_time_ns(self) -> int:
        """When this session's profile began, in nanoseconds since the epoch."""
        return self._profiling_start_ns

    def _check_runnable(self, run_options: RunOptions | None) -> None:
        if self._closed:
            raise InvalidArgumentError("this session was closed; create a new InferenceSession")
        if run_options is not None and run_options.terminate:
            raise InvalidArgumentError("run_options.terminate is set; the run was cancelled before it started")

    # -- IO binding -----------------------------------------------------------------------------
    def io_binding(self) -> IOBinding:
        """Bind inputs and outputs to values on the host or a device (see :mod:`.io_binding`)."""
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding, run_options: RunOptions | None = None) -> None:
        """Run with the binding's inputs; its outputs are then read with ``get_outputs``/``copy_outputs_to_cpu``."""
        token = budget.enter(self._max_value_bytes, run_options)  # the same limit on one value as run()
        scopes = run_scope.enter(self._run_scopes)
        try:
            self._run_with_iobinding(iobinding, run_options)
        finally:
            run_scope.leave(scopes)
            budget.leave(token)

    def _run_with_iobinding(self, iobinding: IOBinding, run_options: RunOptions | None) -> None:
        self._check_runnable(run_options)
        names = iobinding._output_names()
        if not names:
            raise InvalidArgumentError(
                f"no output is bound; bind at least one with bind_output (the model's outputs are "
                f"{list(self._output_names)})"
            )
        feeds = iobinding._feeds()
        self._check_missing(feeds)
        start = time.perf_counter()
        # Outputs that all stay on devices read nothing back: their validation waits for a host-visible read.
        outputs = self._executor.run_bound(feeds, names, iobinding._device_outputs(), self._profile,
                                           graph_slot_of(run_options), iobinding._outputs_stay_on_devices(),
                                           iobinding._copied_outputs())
        if self._profile is not None:
            self._profiled_run(start)
        iobinding._deliver(outputs)

    # -- persistent device bindings (session/device_io_binding.py) ------------------------------------
    def device_io_binding(self, spec, provider: str | None = None):
        """A :class:`DeviceIoBinding`: a buffer on ``provider``'s device (default: this session's first device
        provider, else its first provider) bound to the input and/or output ``spec`` names. A
        ``DeviceBindingSpec`` allocates it; an ``ExternalMemorySpec`` borrows caller-owned memory."""
        from .device_io_binding import DeviceBindingSpec, DeviceIoBinding, ExternalMemorySpec, binding_dtype, track

        self._check_runnable(None)
        if not isinstance(spec, DeviceBindingSpec | ExternalMemorySpec):
            raise InvalidArgumentError(f"expected a DeviceBindingSpec or ExternalMemorySpec, got {type(spec).__name__}")
        handle = self.provider_handle(provider) if provider else next(
            (h for h in self._handles if not h.is_host_accessible), self._handles[0])
        dtype = binding_dtype(spec.dtype)
        for kind, name in (("input", spec.input_name if spec.bind_input else ""), ("output", spec.output_name)):
            if not name:
                continue
            info = self._check_input_name(name) if kind == "input" else self._check_output_name(name)
            if info.kind != "tensor" or (info.dtype is not None and info.dtype is not dtype):
                raise InvalidArgumentError(
                    f"{kind} {name!r} is {info.describe()}, but the binding's dtype is {dtype.name}; bind it "
                    f"with the model's element type"
                )
        if isinstance(spec, ExternalMemorySpec):
            return track(DeviceIoBinding.from_external_memory(handle, spec), self)
        token = budget.enter(self._max_value_bytes)  # one binding is one value: the same limit as a run's
        try:
            return track(DeviceIoBinding.allocate(handle, spec), self)
        finally:
            budget.leave(token)

    def run_with_device_bindings(self, bindings, input_feed: dict | None = None, output_names=None,
                                 run_options: RunOptions | None = None, single_token_step: bool = False,
                                 epilogue=None) -> list:
        """Run with ``bindings`` (DeviceIoBindings of this session) as inputs and outputs, plus the host
        ``input_feed``. Bound outputs are written into their bindings; the return value lists the host outputs
        ``output_names`` (default: every output no binding receives). ``single_token_step`` shows masks marked
        ``decode_freeze_safe_mask`` at capacity; ``run_options`` may select the device-graph slot (a
        verification step's "device_graph.slot" = "verify"). ``epilogue`` (a :class:`.device_step.StepEpilogue`)
        launches device work after the outputs are written, captured with the run where it is replayed. See
        :mod:`.device_binding_run`."""
        from .device_binding_run import SessionSide, run_with_device_bindings

        self._check_runnable(run_options)
        side = SessionSide(tuple(self._handles), self._output_names, self._checked_input, self._check_output_name,
                           self._check_bound, self._check_missing, self._executor_for, self._executor, self._profile)
        token = budget.enter(self._max_value_bytes, run_options)  # the same limit on one value as run()
        scopes = run_scope.enter(self._run_scopes)
        try:
            return run_with_device_bindings(side, bindings, input_feed, output_names, single_token_step, run_options,
                                            epilogue)
        finally:
            run_scope.leave(scopes)
            budget.leave(token)

    def prepare_device_binding_run(self, bindings, output_names=None):
        """For a loop that runs with the same host ``bindings`` every call (a decode loop on the CPU provider): a
        callable ``run(single_token_step=False)`` doing what ``run_with_device_bindings(bindings, output_names=...,
        single_token_step=...)`` does, with the bindings laid out and checked once, now; its ``held()`` enters the
        session's per-run scopes once for a loop of such runs. None where a binding or a provider is not in host
        memory (run each step with ``run_with_device_bindings``)."""
        from .device_binding_run import PreparedRun, SessionSide, prepared_host_run

        self._check_runnable(None)
        side = SessionSide(tuple(self._handles), self._output_names, self._checked_input, self._check_output_name,
                           self._check_bound, self._check_missing, self._executor_for, self._executor, self._profile,
                           self._executor_for_signature, self._signature_order)
        prepared = prepared_host_run(side, bindings, output_names)
        if prepared is None:
            return None
        return PreparedRun(prepared, lambda: self._closed, self._max_value_bytes, self._run_scopes)

    def _device_handle(self, device_type: str, device_id: int) -> ProviderHandle:
        """This session's provider on ``device_type:device_id``, else the process-wide handle of that device."""
        kind = str(device_type).lower()
        for handle in self._handles:
            if not handle.is_host_accessible and handle.device_id.type.value == kind \
                    and handle.device_id.index == int(device_id):
                return handle
        return device_handle(kind, int(device_id))

    def _checked_input(self, name: str, value):
        return _check_feed(name, value, self._check_input_name(name))

    def _check_input_name(self, name: str) -> TypeInfo:
        expected = self._input_types.get(name)
        if expected is None:
            raise InvalidArgumentError(f"unknown input {name!r}; the model's inputs are {list(self._input_types)}")
        return expected

    def _check_output_name(self, name: str) -> TypeInfo:
        expected = self._output_types.get(name)
        if expected is None:
            raise InvalidArgumentError(f"unknown output {name!r}; the model's outputs are {list(self._output_names)}")
        return expected

    def _check_bound(self, name: str, tensor: Tensor, output: bool) -> None:
        """A tensor bound to an input or output: its type and shape against the model's, without reading it."""
        expected = self._check_output_name(name) if output else self._check_input_name(name)
        if expected.kind != "tensor":
            raise InvalidArgumentError(f"{name!r} is a {expected.describe()}; only tensors can be bound")
        check_type_and_shape("output" if output else "input", name, tensor.dtype, tensor.shape, expected)

    # -- profiling (SessionOptions.enable_profiling) -----------------------------------------------
    def profile_summary(self) -> dict[str, tuple[float, int]]:
        """Per operator (and "copy"): total seconds and calls over the profiled runs so far."""
        if self._profile is None:
            raise InvalidArgumentError("profiling is off; set SessionOptions.enable_profiling = True")
        return dict(sorted(self._profile.items(), key=lambda item: -item[1][0]))

    @property
    def profiled_runs(self) -> int:
        """How many runs the profile summarizes."""
        return len(self._profile.runs) if self._profile is not None else 0

    def end_profiling(self) -> str:
        """Write the profile as onnxruntime does, a Chrome-trace JSON event list (session/profiling.py) that
        chrome://tracing and Perfetto open, and return the file's path; a new profile begins. With profiling off,
        return "" as onnxruntime does."""
        if self._profile is None:
            return ""
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
        path = f"{self._sess_options.profile_file_prefix}_{stamp}_{time.perf_counter_ns() % 1000:03d}.json"
        self._profile.write(path)
        self._profile = Profile()
        return path

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._specializer is not None:
            self._specializer.close()
        from .device_io_binding import release_session_bindings

        release_session_bindings(self)  # before the graphs they recorded and the providers their memory is on
        if self._generic is not None:
            self._generic[1].close()
        self._memory.close()  # after the executor: its weights and values are freed, their charges go back
        for handle in self._handles:
            handle.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- feeds ----------------------------------------------------------------------------------
    def _validate_feeds(self, input_feed) -> dict:
        check = self._all_feeds_check
        if check is not None and type(input_feed) is dict:
            feeds = check(input_feed)  # every input an array taken as it is, and nothing else: as checked below
            if feeds is not None:
                return feeds
        if not isinstance(input_feed, dict):
            raise InvalidArgumentError(
                f"input_feed must be a dict of input name -> array, got {type(input_feed).__name__}"
            )
        feeds = {}
        accepted = self._accepted_feeds  # checked once per name, dtype and shape: a decode loop feeds the same
        checks = self._feed_checks
        for name, value in input_feed.items():
            if type(value) is np.ndarray:
                check = checks.get(name)
                if (check is not None and check(value)) or (name, value.dtype, value.shape) in accepted:
                    feeds[name] = value
                    continue
            feeds[name] = _check_feed(name, value, self._check_input_name(name))
            if feeds[name] is value and type(value) is np.ndarray:
                if len(accepted) >= 256:  # shapes without bound (a growing past): start over
                    accepted.clear()
                accepted.add((name, value.dtype, value.shape))
        self._check_missing(feeds)
        return feeds

    def _check_missing(self, feeds: dict) -> None:
        missing = [n for n in self._input_types if n not in feeds]
        if missing:
            details = ", ".join(f"{n!r} ({self._input_types[n].describe()})" for n in missing)
            raise InvalidArgumentError(f"missing inputs {details}; add them to input_feed (or bind them)")


GRAPH_CAPTURE_KEY = "session.graph_capture"  # "1": capture runs into device graphs and replay them
SPECIALIZE_KEY = "session.specialize_shapes"  # "0": no per-signature specialization (session/specialize.py)


def _config_flag(options: SessionOptions, key: str, default: str = "0") -> bool:
    value = options.config().get(key, default).strip().lower()
    if value not in ("0", "1"):
        raise InvalidArgumentError(f"session config entry {key!r} must be '0' or '1', got {value!r}")
    return value == "1"


def _array_check(expected: TypeInfo):
    """A test that an array is a feed ``expected`` takes as it is (its dtype, rank and fixed dimensions), which
    ``_check_feed`` would pass unchanged; None where that needs the general check. A decode loop's feeds have a
    new shape every step, so a cache of checked shapes misses there."""
    if expected.kind != "tensor" or expected.dtype is None or expected.dtype is DataType.STRING:
        return None
    try:
        dtype = expected.dtype.numpy
    except InvalidArgumentError:
        return None
    if expected.shape is None:
        return lambda value: value.dtype == dtype
    rank = len(expected.shape)
    fixed = [(axis, want) for axis, want in enumerate(expected.shape) if isinstance(want, int)]
    if not fixed:
        return lambda value: value.dtype == dtype and value.ndim == rank
    axes = [axis for axis, _ in fixed]
    get = itemgetter(*axes) if len(axes) > 1 else itemgetter(slice(axes[0], axes[0] + 1))
    wanted = tuple(want for _, want in fixed)
    return lambda value: value.dtype == dtype and value.ndim == rank and get(value.shape) == wanted


def _all_feeds_check(types: dict[str, TypeInfo]):
    """One function of a feed dict that gives a new dict of its values where it holds exactly the inputs of
    ``types``, each an array ``_array_check`` passes (so ``_validate_feeds`` would take each as it is and miss none),
    and None otherwise (the general checks then say what is wrong, or convert); None where an input needs the
    general check. Straight-line code over the inputs: a decode step's seven feeds cost about as much through the
    per-input checks as a small kernel."""
    if not types:  # (no inputs: nothing to check)
        return None
    scope: dict = {"ndarray": np.ndarray, "count": len(types)}
    loads, tests, items = [], [], []
    for index, (name, expected) in enumerate(types.items()):
        if expected.kind != "tensor" or expected.dtype is None or expected.dtype is DataType.STRING:
            return None
        try:
            scope[f"d{index}"] = expected.dtype.numpy
        except InvalidArgumentError:
            return None
        scope[f"n{index}"] = name  # (names reach the code as values, never as source)
        value = f"v{index}"
        loads.append(f"        {value} = feed[n{index}]\n")
        tests += [f"type({value}) is not ndarray", f"{value}.dtype != d{index}"]
        if expected.shape is not None:
            tests.append(f"{value}.ndim != {len(expected.shape)}")
            tests += [f"{value}.shape[{axis}] != {int(want)}" for axis, want in enumerate(expected.shape)
                      if isinstance(want, int)]
        items.append(f"n{index}: {value}")
    source = ("def check(feed):\n    if len(feed) != count:\n        return None\n    try:\n"
              + "".join(loads) + "    except KeyError:\n        return None\n"
              + f"    if {' or '.join(tests) or 'False'}:\n        return None\n"
              + f"    return {{{', '.join(items)}}}\n")
    exec(compile(source, "<feeds check>", "exec"), scope)  # noqa: S102 (generated from ints and scope names)
    return scope.pop("check")  # (out of its own globals: no reference cycle to wait for a cyclic collection)


def _check_feed(name: str, value, expected: TypeInfo):
    if expected.kind == "sparse_tensor":  # no kernel takes one, and a raw protobuf passed unchecked reached Cast
        raise InvalidArgumentError(f"input {name!r} is declared as a sparse tensor, which this runtime does not take "
                                   f"as a feed; declare the input as a dense tensor and feed a numpy array")
    if expected.kind != "tensor":
        return value  # sequences/optionals are checked by the operators that consume them
    if isinstance(value, OrtValue):
        value = value.tensor
    if isinstance(value, Tensor):
        value = value.numpy()
    if not isinstance(value, np.ndarray):
        if isinstance(value, (list, tuple, int, float, bool, str, np.generic)):
            try:
                value = np.asarray(value, dtype=expected.dtype.numpy if expected.dtype is not None else None)
            except (TypeError, ValueError) as exc:
                raise InvalidArgumentError(
                    f"input {name!r} expects {expected.describe()}; {value!r} cannot be converted ({exc}); "
                    f"pass a numpy array"
                ) from None
        else:
            raise InvalidArgumentError(
                f"input {name!r} must be a numpy array, got {type(value).__name__}; pass np.asarray(value)"
            )
    got = DataType.from_numpy(value.dtype) if value.dtype.kind not in "OUS" else DataType.STRING
    check_type_and_shape("input", name, got, value.shape, expected, value.dtype)
    if got is DataType.STRING and value.dtype.kind != "O":
        value = value.astype(object)
    return value

