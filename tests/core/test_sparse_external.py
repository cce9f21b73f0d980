"""Sparse initializers with external data are read from the model's folder, never the working directory;
sparse tensors whose indices do not fit their dims are refused with a typed error."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnx_runtime
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidGraphError, ModelLoadError


def sparse_add_model(values: np.ndarray, indices: np.ndarray, dims: list[int]) -> onnx.ModelProto:
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(values, "w"), numpy_helper.from_array(indices, "w_idx"),
                                       dims)
    graph = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    graph.sparse_initializer.append(sparse)
    return helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)])


def externalize(tensor: onnx.TensorProto, location: str, folder) -> None:
    with open(os.path.join(folder, location), "wb") as f:
        f.write(tensor.raw_data or numpy_helper.to_array(tensor).tobytes())
    if not tensor.HasField("raw_data"):
        tensor.raw_data = numpy_helper.to_array(tensor).tobytes()
    onnx.external_data_helper.set_external_data(tensor, location=location)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL


def test_external_sparse_values_come_from_the_model_folder_not_the_cwd(tmp_path, monkeypatch):
    folder, elsewhere = tmp_path / "model", tmp_path / "cwd"
    folder.mkdir()
    elsewhere.mkdir()
    model = sparse_add_model(np.array([1.5, -2.0], np.float32), np.array([1, 3], np.int64), [4])
    externalize(model.graph.sparse_initializer[0].values, "w.bin", folder)
    onnx.save(model, str(folder / "model.onnx"))
    (elsewhere / "w.bin").write_bytes(np.array([100.0, 100.0], np.float32).tobytes())  # a decoy
    monkeypatch.chdir(elsewhere)
    sess = onnx_runtime.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": np.zeros(4, np.float32)})
    assert np.array_equal(y, np.array([0, 1.5, 0, -2.0], np.float32))


def test_external_sparse_data_outside_the_model_folder_is_refused(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    model = sparse_add_model(np.array([1.0], np.float32), np.array([0], np.int64), [2])
    externalize(model.graph.sparse_initializer[0].values, "w.bin", tmp_path)
    for entry in model.graph.sparse_initializer[0].values.external_data:
        if entry.key == "location":
            entry.value = "../w.bin"
    onnx.save(model, str(folder / "model.onnx"))
    with pytest.raises(ModelLoadError, match="external data"):
        onnx_runtime.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])


def test_a_model_given_as_bytes_with_external_sparse_data_names_the_fix(tmp_path):
    model = sparse_add_model(np.array([1.0], np.float32), np.array([0], np.int64), [2])
    externalize(model.graph.sparse_initializer[0].values, "w.bin", tmp_path)
    with pytest.raises(ModelLoadError, match="pass the model's path"):
        onnx_runtime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("indices, dims", [
    (np.array([0, 4], np.int64), [4]),           # past the end
    (np.array([-1, 0], np.int64), [4]),          # negative
    (np.array([[0, 0], [2, 0]], np.int64), [2, 2]),  # a row past its dim
    (np.array([0, 1, 2], np.int64), [4]),        # more indices than values
])
def test_sparse_indices_that_do_not_fit_are_a_typed_error(indices, dims):
    model = sparse_add_model(np.array([1.0, 2.0], np.float32), indices, dims)
    with pytest.raises(InvalidGraphError, match="do not fit dims"):
        onnx_runtime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
