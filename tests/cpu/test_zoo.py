"""The model zoo: every model that scripts/build_zoo.sh built (benchmarks/.models/zoo/manifest.json, from
benchmarks/zoo.py) run in this runtime and in onnxruntime on the same feeds, every output compared at the
model's tolerance class. Skipped as a whole when the zoo is not built; the manifest's failed entries (an export,
a conversion or a call that failed at build time) are listed as skipped with their reason.

Tolerances, relative to the magnitude of the output (``mag``: the largest absolute value onnxruntime returns):

- float32 (exports, optimizer output): ``|ours - ort| <= 1e-4 * mag + 1e-4 * |ort|``.
- float16 (``convert_float_to_float16``, float32 inputs and outputs): 1e-2, float16's 11-bit mantissa.
- int4 (``MatMulNBits``): 1e-3. The 4-bit weights dequantize exactly (integer times a float32 scale) and the
  activations stay float32 (no accuracy_level), so only the order of the sums differs: float32 rounding, with
  room for a runtime that sums block by block.
- int8 (dynamic, QDQ, QOperator): ``|ours - ort| <= 2 * qerr + 1e-3 * mag``, where ``qerr`` is how far
  onnxruntime's own output for this model is from its float32 export's (the quantization error, per output).
  onnxruntime does not compute the operators' exact integer arithmetic: on CPUs without VNNI its u8s8 products
  sum pairs of products in saturating int16 (so quantize_dynamic documents reduce_range), and it runs a QDQ
  model's fused integer kernels where the spec dequantizes to float. On this zoo, onnxruntime differs from
  onnx.reference by up to ~7% of the magnitude on a dynamic int8 MobileNet, and from itself with graph
  optimizations off by as much on QDQ models: differences of the order of the quantization error itself.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

ZOO = Path(os.environ.get("ONNX_RUNTIME_ZOO") or Path(__file__).resolve().parents[2] / "benchmarks/.models/zoo")
MANIFEST = ZOO / "manifest.json"
if not MANIFEST.is_file():
    pytest.skip(f"the model zoo is not built ({MANIFEST} is missing): run scripts/build_zoo.sh",
                allow_module_level=True)

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is the oracle: install the test extra")

import onnx_runtime  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from zoo_feeds import make_feeds  # noqa: E402  (shared with benchmarks/zoo_bench.py)

MODELS = json.loads(MANIFEST.read_text())["models"]
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "int4": 1e-3}
INT8_QERR_FACTOR, INT8_FLOOR = 2.0, 1e-3


def cases():
    for model in MODELS:
        if model["status"] != "ok":
            reason = f"not built ({model['stage']}): {model['reason']}"
            yield pytest.param(model, "", id=model["name"], marks=pytest.mark.skip(reason=reason))
            continue
        for call in model["calls"]:
            yield pytest.param(model, call, id=f"{model['name']}-{call}")
        for call, reason in model.get("refused_calls", {}).items():
            yield pytest.param(model, call, id=f"{model['name']}-{call}",
                               marks=pytest.mark.skip(reason=f"onnxruntime refused this call: {reason}"))


@functools.lru_cache(maxsize=4)
def oracle(file: str):
    return ort.InferenceSession(str(ZOO / file), providers=["CPUExecutionProvider"])


@functools.lru_cache(maxsize=2)
def ours(file: str):
    try:
        return onnx_runtime.InferenceSession(str(ZOO / file), providers=["CPUExecutionProvider"])
    except Exception as exc:  # a missing operator, most often: the message must show, first
        error = f"{type(exc).__name__}: {exc} (onnx_runtime loading {file})"
    pytest.fail(error, pytrace=False)


def allowed(tolerance: str, want: np.ndarray, qerr: float | None) -> tuple[float, float]:
    """(atol, rtol) for one output."""
    mag = float(np.abs(want).max()) if want.size else 0.0
    if tolerance == "int8":
        return INT8_QERR_FACTOR * qerr + INT8_FLOOR * mag, 0.0
    return TOLERANCE[tolerance] * mag, TOLERANCE[tolerance]


def mismatch(name: str, got: np.ndarray, want: np.ndarray, tolerance: str, qerr: float | None) -> str | None:
    """Why ``got`` is not close enough to ``want``, or None."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{name}: {got.dtype}{list(got.shape)} where onnxruntime gives {want.dtype}{list(want.shape)}"
    if not np.issubdtype(want.dtype, np.floating):
        return None if np.array_equal(got, want) else f"{name}: integer outputs differ"
    atol, rtol = allowed(tolerance, want, qerr)
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    if np.all(np.abs(got64 - want64) <= atol + rtol * np.abs(want64)):
        return None
    diff, mag = float(np.nanmax(np.abs(got64 - want64))), float(np.abs(want64).max())
    return (f"{name}: max|diff| {diff:.3g} ({diff / max(mag, 1e-30):.3g} of the magnitude {mag:.3g}); "
            f"{tolerance} allows {atol:.3g} + {rtol:g}*|ort|")


def quantization_errors(model: dict, feeds: dict, want: list[np.ndarray]) -> list[float | None]:
    """Per output: how far onnxruntime's output of the quantized model is from its float32 export's."""
    if model["tolerance"] != "int8":
        return [None] * len(want)
    reference = oracle(model["float_reference"]).run(None, feeds)
    return [float(np.abs(w.astype(np.float64) - r).max()) for w, r in zip(want, reference)]


@pytest.mark.parametrize(("model", "call"), list(cases()))
def test_zoo_model(model, call):
    feeds = make_feeds(model["calls"][call])
    session = ours(model["file"])
    expected = oracle(model["file"])
    names = [o.name for o in expected.get_outputs()]
    assert [o.name for o in session.get_outputs()] == names
    want = expected.run(None, feeds)
    got = session.run(None, feeds)
    qerrs = quantization_errors(model, feeds, want)
    problems = [mismatch(n, g, w, model["tolerance"], q) for n, g, w, q in zip(names, got, want, qerrs)]
    problems = [p for p in problems if p]
    assert not problems, f"{model['name']} ({call}):\n" + "\n".join(problems)
