"""RSS high-water of repeated session creation (issue 22): N create/run/drop cycles of one model, ours and
onnxruntime's, each in a fresh process so neither sees the other's heap.

The peak is the process's own VmHWM (/proc/self/status), read at the end: ``ru_maxrss`` would also count the
parent's RSS at the spawn (Linux carries the pre-exec high-water into the child). Each process also reports its
RSS after the first cycle and after the second (``warm_mb``; ours waits for its background kernel loader after the
first, about 130 MB loaded once), and the growth per cycle after that (``kb_per_cycle_after_warm``), so a leak shows
apart from the import's and the loader's size.

    python benchmarks/hostile_memory.py --model light_resnet50 --cycles 200
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import gc, json, os, sys, time
    import numpy as np
    import onnx

    def status(key):
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) for line in handle if line.startswith(key)) / 1024

    which, name, cycles = sys.argv[1], sys.argv[2], int(sys.argv[3])
    root = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    with open(os.path.join(root, name + ".onnx"), "rb") as handle:
        data = handle.read()
    graph = onnx.ModelProto.FromString(data).graph
    inits = {i.name for i in graph.initializer}
    inputs = [vi for vi in graph.input if vi.name not in inits]
    feeds = {vi.name: np.random.default_rng(0).standard_normal(
        [d.dim_value or 1 for d in vi.type.tensor_type.shape.dim]).astype(np.float32) for vi in inputs}
    if which == "ours":
        import onnx_runtime as ort
    else:
        import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    first_rss = warm_rss = None
    started = time.process_time()
    for cycle in range(cycles):
        session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        session.run(None, feeds)
        del session
        if cycle == 0:
            first_rss = status("VmRSS")
            if which == "ours":  # the compiled kernels load once, in a background thread: not a cycle's growth
                from onnx_runtime_ep_cpu.compiled import deferred
                deferred.wait_ready(600)
        elif cycle == 1:
            warm_rss = status("VmRSS")
    final = status("VmRSS")
    print(json.dumps({"peak_mb": status("VmHWM"), "after_first_mb": first_rss, "warm_mb": warm_rss,
                      "final_rss_mb": final, "kb_per_cycle_after_warm": (final - warm_rss) * 1024 / max(cycles - 2, 1),
                      "cpu_s": time.process_time() - started}))
""")


def measure(which: str, model: str, cycles: int) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, which, model, str(cycles)], capture_output=True, text=True,
                          timeout=3600)
    if done.returncode:
        raise RuntimeError(f"{which} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="light_resnet50", help="a model of onnx's backend/test/data/light")
    parser.add_argument("--cycles", type=int, default=200)
    parser.add_argument("--target", type=float, default=1.5, help="the ratio ours/onnxruntime the issue asks for")
    args = parser.parse_args(argv)
    ours = measure("ours", args.model, args.cycles)
    theirs = measure("onnxruntime", args.model, args.cycles)
    ratio = ours["peak_mb"] / theirs["peak_mb"]
    print(json.dumps({"model": args.model, "cycles": args.cycles, "ours": ours, "onnxruntime": theirs,
                      "peak_ratio": round(ratio, 2)}, indent=1))
    print(f"RSS high-water over {args.cycles} cycles of {args.model}: {ours['peak_mb']:.0f} MB, onnxruntime "
          f"{theirs['peak_mb']:.0f} MB ({ratio:.2f}x; target <= {args.target}x); growth per cycle once warm: "
          f"{ours['kb_per_cycle_after_warm']:.0f} KB, onnxruntime {theirs['kb_per_cycle_after_warm']:.0f} KB")
    return 0 if ratio <= args.target else 1


if __name__ == "__main__":
    sys.exit(main())
