"""What the executor and the layers around it cost per node and per step, beside onnxruntime, in one process.

    .venv/bin/python benchmarks/executor_overhead.py [--chain 1000] [--models 'mobilenetv3.torchscript.fp32']
        [--decoders 'gpt2.torchscript.fp32,llama.dynamo.fp32'] [--rounds 7]

Three measurements, one thread each (``intra_op_num_threads=1`` for both runtimes), CPU time of this thread
(``time.thread_time``), interleaved rounds, medians:

- **chain**: a graph of ``--chain`` Adds of four floats, a chain where every node waits for the one before. The
  kernels do almost nothing, so the time per node is the executor's (and onnxruntime's) per-node cost.
- **models**: a whole run of each zoo model, then the same plan with every kernel replaced by a callable that
  returns the outputs the kernel gave (the executor's loop with no arithmetic): its time over the node count is
  this executor's per-node cost on a real graph, and the rest of the run is the kernels'.
- **decoders**: the greedy generation loop (``onnx_runtime.generate``) against onnxruntime's IO-binding loop
  (``generate_bench.py``'s), per decode step, and our step split into its parts: the kernels (the plan's steps),
  the executor around them, the bound-run layer (bindings to feeds, outputs into bindings), the argmax and token
  writes, and the loop itself (each exclusive of the parts it calls; the split's own clock reads, about 10 per
  step, add a few microseconds to the whole).

The numbers are ratios ours/onnxruntime (lower is better) plus microseconds; the load average is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ZOO = Path(os.environ.get("ONNX_RUNTIME_ZOO") or ROOT / "benchmarks/.models/zoo")
CPU = "CPUExecutionProvider"


def median_of(rounds: int, measures: dict) -> dict[str, float]:
    """Each callable of ``measures`` timed ``rounds`` times, interleaved; the medians."""
    samples: dict[str, list[float]] = {name: [] for name in measures}
    for _ in range(rounds):
        for name, measure in measures.items():
            samples[name].append(measure())
    return {name: statistics.median(values) for name, values in samples.items()}


def per_call(function, calls: int) -> float:
    start = time.thread_time()
    for _ in range(calls):
        function()
    return (time.thread_time() - start) / calls


def sessions(model: bytes | str):
    import onnx_runtime
    import onnxruntime as ort

    options = onnx_runtime.SessionOptions()
    options.intra_op_num_threads = 1
    theirs = ort.SessionOptions()
    theirs.intra_op_num_threads = 1
    return (onnx_runtime.InferenceSession(model, options, providers=[CPU]),
            ort.InferenceSession(model, theirs, providers=[CPU]))


# -- chain ----------------------------------------------------------------------------------------------------


def chain_model(nodes: int) -> bytes:
    from onnx import TensorProto, helper

    graph_nodes, previous = [], "x"
    for index in range(nodes):
        out = "y" if index == nodes - 1 else f"t{index}"
        graph_nodes.append(helper.make_node("Add", [previous, "one"], [out], name=f"add{index}"))
        previous = out
    graph = helper.make_graph(graph_nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                              [helper.make_tensor("one", TensorProto.FLOAT, [4], [1, 1, 1, 1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def chain(nodes: int, rounds: int) -> str:
    ours, theirs = sessions(chain_model(nodes))
    feed = {"x": np.zeros(4, np.float32)}
    expected = theirs.run(None, feed)[0]
    got = ours.run(None, feed)[0]
    if not np.array_equal(got, expected):
        raise SystemExit(f"chain: outputs differ ({got} vs {expected})")
    calls = max(5, 20_000 // nodes)
    m = median_of(rounds, {"ours": lambda: per_call(lambda: ours.run(None, feed), calls),
                           "ort": lambda: per_call(lambda: theirs.run(None, feed), calls)})
    return (f"chain of {nodes} Adds: ours {m['ours'] / nodes * 1e6:.3f} us/node, onnxruntime "
            f"{m['ort'] / nodes * 1e6:.3f} us/node, ratio {m['ours'] / m['ort']:.2f}")


# -- zoo models -------------------------------------------------------------------------------------------------


def zoo_entries(pattern: str, architecture: str | None = None) -> list[dict]:
    import re

    manifest = json.loads((ZOO / "manifest.json").read_text())
    entries = manifest if isinstance(manifest, list) else manifest["models"]
    wanted = [re.compile(p.strip()) for p in pattern.split(",") if p.strip()]
    return [e for e in entries if e.get("status", "ok") == "ok" and any(w.fullmatch(e["name"]) for w in wanted)
            and (architecture is None or e.get("architecture") == architecture)]


def recorded_loop(session, feeds: dict):
    """A callable that runs the plan ``session`` takes for ``feeds`` with every kernel replaced by the outputs it
    gave once (so the loop moves the same values and frees at the same steps), and the plan's step count."""
    from onnx_runtime.session.steps import Steps, run_steps

    executor = session._executor_for(session._validate_feeds(feeds))  # noqa: SLF001 (the session's own plan)
    plan = executor.plan(tuple(output.name for output in session.get_outputs()))
    steps = plan.shape_values.body if plan.shape_values is not None else plan
    env = list(plan.template)
    for name, value in feeds.items():
        env[plan.feed_slots[name]] = value
    if plan.shape_values is not None:
        plan.shape_values.run(env, None)  # fills the kept values the body reads
        env = list(plan.template)
        for name, value in feeds.items():
            env[plan.feed_slots[name]] = value
        for slot, value in zip(plan.shape_values.kept, next(iter(plan.shape_values.values.values()))):
            env[slot] = value
    start = list(env)
    replayed = []
    for step in steps.steps:
        results = step.run(*[env[slot] for slot in step.inputs])
        for slot, value in zip(step.outputs, results):
            env[slot] = value
        replayed.append(type(step)(lambda *_a, r=tuple(results): r, step.inputs, step.outputs, step.release,
                                   step.node, step.provider))
    loop = Steps(replayed)

    def run() -> None:
        run_steps(loop, list(start))

    return run, len(replayed)


