"""A prepared predictor's warm-up plan is the one its first batch runs (the predictor's session says its graph
inputs are per-call data): the first batch of read-only rows, as Arrow hands them over, plans nothing, its tail
micro-batch plans once, and the outputs stay within a float64 reference."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.batch.predictor import Predictor
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.ops import segment as segment_module


def _cnn() -> onnx.ModelProto:
    """Stem, a residual 3x3 pair, a strided 1x1, a pool and a Gemm head: one fused segment on the CPU provider."""
    rng = np.random.default_rng(9)
    inits, nodes = [], []

    def conv(x, y, cin, cout, k, stride=1):
        w = numpy_helper.from_array((rng.standard_normal((cout, cin, k, k)) * 0.3).astype(np.float32), f"{y}_w")
        inits.append(w)
        nodes.append(helper.make_node("Conv", [x, w.name], [y], kernel_shape=[k, k], strides=[stride, stride],
                                      pads=[k // 2] * 4))

    conv("x", "stem", 3, 8, 3, stride=2)
    nodes.append(helper.make_node("Relu", ["stem"], ["s"]))
    conv("s", "a", 8, 8, 3)
    nodes.append(helper.make_node("Relu", ["a"], ["a_r"]))
    conv("a_r", "b", 8, 8, 3)
    nodes.append(helper.make_node("Add", ["b", "s"], ["r"]))
    conv("r", "down", 8, 12, 1, stride=2)
    nodes.append(helper.make_node("GlobalAveragePool", ["down"], ["pooled"]))
    nodes.append(helper.make_node("Flatten", ["pooled"], ["flat"]))
    inits.append(numpy_helper.from_array((rng.standard_normal((12, 5)) * 0.3).astype(np.float32), "fc"))
    nodes.append(helper.make_node("Gemm", ["flat", "fc"], ["y"]))
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 15, 15])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _reference(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    from reference64 import run_float64

    return run_float64(model, {"x": x})[0]


def test_a_prepared_predictors_first_batch_plans_only_its_tail(monkeypatch):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "cpu"))  # reference64
    deferred.wait_ready(240)
    planned = []
    real_plan = segment_module.Segment._plan_and_run  # noqa: SLF001

    def plan_and_run(self, key, inputs):
        planned.append(key[0][0])
        return real_plan(self, key, inputs)

    monkeypatch.setattr(segment_module.Segment, "_plan_and_run", plan_and_run)
    model = _cnn()
    monkeypatch.setenv("ONNX_RUNTIME_PLAN_CACHE", "0")
    predictor = Predictor(model.SerializeToString(), intra_op_threads=1, batch_size=8, prepare=True)
    assert planned == [(8, 3, 15, 15)], "the warm-up was expected to plan the batch size's segment"
    x = np.random.default_rng(4).standard_normal((20, 3, 15, 15)).astype(np.float32)
    x.setflags(write=False)
    y = predictor({"x": x})["y"]
    assert planned == [(8, 3, 15, 15), (4, 3, 15, 15)], planned
    exact = _reference(model, x)
    assert np.abs(y - exact).max() <= 1e-4 * (1 + np.abs(exact).max())


def test_a_jobs_shards_run_in_equal_micro_batches_planned_once(monkeypatch, tmp_path):
    """run_job without a batch size splits each 50-row shard into two calls of 25 rows, not 32 + 18: a worker
    plans one micro-batch shape (at its warm-up), where a short last call would plan a second."""
    from pathlib import Path

    import pyarrow as pa
    import pyarrow.parquet as pq
    from onnx_runtime.batch import engines, read_predictions, run_job
    from onnx_runtime.batch.job import process_shard

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "cpu"))  # reference64
    deferred.wait_ready(240)
    planned = []
    real_plan = segment_module.Segment._plan_and_run  # noqa: SLF001

    def plan_and_run(self, key, inputs):
        planned.append(key[0][0])
        return real_plan(self, key, inputs)

    def in_this_process(job, shards, workers, threads, finished, retries, address):
        for shard in shards:
            finished(process_shard(job, shard))

    monkeypatch.setattr(segment_module.Segment, "_plan_and_run", plan_and_run)
    monkeypatch.setitem(engines.ENGINES, "local", in_this_process)
    monkeypatch.setenv("ONNX_RUNTIME_PLAN_CACHE", "0")
    model = _cnn()
    onnx.save(model, str(tmp_path / "cnn.onnx"))
    x = np.random.default_rng(5).standard_normal((100, 3, 15, 15)).astype(np.float32)
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), 3 * 15 * 15)}),
                   str(tmp_path / "x.parquet"), row_group_size=50)
    summary = run_job(str(tmp_path / "cnn.onnx"), str(tmp_path / "x.parquet"), str(tmp_path / "out"), workers=1,
                      threads=1, shard_rows=50, progress=False)
    assert summary.processed_rows == 100 and not summary.failures
    assert planned == [(25, 3, 15, 15)], planned
    table = read_predictions(str(tmp_path / "out"))
    y = np.array(table.column("y").to_pylist(), np.float64)[np.argsort(table.column("row_id").to_pylist())]
    exact = _reference(model, x)
    assert np.abs(y - exact).max() <= 1e-4 * (1 + np.abs(exact).max())
