"""With only the core installed (tox -e core), sessions fail with the extra to install."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper
from onnx_runtime.cli import main
from onnx_runtime.errors import ProviderNotAvailableError


def _model() -> bytes:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def test_no_provider_is_installed():
    assert ort.get_all_providers() == [] and ort.get_available_providers() == []


def test_creating_a_session_names_the_extra_to_install():
    with pytest.raises(ProviderNotAvailableError, match=r"no execution provider is installed.*onnx-runtime\[cpu\]"):
        ort.InferenceSession(_model())


def test_asking_for_cpu_names_the_extra_to_install():
    with pytest.raises(
        ProviderNotAvailableError, match=r"'CPUExecutionProvider' is not installed.*onnx-runtime\[cpu\]"
    ):
        ort.InferenceSession(_model(), providers=["CPUExecutionProvider"])


def test_host_tensors_work_without_providers():
    tensor = ort.Tensor.from_numpy(np.arange(3, dtype=np.float32))
    assert tensor.numpy().tolist() == [0.0, 1.0, 2.0]


def test_cli_providers_says_how_to_install(capsys):
    assert main(["providers"]) == 0
    assert "no execution providers installed" in capsys.readouterr().out
