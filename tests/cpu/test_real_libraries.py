"""Real libraries built on onnxruntime, run unchanged with this runtime substituted for it
(``sys.modules["onnxruntime"] = onnx_runtime`` before the library is imported), against the same library on
onnxruntime, on inputs the test makes. Each run is a child process: the substitution must not leak into the
oracle, and the library's own import of onnxruntime must see it from the start.

RapidOCR (rapidocr-onnxruntime) ships PP-OCR's detection, direction and recognition models in its wheel, and
drives them through onnxruntime's API as a user would: SessionOptions attributes, CPU provider options
(``arena_extend_strategy``), models declaring -1 dimensions (Paddle2ONNX's dynamic dims), get_inputs/run.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("rapidocr_onnxruntime", reason="rapidocr-onnxruntime is in the test extra")
pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")

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


def _ocr(runtime: str) -> dict:
    done = subprocess.run([sys.executable, "-c", OCR, runtime], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_rapidocr_reads_rendered_text_as_it_does_on_onnxruntime():
    want, got = _ocr("onnxruntime"), _ocr("ours")
    assert (want["runtime"], got["runtime"]) == ("onnxruntime", "onnx_runtime")
    assert [line[0] for line in got["lines"]] == [line[0] for line in want["lines"]]
    assert "".join(line[0] for line in got["lines"]).replace(" ", "").lower() == "helloworld2026onnxruntimeocr"
    for (_, got_score, got_box), (_, want_score, want_box) in zip(got["lines"], want["lines"]):
        assert abs(got_score - want_score) < 1e-3
        assert np.abs(np.asarray(got_box) - np.asarray(want_box)).max() <= 1.0  # pixels
