"""Helpers shared by the tests: tiny ONNX models built in code, and the onnx package's shipped models."""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper

LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
LIGHT_MODELS = sorted(f[:-5] for f in os.listdir(LIGHT_DIR) if f.endswith(".onnx"))


def tensor_info(name, elem=TensorProto.FLOAT, shape=None):
    return helper.make_tensor_value_info(name, elem, shape)


def make_model(nodes, inputs, outputs, initializers=(), opset=17, **kwargs) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test_graph", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **kwargs)
    model.ir_version = 8
    return model


def chain_reference(x: np.ndarray) -> np.ndarray:
    b = np.linspace(-1, 1, 6, dtype=np.float32).reshape(1, 6)
    a = np.maximum(x, 0) + b
    e = np.exp(a - a.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) * x
