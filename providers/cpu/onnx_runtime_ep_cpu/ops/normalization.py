"""BatchNormalization (and FusedBatchNormalization, with its activation), InstanceNormalization,
LayerNormalization, GroupNormalization and LRN.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime import budget
from onnx_runtime.errors import InvalidArgumentError

from ..algorithms.bound_loop import EntryOnce
from ..algorithms.normalization import (
    affine_normalize,
    affine_params,
    batch_norm_stats,
    broadcasts_into,
    channel_affine_loop,
    layer_norm_compiles,
    lrn_compiled,
    per_channel_affine,
    standardize,
    standardize_rows,
)
from ..algorithms.precision import compute_dtype, upcast
from ..algorithms.prepared import Prepared
from ..compiled import COMPILED_DTYPES
from ..compiled import takes as takes_compiled
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import (
    activation_code,
    channel_param,
    frozen,
    graph_error,
    in_place_activation,
    normalize_axis,
    spatial_axes,
    stash_dtype,
)


def _batch_norm_kernel(node, training: bool, spatial: bool, fused_activation: bool = False):
    """BatchNormalization returning as many outputs as the node lists.

    Training mode normalizes with the batch statistics and returns the updated running mean/var
    (and, before opset 14, the batch mean/var). Inference mode passes the running statistics
    through for any optional outputs listed, as they do not change; for float32/float64 it is one
    compiled pass. With ``fused_activation`` (FusedBatchNormalization) it also applies the node's
    activation (inside that pass when compiled).
    """
    epsilon = float(node.attr("epsilon", 1e-5))
    momentum = float(node.attr("momentum", 0.9))
    n_outputs = len(node.outputs)
    prepared = Prepared()
    activate = in_place_activation(node) if fused_activation else None  # validates the activation
    affine = channel_affine_loop(activation_code(node) if fused_activation else (0, [0.0, 0.0]))

    def inference(x, scale, bias, mean, var):
        dtype = compute_dtype(x.dtype)
        if x.ndim >= 2 and all(p.shape == (x.shape[1],) for p in (scale, bias, mean, var)):
            factor, shift = prepared.get(dtype, (scale, bias, mean, var), lambda: affine_params(
                *(p.astype(dtype, copy=False) for p in (mean, var, scale, bias)), epsilon, dtype))
            if takes_compiled(x):
                return affine(x, factor, shift)
            y = per_channel_affine(x, factor, shift, dtype)
        else:
            s, b, mu, v = (channel_param(p, x.ndim, dtype) for p in (scale, bias, mean, var))
            y = affine_normalize(x, mu, v, s, b, epsilon, dtype)
        y = y.astype(x.dtype, copy=False)
        if activate is not None:
            activate(y)
        return y

    def kernel(x, scale, bias, mean, var):
        counts = (x.shape[1] if x.ndim >= 2 else 1, math.prod(x.shape[1:]) if not spatial else -1)
        for name, param in zip(("scale", "B", "input_mean", "input_var"), (scale, bias, mean, var)):
            if param.size not in counts:
                raise InvalidArgumentError(f"node {node.name!r} ({node.op_type}): input {name!r} has shape "
                                           f"{param.shape}; expected one value per channel of X {x.shape}")
        if not training:
            y = inference(x, scale, bias, mean, var)
            return (y, mean, var, mean, var)[:n_outputs]
        dtype = compute_dtype(x.dtype)
        s, b = (channel_param(p, x.ndim, dtype) for p in (scale, bias))
        axes = (0,) if not spatial else (0, *range(2, x.ndim))
        batch_mean, batch_var, run_mean, run_var = batch_norm_stats(
            x, axes, mean.astype(dtype), var.astype(dtype), momentum, dtype)
        y = affine_normalize(x, batch_mean[0], batch_var[0], s, b, epsilon, dtype)
        outputs = (y, run_mean, run_var, batch_mean.reshape(mean.shape), batch_var.reshape(var.shape))
        return tuple(t.astype(x.dtype, copy=False) for t in outputs[:n_outputs])

    kernel.bind = None if training else _inference_binder(prepared, affine, epsilon)
    return kernel


def _inference_binder(prepared, affine, epsilon: float):
    """An inference batch normalization's ``bind(inputs, outputs, constant)``: over constant per-channel parameters,
    the kernel's compiled pass into ``outputs[0]`` (a segment's bound plan, algorithms/segment_steps.py); None
    otherwise."""

    def bind(inputs, outputs, constant):
        if not _bindable(inputs, outputs, constant):
            return None
        x, y = inputs[0], outputs[0]
        scale, bias, mean, var = inputs[1:5]
        dtype = compute_dtype(x.dtype)
        factor, shift = prepared.get(dtype, (scale, bias, mean, var), lambda: affine_params(
            *(p.astype(dtype, copy=False) for p in (mean, var, scale, bias)), epsilon, dtype))
        return affine.bind(x, factor, shift, y)

    return bind


def _bindable(inputs, outputs, constant) -> bool:
    """Whether an inference batch normalization's inputs and output suit its bound pass: float32/float64 buffers
    of one shape, constant parameters of one value per channel."""
    x, y = inputs[0], outputs[0]
    return len(inputs) == 5 and all(constant[1:5]) and takes_compiled(x) and x.ndim >= 2 and y.shape == x.shape \
        and y.dtype == x.dtype and x.flags.c_contiguous and y.flags.c_contiguous \
        and all(p is not None and p.shape == (x.shape[1],) for p in inputs[1:5])


@register("FusedBatchNormalization", domain=FUSED_DOMAIN, since=1)
def fused_batch_normalization(node, shapes, opset):
    """Inference BatchNormalization, then an activation in place on its fresh output."""
    normalize = _batch_norm_kernel(node, training=False, spatial=True, fused_activation=True)

    def kernel(x, scale, bias, mean, var):
        return normalize(x, scale, bias, mean, var)[:1]

    kernel.bind = normalize.bind
    return kernel


def _lists_training_outputs(node) -> bool:
    return any(node.outputs[1:])


@register("BatchNormalization", since=1)
def batch_normalization_1(node, shapes, opset):
    # Before opset 14 training mode is implied by naming the optional statistics outputs (opset < 7
    # also requires is_test=0); plain inference ignores is_test, which old exporters left unset.
    training = _lists_training_outputs(node) and not int(node.attr("is_test", 0))
    return _batch_norm_kernel(node, training=training, spatial=bool(node.attr("spatial", 1)))


@register("BatchNormalization", since=9)
def batch_normalization_9(node, shapes, opset):
    return _batch_norm_kernel(node, training=_lists_training_outputs(node), spatial=True)


@register("BatchNormalization", since=14)
def batch_normalization_14(node, shapes, opset):
    return _batch_norm_kernel(node, training=bool(node.attr("training_mode", 0)), spatial=True)


@register("InstanceNormalization", since=1)
def instance_normalization(node, shapes, opset):
    epsilon = float(node.attr("epsilon", 1e-5))
    from ..compiled import transformer as compiled
    # Ones for the compiled row loop's per-column scale, kept per row length: (length, ones). The node's own scale
    # and bias are per channel, that is per row, and are applied after, unless they are the constants 1 and 0
    # (GroupNorm as the TorchScript exporter writes it: InstanceNormalization of ones and zeros between
    # Reshapes, its affine in a Mul and an Add after): kept as (scale, bias, whether they are).
    ones: tuple = (0, None)
    identity: tuple = (None, None, False)

    def by_rows(x, scale, bias):
        """Each (image, channel) plane a row of the compiled LayerNormalization loop (one pass for the statistics
        and one for the output), where numpy's standardize runs a pass per operation."""
        nonlocal ones, identity
        n, c = x.shape[0], x.shape[1]
        rows = x.reshape(n * c, -1)
        length, unit = ones
        if length != rows.shape[1]:
            unit = np.ones(rows.shape[1], x.dtype)
            ones = (rows.shape[1], unit)
        y, _, _ = compiled.layer_norm(rows, unit, None, epsilon)
        held_scale, held_bias, trivial = identity
        if held_scale is not scale or held_bias is not bias:
            trivial = bool(np.all(scale == 1) and np.all(bias == 0))
            if frozen(scale) and frozen(bias):
                identity = (scale, bias, trivial)
        if not trivial:
            planes = y.reshape(n, c, -1)
            planes *= scale.reshape(c, 1)
            planes += bias.reshape(c, 1)
        return (y.reshape(x.shape),)

    def kernel(x, scale, bias):
        if x.ndim >= 3 and x.size and takes_compiled(x) and x.flags.c_contiguous and scale.dtype == x.dtype \
                and bias.dtype == x.dtype and scale.shape == bias.shape == (x.shape[1],):
            return by_rows(x, scale, bias)
        dtype = compute_dtype(x.dtype)
        normalized, _, _ = standardize(x.astype(dtype, copy=False), spatial_axes(x), epsilon)
        y = normalized * channel_param(scale, x.ndim, dtype) + channel_param(bias, x.ndim, dtype)
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("LayerNormalization", since=17)
def layer_normalization(node, shapes, opset):
    epsilon = float(node.attr("epsilon", 1e-5))
    axis = int(node.attr("axis", -1))
    stash = stash_dtype(node)
    n_outputs = len(node.outputs)
    from ..compiled import transformer as compiled

    def kernel(x, scale, bias=None):
        start = normalize_axis(node, axis, x.ndim)
        stats_shape = x.shape[:start] + (1,) * (x.ndim - start)
        if layer_norm_compiles(x, scale, bias, start, stash):
            rows = np.ascontiguousarray(x).reshape(math.prod(x.shape[:start]), -1)
            y, mean, inv_std = compiled.layer_norm(rows, np.ascontiguousarray(scale).reshape(-1),
                                                   None if bias is None else np.ascontiguousarray(bias).reshape(-1),
                                                   epsilon)
            return (y.reshape(x.shape), mean.reshape(stats_shape), inv_std.reshape(stats_shape))[:n_outputs]
        xs = x.astype(stash, copy=False)
        if stash in (np.float32, np.float64):
            rows = xs.reshape(math.prod(x.shape[:start]), math.prod(x.shape[start:]))
            normalized, mean, inv_std = standardize_rows(rows, epsilon)
        else:  # half-precision statistics, as the spec computes them (numpy has no BLAS for them)
            normalized, mean, inv_std = standardize(xs, tuple(range(start, x.ndim)), epsilon)
        # Scale and shift happen in x's precision, after casting back (the spec's second stage).
        y = normalized.astype(x.dtype, copy=False).reshape(x.shape)
        for param, apply in ((scale, np.multiply), (bias, np.add)):
            if param is not None:
                y = apply(y, param, out=y) if broadcasts_into(param.shape, y.shape) else apply(y, param)
        return (y.astype(x.dtype, copy=False), mean.reshape(stats_shape), inv_std.reshape(stats_shape))[:n_outputs]

    return _layer_norm_for_shape(node, shapes, axis, epsilon, stash, kernel) or kernel


