"""Builds two QOperator int8 transformer models outside the zoo, as onnxruntime's quantizer writes them:
DeiT (torch's dynamo exporter) and DistilBERT (torchscript exporter), tiny configs and random weights,
quantized with quantize_static(QuantFormat.QOperator) from a small calibration reader.

    .venv-zoo/bin/python benchmarks/qoperator_transformers.py OUT_DIR   (the zoo environment: torch, transformers)

Writes OUT_DIR/{deit.dyn,distilbert.ts}.int8_qoperator.onnx and their feeds (.npz); keep OUT_DIR out of git.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np

_find_spec = importlib.util.find_spec
# transformers imports torchvision where it finds one; one built for another torch breaks every model import
importlib.util.find_spec = lambda name, *args, **kwargs: None if name.split(".")[0] == "torchvision" else \
    _find_spec(name, *args, **kwargs)


def _export(module, args, names, path: Path, dynamo: bool) -> None:
    import torch

    if dynamo:  # static shapes: the 2-D products export as Gemm, which the quantizer writes as QGemm
        torch.onnx.export(module, args, str(path), input_names=names, output_names=["y"], dynamo=True,
                          external_data=False)
    else:
        axes = {n: {0: "batch", 1: "tokens"} for n in names}
        torch.onnx.export(module, args, str(path), input_names=names, output_names=["y"], opset_version=17,
                          dynamo=False, dynamic_axes=axes)


def _quantize(fp32: Path, out: Path, feeds) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.i = 0

        def get_next(self):
            self.i += 1
            return feeds(self.i) if self.i <= 8 else None

    pre = fp32.with_suffix(".pre.onnx")
    try:
        quant_pre_process(str(fp32), str(pre))
    except Exception as error:  # symbolic shape inference gives up on the torchscript DistilBERT's mask
        print(f"{fp32.name}: quantized without pre-processing ({type(error).__name__}: {error})")
        pre = fp32
    quantize_static(str(pre), str(out), Reader(), quant_format=QuantFormat.QOperator)


def build(out_dir: Path) -> list[Path]:
    import torch
    from torch import nn
    from transformers import DeiTConfig, DeiTModel, DistilBertConfig, DistilBertModel

    torch.manual_seed(0)
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    os.chdir(out_dir)  # the quantizer's shape inference leaves its scratch files in the working directory

    class Deit(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = DeiTModel(DeiTConfig(hidden_size=48, num_hidden_layers=3, num_attention_heads=3,
                                          intermediate_size=96, image_size=28, patch_size=7,
                                          attn_implementation="eager"))

        def forward(self, pixel_values):
            return self.m(pixel_values).last_hidden_state

    class Distil(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = DistilBertModel(DistilBertConfig(dim=96, n_layers=3, n_heads=6, hidden_dim=192, vocab_size=500,
                                                      attn_implementation="eager"))

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids, attention_mask).last_hidden_state

    def pixels(i):
        return {"pixel_values": np.random.default_rng(i).standard_normal((1, 3, 28, 28)).astype(np.float32)}

    def tokens(i):
        return {"input_ids": np.random.default_rng(i).integers(0, 500, (1, 24)).astype(np.int64),
                "attention_mask": np.ones((1, 24), np.int64)}

    made = []
    specs = [("deit.dyn", Deit(), True, pixels), ("distilbert.ts", Distil(), False, tokens)]
    for name, module, dynamo, sample in specs:
        module.eval()
        fp32 = out_dir / f"{name}.fp32.onnx"
        feeds = sample(0)
        _export(module, tuple(torch.from_numpy(v) for v in feeds.values()), list(feeds), fp32, dynamo)
        out = out_dir / f"{name}.int8_qoperator.onnx"
        _quantize(fp32, out, sample)
        np.savez(out_dir / f"{name}.feeds.npz", **feeds)
        made.append(out)
    return made


if __name__ == "__main__":
    for path in build(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/qoperator_transformers")):
        print(path)
