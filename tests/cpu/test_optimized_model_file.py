"""``SessionOptions.optimized_model_filepath``: the graph as the session runs it, written as standard ONNX and
loaded back. Checked on zoo exports whose fusions make operators of other domains and of later opsets than the
model imports: the file loads in a new session, keeps the fused graph, and computes what the first session did.
Skipped when the zoo is not built (scripts/build_zoo.sh)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

ZOO = Path(os.environ.get("ONNX_RUNTIME_ZOO") or Path(__file__).resolve().parents[2] / "benchmarks/.models/zoo")
if not (ZOO / "manifest.json").is_file():
    pytest.skip("the model zoo is not built: run scripts/build_zoo.sh", allow_module_level=True)

import onnx_runtime as ort  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from zoo_feeds import make_feeds  # noqa: E402

MODELS = {m["name"]: m for m in json.loads((ZOO / "manifest.json").read_text())["models"] if m["status"] == "ok"}
CHOSEN = ["llama.dynamo.fp32", "gpt2.torchscript.fp32", "t5_decoder.torchscript.fp16", "bert.dynamo.int8_qdq",
          "mobilenetv3.torchscript.fp32", "vit.dynamo.optimized"]


@pytest.mark.parametrize("name", CHOSEN)
def test_the_written_optimized_model_loads_back_and_computes_the_same(name, tmp_path):
    if name not in MODELS:
        pytest.skip(f"{name} is not in this zoo")
    model = MODELS[name]
    written = tmp_path / "optimized.onnx"
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(written)
    first = ort.InferenceSession(str(ZOO / model["file"]), options, providers=["CPUExecutionProvider"])
    proto = onnx.load(str(written))
    exported = onnx.load(str(ZOO / model["file"]), load_external_data=False)
    assert len(proto.graph.node) < len(exported.graph.node)  # the fused graph, not the export
    again = ort.InferenceSession(str(written), providers=["CPUExecutionProvider"])
    for call in model["calls"].values():
        feeds = make_feeds(call)
        for want, got in zip(first.run(None, feeds), again.run(None, feeds)):
            assert got.shape == want.shape and got.dtype == want.dtype
            scale = float(np.abs(want.astype(np.float64)).max()) if want.size else 0.0
            assert np.abs(got.astype(np.float64) - want.astype(np.float64)).max(initial=0) <= 1e-5 * scale + 1e-6


def test_a_fusion_of_a_later_opset_is_written_in_its_own_domain(tmp_path):
    """llama's RMS norms fuse to RMSNormalization (opset 23) in an opset-18 export: the file imports
    ai.onnx_runtime.opset23 at 23 for them, and the loader reads them back as standard operators."""
    name = "llama.dynamo.fp32"
    if name not in MODELS:
        pytest.skip(f"{name} is not in this zoo")
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(ZOO / MODELS[name]["file"]), options, providers=["CPUExecutionProvider"])
    proto = onnx.load(options.optimized_model_filepath)
    imports = {o.domain: o.version for o in proto.opset_import}
    later = [n for n in proto.graph.node if n.domain.startswith("ai.onnx_runtime.opset")]
    assert later and all(imports[n.domain] > imports[""] for n in later)
    assert {n.op_type for n in later} & {"RMSNormalization", "Attention", "Swish", "Gelu"}
    again = ort.InferenceSession(options.optimized_model_filepath, providers=["CPUExecutionProvider"])
    assert all(not n.domain.startswith("ai.onnx_runtime.opset") for n in again.model.graph.nodes)
