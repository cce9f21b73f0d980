"""onnxruntime's contrib layer normalizations: SkipLayerNormalization, SkipSimplifiedLayerNormalization and
EmbedLayerNormalization (domain com.microsoft, docs/ContribOperators.md), and SimplifiedLayerNormalization
(RMS normalization), which onnxruntime registers and its optimizer emits in the default ONNX domain.

Half-precision inputs compute in float32 (the statistics always do) and are rounded once, at the outputs;
the statistics outputs (mean, inv_std_var) are float32 as the specs type them.
"""

from __future__ import annotations

import math
import types

import numpy as np

from ..algorithms.kept_call import KeptCall
from ..algorithms.normalization import broadcasts_into, layer_norm_compiles, standardize_rows
from ..algorithms.precision import compute_dtype
from ..compiled.deferred import numpy_first, tried
from ..registry import register
from ._common import CONTRIB_DOMAIN, argument_error, graph_error, normalize_axis, stash_dtype

_F32 = np.dtype(np.float32)
# The contrib kernels' default epsilon for the Skip/Embed normalizations (their schemas' default).
_CONTRIB_EPSILON = 1e-12


def _epsilon(node, default: float) -> float:
    epsilon = float(node.attr("epsilon", default))
    if epsilon < 0 or math.isnan(epsilon):
        raise graph_error(node, "epsilon", f"is {epsilon}; expected a non-negative value")
    return epsilon


