"""Transposes moved through the operators that commute with them until inverse pairs cancel (transpose_sinking.py):
a ConvNeXt-like network in both torch exporters' spellings keeps its residual stream channels-last (the residual Add
fused into the block's last product, the next LayerNormalization reading it contiguous, the final mean over the
spatial axes of the channels-last map), within a float64 reference; a pair whose value another reader needs
channels-first, a reduction whose kept axes would reorder and one that keeps its dims are left alone."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import KernelError
from onnx_runtime_ep_cpu.ops import linalg
from reference64 import assert_within, run_float64

TO_LAST, TO_FIRST = [0, 2, 3, 1], [0, 3, 1, 2]


class _Net:
    """Nodes and weights of a network written node by node (the exporters' spellings of one block)."""

    def __init__(self, spelling: str, seed: int):
        self.spelling, self.rng = spelling, np.random.default_rng(seed)
        self.nodes: list = []
        self.weights: dict[str, np.ndarray] = {}
        self.count = 0

    def name(self, base: str) -> str:
        self.count += 1
        return f"{base}_{self.count}"

    def const(self, base: str, value) -> str:
        name = self.name(base)
        self.weights[name] = np.asarray(value, np.float32)
        return name


    def node(self, op: str, inputs: list, **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], **attrs))
        return out

    def layer_norm(self, x: str, c: int) -> str:
        scale = self.const("scale", 1 + self.rng.standard_normal(c) / 4)
        shift = self.const("shift", self.rng.standard_normal(c) / 4)
        return self.node("LayerNormalization", [x, scale, shift], axis=-1, epsilon=1e-6)

    def linear(self, x: str, k: int, n: int) -> str:
        w = self.const("w", self.rng.standard_normal((k, n)) / np.sqrt(k))
        b = self.const("b", self.rng.standard_normal(n) / 4)
        product = self.node("MatMul", [x, w])
        # TorchScript writes the bias first, the dynamo exporter second
        return self.node("Add", [b, product] if self.spelling == "torchscript" else [product, b])

    def gelu(self, x: str) -> str:
        if self.spelling == "dynamo":
            return self.node("Gelu", [x])
        half = self.node("Div", [x, self.const("sqrt2", np.sqrt(2.0))])
        erf = self.node("Erf", [half])
        one = self.node("Add", [erf, self.const("one", 1.0)])
        return self.node("Mul", [self.node("Mul", [x, one]), self.const("half", 0.5)])

    def conv(self, x: str, c_in: int, c_out: int, kernel: int, group: int = 1, stride: int = 1, pad: int = 0) -> str:
        w = self.const("cw", self.rng.standard_normal((c_out, c_in // group, kernel, kernel)) / kernel)
        b = self.const("cb", self.rng.standard_normal(c_out) / 4)
        return self.node("Conv", [x, w, b], kernel_shape=[kernel, kernel], strides=[stride, stride],
                         pads=[pad] * 4, group=group)

    def block(self, x: str, c: int) -> str:
        """ConvNeXt's block: depthwise conv, then channels-last LayerNorm, MLP and layer scale, then the residual."""
        d = self.conv(x, c, c, 3, group=c, pad=1)
        t = self.node("Transpose", [d], perm=TO_LAST)
        h = self.linear(self.gelu(self.linear(self.layer_norm(t, c), c, 4 * c)), 4 * c, c)
        scaled = self.node("Mul", [self.const("gamma", self.rng.standard_normal(c) / 2), h])
        return self.node("Add", [x, self.node("Transpose", [scaled], perm=TO_FIRST)])

    def channels_last_norm(self, x: str, c: int) -> str:
        t = self.node("Transpose", [x], perm=TO_LAST)
        return self.node("Transpose", [self.layer_norm(t, c)], perm=TO_FIRST)


def _convnext(spelling: str, c: int = 8, size: int = 8, extra_reader: bool = False):
    """stem conv + norm, a block, a 2x2 downsampling (norm, conv), a block, a channels-last norm and the spatial
    mean; ``extra_reader``:
    the first block's sum is also a graph output (its channels-first value must stay)."""
    net = _Net(spelling, c * size + len(spelling))
    stem = net.channels_last_norm(net.conv("x", 3, c, 2, stride=2), c)
    first = net.block(stem, c)
    down = net.conv(net.channels_last_norm(first, c), c, 2 * c, 2, stride=2)
    second = net.block(down, 2 * c)
    head = net.layer_norm(net.node("Transpose", [second], perm=TO_LAST), 2 * c)
    if spelling == "dynamo":  # opset 18 and later: the axes as an input
        net.weights["axes"] = np.array([1, 2], np.int64)
        y = net.node("ReduceMean", [head, "axes"], keepdims=0)
    else:
        y = net.node("ReduceMean", [head], axes=[1, 2], keepdims=0)
    outputs = [tensor_info(y, TensorProto.FLOAT, None)]
    if extra_reader:
        outputs.append(tensor_info(first, TensorProto.FLOAT, None))
    initializers = [numpy_helper.from_array(value, name) for name, value in net.weights.items()]
    model = make_model(net.nodes, [tensor_info("x", TensorProto.FLOAT, [1, 3, 2 * size, 2 * size])], outputs,
                       initializers, opset=20 if spelling == "dynamo" else 17)
    return model


def _session(model) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.compile_in_background", "0")
    options.add_session_config_entry("session.plan_cache", "0")
    return ort.InferenceSession(model.SerializeToString(), options, providers=["cpu"])


def _check(session, model, seeds=range(3)) -> dict:
    for seed in seeds:
        x = np.random.default_rng(seed).standard_normal(session.get_inputs()[0].shape).astype(np.float32)
        got = session.run(None, {"x": x})
        for value, exact in zip(got, run_float64(model, {"x": x})):
            assert_within(value, exact, 2e-5 * (1 + np.abs(exact).max()), f"seed {seed}")
    return {"x": x}


def _planned(session, feeds) -> list[str]:
    return [node.op_type for node in session.graph_for(feeds).nodes]


@pytest.mark.parametrize("spelling", ["torchscript", "dynamo"])
def test_a_convnext_residual_stream_stays_channels_last(spelling, monkeypatch):
    model = _convnext(spelling)
    session = _session(model)
    feeds = _check(session, model)
    planned = _planned(session, feeds)
    # Of the model's 9 Transposes, each block's last one cancels with the norm's after it (the first block's sum is
    # two channels-last values added; the second's adds its channels-first input through a Transpose of its own):
    # both residual Adds are their block's last product's residual, and no Add is left.
    assert planned.count("Transpose") <= 6, planned
    assert "Add" not in planned, planned
    assert sum(1 for node in session.graph_for(feeds).nodes
               if node.op_type == "FusedMatMul" and len(node.inputs) > 3 and node.inputs[3]) == 2
    # the residual read through a moved Transpose (a view) takes the planned product, not the general kernel
    general = []
    real = linalg.product
    monkeypatch.setattr(linalg, "product", lambda *args: general.append(args) or real(*args))
    session.run(None, feeds)
    assert not general


def test_both_spellings_plan_alike():
    plans = []
    for spelling in ("torchscript", "dynamo"):
        model = _convnext(spelling)
        session = _session(model)
        plans.append(_planned(session, _check(session, model, seeds=[0])))
    assert plans[0] == plans[1]


def test_a_pair_whose_channels_first_value_is_also_read_stays():
    # the first block's sum is a graph output too: its Add and the Transposes around it stay channels-first
    model = _convnext("torchscript", extra_reader=True)
    session = _session(model)
    feeds = _check(session, model)
    planned = _planned(session, feeds)
    assert "Add" in planned, planned
    assert planned.count("Transpose") > _planned(_session(_convnext("torchscript")), feeds).count("Transpose")


def _reduction(perm, axes, keepdims: int, opset: int = 17):
    inputs = ["t"] if opset < 18 else ["t", "axes"]
    attrs = {"keepdims": keepdims} if opset >= 18 else {"axes": axes, "keepdims": keepdims}
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=perm),
             helper.make_node("ReduceMean", inputs, ["y"], **attrs)]
    initializers = [numpy_helper.from_array(np.array(axes, np.int64), "axes")] if opset >= 18 else []
    return make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [2, 3, 4, 5])], [tensor_info("y")], initializers,
                      opset=opset)


