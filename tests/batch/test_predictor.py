"""onnx_runtime.batch.Predictor in one process: batch kinds, pickling, padding, static batches, failures, sizing."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from batch_helpers import IN, mlp_reference
from onnx_runtime.batch import Predictor, plan_workers, usable_cpus, worker_threads
from onnx_runtime.batch.sizing import even_micro_batch
from onnx_runtime.errors import InvalidArgumentError, ProviderNotAvailableError


def test_dict_batch_matches_reference_and_keeps_other_columns(mlp, rows):
    out = Predictor(mlp, batch_size=7)({"id": np.arange(50), "x": rows[:50]})
    assert sorted(out) == ["id", "y"]  # the model input is not carried to the result
    np.testing.assert_array_equal(out["id"], np.arange(50))
    np.testing.assert_allclose(out["y"], mlp_reference(rows[:50]), rtol=1e-5, atol=1e-5)


def test_pandas_and_arrow_batches(mlp, rows):
    import pandas as pd
    import pyarrow as pa

    frame = pd.DataFrame({"id": np.arange(20), "features": list(rows[:20])}, index=np.arange(100, 120))
    out = Predictor(mlp, inputs={"x": "features"})(frame)
    assert list(out.index) == list(frame.index)  # Dask aligns partitions on the index
    np.testing.assert_allclose(np.stack(out["y"]), mlp_reference(rows[:20]), rtol=1e-5, atol=1e-5)
    table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(rows[:20].ravel()), IN)})
    out = Predictor(mlp)(table)
    np.testing.assert_allclose(out.column("y").combine_chunks().to_numpy_ndarray(), mlp_reference(rows[:20]),
                               rtol=1e-5, atol=1e-5)


def test_pickles_as_plain_data_and_shares_one_session_per_process(mlp, rows):
    first = Predictor(mlp, intra_op_threads=1)
    first({"x": rows[:2]})
    assert first.session is not None
    clone = pickle.loads(pickle.dumps(first))
    assert clone.__dict__["_session"] is None  # the session never travels
    assert len(pickle.dumps(first)) < 2000
    assert clone.session is first.session  # same model and settings in one process: one session
    with open(mlp, "rb") as f:
        from_bytes = Predictor(f.read(), intra_op_threads=1)
    np.testing.assert_allclose(from_bytes({"x": rows[:3]})["y"], mlp_reference(rows[:3]), rtol=1e-5, atol=1e-5)


def test_variable_length_rows_are_padded_masked_and_trimmed(sequence_model):
    lengths = [3, 7, 1, 5, 7, 2]
    rng = np.random.default_rng(2)
    ids = [rng.integers(1, 100, n).astype(np.float32) for n in lengths]
    column = np.empty(len(ids), dtype=object)
    column[:] = ids  # a ragged column, as Ray Data and pandas hand it over
    out = Predictor(sequence_model, mask_input="mask", batch_size=4)({"ids": column})
    for i, row in enumerate(ids):
        np.testing.assert_array_equal(out["scaled"][i], row * 2)  # cut back to the row's own length
        assert out["total"][i] == pytest.approx(float(row.astype(np.float64).sum()), rel=1e-6)
    padded = Predictor(sequence_model, mask_input="mask", pad_to={"ids": {0: 8}})({"ids": column})
    assert [len(r) for r in padded["scaled"]] == lengths
    with pytest.raises(InvalidArgumentError, match="over the padded length 4"):
        Predictor(sequence_model, mask_input="mask", pad_to={"ids": {0: 4}})({"ids": column})


def test_static_batch_of_one_runs_row_by_row(mlp_batch1, rows):
    out = Predictor(mlp_batch1, batch_size=16)({"x": rows[:5]})
    np.testing.assert_allclose(out["y"], mlp_reference(rows[:5]), rtol=1e-5, atol=1e-5)


def test_flat_rows_are_reshaped_and_bad_rows_recorded(mlp, rows):
    column = np.empty(4, dtype=object)
    column[:] = [rows[0], rows[1][:5], rows[2], rows[3]]  # row 1 is short
    out = Predictor(mlp, errors="record")({"x": column})
    assert out["error"][1] is not None and "row 1" in out["error"][1] and "16 values" in out["error"][1]
    assert [e is None for e in out["error"]] == [True, False, True, True]
    assert out["y"][1] is None
    np.testing.assert_allclose(np.stack(out["y"][[0, 2, 3]]), mlp_reference(rows[[0, 2, 3]]), rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidArgumentError, match="row 1"):
        Predictor(mlp)({"x": column})


def test_missing_provider_is_a_clear_error_in_the_worker(mlp, rows, monkeypatch):
    with pytest.raises(ProviderNotAvailableError, match="'NoSuchExecutionProvider' is not installed here"):
        Predictor(mlp, providers=["NoSuchExecutionProvider", "CPUExecutionProvider"])({"x": rows[:1]})
    # an installed provider that cannot run here (the CUDA one without a GPU) is refused, not skipped
    from onnx_runtime.discovery import registry

    cuda = registry().find("CUDAExecutionProvider")
    if cuda is None or cuda.availability.available:
        pytest.skip("needs the CUDA provider installed on a machine where it cannot run")
    with pytest.raises(ProviderNotAvailableError, match="CUDAExecutionProvider cannot run here"):
        Predictor(mlp, providers=["CUDAExecutionProvider", "CPUExecutionProvider"])({"x": rows[:1]})


def test_bad_arguments_are_typed_errors(mlp, rows):
    with pytest.raises(InvalidArgumentError, match="path every worker can read"):
        Predictor(object())
    with pytest.raises(InvalidArgumentError, match="batch_size"):
        Predictor(mlp, batch_size=0)
    with pytest.raises(InvalidArgumentError, match="no column 'x'"):
        Predictor(mlp)({"a": rows[:2], "b": rows[:2]})
    with pytest.raises(InvalidArgumentError, match="SessionOptions does not have"):
        Predictor(mlp, session_options={"no_such_option": 1})({"x": rows[:1]})


def test_sizing_never_oversubscribes():
    assert plan_workers(cpus=8) == (8, 1)
    assert plan_workers(workers=3, cpus=8) == (3, 2)
    assert plan_workers(threads=3, cpus=8) == (2, 3)
    for workers, threads in ((None, 9), (9, None)):
        with pytest.raises(InvalidArgumentError, match="oversubscribes"):
            plan_workers(workers, threads, cpus=8)
    for workers in range(1, 9):
        for threads in range(1, 9):
            if workers * threads <= 8:
                assert plan_workers(workers, threads, cpus=8) == (workers, threads)
            else:
                with pytest.raises(InvalidArgumentError, match="oversubscribes"):
                    plan_workers(workers, threads, cpus=8)
    assert worker_threads() == usable_cpus()  # a plain process: one session, every CPU


def test_micro_batches_split_a_shard_evenly_where_they_can():
    # (rows, rows per call): at most 32 and at least 16 rows, dividing the shard; a short shard in one call
    cases = [(1, 1), (20, 20), (32, 32), (48, 24), (50, 25), (64, 32), (250, 25), (1000, 25), (1024, 32), (997, 32),
             (33, 32)]
    assert [(rows, even_micro_batch(rows)) for rows, _ in cases] == cases
    for rows in range(1, 400):
        size = even_micro_batch(rows)
        assert size <= 32 and (rows % size == 0 or size == 32) and (size >= 16 or size == rows)
    with pytest.raises(InvalidArgumentError, match="rows per shard"):
        even_micro_batch(0)


def test_session_options_are_plain_data(mlp, rows):
    p = Predictor(mlp, session_options={"graph_optimization_level": 0, "config": {"session.max_value_bytes": 1 << 30}},
                  intra_op_threads=1)
    p({"x": rows[:2]})
    options = p.session.get_session_options()
    assert options.intra_op_num_threads == 1 and int(options.graph_optimization_level) == 0


def test_worker_sessions_compile_kernels_in_the_foreground_unless_the_caller_says_otherwise(mlp, rows):
    default = Predictor(mlp, batch_size=5)
    np.testing.assert_allclose(default({"x": rows[:5]})["y"], mlp_reference(rows[:5]), rtol=1e-5, atol=1e-5)
    assert default.session.get_session_options().config()["session.compile_in_background"] == "0"
    chosen = Predictor(mlp, session_options={"config": {"session.compile_in_background": "1"}})
    assert chosen.session.get_session_options().config()["session.compile_in_background"] == "1"


@pytest.mark.parametrize("runtime", ["onnx_runtime", "onnxruntime"])
@pytest.mark.parametrize(("batch_size", "runs"), [(None, [32, 18]), (8, [8] * 6 + [2])])
def test_a_dynamic_batch_axis_takes_batch_size_rows_per_run_for_both_runtimes(mlp, rows, runtime, batch_size,
                                                                              runs, monkeypatch):
    """Rows are stacked along a dynamic batch axis, ``batch_size`` (default 32) per run, and both runtimes'
    predictors are wrapped the same way (what benchmarks/batch_bench.py compares)."""
    predictor = Predictor(mlp, batch_size=batch_size, runtime=runtime)
    session, batches = predictor.session, []
    run = session.run

    def recording(names, feeds, *args):
        batches.append({len(value) for value in feeds.values()})
        return run(names, feeds, *args)

    monkeypatch.setattr(session, "run", recording)  # the process keeps the session: restored after the test
    out = predictor({"x": rows[:50]})
    assert batches == [{n} for n in runs]
    np.testing.assert_allclose(out["y"], mlp_reference(rows[:50]), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def lookup_model(tmp_path_factory) -> str:
    """y = table[ids] (Gather), ids: [N, 2] int64 into a 10-row table: an id past the table fails its row."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    table = numpy_helper.from_array(np.arange(30, dtype=np.float32).reshape(10, 3), "table")
    graph = helper.make_graph([helper.make_node("Gather", ["table", "ids"], ["y"])], "lookup",
                              [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 3])], [table])
    path = tmp_path_factory.mktemp("models") / "lookup.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return str(path)


