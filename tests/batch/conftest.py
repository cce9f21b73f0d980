"""Models and data for the batch tests, made once per session, and their float64 references."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from batch_helpers import IN, OUT, weights
from onnx import TensorProto, helper, numpy_helper


def _providers_installed() -> bool:
    from importlib.metadata import entry_points

    return bool(entry_points(group="onnx_runtime.providers"))


# As the suite's root conftest does: with no provider installed (tox -e core) no session can run here.
collect_ignore_glob = [] if _providers_installed() else ["test_*.py"]


@pytest.fixture(autouse=True)
def _restore_background_compile():
    """Predictor sessions turn the CPU provider's background kernel loading off for their process (a worker runs
    for long); in this test process, restore it for the tests after."""
    from onnx_runtime_ep_cpu.compiled import deferred

    saved = (deferred.state.disabled, deferred.state.deferring)
    yield
    deferred.state.disabled, deferred.state.deferring = saved


def _save(nodes, inputs, outputs, initializers, path):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


@pytest.fixture(scope="session")
def mlp(tmp_path_factory) -> str:
    """y = relu(x @ w), x: [N, 16] float32, dynamic batch."""
    path = tmp_path_factory.mktemp("models") / "mlp.onnx"
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    return _save(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", IN])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", OUT])],
                 [numpy_helper.from_array(weights(), "w")], path)


@pytest.fixture(scope="session")
def mlp_batch1(tmp_path_factory) -> str:
    """The MLP with a static batch of 1."""
    path = tmp_path_factory.mktemp("models") / "mlp1.onnx"
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"])]
    return _save(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, IN])],
                 [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, OUT])],
                 [numpy_helper.from_array(weights(), "w")], path)


@pytest.fixture(scope="session")
def sequence_model(tmp_path_factory) -> str:
    """ids: [N, L] float, mask: [N, L] float -> scaled = ids * 2 per token, total = sum(ids * mask) per row."""
    path = tmp_path_factory.mktemp("models") / "seq.onnx"
    two = numpy_helper.from_array(np.array(2.0, np.float32), "two")
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    nodes = [helper.make_node("Mul", ["ids", "two"], ["scaled"]), helper.make_node("Mul", ["ids", "mask"], ["kept"]),
             helper.make_node("ReduceSum", ["kept", "axes"], ["total"], keepdims=0)]
    return _save(nodes, [helper.make_tensor_value_info("ids", TensorProto.FLOAT, ["N", "L"]),
                         helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["N", "L"])],
                 [helper.make_tensor_value_info("scaled", TensorProto.FLOAT, ["N", "L"]),
                  helper.make_tensor_value_info("total", TensorProto.FLOAT, ["N"])], [two, axes], path)


@pytest.fixture(scope="session")
def rows() -> np.ndarray:
    return np.random.default_rng(1).standard_normal((600, IN)).astype(np.float32)


@pytest.fixture(scope="session")
def parquet_data(tmp_path_factory, rows) -> str:
    """``rows`` as a Parquet file: id (row * 10), x (a 16-float list), in row groups of 250."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path_factory.mktemp("data") / "rows.parquet"
    table = pa.table({"id": np.arange(len(rows), dtype=np.int64) * 10,
                      "x": pa.FixedSizeListArray.from_arrays(pa.array(rows.ravel()), IN)})
    pq.write_table(table, str(path), row_group_size=250)
    return str(path)
