"""Session profiles: per-operator totals, and the Chrome-trace event list onnxruntime writes.

onnxruntime's ``end_profiling()`` writes a JSON array of complete ("ph": "X") events: "Session" events for model
loading, session initialization and each run, and a "Node" event per node run, named ``<node>_kernel_time``, whose
args carry the operator, the provider and the input and output types and shapes. chrome://tracing, Perfetto and
onnxruntime's own profile analysers read that format; this module records and writes the same.
"""

from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

from ..dtypes import DataType


class Profile(dict):
    """Per-operator ``(seconds, calls)`` (the run loop adds them; ``InferenceSession.profile_summary`` reads them),
    and the trace events since the profile began."""

    def __init__(self, start_ns: int | None = None):
        super().__init__()
        self.start_ns = time.perf_counter_ns() if start_ns is None else start_ns
        self.events: list[dict] = []
        self.runs: list[float] = []
        self._pid = os.getpid()

    def _us(self, seconds: float) -> int:
        return int((seconds * 1e9 - self.start_ns) // 1000)

    def session_event(self, name: str, start: float, seconds: float, args: dict | None = None) -> None:
        """A "Session" event: ``start`` is a ``time.perf_counter()`` reading, ``seconds`` its duration."""
        self.events.append(self._event("Session", name, start, seconds, args or {}))

    def record_node(self, step, start: float, seconds: float, inputs, outputs) -> None:
        """A "Node" event for one step of the run loop (a node's kernel, or an inserted copy)."""
        node = step.node
        if node is None:
            name, args = f"{step.provider}_copy_kernel_time", {"op_name": "MemcpyToHost", "provider": step.provider}
        else:
            name = f"{node.name or node.op_type}_kernel_time"
            args = {"op_name": node.op_type, "provider": step.provider}
        args["input_type_shape"] = [_type_shape(value) for value in inputs]
        args["output_type_shape"] = [_type_shape(value) for value in outputs]
        self.events.append(self._event("Node", name, start, seconds, args))

    def _event(self, category: str, name: str, start: float, seconds: float, args: dict) -> dict:
        return {"cat": category, "pid": self._pid, "tid": threading.get_native_id(), "dur": int(seconds * 1e6),
                "ts": max(self._us(start), 0), "ph": "X", "name": name, "args": args}

    def write(self, path: str) -> None:
        with open(path, "w") as handle:
            json.dump(sorted(self.events, key=lambda event: event["ts"]), handle, indent=0)


def _type_shape(value) -> dict:
    """``{"float": [2, 3]}`` as onnxruntime writes a value's type and shape; ``{}`` for an absent optional."""
    shape = getattr(value, "shape", None)
    dtype = getattr(value, "dtype", None)
    if shape is None or dtype is None:
        return {} if value is None else {type(value).__name__: []}
    try:
        kind = dtype if isinstance(dtype, DataType) else DataType.from_numpy(np.dtype(dtype))
    except Exception:  # a dtype with no ONNX type (an object array of other values): name numpy's
        return {str(dtype): list(shape)}
    return {kind.ort_type[len("tensor("):-1]: [int(d) for d in shape]}
