"""Signal-processing kernels: DFT, STFT, the Hann/Hamming/Blackman windows and MelWeightMatrix.

Complex tensors travel as real tensors with a trailing dimension of 2 (real, imaginary); a
trailing dimension of 1 marks a real signal. Transforms run through ``numpy.fft`` in the
input's precision (complex64 for float32 and narrower floats, complex128 for double) and the
result is cast back to the input's dtype.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from onnx_runtime import budget
from onnx_runtime.dtypes import DataType
from onnx_runtime.errors import InvalidArgumentError

from ..registry import register
from ._common import graph_error


def _complex_dtype(dtype) -> np.dtype:
    return np.dtype(np.complex128 if np.dtype(dtype) == np.float64 else np.complex64)


def _to_complex(x: np.ndarray) -> np.ndarray:
    """A (..., 1) real or (..., 2) complex ONNX signal as a complex array without the last dim."""
    y = np.empty(x.shape[:-1], dtype=_complex_dtype(x.dtype))
    y.real = x[..., 0]
    y.imag = x[..., 1] if x.shape[-1] == 2 else 0
    return y


def _from_complex(y: np.ndarray, dtype) -> np.ndarray:
    return np.stack((y.real, y.imag), axis=-1).astype(dtype)


def _scalar_int(node, value, name: str) -> int:
    array = np.asarray(value)
    if array.size != 1:
        raise InvalidArgumentError(
            f"node {node.name!r} ({node.op_type}): input {name!r} has shape {array.shape}; expected a scalar"
        )
    return int(array.reshape(()))


def _flag(node, name: str, default: int = 0) -> bool:
    value = int(node.attr(name, default))
    if value not in (0, 1):
        raise graph_error(node, name, f"is {value}; expected 0 or 1")
    return bool(value)


# -- DFT -----------------------------------------------------------------------------------------


def _valid_axis(axis: int, rank: int) -> bool:
    # The last dimension holds the real/imaginary parts and is never a signal axis.
    return -rank <= axis <= -2 or 0 <= axis <= rank - 2


def _signal_axis(node, axis: int, rank: int) -> int:
    if not _valid_axis(axis, rank):
        raise InvalidArgumentError(
            f"node {node.name!r} (DFT): axis {axis} is out of range for a rank-{rank} input; expected a value "
            f"in [{-rank}, -2] or [0, {rank - 2}] (the last dimension holds the complex parts)"
        )
    return axis % rank


def _dft(node, x: np.ndarray, dft_length, axis: int, inverse: bool, onesided: bool) -> np.ndarray:
    if x.ndim < 2 or x.shape[-1] not in (1, 2):
        raise InvalidArgumentError(
            f"node {node.name!r} (DFT): input shape {x.shape} must end in 1 (real) or 2 (complex)"
        )
    axis = _signal_axis(node, axis, x.ndim)
    signal = _to_complex(x)
    size = signal.shape[axis]
    if dft_length is not None:
        n = _scalar_int(node, dft_length, "dft_length")
    else:
        n = 2 * (size - 1) if onesided and inverse else size
    if n < 1:
        raise InvalidArgumentError(f"node {node.name!r} (DFT): dft_length is {n}; expected a positive length")
    budget.check(signal.size // max(size, 1) * max(n, size), signal.itemsize, "DFT's transform")
    if onesided and inverse:
        # IRFFT: a one-sided spectrum (Hermitian symmetry implied) to a real signal of length n.
        return np.fft.irfft(signal, n, axis=axis)[..., None].astype(x.dtype)
    y = np.fft.ifft(signal, n, axis=axis) if inverse else np.fft.fft(signal, n, axis=axis)
    if onesided:
        y = np.take(y, np.arange(n // 2 + 1), axis=axis)
    return _from_complex(y, x.dtype)


@register("DFT", since=17)
def dft_17(node, shapes, opset):
    axis = int(node.attr("axis", 1))
    rank = len(shapes[0]) if shapes and shapes[0] is not None else None
    if axis == -1 or (rank is not None and not _valid_axis(axis, rank)):
        raise graph_error(node, "axis", f"is {axis}; expected a signal axis of the rank-{rank} input, not its last")
    inverse, onesided = _flag(node, "inverse"), _flag(node, "onesided")
    return lambda x, dft_length=None: (_dft(node, x, dft_length, axis, inverse, onesided),)


@register("DFT", since=20)
def dft_20(node, shapes, opset):
    # The axis became an optional input, defaulting to the last signal axis.
    inverse, onesided = _flag(node, "inverse"), _flag(node, "onesided")

    def kernel(x, dft_length=None, axis=None):
        axis = -2 if axis is None else _scalar_int(node, axis, "axis")
        return (_dft(node, x, dft_length, axis, inverse, onesided),)

    return kernel


# -- STFT ----------------------------------------------------------------------------------------


@register("STFT", since=17)
def stft(node, shapes, opset):
    onesided = _flag(node, "onesided", 1)

    def kernel(signal, frame_step, window=None, frame_length=None):
        if signal.ndim != 3 or signal.shape[-1] not in (1, 2):
            raise InvalidArgumentError(
                f"node {node.name!r} (STFT): signal shape {signal.shape} must be [batch, length, 1 or 2]"
            )
        step = _scalar_int(node, frame_step, "frame_step")
        length = signal.shape[1]
        if frame_length is not None:
            size = _scalar_int(node, frame_length, "frame_length")
        else:
            size = length if window is None else window.shape[0]
        if window is not None and (window.ndim != 1 or window.shape[0] != size):
            raise InvalidArgumentError(
                f"node {node.name!r} (STFT): window shape {window.shape} does not match frame_length {size}"
            )
        if step < 1 or not 1 <= size <= length:
            raise InvalidArgumentError(
                f"node {node.name!r} (STFT): frame_step {step} and frame_length {size} must be positive, "
                f"with frame_length at most the signal length {length}"
            )
        count = (length - size) // step + 1  # the frames, each transformed into one more array of their size
        budget.check(signal.shape[0] * count * size, 2 * _complex_dtype(signal.dtype).itemsize, "STFT's frames")
        # frames[b, f, k] = signal[b, f * step + k]
        frames = sliding_window_view(_to_complex(signal), size, axis=1)[:, ::step]
        if window is not None:
            frames = frames * window.astype(frames.real.dtype)
        y = np.fft.fft(frames, axis=-1)
        if onesided:
            y = y[..., : size // 2 + 1]
        return (_from_complex(y, signal.dtype),)

    return kernel


# -- window functions ----------------------------------------------------------------------------


def _output_dtype(node) -> np.dtype:
    code = int(node.attr("output_datatype", int(DataType.FLOAT)))
    try:
        dtype = DataType(code)
    except ValueError:
        dtype = None
    if dtype is None or dtype in (DataType.STRING, DataType.BOOL, DataType.UNDEFINED, DataType.COMPLEX64,
                                  DataType.COMPLEX128):
        raise graph_error(node, "output_datatype", f"is {code}; expected a numeric TensorProto data type")
    return dtype.numpy


def _cosine_window(coefficients: tuple[float, ...]):
    """Factory of a generalized cosine window: sum_k (-1)^k a_k cos(2 pi k n / N)."""

    def factory(node, shapes, opset):
        periodic = _flag(node, "periodic", 1)
        dtype = _output_dtype(node)

        def kernel(size):
            count = _scalar_int(node, size, "size")
            if count < 0:
                raise InvalidArgumentError(f"node {node.name!r} ({node.op_type}): size {count} is negative")
            budget.check(count, 8, f"{node.op_type}'s output")  # (computed in float64)
            if count == 1 and not periodic:
                return (np.ones(1, dtype),)  # the symmetric formula is 0/0 there; scipy's convention
            # A periodic window is the first N points of a symmetric window of N + 1 points.
            span = count if periodic else count - 1
            phase = 2 * math.pi * np.arange(count, dtype=np.float64) / max(span, 1)
            y = np.zeros(count, dtype=np.float64)
            for k, a in enumerate(coefficients):
                y += (-1) ** k * a * np.cos(k * phase)
            if np.dtype(dtype).kind in "iu":
                # The cast truncates (as a C cast would); drop rounding error first so a peak of 1 stays 1.
                y = np.round(y, 9)
            return (y.astype(dtype),)

        return kernel

    return factory


register("HannWindow", since=17)(_cosine_window((0.5, 0.5)))
register("HammingWindow", since=17)(_cosine_window((25 / 46, 21 / 46)))
register("BlackmanWindow", since=17)(_cosine_window((0.42, 0.5, 0.08)))


# -- MelWeightMatrix -----------------------------------------------------------------------------


def _hz_to_mel(hz):
    return 2595 * np.log1p(hz / 700) / math.log(10)


def _mel_to_hz(mel):
    return 700 * np.expm1(mel / 2595 * math.log(10))


@register("MelWeightMatrix", since=17)
def mel_weight_matrix(node, shapes, opset):
    dtype = _output_dtype(node)

    def kernel(num_mel_bins, dft_length, sample_rate, lower_edge_hertz, upper_edge_hertz):
        bands = _scalar_int(node, num_mel_bins, "num_mel_bins")
        n_fft = _scalar_int(node, dft_length, "dft_length")
        rate = _scalar_int(node, sample_rate, "sample_rate")
        low, high = (float(np.asarray(v).reshape(())) for v in (lower_edge_hertz, upper_edge_hertz))
        if bands < 1 or n_fft < 1 or rate < 1 or not 0 <= low < high:
            raise InvalidArgumentError(
                f"node {node.name!r} (MelWeightMatrix): expected positive num_mel_bins ({bands}), dft_length "
                f"({n_fft}) and sample_rate ({rate}), and 0 <= lower_edge_hertz ({low}) < upper_edge_hertz ({high})"
            )
        bins = n_fft // 2 + 1
        budget.check(bins * bands, 8, "MelWeightMatrix's output")  # (computed in float64)
        # bands + 2 edges evenly spaced in mel (the step divides by their count, as ONNX Runtime
        # does), each mapped to the spectrogram bin holding that frequency.
        low_mel, high_mel = _hz_to_mel(low), _hz_to_mel(high)
        edges = low_mel + np.arange(bands + 2) * ((high_mel - low_mel) / (bands + 2))
        edges = np.floor_divide((n_fft + 1) * _mel_to_hz(edges), rate).astype(np.int64)
        left, center, right = edges[:-2], edges[1:-1], edges[2:]
        j = np.arange(bins)[:, None]
        rising = (j - left) / np.maximum(center - left, 1)
        falling = (right - j) / np.maximum(right - center, 1)
        weights = np.where((j >= left) & (j < center), rising, 0.0)
        weights = np.where((j > center) & (j < right), falling, weights)
        # Every triangle peaks at 1 on its center bin.
        weights = np.where(j == center, 1.0, weights)
        return (weights.astype(dtype),)

    return kernel

