"""The ``onnx-runtime bench`` command: latency percentiles and the progress bar."""

from __future__ import annotations

import re

import numpy as np
import onnx
from model_helpers import make_model, tensor_info
from onnx import helper
from onnx_runtime.cli import _ProgressBar, main

STATS = ("p50", "p90", "p99", "min", "max", "mean")


def _stats(out: str) -> dict[str, float]:
    found = dict(re.findall(r"^(p50|p90|p99|min|max|mean)\s+([0-9.]+) ms$", out, re.MULTILINE))
    return {name: float(value) for name, value in found.items()}


def _tiny_model(tmp_path) -> str:
    model = make_model(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Add", ["r", "x"], ["y"])],
        [tensor_info("x", shape=[2, 3])], [tensor_info("y", shape=[2, 3])],
    )
    path = str(tmp_path / "tiny.onnx")
    onnx.save(model, path)
    return path


def test_bench_reports_ordered_percentiles_and_completes_the_progress_bar(tmp_path, capsys):
    path = _tiny_model(tmp_path)
    np.save(tmp_path / "x.npy", np.arange(6, dtype=np.float32).reshape(2, 3) - 3)
    code = main(["bench", path, "--providers", "cpu", "--repeat", "30", "--warmup", "2",
                 "--input", f"x={tmp_path / 'x.npy'}"])
    assert code == 0
    captured = capsys.readouterr()
    stats = _stats(captured.out)
    assert set(stats) == set(STATS)
    assert 0 < stats["min"] <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"]
    assert stats["min"] <= stats["mean"] <= stats["max"]
    assert "runs: 30 timed after 2 warm-up" in captured.out
    assert "not given" not in captured.out  # the .npy input was used
    frames = captured.err.split("\r")
    assert frames[-1].rstrip("\n").endswith("100% 32/32")
    assert "[" + "#" * 30 + "]" in frames[-1]


def test_bench_feeds_zeros_for_missing_inputs(tmp_path, capsys):
    assert main(["bench", _tiny_model(tmp_path), "--providers", "cpu", "--repeat", "3", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "input x: not given, using zeros of shape [2, 3]" in out
    assert set(_stats(out)) == set(STATS)


def test_progress_bar_redraws_only_when_the_percentage_changes(capsys):
    bar = _ProgressBar(1000, "bench", width=10)
    for done in range(1, 1001):
        bar.update(done)
    bar.close()
    frames = capsys.readouterr().err.split("\r")[1:]
    assert len(frames) == 101  # 1000 updates, one redraw per percent from 0% to 100%
    assert frames[0] == "bench [..........]   0% 1/1000"
    assert frames[1] == "bench [..........]   1% 10/1000"
    assert frames[-1] == "bench [##########] 100% 1000/1000\n"
