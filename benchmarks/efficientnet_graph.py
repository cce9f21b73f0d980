"""EfficientNet-B0 (torchvision's layout: MBConv blocks with squeeze-and-excite and SiLU) as an ONNX graph with
random weights, written the way each torch exporter writes it, for the batch-32 CNN measurements (issue 26):
this machine has no torch, so the graph is built node by node.

    .venv/bin/python benchmarks/efficientnet_graph.py OUT_FOLDER [--size 64]

Both spellings fold BatchNormalization into the convolutions (as both exporters do in eval mode):

- torchscript: opset 17, SiLU as Sigmoid -> Mul(x, sigmoid), GlobalAveragePool, Flatten -> Gemm.
- dynamo: opset 20, SiLU as Sigmoid -> Mul(x, sigmoid), ReduceMean(axes) for the pooling, Reshape -> Gemm.
- swish: opset 24, SiLU as one Swish node (what a newer exporter or an optimizer emits).
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# torchvision's efficientnet_b0: (expand ratio, kernel, stride, in channels, out channels, layers)
STAGES = ((1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
          (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1))
SPELLINGS = {"torchscript": 17, "dynamo": 20, "swish": 24}


class _Builder:
    def __init__(self, spelling: str, seed: int):
        self.spelling, self.rng = spelling, np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.weights: list[onnx.TensorProto] = []
        self.count = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}_{self.count}"

    def weight(self, array: np.ndarray, stem: str) -> str:
        name = self.name(stem)
        self.weights.append(numpy_helper.from_array(array, name))
        return name

    def node(self, op: str, inputs: list[str], **attrs) -> str:
        out = self.name(op.lower())
        self.nodes.append(helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def conv(self, x: str, cin: int, cout: int, kernel: int, stride: int = 1, group: int = 1) -> str:
        # He-scaled weights keep the activations' magnitude steady through the depth.
        fan_in = cin // group * kernel * kernel
        w = (self.rng.standard_normal((cout, cin // group, kernel, kernel)) * np.sqrt(2.0 / fan_in)).astype(np.float32)
        b = (self.rng.standard_normal(cout) * 0.1).astype(np.float32)  # the folded BatchNormalization's shift
        pad = kernel // 2
        return self.node("Conv", [x, self.weight(w, "w"), self.weight(b, "b")], kernel_shape=[kernel, kernel],
                         strides=[stride, stride], pads=[pad] * 4, group=group, dilations=[1, 1])

    def silu(self, x: str) -> str:
        if self.spelling == "swish":
            return self.node("Swish", [x], alpha=1.0)
        return self.node("Mul", [x, self.node("Sigmoid", [x])])

    def pool(self, x: str) -> str:
        if self.spelling == "torchscript":
            return self.node("GlobalAveragePool", [x])
        axes = self.weight(np.array([2, 3], np.int64), "axes")
        return self.node("ReduceMean", [x, axes], keepdims=1)

    def block(self, x: str, expand: int, kernel: int, stride: int, cin: int, cout: int) -> str:
        hidden, squeeze = cin * expand, max(1, cin // 4)
        h = self.silu(self.conv(x, cin, hidden, 1)) if expand != 1 else x
        h = self.silu(self.conv(h, hidden, hidden, kernel, stride, group=hidden))
        s = self.silu(self.conv(self.pool(h), hidden, squeeze, 1))
        h = self.node("Mul", [h, self.node("Sigmoid", [self.conv(s, squeeze, hidden, 1)])])
        h = self.conv(h, hidden, cout, 1)
        return self.node("Add", [h, x]) if stride == 1 and cin == cout else h

    def model(self, size: int, classes: int) -> onnx.ModelProto:
        h = self.silu(self.conv("input", 3, 32, 3, 2))
        for expand, kernel, stride, cin, cout, layers in STAGES:
            for layer in range(layers):
                h = self.block(h, expand, kernel, stride if layer == 0 else 1, cin if layer == 0 else cout, cout)
        h = self.pool(self.silu(self.conv(h, 320, 1280, 1)))
        if self.spelling == "torchscript":
            h = self.node("Flatten", [h], axis=1)
        else:
            h = self.node("Reshape", [h, self.weight(np.array([-1, 1280], np.int64), "shape")])
        fc = (self.rng.standard_normal((classes, 1280)) / np.sqrt(1280)).astype(np.float32)
        h = self.node("Gemm", [h, self.weight(fc, "fc"), self.weight(np.zeros(classes, np.float32), "fc_b")],
                      transB=1)
        self.nodes[-1].output[0] = "logits"
        graph = helper.make_graph(
            self.nodes, f"efficientnet_b0_{self.spelling}",
            [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
            [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])], self.weights)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", SPELLINGS[self.spelling])])
        model.ir_version = 10
        return model


def efficientnet_b0(spelling: str, size: int = 64, classes: int = 1000, seed: int = 0) -> onnx.ModelProto:
    """EfficientNet-B0 in ``spelling`` (a key of SPELLINGS) for (batch, 3, size, size) images."""
    if spelling not in SPELLINGS:
        raise ValueError(f"spelling {spelling!r}: expected one of {sorted(SPELLINGS)}")
    return _Builder(spelling, seed).model(size, classes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="folder for efficientnet_b0.SPELLING.onnx")
    parser.add_argument("--size", type=int, default=64, help="image height and width")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for spelling in SPELLINGS:
        path = os.path.join(args.out, f"efficientnet_b0.{spelling}.onnx")
        onnx.save(efficientnet_b0(spelling, args.size), path)
        print(path)


if __name__ == "__main__":
    main()
