"""What each planned kernel of one greedy decode step costs, and the normalizations that feed projections.

    .venv/bin/python benchmarks/decode_steps.py [--models 'gpt2.dynamo.fp32,llama.dynamo.fp32'] [--zoo FOLDER]
        [--prompt 16] [--step 6] [--calls 3000] [--rounds 7]

For each decoder, ``onnx_runtime.generate``'s loop (CPU provider, one intra-op thread, kernels loaded in the
foreground) generates twice to warm up; in a third generation the plan steps of decode step ``--step`` are run one
by one and each kernel's arguments kept. Each kernel is then called ``--calls`` times with them, ``--rounds`` times,
on this thread's CPU clock (``time.thread_time``); the table gives the median microseconds per call, the operator
and its first inputs' shapes. Attention steps are not repeated (a bound step appends its rows to the cache
buffers). A step's sum here leaves out the executor, the bindings and the argmax (executor_overhead.py splits
those).

The second table lists every normalization step (LayerNormalization, RMSNormalization and their skip forms) with
the steps that read its outputs before those slots are written again: what folding the normalization into the
projection after it (one call per pair) would have to beat. The load average is printed; numbers taken on a busy
host are comparable within one run only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ZOO = ROOT / "benchmarks/.models/zoo"
NORMALIZATIONS = {"LayerNormalization", "RMSNormalization", "SkipRMSNormalization", "SkipLayerNormalization",
                  "SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization"}


def capture_step(path: Path, prompt: int, step: int) -> list[tuple]:
    """(Step, its kernel, its arguments) of each plan step of decode step ``step`` (1: the first after the
    prefill) of a warmed-up greedy generation of ``path``, run one by one as the plan's loop runs them."""
    import onnx_runtime
    from onnx_runtime.generate import Generator
    from onnx_runtime.session import steps as plan_steps

    options = onnx_runtime.SessionOptions()
    options.intra_op_num_threads = 1
    generator = Generator(str(path), ["CPUExecutionProvider"], options)
    tokens = list(range(5, 5 + prompt))
    for _ in range(2):
        generator.generate(tokens, step + 8)
    captured: list[list[tuple]] = []
    calls = [0]
    # The plan's run loop is replaced for the one generation: no public hook hands out a step's arguments.
    original = plan_steps._run  # noqa: SLF001

    def spy(steps, env, profile):
        if len(steps.steps) > 1:  # the model's body (a one-step plan is a shape-only remainder)
            calls[0] += 1
        if captured or len(steps.steps) <= 1 or calls[0] != step + 1:
            return original(steps, env, profile)
        records = []
        for planned, (run, fetch, single, outs, release) in zip(steps.steps, steps.fast):
            args = fetch(env)
            results = run(*args)
            records.append((planned, run, args))
            if single is not None:
                env[single] = results[0]
            else:
                for slot, value in zip(outs, results):
                    env[slot] = value
            for slot in release:
                env[slot] = None
        captured.append(records)
        return None

    plan_steps._run = spy  # noqa: SLF001
    try:
        generator.generate(tokens, step + 4)
    finally:
        plan_steps._run = original  # noqa: SLF001
    if not captured:
        raise SystemExit(f"{path.name}: no decode step {step} was run through the plan's steps")
    return captured[0]


def op_of(step) -> str:
    return step.node.op_type if step.node is not None else "copy"


def cost_us(run, args: tuple, calls: int, rounds: int) -> float:
    """Median thread-CPU microseconds per call of ``run(*args)``."""
    times = []
    for _ in range(rounds):
        start = time.thread_time()
        for _ in range(calls):
            run(*args)
        times.append((time.thread_time() - start) / calls * 1e6)
    return statistics.median(times)


def readers(records: list[tuple], index: int) -> list[int]:
    """Indices of the steps after ``index`` that read one of its outputs before that slot is written again."""
    live = set(records[index][0].outputs)
    found = []
    for later in range(index + 1, len(records)):
        step = records[later][0]
        if live & set(step.inputs):
            found.append(later)
        live -= set(step.outputs)
        if not live:
            break
    return found


def report(name: str, records: list[tuple], calls: int, rounds: int) -> None:
    costs: dict[int, float] = {}
    print(f"\n{name}: decode step of {len(records)} plan steps")
    for index, (step, run, args) in enumerate(records):
        shapes = [tuple(np.shape(a)) if a is not None else None for a in args[:2]]
        if "Attention" in op_of(step):
            print(f"  {index:3d} {op_of(step):28s}   (not repeated) {shapes}")
            continue
        costs[index] = cost_us(run, args, calls, rounds)
        print(f"  {index:3d} {op_of(step):28s} {costs[index]:6.2f} us {shapes}")
    print(f"  kernels timed: {sum(costs.values()):.1f} us")
    pairs = [(index, readers(records, index)) for index, (step, _, _) in enumerate(records)
             if op_of(step) in NORMALIZATIONS]
    if not pairs:
        return
    print("  normalization -> readers (us)")
    for index, read_by in pairs:
        named = ", ".join(f"{op_of(records[r][0])} {costs.get(r, float('nan')):.2f}" for r in read_by)
        print(f"    {op_of(records[index][0]):24s} {costs.get(index, float('nan')):5.2f} -> {named}")
    print(f"  normalizations: {len(pairs)}, {sum(costs.get(i, 0.0) for i, _ in pairs):.1f} us of the step")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", type=Path, default=DEFAULT_ZOO)
    parser.add_argument("--models", default="gpt2.dynamo.fp32,llama.dynamo.fp32",
                        help="comma-separated model names in --zoo (without .onnx) or paths")
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    parser.add_argument("--step", type=int, default=6, help="which decode step to capture (1: the first)")
    parser.add_argument("--calls", type=int, default=3000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    os.environ.setdefault("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")  # steady state: compiled kernels only
    print(f"load average {os.getloadavg()[0]:.1f}")
    for name in (m.strip() for m in args.models.split(",") if m.strip()):
        path = Path(name) if name.endswith(".onnx") else args.zoo / f"{name}.onnx"
        report(path.stem, capture_step(path, args.prompt, args.step), args.calls, args.rounds)
    print(f"load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
