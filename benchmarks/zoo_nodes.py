"""A zoo model's nodes one at a time, this runtime against onnxruntime: where a whole-model ratio's gap lies.

    .venv/bin/python benchmarks/zoo_nodes.py --models bert.torchscript.optimized [--ops Attention,MatMul]
        [--rounds 30] [--block 100] [--json out.json]

Each node of the model's main graph becomes a one-node model: the node, the initializers it reads, and its other
inputs as graph inputs fed with the values the whole model computes there (onnxruntime, graph optimizations off,
every intermediate value exposed, on the manifest's default call). Both runtimes run that one-node model on one
thread in this process, taking turns in blocks of calls timed as a whole (wall time: the process's CPU clock
can step back when a thread ends, which a block of microsecond calls would show). A row is the lower quartiles
of the blocks' per-call times (blocks no other process interrupted), their difference and ratio, and the
largest difference of the node's outputs between the runtimes. A one-node run includes each runtime's per-run
cost (feeds checked, outputs returned: a few microseconds), so the sums read high against a whole-model run;
the differences are the kernels'.

Why: a whole model's plan fuses nodes (this runtime's and onnxruntime's differently), so neither profiler's
per-operator times compare; one-node models run the same operator on the same values in both.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_feeds import make_feeds  # noqa: E402

ZOO = Path(__file__).resolve().parent / ".models" / "zoo"


def intermediate_values(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """Every tensor value of the main graph (feeds, node outputs) as onnxruntime computes it without graph
    optimizations (which would rename or drop intermediate values)."""
    import onnxruntime

    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    known = {o.name for o in exposed.graph.output}
    for node in exposed.graph.node:
        for name in node.output:
            if name and name not in known:
                exposed.graph.output.append(helper.make_empty_tensor_value_info(name))
                known.add(name)
    options = onnxruntime.SessionOptions()
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = onnxruntime.InferenceSession(exposed.SerializeToString(), options, providers=["CPUExecutionProvider"])
    values = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
    values.update(feeds)
    return values


def _info(name: str, value: np.ndarray):
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape))


def node_models(model: onnx.ModelProto, feeds: dict, ops=None):
    """(node, one-node model, its feeds, the whole model's values of its outputs) per node of the main graph whose
    inputs and outputs are all tensors (``ops``: op types to keep, None for all)."""
    values = intermediate_values(model, feeds)
    initializers = {i.name: i for i in model.graph.initializer}
    for node in model.graph.node:
        if ops is not None and node.op_type not in ops:
            continue
        fed = [name for name in dict.fromkeys(node.input) if name and name not in initializers]
        outputs = [name for name in node.output if name]
        if not all(isinstance(values.get(name), np.ndarray) for name in fed + outputs):
            continue  # a sequence, an optional, or a value of a subgraph's scope
        weights = [initializers[name] for name in dict.fromkeys(node.input) if name in initializers]
        graph = helper.make_graph([node], node.name or node.op_type, [_info(n, values[n]) for n in fed],
                                  [_info(n, values[n]) for n in outputs], weights)
        one = helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version)
        yield node, one, {n: values[n] for n in fed}, [values[n] for n in outputs]


def _block(session, feeds: dict, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        session.run(None, feeds)
    return (time.perf_counter() - start) / calls * 1e6


def measure(one: onnx.ModelProto, feeds: dict, rounds: int = 30, block: int = 100) -> dict:
    """ours and onnxruntime's lower-quartile microseconds per call of a one-node model, one thread each, and the
    largest difference of their outputs."""
    import onnx_runtime
    import onnxruntime

    data = one.SerializeToString()
    ours_options = onnx_runtime.SessionOptions()
    ours_options.intra_op_num_threads = ours_options.inter_op_num_threads = 1
    ours = onnx_runtime.InferenceSession(data, ours_options, providers=["cpu"])
    theirs_options = onnxruntime.SessionOptions()
    theirs_options.intra_op_num_threads = theirs_options.inter_op_num_threads = 1
    theirs_options.log_severity_level = 3
    theirs = onnxruntime.InferenceSession(data, theirs_options, providers=["CPUExecutionProvider"])
    ours.run(None, feeds)
    _settle()
    for _ in range(block):
        ours.run(None, feeds)
        theirs.run(None, feeds)
    _settle()  # (a signature first met in the warm-up is linked now)
    difference = max((float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0
                      for a, b in zip(ours.run(None, feeds), theirs.run(None, feeds))), default=0.0)
    times: dict = {ours: [], theirs: []}
    for turn in range(rounds):
        for session in (ours, theirs) if turn % 2 else (theirs, ours):
            times[session].append(_block(session, feeds, block))
    return {"ours_us": lower_quartile(times[ours]), "ort_us": lower_quartile(times[theirs]), "max_diff": difference}


def lower_quartile(times: list[float]) -> float:
    """The lower quartile of a few block times, within their range: the default (exclusive) method extrapolates
    below the fastest block when there are few of them and one is slow (a first block that links a kernel)."""
    return statistics.quantiles(times, n=4, method="inclusive")[0] if len(times) > 1 else times[0]


def _settle() -> None:
    """Wait for the CPU provider's background kernel loader, where it runs (numpy-served calls until then)."""
    try:
        from onnx_runtime_ep_cpu.compiled import deferred
    except ImportError:
        return
    deferred.wait_ready(120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--zoo", type=Path, default=ZOO, help="the zoo's folder (with manifest.json)")
    parser.add_argument("--models", required=True, help="comma-separated names or globs of the manifest")
    parser.add_argument("--ops", default="", help="comma-separated op types to measure (default all)")
    parser.add_argument("--rounds", type=int, default=30, help="blocks per runtime and node")
    parser.add_argument("--block", type=int, default=100, help="calls per block")
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    manifest = json.loads((args.zoo / "manifest.json").read_text())
    patterns = [p for p in args.models.split(",") if p]
    entries = [m for m in manifest["models"] if m["status"] == "ok"
               and any(fnmatch.fnmatch(m["name"], p) for p in patterns)]
    if not entries:
        print(f"no model of {args.zoo / 'manifest.json'} matches {args.models!r}", file=sys.stderr)
        return 2
    ops = {o for o in args.ops.split(",") if o} or None
    rows = []
    print(f"# zoo_nodes, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.2f}")
    for entry in entries:
        model = onnx.load(str(args.zoo / entry["file"]))
        feeds = make_feeds(entry["calls"]["default"])
        print(f"\n{entry['name']}\n\n| node | op | ours us | ort us | ours - ort | ratio | max diff |\n"
              "|---|---|---|---|---|---|---|")
        total = [0.0, 0.0]
        for node, one, node_feeds, _ in node_models(model, feeds, ops):
            label = node.name or f"{node.op_type} -> {node.output[0]}"
            row = {"model": entry["name"], "node": label, "op": node.op_type,
                   **measure(one, node_feeds, args.rounds, args.block)}
            rows.append(row)
            total[0] += row["ours_us"]
            total[1] += row["ort_us"]
            print(f"| {label} | {node.op_type} | {row['ours_us']:.2f} | {row['ort_us']:.2f} | "
                  f"{row['ours_us'] - row['ort_us']:+.2f} | {row['ours_us'] / row['ort_us']:.2f} | "
                  f"{row['max_diff']:.3g} |", flush=True)
        if total[1]:
            print(f"| sum | | {total[0]:.1f} | {total[1]:.1f} | {total[0] - total[1]:+.1f} | "
                  f"{total[0] / total[1]:.2f} | |")
    print(f"\nload {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
