"""Decoders with past that the zoo does not hold, for checking a generation-speed change on models it was not
tuned on: tiny Qwen2, Mistral and OPT configurations from transformers (random weights), each exported with
both of torch's exporters the way benchmarks/zoo.py exports the zoo's (dynamic batch, sequence and past), at a
size whose KV cache is larger than the zoo's (``--hidden``, ``--layers``, ``--positions``).

    .venv-zoo/bin/python benchmarks/decoder_export.py --out benchmarks/.models/untuned [--models qwen2,opt]
    .venv/bin/python benchmarks/generate_bench.py --zoo benchmarks/.models/untuned --models '.*'

A manifest.json beside the exports lists them as generate_bench reads the zoo's (architecture "decoder").
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

_find_spec = importlib.util.find_spec
# transformers imports torchvision where it finds one; a torchvision built for another torch breaks every model
# import (operator torchvision::nms does not exist), and these models need none of it.
importlib.util.find_spec = lambda name, *args, **kwargs: None if name.split(".")[0] == "torchvision" else \
    _find_spec(name, *args, **kwargs)

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo import EXPORT  # noqa: E402
from zoo_models import CausalLMWithPast, Feed, Spec  # noqa: E402

VOCAB = 1000


def build(kind: str, hidden: int, layers: int, heads: int, kv_heads: int, positions: int,
          vocab: int = VOCAB) -> torch.nn.Module:
    import transformers

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  max_position_embeddings=positions, attn_implementation="eager")
    if kind == "opt":  # learned positions, ReLU MLP, pre-LayerNorm, no grouped heads
        config = transformers.OPTConfig(ffn_dim=2 * hidden, word_embed_proj_dim=hidden, **common)
        model = transformers.OPTForCausalLM(config)
    else:  # rotary, RMSNorm, SwiGLU, grouped-query attention
        names = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM")}
        config_class, model_class = (getattr(transformers, name) for name in names[kind])
        config = config_class(intermediate_size=2 * hidden, num_key_value_heads=kv_heads, **common)
        model = model_class(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():  # matrices larger than the init's, so greedy tokens vary step to
            if parameter.ndim > 1:  # step; norms and biases as initialized, so float32 stays well conditioned
                parameter.normal_(0, 0.08)
    # The wrapper in eval mode too: the dynamo exporter traces the top module's mode, and OPT's dropout (0.1)
    # exported in training mode gives random outputs on every runtime.
    return CausalLMWithPast(model.eval()).eval()


def spec(kind: str, layers: int, kv_heads: int, head_dim: int, vocab: int = VOCAB) -> Spec:
    def feeds(batch: int, seq: int, past: int) -> list[Feed]:
        out = [Feed("input_ids", "int64", [batch, seq], "ids", {0: "batch", 1: "sequence"}, high=vocab),
               Feed("attention_mask", "int64", [batch, past + seq], "ones", {0: "batch", 1: "total_sequence"}),
               Feed("position_ids", "int64", [batch, seq], "positions", {0: "batch", 1: "sequence"}, start=past)]
        for layer in range(layers):
            for kv in ("key", "value"):
                out.append(Feed(f"past_key_values.{layer}.{kv}", "float32", [batch, kv_heads, past, head_dim],
                                "normal", {0: "batch", 2: "past_sequence"}, group="past"))
        return out

    def outputs() -> list[tuple[str, dict[int, str]]]:
        return [("logits", {0: "batch", 1: "sequence"})] + [
            (f"present.{layer}.{kv}", {0: "batch", 2: "total_sequence"}) for layer in range(layers)
            for kv in ("key", "value")]

    return Spec(kind, "decoder", kind, lambda: None, feeds, outputs, ("fp32",), {})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/.models/untuned")
    parser.add_argument("--models", default="qwen2,mistral,opt")
    parser.add_argument("--exporters", default="torchscript,dynamo")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=VOCAB)
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    entries = []
    for kind in args.models.split(","):
        kv_heads = args.heads if kind == "opt" else args.kv_heads
        module = build(kind, args.hidden, args.layers, args.heads, kv_heads, args.positions, args.vocab)
        for exporter in args.exporters.split(","):
            name = f"{kind}{'' if args.vocab == VOCAB else f'_v{args.vocab}'}.{exporter}.fp32"
            entry = {"name": name, "architecture": "decoder", "exporter": exporter, "variant": "fp32",
                     "positions": args.positions}
            try:
                EXPORT[exporter](module, spec(kind, args.layers, kv_heads, args.hidden // args.heads, args.vocab),
                                 os.path.join(args.out, name + ".onnx"))
            except Exception as error:  # one export that fails is listed with its reason, the others go on
                entry["status"] = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            print(name, entry.get("status", "ok"), flush=True)
            entries.append(entry)
    with open(os.path.join(args.out, "manifest.json"), "w") as handle:
        json.dump(entries, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