@pytest.mark.parametrize("perm, axes, keepdims, opset, reads_source", [
    (TO_FIRST, [2, 3], 0, 17, True),       # the mean over a channels-first view's spatial axes (ConvNeXt's)
    (TO_FIRST, [-2, -1], 0, 18, True),     # the same, the axes an input
    ([0, 1, 3, 2], [0, 1], 0, 17, False),  # the kept axes would come out swapped
    (TO_FIRST, [2, 3], 1, 17, False),      # kept dims: the result would need a Transpose after
])
def test_a_reduction_reads_the_transposes_source_where_its_kept_axes_keep_their_order(perm, axes, keepdims, opset,
                                                                                     reads_source):
    model = _reduction(perm, axes, keepdims, opset)
    session = _session(model)
    x = np.random.default_rng(3).standard_normal((2, 3, 4, 5)).astype(np.float32)
    (got,) = session.run(None, {"x": x})
    (exact,) = run_float64(model, {"x": x})
    assert_within(got, exact, 1e-6 * (1 + np.abs(exact).max()))
    assert ("Transpose" not in _planned(session, {"x": x})) == reads_source


@pytest.mark.parametrize("second, remains", [(TO_FIRST, None), ([0, 2, 1, 3], [0, 3, 2, 1])])
def test_consecutive_transposes_compose(second, remains):
    # (0, 2, 3, 1) then (0, 3, 1, 2) is the identity; then (0, 2, 1, 3) is one Transpose by the composition
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=TO_LAST),
             helper.make_node("Transpose", ["t"], ["u"], perm=second), helper.make_node("Relu", ["u"], ["y"])]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [1, 2, 3, 4])], [tensor_info("y")])
    session = _session(model)
    x = np.random.default_rng(5).standard_normal((1, 2, 3, 4)).astype(np.float32)
    (got,) = session.run(None, {"x": x})
    (exact,) = run_float64(model, {"x": x})
    assert_within(got, exact, 0.0)
    transposes = [node for node in session.graph_for({"x": x}).nodes if node.op_type == "Transpose"]
    assert [list(node.attrs["perm"]) for node in transposes] == ([] if remains is None else [remains])


