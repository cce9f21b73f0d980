"""benchmarks/zoo_nodes.py: the one-node models it cuts from a zoo model compute, under onnxruntime, the values the
whole model computes at those nodes (so both runtimes time each operator on the model's own values), and a short
run reports a row per node with finite positive times and outputs within float32 tolerance of onnxruntime's.
Skipped when the zoo is not built."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from model_helpers import zoo_manifest

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = zoo_manifest()
ZOO = MANIFEST.parent
onnxruntime = pytest.importorskip("onnxruntime", reason="the benchmark compares with onnxruntime")

sys.path.insert(0, str(ROOT / "benchmarks"))
import onnx  # noqa: E402
import zoo_nodes  # noqa: E402
from zoo_feeds import make_feeds  # noqa: E402

ENTRIES = {m["name"]: m for m in json.loads(MANIFEST.read_text())["models"] if m["status"] == "ok"}
# two exporters' graphs: the optimizer's contrib nodes, and dynamo's plain operators
MODELS = [name for name in ("bert.torchscript.optimized", "bert.dynamo.fp32") if name in ENTRIES]


def _load(name: str):
    entry = ENTRIES[name]
    return onnx.load(str(ZOO / entry["file"])), make_feeds(entry["calls"]["default"])


@pytest.mark.parametrize("name", MODELS)
def test_one_node_models_reproduce_the_whole_models_values(name):
    model, feeds = _load(name)
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    cut = list(zoo_nodes.node_models(model, feeds))
    tensor_nodes = [n for n in model.graph.node if n.op_type != "Constant"]
    assert len([c for c in cut if c[0].op_type != "Constant"]) == len(tensor_nodes)
    for node, one, node_feeds, expected in cut:
        onnx.checker.check_model(one)
        assert set(node_feeds) == {i for i in node.input if i and i not in {w.name for w in model.graph.initializer}}
        session = onnxruntime.InferenceSession(one.SerializeToString(), options, providers=["CPUExecutionProvider"])
        for got, want in zip(session.run(None, node_feeds), expected):
            assert got.dtype == want.dtype and got.shape == want.shape, node.name
            np.testing.assert_array_equal(got, want, err_msg=f"{name}: {node.op_type} {node.name}")


def test_ops_filter_keeps_only_those_op_types():
    model, feeds = _load(MODELS[0])
    kept = [node.op_type for node, *_ in zoo_nodes.node_models(model, feeds, {"MatMul"})]
    assert kept and set(kept) == {"MatMul"}
    assert len(kept) == sum(n.op_type == "MatMul" for n in model.graph.node)


def test_short_run_reports_every_node(tmp_path, capsys):
    out = tmp_path / "rows.json"
    name = MODELS[0]
    assert zoo_nodes.main(["--zoo", str(ZOO), "--models", name, "--ops", "MatMul,Attention", "--rounds", "2",
                           "--block", "2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    model, _ = _load(name)
    assert len(rows) == sum(n.op_type in ("MatMul", "Attention") for n in model.graph.node)
    for row in rows:
        assert row["model"] == name and row["op"] in ("MatMul", "Attention")
        assert math.isfinite(row["ours_us"]) and row["ours_us"] > 0
        assert math.isfinite(row["ort_us"]) and row["ort_us"] > 0
        assert row["max_diff"] < 1e-4  # float32 activations of unit scale
    assert "| sum |" in capsys.readouterr().out


def test_unknown_model_is_refused(capsys):
    assert zoo_nodes.main(["--zoo", str(ZOO), "--models", "no_such_model.*"]) == 2
    assert "no_such_model" in capsys.readouterr().err


def test_the_lower_quartile_stays_within_the_block_times():
    # two rounds with a slow first block (a kernel linked in it): the exclusive quantile went below zero
    assert zoo_nodes.lower_quartile([2018.0, 18.0]) == pytest.approx(18.0 + 0.25 * 2000.0)
    assert zoo_nodes.lower_quartile([5.0]) == 5.0
    times = [30.0, 10.0, 12.0, 11.0, 50.0]
    assert min(times) <= zoo_nodes.lower_quartile(times) <= max(times)
