"""EmbedLayerNormalization's table lookups and sum in one compiled pass: numpy spends a bounds reduction, a
fancy index and an add per table on a handful of rows, several times the arithmetic of a BERT-sized
embedding; the normalization after it (transformer.py's layer_norm loop) runs in the same call."""

from __future__ import annotations

import numpy as np

from . import jit
from .transformer import layer_norm_rows

_NO_POSITIONS = np.empty((0, 0), np.int64)  # (a global array: numba freezes it as a constant)


@jit
def count_ones_(mask, counts):
    """counts[b] = how many entries of mask[b] are 1 (the contrib mask_index)."""
    for b in range(mask.shape[0]):
        count = 0
        for s in range(mask.shape[1]):
            if mask[b, s] == 1:
                count += 1
        counts[b] = count


@jit
def embedding_sum_(ids, word, position, segment_ids, segment, mask, out, counts):
    """out[b, s] = word[ids[b, s]] + position[s] (+ segment[segment_ids[b, s]] where ``segment`` has rows),
    added in that order in out's dtype, and counts[b] the ones in mask[b] (where ``mask`` has rows). Returns -1,
    or the flat index of the first id outside its table (input ids first, then segment ids), with nothing
    promised of ``out``."""
    return embedding_sum_at_(ids, word, position, _NO_POSITIONS, segment_ids, segment, mask, out, counts)


@jit
def embedding_sum_at_(ids, word, position, position_ids, segment_ids, segment, mask, out, counts):
    """embedding_sum_ with position[position_ids[b or 0, s]] where ``position_ids`` (B or 1, S) has rows; an id
    outside the position table returns an index past both of embedding_sum_'s ranges."""
    count_ones_(mask, counts)
    batch, steps = ids.shape
    words, segments, positions = word.shape[0], segment.shape[0], position.shape[0]
    given, per_batch = position_ids.shape[0] > 0, position_ids.shape[0] > 1
    for b in range(batch):
        for s in range(steps):
            w = ids[b, s]
            if w < 0 or w >= words:
                return b * steps + s
            p = position_ids[b if per_batch else 0, s] if given else s
            if p < 0 or p >= positions:
                return 2 * batch * steps + b * steps + s
            row = out[b, s]
            for h in range(row.shape[0]):
                row[h] = word[w, h] + position[p, h]
            if segments:
                g = segment_ids[b, s]
                if g < 0 or g >= segments:
                    return batch * steps + b * steps + s
                for h in range(row.shape[0]):
                    row[h] += segment[g, h]
    return -1


@jit
def embed_layer_norm_(ids, word, position, position_ids, segment_ids, segment, mask, gamma, beta, epsilon, total,
                      out, counts, mean, inv_std):
    """embedding_sum_at_ into ``total`` (B, S, H), then transformer.layer_norm_rows of its rows into ``out`` with
    gamma and beta (beta empty for none): EmbedLayerNormalization in one call, the same arithmetic as the
    two loops. Returns embedding_sum_at_'s -1 or the index of the first id outside its table."""
    found = embedding_sum_at_(ids, word, position, position_ids, segment_ids, segment, mask, total, counts)
    if found >= 0:
        return found
    hidden = total.shape[2]
    layer_norm_rows(total.reshape(-1, hidden), gamma, beta, epsilon, out.reshape(-1, hidden), mean, inv_std)
    return -1