def _layer_norm_for_shape(node, shapes, axis: int, epsilon: float, stash, general):
    """LayerNormalization for the one input shape the kernel is made for (a planned shape): the compiled loop
    over its rows with the axis, row count and output shapes decided here, where working them out per call
    cost a small model's normalization several times its arithmetic. Other shapes, dtypes or layouts go to
    ``general``. None where the shape is not known or the compiled loop does not apply."""
    x_shape = shapes[0] if shapes else None
    dtype = np.dtype(stash)
    if not x_shape or not all(isinstance(d, int) and d > 0 for d in x_shape) or dtype not in COMPILED_DTYPES \
            or not -len(x_shape) <= axis < len(x_shape):  # (a bad axis: the general kernel says so per call)
        return None
    from ..compiled import transformer as compiled

    start = normalize_axis(node, axis, len(x_shape))
    rows, cols = math.prod(x_shape[:start]), math.prod(x_shape[start:])
    stats_shape = x_shape[:start] + (1,) * (len(x_shape) - start)
    params = x_shape[start:]
    loop, no_bias, outputs = compiled.layer_norm_rows, np.empty(0, dtype), len(node.outputs)
    flat = len(params) == 1  # scale and bias are read as they are
    # Y alone wanted: the loop's statistics go to scratch nobody reads (threads running this node at once may
    # write it together, harmlessly); allocating and reshaping them cost a short sequence's LayerNorm as much
    # as its arithmetic. Made at the first call whose input has the planned shape, not here: a declared shape
    # can be far larger than any feed (the budget sees feeds and outputs, not what a kernel's build sizes).
    scratch: list[np.ndarray] = []
    # Y alone, flat parameters: the loop's entry point, bound at the first call of constant scale and bias (the same
    # read-only arrays every run) and called while they are those (every other argument made here, C-contiguous):
    # numba's typing of its seven arguments cost a decode step's normalization a third of its call.
    bind, constants = EntryOnce(loop), [None, None]

    def kernel(x, scale, bias=None):
        if x.shape != x_shape or x.dtype is not dtype or scale.dtype is not dtype or scale.shape != params \
                or (bias is not None and (bias.dtype is not dtype or bias.shape != params)):
            return general(x, scale, bias)
        if not x.flags.c_contiguous:  # (a channels-last view of an NCHW map, ConvNeXt's: one copy, not general's path)
            x = np.ascontiguousarray(x)
        y = np.empty((rows, cols), dtype)
        if not flat:
            scale, bias = scale.reshape(cols), None if bias is None else bias.reshape(cols)
        if outputs == 1:
            if not scratch:
                scratch.append(np.empty(rows, dtype))
            arguments = (x.reshape(rows, cols), scale, no_bias if bias is None else bias, epsilon, y, scratch[0],
                         scratch[0])
            if scale is constants[0] and bias is constants[1]:
                bind.run(arguments)
            else:
                loop(*arguments)
                if flat and _constant(scale) and (bias is None or _constant(bias)):
                    constants[:] = [scale, bias]
            return (y.reshape(x_shape),)
        mean, inv_std = np.empty(stats_shape, dtype), np.empty(stats_shape, dtype)
        loop(x.reshape(rows, cols), scale, no_bias if bias is None else bias, epsilon, y, mean.reshape(rows),
             inv_std.reshape(rows))
        return (y.reshape(x_shape), mean, inv_std)[:outputs]

    return kernel