def model(entry: dict, call: str, rounds: int) -> str:
    """One manifest call of a zoo model (a decoder's are ``prefill`` and ``decode``, the others' ``default``)."""
    import zoo_feeds

    path = str(ZOO / entry["file"])
    ours, theirs = sessions(path)
    feeds = zoo_feeds.make_feeds(entry["calls"][call])
    for _ in range(3):
        ours.run(None, feeds)
        theirs.run(None, feeds)
    loop, nodes = recorded_loop(ours, feeds)
    calls = 20
    m = median_of(rounds, {"ours": lambda: per_call(lambda: ours.run(None, feeds), calls),
                           "ort": lambda: per_call(lambda: theirs.run(None, feeds), calls),
                           "loop": lambda: per_call(loop, calls)})
    label = entry["name"] if call == "default" else f"{entry['name']} {call}"
    return (f"{label}: ours {m['ours'] * 1e6:.0f} us, onnxruntime {m['ort'] * 1e6:.0f} us (ratio "
            f"{m['ours'] / m['ort']:.2f}); {nodes} steps, the loop without kernels {m['loop'] * 1e6:.1f} us "
            f"({m['loop'] / max(nodes, 1) * 1e6:.2f} us/step, {m['loop'] / m['ours']:.0%} of the run)")


# -- decode steps -----------------------------------------------------------------------------------------------


class Split:
    """Thread CPU time spent inside each wrapped layer of a generation, exclusive of the layers it calls."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self.stack: list[list] = []
        self.undo: list = []

    def wrap(self, owner, attribute: str, label: str) -> None:
        function = getattr(owner, attribute)
        clock, stack, total = time.thread_time, self.stack, self.total

        def timed(*args, **kwargs):
            frame = [clock(), 0.0]
            stack.append(frame)
            try:
                return function(*args, **kwargs)
            finally:
                stack.pop()
                elapsed = clock() - frame[0]
                total[label] = total.get(label, 0.0) + elapsed - frame[1]
                if stack:
                    stack[-1][1] += elapsed

        setattr(owner, attribute, timed)
        self.undo.append((owner, attribute, function))

    def restore(self) -> None:
        for owner, attribute, function in reversed(self.undo):
            setattr(owner, attribute, function)


def decoder(name: str, rounds: int, new: int) -> list[str]:
    import generate_bench
    from onnx_runtime import generate as generate_module
    from onnx_runtime.session import executor, inference_session

    path = str(ZOO / f"{name}.onnx")
    engines = {"ours": generate_bench.ours(path, 1), "ort": generate_bench.onnxruntime_iobinding(path, 1)}
    prompt = list(range(1, 17))
    if engines["ours"](prompt, 16) != engines["ort"](prompt, 16):
        return [f"{name}: greedy tokens differ from onnxruntime's"]
    for engine in engines.values():
        engine(prompt, new)

    def per_step(engine) -> float:
        start = time.thread_time()
        engine(prompt, 1)
        first = time.thread_time()
        engine(prompt, new)
        return ((time.thread_time() - first) - (first - start)) / (new - 1)

    m = median_of(rounds, {label: (lambda e=engine: per_step(e)) for label, engine in engines.items()})
    lines = [f"{name}: ours {m['ours'] * 1e6:.0f} us/step, onnxruntime IO binding {m['ort'] * 1e6:.0f} us/step, "
             f"tokens/s ours/onnxruntime {m['ort'] / m['ours']:.2f}"]
    split = Split()
    split.wrap(executor, "run_steps", "kernels")
    split.wrap(executor.Executor, "run", "executor")
    split.wrap(inference_session.InferenceSession, "run_with_device_bindings", "bound run")
    state = generate_module._Bindings  # noqa: SLF001 (the loop's own parts are what is timed)
    split.wrap(state, "_choose", "argmax + token")
    split.wrap(state, "loop", "loop")
    try:
        runs = []
        for _ in range(rounds):
            split.total.clear()
            engines["ours"](prompt, 1)
            first = dict(split.total)
            split.total.clear()
            engines["ours"](prompt, new)
            runs.append({k: (v - first.get(k, 0.0)) / (new - 1) for k, v in split.total.items()})
    finally:
        split.restore()
    parts = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in runs[0]}
    whole = sum(parts.values())
    lines.append("  step split: " + ", ".join(f"{k} {v * 1e6:.1f} us ({v / whole:.0%})"
                                                   for k, v in parts.items()))
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", type=int, default=1000, help="Adds in the chain (0: skip)")
    parser.add_argument("--models", default="mobilenetv3.torchscript.fp32", help="zoo models, regexes ('' skips)")
    parser.add_argument("--decoders", default="gpt2.torchscript.fp32,llama.dynamo.fp32",
                        help="zoo decoders for the generation loop ('' skips)")
    parser.add_argument("--new", type=int, default=64, help="new tokens per generation")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    os.environ.setdefault("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")  # steady state: no loader thread running
    print(f"host: {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; one thread, thread CPU time, "
          f"median of {args.rounds} interleaved rounds")
    if args.chain:
        print(chain(args.chain, args.rounds))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    for entry in zoo_entries(args.models) if args.models else []:
        for call in entry["calls"]:
            print(model(entry, call, args.rounds))
    for entry in zoo_entries(args.decoders, "decoder") if args.decoders else []:
        for line in decoder(entry["name"], args.rounds, args.new):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
