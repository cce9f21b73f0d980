"""The generate loop on the GPU against torch (rows of scripts/gpu_bench.py; also runnable alone).

Ours: ``onnx_runtime.generate.Generator`` on a decoder of the model zoo (benchmarks/.models/zoo, built by
scripts/build_zoo.sh) with the CUDA provider and ``session.graph_capture`` on, so the KV cache, argmax and
token writer stay on the device and every decode step replays one device graph. Torch: the same weights,
rebuilt in torch by benchmarks/zoo_models.py (seeded, as the zoo exported them; needs transformers), run as
the same greedy loop on the GPU with its KV cache. Each row gives tokens/s after the first token (wall
time, the device synchronized at the end) and the note the time to first token and whether the greedy
tokens agree; a side that cannot run says why instead.

    python scripts/gpu_generate.py [--models gpt2.torchscript.fp32,llama.dynamo.fp32] [--new 64] [--device cuda]

``--device cpu`` runs the torch side on the CPU (a check of this script without a GPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ZOO = ROOT / "benchmarks/.models/zoo"
MODELS = ("gpt2.torchscript.fp32", "llama.dynamo.fp32")
PROMPT = [5, 17, 300, 42, 7, 901, 13, 64]
CUDA = "CUDAExecutionProvider"


def ours(path: Path, new: int) -> tuple[list[int], float, float, str]:
    """(tokens, seconds to the first token, tokens/s after it, how the steps ran) for our generate loop."""
    import onnx_runtime as ort
    from onnx_runtime.generate import Generator

    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    generator = Generator(str(path), [CUDA, "CPUExecutionProvider"], options)
    generator.generate(PROMPT, new)  # warm-up: kernels compiled, the decode step captured
    result = generator.generate(PROMPT, new)
    return result.tokens, result.time_to_first_token, result.tokens_per_second, generator.session.device_graph_status()


def torch_side(name: str, new: int, device: str) -> tuple[list[int], float, float]:
    """The same greedy loop in torch over the zoo model's weights, rebuilt by benchmarks/zoo_models.py."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import zoo_models

    spec = next(s for s in zoo_models.SPECS if s.name == name.split(".")[0])
    model = spec.build().to(device).eval()

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    def generate() -> tuple[list[int], float, float]:
        start = time.perf_counter()
        ids = torch.tensor([PROMPT], device=device)
        positions = torch.arange(len(PROMPT), device=device)[None]
        mask = torch.ones((1, len(PROMPT) + new), dtype=torch.int64, device=device)
        past: tuple = ()
        tokens: list[torch.Tensor] = []
        first = 0.0
        with torch.no_grad():
            for step in range(new):
                total = len(PROMPT) + step
                logits, *presents = model(ids, mask[:, :total], positions, past)
                token = logits[0, -1].argmax()
                tokens.append(token)
                if step == 0:
                    int(token)  # the first token on the host, as ours reports it
                    first = time.perf_counter() - start
                past = tuple(presents)
                ids, positions = token.view(1, 1), torch.full((1, 1), total, device=device)
        chosen = [int(t) for t in tokens]
        sync()
        seconds = time.perf_counter() - start
        return chosen, first, (new - 1) / (seconds - first)

    generate()  # warm-up
    return generate()


def generate_rows(names, new: int, device: str, torch_ok: bool) -> list[tuple[str, str, str, str]]:
    """(what, ours, torch, note) per model, for gpu_bench's table."""
    rows = []
    for name in names:
        what = f"generate {name} ({len(PROMPT)}-token prompt, {new} new) tokens/s"
        path = ZOO / f"{name}.onnx"
        if not path.exists():
            rows.append((what, "n/a", "n/a", f"{path} is missing: run scripts/build_zoo.sh or bring the zoo"))
            continue
        try:
            tokens, first, rate, status = ours(path, new)
            mine, note = f"{rate:.0f}", f"ours: first token {first * 1e3:.1f} ms, {status}"
        except Exception as exc:  # one side failing must not hide the other
            tokens, mine, note = None, "error", f"ours: {type(exc).__name__}: {str(exc)[:200]}"
        theirs = "n/a"
        if torch_ok:
            try:
                torch_tokens, torch_first, torch_rate = torch_side(name, new, device)
                theirs = f"{torch_rate:.0f}"
                agree = "tokens equal" if tokens == torch_tokens else "TOKENS DIFFER"
                note += f"; torch: first token {torch_first * 1e3:.1f} ms; {agree}"
            except ImportError as exc:
                note += f"; torch side needs {exc.name} (pip install torch transformers)"
            except Exception as exc:
                theirs, note = "error", note + f"; torch: {type(exc).__name__}: {str(exc)[:200]}"
        rows.append((what, mine, theirs, note))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="where the torch side runs")
    args = parser.parse_args()
    for what, mine, theirs, note in generate_rows(args.models.split(","), args.new, args.device, True):
        print(f"{what}: ours {mine}, torch {theirs}; {note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
