"""Shape and data-movement kernels: Concat, Split, Slice, the Gather/Scatter family, Shape/Size, Expand, Tile,
DepthToSpace/SpaceToDepth, Trilu, Compress, NonZero, OneHot, TopK and Unique (Reshape, Flatten, Transpose,
Squeeze and Unsqueeze are view.py's).

Slice, Split and Gather of one index may return views of their input: kernels never write into their inputs,
so sharing the buffer is safe.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime import budget
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from ..registry import register
from ._common import frozen, indices_checked, shape_free
from .view import normalize_axes, normalize_axis


def _attribute_error(node, attribute, problem, expected):
    return InvalidGraphError(
        f"node {node.name!r} ({node.op_type}): attribute '{attribute}' {problem}; expected {expected}"
    )


# -- Shape, Size, Expand, Tile ------------------------------------------------------------------------


@register("Shape", since=1)
def shape_v1(node, shapes, opset):
    return shape_free(lambda x: (np.array(x.shape, dtype=np.int64),))


@register("Shape", since=15)
def shape(node, shapes, opset):
    # Python slicing clamps start/end to [0, rank] after adding rank to negatives, as ONNX does.
    window = slice(node.attr("start", 0), node.attr("end"))
    return shape_free(lambda x: (np.array(x.shape[window], dtype=np.int64),))


@register("Size", since=1)
def size(node, shapes, opset):
    return lambda x: (np.array(x.size, dtype=np.int64),)


@register("Expand", since=8)
def expand(node, shapes, opset):
    def kernel(x, shape):
        if np.asarray(shape).dtype.kind not in "iu":  # a shape of unknown type at creation passed the type check
            raise InvalidArgumentError(f"node {node.name!r} (Expand): shape is {np.asarray(shape).dtype}; "
                                       f"expected int64")
        target = _broadcast_shape(node, x.shape, tuple(np.asarray(shape).reshape(-1).tolist()))
        # Materialized (a read-only zero-stride view would surprise whoever receives the output), by one
        # copy into a fresh array: np.broadcast_shapes and broadcast_to cost several times a small copy.
        budget.check_shape(target, x.dtype.itemsize, "Expand's output")
        out = np.empty(target, x.dtype)
        np.copyto(out, x)
        return (out,)

    return shape_free(kernel)


def _broadcast_shape(node, shape: tuple, target: tuple) -> tuple:
    """The multidirectional broadcast of ``shape`` and Expand's ``target`` (numpy's rule, in plain Python)."""
    rank = max(len(shape), len(target))
    shape, target = (1,) * (rank - len(shape)) + shape, (1,) * (rank - len(target)) + target
    out = []
    for have, want in zip(shape, target):
        if want < 0 or (have != want and have != 1 and want != 1):
            raise InvalidArgumentError(
                f"node {node.name!r} (Expand): input shape {shape} does not broadcast to shape {target}; expected "
                f"each dimension of the shape input to equal the input's, or either of them to be 1"
            )
        out.append(want if have == 1 else have)
    return tuple(out)


@register("Tile", since=1)
def tile_v1(node, shapes, opset):
    # Tile-1 repeats along a single axis: inputs are (input, tiles, axis).
    def kernel(x, tiles, axis):
        repeats = [1] * x.ndim
        repeats[normalize_axis(np.asarray(axis).item(), x.ndim)] = int(np.asarray(tiles).item())
        return (np.tile(x, repeats),)

    return kernel


@register("Tile", since=6)
def tile(node, shapes, opset):
    def kernel(x, repeats):
        reps = np.asarray(repeats).reshape(-1).tolist()
        if len(reps) != x.ndim or any(r < 0 for r in reps):
            raise InvalidArgumentError(f"node {node.name!r} (Tile): repeats {reps} must hold one non-negative count "
                                       f"per dimension of the input, of shape {x.shape}")
        budget.check_shape([d * r for d, r in zip(x.shape, reps)], x.dtype.itemsize, "Tile's output")
        return (np.tile(x, reps),)

    return kernel


# -- Concat, Split, Slice -----------------------------------------------------------------------------


def _concat_factory(default_axis):
    def factory(node, shapes, opset):
        axis = node.attr("axis", default_axis)
        if axis is None:
            raise _attribute_error(node, "axis", "is missing", "the axis to concatenate on")
        if shapes and shapes[0] is not None and -len(shapes[0]) <= axis < len(shapes[0]):
            # A valid axis for the known rank: numpy counts a negative one from each call's own rank, as ONNX
            # does, so the kernel serves every shape (a decode step's growing cache).
            if len(node.inputs) == 2 and node.outputs:
                return shape_free(_appending_concat(node.outputs[0], axis))
            return shape_free(lambda *xs: (np.concatenate(xs, axis=axis),))
        return shape_free(lambda *xs: (np.concatenate(xs, axis=normalize_axis(axis, xs[0].ndim)),))

    return factory


def _appending_concat(output: str, axis: int):
    """Concat of two, which appends in place where the bound run feeding the first allows (kv_append.py): a KV
    cache's ``present = Concat(past, new)``."""
    from onnx_runtime import kv_append  # (at the first such Concat: the CNNs' Flatten loads this module without it)

    def kernel(*xs):
        grown = kv_append.append(output, xs, axis if axis >= 0 else axis + xs[0].ndim)
        return (np.concatenate(xs, axis=axis) if grown is None else grown,)

    return kernel


