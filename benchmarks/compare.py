"""Compare this runtime with onnxruntime (and optionally onnx.reference) on the same models, in one process.

    .venv/bin/python benchmarks/compare.py [--models cnn,gpt_prefill_128,...] [--repeat N] [--threads N]

For each model both runtimes get identical inputs; the outputs are compared (max abs diff) so that a
fast but wrong result shows; then the runtimes are timed alternately after warm-up and the medians
are reported with the ratio ours/onnxruntime next to its target. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from dataclasses import dataclass, field

import numpy as np
import onnx
from bench_models import CNN_NAMES, BenchModel, Unavailable, catalogue
from bench_timing import alternating, geomean, in_blocks, median, timed

# Targets for ours/onnxruntime (lower is better).
TARGETS = {"cnn": 2.0, "prefill": 1.25, "decode": 1.25}
CNN_GEOMEAN_TARGET = 1.25
CREATE_TARGET = 2.0
GROUPS = {"cnn": list(CNN_NAMES), "transformers": ["gpt_prefill_128", "llama_decode_p128"]}


@dataclass
class Result:
    model: BenchModel
    ours: float = float("nan")  # median seconds per run
    ort: float = float("nan")
    reference: str = "-"  # median ms, or why it was not timed
    diff: float = float("nan")  # max abs diff ours vs onnxruntime over all outputs
    logits_diff: float | None = None  # relative diff of a final Softmax's input (see softmax_probe)
    agree: bool = False
    create_ours: float = float("nan")
    create_ort: float = float("nan")
    first_ours: float = float("nan")  # median seconds of the first run on a fresh session
    first_ort: float = float("nan")
    notes: list[str] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.ours / self.ort

    @property
    def create_ratio(self) -> float:
        return self.create_ours / self.create_ort


# -- the runtimes ----------------------------------------------------------------------------------


def make_ours(path: str, threads: int | None = None):
    """Ours with its defaults, plus --threads (the same count as onnxruntime's: a one-thread comparison is one)."""
    import onnx_runtime

    options = onnx_runtime.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
    return onnx_runtime.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def make_ort(path: str, threads: int | None):
    """onnxruntime as users run it: its default settings (thread spinning included), plus --threads."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.log_severity_level = 3  # the light CNNs carry unused initializers onnxruntime warns about
    if threads is not None:
        options.intra_op_num_threads = threads
    return onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def make_reference(path: str):
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(path)


def max_abs_diff(ours: list, theirs: list) -> tuple[float, bool]:
    """The largest |ours - theirs| over all outputs, and whether it is within 1e-3 of the output's scale."""
    worst, agree = 0.0, True
    for a, b in zip(ours, theirs):
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        if a.shape != b.shape:
            return float("inf"), False
        diff = float(np.abs(a - b).max()) if a.size else 0.0
        worst = max(worst, diff)
        agree = agree and diff <= 1e-3 * max(1.0, float(np.abs(b).max()) if b.size else 1.0)
    return worst, agree


def softmax_probe(path: str) -> bytes | None:
    """The model with its final Softmax's input added as an output, or None when it does not end in Softmax.

    The light CNNs have constant weights, so every class gets the same logit and the softmax output is
    1/1000 whatever the convolutions computed; comparing the logits is what catches a wrong kernel.
    """
    model = onnx.load(path)
    last = model.graph.node[-1] if model.graph.node else None
    if last is None or last.op_type != "Softmax":
        return None
    model.graph.output.append(onnx.ValueInfoProto(name=last.input[0]))
    return model.SerializeToString()


def check_logits(result: Result, threads: int | None) -> bool:
    """Compare the pre-softmax logits (relative to their magnitude); True when they agree or there are none."""
    probe = softmax_probe(result.model.path)
    if probe is None:
        return True
    ours = make_ours(probe).run(None, result.model.feeds)[-1]
    theirs = make_ort(probe, threads).run(None, result.model.feeds)[-1]
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        scale = max(1.0, float(np.abs(theirs).max()))
        result.logits_diff = float(np.abs(ours - theirs).max()) / scale
    return ours.shape == theirs.shape and result.logits_diff <= 1e-3


# -- measuring one model ---------------------------------------------------------------------------


def measure_creation(result: Result, threads: int | None, repeat: int) -> None:
    """Median session-creation time of each runtime, alternating, after one untimed creation each.

    The first run on each fresh session is timed too: work a runtime defers from creation to its first
    run (planning, weight packing) shows there rather than vanishing from the report.
    """
    model = result.model
    first: dict[str, list[float]] = {"ours": [], "ort": []}

    def create_and_run(name: str, make) -> None:
        sess = make()
        first[name].append(timed(lambda: sess.run(None, model.feeds))[1])

    times = alternating({
        "ours": lambda: make_ours(model.path, threads), "ort": lambda: make_ort(model.path, threads),
    }, repeat, warmup=1)
    for _ in range(repeat):
        create_and_run("ours", lambda: make_ours(model.path, threads))
        create_and_run("ort", lambda: make_ort(model.path, threads))
    result.create_ours, result.create_ort = median(times["ours"]), median(times["ort"])
    result.first_ours, result.first_ort = median(first["ours"]), median(first["ort"])


def measure_reference(result: Result, mode: str, cap: float, ort_outputs: list) -> dict:
    """A runner for onnx.reference when ``mode`` allows it and one run fits in ``cap`` seconds, else {}."""
    model = result.model
    if mode == "none" or (mode == "auto" and not model.reference_ok):
        return {}
    try:
        ref = make_reference(model.path)
        outputs, seconds = timed(lambda: ref.run(None, model.feeds))
    except Exception as exc:  # the reference evaluator lacks some ops; that is not this benchmark's failure
        result.reference = f"failed: {type(exc).__name__}"
        return {}
    if seconds > cap:
        result.reference = f"skip ({seconds:.1f} s/run > cap)"
        return {}
    diff, agree = max_abs_diff(outputs, ort_outputs)
    result.notes.append(f"reference vs onnxruntime max abs diff {diff:.2e}{'' if agree else ' MISMATCH'}")
    return {"reference": lambda: ref.run(None, model.feeds)}


def measure(model: BenchModel, args) -> Result:
    result = Result(model)
    measure_creation(result, args.threads, args.create_repeat)
    ours, ort = make_ours(model.path, args.threads), make_ort(model.path, args.threads)
    feeds = model.feeds
    ort_outputs = ort.run(None, feeds)
    result.diff, result.agree = max_abs_diff(ours.run(None, feeds), ort_outputs)
    result.agree = check_logits(result, args.threads) and result.agree
    runners = {"ours": lambda: ours.run(None, feeds), "ort": lambda: ort.run(None, feeds)}
    runners.update(measure_reference(result, args.reference, args.reference_cap, ort_outputs))
    times = in_blocks(runners, args.repeat, warmup=args.warmup, block=args.block, pause=args.pause)
    result.ours, result.ort = median(times["ours"]), median(times["ort"])
    if "reference" in times:
        result.reference = f"{median(times['reference']) * 1e3:.2f}"
    return result


# -- the report ------------------------------------------------------------------------------------


def verdict(value: float, target: float | None) -> str:
    if target is None:
        return ""
    return f"<= {target:.2f} {'ok' if value <= target else 'MISS'}"


def print_report(results: list[Result], skipped: list[tuple[str, str]]) -> None:
    header = (f"{'model':<20}{'nodes':>6}{'ours ms':>11}{'ort ms':>10}{'ratio':>8}  {'target':<13}"
              f"{'ref ms':>10}  {'max|diff|':>9}  {'logits rel':>10}  check")
    print("\nlatency (median over alternating blocks of runs; ratio = ours / onnxruntime)")
    print(header)
    print("-" * len(header))
    for r in results:
        logits = "-" if r.logits_diff is None else f"{r.logits_diff:.2e}"
        print(f"{r.model.name:<20}{r.model.nodes:>6}{r.ours * 1e3:>11.2f}{r.ort * 1e3:>10.2f}{r.ratio:>8.2f}  "
              f"{verdict(r.ratio, TARGETS.get(r.model.kind)):<13}{r.reference:>10}  {r.diff:>9.2e}  {logits:>10}  "
              f"{'ok' if r.agree else 'MISMATCH'}")
    for name, reason in skipped:
        print(f"{name:<20}  skipped: {reason}")

    cnn = [r for r in results if r.model.kind == "cnn"]
    if cnn:
        worst = max(cnn, key=lambda r: r.ratio)
        print(f"\nCNN geomean ratio  {geomean([r.ratio for r in cnn]):.2f}  "
              f"(target {verdict(geomean([r.ratio for r in cnn]), CNN_GEOMEAN_TARGET)}; over {len(cnn)} models)")
        print(f"CNN worst ratio    {worst.ratio:.2f}  ({worst.model.name}; target {verdict(worst.ratio, 2.0)})")
    for r in results:
        if r.model.kind == "chain":
            print(f"chain dispatch     ours {r.ours / r.model.nodes * 1e6:.1f} us/node, "
                  f"onnxruntime {r.ort / r.model.nodes * 1e6:.1f} us/node ({r.model.nodes} nodes)")

    header = (f"{'model':<20}{'ours ms':>11}{'ort ms':>10}{'ratio':>8}  {'target':<13}"
              f"{'1st run ours':>13}{'1st run ort':>13}")
    print("\nsession creation (median of alternating creations), and the first run on a fresh session")
    print(header)
    print("-" * len(header))
    for r in results:
        print(f"{r.model.name:<20}{r.create_ours * 1e3:>11.1f}{r.create_ort * 1e3:>10.1f}{r.create_ratio:>8.2f}  "
              f"{verdict(r.create_ratio, CREATE_TARGET):<13}{r.first_ours * 1e3:>13.1f}{r.first_ort * 1e3:>13.1f}")
    if results:
        gm = geomean([r.create_ratio for r in results])
        print(f"{'geomean':<20}{'':>21}{gm:>8.2f}")
    notes = [(r.model.name, note) for r in results for note in r.notes]
    for name, note in notes:
        print(f"note: {name}: {note}")


# -- command line ----------------------------------------------------------------------------------


def select(spec: str | None) -> list[str]:
    """Model names from a comma-separated list of groups (cnn, transformers), names, or parts of names."""
    known = list(catalogue())
    if not spec:
        return known
    chosen: set[str] = set()
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        matches = GROUPS.get(item) or [n for n in known if item in n]
        if not matches:
            raise SystemExit(f"unknown model {item!r}; choose from {', '.join(known)} or a group {sorted(GROUPS)}")
        chosen.update(matches)
    return [n for n in known if n in chosen]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated model names, parts of names or groups "
                                         f"({', '.join(sorted(GROUPS))}); default: all")
    parser.add_argument("--repeat", type=int, default=20, help="timed runs per runtime (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs per runtime first (default 3, min 3)")
    parser.add_argument("--block", type=int, default=5, help="consecutive timed runs per turn (default 5)")
    parser.add_argument("--pause", type=float, default=0.3,
                        help="seconds between turns, for thread pools to go idle (default 0.3)")
    parser.add_argument("--create-repeat", type=int, default=5, help="timed session creations (default 5)")
    parser.add_argument("--threads", type=int, help="intra_op_num_threads of both runtimes (default: their defaults)")
    parser.add_argument("--reference", choices=("auto", "all", "none"), default="auto",
                        help="time onnx.reference.ReferenceEvaluator too: auto = small models only (default)")
    parser.add_argument("--reference-cap", type=float, default=2.0,
                        help="with --reference all: skip models whose first reference run takes longer (s)")
    args = parser.parse_args(argv)
    args.warmup = max(args.warmup, 3)
    args.repeat = max(args.repeat, 1)
    args.create_repeat = max(args.create_repeat, 1)
    return args


def print_environment(args) -> None:
    import onnx
    import onnx_runtime
    import onnxruntime

    threads = args.threads if args.threads is not None else "default"
    print(f"python {platform.python_version()}, numpy {np.__version__}, onnx {onnx.__version__}, "
          f"onnxruntime {onnxruntime.__version__}, onnx_runtime {getattr(onnx_runtime, '__version__', '?')}")
    print(f"cpus {os.cpu_count()}, onnxruntime intra_op_num_threads {threads}; "
          f"{args.repeat} timed runs after {args.warmup} warm-ups, {args.create_repeat} session creations")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = select(args.models)
    print_environment(args)
    entries = catalogue()
    results, skipped = [], []
    for name in names:
        print(f"[{name}] ...", file=sys.stderr, flush=True)
        try:
            model = entries[name]()
        except Unavailable as exc:
            skipped.append((name, str(exc)))
            continue
        results.append(measure(model, args))
        r = results[-1]
        print(f"[{name}] ours {r.ours * 1e3:.2f} ms, onnxruntime {r.ort * 1e3:.2f} ms, ratio {r.ratio:.2f}",
              file=sys.stderr, flush=True)
    print_report(results, skipped)
    return 0 if all(r.agree for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
