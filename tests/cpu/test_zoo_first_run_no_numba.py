"""Cold start over the whole model zoo: a fresh process's session creation and first run of every call load no
numba (compiled/deferred.py serves them from numpy while the kernels load in the background). A kernel that
imports its compiled module when built, or a loop without a numpy twin, loads numba on the run thread instead
(about 0.3 CPU-s of a first run that otherwise takes tens of milliseconds). Such regressions were found by hand
(b825f5c's pools, 48b33f7's and 3511d81's int8 convolutions, 860cc3b's RoundedGelu), so every model is checked.
The first runs' values are checked by test_background_compile.py and the numpy twins' own tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_helpers import zoo_manifest

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = zoo_manifest()
ZOO = MANIFEST.parent

MODELS = [m for m in json.loads(MANIFEST.read_text())["models"] if m["status"] == "ok"]

SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[3])
from zoo_feeds import make_feeds
import onnx_runtime as ort

model = json.loads(sys.argv[2])
sess = ort.InferenceSession(sys.argv[1], providers=["CPUExecutionProvider"])
imported = {}
for name, call in model["calls"].items():
    sess.run(None, make_feeds(call))
    imported[name] = "numba" in sys.modules
print(json.dumps(imported))
"""


@pytest.mark.parametrize("model", MODELS, ids=[m["name"] for m in MODELS])
def test_first_run_loads_no_numba(model):
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(ZOO / model["file"]), json.dumps(model),
                           str(ROOT / "benchmarks")], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(imported) == set(model["calls"])
    assert not any(imported.values()), f"{model['name']}: numba imported by the first run of {imported}"
