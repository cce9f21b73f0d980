"""A normalization and the few-row product that reads it, as one compiled call: a decode step's LayerNormalization
or RMSNormalization in front of its projection (query/key/value, the feed-forward's first product, the head).

Run apart, each is a kernel call of its own whose Python and dispatch cost about what its arithmetic does at one
row; here the rows are normalized into scratch by the very loops the normalization kernels run
(transformer.layer_norm_rows, decoder.rms_norm), then few_rows.few_row_panels multiplies the scratch by the packed
weights with its bias and Gelu epilogue: the same bits as the two kernels one after the other.
"""

from __future__ import annotations

import numpy as np

from . import jit
from .decoder import rms_norm
from .few_rows import few_row_panels
from .transformer import layer_norm_rows


@jit
def normed_panels(x, scale, shift, epsilon, rms, rows, depth, packed, offsets, bias, y, n, residual, flags,
                  coefficients, spare):
    """few_row_panels(normalized x, ...) over every panel of ``packed``, x (flat, rows by depth) normalized into
    scratch first: RMS with ``rms``, else LayerNormalization with ``shift`` (empty: none). ``scale`` and ``shift``
    are (depth,); ``spare``: the size of few_row_panels' scratch. The scratch is allocated here: passing it in cost
    an allocation and an argument's unboxing each."""
    normed = np.empty(rows * depth, x.dtype)
    source, target = x.reshape(rows, depth), normed.reshape(rows, depth)
    if rms:
        rms_norm(source, scale, epsilon, target)
    else:
        stats = np.empty(rows, x.dtype)
        layer_norm_rows(source, scale, shift, epsilon, target, stats, stats)
    few_row_panels(normed, depth, rows, depth, packed, offsets, bias, y, n, residual, flags, coefficients, 0,
                   packed.shape[0], np.empty(spare, x.dtype))
