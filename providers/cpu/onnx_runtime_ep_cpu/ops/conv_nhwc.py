"""NhwcConv: a 2-D convolution of a channels-last (N, H, W, C) input into a channels-last (N, OH, OW, M) output,
Conv's attributes and (M, C / group, kh, kw) weights. transpose_sinking.py writes it for a Conv that reads
Transpose(x, (0, 3, 1, 2)) where a channels-last path serves its geometry (channels_last_path), so the Transposes
around it cancel with their neighbours':

- a patch convolution (kernel = stride, unpadded, undilated, one group: ConvNeXt's downsampling) is one product of
  its patches, which a reshape of the channels-last input gathers (each patch row is kw * C contiguous values);
- a float32 depthwise convolution of stride 1 is compiled/depthwise_nhwc's 16-lane rows (channels across the
  lanes, output pixels of a row in registers, the input read in place), but for rows of a few pixels on a small
  map;
- another depthwise convolution onto a small map is compiled/depthwise_small's channels-last pair sums, without
  the two layout changes the channels-first form makes around them.

Other geometries (a graph written elsewhere) run Conv's kernel between two transposes.
"""

from __future__ import annotations

import numpy as np

from ..compiled import takes as takes_compiled
from ..fused_domain import FUSED_DOMAIN
from ..registry import lookup, register

# Depthwise maps of up to this many output (and input) pixels may take the channels-last pair sums: on larger
# planes the channels-first loops (depthwise_rows' register tiles) outrun them even with the copies around them.
DEPTHWISE_PIXELS = 16
# The window widths compiled/depthwise_nhwc.py builds its calls for (its KERNEL_WIDTHS: planning does not import
# that module, which loads numba).
LANE_KERNEL_WIDTHS = (3, 5, 7)
# Output rows narrower than this keep the pair sums where both serve: a 16-lane call computes at least NARROW
# columns (compiled/depthwise_nhwc.py), most of them thrown away on a row of two pixels.
LANE_MIN_WIDTH = 4


def _geometry(x_shape, w_shape, attrs: dict):
    """(kernel, strides, dilations, pads (top, left, bottom, right), output (OH, OW)) of a 2-D channels-last
    convolution, or None for a shape that is not 4-D with static spatial sizes or an auto_pad."""
    if len(x_shape) != 4 or len(w_shape) != 4 or attrs.get("auto_pad", "NOTSET") not in ("NOTSET", b"NOTSET") \
            or not all(isinstance(d, int) for d in (*x_shape[1:], *w_shape)):
        return None
    kernel = tuple(int(k) for k in attrs.get("kernel_shape") or w_shape[2:])
    strides = tuple(int(s) for s in attrs.get("strides") or (1, 1))
    dilations = tuple(int(d) for d in attrs.get("dilations") or (1, 1))
    pads = tuple(int(p) for p in attrs.get("pads") or (0, 0, 0, 0))
    if len(kernel) != 2 or len(strides) != 2 or len(dilations) != 2 or len(pads) != 4:
        return None
    out = tuple((x_shape[1 + a] + pads[a] + pads[2 + a] - dilations[a] * (kernel[a] - 1) - 1) // strides[a] + 1
                for a in range(2))
    return kernel, strides, dilations, pads, out


def output_shape(x_shape, w_shape, attrs: dict) -> tuple | None:
    """NhwcConv's output shape (N, OH, OW, M) for these input and weight shapes, or None."""
    geometry = _geometry(x_shape, w_shape, attrs)
    return None if geometry is None else (x_shape[0], *geometry[4], w_shape[0])


def channels_last_path(x_shape, w_shape, attrs: dict, float32: bool = True) -> str | None:
    """"patch", "lanes" or "depthwise" where NhwcConv has a channels-last path for this geometry (x_shape
    channels-last) and element type (``float32``, or another: "lanes" serves float32 only), else None."""
    geometry = _geometry(x_shape, w_shape, attrs)
    if geometry is None:
        return None
    kernel, strides, dilations, pads, out = geometry
    group, channels = int(attrs.get("group", 1)), x_shape[3]
    if min(out) < 1 or dilations != (1, 1):
        return None
    if group == 1 and kernel == strides and not any(pads) and w_shape[1] == channels:
        return "patch"
    if group != channels or w_shape[0] != channels or w_shape[1] != 1:
        return None
    small = out[0] * out[1] <= DEPTHWISE_PIXELS and x_shape[1] * x_shape[2] <= DEPTHWISE_PIXELS
    if float32 and strides == (1, 1) and kernel[1] in LANE_KERNEL_WIDTHS and (out[1] >= LANE_MIN_WIDTH or not small):
        return "lanes"
    return "depthwise" if small else None


