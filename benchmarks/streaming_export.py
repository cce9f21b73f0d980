"""Small streaming models exported with both torch exporters, for benchmarks/spotter_bench.py.

    .venv-zoo/bin/python benchmarks/streaming_export.py [--out benchmarks/.models/streaming]

Each model is called once per frame (or token) with its recurrent state, as a streaming deployment calls it:

- ``kws_gru``: a keyword spotter, Conv1d over a 3-frame window of 40 log-mel features, ReLU, GRU(64), Linear,
  Softmax; state h (1, 1, 64).
- ``crnn_lstm``: a small CRNN, Conv2d + BatchNorm + ReLU + MaxPool over a (40, 3) spectrogram patch, Linear,
  LSTM(64), Linear, LogSoftmax; states h, c (1, 1, 64).
- ``lstm_lm``: a character language model's decode step, Embedding(96, 64), two-layer LSTM(128), Linear;
  states h, c (2, 1, 128).

TorchScript export: opset 17, ``dynamo=False``; dynamo export: ``dynamo=True`` at its default opset. Fixed shapes
(a streaming call has one frame). Weights are seeded, so the files are the same on every export.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn


class KeywordSpotter(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(40, 64, 3)
        self.gru = nn.GRU(64, 64)
        self.head = nn.Linear(64, 12)

    def forward(self, feats, h):
        x = torch.relu(self.conv(feats))  # (1, 64, 1)
        y, h_out = self.gru(x.permute(2, 0, 1), h)
        return torch.softmax(self.head(y[-1]), dim=-1), h_out


class SmallCRNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 16, 3, padding=(1, 0))
        self.norm = nn.BatchNorm2d(16)
        self.pool = nn.MaxPool2d((2, 1))
        self.proj = nn.Linear(16 * 20, 64)
        self.lstm = nn.LSTM(64, 64)
        self.head = nn.Linear(64, 30)

    def forward(self, patch, h, c):
        x = self.pool(torch.relu(self.norm(self.conv(patch))))  # (1, 16, 20, 1)
        x = self.proj(x.reshape(1, 1, 16 * 20))
        y, (h_out, c_out) = self.lstm(x, (h, c))
        return torch.log_softmax(self.head(y[-1]), dim=-1), h_out, c_out


class CharLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(96, 64)
        self.lstm = nn.LSTM(64, 128, num_layers=2)
        self.head = nn.Linear(128, 96)

    def forward(self, token, h, c):
        y, (h_out, c_out) = self.lstm(self.embed(token), (h, c))  # token (1, 1): one step, batch 1
        return self.head(y[-1]), h_out, c_out


# name: (module, {input: example shape}, outputs); an output X_out is the state fed back as input X
MODELS = {
    "kws_gru": (KeywordSpotter, {"feats": (1, 40, 3), "h": (1, 1, 64)}, ["probs", "h_out"]),
    "crnn_lstm": (SmallCRNN, {"patch": (1, 1, 40, 3), "h": (1, 1, 64), "c": (1, 1, 64)}, ["logp", "h_out", "c_out"]),
    "lstm_lm": (CharLM, {"token": (1, 1), "h": (2, 1, 128), "c": (2, 1, 128)}, ["logits", "h_out", "c_out"]),
}


def example(shapes: dict) -> tuple:
    generator = torch.Generator().manual_seed(1)
    return tuple(torch.randint(0, 96, shape, generator=generator) if name == "token"
                 else torch.randn(shape, generator=generator) for name, shape in shapes.items())


def export(name: str, exporter: str, out: Path) -> Path:
    factory, shapes, outputs = MODELS[name]
    torch.manual_seed(0)
    module = factory().eval()
    with torch.no_grad():
        for parameter in module.parameters():  # a trained model's spread, so gates leave their linear range
            parameter.mul_(2.0)
    path = out / f"{name}.{exporter}.onnx"
    args = example(shapes)
    with torch.no_grad():
        if exporter == "torchscript":
            torch.onnx.export(module, args, str(path), dynamo=False, opset_version=17, input_names=list(shapes),
                              output_names=outputs)
        else:
            program = torch.onnx.export(module, args, dynamo=True, input_names=list(shapes), output_names=outputs)
            program.save(str(path), external_data=False)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parent / ".models" / "streaming"))
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.models.split(","):
        for exporter in ("torchscript", "dynamo"):
            print(export(name, exporter, out))


if __name__ == "__main__":
    main()
