"""Rows to model feeds: stacking, padding of variable-length rows, and trimming outputs back per row.

A column arrives as one array (rows along axis 0) or as a sequence of per-row arrays whose shapes may
differ (token ids of different lengths, as Ray hands a ragged column and pandas an object column). Rows
are padded at the end of each axis to the longest row of the micro-batch (or to ``pad_to``), so a padded
batch runs as one call; the row lengths come back so outputs can be trimmed to each row.
"""

from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError


def column_rows(column, name: str) -> list[np.ndarray]:
    """A column as a list of per-row arrays (nested lists and object arrays become numeric arrays)."""
    if isinstance(column, np.ndarray) and column.dtype != object:
        return list(column)
    rows = []
    for index, value in enumerate(column):
        rows.append(_as_array(value, name, index))
    return rows


def _as_array(value, name: str, index: int) -> np.ndarray:
    if isinstance(value, np.ndarray) and value.dtype == object:
        if value.ndim == 0:
            value = value.item()
        else:
            parts = [_as_array(v, name, index) for v in value]
            if len({p.shape for p in parts}) > 1:
                raise InvalidArgumentError(
                    f"batch input {name!r}, row {index}: nested rows of different lengths "
                    f"{sorted({p.shape for p in parts})}; a row must be rectangular (only whole rows are padded)")
            return np.stack(parts) if parts else np.zeros((0,), np.float32)
    try:
        return np.asarray(value)
    except ValueError as exc:
        raise InvalidArgumentError(f"batch input {name!r}, row {index}: not a rectangular array ({exc})") from None


def fit_row(row: np.ndarray, shape: list, name: str, row_id) -> np.ndarray:
    """``row`` shaped for the model's per-row input shape: a flat row (as Parquet stores a tensor) is reshaped
    when every dimension of ``shape`` is known; otherwise the row is kept as it is."""
    if row.ndim == len(shape) and all(not isinstance(d, int) or d == s for d, s in zip(shape, row.shape)):
        return row
    if all(isinstance(d, int) and d > 0 for d in shape):
        size = int(np.prod(shape, dtype=np.int64))
        if row.size == size:
            return row.reshape(shape)
        raise InvalidArgumentError(
            f"batch input {name!r}, row {row_id}: {row.size} values of shape {row.shape} where the model takes "
            f"{shape} ({size} values) per row; fix the data or the column mapping")
    if row.ndim != len(shape):
        raise InvalidArgumentError(
            f"batch input {name!r}, row {row_id}: rank {row.ndim} (shape {row.shape}) where the model takes rank "
            f"{len(shape)} per row ({shape})")
    return row


def stack_rows(rows: list[np.ndarray], name: str, dtype, pad_value=0, pad_to: dict | None = None):
    """``(batch, lengths)``: rows stacked along a new axis 0, padded at the end of each axis where they differ.
    ``lengths`` is None without padding, else an (n, rank) array of each row's own shape. ``pad_to`` maps an
    axis of the row to a fixed length (a model with a static sequence length)."""
    shapes = {r.shape for r in rows}
    if len({len(s) for s in shapes}) > 1:
        raise InvalidArgumentError(
            f"batch input {name!r}: rows of different ranks {sorted(shapes)}; every row needs the same rank")
    if len(shapes) == 1 and not pad_to:
        return np.stack(rows).astype(dtype, copy=False), None
    rank = rows[0].ndim
    target = [max(r.shape[axis] for r in rows) for axis in range(rank)]
    for axis, length in (pad_to or {}).items():
        longest = target[axis]
        if longest > length:
            raise InvalidArgumentError(
                f"batch input {name!r}: a row has {longest} elements along axis {axis}, over the padded length "
                f"{length}; truncate the data or raise pad_to")
        target[axis] = length
    out = np.full([len(rows), *target], pad_value, dtype=dtype)
    lengths = np.zeros((len(rows), rank), np.int64)
    for i, row in enumerate(rows):
        out[i][tuple(slice(0, n) for n in row.shape)] = row
        lengths[i] = row.shape
    return out, lengths


def padding_mask(lengths: np.ndarray, shape: tuple, dtype) -> np.ndarray:
    """1 over each row's own elements along its first padded axis, 0 over the padding (an attention mask)."""
    axis = int(np.argmax((lengths != lengths.max(axis=0)).any(axis=0))) if lengths.size else 0
    positions = np.arange(shape[1 + axis])
    return (positions[None, :] < lengths[:, axis:axis + 1]).astype(dtype)


def trim_output(row: np.ndarray, padded: tuple, own: np.ndarray) -> np.ndarray:
    """One row of an output, cut back along each axis whose size is a padded length of the input to the row's
    own length there (a per-token output follows its tokens; a pooled output is left whole)."""
    index = []
    for size in row.shape:
        cut = slice(None)
        for in_axis, length in enumerate(padded):
            if size == length and own[in_axis] != length:
                cut = slice(0, int(own[in_axis]))
                break
        index.append(cut)
    return row[tuple(index)]
