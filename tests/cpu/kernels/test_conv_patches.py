"""A convolution whose windows tile its input onto few output columns (algorithms/conv_patches.py): the gathered
patches times the weight rows. The computation against a float64 reference (with and without a bias, batches,
sizes the windows do not divide), the gather's numpy twin, the selection, and sessions: ConvNeXt's downsampling
(Transpose, 2x2/2 Conv, 7x7 depthwise Conv, in a segment's bound plan) and a lone FusedConv with a Relu."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime_ep_cpu.algorithms import conv_patches
from onnx_runtime_ep_cpu.algorithms.conv_choice import patches_apply
from onnx_runtime_ep_cpu.algorithms.conv_patches import PatchConv
from onnx_runtime_ep_cpu.algorithms.prepared import Prepared
from onnx_runtime_ep_cpu.algorithms.window import Geometry
from onnx_runtime_ep_cpu.compiled import deferred, generic
from reference64 import run_float64

# (x shape, kernel = strides, output channels)
CASES = {
    "ConvNeXt stage 2, 2x2/2 onto 4x4": ((1, 32, 8, 8), (2, 2), 64),
    "ConvNeXt stage 3, 2x2/2 onto 2x2": ((1, 64, 4, 4), (2, 2), 128),
    "3x3/3 on 7x8, 2 images": ((2, 5, 7, 8), (3, 3), 6),
    "2x1/(2,1) on 6x5": ((1, 3, 6, 5), (2, 1), 4),
}


def _geometry(x_shape, kernel, pads=(0, 0, 0, 0), strides=None, dilations=(1, 1)) -> Geometry:
    strides = kernel if strides is None else strides
    out = tuple((n + pads[i] + pads[i + 2] - d * (k - 1) - 1) // s + 1
                for i, (n, k, s, d) in enumerate(zip(x_shape[2:], kernel, strides, dilations)))
    return Geometry(tuple(x_shape[2:]), kernel, strides, dilations, tuple(pads[:2]), tuple(pads[2:]), out)


def _exact(x, w, b):
    """float64 (N, M, OH, OW): each output pixel's own patch times the weights."""
    kh, kw = w.shape[2:]
    oh, ow = x.shape[2] // kh, x.shape[3] // kw
    patches = x[:, :, :oh * kh, :ow * kw].astype(np.float64).reshape(x.shape[0], x.shape[1], oh, kh, ow, kw)
    y = np.einsum("ncyixj,mcij->nmyx", patches, w.astype(np.float64))
    return y if b is None else y + b.astype(np.float64)[None, :, None, None]


def _operands(case):
    x_shape, kernel, m = CASES[case]
    rng = np.random.default_rng(sum(x_shape) + m)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = (rng.standard_normal((m, x_shape[1], *kernel)) * 0.3).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    w.setflags(write=False)
    b.setflags(write=False)
    return x, w, b, _geometry(x_shape, kernel)


def _bound(x, w, exact):
    terms = w[0].size + 1
    return (terms + 2) * np.finfo(np.float32).eps * (np.abs(exact).max() + np.abs(x).max() * np.abs(w).max() * terms)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_patch_product_matches_float64(case, with_bias):
    x, w, b, geo = _operands(case)
    b = b if with_bias else None
    assert patches_apply(geo, 1, x, w)
    exact = _exact(x, w, b)
    compute = PatchConv(geo, x.shape, w.shape, Prepared())
    for _ in range(2):  # (the second call with the kept weight rows)
        y = compute(x, w, b, None)
        assert y.shape == exact.shape and y.dtype == np.float32
        assert np.abs(y - exact).max() <= _bound(x, w, exact)
    bound_y = np.full(exact.shape, np.nan, np.float32)
    source = x.copy()
    calls = compute.bind(source, w, b, None, bound_y)
    for _ in range(2):  # a bound plan's calls, run again over the same buffers
        for function, arguments in calls:
            function(*arguments)
        assert np.abs(bound_y - exact).max() <= _bound(x, w, exact)
    np.testing.assert_array_equal(source, x)


