"""The nine real CNNs shipped in the onnx wheel: shipped outputs, and random inputs against the oracle."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import LIGHT_DIR, LIGHT_MODELS
from onnx import numpy_helper


def test_all_nine_light_models_are_shipped():
    assert LIGHT_MODELS == [
        "light_bvlc_alexnet",
        "light_densenet121",
        "light_inception_v1",
        "light_inception_v2",
        "light_resnet50",
        "light_shufflenet",
        "light_squeezenet",
        "light_vgg19",
        "light_zfnet512",
    ]


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_model_reproduces_its_shipped_output(name):
    sess = ort.InferenceSession(os.path.join(LIGHT_DIR, f"{name}.onnx"), providers=["CPUExecutionProvider"])
    (arg,) = sess.get_inputs()
    expected = numpy_helper.to_array(onnx.load_tensor(os.path.join(LIGHT_DIR, f"{name}_output_0.pb")))
    (got,) = sess.run(None, {arg.name: np.zeros(arg.shape, np.float32)})
    assert got.shape == expected.shape and got.dtype == expected.dtype
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert set(sess.placement().summary()) == {"CPUExecutionProvider"}


# (light_squeezenet is left out: the reference evaluator applies Softmax-13 semantics to its opset-9
# Softmax over a [1, 1000, 1, 1] tensor, while the shipped output follows the opset-9 2-D coercion we implement.)
@pytest.mark.parametrize("name", ["light_shufflenet", "light_inception_v1"])
def test_light_model_on_random_input_matches_the_reference_evaluator(name):
    from onnx.reference import ReferenceEvaluator

    path = os.path.join(LIGHT_DIR, f"{name}.onnx")
    sess = ort.InferenceSession(path, providers=["cpu"])
    (arg,) = sess.get_inputs()
    x = np.random.default_rng(7).standard_normal(arg.shape).astype(np.float32)
    (got,) = sess.run(None, {arg.name: x})
    (want,) = ReferenceEvaluator(path).run(None, {arg.name: x})
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-5)