def _constant(param: np.ndarray) -> bool:
    """Whether ``param`` is a C-contiguous read-only array (an initializer: the same values on every run)."""
    return param.flags.c_contiguous and not param.flags.writeable


def _group_norm_kernel(node, per_group_params: bool, stash: np.dtype | None):
    epsilon = float(node.attr("epsilon", 1e-5))
    groups = node.attr("num_groups")
    if groups is None or int(groups) < 1:
        raise graph_error(node, "num_groups", f"is {groups}; expected a positive group count")
    groups = int(groups)

    def kernel(x, scale, bias):
        n, c = x.shape[:2]
        if c % groups:
            raise InvalidArgumentError(
                f"node {node.name!r} (GroupNormalization): {c} channels do not split into "
                f"num_groups={groups} equal groups"
            )
        grouped = x.astype(stash or compute_dtype(x.dtype)).reshape(n, groups, -1)
        normalized, _, _ = standardize(grouped, (2,), epsilon)
        normalized = normalized.reshape(x.shape).astype(x.dtype)
        if per_group_params:
            scale, bias = (np.repeat(p, c // groups) for p in (scale, bias))
        y = normalized * channel_param(scale, x.ndim, x.dtype) + channel_param(bias, x.ndim, x.dtype)
        return (y.astype(x.dtype, copy=False),)

    return kernel


@register("GroupNormalization", since=18)
def group_normalization_18(node, shapes, opset):
    # Opset 18 takes scale/bias per group and has no stash_type (half precision computes in float32).
    return _group_norm_kernel(node, per_group_params=True, stash=None)


@register("GroupNormalization", since=21)
def group_normalization_21(node, shapes, opset):
    return _group_norm_kernel(node, per_group_params=False, stash=stash_dtype(node))


@register("LRN", since=1)
def lrn(node, shapes, opset):
    size = node.attr("size")
    if size is None or int(size) < 1:
        raise graph_error(node, "size", f"is {size}; expected a positive channel window size")
    size = int(size)
    alpha = float(node.attr("alpha", 1e-4))
    beta = float(node.attr("beta", 0.75))
    bias = float(node.attr("bias", 1.0))
    before = (size - 1) // 2  # the window over channels is [c - before, c - before + size)
    from ..compiled import lrn as loops  # numba loads only for models with LRN

    def kernel(x):
        if x.ndim < 2:
            raise InvalidArgumentError(f"node {node.name!r} (LRN): X has shape {x.shape}; expected (N, C, ...)")
        if takes_compiled(x) and x.ndim >= 3 and x.size:
            return (lrn_compiled(loops, x, size, before, alpha, beta, bias),)
        xc = upcast(x)
        budget.check_shape((x.shape[0], x.shape[1] + size - 1, *x.shape[2:]), 8, "LRN's padded squares")
        squares = np.zeros((x.shape[0], x.shape[1] + size - 1, *x.shape[2:]), dtype=xc.dtype)
        np.square(xc, out=squares[:, before:before + x.shape[1]])
        total = squares[:, : x.shape[1]].copy()
        for offset in range(1, size):
            total += squares[:, offset:offset + x.shape[1]]
        y = xc / np.power(bias + (alpha / size) * total, beta)
        return (y.astype(x.dtype, copy=False),)

    return kernel
