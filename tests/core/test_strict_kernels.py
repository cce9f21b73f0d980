"""Strict mode (session config ``session.strict_kernels`` = "1", session/strict.py): each kind of kernel mistake a
provider can make is caught at the call, with the provider, the node and the fix named, instead of a wrong result
downstream or a changed feed array. Without strict mode the same provider's mistakes pass silently (the first
test shows it), which is why the provider-testing plugin turns strict mode on."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper
from onnx_runtime.session.strict import KernelContractError

X = np.array([-1.0, 0.5, 2.0], np.float32)

MISTAKES = {
    "bare array": (lambda x: np.maximum(x, 0), r"returned a ndarray; a kernel returns a tuple"),
    "two outputs for one": (lambda x: (np.maximum(x, 0), x), r"returned 2 values; the node has 1 outputs"),
    "float64": (lambda x: (np.maximum(x, 0).astype(np.float64),), r"returned tensor\(double\).*is tensor\(float\)"),
    "wrong shape": (lambda x: (np.maximum(x, 0)[:2],), r"returned shape \[2\].*tensor\(float\)\[3\]"),
    "writes its input": (lambda x: (np.maximum(x, 0, out=x),), r"wrote into its input 0 \('x'\); inputs are read-only"),
    "a list of lists": (lambda x: ([0.0, 0.5, 2.0],), r"returned a list for output 'y'.*return a numpy array"),
}


def _provider(kernel):
    class Careless:
        @ort.hookimpl
        def name(self):
            return "CarelessExecutionProvider"

        @ort.hookimpl
        def supports_op(self, node, opset):
            return ort.KernelMatch.supported() if node.op_type == "Relu" else ort.KernelMatch.unsupported("Relu only")

        @ort.hookimpl
        def get_kernel(self, node, opset):
            return kernel

    return Careless


@pytest.fixture
def careless(request):
    ort.register_provider(_provider(MISTAKES[request.param][0]))
    yield MISTAKES[request.param][1]
    ort.unregister_provider("CarelessExecutionProvider")


def _session(strict: bool):
    model = make_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [tensor_info("x", shape=[3])],
                       [tensor_info("y", shape=[3])])
    options = ort.SessionOptions()
    if strict:
        options.add_session_config_entry("session.strict_kernels", "1")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CarelessExecutionProvider"])


@pytest.mark.parametrize("careless", ["writes its input", "float64"], indirect=True)
def test_without_strict_mode_some_mistakes_pass_silently(careless):
    feed = X.copy()
    result = _session(strict=False).run(None, {"x": feed})[0]
    assert result.dtype == np.float64 or feed.tolist() != X.tolist()  # a wrong dtype out, or the feed changed


@pytest.mark.parametrize("careless", list(MISTAKES), indirect=True)
def test_strict_mode_names_provider_node_and_rule(careless):
    feed = X.copy()
    with pytest.raises(KernelContractError, match=careless) as raised:
        _session(strict=True).run(None, {"x": feed})
    assert "CarelessExecutionProvider's kernel for node 'relu' (Relu)" in str(raised.value)
    assert isinstance(raised.value, ort.capi.onnxruntime_pybind11_state.Fail)


def test_a_correct_kernel_passes_strict_mode():
    ort.register_provider(_provider(lambda x: (np.maximum(x, 0),)))
    try:
        feed = X.copy()
        assert _session(strict=True).run(None, {"x": feed})[0].tolist() == [0.0, 0.5, 2.0]
        assert feed.tolist() == X.tolist()
    finally:
        ort.unregister_provider("CarelessExecutionProvider")
