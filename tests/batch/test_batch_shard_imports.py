"""A new worker's shard loop reads and writes Parquet without importing pandas or pyarrow.compute (pyarrow's
``to_numpy`` and ``pa.array`` import the one, ``flatten`` and ``combine_chunks`` the other: together half of a new
worker's first shard), and what it writes is what pyarrow's own conversions would have written: every row once,
outputs as the float64 reference's."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
from batch_helpers import IN, assert_predictions
from onnx_runtime.batch.job import read_predictions
from onnx_runtime.batch.sources import Shard, open_source

SHARDS = r"""
import sys
from onnx_runtime.batch.job import process_shard
from onnx_runtime.batch.sources import open_source
model, data, out = sys.argv[1:4]
source = open_source(data)
job = {"source": source, "output": out, "id_column": "id",
       "predictor": dict(model=model, intra_op_threads=1, keep_columns=[], errors="record", batch_size=7)}
results = [process_shard(job, shard) for shard in source.shards(100)]
assert all(r["written"] for r in results), results
print("pandas" in sys.modules, "pyarrow.compute" in sys.modules)
"""


def test_a_worker_shard_loop_imports_no_pandas(mlp, parquet_data, rows, tmp_path):
    out = tmp_path / "out"
    os.makedirs(out)
    done = subprocess.run([sys.executable, "-c", SHARDS, mlp, parquet_data, str(out)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["False", "False"]  # neither pandas nor pyarrow.compute imported
    assert_predictions(read_predictions(str(out)), rows, list(range(0, 10 * len(rows), 10)))


def test_a_sliced_column_is_read_in_place_with_its_offset(tmp_path):
    """Shards that start inside a row group: the flat values are viewed at the slice's offset, for each numeric
    type, as pyarrow's conversion gives them."""
    import pyarrow.parquet as pq

    for dtype in (np.float32, np.float64, np.float16, np.int64, np.uint8):
        values = (np.arange(40 * IN) % 97).astype(dtype).reshape(40, IN)
        path = str(tmp_path / f"{np.dtype(dtype).name}.parquet")
        column = pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), IN)
        pq.write_table(pa.table({"x": column}), path, row_group_size=40)
        source = open_source(path)
        (whole,) = source.shards(40)
        shard = Shard(index=0, file=whole.file, group=whole.group, start=13, stop=31, base=13)
        columns, ids, failures = source.read(shard, None)
        got = columns["x"]
        assert got.dtype == dtype and got.shape == (18, IN) and not failures and ids == list(range(13, 31))
        assert np.array_equal(got, values[13:31])
        assert not got.flags.writeable  # Arrow's memory, viewed: immutable as pyarrow's zero-copy conversion has it


def test_a_row_group_is_decoded_on_the_calling_thread(monkeypatch, tmp_path):
    """A worker is one of workers x threads = CPUs: its shard's row group is read without Arrow's thread pool."""
    import pyarrow.parquet as pq

    values = (np.arange(30 * IN) % 89).astype(np.float32).reshape(30, IN)
    path = str(tmp_path / "x.parquet")
    pq.write_table(pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(values.ravel()), IN)}), path)
    asked = []
    real = pq.ParquetFile.read_row_group

    def read_row_group(self, i, columns=None, use_threads=True, use_pandas_metadata=False):
        asked.append(use_threads)
        return real(self, i, columns=columns, use_threads=use_threads, use_pandas_metadata=use_pandas_metadata)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", read_row_group)
    source = open_source(path)
    columns, ids, failures = source.read(source.shards(30)[0], None)
    assert asked == [False]
    assert np.array_equal(columns["x"], values) and ids == list(range(30)) and not failures