@pytest.mark.parametrize("second", [[0, 5, 1, 2], [0, 0, 1, 2], [0, 2, 1]])
def test_a_transpose_whose_perm_is_not_a_permutation_of_its_axes_is_left_to_its_kernel(second):
    # out of range, repeated, of another rank (the fuzz harness's seed 83): the pass leaves the pair alone and the
    # Transpose kernel refuses the node by name, not the pass with an IndexError
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=TO_LAST),
             helper.make_node("Transpose", ["t"], ["u"], perm=second), helper.make_node("Relu", ["u"], ["y"])]
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, [1, 2, 3, 4])], [tensor_info("y")])
    with pytest.raises(KernelError, match="Transpose"):
        _session(model).run(None, {"x": np.zeros((1, 2, 3, 4), np.float32)})


def test_convs_reading_a_channels_last_map_run_channels_last_where_a_path_serves_them():
    # the downsampling patch conv (2x2 / 2) and both blocks' depthwise convs (float32, stride 1: the 16-lane rows on
    # the 8x8 map as on the 4x4 one) run as NhwcConv; the stem's conv reads the channels-first input and stays
    model = _convnext("torchscript")
    session = _session(model)
    feeds = _check(session, model)
    nodes = session.graph_for(feeds).nodes
    assert sorted(node.attrs.get("group", 1) for node in nodes if node.op_type == "NhwcConv") == [1, 8, 16]
    assert [node.op_type for node in nodes].count("Conv") == 1


