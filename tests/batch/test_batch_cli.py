"""``onnx-runtime batch`` on the local engine: Parquet, NumPy and image inputs, the summary, a killed worker,
and an interrupted job resumed without recomputing or duplicating rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from batch_helpers import assert_predictions
from onnx_runtime.batch import read_predictions, run_job
from onnx_runtime.cli import main
from onnx_runtime.errors import InvalidArgumentError


def test_parquet_on_two_local_workers_matches_one_process(mlp, rows, parquet_data, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["batch", mlp, "--input", parquet_data, "--output", str(out), "--workers", "2", "--threads", "1",
                 "--shard-rows", "100", "--id-column", "id"])
    printed = capsys.readouterr()
    assert code == 0, printed.err
    assert "rows: 600 in 7 shards" in printed.out and "rows/s" in printed.out and "failed rows: 0" in printed.out
    assert "rows/s" in printed.err and "100%" in printed.err  # the progress bar
    assert_predictions(read_predictions(str(out)), rows, list(range(0, 6000, 10)))
    summary = json.loads((out / "_summary.json").read_text())
    assert summary["rows"] == summary["processed_rows"] == 600 and summary["failures"] == []
    assert summary["workers"] == 2 and summary["threads"] == 1
    # the CPU accounting: shards ran in one or two workers, whose CPU since start covers their shards'
    assert summary["workers_seen"] in (1, 2) and 0 < summary["shard_cpu_seconds"] <= summary["worker_cpu_seconds"]


def test_numpy_input_and_row_positions_as_ids(mlp, rows, tmp_path):
    np.save(tmp_path / "x.npy", rows[:130])
    summary = run_job(mlp, str(tmp_path / "x.npy"), str(tmp_path / "out"), workers=1, threads=1, shard_rows=64,
                      progress=False)
    assert (summary.rows, summary.shards, summary.failures) == (130, 3, [])
    assert_predictions(read_predictions(str(tmp_path / "out")), rows[:130], list(range(130)))


def test_image_folder_with_an_unreadable_file(tmp_path):
    """Images are resized to the model's input and laid out NCHW; an unreadable file fails its row, named."""
    from onnx import TensorProto, helper, save
    from PIL import Image

    folder = tmp_path / "images"
    folder.mkdir()
    rng = np.random.default_rng(3)
    pixels = {}
    for i in range(5):
        array = rng.integers(0, 256, (8, 6, 3), dtype=np.uint8)  # 8 high, 6 wide: the model's size, no resampling
        Image.fromarray(array).save(folder / f"img{i}.png")
        pixels[f"img{i}.png"] = array
    (folder / "broken.png").write_bytes(b"not a png")
    graph = helper.make_graph([helper.make_node("ReduceMean", ["image"], ["mean"], axes=[2, 3], keepdims=0)], "g",
                              [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 8, 6])],
                              [helper.make_tensor_value_info("mean", TensorProto.FLOAT, ["N", 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    save(model, str(tmp_path / "mean.onnx"))
    summary = run_job(str(tmp_path / "mean.onnx"), str(folder), str(tmp_path / "out"), workers=1, threads=1,
                      progress=False)
    assert summary.rows == 6
    assert [f[0] for f in summary.failures] == ["broken.png"] and "UnidentifiedImageError" in summary.failures[0][1]
    table = read_predictions(str(tmp_path / "out"))
    got = dict(zip(table.column("row_id").to_pylist(), table.column("mean").to_pylist()))
    assert got["broken.png"] is None
    for name, array in pixels.items():
        np.testing.assert_allclose(got[name], array.astype(np.float64).mean(axis=(0, 1)) / 255.0, rtol=1e-5)


def test_a_different_job_is_not_mixed_into_an_output(mlp, mlp_batch1, parquet_data, tmp_path):
    out = str(tmp_path / "out")
    run_job(mlp, parquet_data, out, workers=1, threads=1, shard_rows=300, progress=False)
    with pytest.raises(InvalidArgumentError, match="different job.*model_sha256"):
        run_job(mlp_batch1, parquet_data, out, workers=1, threads=1, shard_rows=300, progress=False)
    with pytest.raises(InvalidArgumentError, match="oversubscribes"):
        run_job(mlp, parquet_data, out, workers=64, threads=64, progress=False)


def _children(pid: int) -> list[int]:
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            found += [int(c) for c in open(f"/proc/{pid}/task/{task}/children").read().split()]
        except OSError:
            pass
    return found


def _worker_pids(parent: int) -> list[int]:
    """The pool's workers: the children of ``parent``'s multiprocessing fork server."""
    servers = []
    for child in _children(parent):
        try:
            if b"forkserver" in open(f"/proc/{child}/cmdline", "rb").read():
                servers.append(child)
        except OSError:
            pass
    return [worker for server in servers for worker in _children(server)]


def _wait_for_parts(folder, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.isdir(folder) and sum(f.startswith("part-") for f in os.listdir(folder)) >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"no {count} part files in {folder} after {timeout} s")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="finds the pool's workers through /proc")
def test_a_killed_local_worker_is_replaced_and_its_shards_rerun(mlp, rows, parquet_data, tmp_path):
    out = tmp_path / "out"
    killed = []

    def kill_one_worker():
        _wait_for_parts(out, 1)
        pids = _worker_pids(os.getpid())
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(sum(f.startswith("part-") for f in os.listdir(out)))

    killer = threading.Thread(target=kill_one_worker)
    killer.start()
    summary = run_job(mlp, parquet_data, str(out), workers=2, threads=1, shard_rows=10, progress=False)
    killer.join()
    assert killed and killed[0] < 60, "no worker killed mid-job"
    assert summary.processed_rows == 600 and summary.failures == [] and summary.failed_shards == []
    assert_predictions(read_predictions(str(out)), rows, list(range(600)))


def test_run_job_at_a_scripts_top_level_is_a_typed_error_naming_the_main_guard(mlp, parquet_data, tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text("from onnx_runtime.batch import run_job\n"
                      f"run_job({mlp!r}, {parquet_data!r}, {str(tmp_path / 'out')!r}, workers=2, threads=1, "
                      "shard_rows=100, progress=False)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    # The traceback's exception line (multiprocessing's resource tracker may warn after it as the script dies).
    errors = [line for line in done.stderr.splitlines() if line.startswith("onnx_runtime.batch.engines.")]
    assert errors, done.stderr
    last = errors[-1]
    assert last.startswith("onnx_runtime.batch.engines.WorkerStartError: batch: the local engine's worker"), last
    assert str(script) in last and 'if __name__ == "__main__":' in last
    guarded = tmp_path / "guarded.py"
    guarded.write_text(script.read_text().replace("run_job(", "if __name__ == '__main__':\n    run_job(", 1)
                       .replace(str(tmp_path / "out"), str(tmp_path / "out2")))
    done = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_interrupted_job_resumes_without_recomputing_finished_shards(mlp, rows, parquet_data, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "onnx_runtime.cli", "batch", mlp, "--input", parquet_data, "--output", str(out),
               "--workers", "1", "--threads", "1", "--shard-rows", "2", "--no-progress"]
    job = subprocess.Popen(command, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for_parts(out, 3)
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # the job and its workers, mid-run
        job.wait()
    before = {f: os.stat(out / f).st_mtime_ns for f in os.listdir(out) if f.startswith("part-")}
    # 300 shards of 2 rows: a worker compiling in the foreground writes dozens while the kill lands
    assert 3 <= len(before) < 300, "the job was not interrupted mid-run"
    (out / ".part-000299.12345.tmp").write_bytes(b"half a file")  # as a kill mid-write leaves one
    result = subprocess.run(command + ["--json"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["skipped_shards"] == len(before) and summary["processed_rows"] == 600 - 2 * len(before)
    for name, mtime in before.items():
        assert os.stat(out / name).st_mtime_ns == mtime, f"{name} was recomputed"
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    assert_predictions(read_predictions(str(out)), rows, list(range(600)))
