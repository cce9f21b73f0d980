"""Session and run options, with the attribute names onnxruntime users already know."""

from __future__ import annotations

import enum

from ..errors import ConfigEntryNotSetError, InvalidArgumentError


class GraphOptimizationLevel(enum.IntEnum):
    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3  # onnxruntime's layout passes; here as EXTENDED (layouts are the providers' choice)
    ORT_ENABLE_ALL = 99


class ExecutionMode(enum.IntEnum):
    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class ExecutionOrder(enum.IntEnum):
    """onnxruntime's node orders; nodes run here in the topological order placement fixed, for every value."""

    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


_ENUMS = {"graph_optimization_level": GraphOptimizationLevel, "execution_mode": ExecutionMode,
          "execution_order": ExecutionOrder}
_INTS = ("intra_op_num_threads", "inter_op_num_threads", "log_severity_level", "log_verbosity_level")
_BOOLS = ("enable_profiling", "enable_mem_pattern", "enable_mem_reuse", "enable_cpu_mem_arena",
          "use_deterministic_compute", "use_per_session_threads", "only_execute_path_to_fetches", "terminate")


class _Options:
    """Attributes as onnxruntime's options objects have them: a misspelled name is an ``AttributeError`` (not a
    silently ignored new attribute), and an enum or number of the wrong type a ``TypeError``."""

    _sealed = False

    def __setattr__(self, name: str, value) -> None:
        if self._sealed and not name.startswith("_") and name not in self.__dict__:
            import difflib
            close = difflib.get_close_matches(name, [n for n in self.__dict__ if not n.startswith("_")], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}{hint}")
        object.__setattr__(self, name, _checked(type(self).__name__, name, value))

    def _seal(self) -> None:
        object.__setattr__(self, "_sealed", True)


def _checked(owner: str, name: str, value):
    kind = _ENUMS.get(name)
    if kind is not None:
        if isinstance(value, kind):
            return value
        if isinstance(value, int) and not isinstance(value, bool) and value in kind._value2member_map_:
            return kind(value)
        raise TypeError(f"{owner}.{name} takes a {kind.__name__} ({', '.join(kind.__members__)}), got {value!r}")
    if name in _INTS and (not isinstance(value, int) or isinstance(value, bool)):
        raise TypeError(f"{owner}.{name} takes an int, got {value!r}")
    if name in _BOOLS and not isinstance(value, (bool, int)):
        raise TypeError(f"{owner}.{name} takes a bool, got {value!r}")
    return value


class SessionOptions(_Options):
    """Options for :class:`InferenceSession` (the onnxruntime attribute names)."""

    def __init__(self):
        self.graph_optimization_level = GraphOptimizationLevel.ORT_ENABLE_ALL
        self.execution_mode = ExecutionMode.ORT_SEQUENTIAL
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.enable_profiling = False
        self.profile_file_prefix = "onnx_runtime_profile"
        self.log_severity_level = 2
        self.log_verbosity_level = 0
        self.logid = ""
        self.optimized_model_filepath = ""
        self.enable_mem_pattern = True
        self.enable_mem_reuse = True
        self.enable_cpu_mem_arena = True
        self.use_deterministic_compute = False
        self.use_per_session_threads = True
        self.execution_order = ExecutionOrder.DEFAULT
        self._config: dict[str, str] = {}
        self._free_dimension_overrides: dict[str, int] = {}  # dim_param -> value, applied at creation
        self._free_dimension_denotations: dict[str, int] = {}  # dimension denotation -> value
        self._seal()

    def add_free_dimension_override_by_name(self, dim_name: str, dim_value: int) -> None:
        """Fix the model's symbolic dimension ``dim_name`` to ``dim_value`` wherever a graph input declares it."""
        self._free_dimension_overrides[_dim_key(dim_name)] = _dim_value(dim_name, dim_value)

    def add_free_dimension_override_by_denotation(self, dim_denotation: str, dim_value: int) -> None:
        """Fix every graph-input dimension whose denotation is ``dim_denotation`` (e.g. "DATA_BATCH")."""
        self._free_dimension_denotations[_dim_key(dim_denotation)] = _dim_value(dim_denotation, dim_value)

    def free_dimension_overrides(self) -> tuple[dict[str, int], dict[str, int]]:
        """The overrides by name and by denotation."""
        return dict(self._free_dimension_overrides), dict(self._free_dimension_denotations)

    def register_custom_ops_library(self, library_path: str) -> None:
        """onnxruntime loads custom-operator shared libraries built against its C API; they cannot run here.
        Custom operators come from a provider plugin instead (docs/writing-a-provider.md)."""
        from ..errors import NotSupportedError
        raise NotSupportedError(
            f"custom operator library {library_path!r} is built for onnxruntime's C API and cannot be loaded by "
            f"onnx-runtime; implement the operators in an execution provider plugin (docs/writing-a-provider.md)"
        )

    def has_providers(self) -> bool:
        return False  # providers are named at InferenceSession(providers=...), not added to the options

    def add_session_config_entry(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError("session config keys are non-empty strings, e.g. 'session.profile'")
        self._config[key] = str(value)

    def get_session_config_entry(self, key: str) -> str:
        try:
            return self._config[key]
        except KeyError:
            raise ConfigEntryNotSetError(f"session config entry {key!r} is not set; set it with "
                                         f"add_session_config_entry") from None

    def config(self) -> dict[str, str]:
        return dict(self._config)


def _dim_key(name) -> str:
    if not isinstance(name, str) or not name:
        raise InvalidArgumentError(f"a free dimension is named by a non-empty string, got {name!r}")
    return name


def _dim_value(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"free dimension {name!r} override must be an int >= 0, got {value!r}")
    return value


class RunOptions(_Options):
    """Per-run options (onnxruntime names); ``terminate`` set before a run cancels it."""

    def __init__(self):
        self.log_severity_level = 2
        self.log_verbosity_level = 0
        self.logid = ""
        self.run_tag = ""
        self.terminate = False
        self.only_execute_path_to_fetches = False
        self._config: dict[str, str] = {}
        self._seal()

    def add_run_config_entry(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(
                "run config keys are non-empty strings, e.g. 'memory.enable_memory_arena_shrinkage'")
        self._config[key] = str(value)

    def get_run_config_entry(self, key: str) -> str:
        try:
            return self._config[key]
        except KeyError:
            raise ConfigEntryNotSetError(f"run config entry {key!r} is not set; set it with add_run_config_entry") \
                from None
