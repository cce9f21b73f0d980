"""Keys of the Attention kernels' cache by input shapes: the shapes a length-free kernel serves alike."""

from __future__ import annotations


def length_free_key(shapes) -> tuple:
    """The input shapes without the keys' length (axis -2 of K, V and the pasts, the mask's last axis): a
    length-free Attention kernel serves every shapes that agree on these."""
    # (A shape's axes around the length as parts of the key rather than one tuple joined from them: the same
    # information, since the parts' lengths give the rank, without a concatenation per shape.)
    try:
        if len(shapes) == 4:  # (Q, K, V, mask), a decode step's: each new length of a first generation asks
            q, k, v, mask = shapes
            if k is not None and v is not None and mask is not None:
                return q, k[:-2], k[-1], v[:-2], v[-1], mask[:-1]
        elif len(shapes) == 6:  # (Q, K, V, mask, past K, past V): a PastAttention's, asked by each layer per new length
            q, k, v, mask, past_k, past_v = shapes
            if k is not None and v is not None and mask is not None and past_k is not None and past_v is not None:
                return q, k[:-2], k[-1], v[:-2], v[-1], mask[:-1], past_k[:-2], past_k[-1], past_v[:-2], past_v[-1]
    except IndexError:  # (a scalar K or V: the general form below)
        pass
    key = list(shapes)
    for index in range(1, min(len(key), 6)):
        shape = key[index]
        if shape is not None:
            key[index] = shape[:-1] if index == 3 else shape[:-2] + shape[-1:]
    return tuple(key)
