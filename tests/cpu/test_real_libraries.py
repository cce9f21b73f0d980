"""Real libraries built on onnxruntime, run unchanged with this runtime substituted for it
(``sys.modules["onnxruntime"] = onnx_runtime`` before the library is imported), against the same library on
onnxruntime, on inputs the test makes. Each run is a child process: the substitution must not leak into the
oracle, and the library's own import of onnxruntime must see it from the start.

RapidOCR (rapidocr-onnxruntime) ships PP-OCR's detection, direction and recognition models in its wheel, and
drives them through onnxruntime's API as a user would: SessionOptions attributes, CPU provider options
(``arena_extend_strategy``), models declaring -1 dimensions (Paddle2ONNX's dynamic dims), get_inputs/run.

silero-vad ships its voice activity model in its wheel and streams 32 ms frames through onnxruntime, with the
model's LSTM state carried between calls; its utilities need torch, so it runs in the zoo's venv (.venv-zoo, where
scripts/build_zoo.sh installs it beside torch and this runtime).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")
ZOO_PYTHON = Path(__file__).resolve().parents[2] / ".venv-zoo/bin/python"

OCR = r"""
import json, sys
import numpy as np
from PIL import Image, ImageDraw, ImageFont

if sys.argv[1] == "ours":
    import onnx_runtime
    sys.modules["onnxruntime"] = onnx_runtime
from rapidocr_onnxruntime import RapidOCR

image = Image.new("RGB", (640, 200), "white")
draw = ImageDraw.Draw(image)
font = ImageFont.load_default(size=36)
for row, line in enumerate(["Hello World 2026", "onnx runtime OCR"]):
    draw.text((20, 20 + 60 * row), line, fill="black", font=font)
result, _ = RapidOCR()(np.asarray(image)[:, :, ::-1].copy())
import onnxruntime
print(json.dumps({"runtime": onnxruntime.__name__,
                  "lines": [[text, float(score), np.asarray(box, float).tolist()] for box, text, score in result]}))
"""


VAD = r"""
import json, sys
import numpy as np
if sys.argv[1] == "ours":
    import onnx_runtime
    sys.modules["onnxruntime"] = onnx_runtime
import torch
from silero_vad import get_speech_timestamps, load_silero_vad

# A second of noise, 1.6 s of a voiced sound (a gliding 110 Hz pitch through three formants, at a syllable rate of
# 4 Hz), a second of noise.
rate = 16000
t = np.arange(int(rate * 1.6)) / rate
pitch = 110 + 25 * np.sin(2 * np.pi * 3 * t)
phase = 2 * np.pi * np.cumsum(pitch) / rate
voiced = sum(np.sin(k * phase) * np.exp(-((k * pitch - f) / 180.0) ** 2 * 0.5)
             for k in range(1, 40) for f in (700, 1200, 2600))
voiced *= (0.55 + 0.45 * np.sin(2 * np.pi * 4 * t)) / np.abs(voiced).max()
rng = np.random.default_rng(0)
audio = np.concatenate([rng.normal(0, 1e-3, rate), 0.5 * voiced, rng.normal(0, 1e-3, rate)]).astype(np.float32)
model = load_silero_vad(onnx=True)
probs = [float(model(torch.from_numpy(audio[i:i + 512]), rate)) for i in range(0, len(audio) - 511, 512)]
model.reset_states()
stamps = get_speech_timestamps(torch.from_numpy(audio), model, sampling_rate=rate)
import onnxruntime
print(json.dumps({"runtime": onnxruntime.__name__, "probs": probs, "stamps": stamps}))
"""


def _child(python, script: str, runtime: str) -> dict:
    done = subprocess.run([str(python), "-c", script, runtime], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_rapidocr_reads_rendered_text_as_it_does_on_onnxruntime():
    pytest.importorskip("rapidocr_onnxruntime", reason="rapidocr-onnxruntime is in the test extra")
    want, got = _child(sys.executable, OCR, "onnxruntime"), _child(sys.executable, OCR, "ours")
    assert (want["runtime"], got["runtime"]) == ("onnxruntime", "onnx_runtime")
    assert [line[0] for line in got["lines"]] == [line[0] for line in want["lines"]]
    assert "".join(line[0] for line in got["lines"]).replace(" ", "").lower() == "helloworld2026onnxruntimeocr"
    for (_, got_score, got_box), (_, want_score, want_box) in zip(got["lines"], want["lines"]):
        assert abs(got_score - want_score) < 1e-3
        assert np.abs(np.asarray(got_box) - np.asarray(want_box)).max() <= 1.0  # pixels


def test_silero_vad_finds_the_same_speech_as_on_onnxruntime():
    if not ZOO_PYTHON.is_file() or subprocess.run([str(ZOO_PYTHON), "-c", "import silero_vad, onnx_runtime"],
                                                  capture_output=True).returncode != 0:
        pytest.skip("silero-vad runs in the zoo's venv: run scripts/build_zoo.sh")
    want, got = _child(ZOO_PYTHON, VAD, "onnxruntime"), _child(ZOO_PYTHON, VAD, "ours")
    assert (want["runtime"], got["runtime"]) == ("onnxruntime", "onnx_runtime")
    assert len(got["probs"]) == len(want["probs"]) > 100
    assert np.abs(np.asarray(got["probs"]) - np.asarray(want["probs"])).max() < 1e-4
    assert max(want["probs"]) > 0.5 > max(want["probs"][:25])  # the voiced part is speech, the noise before is not
    assert got["stamps"] == want["stamps"] and len(want["stamps"]) == 1
