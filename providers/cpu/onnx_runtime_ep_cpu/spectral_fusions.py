"""A short-time Fourier transform's magnitude as torch's exporters write ``torch.stft(...).abs()`` for a model that
carries its Fourier basis as a convolution weight (silero-vad's STFT, every export of it):

    spectrum = Conv(frames_in, basis)                          (1-D, one input channel, no pads, stride = hop)
    real, imag = Slice(spectrum, rows of the real part), Slice(spectrum, rows of the imaginary part)   (axis 1)
    magnitude = Sqrt(Pow(real, 2) + Pow(imag, 2))              (or Mul(real, real) + Mul(imag, imag))

fused into one ``SpectralMagnitude`` step of this provider's domain (ops/spectrum.py): one product of the
frames, read in place through a strided view, by the selected basis rows, then the magnitude in place. A streaming
model runs these seven nodes per frame on a few columns, where each node's call costs more than its arithmetic.
The selected basis rows (real part first) are laid out here once, as the (2F, K) matrix the product reads.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Graph, Node
from onnx_runtime.optimizer.rewrite import add_initializer

from .fusions import FUSED_DOMAIN, GraphView, owned, until_fixed


def _squared(view: GraphView, name: str) -> tuple[Node, str] | None:
    """(the squaring node, what it squares) where ``name`` is Pow(a, 2) or Mul(a, a)."""
    node = view.producer.get(name)
    if node is None or node.domain or view.only_consumer(name, "Add") is None:
        return None
    if node.op_type == "Pow" and len(node.inputs) == 2 and view.scalar(node.inputs[1], 2.0):
        return node, node.inputs[0]
    if node.op_type == "Mul" and len(node.inputs) == 2 and node.inputs[0] == node.inputs[1]:
        return node, node.inputs[0]
    return None


def _rows(view: GraphView, node: Node, channels: int) -> range | None:
    """The channels a Slice of a (N, C, T) value keeps along axis 1, in order (step 1), or None."""
    if node.op_type != "Slice" or node.domain or len(node.inputs) < 3:
        return None
    values = [view.const(name) if name else None for name in node.inputs[1:5]]
    if any(v is None for v in values[:2]) or any(name and v is None for name, v in zip(node.inputs[3:5], values[2:])):
        return None
    starts, ends = (np.asarray(v).reshape(-1) for v in values[:2])
    axes = np.asarray(values[2]).reshape(-1) if len(values) > 2 and values[2] is not None else np.arange(starts.size)
    steps = np.asarray(values[3]).reshape(-1) if len(values) > 3 and values[3] is not None else np.ones_like(starts)
    if not (starts.size == ends.size == axes.size == steps.size == 1) or int(axes[0]) not in (1, -2) \
            or int(steps[0]) != 1:
        return None
    picked = range(channels)[slice(int(starts[0]), int(ends[0]))]
    return picked if len(picked) else None


def _basis_conv(view: GraphView, name: str) -> tuple[Node, np.ndarray, np.ndarray | None, int] | None:
    """(the Conv, its (M, 1, K) weight, its bias or None, its stride) where ``name`` is a 1-D one-input-channel
    convolution without pads or dilation by a constant float32 basis."""
    conv = view.producer.get(name)
    if conv is None or conv.op_type != "Conv" or conv.domain or len(conv.inputs) < 2:
        return None
    weight = view.const(conv.inputs[1])
    bias = view.const(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] else None
    if weight is None or weight.ndim != 3 or weight.shape[1] != 1 or weight.dtype != np.float32 \
            or (len(conv.inputs) > 2 and conv.inputs[2] and bias is None) or int(conv.attr("group", 1)) != 1:
        return None
    strides = [int(s) for s in conv.attr("strides", [1])]
    if any(int(p) for p in conv.attr("pads", [0, 0])) or any(int(d) != 1 for d in conv.attr("dilations", [1])) \
            or len(strides) != 1 or conv.attr("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET", "VALID", b"VALID"):
        return None
    kernel = conv.attr("kernel_shape")
    if kernel is not None and [int(k) for k in kernel] != [weight.shape[2]]:
        return None
    return conv, weight, bias, strides[0]


def _match(view: GraphView, sqrt: Node):
    """(the nodes, the convolution's input, its stride, the (2F, K) rows, their bias or None, the output)."""
    add = view.producer.get(sqrt.inputs[0]) if sqrt.inputs else None
    if add is None or add.op_type != "Add" or add.domain or len(add.inputs) != 2 \
            or view.only_consumer(add.outputs[0], "Sqrt") is not sqrt:
        return None
    squares = [_squared(view, name) for name in add.inputs]
    if squares[0] is None or squares[1] is None:
        return None
    slices = [view.producer.get(source) for _, source in squares]  # type: ignore[misc]
    if any(s is None for s in slices) or slices[0] is slices[1] or slices[0].inputs[0] != slices[1].inputs[0]:
        return None
    for square, source in squares:  # type: ignore[misc]
        readers = view.consumers.get(source, [])  # (Mul(a, a) reads it twice)
        if not readers or any(r is not square for r in readers) or source in view.outputs \
                or source in view.inner_reads:
            return None
    found = _basis_conv(view, slices[0].inputs[0])
    if found is None or view.consumers.get(slices[0].inputs[0], []) not in (slices, slices[::-1]) \
            or slices[0].inputs[0] in view.outputs or slices[0].inputs[0] in view.inner_reads:
        return None
    conv, weight, bias, stride = found
    rows = [_rows(view, piece, weight.shape[0]) for piece in slices]
    if rows[0] is None or rows[1] is None or len(rows[0]) != len(rows[1]):
        return None
    picked = [*rows[0], *rows[1]]
    basis = np.ascontiguousarray(weight[picked, 0, :])
    shift = None if bias is None else np.ascontiguousarray(bias.astype(np.float32)[picked].reshape(-1, 1))
    nodes = [conv, *slices, *(square for square, _ in squares), add, sqrt]  # type: ignore[misc]
    return nodes, conv.inputs[0], stride, basis, shift, sqrt.outputs[0]


def fuse_spectral_magnitudes(graph: Graph, owns=None) -> bool:
    view = GraphView(graph)
    for sqrt in list(graph.nodes):
        if sqrt.op_type != "Sqrt" or sqrt.domain:
            continue
        found = _match(view, sqrt)
        if found is None or not owned(owns, found[0]):
            continue
        nodes, source, stride, basis, shift, out = found
        base = f"{sqrt.name or out}/spectral_magnitude"
        names = [f"{base}_basis"] + ([] if shift is None else [f"{base}_bias"])
        if any(name in graph.initializers or name in graph.value_info for name in names):
            continue
        for name, array in zip(names, (basis, shift)):
            add_initializer(graph, name, array)
        fused = Node("SpectralMagnitude", [source, *names], [out], name=base, domain=FUSED_DOMAIN, opset=1,
                     attrs={"stride": int(stride)})
        _replace(graph, nodes, fused)
        return True
    return False


def _replace(graph: Graph, removed: list[Node], fused: Node) -> None:
    """``fused`` where the Sqrt was (after every node it replaces; its inputs come before the Conv)."""
    gone = {id(n) for n in removed}
    graph.nodes = [fused if n is removed[-1] else n for n in graph.nodes if id(n) not in gone or n is removed[-1]]


SPECTRAL_PASSES = [until_fixed(fuse_spectral_magnitudes)]
