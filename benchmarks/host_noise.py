"""The host's own floor under zoo_bench's busy targets: fixed work that is neither runtime's, timed the way
zoo_bench times a model's calls (blocks of calls taking turns, quiet and then beside ``--busy`` CPU-bound
processes), with the same statistics: the spread (p90 - p10) / median per call and over the rounds' medians, and
the slowest call and round over the quiet median.

    OPENBLAS_NUM_THREADS=1 .venv/bin/python benchmarks/host_noise.py [--busy 1] [--repeat 400]

The workloads are a float32 matrix product through numpy's BLAS (one thread), an elementwise pass over an array
that fits the L2 cache, and a pure-Python loop: a few hundred microseconds each, the size of a small model's
call. Where fixed work already spreads by more than issue 19's 25% beside a busy process, no runtime's calls can
spread less on this host: the spread targets then measure the host, not the runtime.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from zoo_bench import BUSY_MAX_OVER_QUIET, BUSY_SPREAD, Competitors, in_blocks, stats  # noqa: E402


def workloads() -> dict:
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((128, 256), dtype=np.float32), rng.standard_normal((256, 256), dtype=np.float32)
    product = np.empty((128, 256), dtype=np.float32)
    x = rng.standard_normal(64 * 1024, dtype=np.float32)
    y = np.empty_like(x)

    def blas() -> None:
        for _ in range(8):
            np.matmul(a, b, out=product)

    def elementwise() -> None:
        for _ in range(40):
            np.multiply(x, 1.0001, out=y)
            np.add(y, x, out=y)

    def python_loop() -> None:
        total = 0
        for i in range(6000):
            total += i * i
        return total

    return {"blas": blas, "elementwise": elementwise, "python": python_loop}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--busy", type=int, default=1, help="CPU-bound competing processes (zoo_bench's)")
    parser.add_argument("--repeat", type=int, default=400, help="timed calls per workload and condition")
    parser.add_argument("--block", type=int, default=10, help="calls a turn times in a row (zoo_bench's)")
    parser.add_argument("--pause", type=float, default=0.02, help="seconds before each block (zoo_bench's)")
    parser.add_argument("--json", help="write the statistics here as well")
    args = parser.parse_args()

    runners = workloads()
    for run in runners.values():
        run()
    quiet = in_blocks(runners, args.repeat, args.block, args.pause, 1e9, args.repeat)
    with Competitors(args.busy):
        busy = in_blocks(runners, args.repeat, args.block, args.pause, 1e9, args.repeat)
    out = {}
    print(f"| workload | quiet median us | quiet spread | busy median us | busy spread (limit {BUSY_SPREAD:.0%}) "
          f"| busy round spread | busy max call / quiet (limit {BUSY_MAX_OVER_QUIET:g}) | busy slowest round / quiet |")
    print("|---|---|---|---|---|---|---|---|")
    for name in runners:
        q = stats(quiet[name][0], block=args.block)
        b = stats(busy[name][0], q["median"], args.block)
        out[name] = {"quiet": q, "busy": b}
        print(f"| {name} | {q['median'] * 1e6:.0f} | {q['spread']:.0%} | {b['median'] * 1e6:.0f} | {b['spread']:.0%} "
              f"| {b['round_spread']:.0%} | {b['max_over_quiet']:.1f} | {b['round_max_over_quiet']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
