"""The nine light CNNs of the onnx wheel placed entirely on the CUDA provider, and run end to end against
the CPU provider. Their weights are constant, so the final Softmax is uniform whatever the convolutions
computed, and with logits of magnitude up to ~1e19 it is ill-conditioned (a relative difference of 1e-7
between two GEMMs' roundings moves it entirely): the Softmax's input (the logits) is exposed as an extra
output and compared relative to its magnitude, and the Softmax output is checked to be a distribution.

The simulator executes kernels on the CPU: 5-20 s per model on two cores, vgg19 (20 GFLOP) a few
minutes. The real driver (scripts/gpu_check.sh) runs them in well under a second each."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from cuda_op_harness import CUDA, CUDA_FIRST, random
from model_helpers import LIGHT_DIR, LIGHT_MODELS

pytestmark = pytest.mark.usefixtures("cuda_driver_mode")


def _with_logits(path: str) -> tuple[bytes, set[str]]:
    """The model with each Softmax's input as an extra output, and the names of the Softmax outputs."""
    model = onnx.load(path)
    softmaxes = [n for n in model.graph.node if n.op_type == "Softmax"]
    for softmax in softmaxes:
        logits = onnx.ValueInfoProto()
        logits.name = softmax.input[0]
        model.graph.output.append(logits)
    return model.SerializeToString(), {n.output[0] for n in softmaxes}


@pytest.mark.parametrize("name", LIGHT_MODELS)
def test_light_model_runs_entirely_on_cuda(name):
    model, softmax_outputs = _with_logits(os.path.join(LIGHT_DIR, f"{name}.onnx"))
    session = ort.InferenceSession(model, providers=CUDA_FIRST)
    off = {(n.op_type, n.rejected.get(CUDA)) for n in session.placement() if n.provider != CUDA}
    assert not off
    (arg,) = session.get_inputs()
    feeds = {arg.name: random(arg.shape, seed=3)}
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = session.run(None, feeds)
    for output, want, have in zip(session.get_outputs(), expected, got):
        if output.name in softmax_outputs:
            assert np.isfinite(have).all() and np.allclose(have.reshape(len(have), -1).sum(axis=1), 1, atol=1e-4)
            continue
        # Random weights grow the deepest nets' logits to about 1e31 over 16+ convolutions, where float32 sums in
        # another order (the CPU's numpy paths while its kernels load, or the device's loops) differ by about 1e-4
        # of the scale; a wrong kernel is off by the scale itself.
        scale = float(np.abs(want).max()) or 1.0
        np.testing.assert_allclose(have / scale, want / scale, rtol=0, atol=1e-3)