register("Concat", since=1)(_concat_factory(default_axis=1))
register("Concat", since=4)(_concat_factory(default_axis=None))


def _split_sizes(dim, parts, uneven_last):
    """Sizes of an equal split of ``dim`` into ``parts``; with ``uneven_last`` the last may be smaller."""
    if uneven_last:
        chunk = -(-dim // parts)
        sizes = [chunk] * (parts - 1) + [dim - chunk * (parts - 1)]
        if sizes[-1] < 0:
            raise InvalidArgumentError(f"cannot split a dimension of {dim} into {parts} chunks of {chunk}")
        return sizes
    if dim % parts:
        raise InvalidArgumentError(f"cannot split a dimension of {dim} into {parts} equal parts")
    return [dim // parts] * parts


def _split_kernel(node, sizes_attr=None, uneven_last=False):
    axis = node.attr("axis", 0)
    parts = len(node.outputs)
    # The last call's input shape, its constant ``split`` (or None) and the index of each part: a decode
    # step splits the same shape every run, and working the sizes out again costs more than the views.
    last = (None, None, ())

    def kernel(x, split=None):
        nonlocal last
        shape, sizes, indices = last  # one read: another thread running this node may replace it
        if x.shape == shape and split is sizes:
            return tuple([x[index] for index in indices])
        ax = normalize_axis(axis, x.ndim)
        if split is not None and split.size:
            sizes = split.tolist()
        elif sizes_attr is not None:
            sizes = list(sizes_attr)
        else:
            sizes = _split_sizes(x.shape[ax], parts, uneven_last)
        if len(sizes) != parts or sum(sizes) != x.shape[ax] or min(sizes, default=0) < 0:
            raise InvalidArgumentError(
                f"Split {node.name!r}: sizes {sizes} must be {parts} non-negative values summing to dimension "
                f"{x.shape[ax]} of axis {ax}"
            )
        if split is None or not split.flags.writeable:  # no input, or a constant: the same sizes every run
            last = (x.shape, split, _split_indices(ax, sizes))
        return _split_views(x, ax, sizes)

    return kernel


def _split_views(x, axis, sizes):
    """Views of ``x`` cut along ``axis`` into ``sizes`` (plain slicing: np.split costs far more; 8c99352)."""
    return tuple([x[index] for index in _split_indices(axis, sizes)])


def _split_indices(axis, sizes) -> tuple:
    """The index of each part of a split along ``axis`` into ``sizes``."""
    leading = (slice(None),) * axis
    indices, start = [], 0
    for size in sizes:
        indices.append((*leading, slice(start, start + size)))
        start += size
    return tuple(indices)


@register("Split", since=1)
def split_v1(node, shapes, opset):
    # Before 13 the sizes come from the 'split' attribute (or, in Split-1 only, a second input).
    return _split_kernel(node, sizes_attr=node.attr("split"))


@register("Split", since=13)
def split_v13(node, shapes, opset):
    return _split_kernel(node)


@register("Split", since=18)
def split(node, shapes, opset):
    num_outputs = node.attr("num_outputs")
    if num_outputs is not None and num_outputs != len(node.outputs):
        raise _attribute_error(node, "num_outputs", f"is {num_outputs}", f"the node's {len(node.outputs)} outputs")
    return _split_kernel(node, uneven_last=num_outputs is not None)


def _slice_bounds(start, end, step, dim):
    """One axis's ONNX slice as a Python slice: negatives count from the end, then clamp."""
    if step == 0:
        raise InvalidArgumentError("Slice steps must be non-zero")
    start = start + dim if start < 0 else start
    end = end + dim if end < 0 else end
    if step > 0:
        return slice(min(max(start, 0), dim), min(max(end, 0), dim), step)
    # Stepping backwards, end -1 means "past the first element", which Python spells None.
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    return slice(start, None if end < 0 else end, step)


def _slice(x, starts, ends, axes=None, steps=None):
    return x[_slice_index(x.shape, x.ndim, starts, ends, axes, steps)]


@register("Slice", since=1)
def slice_v1(node, shapes, opset):
    starts, ends, axes = node.attr("starts"), node.attr("ends"), node.attr("axes")
    if starts is None or ends is None:
        raise _attribute_error(node, "starts", "or 'ends' is missing", "both starts and ends")
    return lambda x: (_slice(x, starts, ends, axes),)


@register("Slice", since=10)
def slice_(node, shapes, opset):
    # Constant starts/ends/axes/steps (nearly always initializers) give the same index for the same input
    # shape: the last one is kept (as one tuple: sessions may run from several threads).
    last: list = [((), None, None)]

    def kernel(x, starts, ends, axes=None, steps=None):
        params = (starts, ends, axes, steps)
        held, shape, index = last[0]
        if shape == x.shape and len(held) == 4 and all(a is b for a, b in zip(held, params)):
            return (x[index],)
        index = _slice_index(x.shape, x.ndim, starts, ends, axes, steps)
        if all(frozen(p) for p in params):
            last[0] = (params, x.shape, index)
        return (x[index],)

    return kernel


def _slice_index(shape, rank, starts, ends, axes=None, steps=None) -> tuple:
    starts = np.asarray(starts).reshape(-1).tolist()
    ends = np.asarray(ends).reshape(-1).tolist()
    if axes is None and len(starts) > rank:
        raise InvalidArgumentError(f"Slice has {len(starts)} starts for a rank-{rank} input and no axes; give at most "
                                   f"one start per axis")
    axes = range(len(starts)) if axes is None else normalize_axes(axes, rank)
    steps = [1] * len(starts) if steps is None else np.asarray(steps).reshape(-1).tolist()
    index = [slice(None)] * rank
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        index[axis] = _slice_bounds(start, end, step, shape[axis])
    return tuple(index)


# -- Gather and Scatter -------------------------------------------------------------------------------


@register("Gather", since=1)
@indices_checked
def gather(node, shapes, opset):
    axis = node.attr("axis", 0)
    # np.take accepts negative indices and raises IndexError for out-of-range ones.
    # The last one-index call with constant indices (read-only: identity stands for the value): (the data's shape,
    # the indices, the view's key). A streaming model picks the same state of the same shape every frame, and the
    # checks below cost several times the view.
    kept: tuple = (None, None, None)

    def kernel(x, indices):
        nonlocal kept
        shape, held, key = kept  # one read: another thread may keep another call meanwhile
        if indices is held and x.shape == shape:
            return (x[key],)
        ax = normalize_axis(axis, x.ndim)
        # One index (a streaming model picking a state, a shape's entry) is a view: no copy, no np.take.
        if isinstance(indices, np.ndarray) and indices.size == 1 and indices.ndim <= 1 and indices.dtype.kind in "iu":
            i, dim = int(indices.reshape(-1)[0]), x.shape[ax]
            if -dim <= i < dim:
                i += dim if i < 0 else 0
                # (Ellipsis last: a 0-d result stays an array instead of becoming a numpy scalar.)
                key = (slice(None),) * ax + ((i,) if indices.ndim == 0 else (slice(i, i + 1),)) + (Ellipsis,)
                if frozen(indices):
                    kept = (x.shape, indices, key)
                return (x[key],)
        # (the array's own take: np.take's dispatch through numpy's Python wrapper costs a one-token embedding
        # lookup about as much as the lookup)
        return (x.take(indices, axis=ax) if type(x) is np.ndarray else np.take(x, indices, axis=ax),)

    return shape_free(kernel)


def _element_positions(indices: np.ndarray, shape: tuple[int, ...], ax: int) -> np.ndarray | None:
    """The flat (C-order) positions in data of ``shape`` that GatherElements' ``indices`` along ``ax`` pick, or
    None where an index lies outside [-n, n) (the general path then raises the node's error)."""
    n = shape[ax]
    if indices.size and not (-n <= int(indices.min()) and int(indices.max()) < n):
        return None
    along = indices.astype(np.intp)
    along[along < 0] += n
    strides = np.cumprod((1,) + shape[:0:-1])[::-1]  # in elements
    positions = along * strides[ax]
    for d, size in enumerate(indices.shape):
        if d != ax:
            positions += (np.arange(size, dtype=np.intp) * strides[d]).reshape((size,) + (1,) * (indices.ndim - d - 1))
    return positions


@register("GatherElements", since=11)
@indices_checked
def gather_elements(node, shapes, opset):
    axis = node.attr("axis", 0)
    # Constant indices (read-only: an initializer, or a plan's shape-derived value such as DeBERTa's relative
    # positions; identity stands for contents) gather by flat positions worked out once: (the indices, the data's
    # shape, the positions). np.take_along_axis builds its index grids on every call, several times the gather.
    kept: tuple = (None, None, None)

    def kernel(x, indices):
        nonlocal kept
        held, shape, positions = kept  # one read: another thread may keep another call meanwhile
        if held is indices and shape == x.shape:
            return (x.reshape(-1)[positions],)
        ax = normalize_axis(axis, x.ndim)
        if indices.ndim != x.ndim or any(i > d for a, (i, d) in enumerate(zip(indices.shape, x.shape)) if a != ax):
            raise InvalidArgumentError(
                f"node {node.name!r} (GatherElements): indices of shape {list(indices.shape)} do not fit data of "
                f"shape {list(x.shape)}; they need the data's rank and, off axis {ax}, no larger dimensions")
        if frozen(indices) and indices.dtype.kind in "iu" and x.size:
            positions = _element_positions(indices, x.shape, ax)
            if positions is not None:
                kept = (indices, x.shape, positions)
                return (x.reshape(-1)[positions],)
        # Off the axis, indices may be shorter than the data: gather from the matching corner.
        corner = tuple(slice(None) if d == ax else slice(0, n) for d, n in enumerate(indices.shape))
        return (np.take_along_axis(x[corner], indices.astype(np.int64, copy=False), axis=ax),)

    return kernel


@register("GatherND", since=11)
@indices_checked
def gather_nd(node, shapes, opset):
    batch_dims = node.attr("batch_dims", 0)
    # The last read-only indices (a constant, or a shape value a plan keeps: identity stands for contents, see
    # frozen), the data shape and the flat positions they gather: (indices, shape, positions, rows shape); and
    # the shape of the indices the call before had. Positions are worked out only for indices of a shape seen
    # twice in a row: a decode loop's growing mask brings new indices every step, which would never reuse them.
    last: list = [(None, None, None, None), None]

    def kernel(x, indices):
        if batch_dims == 0 and indices.ndim > 1 and 0 < indices.shape[-1] <= x.ndim:
            held, shape, positions, rows = last[0]
            if held is indices and shape == x.shape:
                return (x.reshape(rows)[positions],)
            # One fancy index by the tuples' columns (a decode step's mask gathers this way every run).
            depth = indices.shape[-1]
            columns = tuple([indices[..., axis] for axis in range(depth)])
            gathered = x[columns]
            repeated, last[1] = last[1] == indices.shape, indices.shape
            if repeated and frozen(indices) and indices.size \
                    and all(0 <= c.min() and c.max() < d for c, d in zip(columns, x.shape)):
                rows = (math.prod(x.shape[:depth]),) + x.shape[depth:]
                last[0] = (indices, x.shape, np.ravel_multi_index(columns, x.shape[:depth]), rows)
            return (gathered,)
        # Flatten the batch dimensions to one, and the index tuples of each batch to one axis.
        batches = math.prod(x.shape[:batch_dims])
        depth = indices.shape[-1]
        flat_x = x.reshape((batches,) + x.shape[batch_dims:])
        tuples = indices.reshape(batches, math.prod(indices.shape[batch_dims:-1]), depth)
        batch_index = np.arange(batches).reshape(batches, 1)
        gathered = flat_x[(batch_index,) + tuple(np.moveaxis(tuples, -1, 0))]
        return (gathered.reshape(indices.shape[:-1] + x.shape[batch_dims + depth :]),)

    return shape_free(kernel)


_SCATTER_REDUCTIONS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter_reduction(node):
    reduction = node.attr("reduction", "none")
    if reduction != "none" and reduction not in _SCATTER_REDUCTIONS:
        raise _attribute_error(node, "reduction", f"is {reduction!r}", f"'none' or one of {list(_SCATTER_REDUCTIONS)}")
    return _SCATTER_REDUCTIONS.get(reduction)


def _scatter(data, index, updates, reduce):
    out = data.copy()
    if reduce is None:
        out[index] = updates  # duplicate indices: the last update wins (ONNX leaves it undefined)
    else:
        reduce.at(out, index, updates)  # unbuffered, so duplicate indices all accumulate
    return out


def _scatter_elements_factory(node, shapes, opset):
    axis = node.attr("axis", 0)
    reduce = _scatter_reduction(node)

    def kernel(data, indices, updates):
        if indices.shape != updates.shape or indices.ndim != data.ndim:
            raise InvalidArgumentError(
                f"node {node.name!r} ({node.op_type}): indices {list(indices.shape)} and updates "
                f"{list(updates.shape)} must have one shape, of the rank of data {list(data.shape)}")
        index = list(np.indices(indices.shape, sparse=True))
        index[normalize_axis(axis, data.ndim)] = indices
        return (_scatter(data, tuple(index), updates, reduce),)

    return kernel


register("ScatterElements", since=11)(indices_checked(_scatter_elements_factory))
register("Scatter", since=9)(indices_checked(_scatter_elements_factory))  # the deprecated name of ScatterElements


@register("ScatterND", since=11)
@indices_checked
def scatter_nd(node, shapes, opset):
    reduce = _scatter_reduction(node)

    def kernel(data, indices, updates):
        # The last axis of indices holds coordinates into data's leading dimensions.
        depth = indices.shape[-1] if indices.ndim else -1
        if not 0 < depth <= data.ndim or updates.shape != indices.shape[:-1] + data.shape[depth:]:
            raise InvalidArgumentError(
                f"node {node.name!r} (ScatterND): updates of shape {list(updates.shape)} must have shape "
                f"indices.shape[:-1] + data.shape[indices.shape[-1]:] (indices {list(indices.shape)}, data "
                f"{list(data.shape)})")
        return (_scatter(data, tuple(np.moveaxis(indices, -1, 0)), updates, reduce),)

    return kernel


# -- DepthToSpace, SpaceToDepth, Trilu ----------------------------------------------------------------


def _blocksize(node):
    blocksize = node.attr("blocksize")
    if not isinstance(blocksize, int) or blocksize < 1:
        raise _attribute_error(node, "blocksize", f"is {blocksize!r}", "a positive integer")
    return blocksize


@register("DepthToSpace", since=1)
def depth_to_space(node, shapes, opset):
    b = _blocksize(node)
    mode = node.attr("mode", "DCR")
    if mode not in ("DCR", "CRD"):
        raise _attribute_error(node, "mode", f"is {mode!r}", "'DCR' or 'CRD'")

    def kernel(x):
        n, c, h, w = x.shape
        if mode == "DCR":  # depth is ordered (row block, column block, channel)
            blocks = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
        else:  # CRD: (channel, row block, column block)
            blocks = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
        return (blocks.reshape(n, c // (b * b), h * b, w * b),)

    return kernel


@register("SpaceToDepth", since=1)
def space_to_depth(node, shapes, opset):
    b = _blocksize(node)
    mode = node.attr("mode", "DCR")  # the attribute exists from opset 28 on
    if mode not in ("DCR", "CRD"):
        raise _attribute_error(node, "mode", f"is {mode!r}", "'DCR' or 'CRD'")
    # Output depth is ordered (row block, column block, channel) for DCR, (channel, row, column) for CRD.
    order = (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)

    def kernel(x):
        n, c, h, w = x.shape
        blocks = x.reshape(n, c, h // b, b, w // b, b).transpose(order)
        return (blocks.reshape(n, c * b * b, h // b, w // b),)

    return kernel


@register("Trilu", since=14)
def trilu(node, shapes, opset):
    keep = np.triu if node.attr("upper", 1) else np.tril  # both act on the last two axes

    def kernel(x, k=None):
        if x.ndim < 2:
            raise InvalidArgumentError(f"node {node.name!r} (Trilu): input of shape {x.shape} must have rank >= 2 "
                                       f"(its last two axes are the matrices)")
        if k is not None and np.asarray(k).size != 1:
            raise InvalidArgumentError(f"node {node.name!r} (Trilu): k must be one value, got shape {np.shape(k)}")
        return (keep(x, 0 if k is None else int(np.asarray(k).item())),)

    return kernel


# -- Compress, NonZero, OneHot ------------------------------------------------------------------------


@register("Compress", since=9)
def compress(node, shapes, opset):
    axis = node.attr("axis")  # None: select from the flattened input

    def kernel(x, condition):
        ax = None if axis is None else normalize_axis(axis, x.ndim)
        length = x.size if ax is None else x.shape[ax]
        if condition.size > length:
            raise InvalidArgumentError(f"node {node.name!r} (Compress): condition has {condition.size} values for "
                                       f"{length} slices; it may be shorter, never longer")
        return (np.compress(condition.reshape(-1).astype(bool, copy=False), x, axis=ax),)

    return kernel


@register("NonZero", since=9)
def non_zero(node, shapes, opset):
    def kernel(x):
        if x.ndim == 0:  # a scalar has no coordinates: shape (0, nonzero count)
            return (np.zeros((0, int(np.count_nonzero(x))), dtype=np.int64),)
        return (np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1),)

    return kernel


@register("OneHot", since=9)
def one_hot(node, shapes, opset):
    axis = node.attr("axis", -1)

    def kernel(indices, depth, values):
        depth = int(np.asarray(depth).reshape(-1)[0])
        if depth < 1 or values.size != 2:
            raise InvalidArgumentError(f"node {node.name!r} (OneHot): depth {depth} and values of shape "
                                       f"{values.shape}; expected a depth >= 1 and values [off_value, on_value]")
        budget.check(indices.size * depth, max(values.dtype.itemsize, 8), "OneHot's output")
        off, on = values.reshape(-1)[0], values.reshape(-1)[1]
        positions = indices.astype(np.int64)
        positions = np.where(positions < 0, positions + depth, positions)
        # Out-of-range indices match no position and stay all off_value.
        hot = positions[..., np.newaxis] == np.arange(depth)
        out = np.where(hot, on, off).astype(values.dtype, copy=False)
        return (np.moveaxis(out, -1, normalize_axis(axis, out.ndim)),)

    return kernel


# -- TopK, Unique -------------------------------------------------------------------------------------


def _top_k(x, k, axis, largest):
    """The k largest (or smallest) along ``axis``; equal values keep their original order."""
    axis = normalize_axis(axis, x.ndim)
    n = x.shape[axis]
    if not 0 <= k <= n:
        raise InvalidArgumentError(f"TopK k={k} is out of range for an axis of length {n}")
    if largest:
        # Sort the reversed axis ascending (stable), then reverse: descending values, and among
        # equal values the lowest original index first.
        order = np.flip(np.argsort(np.flip(x, axis), axis=axis, kind="stable"), axis)
        order = (n - 1) - order
    else:
        order = np.argsort(x, axis=axis, kind="stable")
    indices = np.take(order, np.arange(k), axis=axis).astype(np.int64, copy=False)
    return np.take_along_axis(x, indices, axis=axis), indices


@register("TopK", since=1)
def top_k_v1(node, shapes, opset):
    k, axis = node.attr("k"), node.attr("axis", -1)
    if k is None:
        raise _attribute_error(node, "k", "is missing", "the number of elements to keep")
    return lambda x: _top_k(x, k, axis, largest=True)


@register("TopK", since=10)
def top_k(node, shapes, opset):
    axis = node.attr("axis", -1)
    largest = bool(node.attr("largest", 1))  # 'largest' and 'sorted' arrived in 11; results stay sorted
    return lambda x, k: _top_k(x, int(np.asarray(k).reshape(-1)[0]), axis, largest)


@register("Unique", since=11)
def unique(node, shapes, opset):
    axis = node.attr("axis")
    keep_sorted = bool(node.attr("sorted", 1))

    def kernel(x):
        ax = None if axis is None else normalize_axis(axis, x.ndim)
        if ax is not None and x.dtype.kind == "O":  # numpy's unique takes no axis for strings
            values, first, inverse, counts = _unique_object_slices(x, ax)
        else:
            values, first, inverse, counts = np.unique(
                x, return_index=True, return_inverse=True, return_counts=True, axis=ax
            )
        if not keep_sorted:  # reorder by first occurrence
            order = np.argsort(first, kind="stable")
            rank = np.empty_like(order)
            rank[order] = np.arange(order.size)
            values = np.take(values, order, axis=0 if ax is None else ax)
            first, inverse, counts = first[order], rank[inverse], counts[order]
        return tuple([values] + [a.reshape(-1).astype(np.int64) for a in (first, inverse, counts)])

    return kernel


def _unique_object_slices(x: np.ndarray, axis: int):
    """np.unique(x, axis=axis)'s four results for a string tensor: its slices along ``axis`` compared as tuples,
    lexicographically, as numpy orders the rows of a numeric one."""
    n = x.shape[axis]
    rows = [tuple(r) for r in np.moveaxis(x, axis, 0).reshape(n, math.prod(x.shape) // n if n else 0)]
    index = {row: i for i, row in enumerate(sorted(set(rows)))}
    inverse = np.fromiter((index[row] for row in rows), np.int64, count=n)
    first = np.full(len(index), n, np.int64)
    np.minimum.at(first, inverse, np.arange(n, dtype=np.int64))
    return np.take(x, first, axis=axis), first, inverse, np.bincount(inverse, minlength=len(index)).astype(np.int64)
