"""Lazy weights (core/onnx_runtime/memory/mapped.py, weights.py): initializers memory-mapped from external data
instead of read, and paged to a device under a weight-residency budget with eviction and lookahead, giving the
same outputs as an unbounded run."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from chain_models import external_chain
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime.errors import InvalidArgumentError, ModelLoadError
from onnx_runtime.loader import load_model
from onnx_runtime.memory import MemoryBudgetError, process_governor
from onnx_runtime.memory.mapped import mapped_region

SAMPLE = "SampleDeviceExecutionProvider"
DEVICE = "other:7"
D = 2048  # elements per weight: above the loader's shape-value limit, so mapped


def _save(model, path) -> str:
    onnx.save_model(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)
    return str(path)


def _chain(path, layers: int = 8, seed: int = 0) -> str:
    return external_chain(path, D, layers, seed)


def _session(path, providers=(SAMPLE, "CPUExecutionProvider"), **config):
    options = ort.SessionOptions()
    for key, value in config.items():
        options.add_session_config_entry(f"session.{key}", str(value))
    return ort.InferenceSession(path, options, providers=list(providers))


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# -- mapped, not read -----------------------------------------------------------------------------------------
def test_external_weights_are_mapped_and_read_only(tmp_path):
    path = _chain(tmp_path / "m.onnx")
    model = load_model(path)
    weight = model.graph.initializers["W0"]
    region = mapped_region(weight)
    assert region is not None and region[0].path.endswith("m.onnx.data")
    assert not weight.flags.writeable
    np.testing.assert_array_equal(weight, numpy_helper.to_array(onnx.load(path).graph.initializer[0]))
    unmapped = load_model(path, map_weights=False).graph.initializers["W0"]
    assert mapped_region(unmapped) is None
    np.testing.assert_array_equal(unmapped, weight)


def test_session_config_can_turn_mapping_off(tmp_path):
    path = _chain(tmp_path / "m.onnx")
    x = np.ones((1, D), np.float32)
    mapped = _session(path, providers=["CPUExecutionProvider"])
    read = _session(path, providers=["CPUExecutionProvider"], map_external_weights=0)
    assert mapped_region(mapped.model.graph.initializers["W1"]) is not None
    assert mapped_region(read.model.graph.initializers["W1"]) is None
    np.testing.assert_array_equal(mapped.run(None, {"X": x})[0], read.run(None, {"X": x})[0])


def test_a_session_touches_only_the_weight_pages_it_reads(tmp_path):
    """A 64 MiB embedding table read by a Gather of two rows: creating the session and running it reads a few
    pages of the table, not the table (host RSS stays near what is touched)."""
    rows, width = 16384, 1024
    table = np.memmap(tmp_path / "big.raw", np.float32, "w+", shape=(rows, width))
    table[:] = np.arange(rows, dtype=np.float32)[:, None]
    table.flush()
    tensor = numpy_helper.from_array(np.asarray(table), "table")
    del table
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["Y"], axis=0)], "embed",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, width])], [tensor])
    path = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "embed.onnx")
    del tensor, graph
    # Measured in fresh processes: in this one, freed heap pages from earlier tests would hide the eager read.
    assert _growth_in_child(path, mapped=True) < 24 << 20, "RSS grew past 24 MiB for two rows of a 64 MiB table"
    assert _growth_in_child(path, mapped=False) > 64 << 20  # the eager path reads it: the check can fail


_CHILD = """
import sys, numpy as np, onnx_runtime as ort
def rss():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096
options = ort.SessionOptions()
options.add_session_config_entry("session.map_external_weights", sys.argv[2])
before = rss()
session = ort.InferenceSession(sys.argv[1], options, providers=["CPUExecutionProvider"])
(y,) = session.run(None, {"ids": np.array([3, 16000], np.int64)})
assert list(y[:, 0]) == [3, 16000]
print(rss() - before)
"""


def _growth_in_child(path, mapped: bool) -> int:
    env = dict(os.environ, ONNX_RUNTIME_COMPILE_IN_BACKGROUND="0")
    done = subprocess.run([sys.executable, "-c", _CHILD, path, "1" if mapped else "0"], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_a_data_file_shorter_than_the_weights_is_refused_at_load(tmp_path):
    path = _chain(tmp_path / "m.onnx")
    with open(path + ".data", "r+b") as handle:
        handle.truncate(3 * D * 4)
    with pytest.raises(ModelLoadError, match="external data"):
        load_model(path)


def test_a_declared_length_that_does_not_match_the_shape_is_refused(tmp_path):
    path = _chain(tmp_path / "m.onnx")
    proto = onnx.load(path, load_external_data=False)
    for entry in proto.graph.initializer[2].external_data:
        if entry.key == "length":
            entry.value = str(D * 2)
    onnx.save_model(proto, path)
    with pytest.raises(ModelLoadError, match=r"'W2' declares 4096 bytes of external data"):
        load_model(path)


# -- paged under a budget -------------------------------------------------------------------------------------
@pytest.mark.parametrize("layers_resident", [1, 2, 3])
def test_a_budget_smaller_than_the_weights_gives_the_unbounded_outputs(tmp_path, layers_resident):
    path = _chain(tmp_path / "m.onnx", layers=12)
    rng = np.random.default_rng(1)
    feeds = [{"X": rng.standard_normal((1, D)).astype(np.float32)} for _ in range(3)]
    unbounded = _session(path)
    want = [unbounded.run(None, f)[0] for f in feeds]
    budget = layers_resident * D * 4
    paged = _session(path, weight_residency_budget=budget)
    for f, w in zip(feeds, want):
        np.testing.assert_array_equal(paged.run(None, f)[0], w)
    (stats,) = paged.memory_report()["weights"]
    assert stats["paged"] and stats["weight_bytes"] == 12 * D * 4 >= 4 * budget
    assert stats["high_water"] <= budget and stats["reserved"] == budget
    assert stats["pages"] > 12 and stats["evictions"] > 0  # paged again after eviction, run after run
    assert stats["prefetches"] > 0  # the next node's mapped weights read ahead


def test_a_budget_as_large_as_the_weights_uploads_each_once(tmp_path):
    path = _chain(tmp_path / "m.onnx", layers=4)
    session = _session(path, weight_residency_budget=4 * D * 4)
    for _ in range(3):
        session.run(None, {"X": np.ones((1, D), np.float32)})
    (stats,) = session.memory_report()["weights"]
    assert not stats["paged"] and stats["pages"] == 0  # fits: uploaded once when planned, never paged


def test_the_governor_holds_the_budget_not_the_weights(tmp_path):
    path = _chain(tmp_path / "m.onnx", layers=8)
    governor = process_governor()
    gc.collect()
    before = governor.used(DEVICE)
    session = _session(path, weight_residency_budget=2 * D * 4)
    session.run(None, {"X": np.ones((1, D), np.float32)})
    assert governor.used(DEVICE) - before == 2 * D * 4
    session.close()
    assert governor.used(DEVICE) == before


def test_a_budget_below_one_nodes_weights_fails_at_load(tmp_path):
    path = _chain(tmp_path / "m.onnx")
    with pytest.raises(MemoryBudgetError, match=r"reads 8192 bytes of weights at once.*at least 8192"):
        _session(path, weight_residency_budget=1000)


def test_a_budget_with_device_graphs_is_refused(tmp_path):
    path = _chain(tmp_path / "m.onnx")
    with pytest.raises(InvalidArgumentError, match="device graphs cannot replay"):
        _session(path, weight_residency_budget=4096, graph_capture=1)


def test_a_weight_the_run_still_holds_is_not_evicted(tmp_path):
    """Both inputs of one Add are weights: with room for exactly those two, paging the second must not evict the
    first (the node still reads it)."""
    rng = np.random.default_rng(2)
    a, b, c = (rng.standard_normal((1, D)).astype(np.float32) for _ in range(3))
    graph = helper.make_graph(
        [helper.make_node("Add", ["A", "B"], ["s"]), helper.make_node("Mul", ["s", "X"], ["t"]),
         helper.make_node("Add", ["t", "C"], ["Y"])], "pairs",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, D])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, D])],
        [numpy_helper.from_array(a, "A"), numpy_helper.from_array(b, "B"), numpy_helper.from_array(c, "C")])
    path = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "p.onnx")
    x = rng.standard_normal((1, D)).astype(np.float32)
    session = _session(path, weight_residency_budget=2 * D * 4)
    for _ in range(2):
        np.testing.assert_allclose(session.run(None, {"X": x})[0], (a + b) * x + c, rtol=1e-6)


def test_weights_the_next_run_needs_soonest_stay_resident_across_runs(tmp_path):
    """The plan's order is known and runs repeat it: with room for three of twelve weights, evicting the one
    needed again last keeps two resident into the next run (least-recently-used would page all twelve)."""
    path = _chain(tmp_path / "m.onnx", layers=12)
    session = _session(path, weight_residency_budget=3 * D * 4)
    x = np.ones((1, D), np.float32)
    pages = []
    for _ in range(4):
        session.run(None, {"X": x})
        pages.append(session.memory_report()["weights"][0]["pages"])
    assert pages[0] == 12
    assert [b - a for a, b in zip(pages, pages[1:])] == [10, 10, 10]


_CREATION_CHILD = """
import sys, numpy as np, onnx_runtime as ort
def status():
    with open("/proc/self/io") as f:
        read = next(int(line.split()[1]) for line in f if line.startswith("rchar:"))
    resident, inside = 0, False
    with open("/proc/self/smaps") as f:  # the resident pages of the data file's mappings
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                inside = line.rstrip().endswith(sys.argv[1] + ".data")
            elif inside and line.startswith("Rss:"):
                resident += int(head[1]) * 1024
    return read, resident
