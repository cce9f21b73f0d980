"""Shared by the CUDA operator tests (test_ops_linalg/conv/data; the driver is chosen by conftest's
``cuda_driver_mode``): single-node models, the onnx backend node cases of an
operator family, and the comparison of CUDA+CPU runs against the CPU provider.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from onnx import helper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "conformance"))
from backend_cases import assert_similar, node_cases  # noqa: E402

driver = pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")

CUDA_FIRST = ["CUDAExecutionProvider", "CPUExecutionProvider"]
CUDA = "CUDAExecutionProvider"
HALVES = [np.float16, ml_dtypes.bfloat16]


_kernel_files: dict[str, str] = {}


def kernel_file(tmp_path_factory, name: str, source: str) -> str:
    """The path of a test-only kernel source ``name`` holding ``source``, written once per test session."""
    if name not in _kernel_files:
        path = tmp_path_factory.mktemp("kernels") / name
        path.write_text(source)
        _kernel_files[name] = str(path)
    return _kernel_files[name]


def random(shape, dtype=np.float32, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, shape).astype(dtype)


# The operator families these tests cover; a backend case runs with the first family it uses.
LINALG_OPS = frozenset({"MatMul", "Gemm"})
CONV_OPS = frozenset({"Conv", "MaxPool", "AveragePool", "GlobalAveragePool"})
DATA_OPS = frozenset({"Transpose", "Concat", "Slice", "Split", "Expand", "Tile", "Gather", "GatherElements",
                      "GatherND", "ScatterND", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Range",
                      "ConstantOfShape", "Shape"})
FAMILIES = (CONV_OPS, LINALG_OPS, DATA_OPS)


def family_cases(ops: frozenset[str]) -> list[str]:
    """Names of the backend node cases built only from these families' operators whose first family (in
    FAMILIES order) is ``ops``, so each case is tested once."""
    supported = frozenset().union(*FAMILIES)
    before = frozenset().union(*FAMILIES[:FAMILIES.index(ops)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case generators trip numpy overflow warnings on purpose
        cases = node_cases()
    names = []
    for name, case in sorted(cases.items()):
        used = {node.op_type for node in case.model.graph.node}
        if used <= supported and used & ops and not used & before:
            names.append(name)
    return names


def run_backend_case(name: str, declined_ok=lambda name: False) -> None:
    """Run case ``name`` on CUDA+CPU: every node must be placed on CUDA (unless ``declined_ok(name)``: then
    the nodes left on the CPU must carry CUDA's reason) and the outputs must match the CPU provider's."""
    case = node_cases()[name]
    data = case.model.SerializeToString()
    session = ort.InferenceSession(data, providers=CUDA_FIRST)
    off = [n for n in session.placement() if n.provider != CUDA]
    if off:
        assert declined_ok(name), f"{name}: nodes left CUDA: {[(n.op_type, n.rejected) for n in off]}"
        assert all(CUDA in n.rejected for n in off)
    reference = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    initializers = {i.name for i in case.model.graph.initializer}
    names = [i.name for i in case.model.graph.input if i.name not in initializers]
    for inputs, _ in case.data_sets:
        feeds = dict(zip(names, [onnx.numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else v
                                 for v in inputs]))
        expected = reference.run(None, feeds)
        assert_similar(expected, session.run(None, feeds), _cross_provider_rtol(expected, case.rtol), case.atol)


# One unit in the last place, relative to the value (at most): the CUDA kernels compute half-precision types
# in float32 and round once at the output, where the CPU provider rounds where an operator's function
# body does (Attention), so a correctly rounded pair of results may differ by that much.
_ONE_ULP = {"bfloat16": 2.0**-7, "float16": 2.0**-10}


def _cross_provider_rtol(expected: list, rtol: float) -> float:
    names = {getattr(value, "dtype", np.dtype(object)).name for value in expected}
    return max([rtol, *(_ONE_ULP[name] for name in names if name in _ONE_ULP)])


def node_model(op: str, inputs: dict[str, np.ndarray | None], attrs: dict | None = None, opset: int = 18,
               outputs: int = 1) -> bytes:
    """A one-node model whose inputs are graph inputs named as ``inputs`` (None: an omitted optional)."""
    names = [name if value is not None else "" for name, value in inputs.items()]
    infos = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)
             for name, value in inputs.items() if value is not None]
    outs = []
    for i in range(outputs):
        info = onnx.ValueInfoProto()
        info.name = f"y{i}"
        outs.append(info)
    node = helper.make_node(op, names, [o.name for o in outs], **(attrs or {}))
    graph = helper.make_graph([node], "g", infos, outs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()


def compare(model: bytes, feeds: dict[str, np.ndarray], rtol: float = 1e-5, atol: float = 1e-6,
            all_on_cuda: bool = True) -> list:
    """Outputs of CUDA+CPU, checked against the CPU provider's (exact for integers, bools and dtypes)."""
    session = ort.InferenceSession(model, providers=CUDA_FIRST)
    if all_on_cuda:
        off = {n.node: n.rejected for n in session.placement() if n.provider != CUDA}
        assert not off, f"nodes placed off CUDA: {off}"
    expected = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    got = session.run(None, feeds)
    assert_similar(expected, got, rtol, atol)
    return got


def check_node(op: str, inputs: dict, attrs: dict | None = None, opset: int = 18, outputs: int = 1,
               rtol: float = 1e-5, atol: float = 1e-6) -> list:
    """One node on CUDA against the CPU provider."""
    feeds = {name: value for name, value in inputs.items() if value is not None}
    return compare(node_model(op, inputs, attrs, opset, outputs), feeds, rtol, atol)


def decline_reason(op: str, inputs: dict, attrs: dict | None = None, opset: int = 18, outputs: int = 1) -> str:
    """Why the CUDA provider declined the one node of ``op`` (which then runs on the CPU)."""
    session = ort.InferenceSession(node_model(op, inputs, attrs, opset, outputs), providers=CUDA_FIRST)
    (placed,) = list(session.placement())
    assert placed.provider == "CPUExecutionProvider"
    return placed.rejected[CUDA]


def tolerance(dtype) -> dict:
    """rtol/atol for outputs stored in ``dtype`` after float accumulation."""
    name = np.dtype(dtype).name
    if name == "bfloat16":
        return {"rtol": 2e-2, "atol": 2e-2}
    if name == "float16":
        return {"rtol": 5e-3, "atol": 5e-3}
    return {"rtol": 1e-4, "atol": 1e-5}