def _rms_rows(rows: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """(rows * inv_rms, inv_rms) over a 2-D array's rows: inv_rms = 1 / sqrt(mean(x^2) + epsilon)."""
    mean_square = np.einsum("ij,ij->i", rows, rows)[:, None]
    mean_square /= max(rows.shape[1], 1)
    mean_square += rows.dtype.type(epsilon)
    inv = np.reciprocal(np.sqrt(mean_square, out=mean_square), out=mean_square)
    return rows * inv, inv


def _vector(node, name: str, value, size: int, dtype) -> np.ndarray | None:
    """A (hidden,) parameter in ``dtype`` (None when omitted)."""
    if value is None:
        return None
    if value.shape != (size,):
        raise argument_error(node, f"{name} has shape {value.shape}; expected ({size},), the hidden size")
    return value.astype(dtype, copy=False)


# -- SkipLayerNormalization / SkipSimplifiedLayerNormalization ----------------------------------


def _skip_sum(node, x, skip, bias, dtype) -> np.ndarray:
    """input + skip (+ bias) as a fresh (rows, hidden) array of ``dtype``."""
    if x.ndim not in (2, 3) or skip.shape[-1:] != x.shape[-1:] or not broadcasts_into(skip.shape, x.shape):
        raise argument_error(node, f"input {x.shape} and skip {skip.shape} do not fit; expected a 2-D or 3-D input "
                             f"and a skip of its shape, (1, S, H) or (S, H)")
    total = x.astype(dtype)
    total += skip.astype(dtype, copy=False)
    if bias is not None:
        total += _vector(node, "bias", bias, x.shape[-1], dtype)
    return total.reshape(-1, x.shape[-1])


def _skip_outputs(node, x, y, mean, inv, total) -> tuple:
    """(output, mean, inv_std_var, input_skip_bias_sum), as many as the node lists."""
    stats = x.shape[:-1] + (1,)
    outputs = (y.reshape(x.shape).astype(x.dtype, copy=False), mean.reshape(stats).astype(_F32, copy=False),
               inv.reshape(stats).astype(_F32, copy=False), total.reshape(x.shape).astype(x.dtype, copy=False))
    return outputs[:len(node.outputs)]


@register("SkipLayerNormalization", domain=CONTRIB_DOMAIN, since=1)
def skip_layer_normalization(node, shapes, opset):
    """LayerNorm(input + skip + bias) * gamma + beta over the hidden axis."""
    epsilon = _epsilon(node, _CONTRIB_EPSILON)

    def kernel(x, skip, gamma, beta=None, bias=None):
        dtype = compute_dtype(x.dtype)
        total = _skip_sum(node, x, skip, bias, dtype)
        normalized, mean, inv = standardize_rows(total, epsilon)
        normalized *= _vector(node, "gamma", gamma, x.shape[-1], dtype)
        if beta is not None:
            normalized += _vector(node, "beta", beta, x.shape[-1], dtype)
        return _skip_outputs(node, x, normalized, mean, inv, total)

    return kernel


@register("SkipSimplifiedLayerNormalization", domain=CONTRIB_DOMAIN, since=1)
def skip_simplified_layer_normalization(node, shapes, opset):
    """RMSNorm(input + skip + bias) * gamma. RMS normalization has no mean: that optional output is zeros
    (as onnxruntime's kernel leaves it)."""
    epsilon = _epsilon(node, _CONTRIB_EPSILON)

    def kernel(x, skip, gamma, bias=None):
        dtype = compute_dtype(x.dtype)
        total = _skip_sum(node, x, skip, bias, dtype)
        normalized, inv = _rms_rows(total, epsilon)
        normalized *= _vector(node, "gamma", gamma, x.shape[-1], dtype)
        return _skip_outputs(node, x, normalized, np.zeros_like(inv), inv, total)

    return kernel


# -- SimplifiedLayerNormalization ----------------------------------------------------------------


@register("SimplifiedLayerNormalization", since=1)
def simplified_layer_normalization(node, shapes, opset):
    """X / sqrt(mean(X^2 over axis..) + epsilon) * scale, the statistics in stash_type; Y has scale's dtype
    (onnxruntime's schema types it so), inv_std_var the stash type, shaped X.shape[:axis] + (1, ...)."""
    epsilon = _epsilon(node, 1e-5)
    axis = int(node.attr("axis", -1))
    stash = stash_dtype(node)
    if stash not in (np.float32, np.float64):
        raise graph_error(node, "stash_type", f"is {node.attr('stash_type')}; expected 1 (float) or 11 (double)")

    def kernel(x, scale):
        start = normalize_axis(node, axis, x.ndim)
        normalized_shape = x.shape[start:]
        if not broadcasts_into(scale.shape, normalized_shape):
            raise argument_error(node, f"scale has shape {scale.shape}; expected a suffix of the normalized shape "
                                 f"{normalized_shape}")
        rows = x.astype(stash).reshape(math.prod(x.shape[:start]), -1)
        normalized, inv = _rms_rows(rows, epsilon)
        dtype = np.result_type(stash, compute_dtype(scale.dtype))
        y = normalized.reshape(x.shape).astype(dtype, copy=False) * scale.astype(dtype, copy=False)
        stats = x.shape[:start] + (1,) * (x.ndim - start)
        return (y.astype(scale.dtype, copy=False), inv.reshape(stats))[:len(node.outputs)]

    return kernel


# -- EmbedLayerNormalization ---------------------------------------------------------------------


def _lookup(node, name: str, table, ids) -> np.ndarray:
    """table[ids], every id checked to lie inside the table."""
    ids = np.asarray(ids)
    # One reduction checks both ends: seen unsigned, a negative id is larger than any table's row count.
    unsigned = ids.view(ids.dtype.str.replace("i", "u")) if ids.dtype.kind == "i" else ids
    if ids.size and unsigned.max() >= table.shape[0]:
        raise argument_error(node, f"{name} hold values up to {ids.max()} (min {ids.min()}); expected ids in "
                             f"[0, {table.shape[0]}), the rows of its embedding table")
    return table[ids]


def _embedding_sum(node, input_ids, segment_ids, word, position, segment, position_ids, dtype):
    """word[input_ids] + position[position_ids or 0..S-1] (+ segment[segment_ids]), (B, S, H) in ``dtype``."""
    if input_ids.ndim != 2:
        raise argument_error(node, f"input_ids has shape {input_ids.shape}; expected (batch, sequence)")
    batch, steps = input_ids.shape
    if word.ndim != 2 or position.shape[1:] != word.shape[1:] or (segment is not None and
                                                                   segment.shape[1:] != word.shape[1:]):
        raise argument_error(node, "word, position and segment embeddings must be 2-D tables of one hidden size")
    if (segment_ids is None) != (segment is None):
        raise argument_error(node, "segment_ids and segment_embedding must be given together")
    if position_ids is None:
        if steps > position.shape[0]:
            raise argument_error(node, f"input_ids has {steps} positions; the position embedding table has "
                                 f"{position.shape[0]} rows")
        positions = position[:steps]  # positions 0 .. S-1 of every batch entry
    elif position_ids.shape not in ((batch, steps), (1, steps)):
        raise argument_error(node, f"position_ids has shape {position_ids.shape}; expected ({batch}, {steps}) or "
                             f"(1, {steps})")
    else:
        positions = _lookup(node, "position_ids", position, position_ids)
    total = _lookup(node, "input_ids", word, input_ids).astype(dtype, copy=False)  # (a fresh array: the lookup's)
    total += positions.astype(dtype, copy=False)
    if segment is not None:
        if segment_ids.shape != input_ids.shape:
            raise argument_error(node, f"segment_ids has shape {segment_ids.shape}; expected {input_ids.shape}")
        total += _lookup(node, "segment_ids", segment, segment_ids).astype(dtype, copy=False)
    return total


_NO_ROWS = {np.dtype(np.float32): np.empty((0, 0), np.float32), np.dtype(np.float64): np.empty((0, 0), np.float64)}
_NO_IDS = np.empty((0, 0), np.int32)


def _compiled_takes(input_ids, segment_ids, word, position, segment, position_ids, mask, dtype) -> bool:
    """Whether compiled/embedding.py takes these inputs: tables C-contiguous float32/float64 of the compute
    dtype, positions 0 .. S-1, ids and mask integers of the input's shape (else _embedding_sum decides and
    reports)."""
    empty = _NO_ROWS.get(dtype)
    if empty is None or position_ids is not None or input_ids.ndim != 2 or word.dtype != dtype \
            or position.dtype != dtype or word.ndim != 2 or position.ndim != 2 \
            or position.shape[1] != word.shape[1] or input_ids.shape[1] > position.shape[0] \
            or input_ids.dtype.kind != "i" or (segment is None) != (segment_ids is None) \
            or not (word.flags.c_contiguous and position.flags.c_contiguous) \
            or (mask is not None and (mask.shape != input_ids.shape or mask.dtype.kind != "i")):
        return False
    return segment is None or (segment.dtype == dtype and segment.ndim == 2 and segment.shape[1] == word.shape[1]
                               and segment_ids.shape == input_ids.shape and segment_ids.dtype.kind == "i"
                               and segment.flags.c_contiguous)


def _compiled_sum(input_ids, segment_ids, word, position, segment, position_ids, mask, dtype) -> tuple | None:
    """(_embedding_sum's result, the mask_index output) from compiled/embedding.py where _compiled_takes;
    None where _embedding_sum must decide (and report)."""
    if not _compiled_takes(input_ids, segment_ids, word, position, segment, position_ids, mask, dtype) \
            or numpy_first():
        return None
    empty = _NO_ROWS[dtype]
    from ..compiled.embedding import embedding_sum_

    total = np.empty(input_ids.shape + word.shape[1:], dtype)
    counts = np.zeros(input_ids.shape[0], np.int32)
    found = embedding_sum_(input_ids, word, position, _NO_IDS if segment_ids is None else segment_ids,
                           empty if segment is None else segment, _NO_IDS if mask is None else mask, total, counts)
    return (total, counts) if found < 0 else None


def fused_embed_norm(input_ids, segment_ids, word, position, segment, gamma, beta, mask, position_ids,
                      epsilon: float, kept: KeptCall | None = None) -> tuple | None:
    """(normalized, mask_index, embedding_sum) from compiled/embedding.embed_layer_norm_, one call for the
    lookups, the sum and the normalization, where the compiled loops take the inputs and gamma and beta are
    (hidden,) of the tables' dtype; None where the kernel's general path decides (and reports). A call that
    ran whole is kept in ``kept`` for _embed_repeat."""
    dtype = word.dtype
    hidden = word.shape[-1] if word.ndim == 2 else -1
    if not _compiled_takes(input_ids, segment_ids, word, position, segment, None, mask, dtype) \
            or (position_ids is not None and (position_ids.dtype.kind != "i" or position_ids.ndim != 2
                                              or position_ids.shape[1:] != input_ids.shape[1:]
                                              or position_ids.shape[0] not in (1, input_ids.shape[0]))) \
            or gamma.shape != (hidden,) or gamma.dtype != dtype or not gamma.flags.c_contiguous \
            or (beta is not None and (beta.shape != (hidden,) or beta.dtype != dtype or not beta.flags.c_contiguous)) \
            or not input_ids.size or numpy_first():
        return None
    from ..compiled.embedding import embed_layer_norm_

    batch, steps = input_ids.shape
    total, out, counts, mean, inv_std = _embed_outputs(batch, steps, hidden, dtype)
    arguments = (input_ids, word, position, _NO_IDS if position_ids is None else position_ids,
                 _NO_IDS if segment_ids is None else segment_ids, _NO_ROWS[dtype] if segment is None else segment,
                 _NO_IDS if mask is None else mask, gamma, _NO_ROWS[dtype][0] if beta is None else beta, epsilon, total,
                 out, counts, mean, inv_std)
    found = embed_layer_norm_(*arguments)
    if kept is not None and found < 0:  # (the omitted inputs' stand-ins, the segment table, beta and epsilon)
        kept.keep((word, position, segment, gamma, beta), (input_ids, segment_ids, mask, position_ids),
                  (embed_layer_norm_, *(arguments[i] for i in (3, 4, 5, 6, 8, 9))))
    return (out, counts, total) if found < 0 else None


def _embed_outputs(batch: int, steps: int, hidden: int, dtype) -> tuple:
    """(total, out, counts, mean, inv_std) for embed_layer_norm_: the float ones views of one fresh buffer."""
    rows = batch * steps
    size = rows * hidden
    floats = np.empty(2 * size + 2 * rows, dtype)
    return (floats[:size].reshape(batch, steps, hidden), floats[size:2 * size].reshape(batch, steps, hidden),
            np.zeros(batch, np.int32), floats[2 * size:2 * size + rows], floats[2 * size + rows:])


def _embed_repeat(kept: KeptCall, input_ids, segment_ids, word, position, segment, gamma, beta, mask,
                  position_ids) -> tuple | None:
    """fused_embed_norm's result for a call repeating the kept one (the same tables, gamma and beta, fed ids and
    mask of the same kinds): the compiled loop straight away; None for any other call or an id outside its table."""
    found = kept.match((word, position, segment, gamma, beta), (input_ids, segment_ids, mask, position_ids))
    if found is None:
        return None
    loop, no_positions, no_segments, table, no_mask, beta_row, epsilon = found
    batch, steps = input_ids.shape
    total, out, counts, mean, inv_std = _embed_outputs(batch, steps, word.shape[1], word.dtype)
    if loop(input_ids, word, position, no_positions if position_ids is None else position_ids,
             no_segments if segment_ids is None else segment_ids, table, no_mask if mask is None else mask, gamma,
             beta_row, epsilon, total, out, counts, mean, inv_std) >= 0:
        return None
    return out, counts, total


@register("EmbedLayerNormalization", domain=CONTRIB_DOMAIN, since=1)
def embed_layer_normalization(node, shapes, opset):
    """LayerNorm(word + position (+ segment) embeddings) * gamma + beta; mask_index counts each row's ones
    in mask (zeros without a mask); embedding_sum is the sum before normalization."""
    epsilon = _epsilon(node, _CONTRIB_EPSILON)

    from ..compiled import transformer as compiled

    # The compiled calls run in a Trial until one after deferral ran whole: a loop numba's cache misses then
    # goes to the loader's child while the numpy path serves (no compile on a run's thread).
    ran = types.SimpleNamespace(fused=False, summed=False)

    kept = KeptCall()  # the last compiled call that ran whole, once the loop has run after deferral

    def kernel(input_ids, segment_ids, word_embedding, position_embedding, segment_embedding, gamma, beta,
               mask=None, position_ids=None):
        fused = _embed_repeat(kept, input_ids, segment_ids, word_embedding, position_embedding, segment_embedding,
                              gamma, beta, mask, position_ids)
        if fused is not None:
            return fused[:len(node.outputs)]
        dtype = compute_dtype(word_embedding.dtype)
        if dtype == word_embedding.dtype:
            arguments = (input_ids, segment_ids, word_embedding, position_embedding, segment_embedding, gamma, beta,
                         mask, position_ids, epsilon)
            fused = fused_embed_norm(*arguments, kept) if ran.fused else \
                tried(ran, "fused", fused_embed_norm, *arguments)
            if fused is not None:
                return fused[:len(node.outputs)]
        arguments = (input_ids, segment_ids, word_embedding, position_embedding, segment_embedding, position_ids,
                     mask, dtype)
        summed = _compiled_sum(*arguments) if ran.summed else tried(ran, "summed", _compiled_sum, *arguments)
        total, counts = summed if summed is not None else (None, None)
        if total is None:  # checks and errors, other layouts, or numba still loading
            total = _embedding_sum(node, input_ids, segment_ids, word_embedding, position_embedding,
                                   segment_embedding, position_ids, dtype)
        hidden = total.shape[-1]
        gamma = _vector(node, "gamma", gamma, hidden, dtype)
        beta = _vector(node, "beta", beta, hidden, dtype)
        rows = total.reshape(-1, hidden)
        if rows.size and layer_norm_compiles(rows, gamma, beta, 1, dtype):  # one pass per row, in cache
            normalized = compiled.layer_norm(rows, np.ascontiguousarray(gamma), np.ascontiguousarray(beta),
                                             epsilon)[0]
        else:
            normalized, _, _ = standardize_rows(rows, epsilon)
            normalized *= gamma
            normalized += beta
        if mask is not None and mask.shape != input_ids.shape:
            raise argument_error(node, f"mask has shape {mask.shape}; expected {input_ids.shape}")
        if counts is None:
            counts = (mask == 1).sum(axis=1) if mask is not None else np.zeros(input_ids.shape[0])
        outputs = (normalized.reshape(total.shape).astype(word_embedding.dtype, copy=False),
                   counts.astype(np.int32), total.astype(word_embedding.dtype, copy=False))
        return outputs[:len(node.outputs)]

    return kernel
