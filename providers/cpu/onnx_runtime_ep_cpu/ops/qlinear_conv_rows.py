"""QLinearConv's compiled path (ops/quantization.py): patch rows of the 8-bit input times the packed weight in
int32, requantized per output channel in one call (compiled/dynamic_conv.qlinear_conv). A quantized ViT's or
DeiT's patch embedding ran the exact float convolution of the centred codes and a requantizing pass.

Taken for group 1, explicit pads, 1-D and 2-D, 8-bit X and W, per-tensor X and Y parameters of the spec's types,
W's scale and zero point per tensor or per output channel, an int32 bias of one value per channel (or none);
every other input (and every error) goes through the general path, which checks it.
"""

from __future__ import annotations

import numpy as np

from ..algorithms.patch_geometry import patch_geometry
from ..algorithms.quantize import IntegerProduct, integer_range
from ..compiled.deferred import numpy_first

_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
_F32 = np.dtype(np.float32)
_NO_C = np.zeros(0, np.int32)


def _fits(x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero, bias) -> bool:
    channels = w.shape[0] if w.ndim else 0
    return (x.dtype in _EIGHT_BIT and w.dtype in _EIGHT_BIT and w.ndim in (3, 4) and y_zero.dtype in _EIGHT_BIT
            and x_zero.dtype == x.dtype and x_zero.size == 1 and w_zero.dtype == w.dtype
            and w_zero.size in (1, channels) and y_zero.size == 1 and x_scale.size == 1 and y_scale.size == 1
            and w_scale.size in (1, channels) and all(s.dtype == _F32 for s in (x_scale, w_scale, y_scale))
            and (bias is None or (bias.dtype == np.int32 and bias.size == channels)))


def _side(product, qgemm, x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero, bias) -> tuple | None:
    """The compiled call's arguments after the geometry: X's zero point, the packed weight and its pairs, C,
    the float64 multiplier the general path forms (x_scale * w_scale[m] / y_scale), Y's zero point and code
    range; then X's type. None where the call does not take these inputs."""
    if not _fits(x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero, bias):
        return None
    packed = product.packed(w.reshape(w.shape[0], -1).T, w_zero.reshape(-1))
    if packed is None:
        return None
    multiplier = x_scale.astype(np.float64).reshape(()) * w_scale.astype(np.float64).reshape(-1)
    low, high = integer_range(y_zero.dtype)
    return (int(x_zero.reshape(())), packed, qgemm.pairs_for(packed), _NO_C if bias is None else bias.reshape(-1),
            multiplier / float(y_scale.reshape(())), int(y_zero.reshape(())), low, high, x.dtype)


def patch_rows_conv(node):
    """A function of QLinearConv's inputs giving its output through the compiled call, or None where that call
    does not take them (and while numba loads in the background: the call's modules import it)."""
    auto_pad = node.attr("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if int(node.attr("group", 1)) != 1 or auto_pad != "NOTSET":
        return lambda *inputs: None
    product = IntegerProduct()
    last: list = [(), None]  # the constant parameters of the last call, then their side (or None)
    geometries: dict = {}  # per (X's shape, W's shape): patch_geometry's answer

    def fast(x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, bias=None):
        if numpy_first():
            return None
        from ..compiled import dynamic_conv, qgemm  # (found in sys.modules after the first call)

        params = (x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point, bias)
        seen, found = last
        if found is None or found[-1] != x.dtype or len(seen) != len(params) \
                or not all(a is b for a, b in zip(seen, params)):
            found = _side(product, qgemm, x, *params)
            if all(p is None or not p.flags.writeable for p in params):
                last[:] = [params, found]
        key = (x.shape, w.shape)
        geometry = geometries.get(key) if found is not None else None
        if geometry is None and found is not None:
            geometry = patch_geometry(node, x.shape, w.shape)
            if geometry is not None and len(geometries) < 16:
                geometries[key] = geometry
        if geometry is None:
            return None
        shape4, steps, out_shape, (oh, ow) = geometry
        out = np.empty(out_shape, y_zero_point.dtype)
        dynamic_conv.qlinear_conv(np.ascontiguousarray(x).reshape(shape4), found[0], *steps, oh, ow, *found[1:-1],
                                  out.reshape(out_shape[0], out_shape[1], oh * ow))
        return out

    return fast
