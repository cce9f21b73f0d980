"""A real generation loop, this runtime beside onnxruntime: one prefill, then decode steps whose past grows by
one token each step (the presents fed back as the next step's past, the attention mask and position ids grown
to match), as a user's greedy loop calls a decoder-with-past export. The zoo's own decode call repeats one
shape; here every step has a new one, which is what a shape-keyed cache cannot serve.

    .venv/bin/python benchmarks/decode_loop.py [--models 'gpt2.dynamo.fp32,t5_decoder.*.fp32'] [--steps 32]
    .venv/bin/python benchmarks/decode_loop.py --models gpt2.dynamo.fp32 --profile ours   # cProfile our steps

Both runtimes run on one thread, step by step interleaved (our step k, then onnxruntime's step k), so a load
change on a shared host hits both alike; each step's CPU time of this thread (``time.thread_time``) is
summed per round, and a round's ratio is ours/onnxruntime. The first round is a warm-up (compiles, the
specializations a loop makes on its first steps) and is reported apart, in full ("warm-up") and from its
fifth decode step on ("1st gen": every length is new to the session there, as in a user's first generation;
the timed rounds walk lengths the session has seen). Both loops read the same token ids;
their logits are compared each step (the largest difference relative to onnxruntime's largest logit).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from zoo_feeds import make_feeds  # noqa: E402

DEFAULT_ZOO = HERE / ".models" / "zoo"
DEFAULT_MODELS = "gpt2.*.fp32,t5_decoder.*.fp32,llama.*.fp32"
NOT_TUNED = ("llama",)  # models this runtime is not tuned on: reported apart
SETTLE = 4  # decode steps of the first round left out of its "first generation" ratio


def session(runtime: str, path: str):
    if runtime == "ours":
        import onnx_runtime as rt
    else:
        import onnxruntime as rt
    options = rt.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    if runtime == "ort":
        options.log_severity_level = 3
    return rt.InferenceSession(path, options, providers=["CPUExecutionProvider"])


class Loop:
    """One runtime's generation state: the feeds of its next step, advanced from its own outputs."""

    def __init__(self, sess, prefill: dict[str, np.ndarray]):
        self.session = sess
        self.outputs = [o.name for o in sess.get_outputs()]
        self.inputs = {i.name for i in sess.get_inputs()}
        self.feeds = dict(prefill)
        self.logits: np.ndarray | None = None

    def step(self) -> float:
        start = time.thread_time()
        results = self.session.run(self.outputs, self.feeds)
        elapsed = time.thread_time() - start
        by_name = dict(zip(self.outputs, results))
        self.logits = by_name["logits"]
        for name, value in by_name.items():
            if name.startswith("present."):
                self.feeds["past_key_values." + name[len("present."):]] = value
        return elapsed

    def advance(self, token: int) -> None:
        """Feeds of the next decode step: one new token after everything so far."""
        past = next(v.shape[2] for k, v in self.feeds.items()
                    if k.startswith("past_key_values.") and ".encoder." not in k)
        self.feeds["input_ids"] = np.array([[token]], dtype=np.int64)
        if "attention_mask" in self.inputs:
            self.feeds["attention_mask"] = np.ones((1, past + 1), dtype=np.int64)
        if "position_ids" in self.inputs:
            self.feeds["position_ids"] = np.array([[past]], dtype=np.int64)


def one_round(sessions: dict, prefill: dict, tokens: list[int]) -> dict:
    """Prefill then ``len(tokens)`` decode steps for both runtimes, interleaved step by step."""
    loops = {name: Loop(sess, prefill) for name, sess in sessions.items()}
    times = {name: [] for name in loops}
    worst = 0.0
    for index in range(len(tokens) + 1):
        for name, loop in loops.items():
            if index:
                loop.advance(tokens[index - 1])
            times[name].append(loop.step())
        ours, theirs = loops["ours"].logits, loops["ort"].logits
        worst = max(worst, float(np.max(np.abs(ours - theirs)) / max(float(np.max(np.abs(theirs))), 1e-30)))
    return {"prefill": {name: t[0] for name, t in times.items()},
            "decode": {name: sum(t[1:]) for name, t in times.items()},
            # Steps after the first few (where a session specializes its plans): a first generation's steady
            # cost, every length new to the session.
            "settled": {name: sum(t[1 + SETTLE:]) for name, t in times.items()},
            "steps": len(tokens), "max_rel_diff": worst}