class _Constant:
    """A weight arrangement kept for the last constant (read-only) weight and bias it was made from."""

    def __init__(self, arrange):
        self.arrange, self.key, self.value = arrange, None, None

    def __call__(self, w: np.ndarray, b, dtype) -> np.ndarray:
        key = self.key
        if key is not None and key[0] is w and key[1] is b and self.value.dtype == dtype:
            return self.value
        value = np.ascontiguousarray(self.arrange(w, b), dtype=dtype)
        if not w.flags.writeable and (b is None or not b.flags.writeable):
            self.key, self.value = (w, b), value
        return value


def _patch_kernel(geometry, w_shape):
    (kh, kw), _, _, _, (oh, ow) = geometry
    m = w_shape[0]

    def arrange(w, b):
        """The weight's rows in the patches' (i, j, c) order, the bias (where given) as one more row."""
        rows = w.transpose(2, 3, 1, 0).reshape(-1, m)
        return rows if b is None else np.concatenate([rows, b.reshape(1, m).astype(rows.dtype)])

    weights = _Constant(arrange)

    dot = getattr(np.dot, "_implementation", np.dot)  # (its C function, without the array-function dispatch)

    def kernel(x, w, b=None):
        n, c = x.shape[0], x.shape[3]
        depth = kh * kw * c
        # the patches as rows, gathered by one copy of a view of x (and a column of ones for the bias)
        patches = np.empty((n * oh * ow, depth + (b is not None)), x.dtype)
        view = x[:, :oh * kh, :ow * kw].reshape(n, oh, kh, ow, kw, c).transpose(0, 1, 3, 2, 4, 5)
        np.copyto(patches[:, :depth].reshape(n, oh, ow, kh, kw, c), view)
        if b is not None:
            patches[:, depth] = 1
        return (dot(patches, weights(w, b, x.dtype)).reshape(n, oh, ow, m),)

    return kernel


def _depthwise_kernel(geometry, x_shape, fallback):
    from ..algorithms.bound_loop import EntryOnce
    from ..compiled import depthwise_small

    kernel_size, strides, dilations, pads, out = geometry
    pairs, starts = depthwise_small.window_pairs(x_shape[1:3], kernel_size, strides, dilations, pads[:2], out)
    # (taps * C) flat, and the bias (zeros for none)
    weights = _Constant(lambda w, b: w.reshape(w.shape[0], -1).T.reshape(-1))
    biases = _Constant(lambda w, b: np.zeros(w.shape[0]) if b is None else b)
    # the loop's entry point, bound once: its arguments keep their types from call to call
    loop = EntryOnce(depthwise_small.depthwise_pairs_nhwc)

    rest = tuple(x_shape[1:])
    # the last call's (w, b, dtype, arranged weights, bias): a model's constants repeat them every run
    kept: list = [(None, None, None, None, None)]

    def kernel(x, w, b=None):
        last = kept[0]
        if last[0] is w and last[1] is b and last[2] is x.dtype and x.flags.c_contiguous and x.shape[1:] == rest:
            y = np.empty((x.shape[0], *out, x.shape[3]), x.dtype)
            loop.run((x.reshape(-1), last[3], last[4], pairs, starts, y.reshape(-1)))
            return (y,)
        if not takes_compiled(x) or x.shape[1:] != rest:
            return fallback(x, w, b)
        arranged, bias = weights(w, None, x.dtype), biases(w, b, x.dtype)
        if not w.flags.writeable and (b is None or not b.flags.writeable):
            kept[0] = (w, b, x.dtype, arranged, bias)
        y = np.empty((x.shape[0], *out, x.shape[3]), x.dtype)
        loop.run((np.ascontiguousarray(x).reshape(-1), arranged, bias, pairs, starts, y.reshape(-1)))
        return (y,)

    return kernel


