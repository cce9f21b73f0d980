"""The ``onnx-runtime`` command: list providers, describe a model, run a model.

    onnx-runtime providers
    onnx-runtime info MODEL [--providers cpu] [--nodes] [--memory] [--memory-limit BYTES] [--weight-budget BYTES]
    onnx-runtime run [MODEL] [--input NAME=FILE.npy ...] [--providers cpu] [--repeat N]
    onnx-runtime bench MODEL [--input NAME=FILE.npy ...] [--providers cpu] [--repeat N] [--warmup N]
    onnx-runtime compile [MODEL ...] [--providers cpu] [--jobs N]
    onnx-runtime generate MODEL --prompt TEXT [--max-new-tokens N] [--providers cpu] [--memory-limit BYTES]
    onnx-runtime new-provider NAME [--dir DIR]
    onnx-runtime batch MODEL --input DATA --output OUT [--engine local|ray|dask] [--workers N] [--threads N]

Without MODEL, ``run`` runs the embedded default: light_resnet50 from the installed onnx package,
checked against the output shipped beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from .errors import OnnxRuntimeError

DEFAULT_MODEL = "light_resnet50"


def _default_model_paths() -> tuple[str, str]:
    import onnx

    folder = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    return os.path.join(folder, f"{DEFAULT_MODEL}.onnx"), os.path.join(folder, f"{DEFAULT_MODEL}_output_0.pb")


def _providers_arg(value: str | None):
    return [p.strip() for p in value.split(",") if p.strip()] if value else None


def cmd_providers(args) -> int:
    from .discovery import registry

    entries = registry().entries()
    if getattr(args, "json", False):
        from .contract.version import VERSION
        print(json.dumps({"contract_version": VERSION, "providers": [{
            "name": e.name, "short_name": e.short_name, "distribution": e.distribution, "version": e.version,
            "device": e.device, "contract_version": e.contract_version, "available": e.availability.available,
            "reason": e.availability.reason, "selected_by_default": e.selected_by_default,
            "implemented_hooks": e.implemented_hooks} for e in entries],
            "broken": [{"source": b.source, "reason": b.reason, "entry_point": b.entry_point}
                       for b in registry().broken]}, indent=2))
        return 0
    if not entries:
        print("no execution providers installed; install one with `pip install 'onnx-runtime[cpu]'`")
    for e in entries:
        dist = f"{e.distribution} {e.version}".strip() or e.source
        state = "available" if e.availability.available else f"unavailable: {e.availability.reason}"
        print(f"{e.name} ({e.short_name})  {dist}  device {e.device}  {state}")
    for broken in registry().broken:
        print(f"broken plugin {broken.source}: {broken.reason}")
    return 0


def cmd_info(args) -> int:
    from .session import InferenceSession

    sess = InferenceSession(args.model, _memory_options(args), providers=_providers_arg(args.providers))
    model = sess.model
    print(f"model: {args.model}")
    print(f"producer: {model.producer_name} {model.producer_version}".rstrip())
    print("opsets: " + ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in sorted(model.opsets.items())))
    for kind, args_ in (("input", sess.get_inputs()), ("output", sess.get_outputs())):
        for arg in args_:
            print(f"{kind}: {arg.name} {arg.type} {arg.shape}")
    placement = sess.placement()
    print(f"nodes: {len(placement)}")
    for provider, count in placement.summary().items():
        print(f"  {provider}: {count} nodes")
    declined: dict[tuple[str, str], list[str]] = {}  # (provider, reason) -> operators
    for record in placement:
        for provider, reason in record.rejected.items():
            declined.setdefault((provider, reason), []).append(record.op_type)
    for (provider, reason), ops in declined.items():
        print(f"  {provider} declined {len(ops)} nodes ({', '.join(sorted(set(ops)))}): {reason}")
    if args.nodes:
        print(placement)
    if args.memory:
        from .memory.report import measure, render

        feeds = {arg.name: _default_feed(arg) for arg in sess.get_inputs()}
        print("\n".join(render(measure(sess, feeds))))
    return 0


def _memory_options(args, options=None):
    """SessionOptions carrying --memory-limit and --weight-budget (session.memory_limit and
    session.weight_residency_budget)."""
    from .memory.session import LIMIT_KEY, WEIGHT_BUDGET_KEY
    from .session import SessionOptions

    options = options or SessionOptions()
    for key, value in ((LIMIT_KEY, getattr(args, "memory_limit", None)),
                       (WEIGHT_BUDGET_KEY, getattr(args, "weight_budget", None))):
        if value:
            options.add_session_config_entry(key, value)
    return options


def _add_memory_arguments(p) -> None:
    p.add_argument("--memory-limit", metavar="BYTES",
                   help="bound what the process takes from each device the model runs on (e.g. 8GiB, 0 = no bound)")
    p.add_argument("--weight-budget", metavar="BYTES",
                   help="weights resident on a device at once; past it they are paged in per node (e.g. 256MiB)")


def _parse_inputs(specs: list[str]) -> dict:
    feeds = {}
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--input expects NAME=FILE.npy, got {spec!r}")
        if not os.path.exists(path):
            raise SystemExit(f"--input {name}: file {path!r} does not exist")
        feeds[name] = np.load(path, allow_pickle=False)
    return feeds


def _default_feed(arg) -> np.ndarray:
    from .dtypes import DataType

    dtype = DataType.parse(arg.type).numpy
    shape = [d if isinstance(d, int) else 1 for d in arg.shape]
    return np.zeros(shape, dtype=dtype)


def _time_runs(sess, feeds, repeat: int):
    outputs = sess.run(None, feeds)  # first run builds the plan and kernels
    times = []
    for _ in range(max(repeat, 1)):
        start = time.perf_counter()
        outputs = sess.run(None, feeds)
        times.append(time.perf_counter() - start)
    return outputs, times


def cmd_run(args) -> int:
    from .session import InferenceSession, SessionOptions

    checking = args.model is None
    if checking:
        model_path, expected_path = _default_model_paths()
        print(f"running the embedded default model {DEFAULT_MODEL} ({model_path})")
    else:
        model_path, expected_path = args.model, None
    options = _memory_options(args, SessionOptions())
    options.enable_profiling = args.profile or bool(args.trace)
    sess = InferenceSession(model_path, options, providers=_providers_arg(args.providers))
    feeds = _parse_inputs(args.input)
    for arg in sess.get_inputs():
        if arg.name not in feeds:
            feeds[arg.name] = _default_feed(arg)
            if not checking:
                print(f"input {arg.name}: not given, using zeros of shape {list(feeds[arg.name].shape)}")
    outputs, times = _time_runs(sess, feeds, args.repeat)
    for arg, value in zip(sess.get_outputs(), outputs):
        value = np.asarray(value)
        preview = np.array2string(value.reshape(-1)[:5], precision=5) if value.dtype != object else ""
        print(f"output {arg.name}: {value.dtype} {list(value.shape)} {preview}")
    print(f"providers: {', '.join(sess.get_providers())}")
    print(f"time per run: median {statistics.median(times) * 1e3:.2f} ms over {len(times)} runs")
    if args.profile:
        _print_profile(sess)
    if args.trace:
        os.replace(sess.end_profiling(), args.trace)
        print(f"trace written to {args.trace} (open it in Perfetto or chrome://tracing)")
    if expected_path is not None:  # checking the default model
        import onnx
        from onnx import numpy_helper

        expected = numpy_helper.to_array(onnx.load_tensor(expected_path))
        diff = float(np.abs(outputs[0] - expected).max())
        if np.allclose(outputs[0], expected, rtol=1e-4, atol=1e-4):
            print(f"MATCH: output equals the shipped reference (max abs diff {diff:.2e})")
        else:
            print(f"MISMATCH: max abs diff {diff:.2e} against the shipped reference")
            return 1
    return 0


class _ProgressBar:
    """A one-line text progress bar, redrawn in place with \\r, only when its shown percentage changes."""

    def __init__(self, total: int, label: str, stream=None, width: int = 30):
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = stream if stream is not None else sys.stderr
        self._shown = -1

    def update(self, done: int) -> None:
        percent = done * 100 // self.total
        if percent == self._shown:
            return
        self._shown = percent
        filled = done * self.width // self.total
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.label} [{bar}] {percent:3d}% {done}/{self.total}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _bench_feeds(sess, specs: list[str]) -> dict:
    feeds = _parse_inputs(specs)
    for arg in sess.get_inputs():
        if arg.name not in feeds:
            feeds[arg.name] = _default_feed(arg)
            print(f"input {arg.name}: not given, using zeros of shape {list(feeds[arg.name].shape)}")
    return feeds


def cmd_bench(args) -> int:
    from .session import InferenceSession

    if args.repeat < 1 or args.warmup < 0:
        raise SystemExit("--repeat must be at least 1 and --warmup at least 0")
    start = time.perf_counter()
    sess = InferenceSession(args.model, _memory_options(args), providers=_providers_arg(args.providers))
    created = time.perf_counter() - start
    feeds = _bench_feeds(sess, args.input)
    bar = _ProgressBar(args.warmup + args.repeat, "bench")
    times = []
    for i in range(args.warmup + args.repeat):
        start = time.perf_counter()
        sess.run(None, feeds)
        elapsed = time.perf_counter() - start
        if i >= args.warmup:
            times.append(elapsed)
        bar.update(i + 1)
    bar.close()
    ms = np.array(times) * 1e3
    print(f"model: {args.model}")
    print(f"providers: {', '.join(sess.get_providers())}")
    print(f"session creation: {created * 1e3:.2f} ms")
    print(f"runs: {args.repeat} timed after {args.warmup} warm-up")
    for name, value in (("p50", np.percentile(ms, 50)), ("p90", np.percentile(ms, 90)),
                        ("p99", np.percentile(ms, 99)), ("min", ms.min()), ("max", ms.max()), ("mean", ms.mean())):
        print(f"{name:<5}{value:12.3f} ms")
    return 0


def cmd_compile(args) -> int:
    from .ahead import compile_ahead, default_corpus

    for path in args.models:
        if not os.path.isfile(path):
            raise SystemExit(f"compile: model file {path!r} does not exist")
    models = [(os.path.basename(p), p) for p in args.models] if args.models else default_corpus()
    jobs = args.jobs or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    if jobs < 1:
        raise SystemExit("--jobs must be at least 1")
    print(f"compiling ahead: {len(models)} models, {jobs} processes")
    start = time.perf_counter()

    def report(result) -> None:
        print(f"  {result.name}: {result.seconds:.1f} s" + (f" ({result.error})" if result.error else ""))

    results = compile_ahead(models, _providers_arg(args.providers), jobs, report=report)
    failed = [r for r in results if r.error]
    print(f"done in {time.perf_counter() - start:.1f} s; later processes load the cached kernels"
          + (f"; {len(failed)} models failed" if failed else ""))
    return 1 if failed else 0


def _print_profile(sess) -> None:
    summary = sess.profile_summary()
    total = sum(seconds for seconds, _ in summary.values()) or 1.0
    runs = sess.profiled_runs or 1
    print(f"{'operator':<28}{'ms/run':>10}{'share':>8}{'calls/run':>11}")
    for op, (seconds, calls) in summary.items():
        print(f"{op:<28}{seconds / runs * 1e3:>10.3f}{seconds / total:>8.1%}{calls / runs:>11.0f}")


def cmd_generate(args) -> int:
    from .generate import run_cli

    return run_cli(args, _memory_options(args) if args.memory_limit or args.weight_budget else None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="onnx-runtime", description="ONNX inference with plugin providers")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("providers", help="list installed providers and whether they can run here")
    p.add_argument("--json", action="store_true",
                   help="machine-readable: versions, availability and reason, the hooks each implements")
    p.set_defaults(func=cmd_providers)
    p = sub.add_parser("info", help="describe a model and where its nodes would run")
    p.add_argument("model")
    p.add_argument("--providers", help="comma-separated provider names (default: all available)")
    p.add_argument("--nodes", action="store_true", help="list every node's placement")
    p.add_argument("--memory", action="store_true",
                   help="run once and report weights, device budgets, residency, peak activations, allocation sites")
    _add_memory_arguments(p)
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("run", help="run a model (without MODEL: the embedded light_resnet50 check)")
    p.add_argument("model", nargs="?")
    p.add_argument("--input", action="append", metavar="NAME=FILE.npy", help="an input from a .npy file")
    p.add_argument("--providers", help="comma-separated provider names (default: all available)")
    p.add_argument("--repeat", type=int, default=5, help="timed runs after a warm-up run (default 5)")
    p.add_argument("--profile", action="store_true", help="print time per operator")
    p.add_argument("--trace", metavar="FILE", help="write onnxruntime's Chrome-trace profile of the runs to FILE")
    _add_memory_arguments(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("bench", help="run a model repeatedly and report latency percentiles")
    p.add_argument("model")
    p.add_argument("--input", action="append", metavar="NAME=FILE.npy", help="an input from a .npy file")
    p.add_argument("--providers", help="comma-separated provider names (default: all available)")
    p.add_argument("--repeat", type=int, default=100, help="timed runs (default 100)")
    p.add_argument("--warmup", type=int, default=5, help="untimed runs first (default 5)")
    _add_memory_arguments(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("compile", help="compile and cache the providers' kernels ahead, by running models once")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help="the models to compile for (default: onnx's light CNNs and a transformer block)")
    p.add_argument("--providers", help="comma-separated provider names (default: all available)")
    p.add_argument("--jobs", type=int, help="worker processes (default: the CPUs this process may use)")
    p.set_defaults(func=cmd_compile)
    p = sub.add_parser("generate", help="greedy generation with a decoder exported with past, streamed")
    p.add_argument("model")
    p.add_argument("--prompt", help="text, tokenized with the tokenizer.json beside the model")
    p.add_argument("--prompt-ids", help="comma-separated token ids instead of text")
    p.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate at most (default 32)")
    p.add_argument("--providers", help="comma-separated provider names (default: all available)")
    _add_memory_arguments(p)
    p.set_defaults(func=cmd_generate)
    from .scaffold import cmd_new_provider

    p = sub.add_parser("new-provider", help="write a provider distribution to start from (entry point, tests, tox)")
    p.add_argument("name", help="the provider's name, e.g. my-accel (-> MyAccelExecutionProvider)")
    p.add_argument("--dir", default=".", help="where to write it (default: the current directory)")
    p.set_defaults(func=cmd_new_provider)
    from .batch.cli import add_parser as add_batch_parser

    add_batch_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except OnnxRuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
