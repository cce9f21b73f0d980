"""Static QDQ variants of the zoo's decoders with a past (gpt2, llama and t5_decoder, both exporters):
quantize_static in QDQ format over a small calibration set of prefill and decode calls, written outside the zoo;
then, with ``--measure``, each against onnxruntime in the same process (one thread, CPU time, interleaved).

    python benchmarks/qdq_decoders.py OUT_FOLDER [--zoo benchmarks/.models/zoo] [--measure] [--profile]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from zoo_feeds import grown, make_feeds  # noqa: E402

DECODERS = ("gpt2.torchscript", "gpt2.dynamo", "llama.torchscript", "llama.dynamo", "t5_decoder.torchscript",
            "t5_decoder.dynamo")


def calibration_feeds(entry: dict, count: int = 6) -> list[dict]:
    """Prefill calls, then decode calls a few tokens further each."""
    calls = entry["calls"]
    feeds = [make_feeds(calls["prefill"])]
    feeds += [make_feeds(grown(calls["decode"], extra)) for extra in range(count - 1)]
    return feeds


def non_finite_readers(path: Path, feeds: list[dict]) -> list[str]:
    """Nodes that read a float tensor holding an infinity or NaN in some calibration call. T5's relative-position
    buckets take the log of a relative position of 0 (-inf, later masked by a Where); calibration takes the
    range over it, and quantize_static then writes an infinite scale and a NaN zero point (cast to 0), so the
    bucket indices run out of range. Excluded, those nodes keep their float inputs, as the float model's."""
    import numpy as np
    import onnx
    import onnxruntime

    model = onnx.shape_inference.infer_shapes(onnx.load(path))
    known = {o.name for o in model.graph.output}
    floats = [info for info in model.graph.value_info
              if info.type.tensor_type.elem_type == onnx.TensorProto.FLOAT and info.name not in known]
    model.graph.output.extend(floats)
    session = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    bad = set()
    for feed in feeds:
        for name, value in zip(names, session.run(None, feed)):
            if isinstance(value, np.ndarray) and value.dtype.kind == "f" and not np.isfinite(value).all():
                bad.add(name)
    return [node.name for node in model.graph.node if node.name and bad & set(node.input)]


def build(zoo: Path, out: Path, names=DECODERS) -> dict[str, Path]:
    from onnxruntime import quantization as q

    class Reader(q.CalibrationDataReader):
        def __init__(self, feeds):
            self.feeds = iter(feeds)

        def get_next(self):
            return next(self.feeds, None)

    entries = {e["name"]: e for e in json.loads((zoo / "manifest.json").read_text())["models"]}
    out.mkdir(parents=True, exist_ok=True)
    built = {}
    for name in names:
        entry = entries[name + ".fp32"]
        target = out / f"{name}.int8_qdq.onnx"
        feeds = calibration_feeds(entry)
        q.quantize_static(zoo / entry["file"], target, Reader(feeds), quant_format=q.QuantFormat.QDQ,
                          activation_type=q.QuantType.QUInt8, weight_type=q.QuantType.QInt8,
                          nodes_to_exclude=non_finite_readers(zoo / entry["file"], feeds))
        built[name] = target
    return built


def sessions(path: Path, profile: bool = False) -> tuple:
    """(ours, onnxruntime's) on one thread each."""
    import onnx_runtime
    import onnxruntime

    ours_options = onnx_runtime.SessionOptions()
    ours_options.intra_op_num_threads = ours_options.inter_op_num_threads = 1
    ours_options.enable_profiling = profile
    ours_options.profile_file_prefix = str(Path(tempfile.gettempdir()) / "qdq_decoders_profile")
    theirs_options = onnxruntime.SessionOptions()
    theirs_options.intra_op_num_threads = theirs_options.inter_op_num_threads = 1
    theirs_options.log_severity_level = 3
    return (onnx_runtime.InferenceSession(str(path), ours_options, providers=["cpu"]),
            onnxruntime.InferenceSession(str(path), theirs_options, providers=["CPUExecutionProvider"]))


def ratio(ours, theirs, feeds: dict, rounds: int = 30, block: int = 20) -> tuple[float, float, float]:
    """(ours/theirs of the lower quartiles, ours us, theirs us) per call, CPU time, blocks taking turns."""
    times: dict = {ours: [], theirs: []}
    for turn in range(rounds):
        for session in (ours, theirs) if turn % 2 else (theirs, ours):
            session.run(None, feeds)
            for _ in range(block):
                start = time.process_time()
                session.run(None, feeds)
                times[session].append(time.process_time() - start)
    low = {s: statistics.quantiles(t, n=4, method="inclusive")[0] for s, t in times.items()}
    return low[ours] / low[theirs], low[ours] * 1e6, low[theirs] * 1e6


def profile(path: Path, feeds: dict, calls: int = 200) -> list[tuple[str, float, float]]:
    """(operator, us per call, steps per call) of ours on ``feeds``, slowest first."""
    ours, _ = sessions(path, profile=True)
    for _ in range(5):
        ours.run(None, feeds)
    ours.end_profiling()
    for _ in range(calls):
        ours.run(None, feeds)
    summary = ours.profile_summary()
    rows = [(op, seconds / calls * 1e6, count / calls) for op, (seconds, count) in summary.items()]
    return sorted(rows, key=lambda row: -row[1])


def measure(zoo: Path, built: dict[str, Path], show_profile: bool) -> None:
    os.environ["ONNX_RUNTIME_COMPILE_IN_BACKGROUND"] = "0"  # the compiled kernels', not numpy's first runs
    entries = {e["name"]: e for e in json.loads((zoo / "manifest.json").read_text())["models"]}
    print(f"load {os.getloadavg()[0]:.2f}; ours/onnxruntime, one thread, CPU time, lower quartiles (us)")
    for name, path in built.items():
        calls = entries[name + ".fp32"]["calls"]
        ours, theirs = sessions(path)
        line = [name]
        for call in ("prefill", "decode"):
            feeds = make_feeds(calls[call])
            value, us, them = ratio(ours, theirs, feeds)
            line.append(f"{call} {value:.2f} ({us:.0f}/{them:.0f})")
        steps = sum(row[2] for row in profile(path, make_feeds(calls["decode"]), 3) if row[0] != "copy")
        print("  ".join(line), f" decode steps {steps:.0f}", flush=True)
        if show_profile:
            for op, us, count in profile(path, make_feeds(calls["decode"]))[:8]:
                print(f"    {op:28s} {us:8.1f} us  {count:5.1f} steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--zoo", type=Path, default=HERE / ".models" / "zoo")
    parser.add_argument("--models", default=",".join(DECODERS), help="comma-separated names (default: all)")
    parser.add_argument("--measure", action="store_true", help="time each against onnxruntime")
    parser.add_argument("--profile", action="store_true", help="with --measure: our decode call per operator")
    args = parser.parse_args()
    built = build(args.zoo, args.out, args.models.split(","))
    for name, path in built.items():
        print(name, path)
    if args.measure:
        measure(args.zoo, built, args.profile)


if __name__ == "__main__":
    main()
