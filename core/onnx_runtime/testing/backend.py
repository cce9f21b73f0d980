"""The backend suite and contract checks of ``onnx_runtime.testing``, as pytest tests of the provider under test.

Run them with ``pytest -p onnx_runtime.testing --provider NAME --pyargs onnx_runtime.testing.backend``, or import
them into a test module of your own (``from onnx_runtime.testing.backend import *``). The plugin parametrizes
them: every onnx backend node case, every shipped model set, every hook the provider implements.
"""

from __future__ import annotations

import pytest

from . import cases
from . import contract as contract_checks

__all__ = ["test_onnx_backend_model", "test_onnx_backend_node", "test_provider_contract"]


def test_onnx_backend_node(onnx_backend_node, onnx_runtime_target):
    case = cases.node_cases()[onnx_backend_node]
    onnx_runtime_target.run(case.model, case.data_sets, case.rtol, case.atol, onnx_backend_node)


def test_onnx_backend_model(onnx_backend_model, onnx_runtime_target):
    model, data_sets = cases.load_model_set(cases.model_set_dirs()[onnx_backend_model])
    onnx_runtime_target.run(model, data_sets, cases.MODEL_SET_RTOL, cases.MODEL_SET_ATOL, onnx_backend_model)


def test_provider_contract(provider_contract_hook, provider_handle):
    check = contract_checks.check_for(provider_contract_hook)
    if check is None:
        pytest.skip(f"`{provider_contract_hook}` is exercised by sessions (device graphs, validation, decoding), "
                    "not checked in isolation")
    check(provider_handle, provider_contract_hook)
