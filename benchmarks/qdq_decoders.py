"""Static QDQ variants of the zoo's decoders with a past (gpt2 and llama, both exporters): quantize_static in QDQ
format over a small calibration set of prefill and decode calls, written outside the zoo.

    python benchmarks/qdq_decoders.py OUT_FOLDER [--zoo benchmarks/.models/zoo]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from zoo_feeds import grown, make_feeds  # noqa: E402

DECODERS = ("gpt2.torchscript", "gpt2.dynamo", "llama.torchscript", "llama.dynamo")


def calibration_feeds(entry: dict, count: int = 6) -> list[dict]:
    """Prefill calls, then decode calls a few tokens further each."""
    calls = entry["calls"]
    feeds = [make_feeds(calls["prefill"])]
    feeds += [make_feeds(grown(calls["decode"], extra)) for extra in range(count - 1)]
    return feeds


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
        q.quantize_static(zoo / entry["file"], target, Reader(calibration_feeds(entry)),
                          quant_format=q.QuantFormat.QDQ, activation_type=q.QuantType.QUInt8,
                          weight_type=q.QuantType.QInt8)
        built[name] = target
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--zoo", type=Path, default=HERE / ".models" / "zoo")
    args = parser.parse_args()
    for name, path in build(args.zoo, args.out).items():
        print(name, path)


if __name__ == "__main__":
    main()
