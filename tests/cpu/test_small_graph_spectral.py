"""An STFT magnitude written as a convolution by its Fourier basis, two Slices, squares, Add and Sqrt (silero-vad's
export) runs as one SpectralMagnitude step (spectral_fusions.py, ops/spectrum.py). Outputs against a float64
reference; forms the fusion must leave alone still agree with it."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import helper, numpy_helper
from reference64 import run_float64

CPU = ["CPUExecutionProvider"]
RNG = np.random.default_rng(11)
WINDOW, HOP, BINS = 16, 4, 9  # a 16-sample window, hop 4: 9 frequency bins, real and imaginary rows
END = np.iinfo(np.int64).max


def _basis() -> np.ndarray:
    """torch.stft's real and imaginary Fourier rows under a Hann window, as (2F, 1, K) convolution weights."""
    k = np.arange(WINDOW)
    window = 0.5 - 0.5 * np.cos(2 * np.pi * k / WINDOW)
    freqs = np.arange(BINS)[:, None]
    real = np.cos(2 * np.pi * freqs * k / WINDOW) * window
    imag = -np.sin(2 * np.pi * freqs * k / WINDOW) * window
    return np.concatenate([real, imag])[:, None, :].astype(np.float32)


def _model(square: str = "Pow", step: int = 1, bias: bool = False, imag_first: bool = False, framed: bool = False):
    """x (N, L) -> reflect Pad -> Unsqueeze -> Conv(basis, stride HOP) -> magnitude -> Relu (the encoder reads it);
    ``framed``: x is the (N, 1, L) the convolution reads."""
    constants = {"pads": np.array([0, WINDOW // 2, 0, WINDOW // 2], np.int64), "axis1": np.array([1], np.int64),
                 "zero": np.array([0], np.int64), "bins": np.array([BINS], np.int64), "end": np.array([END], np.int64),
                 "step": np.array([step], np.int64), "two": np.array(2.0, np.float32), "basis": _basis()}
    conv_inputs = ["framed", "basis"]
    if bias:
        constants["basis_bias"] = (RNG.standard_normal(2 * BINS) * 0.1).astype(np.float32)
        conv_inputs.append("basis_bias")
    real, imag = (["zero", "bins"], ["bins", "end"])
    nodes = [] if framed else [helper.make_node("Pad", ["x", "pads"], ["padded"], mode="reflect"),
                               helper.make_node("Unsqueeze", ["padded", "axis1"], ["framed"])]
    nodes += [helper.make_node("Conv", conv_inputs, ["spectrum"], kernel_shape=[WINDOW], strides=[HOP], pads=[0, 0]),
              helper.make_node("Slice", ["spectrum", *(imag if imag_first else real), "axis1", "step"], ["re"]),
              helper.make_node("Slice", ["spectrum", *(real if imag_first else imag), "axis1", "step"], ["im"])]
    for part in ("re", "im"):
        if square == "Pow":
            nodes.append(helper.make_node("Pow", [part, "two"], [f"{part}2"]))
        else:
            nodes.append(helper.make_node("Mul", [part, part], [f"{part}2"]))
    nodes += [helper.make_node("Add", ["re2", "im2"], ["power"]), helper.make_node("Sqrt", ["power"], ["magnitude"]),
              helper.make_node("Relu", ["magnitude"], ["y"])]
    source = tensor_info("framed", shape=["N", 1, "L"]) if framed else tensor_info("x", shape=["N", "L"])
    return make_model(nodes, [source], [tensor_info("y")],
                      [numpy_helper.from_array(v, k) for k, v in constants.items()])


def _ops(session, feeds) -> list[str]:
    return [node.op_type for node in session.graph_for(feeds).nodes]


@pytest.mark.parametrize("square, bias, imag_first", [("Pow", False, False), ("Mul", False, False),
                                                      ("Pow", True, False), ("Pow", False, True)])
@pytest.mark.parametrize("batch, length", [(1, 64), (3, 37)])
def test_the_magnitude_is_one_step_and_agrees_with_float64(square, bias, imag_first, batch, length):
    model = _model(square, bias=bias, imag_first=imag_first)
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    for _ in range(3):  # a streaming model's repeated frames: the same result from the same step
        x = RNG.standard_normal((batch, length)).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        exact = run_float64(model, {"x": x})[0]
        assert y.shape == exact.shape
        # each bin sums WINDOW products of magnitude at most |x| and then takes a root: far inside 1e-5 relative
        np.testing.assert_allclose(y, exact, rtol=2e-5, atol=2e-5 * float(np.max(np.abs(exact))))
    ops = _ops(session, {"x": x})
    assert "SpectralMagnitude" in ops and not {"Conv", "Slice", "Pow", "Mul", "Sqrt"} & set(ops), ops


def test_slices_with_a_step_are_left_to_their_nodes():
    model = _model(step=2)  # every other row: not a contiguous half of the basis
    session = ort.InferenceSession(model.SerializeToString(), providers=CPU)
    x = RNG.standard_normal((1, 40)).astype(np.float32)
    (y,) = session.run(None, {"x": x})
    np.testing.assert_allclose(y, run_float64(model, {"x": x})[0], rtol=2e-5, atol=1e-5)
    assert "SpectralMagnitude" not in _ops(session, {"x": x})


def test_a_window_longer_than_the_input_is_a_typed_error():
    session = ort.InferenceSession(_model(framed=True).SerializeToString(), providers=CPU)
    framed = RNG.standard_normal((1, 1, 40)).astype(np.float32)
    assert "SpectralMagnitude" in _ops(session, {"framed": framed})
    with pytest.raises(ort.OnnxRuntimeError) as raised:
        session.run(None, {"framed": framed[:, :, :9]})  # 9 samples: shorter than the 16-sample window
    message = str(raised.value)
    assert "'framed'" in message and "window (16)" in message, message
