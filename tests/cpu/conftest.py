"""Fixtures shared by the CPU provider's test files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ZOO = ROOT / "benchmarks" / ".models" / "zoo"


@pytest.fixture
def made(monkeypatch) -> list:
    """(op type, input shapes) of every kernel the session makes."""
    from onnx_runtime.session import executor, steps

    kernels: list = []
    original = steps.make_kernel

    def recording(handle, node, shapes, graph):
        kernels.append((node.op_type, tuple(tuple(s) if s is not None else None for s in shapes)))
        return original(handle, node, shapes, graph)

    monkeypatch.setattr(steps, "make_kernel", recording)
    monkeypatch.setattr(executor, "make_kernel", recording)  # (a static graph's kernels are made at planning)
    return kernels


@pytest.fixture
def built_convs(monkeypatch) -> list:
    """The convolutions conv_path builds while the test runs, as (class name, weight shape)."""
    from onnx_runtime_ep_cpu.algorithms import conv_direct, conv_packed

    built = []
    for module, cls in ((conv_direct, conv_direct.DirectConv), (conv_packed, conv_packed.PackedConv)):
        monkeypatch.setattr(module, cls.__name__, type(cls.__name__, (cls,), {
            "__init__": lambda self, *args, _cls=cls, **kwargs: built.append((_cls.__name__, tuple(args[3])))
            or _cls.__init__(self, *args, **kwargs)}))
    return built


@pytest.fixture(scope="session")
def qdq_decoders(tmp_path_factory):
    """(built, manifest entries by name, the zoo_feeds module): the zoo's decoders quantized with quantize_static
    to QDQ by benchmarks/qdq_decoders.py, built once per test session (each build calibrates)."""
    if not (ZOO / "manifest.json").exists():
        pytest.skip("the model zoo is not built: run scripts/build_zoo.sh")
    pytest.importorskip("onnxruntime.quantization", reason="quantize_static builds the models: install the test extra")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import qdq_decoders
        import zoo_feeds
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    built = qdq_decoders.build(ZOO, tmp_path_factory.mktemp("qdq_decoders"))
    entries = {e["name"]: e for e in json.loads((ZOO / "manifest.json").read_text())["models"]}
    return built, entries, zoo_feeds