def bench(zoo: Path, model: dict, args: argparse.Namespace) -> dict:
    path = str(zoo / model["file"])
    prefill = make_feeds(model["calls"]["prefill"])
    prompt = prefill["input_ids"].shape[1]
    rng = np.random.default_rng(1)
    high = next(f["high"] for f in model["calls"]["prefill"]["feeds"] if f["name"] == "input_ids")
    tokens = [int(t) for t in rng.integers(0, high, size=args.steps)]
    sessions = {"ours": session("ours", path), "ort": session("ort", path)}
    rounds = [one_round(sessions, prefill, tokens) for _ in range(args.rounds + 1)]
    warm, timed = rounds[0], rounds[1:]
    decode = [r["decode"]["ours"] / r["decode"]["ort"] for r in timed]
    pre = [r["prefill"]["ours"] / r["prefill"]["ort"] for r in timed]
    per_step = {name: statistics.median(r["decode"][name] for r in timed) / args.steps for name in ("ours", "ort")}
    result = {
        "model": model["name"], "prompt": prompt, "steps": args.steps, "rounds": args.rounds,
        "decode_ratio": statistics.median(decode), "decode_ratios": decode,
        "prefill_ratio": statistics.median(pre),
        "decode_step_us": {k: v * 1e6 for k, v in per_step.items()},
        "warmup_decode_ratio": warm["decode"]["ours"] / warm["decode"]["ort"],
        "first_generation_ratio": warm["settled"]["ours"] / max(warm["settled"]["ort"], 1e-9),
        "max_rel_diff": max(r["max_rel_diff"] for r in rounds),
    }
    if args.profile == "ours":
        import cProfile
        import pstats
        profiler = cProfile.Profile()
        loop = Loop(sessions["ours"], prefill)
        loop.step()
        profiler.enable()
        for token in tokens:
            loop.advance(token)
            loop.step()
        profiler.disable()
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile_lines)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--zoo", type=Path, default=DEFAULT_ZOO)
    parser.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated fnmatch patterns of zoo names")
    parser.add_argument("--steps", type=int, default=96,
                        help="decode steps after the prefill (the zoo's models hold 128 positions)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up round)")
    parser.add_argument("--profile", choices=("ours",), help="cProfile one more loop of ours, to stderr")
    parser.add_argument("--profile-lines", type=int, default=30)
    parser.add_argument("--json", type=Path, help="write the results here as well")
    args = parser.parse_args(argv)
    # Steady state: the compiled kernels from the first call on (not numpy's generic loops while numba loads).
    os.environ["ONNX_RUNTIME_COMPILE_IN_BACKGROUND"] = "0"
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    manifest = json.loads((args.zoo / "manifest.json").read_text())
    patterns = [p.strip() for p in args.models.split(",") if p.strip()]
    models = [m for m in manifest["models"] if m.get("status", "ok") == "ok" and "decode" in m.get("calls", {})
              and any(fnmatch.fnmatch(m["name"], p) for p in patterns)]
    if not models:
        parser.error(f"no decoder-with-past model of the zoo matches {args.models!r}")
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs; one thread each; "
          f"{args.steps} decode steps after the prompt, {args.rounds} timed rounds")
    print(f"{'model':34} {'prefill':>8} {'decode':>8} {'ours us/step':>13} {'ort us/step':>12} {'warm-up':>8} "
          f"{'1st gen':>8} {'rel diff':>9}")
    results = []
    for model in models:
        r = bench(args.zoo, model, args)
        results.append(r)
        mark = " (not tuned on)" if model["model"] in NOT_TUNED else ""
        print(f"{r['model']:34} {r['prefill_ratio']:8.2f} {r['decode_ratio']:8.2f} {r['decode_step_us']['ours']:13.0f} "
              f"{r['decode_step_us']['ort']:12.0f} {r['warmup_decode_ratio']:8.2f} {r['first_generation_ratio']:8.2f} "
              f"{r['max_rel_diff']:9.1e}{mark}",
              flush=True)
    tuned = [r["decode_ratio"] for r, m in zip(results, models) if m["model"] not in NOT_TUNED]
    if tuned:
        print(f"decode geomean (tuned-on models): {math.exp(sum(map(math.log, tuned)) / len(tuned)):.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
