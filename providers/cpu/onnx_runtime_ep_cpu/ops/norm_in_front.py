"""The normalization a product reads its input through (norm_projections.py folds a LayerNormalization or
RMSNormalization into the FusedMatMul or ProjectionGroup that alone reads it): attribute ``normalize`` ("layer" or
"rms") and ``norm_epsilon``, the scale and shift as the reader's last two inputs.

A reader computes the normalization with the normalization node's own kernel (the same planned loop, the same
checks, the same errors) unless its product is a few rows bound with the normalization in front
(PackedProduct.bound's ``norm``): then both run as one compiled call."""

from __future__ import annotations

import numpy as np
from onnx_runtime.ir import Node

from ..registry import lookup
from ._common import graph_error

# Each kind: the operator whose kernel normalizes, and the opset it is looked up at.
KINDS = {"layer": ("LayerNormalization", 17), "rms": ("RMSNormalization", 23)}


class NormInFront:
    """A reader's normalization: ``self(x, scale, shift)`` is the normalization node's output for ``x``."""

    __slots__ = ("_kernel", "epsilon", "rms")

    def __init__(self, node, kind: str, shapes):
        op_type, opset = KINDS[kind]
        self.epsilon = float(node.attr("norm_epsilon", 1e-5))
        self.rms = kind == "rms"
        inputs = ["x", "scale"] if self.rms else ["x", "scale", "shift"]
        normalization = Node(op_type, inputs, [f"{node.name}/normalized"], name=f"{node.name}/normalization",
                             attrs={"axis": -1, "epsilon": self.epsilon}, opset=opset)
        factory = lookup(op_type, "", opset)
        if factory is None:  # (both are registered by this provider)
            raise graph_error(node, "normalize", f"names {op_type}, which this provider has no kernel for")
        self._kernel = factory(normalization, [shapes[0] if shapes else None], opset)

    def __call__(self, x: np.ndarray, scale: np.ndarray, shift: np.ndarray | None) -> np.ndarray:
        if self.rms:
            return self._kernel(x, scale)[0]
        return self._kernel(x, scale, shift)[0]

    def spec(self, scale: np.ndarray, shift: np.ndarray | None) -> tuple:
        """PackedProduct.bound's ``norm`` for these operands."""
        return (scale, shift, self.epsilon, self.rms)


def norm_in_front(node, shapes) -> NormInFront | None:
    """The normalization ``node`` reads its input through, or None where it reads it as it is."""
    kind = node.attr("normalize", "")
    if not kind:
        return None
    if kind not in KINDS:
        raise graph_error(node, "normalize", f"is {kind!r}; expected one of {sorted(KINDS)}")
    return NormInFront(node, kind, shapes)
