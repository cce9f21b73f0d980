"""benchmarks/executor_overhead.py runs end to end on the zoo: a model with one call (``default``) and a decoder
whose calls are ``prefill`` and ``decode`` (the script once read every model's ``default`` call and stopped with
KeyError 'default' on the decoders), and the generation split. Skipped when the zoo is not built."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from model_helpers import zoo_manifest

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = zoo_manifest()
ZOO = MANIFEST.parent
pytest.importorskip("onnxruntime", reason="the benchmark compares with onnxruntime")

sys.path.insert(0, str(ROOT / "benchmarks"))
import executor_overhead  # noqa: E402

OK = {m["name"] for m in json.loads(MANIFEST.read_text())["models"] if m["status"] == "ok"}
DECODER, PLAIN = "gpt2.dynamo.fp32", "mobilenetv3.torchscript.fp32"
RATIO = re.compile(r"ratio (\d+\.\d+)")


@pytest.mark.skipif(not {DECODER, PLAIN} <= OK, reason="the zoo lacks the models this test runs")
def test_runs_a_decoders_calls_and_a_plain_models(capsys, monkeypatch):
    monkeypatch.setenv("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")  # as main() sets it, restored after
    assert executor_overhead.main(["--chain", "20", "--models", f"{DECODER},{PLAIN}", "--decoders", DECODER,
                                   "--rounds", "1", "--new", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for label in ("chain of 20 Adds", PLAIN, f"{DECODER} prefill", f"{DECODER} decode"):
        line = next((line for line in lines if line.startswith(label + ":")), None)
        assert line is not None, (label, lines)
        assert float(RATIO.search(line).group(1)) > 0, line
    assert any(line.startswith(f"{DECODER}: ours") and "tokens/s" in line for line in lines), lines
    assert any("step split: kernels" in line for line in lines), lines
