"""Host memory of a model with large external-data weights, onnx_runtime beside onnxruntime (CPU provider).

    python benchmarks/memory_bench.py [--gib 1.0] [--layers 16] [--folder /tmp/memory_bench] [--runs 3]

Writes (once, into --folder, never into the repository) an MLP whose MatMul weights total --gib GiB in one
external data file, then measures each runtime in its own fresh process, one intra-op thread:

- creation: the bytes the process read (/proc/self/io rchar) and its file-backed resident memory (RssFile)
  gained while the session was created: a runtime that maps the weights and reads none at load gains neither;
- the first run and --runs more: the process's peak resident memory (VmHWM) and its resident memory after them.

The runtimes alternate (ours, onnxruntime, ours, ...) over --rounds; the report gives each measure's median
and the ratio ours / onnxruntime for the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np

CHILD = r"""
import json, os, sys, time
def status():
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssFile", "RssAnon"):
                fields[key] = int(value.split()[0]) * 1024
    with open("/proc/self/io") as f:
        fields["rchar"] = int(next(l for l in f if l.startswith("rchar")).split()[1])
    return fields
runtime, model, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
import numpy as np
if runtime == "onnxruntime":
    import onnxruntime as rt
else:
    import onnx_runtime as rt
options = rt.SessionOptions()
options.intra_op_num_threads = 1
before = status()
start = time.perf_counter()
session = rt.InferenceSession(model, options, providers=["CPUExecutionProvider"])
created = status()
create_seconds = time.perf_counter() - start
x = np.random.default_rng(0).standard_normal((1, session.get_inputs()[0].shape[1])).astype(np.float32)
y = session.run(None, {"X": x})[0]
for _ in range(runs):
    session.run(None, {"X": x})
after = status()
print(json.dumps({"create_read": created["rchar"] - before["rchar"],
                  "create_rss_file": created["RssFile"] - before["RssFile"],
                  "create_rss": created["VmRSS"] - before["VmRSS"], "create_seconds": create_seconds,
                  "rss_before": before["VmRSS"], "peak": after["VmHWM"], "rss_after": after["VmRSS"],
                  "checksum": float(np.abs(y).sum())}))
"""


def write_model(folder: str, gib: float, layers: int) -> tuple[str, int]:
    """The MLP (MatMul + Relu per layer, square weights) with ``gib`` GiB of weights in ``mlp.data``."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    width = int((gib * (1 << 30) / layers / 4) ** 0.5) // 64 * 64
    path = os.path.join(folder, f"mlp_{layers}x{width}.onnx")
    weight_bytes = layers * width * width * 4
    if os.path.exists(path):
        return path, weight_bytes
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "X"
    for i in range(layers):
        w = (rng.standard_normal((width, width), dtype=np.float32) / np.float32(np.sqrt(width)))
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"]),
                  helper.make_node("Relu", [f"m{i}"], [f"h{i}"])]
        prev = f"h{i}"
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [1, width])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save_model(model, path, save_as_external_data=True, location=os.path.basename(path) + ".data",
                    size_threshold=1024)
    return path, weight_bytes


def measure(runtime: str, model: str, runs: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, runtime, model, str(runs)], capture_output=True, text=True,
                          env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"memory_bench: the {runtime} process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--folder", default="/tmp/memory_bench")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    model, weight_bytes = write_model(args.folder, args.gib, args.layers)
    print(f"model {model}: {weight_bytes / (1 << 20):.0f} MiB of external-data weights; load average "
          f"{os.getloadavg()[0]:.1f}", flush=True)
    results: dict = {"onnx_runtime": [], "onnxruntime": []}
    for round_ in range(args.rounds):
        for runtime in results:
            r = measure(runtime, model, args.runs)
            results[runtime].append(r)
            mib = {key: value / (1 << 20) for key, value in r.items()}
            print(f"round {round_ + 1} {runtime:<13} creation read {mib['create_read']:8.1f} MiB, "
                  f"file-backed RSS +{mib['create_rss_file']:7.1f} MiB, RSS +{mib['create_rss']:7.1f} MiB "
                  f"in {r['create_seconds']:.2f} s; peak RSS {mib['peak']:7.0f} MiB, after the runs "
                  f"{mib['rss_after']:7.0f} MiB", flush=True)
    sums = {runtime: {r["checksum"] for r in rs} for runtime, rs in results.items()}
    ours, theirs = sums["onnx_runtime"].pop(), sums["onnxruntime"].pop()
    if abs(ours - theirs) > 1e-3 * max(1.0, abs(theirs)):
        raise SystemExit(f"memory_bench: the outputs differ (sum |y| {ours} vs {theirs})")
    median = {runtime: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for runtime, rs in results.items()}
    print(f"\nmedians of {args.rounds} rounds, weights {weight_bytes / (1 << 20):.0f} MiB:")
    for runtime, m in median.items():
        print(f"  {runtime:<13} creation read {m['create_read'] / (1 << 20):8.1f} MiB, file-backed RSS "
              f"+{m['create_rss_file'] / (1 << 20):7.1f} MiB; peak RSS {m['peak'] / (1 << 20):7.0f} MiB")
    print(f"peak RSS onnx_runtime / onnxruntime: {median['onnx_runtime']['peak'] / median['onnxruntime']['peak']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
