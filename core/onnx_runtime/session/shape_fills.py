"""Shape rules and index ranges for a shape program's windows over an unpadded generation's feeds
(:mod:`.canonical_feeds`): an all-ones mask is a fill (one value broadcast), and what a gather or reshape makes of
a fill is that value broadcast to the output's shape; a position's window of a table gathered by counting
positions is cut to the table's rows. Shapes are tuples of affine forms, as in :mod:`.shape_layout`."""
from __future__ import annotations

import numpy as np

from ..ir import Node

# Layout and gathers whose output holds only input 0's elements: of a fill, a fill too.
FILL_LAYOUT = frozenset({"GatherND", "Gather", "GatherElements", "Reshape", "Flatten"})


def gathered_shape(node: Node, data: tuple, indices: tuple) -> tuple | None:
    """The output shape of a Gather, GatherElements or GatherND (batch_dims 0) of ``data``'s shape by indices of
    shape ``indices``; None where these rules do not give it."""
    op = node.op_type
    if op == "Gather" and data:
        axis = int(node.attr("axis", 0)) % len(data)
        return data[:axis] + indices + data[axis + 1:]
    if op == "GatherElements":
        return indices
    if op == "GatherND" and indices and not node.attr("batch_dims", 0) and not indices[-1][1:].any():
        last = int(indices[-1][0])
        return indices[:-1] + data[last:] if 0 < last <= len(data) else None
    return None


def index_run(base: np.ndarray, size: int) -> tuple[int, int, int] | None:
    """(axis, start, stop): the one run of ``base``'s entries in ``[0, size)`` along its one axis longer than 1;
    None where every entry is in range. ValueError where they are not one run along one axis."""
    bad = (base < 0) | (base >= size)
    if not bad.any():
        return None
    moving = [axis for axis, n in enumerate(base.shape) if n != 1]
    good = np.flatnonzero(~bad.reshape(-1))
    if len(moving) != 1 or not good.size or good[-1] - good[0] + 1 != good.size:
        raise ValueError("indices out of range")
    return moving[0], int(good[0]), int(good[-1]) + 1
