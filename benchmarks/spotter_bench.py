"""Streaming models per frame, this runtime against onnxruntime in one process, one thread each.

    .venv-zoo/bin/python benchmarks/streaming_export.py        (once: writes benchmarks/.models/streaming)
    .venv/bin/python benchmarks/spotter_bench.py [--models kws_gru,crnn_lstm,lstm_lm] [--frames 400] [--rounds 5]
        [--busy N] [--profile]

Each model (both exports) is called once per frame with the recurrent state the previous frame returned (an output
``X_out`` feeds input ``X``), the way a streaming deployment runs a keyword spotter or a character model's decode.
Frames alternate between the two runtimes in blocks (interleaved rounds), CPU time of this thread: the median per
frame in microseconds, and the median of the rounds' ratios; the largest gap between the two runtimes' first
outputs is printed beside. ``--busy N`` measures again beside N CPU-bound processes the script starts (zoo_bench's
competitors). ``--profile`` prints, per operator type, the median time of each node per frame from each runtime's
own Chrome trace (wall time, whole microseconds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / ".models" / "streaming"
CPU = "CPUExecutionProvider"
sys.path.insert(0, str(ROOT / "benchmarks"))

from zoo_bench import Competitors  # noqa: E402

_NUMPY = {"tensor(float)": np.float32, "tensor(int64)": np.int64}


def _state_names(session) -> dict[str, str]:
    """Output name -> the input it feeds on the next frame (``h_out`` -> ``h``)."""
    inputs = {i.name for i in session.get_inputs()}
    return {o.name: o.name[:-4] for o in session.get_outputs() if o.name.endswith("_out") and o.name[:-4] in inputs}


def frames(session, count: int) -> list[dict]:
    """Per frame, the feeds that are not state: seeded features (or tokens), so both runtimes see the same."""
    rng = np.random.default_rng(0)
    state = set(_state_names(session).values())
    out = []
    for _ in range(count):
        feed = {}
        for i in session.get_inputs():
            if i.name in state:
                continue
            shape = [d if isinstance(d, int) else 1 for d in i.shape]
            if _NUMPY[i.type] is np.int64:
                feed[i.name] = rng.integers(0, 96, shape).astype(np.int64)
            else:
                feed[i.name] = rng.standard_normal(shape).astype(np.float32)
        out.append(feed)
    return out


def initial_state(session) -> dict[str, np.ndarray]:
    state = set(_state_names(session).values())
    return {i.name: np.zeros([d if isinstance(d, int) else 1 for d in i.shape], np.float32)
            for i in session.get_inputs() if i.name in state}


def stream(session, feeds: list[dict]) -> tuple[list[float], np.ndarray]:
    """Run ``feeds`` in order with the state carried: CPU seconds per frame and each frame's first output."""
    names = [o.name for o in session.get_outputs()]
    carried = _state_names(session)
    state = initial_state(session)
    times, firsts = [], []
    for feed in feeds:
        start = time.thread_time()
        outs = session.run(None, {**feed, **state})
        times.append(time.thread_time() - start)
        state = {carried[n]: v for n, v in zip(names, outs) if n in carried}
        firsts.append(outs[0].reshape(-1))
    return times, np.stack(firsts)


def compare(ours, theirs, feeds: list[dict], rounds: int) -> tuple[float, float, float, float]:
    """Median microseconds per frame of each runtime (rounds alternating), the median of the rounds' ratios (each
    round's two blocks ran next to each other, so a shared host's load moves both) and the largest first-output
    gap."""
    mine, other, ratios, diff = [], [], [], 0.0
    for _ in range(rounds):
        t_ours, o_ours = stream(ours, feeds)
        t_ort, o_ort = stream(theirs, feeds)
        mine.append(statistics.median(t_ours))
        other.append(statistics.median(t_ort))
        ratios.append(mine[-1] / other[-1])
        diff = max(diff, float(np.max(np.abs(o_ours - o_ort))))
    return statistics.median(mine) * 1e6, statistics.median(other) * 1e6, statistics.median(ratios), diff


