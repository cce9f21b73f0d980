"""DynamicQuantizeMatMul with its Gelu and residual Add as an epilogue (dynamic_epilogues.fuse_dynamic_epilogues):
an int8_dynamic encoder's feed-forward product runs DynamicQuantizeMatMul -> Gelu, and its output products
DynamicQuantizeMatMul -> Add(residual), a node each over a small activation. Here the Gelu and the residual run
in place over the fresh product, by the loops the unfused Gelu and Add kernels use, so the bits are theirs."""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import InvalidGraphError

from ..algorithms.activations import gelu_erf, gelu_series, gelu_tanh
from ..algorithms.bound_loop import EntryOnce
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from .contrib_integer_matmul import dynamic_quantize_matmul

_F32 = np.dtype(np.float32)
# The activation attribute: the Gelu approximation it stands for (None: no activation), as FusedMatMul's.
APPROXIMATIONS = {"none": None, "gelu": "none", "gelu_tanh": "tanh"}


@register("DynamicQuantizeFusedMatMul", domain=FUSED_DOMAIN, since=1)
def dynamic_quantize_fused_matmul(node, shapes, opset):
    """Inputs: DynamicQuantizeMatMul's (A, B, b_scale, b_zero_point, bias; "" where absent), then the residual
    ("" where none). Attribute activation: none, gelu (erf form) or gelu_tanh. Output: the product, its Gelu, plus
    the residual."""
    from ..compiled import transformer as compiled

    activation = node.attr("activation", "none")
    if activation not in APPROXIMATIONS:
        raise InvalidGraphError(f"node {node.name!r} (DynamicQuantizeFusedMatMul): unknown activation {activation!r}")
    approximate = APPROXIMATIONS[activation]
    product = dynamic_quantize_matmul(node, shapes, opset)
    coefficients = None if approximate is None else gelu_series(approximate, _F32)
    exact = None if approximate is None else (gelu_erf if approximate == "none" else gelu_tanh)
    no_bias, no_residual = np.empty(0, _F32), np.empty((0, 0), _F32)
    bind = EntryOnce(compiled.gelu_float32_)  # (every call's arguments are 2-D float32 rows and these)

    def kernel(a, b, b_scale, b_zero_point=None, bias=None, residual=None):
        (y,) = product(a, b, b_scale, b_zero_point, bias)  # float32, C-contiguous, a fresh array
        if coefficients is not None and y.size:
            rows = compiled.as_rows(y)  # the Gelu kernel's rows: its loop, its bits
            skip = no_residual
            if residual is not None and residual.shape == y.shape and residual.dtype is _F32:
                skip, residual = np.ascontiguousarray(residual).reshape(rows.shape), None
            bind.run((rows, no_bias, rows, skip, coefficients))
        elif exact is not None:
            with np.errstate(over="ignore", invalid="ignore"):  # as the Gelu kernel
                y = exact(y).astype(_F32, copy=False)
        if residual is None:
            return (y,)
        if residual.shape == y.shape and residual.dtype is _F32:
            return (np.add(y, residual, out=y),)
        return (residual + y,)  # the Add kernel's broadcast and type rules

    return kernel