read0, file0 = status()
session = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
read1, file1 = status()
y = session.run(None, {"X": np.ones((1, 1024), np.float32)})[0]
read2, file2 = status()
print(read1 - read0, file1 - file0, file2 - file1, float(y.sum()))
"""


def test_creating_a_session_reads_no_weight_bytes_and_the_first_run_touches_them(tmp_path):
    """Four 8 MiB MatMul weights in external data: session creation reads (read calls) well under one weight and
    maps in none of the data file's pages; the run that multiplies by all of them maps them in."""
    rng = np.random.default_rng(4)
    nodes, prev = [], "X"
    shapes = [(1024, 2048), (2048, 1024), (1024, 2048), (2048, 1024)]
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) / 32, f"W{i}")
             for i, s in enumerate(shapes)]
    for i in range(4):
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"h{i}"]))
        prev = f"h{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 1024])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, 1024])], inits)
    path = _save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "mlp.onnx")
    want = np.ones((1, 1024), np.float64)
    for tensor in inits:
        want = want @ numpy_helper.to_array(tensor).astype(np.float64)
    env = dict(os.environ, ONNX_RUNTIME_COMPILE_IN_BACKGROUND="0")
    done = subprocess.run([sys.executable, "-c", _CREATION_CHILD, path], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    read, mapped_at_creation, mapped_by_run, total = done.stdout.split()[-4:]
    weight = 8 << 20
    assert int(read) < weight // 4 and int(mapped_at_creation) < weight // 64, (read, mapped_at_creation)
    assert int(mapped_by_run) > 3 * weight  # the run reads them all: the measure can see a read
    assert abs(float(total) - want.sum()) <= 1e-3 * np.abs(want).sum()
