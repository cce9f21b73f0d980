"""The benchmark models: where they come from, how they are built, and the inputs they are run with.

The CNNs ship with the onnx package. The node chain is built with ``onnx.helper``. The two transformers
are exported from PyTorch into ``benchmarks/.models/`` on first use (torch is a benchmark-only
dependency; without it those models are skipped with the reason).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper

LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
CNN_NAMES = (
    "bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
    "shufflenet", "squeezenet", "vgg19", "zfnet512",
)
CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), ".models")
TORCH_INSTALL_HINT = (
    "torch is not installed, and the model is not in benchmarks/.models/ yet; to export it install "
    "torch (the CPU build is enough, see benchmarks/README.md), e.g. "
    "`.venv/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu`"
)

CHAIN_NODES = 1000
PREFILL_SEQ = 128
DECODE_PAST = 128

# Transformer sizes: small enough that the exported files stay a few MB.
LAYERS, D_MODEL, HEADS, KV_HEADS, VOCAB = 4, 256, 4, 2, 1000


class Unavailable(Exception):
    """A model cannot be built here (e.g. torch is missing); the message says why."""


@dataclass
class BenchModel:
    """A model to benchmark: its file, the inputs both runtimes get, and how to judge it."""

    name: str
    kind: str  # "cnn", "prefill", "decode", "chain": selects the target the ratio is checked against
    path: str
    feeds: dict[str, np.ndarray] = field(default_factory=dict)
    nodes: int = 0
    reference_ok: bool = False  # small enough for onnx.reference.ReferenceEvaluator


def _seeded(name: str) -> np.random.Generator:
    # A fixed seed per model (not hash(), which varies per process) so every run feeds the same data.
    return np.random.default_rng(sum(map(ord, name)))


def _random_feeds(model: onnx.ModelProto, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Standard-normal float inputs for every graph input that is not an initializer (batch dims -> 1)."""
    inits = {init.name for init in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        shape = [d.dim_value if d.HasField("dim_value") else 1 for d in vi.type.tensor_type.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
        feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def _count_nodes(path: str) -> int:
    return len(onnx.load(path, load_external_data=False).graph.node)


# -- the light CNNs --------------------------------------------------------------------------------


def cnn(name: str) -> BenchModel:
    path = os.path.join(LIGHT_DIR, f"light_{name}.onnx")
    model = onnx.load(path)
    return BenchModel(name, "cnn", path, _random_feeds(model, _seeded(name)), len(model.graph.node))


# -- the elementwise chain -------------------------------------------------------------------------


def build_chain(nodes: int = CHAIN_NODES, width: int = 16) -> onnx.ModelProto:
    """``nodes`` small elementwise ops in a line (Add, Mul, Relu, Tanh repeating) on a [1, width] tensor.

    The tensors are tiny, so the run time is almost entirely per-node dispatch.
    """
    cycle = ("Add", "Mul", "Relu", "Tanh")
    initializers = [
        helper.make_tensor("bias", TensorProto.FLOAT, [width], np.linspace(-0.1, 0.1, width).tolist()),
        helper.make_tensor("scale", TensorProto.FLOAT, [width], np.linspace(0.9, 1.1, width).tolist()),
    ]
    graph_nodes, previous = [], "x"
    for i in range(nodes):
        op = cycle[i % len(cycle)]
        out = "y" if i == nodes - 1 else f"t{i}"
        extra = {"Add": ["bias"], "Mul": ["scale"]}.get(op, [])
        graph_nodes.append(helper.make_node(op, [previous, *extra], [out], name=f"n{i}"))
        previous = out
    graph = helper.make_graph(
        graph_nodes, "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])],
        initializer=initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def chain() -> BenchModel:
    path = os.path.join(CACHE_DIR, f"chain_{CHAIN_NODES}.onnx")
    os.makedirs(CACHE_DIR, exist_ok=True)
    onnx.save(build_chain(), path)  # cheap to build, so always current
    feeds = {"x": _seeded("chain").standard_normal((1, 16)).astype(np.float32)}
    return BenchModel("chain_1000", "chain", path, feeds, CHAIN_NODES, reference_ok=True)


# -- the PyTorch transformers ----------------------------------------------------------------------


def _torch():
    try:
        import torch
    except ImportError:
        raise Unavailable(TORCH_INSTALL_HINT) from None
    return torch


def _cached(stem: str) -> str:
    """A cache path keyed by the model code, so editing torch_models.py re-exports instead of reusing."""
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_models.py"), "rb") as source:
        digest = hashlib.sha256(source.read()).hexdigest()[:8]
    return os.path.join(CACHE_DIR, f"{stem}_{digest}.onnx")


def _export(module, args: tuple, path: str, input_names: list[str], output_names: list[str]) -> None:
    torch = _torch()
    os.makedirs(CACHE_DIR, exist_ok=True)
    tmp = path + ".tmp"
    with torch.no_grad():
        torch.onnx.export(
            module, args, tmp, input_names=input_names, output_names=output_names,
            opset_version=17, dynamo=False,
        )
    # Fold any external-data sidecar back in so the cache holds one self-contained file per model.
    onnx.save(onnx.load(tmp), path)
    os.remove(tmp)
    if os.path.exists(tmp + ".data"):
        os.remove(tmp + ".data")


def gpt_prefill() -> BenchModel:
    """GPT-2-like prefill: token + learned position embeddings, pre-LN blocks, causal attention, GELU MLP."""
    path = _cached(f"gpt_prefill_l{LAYERS}_d{D_MODEL}_s{PREFILL_SEQ}")
    if not os.path.exists(path):
        torch = _torch()  # first, so a missing torch gives the install hint rather than an ImportError
        from torch_models import build_gpt

        model = build_gpt(LAYERS, D_MODEL, HEADS, VOCAB, PREFILL_SEQ)
        ids = torch.randint(0, VOCAB, (1, PREFILL_SEQ), generator=torch.Generator().manual_seed(0))
        _export(model, (ids,), path, ["input_ids"], ["logits"])
    rng = _seeded("gpt_prefill")
    feeds = {"input_ids": rng.integers(0, VOCAB, (1, PREFILL_SEQ), dtype=np.int64)}
    return BenchModel("gpt_prefill_128", "prefill", path, feeds, _count_nodes(path))


def llama_decode() -> BenchModel:
    """LLaMA-like decode step: one new token over a 128-token KV cache (RMSNorm, RoPE, GQA, SwiGLU)."""
    path = _cached(f"llama_decode_l{LAYERS}_d{D_MODEL}_p{DECODE_PAST}")
    head_dim = D_MODEL // HEADS
    names = [f"past_{kind}_{i}" for i in range(LAYERS) for kind in ("key", "value")]
    if not os.path.exists(path):
        torch = _torch()  # first, so a missing torch gives the install hint rather than an ImportError
        from torch_models import build_llama

        model = build_llama(LAYERS, D_MODEL, HEADS, KV_HEADS, VOCAB)
        gen = torch.Generator().manual_seed(0)
        past = [torch.randn(1, KV_HEADS, DECODE_PAST, head_dim, generator=gen) for _ in names]
        args = (torch.tensor([[7]]), torch.tensor([[DECODE_PAST]]), *past)
        outputs = ["logits"] + [n.replace("past_", "present_") for n in names]
        _export(model, args, path, ["input_ids", "position_ids", *names], outputs)
    rng = _seeded("llama_decode")
    feeds = {
        "input_ids": rng.integers(0, VOCAB, (1, 1), dtype=np.int64),
        "position_ids": np.array([[DECODE_PAST]], dtype=np.int64),
    }
    for name in names:
        feeds[name] = rng.standard_normal((1, KV_HEADS, DECODE_PAST, head_dim)).astype(np.float32)
    return BenchModel("llama_decode_p128", "decode", path, feeds, _count_nodes(path))


# -- the catalogue ---------------------------------------------------------------------------------


def catalogue() -> dict[str, Callable[[], BenchModel]]:
    """Every benchmark model by name, in report order; calling an entry builds (or loads) it."""
    entries: dict[str, Callable[[], BenchModel]] = {name: (lambda n=name: cnn(n)) for name in CNN_NAMES}
    entries["gpt_prefill_128"] = gpt_prefill
    entries["llama_decode_p128"] = llama_decode
    entries["chain_1000"] = chain
    return entries
