"""Shared helpers: tiny ONNX models built in code, and paths to the onnx package's shipped models."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper


def _providers_installed() -> bool:
    from importlib.metadata import entry_points

    return bool(entry_points(group="onnx_runtime.providers"))


# With no provider installed (tox -e core) only tests/core_only runs; with providers, everything else.
collect_ignore = ["sample_provider"] + (["core_only"] if _providers_installed() else [])
collect_ignore_glob = [] if _providers_installed() else ["test_*.py"]

LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
LIGHT_MODELS = sorted(f[:-5] for f in os.listdir(LIGHT_DIR) if f.endswith(".onnx"))


def tensor_info(name, elem=TensorProto.FLOAT, shape=None):
    return helper.make_tensor_value_info(name, elem, shape)


def make_model(nodes, inputs, outputs, initializers=(), opset=17, **kwargs) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test_graph", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **kwargs)
    model.ir_version = 8
    return model


@pytest.fixture
def chain_model():
    """y = Softmax(Relu(x) + b) * x: Relu/Add/Mul can run on the sample device, Softmax cannot."""
    b = onnx.numpy_helper.from_array(np.linspace(-1, 1, 6, dtype=np.float32).reshape(1, 6), "b")
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Add", ["r", "b"], ["a"], name="add"),
        helper.make_node("Softmax", ["a"], ["s"], name="softmax", axis=-1),
        helper.make_node("Mul", ["s", "x"], ["y"], name="mul"),
    ]
    return make_model(nodes, [tensor_info("x", shape=[2, 6])], [tensor_info("y", shape=[2, 6])], [b])


def chain_reference(x: np.ndarray) -> np.ndarray:
    b = np.linspace(-1, 1, 6, dtype=np.float32).reshape(1, 6)
    a = np.maximum(x, 0) + b
    e = np.exp(a - a.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) * x