def test_the_gathers_numpy_twin_fills_the_same_columns():
    from onnx_runtime_ep_cpu.compiled.im2col import fill_patches

    x = np.random.default_rng(3).standard_normal((5, 7, 8)).astype(np.float32)
    compiled, twin = np.full((5 * 9 + 1, 4), 7, np.float32), np.full((5 * 9 + 1, 4), 7, np.float32)
    fill_patches(x, compiled, 3, 3)
    generic.fill_patches(x, twin, 3, 3)
    np.testing.assert_array_equal(compiled, twin)
    assert (compiled[-1] == 7).all()  # the rows past the patches are left as they were
    np.testing.assert_array_equal(compiled[:-1].reshape(5, 3, 3, 2, 2),
                                  x[:, :6, :6].reshape(5, 2, 3, 2, 3).transpose(0, 2, 4, 1, 3))


def test_other_convolutions_keep_their_paths():
    x = np.zeros((1, 64, 7, 7), np.float32)
    w = np.zeros((32, 64, 1, 1), np.float32)
    assert not patches_apply(_geometry(x.shape, (1, 1)), 1, x, w)  # pointwise
    wide = np.zeros((1, 16, 16, 16), np.float32)  # 8 output columns: the direct tiles are full
    assert not patches_apply(_geometry(wide.shape, (2, 2)), 1, wide, np.zeros((32, 16, 2, 2), np.float32))
    two = np.zeros((32, 16, 2, 2), np.float32)
    small = np.zeros((1, 16, 8, 8), np.float32)
    assert patches_apply(_geometry(small.shape, (2, 2)), 1, small, two)
    assert not patches_apply(_geometry(small.shape, (2, 2), pads=(1, 1, 1, 1)), 1, small, two)  # padded
    assert not patches_apply(_geometry(small.shape, (2, 2), strides=(1, 1)), 1, small, two)  # overlapping
    assert not patches_apply(_geometry(small.shape, (2, 2)), 2, small, np.zeros((32, 8, 2, 2), np.float32))
    assert not patches_apply(_geometry(small.shape, (2, 2)), 1, small.astype(np.float64), two)


def _downsampling(x_shape, m, tail):
    """ConvNeXt's downsampling on a channels-first input: the 2x2/2 Conv, then (``tail``) a 7x7 depthwise Conv
    with the residual sum (a segment of two convolutions), or a Relu (one FusedConv). (Read through a Transpose
    from channels-last, the same Conv becomes NhwcConv: tests/cpu/test_transpose_sinking.py.)"""
    n, c, h, width = x_shape
    rng = np.random.default_rng(m)
    w = (rng.standard_normal((m, c, 2, 2)) * 0.3).astype(np.float32)
    b = rng.standard_normal(m).astype(np.float32)
    initializers = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")]
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["down"], kernel_shape=[2, 2], strides=[2, 2])]
    if tail == "depthwise":
        dw = (rng.standard_normal((m, 1, 7, 7)) * 0.1).astype(np.float32)
        initializers += [numpy_helper.from_array(dw, "dw"), numpy_helper.from_array(b[::-1].copy(), "db")]
        nodes += [helper.make_node("Conv", ["down", "dw", "db"], ["mixed"], kernel_shape=[7, 7], group=m,
                                   pads=[3, 3, 3, 3]),
                  helper.make_node("Add", ["down", "mixed"], ["y"])]
    else:
        nodes.append(helper.make_node("Relu", ["down"], ["y"]))
    graph = helper.make_graph(nodes, "downsampling", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                    list(x_shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("x_shape,m", [((1, 32, 8, 8), 64), ((1, 64, 4, 4), 128), ((2, 8, 6, 6), 16)])
@pytest.mark.parametrize("tail", ["depthwise", "relu"])
def test_sessions_take_the_patch_product_and_match_float64(monkeypatch, x_shape, m, tail):
    taken = []
    original = PatchConv.calls

    def counted(self, *args):
        taken.append(self)
        return original(self, *args)

    monkeypatch.setattr(conv_patches.PatchConv, "calls", counted)
    model = _downsampling(x_shape, m, tail)
    x = np.random.default_rng(5).standard_normal(x_shape).astype(np.float32)
    exact = run_float64(model, {"x": x})[0]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    bound = 200 * np.finfo(np.float32).eps * (1 + np.abs(exact).max()) * (1 + np.abs(x).max())
    for run in range(4):  # the first run and the later ones (compiled kernels, a segment's bound calls)
        ours = sess.run(None, {"x": x})[0]
        if run == 0:
            deferred.wait_ready(240)
        assert ours.shape == exact.shape and ours.dtype == np.float32
        assert np.abs(ours - exact).max() <= bound
    assert taken
