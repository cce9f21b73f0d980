"""silero-vad per frame, this runtime against onnxruntime in one process, one thread each.

    .venv/bin/python benchmarks/silero_bench.py [--models 'silero_vad,silero_vad_16k_op15,silero_vad_op18_ifless']
        [--frames 300] [--rounds 5] [--busy N]

Each model streams the same frames the way silero-vad's OnnxWrapper does at 16 kHz: a (1, 576) window (64
samples of context and a 512-sample frame), the (2, 1, 128) state returned by the previous frame, and sr. The
frames alternate between the two runtimes in blocks (interleaved rounds), CPU time of this thread, medians per
frame in microseconds and the median of the rounds' ratios. The model files come from the silero-vad wheel in the
zoo's venv (scripts/build_zoo.sh), or --data. The load average is printed beside the numbers. ``--busy N`` measures
again beside N CPU-bound processes that the script starts (zoo_bench's competitors): a streaming model shares its
host in deployment.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / ".venv-zoo/lib/python3.11/site-packages/silero_vad/data"
CPU = "CPUExecutionProvider"
sys.path.insert(0, str(ROOT / "benchmarks"))

from zoo_bench import Competitors  # noqa: E402


def frames(count: int) -> np.ndarray:
    """Noise with a voiced stretch in the middle, so the model's state moves through both regimes."""
    rng = np.random.default_rng(0)
    t = np.arange(count * 512) / 16000.0
    voiced = np.sin(2 * np.pi * (110 + 20 * t) * t) * (np.abs(np.sin(2 * np.pi * 4 * t)) > 0.3)
    middle = (t > t[-1] / 3) & (t < 2 * t[-1] / 3)
    audio = (0.02 * rng.standard_normal(t.size) + 0.5 * voiced * middle).astype(np.float32)
    padded = np.concatenate([np.zeros(64, np.float32), audio])
    return np.stack([padded[i * 512: i * 512 + 576] for i in range(count)])[:, None, :]


def stream(session, windows: np.ndarray) -> tuple[list[float], np.ndarray]:
    names = {i.name for i in session.get_inputs()}
    state = np.zeros((2, 1, 128), np.float32)
    sr = np.array(16000, np.int64)
    times, probs = [], []
    for window in windows:
        feed = {"input": window, "state": state}
        if "sr" in names:
            feed["sr"] = sr
        start = time.thread_time()
        out, state = session.run(None, feed)
        times.append(time.thread_time() - start)
        probs.append(float(out.reshape(-1)[0]))
    return times, np.array(probs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="silero_vad,silero_vad_16k_op15,silero_vad_op18_ifless")
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--frames", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--busy", type=int, default=0, help="also measure beside this many CPU-bound processes")
    args = parser.parse_args()
    os.environ.setdefault("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")  # kernels loaded before the first timed run

    import onnx_runtime
    import onnxruntime as ort

    windows = frames(args.frames)
    print(f"load {os.getloadavg()[0]:.2f}; onnxruntime {ort.__version__}; {args.frames} frames x {args.rounds} rounds")
    pairs = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        path = str(Path(args.data) / f"{name}.onnx")
        options = onnx_runtime.SessionOptions()
        options.intra_op_num_threads = 1
        ours = onnx_runtime.InferenceSession(path, options, providers=[CPU])
        ort_options = ort.SessionOptions()
        ort_options.intra_op_num_threads = 1
        ort_options.log_severity_level = 3
        theirs = ort.InferenceSession(path, ort_options, providers=[CPU])
        stream(ours, windows[:5])
        stream(theirs, windows[:5])
        pairs.append((name, ours, theirs))
    conditions = ["quiet"] + ([f"busy {args.busy}"] if args.busy else [])
    for condition in conditions:
        competitors = Competitors(args.busy) if condition != "quiet" else contextlib.nullcontext()
        with competitors:
            print(f"{condition}: {'model':21s} {'ours us':>9s} {'ort us':>8s} {'ratio':>6s} {'max |dp|':>9s}")
            for name, ours, theirs in pairs:
                a, b, ratio, diff = compare(ours, theirs, windows, args.rounds)
                print(f"{condition}: {name:21s} {a:9.1f} {b:8.1f} {ratio:6.2f} {diff:9.2e}", flush=True)
    print(f"load {os.getloadavg()[0]:.2f}")
    return 0


def compare(ours, theirs, windows: np.ndarray, rounds: int) -> tuple[float, float, float, float]:
    """Median microseconds per frame of each runtime (rounds alternating), the median of the rounds' ratios (each
    round's two blocks ran next to each other, so a shared host's load moves both) and their largest probability
    gap."""
    mine, other, ratios, diff = [], [], [], 0.0
    for _ in range(rounds):
        t_ours, p_ours = stream(ours, windows)
        t_ort, p_ort = stream(theirs, windows)
        mine.append(statistics.median(t_ours))
        other.append(statistics.median(t_ort))
        ratios.append(mine[-1] / other[-1])
        diff = max(diff, float(np.max(np.abs(p_ours - p_ort))))
    return statistics.median(mine) * 1e6, statistics.median(other) * 1e6, statistics.median(ratios), diff


if __name__ == "__main__":
    sys.exit(main())