def test_a_depthwise_conv_of_another_type_keeps_the_pair_sums_or_its_channels_first_form():
    from onnx_runtime_ep_cpu.ops import conv_nhwc

    attrs = {"kernel_shape": [7, 7], "pads": [3] * 4, "group": 16}
    assert conv_nhwc.channels_last_path((1, 16, 16, 16), (16, 1, 7, 7), attrs) == "lanes"
    assert conv_nhwc.channels_last_path((1, 16, 16, 16), (16, 1, 7, 7), attrs, float32=False) is None
    assert conv_nhwc.channels_last_path((1, 4, 4, 16), (16, 1, 7, 7), attrs, float32=False) == "depthwise"
    assert conv_nhwc.channels_last_path((1, 2, 2, 16), (16, 1, 7, 7), attrs) == "depthwise"  # a row of two pixels
    from onnx_runtime_ep_cpu.compiled import depthwise_nhwc

    assert conv_nhwc.LANE_KERNEL_WIDTHS == depthwise_nhwc.KERNEL_WIDTHS  # what planning offers the loop builds
    # a planned 16-lane kernel given another type (a graph written elsewhere) runs the other paths
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.fused_domain import FUSED_DOMAIN
    from onnx_runtime_ep_cpu.registry import lookup

    rng = np.random.default_rng(7)
    for x_shape in ((1, 16, 16, 16), (1, 4, 4, 16)):
        node = Node("NhwcConv", ["x", "w", "b"], ["y"], domain=FUSED_DOMAIN, attrs=attrs, opset=1)
        kernel = lookup("NhwcConv", FUSED_DOMAIN, 1)(node, [x_shape, (16, 1, 7, 7), (16,)], 1)
        w = (rng.standard_normal((16, 1, 7, 7)) / 7).astype(np.float32)
        b = rng.standard_normal(16).astype(np.float32)
        for dtype in (np.float32, np.float64, np.float16):
            x = rng.standard_normal(x_shape).astype(dtype)
            exact = _conv_float64(x.astype(np.float32), w, b, attrs)
            (got,) = kernel(x, w.astype(dtype), b.astype(dtype))
            assert got.dtype == dtype
            assert_within(got, exact, (1e-2 if dtype == np.float16 else 1e-5) * (1 + np.abs(exact).max()))


def _conv_float64(x_nhwc, w, b, attrs) -> np.ndarray:
    """The channels-last output of Conv over the channels-first view of ``x_nhwc``, in float64 (onnx's evaluator)."""
    inputs = ["x", "w"] + (["b"] if b is not None else [])
    nodes = [helper.make_node("Transpose", ["x"], ["planes"], perm=TO_FIRST),
             helper.make_node("Conv", ["planes", *inputs[1:]], ["c"], **attrs),
             helper.make_node("Transpose", ["c"], ["y"], perm=TO_LAST)]
    initializers = [numpy_helper.from_array(w, "w")] + ([numpy_helper.from_array(b, "b")] if b is not None else [])
    model = make_model(nodes, [tensor_info("x", TensorProto.FLOAT, list(x_nhwc.shape))], [tensor_info("y")],
                       initializers)
    return run_float64(model, {"x": x_nhwc})[0]


@pytest.mark.parametrize("x_shape, w_shape, attrs, bias, path", [
    ((2, 8, 8, 16), (32, 16, 2, 2), {"kernel_shape": [2, 2], "strides": [2, 2]}, True, "patch"),
    ((1, 9, 6, 4), (8, 4, 3, 3), {"kernel_shape": [3, 3], "strides": [3, 3]}, False, "patch"),
    ((2, 4, 4, 64), (64, 1, 7, 7), {"kernel_shape": [7, 7], "pads": [3] * 4, "group": 64}, True, "lanes"),
    ((1, 16, 16, 16), (16, 1, 7, 7), {"kernel_shape": [7, 7], "pads": [3] * 4, "group": 16}, True, "lanes"),
    ((2, 8, 8, 32), (32, 1, 7, 7), {"kernel_shape": [7, 7], "pads": [3] * 4, "group": 32}, False, "lanes"),
    # a row of 11 pixels (a block and a partial one), 20 channels (a partial block of lanes), unequal pads
    ((1, 5, 11, 20), (20, 1, 5, 5), {"kernel_shape": [5, 5], "pads": [2, 1, 2, 3], "group": 20}, True, "lanes"),
    ((1, 6, 9, 24), (24, 1, 3, 3), {"kernel_shape": [3, 3], "pads": [0, 1, 2, 1], "group": 24}, True, "lanes"),
    # rows of at most 4 pixels: the narrow calls
    ((1, 3, 4, 16), (16, 1, 3, 3), {"kernel_shape": [3, 3], "pads": [1] * 4, "group": 16}, True, "lanes"),
    ((2, 6, 4, 40), (40, 1, 5, 5), {"kernel_shape": [5, 5], "pads": [2] * 4, "group": 40}, False, "lanes"),
    ((1, 2, 2, 128), (128, 1, 7, 7), {"kernel_shape": [7, 7], "pads": [3] * 4, "group": 128}, False, "depthwise"),
    ((1, 4, 4, 16), (16, 1, 3, 3), {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1] * 4, "group": 16}, True,
     "depthwise"),
    ((1, 5, 5, 8), (12, 8, 3, 3), {"kernel_shape": [3, 3], "pads": [1] * 4}, True, None),  # Conv's own kernel
])
def test_nhwc_conv_matches_conv_over_the_channels_first_view(x_shape, w_shape, attrs, bias, path):
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.fused_domain import FUSED_DOMAIN
    from onnx_runtime_ep_cpu.ops import conv_nhwc
    from onnx_runtime_ep_cpu.registry import lookup

    rng = np.random.default_rng(len(x_shape) + w_shape[0])
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32)
    w.flags.writeable = False
    b = rng.standard_normal(w_shape[0]).astype(np.float32) if bias else None
    if b is not None:
        b.flags.writeable = False  # constants, as a model's: the second call takes the kept arrangement
    assert conv_nhwc.channels_last_path(x_shape, w_shape, attrs) == path
    node = Node("NhwcConv", ["x", "w", "b"] if bias else ["x", "w"], ["y"], domain=FUSED_DOMAIN, attrs=attrs, opset=1)
    kernel = lookup("NhwcConv", FUSED_DOMAIN, 1)(node, [x_shape, w_shape] + ([b.shape] if bias else []), 1)
    exact = _conv_float64(x, w, b, attrs)
    for xi in (x, x, x[::-1].copy()):  # the second and third calls reuse the arranged weights
        (got,) = kernel(xi, w, b) if bias else kernel(xi, w)
        exact_i = exact if xi is x else _conv_float64(xi, w, b, attrs)
        assert got.shape == exact_i.shape == conv_nhwc.output_shape(x_shape, w_shape, attrs)
        assert_within(got, exact_i, 1e-5 * (1 + np.abs(exact_i).max()))


