"""Few-row float32 products against constant weights (a decode step's, a small batch's), this runtime against
onnxruntime on one-node graphs, in one process, CPU time.

    .venv/bin/python benchmarks/few_row_products.py [--rows 1,2,4,8,16] [--shapes 768x768,768x3072]
        [--layouts matmul,gemm_tb] [--threads 1] [--busy 0] [--json out.json]

Each product is a one-node graph: MatMul(x, W) with W (K, N) an initializer ("matmul"), or Gemm(x, W, bias)
with transB=1, W (N, K) ("gemm_tb", a classifier's or an OPT export's layout). Both runtimes get the same
feeds; the outputs are compared with a float64 reference, then the runtimes take turns in blocks of calls,
each block timed as a whole in this process's CPU time (a one-row product takes microseconds, about a clock
read's resolution a call). The ratio is ours / onnxruntime of the block medians. ``--busy N`` starts N
CPU-bound processes for the measurement (a shared host). ``--bare`` adds numpy's BLAS (np.matmul) on the
same arrays, the floor an OpenBLAS call sets.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_bench import Competitors, session  # noqa: E402

# The zoo's decoders and encoders (hidden 64, MLP 128-256, vocabulary 1000) and the sizes of the models they
# stand for (gpt2 768, llama 1024-4096, bert/t5 512-768, whisper 384-1024).
SHAPES = ("64x64", "64x256", "256x64", "64x1000", "384x1536", "768x768", "768x2304", "768x3072", "3072x768",
          "1024x1024", "1024x4096", "4096x1024")
ROWS = (1, 2, 4, 8, 16)


def product_model(layout: str, depth: int, n: int, seed: int) -> tuple[bytes, np.ndarray, np.ndarray | None]:
    """The one-node model, its weights as (K, N) and its bias (Gemm's) or None."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((depth, n)) / math.sqrt(depth)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["rows", depth])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", n])
    if layout == "matmul":
        node, inits, bias = helper.make_node("MatMul", ["x", "w"], ["y"]), [numpy_helper.from_array(w, "w")], None
    else:
        bias = rng.standard_normal(n).astype(np.float32)
        node = helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1)
        inits = [numpy_helper.from_array(np.ascontiguousarray(w.T), "w"), numpy_helper.from_array(bias, "c")]
    graph = helper.make_graph([node], "product", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString(), w, bias


def sessions(model: bytes, threads: int):
    with tempfile.NamedTemporaryFile(suffix=".onnx", delete=False) as f:
        f.write(model)
        path = f.name
    try:
        return {name: session(name, path, threads) for name in ("ours", "ort")}
    finally:
        os.unlink(path)


def timed_blocks(runners: dict, seconds: float, block_seconds: float = 0.004, min_blocks: int = 7,
                 clock=time.process_time) -> dict:
    """Seconds of CPU (or of ``clock``) per call of each runner: blocks of calls (about ``block_seconds`` each), the
    runners taking turns (order rotating), until ``seconds`` have passed and each has ``min_blocks``; the median
    block."""
    names = list(runners)
    calls = {}
    for name, run in runners.items():  # warm-up, and the calls per block
        for _ in range(3):
            run()
        start = clock()
        count = 0
        while clock() - start < block_seconds / 2 or count < 2:
            run()
            count += 1
        calls[name] = max(1, int(count * block_seconds / max(clock() - start, 1e-9)))
    samples: dict[str, list[float]] = {name: [] for name in names}
    began, round_ = time.perf_counter(), 0
    while min(len(s) for s in samples.values()) < min_blocks or time.perf_counter() - began < seconds:
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            run, count = runners[name], calls[name]
            run()
            start = clock()
            for _ in range(count):
                run()
            samples[name].append((clock() - start) / count)
        round_ += 1
    return {name: statistics.median(s) for name, s in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--shapes", default=",".join(SHAPES), help="KxN weights, comma-separated")
    parser.add_argument("--layouts", default="matmul,gemm_tb")
    parser.add_argument("--threads", type=int, default=1, help="intra_op_num_threads of both (0: defaults)")
    parser.add_argument("--busy", type=int, default=0, help="CPU-bound competitor processes")
    parser.add_argument("--seconds", type=float, default=0.3, help="timed seconds per product, at least")
    parser.add_argument("--bare", action="store_true", help="also time np.matmul on the same arrays")
    parser.add_argument("--wall", action="store_true", help="wall-clock time instead of CPU time (more threads' "
                        "CPU time adds up; beside a busy process, waiting for a core counts)")
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")

    rows_list = [int(r) for r in args.rows.split(",")]
    clock = time.perf_counter if args.wall else time.process_time
    shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
    results = []
    print(f"load {os.getloadavg()[0]:.2f}, threads {args.threads or 'default'}, busy {args.busy}, "
          f"{'wall' if args.wall else 'CPU'} time", flush=True)
    print(f"{'layout':8} {'K x N':>10} {'rows':>4} {'ours us':>9} {'ort us':>9} {'ratio':>6}"
          + (f" {'blas us':>9}" if args.bare else "") + "  err", flush=True)
    with Competitors(args.busy):
        for layout in args.layouts.split(","):
            for seed, (depth, n) in enumerate(shapes):
                model, w, bias = product_model(layout, depth, n, seed)
                made = sessions(model, args.threads)
                for rows in rows_list:
                    x = np.random.default_rng(rows).standard_normal((rows, depth)).astype(np.float32)
                    feed = {"x": x}
                    expected = x.astype(np.float64) @ w.astype(np.float64)
                    if bias is not None:
                        expected += bias
                    scale = float(np.abs(expected).max()) or 1.0
                    err = max(float(np.abs(made[r].run(None, feed)[0] - expected).max()) / scale for r in made)
                    runners = {name: (lambda s=s, f=feed: s.run(None, f)) for name, s in made.items()}
                    if args.bare:
                        weights = w if layout == "matmul" else np.ascontiguousarray(w.T).T
                        runners["blas"] = lambda x=x, w=weights: np.matmul(x, w)
                    times = timed_blocks(runners, args.seconds, clock=clock)
                    ratio = times["ours"] / times["ort"]
                    line = {"layout": layout, "depth": depth, "n": n, "rows": rows, "ratio": ratio, "err": err,
                            **{f"{name}_us": t * 1e6 for name, t in times.items()}}
                    results.append(line)
                    print(f"{layout:8} {depth:>4}x{n:<5} {rows:>4} {times['ours'] * 1e6:9.2f} "
                          f"{times['ort'] * 1e6:9.2f} {ratio:6.2f}"
                          + (f" {times['blas'] * 1e6:9.2f}" if args.bare else "") + f"  {err:.1e}", flush=True)
    by_rows = {rows: [r["ratio"] for r in results if r["rows"] == rows] for rows in rows_list}
    print("geomean by rows: " + ", ".join(
        f"{rows}: {math.exp(statistics.fmean(math.log(v) for v in values)):.2f}" for rows, values in by_rows.items()
        if values) + f"  (load {os.getloadavg()[0]:.2f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": os.getloadavg(), "args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