def _lanes_kernel(geometry, x_shape, small):
    """compiled/depthwise_nhwc's loop for float32 calls; others take ``small`` (the pair sums' kernel, where the map
    is small enough for them) or the fallback."""
    from ..algorithms.bound_loop import EntryOnce
    from ..compiled import deferred

    (kh, kw), _, _, pads, out = geometry
    module: list = []  # compiled/depthwise_nhwc (imports numba), at the first float32 call
    loop: list = []
    weights = _Constant(lambda w, b: w.reshape(w.shape[0], -1).T.reshape(-1))  # (kh * kw * C) flat
    biases = _Constant(lambda w, b: np.zeros(w.shape[0]) if b is None else b)
    geometry_arguments = (x_shape[1], x_shape[2], kh, kw, pads[0], pads[1], out[1])
    rest = tuple(x_shape[1:])
    # the last call's (w, b, arranged weights, bias, the loop's entry point bound): a model's constants repeat them
    kept: list = [(None, None, None, None, None)]

    def kernel(x, w, b=None):
        last = kept[0]
        if last[0] is w and last[1] is b and x.dtype is _FLOAT32 and x.flags.c_contiguous and x.shape[1:] == rest:
            y = np.empty((x.shape[0], *out, x.shape[3]), _FLOAT32)
            last[4](x, last[2], last[3], y, *geometry_arguments)
            return (y,)
        if x.dtype != _FLOAT32 or x.shape[1:] != rest:
            return small(x, w, b)
        if not module:
            from ..compiled import depthwise_nhwc

            module.append(depthwise_nhwc)
            loop.append(EntryOnce(depthwise_nhwc.depthwise_nhwc))
        arranged, bias = weights(w, None, x.dtype), biases(w, b, x.dtype)
        y = np.empty((x.shape[0], *out, x.shape[3]), x.dtype)
        arguments = (np.ascontiguousarray(x), arranged, bias, y, *geometry_arguments)
        compiled = module[0].depthwise_nhwc
        if deferred.state.deferring and not compiled.switched:  # numba loads in the background meanwhile
            compiled.expect(*arguments)
            return small(x, w, b)
        loop[0].run(arguments)
        entry = loop[0].entry  # (bound by that call: its arguments' types are those of every kept call)
        if entry is not None and not w.flags.writeable and (b is None or not b.flags.writeable):
            kept[0] = (w, b, arranged, bias, entry)
        return (y,)

    return kernel


_FLOAT32 = np.dtype(np.float32)


@register("NhwcConv", domain=FUSED_DOMAIN, since=1)
def nhwc_conv(node, shapes, opset):
    from onnx_runtime.ir import Node

    x_shape = tuple(shapes[0]) if shapes and shapes[0] is not None else ()
    w_shape = tuple(shapes[1]) if len(shapes) > 1 and shapes[1] is not None else ()
    nchw = (x_shape[0], x_shape[3], x_shape[1], x_shape[2]) if len(x_shape) == 4 else None
    conv = Node("Conv", list(node.inputs), list(node.outputs), name=node.name, attrs=dict(node.attrs), opset=11)
    made: list = []  # Conv's kernel for the channels-first view, made at the first call that needs it

    def fallback(x, w, b=None):
        if not made:
            made.append(lookup("Conv", "", 11)(conv, [nchw, *shapes[1:]], 11))
        y = made[0](x.transpose(0, 3, 1, 2), w, b)[0]
        return (np.ascontiguousarray(y.transpose(0, 2, 3, 1)),)

    path = channels_last_path(x_shape, w_shape, node.attrs) if x_shape and w_shape else None
    geometry = _geometry(x_shape, w_shape, node.attrs) if path else None
    if path == "patch":
        return _patch_kernel(geometry, w_shape)
    if path == "depthwise":
        return _depthwise_kernel(geometry, x_shape, fallback)
    if path == "lanes":
        small = channels_last_path(x_shape, w_shape, node.attrs, float32=False) == "depthwise"
        return _lanes_kernel(geometry, x_shape, _depthwise_kernel(geometry, x_shape, fallback) if small else fallback)
    return fallback