def test_a_mean_over_middle_axes_is_one_reduce_of_a_three_axis_view(monkeypatch):
    # the channels-last map's spatial mean (ConvNeXt's last node after the pass): numpy's bits, not the general path
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.ops import reduction
    from onnx_runtime_ep_cpu.registry import lookup

    monkeypatch.setattr(reduction, "_reduce", lambda *args: pytest.fail("the general path ran"))
    for shape, axes, keepdims in (((1, 2, 2, 128), [1, 2], 0), ((3, 5, 7, 16), [1, 2], 1), ((4, 6, 3), [-2], 0)):
        node = Node("ReduceMean", ["x"], ["y"], attrs={"axes": axes, "keepdims": keepdims}, opset=17)
        kernel = lookup("ReduceMean", "", 17)(node, [shape], 17)
        x = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)
        normalized = tuple(a % x.ndim for a in axes)
        expected = np.add.reduce(x, axis=normalized, keepdims=bool(keepdims)) / np.float32(
            np.prod([shape[a] for a in normalized]))
        (got,) = kernel(x)
        assert got.shape == expected.shape and np.array_equal(got, expected)


def test_a_kept_lanes_call_goes_straight_to_the_bound_entry_point(monkeypatch):
    # constant weights and bias kept with the loop's entry point: a later call neither arranges them nor goes through
    # EntryOnce (whose run would pass the arrays reshaped flat), and still matches the float64 reference
    from onnx_runtime.ir import Node
    from onnx_runtime_ep_cpu.algorithms import bound_loop
    from onnx_runtime_ep_cpu.fused_domain import FUSED_DOMAIN
    from onnx_runtime_ep_cpu.registry import lookup

    attrs = {"kernel_shape": [7, 7], "pads": [3] * 4, "group": 32}
    rng = np.random.default_rng(11)
    w = (rng.standard_normal((32, 1, 7, 7)) / 7).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    w.flags.writeable = b.flags.writeable = False
    node = Node("NhwcConv", ["x", "w", "b"], ["y"], domain=FUSED_DOMAIN, attrs=attrs, opset=1)
    kernel = lookup("NhwcConv", FUSED_DOMAIN, 1)(node, [(1, 8, 8, 32), (32, 1, 7, 7), (32,)], 1)
    kernel(rng.standard_normal((1, 8, 8, 32)).astype(np.float32), w, b)
    monkeypatch.setattr(bound_loop.EntryOnce, "run", lambda *args: pytest.fail("not the kept entry point"))
    for _ in range(2):
        x = rng.standard_normal((1, 8, 8, 32)).astype(np.float32)
        (got,) = kernel(x, w, b)
        exact = _conv_float64(x, w, b, attrs)
        assert_within(got, exact, 1e-5 * (1 + np.abs(exact).max()))
