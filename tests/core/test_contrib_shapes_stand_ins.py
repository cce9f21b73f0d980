"""Shape inference through com.microsoft operators (onnx_runtime/contrib_stand_ins.py): the inferred type of each
contrib output matches what onnxruntime (the oracle) produces, the annotated graph keeps the model's own nodes, and
shape chains after contrib nodes fold in the specialized graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_runtime
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.contrib_stand_ins import covered_operators, stand_in_contrib_ops
from onnx_runtime.loader import infer_graph

MS = "com.microsoft"
RNG = np.random.default_rng(7)
F32, U8, I8 = np.float32, np.uint8, np.int8


def _u8(*shape):
    return RNG.integers(0, 255, size=shape).astype(U8)


def _f(*shape):
    return RNG.standard_normal(shape).astype(F32)


def _scalar(value, dtype):
    return np.array(value, dtype=dtype)


def _model(node: onnx.NodeProto, feeds: dict, weights: dict, opset: int = 17) -> onnx.ModelProto:
    """``node`` alone: ``feeds`` as graph inputs whose first dimension is symbolic, ``weights`` as initializers."""
    inputs = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype),
                                            ["batch", *a.shape[1:]] if a.ndim else [])
              for name, a in feeds.items()]
    graph = helper.make_graph([node], "g", inputs, [onnx.ValueInfoProto(name=node.output[0])],
                              [numpy_helper.from_array(a, name) for name, a in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)],
                             ir_version=8)


def _qlinear_binary(op):
    node = helper.make_node(op, ["a", "as", "az", "b", "bs", "bz", "cs", "cz"], ["y"], domain=MS)
    return node, {"a": _u8(2, 3, 4), "b": _u8(4)}, {"as": _scalar(0.1, F32), "az": _scalar(128, U8),
                                                    "bs": _scalar(0.2, F32), "bz": _scalar(100, U8),
                                                    "cs": _scalar(0.3, F32), "cz": _scalar(120, U8)}


def _qlinear_unary(op, **attrs):
    node = helper.make_node(op, ["x", "xs", "xz", "ys", "yz"], ["y"], domain=MS, **attrs)
    return node, {"x": _u8(2, 3, 6, 6)}, {"xs": _scalar(0.1, F32), "xz": _scalar(128, U8),
                                          "ys": _scalar(0.05, F32), "yz": _scalar(100, U8)}


def _qlinear_concat():
    node = helper.make_node("QLinearConcat", ["ys", "yz", "x1", "s", "z", "x2", "s", "z"], ["y"], domain=MS, axis=1)
    return node, {"x1": _u8(2, 3, 4), "x2": _u8(2, 5, 4)}, {"ys": _scalar(0.1, F32), "yz": _scalar(10, U8),
                                                            "s": _scalar(0.2, F32), "z": _scalar(3, U8)}


def _qgemm(quantized: bool):
    names = ["a", "as", "az", "b", "bs", "bz", "", *(["ys", "yz"] if quantized else [])]
    node = helper.make_node("QGemm", names, ["y"], domain=MS, transB=1)
    weights = {"as": _scalar(0.1, F32), "az": _scalar(128, U8), "b": RNG.integers(-100, 100, (5, 8)).astype(I8),
               "bs": _scalar(0.2, F32), "bz": _scalar(0, I8)}
    if quantized:
        weights.update(ys=_scalar(0.5, F32), yz=_scalar(120, U8))
    return node, {"a": _u8(3, 8)}, weights


def _matmul_nbits():
    k, n, block = 32, 8, 16
    node = helper.make_node("MatMulNBits", ["a", "b", "s"], ["y"], domain=MS, K=k, N=n, bits=4, block_size=block)
    return node, {"a": _f(2, 3, k)}, {"b": _u8(n, k // block, block // 2), "s": _f(n * (k // block))}


def _dynamic_quantize_matmul():
    node = helper.make_node("DynamicQuantizeMatMul", ["a", "b", "bs"], ["y"], domain=MS)
    return node, {"a": _f(2, 5, 8)}, {"b": RNG.integers(-100, 100, (8, 6)).astype(I8), "bs": _scalar(0.1, F32)}


def _matmul_integer_to_float():
    node = helper.make_node("MatMulIntegerToFloat", ["a", "b", "as", "bs", "az"], ["y"], domain=MS)
    return node, {"a": _u8(2, 5, 8)}, {"b": RNG.integers(-100, 100, (8, 6)).astype(I8), "as": _scalar(0.1, F32),
                                       "bs": _scalar(0.2, F32), "az": _scalar(128, U8)}


def _contrib_quantize(op):
    node = helper.make_node(op, ["x", "s", "z"], ["y"], domain=MS)
    x = _f(2, 3) if op == "QuantizeLinear" else _u8(2, 3)
    return node, {"x": x}, {"s": _scalar(0.1, F32), "z": _scalar(5, U8)}


def _gather_block_quantized():
    node = helper.make_node("GatherBlockQuantized", ["data", "ids", "s"], ["y"], domain=MS, block_size=16,
                            gather_axis=0, quantize_axis=1, bits=4)
    ids = RNG.integers(0, 10, (2, 3)).astype(np.int64)
    return node, {"ids": ids}, {"data": _u8(10, 16), "s": _f(10, 2)}


def _skip_layer_norm():
    node = helper.make_node("SkipLayerNormalization", ["x", "skip", "g", "b"], ["y"], domain=MS, epsilon=1e-5)
    return node, {"x": _f(2, 3, 8), "skip": _f(2, 3, 8)}, {"g": _f(8), "b": _f(8)}


def _fused_matmul():
    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain=MS, alpha=0.5)
    return node, {"a": _f(2, 3, 4, 5)}, {"b": _f(5, 7)}


def _fast_gelu():
    node = helper.make_node("FastGelu", ["x", "bias"], ["y"], domain=MS)
    return node, {"x": _f(2, 3, 8)}, {"bias": _f(8)}


CASES = {
    "QLinearAdd": lambda: _qlinear_binary("QLinearAdd"),
    "QLinearMul": lambda: _qlinear_binary("QLinearMul"),
    "QLinearSigmoid": lambda: _qlinear_unary("QLinearSigmoid"),
    "QLinearLeakyRelu": lambda: _qlinear_unary("QLinearLeakyRelu", alpha=0.1),
    "QLinearSoftmax": lambda: _qlinear_unary("QLinearSoftmax", axis=-1, opset=13),
    "QLinearGlobalAveragePool": lambda: _qlinear_unary("QLinearGlobalAveragePool", channels_last=0),
    "QLinearAveragePool": lambda: _qlinear_unary("QLinearAveragePool", kernel_shape=[3, 3], strides=[2, 2],
                                                 pads=[1, 1, 1, 1]),
    "QLinearConcat": _qlinear_concat,
    "QGemm float": lambda: _qgemm(False),
    "QGemm quantized": lambda: _qgemm(True),
    "MatMulNBits": _matmul_nbits,
    "DynamicQuantizeMatMul": _dynamic_quantize_matmul,
    "MatMulIntegerToFloat": _matmul_integer_to_float,
    "QuantizeLinear": lambda: _contrib_quantize("QuantizeLinear"),
    "DequantizeLinear": lambda: _contrib_quantize("DequantizeLinear"),
    "GatherBlockQuantized": _gather_block_quantized,
    "SkipLayerNormalization": _skip_layer_norm,
    "FusedMatMul": _fused_matmul,
    "FastGelu": _fast_gelu,
}


def _declared(graph: onnx.GraphProto, name: str) -> tuple[int, list]:
    for vi in (*graph.output, *graph.value_info):
        if vi.name == name and vi.type.HasField("tensor_type"):
            tensor = vi.type.tensor_type
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tensor.shape.dim]
            return tensor.elem_type, dims
    return 0, []


@pytest.mark.parametrize("case", sorted(CASES))
def test_inferred_type_matches_onnxruntime(case):
    node, feeds, weights = CASES[case]()
    assert node.op_type in covered_operators()
    model = _model(node, feeds, weights)
    (expected,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    inferred = infer_graph(model)
    assert inferred is not None
    elem_type, dims = _declared(inferred, "y")
    assert elem_type == helper.np_dtype_to_tensor_dtype(expected.dtype), case
    assert len(dims) == expected.ndim, case
    batch_follows = expected.ndim > 0 and any(a.ndim and a.shape[0] == expected.shape[0] for a in feeds.values())
    for axis, (dim, size) in enumerate(zip(dims, expected.shape)):
        if axis == 0 and batch_follows and isinstance(dim, str):
            assert dim == "batch", case  # the feeds' symbolic batch carried through
        else:
            assert dim == size, (case, dims, expected.shape)
    # The annotated graph is the model's own: same nodes, none of the stand-ins' values.
    assert [n.SerializeToString() for n in inferred.node] == [n.SerializeToString() for n in model.graph.node]
    assert not [vi.name for vi in inferred.value_info if "stand_in" in vi.name]


def test_uncovered_form_stays_untyped():
    node, feeds, weights = _qlinear_unary("QLinearGlobalAveragePool", channels_last=1)
    inferred = infer_graph(_model(node, feeds, weights))
    assert inferred is not None
    assert _declared(inferred, "y") == (0, [])
    assert stand_in_contrib_ops(_model(node, feeds, weights)).model.graph.node[0].op_type == "QLinearGlobalAveragePool"


def test_contrib_node_in_a_subgraph():
    inner, feeds, weights = _qlinear_binary("QLinearAdd")
    then = helper.make_graph([inner], "then", [], [onnx.ValueInfoProto(name="y")])
    other = helper.make_graph([helper.make_node("Identity", ["a"], ["z"])], "else", [], [onnx.ValueInfoProto(name="z")])
    node = helper.make_node("If", ["cond"], ["out"], then_branch=then, else_branch=other)
    model = _model(node, {**feeds, "cond": np.array(True)}, weights)
    inferred = infer_graph(model)
    assert inferred is not None
    branch = next(a.g for a in inferred.node[0].attribute if a.name == "then_branch")
    assert branch.node[0].op_type == "QLinearAdd" and branch.node[0].domain == MS
    assert _declared(branch, "y") == (TensorProto.UINT8, ["batch", 3, 4])


def test_shape_chain_after_contrib_node_folds():
    """Reshape(y, Shape(y)[:2] + [-1]) after QLinearAdd: with y's shape known, the chain folds away once the feeds'
    shapes are known, and the session still matches onnxruntime."""
    node, feeds, weights = _qlinear_binary("QLinearAdd")
    nodes = [node,
             helper.make_node("Shape", ["y"], ["shape"]),
             helper.make_node("Slice", ["shape", "zero", "two"], ["head"]),
             helper.make_node("Concat", ["head", "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["y", "target"], ["out"])]
    weights.update(zero=np.array([0]), two=np.array([2]), minus_one=np.array([-1]))
    inputs = [helper.make_tensor_value_info(name, TensorProto.UINT8, ["batch", *a.shape[1:]]) for name, a in
              feeds.items()]
    graph = helper.make_graph(nodes, "g", inputs, [onnx.ValueInfoProto(name="out")],
                              [numpy_helper.from_array(a, name) for name, a in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(MS, 1)],
                              ir_version=8)
    session = onnx_runtime.InferenceSession(model.SerializeToString())
    (got,) = session.run(None, feeds)
    (expected,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    np.testing.assert_array_equal(got, expected)
    assert not [n.op_type for n in session.graph_for(feeds).nodes if n.op_type in ("Shape", "Slice", "Concat")]