@pytest.mark.parametrize("runtime", ["onnx_runtime", "onnxruntime"])
def test_a_dense_column_runs_as_views_and_matches_the_per_row_path(mlp, rows, runtime):
    """A numeric column is fed as slices of one array (no per-row work); the result equals the same rows given
    as a column of per-row arrays (the general path), and a flat column is reshaped to the per-row shape."""
    dense = Predictor(mlp, batch_size=16, runtime=runtime)({"x": rows[:100]})["y"]
    column = np.empty(100, dtype=object)
    column[:] = list(rows[:100])
    general = Predictor(mlp, batch_size=16, runtime=runtime)({"x": column})["y"]
    assert dense.shape == (100, 4) and dense.dtype == np.float32
    np.testing.assert_array_equal(dense, general)
    np.testing.assert_allclose(dense, mlp_reference(rows[:100]), rtol=1e-5, atol=1e-5)
    flat = Predictor(mlp, batch_size=16, runtime=runtime)({"x": rows[:100].reshape(100, 4, 4)})["y"]
    np.testing.assert_array_equal(flat, dense)


@pytest.mark.parametrize("runtime", ["onnx_runtime", "onnxruntime"])
def test_a_failing_dense_micro_batch_is_retried_row_by_row(lookup_model, runtime):
    ids = np.tile(np.arange(2, dtype=np.int64)[None, :], (40, 1)) + np.arange(40, dtype=np.int64)[:, None] % 8
    ids[13, 1] = 99  # past the 10-row table: this row fails, the other 39 do not
    predictor = Predictor(lookup_model, batch_size=8, errors="record", runtime=runtime)
    out = predictor({"ids": ids})
    assert [i for i, message in enumerate(out["error"]) if message is not None] == [13]
    table = np.arange(30, dtype=np.float32).reshape(10, 3)
    for i in range(40):
        if i != 13:
            np.testing.assert_array_equal(out["y"][i], table[ids[i]])
    assert out["y"][13] is None
    with pytest.raises(Exception, match="99|out of|indices"):
        Predictor(lookup_model, batch_size=8, runtime=runtime)({"ids": ids})
