"""Session and run options, with the attribute names onnxruntime users already know."""

from __future__ import annotations

import enum

from ..errors import InvalidArgumentError


class GraphOptimizationLevel(enum.IntEnum):
    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_ALL = 99


class ExecutionMode(enum.IntEnum):
    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class SessionOptions:
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
        self._config: dict[str, str] = {}

    def add_session_config_entry(self, key: str, value: str) -> None:
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError("session config keys are non-empty strings, e.g. 'session.profile'")
        self._config[key] = str(value)

    def get_session_config_entry(self, key: str) -> str:
        try:
            return self._config[key]
        except KeyError:
            raise InvalidArgumentError(f"session config entry {key!r} is not set") from None

    def config(self) -> dict[str, str]:
        return dict(self._config)


class RunOptions:
    """Per-run options (onnxruntime names); ``terminate`` set before a run cancels it."""

    def __init__(self):
        self.log_severity_level = 2
        self.log_verbosity_level = 0
        self.logid = ""
        self.run_tag = ""
        self.terminate = False
        self.only_execute_path_to_fetches = False