def _one_thread(options):
    options.intra_op_num_threads = 1
    return options


def profiles(path: str, feeds: list[dict]) -> None:
    """Per operator type, the median microseconds of each of its nodes per frame (medians: a preempted frame does
    not move them), summed over the op's nodes; ours then onnxruntime's, each from its own Chrome trace."""
    import onnx_runtime
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as folder:
        for who, module in (("ours", onnx_runtime), ("onnxruntime", ort)):
            options = _one_thread(module.SessionOptions())
            options.enable_profiling = True
            options.profile_file_prefix = str(Path(folder) / who)
            options.log_severity_level = 3
            session = module.InferenceSession(path, options, providers=[CPU])
            stream(session, feeds)
            _print_trace(who, json.loads(Path(session.end_profiling()).read_text()))


def _print_trace(who: str, trace: list[dict]) -> None:
    per_node: dict = {}
    runs = []
    for event in trace:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            per_node.setdefault((event["args"]["op_name"], event["name"]), []).append(event["dur"])
        elif event.get("cat") == "Session" and event["name"] == "model_run":
            runs.append(event["dur"])
    table: dict = {}
    for (op, _node), durations in per_node.items():
        total, calls = table.get(op, (0.0, 0.0))
        table[op] = (total + statistics.median(durations), calls + len(durations) / max(len(runs), 1))
    print(f"  {who}: run median {statistics.median(runs) if runs else float('nan'):.0f} us (wall), per frame:")
    for op, (total, calls) in sorted(table.items(), key=lambda item: -item[1][0]):
        print(f"    {op:28s} {total:6.0f} us  {calls:4.1f} calls")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="kws_gru,crnn_lstm,lstm_lm")
    parser.add_argument("--exporters", default="torchscript,dynamo")
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--frames", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="also measure beside this many CPU-bound processes")
    parser.add_argument("--profile", action="store_true", help="print time per operator type for each model")
    args = parser.parse_args()
    os.environ.setdefault("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")  # kernels loaded before the first timed run

    import onnx_runtime
    import onnxruntime as ort

    print(f"load {os.getloadavg()[0]:.2f}; onnxruntime {ort.__version__}; {args.frames} frames x {args.rounds} rounds")
    pairs = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        for exporter in args.exporters.split(","):
            name = f"{model}.{exporter}"
            path = str(Path(args.data) / f"{name}.onnx")
            if not Path(path).exists():
                raise SystemExit(f"{path} is missing: run .venv-zoo/bin/python benchmarks/streaming_export.py")
            ours = onnx_runtime.InferenceSession(path, _one_thread(onnx_runtime.SessionOptions()), providers=[CPU])
            ort_options = _one_thread(ort.SessionOptions())
            ort_options.log_severity_level = 3
            theirs = ort.InferenceSession(path, ort_options, providers=[CPU])
            feeds = frames(theirs, args.frames)
            stream(ours, feeds[:5])
            stream(theirs, feeds[:5])
            pairs.append((name, ours, theirs, feeds))
            if args.profile:
                print(f"{name}:")
                profiles(path, feeds)
    conditions = ["quiet"] + ([f"busy {args.busy}"] if args.busy else [])
    for condition in conditions:
        competitors = Competitors(args.busy) if condition != "quiet" else contextlib.nullcontext()
        with competitors:
            print(f"{condition}: {'model':22s} {'ours us':>9s} {'ort us':>8s} {'ratio':>6s} {'max |d|':>9s}")
            for name, ours, theirs, feeds in pairs:
                a, b, ratio, diff = compare(ours, theirs, feeds, args.rounds)
                print(f"{condition}: {name:22s} {a:9.1f} {b:8.1f} {ratio:6.2f} {diff:9.2e}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
