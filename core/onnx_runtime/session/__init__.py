"""The session layer: placement, the planned executor, and the onnxruntime-style InferenceSession."""

from .inference_session import InferenceSession, ModelMetadata, NodeArg
from .options import ExecutionMode, ExecutionOrder, GraphOptimizationLevel, RunOptions, SessionOptions
from .placement import NodePlacement, Placement

__all__ = [
    "ExecutionMode", "ExecutionOrder", "GraphOptimizationLevel", "InferenceSession", "ModelMetadata", "NodeArg",
    "NodePlacement", "Placement", "RunOptions", "SessionOptions",
]
