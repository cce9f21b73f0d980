"""Where rows come from: a Parquet file or folder, a NumPy file, or a folder of images, cut into shards.

Shards are fixed by the input alone (file, row range), so an interrupted job cut again gets the same shards
and can skip those already written. A source is plain data: it pickles to the worker, which reads only its
shard (a Parquet row group, a memory-mapped slice, its image files).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgumentError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif", ".tif", ".tiff")


@dataclass(frozen=True)
class Shard:
    index: int
    file: str
    group: int  # Parquet row group (0 elsewhere)
    start: int  # first row, within the group or file
    stop: int
    base: int  # the global position of the first row: row ids when the data has no id column


@dataclass
class Source:
    kind: str  # "parquet", "numpy" or "images"
    path: str
    files: list = field(default_factory=list)
    image_input: tuple | None = None  # (layout "NCHW"/"NHWC", channels, height, width) for images

    def describe(self) -> dict:
        return {"kind": self.kind, "path": os.path.abspath(self.path),
                "files": [[os.path.relpath(f, self.path) if self.kind != "numpy" else os.path.basename(f),
                           os.path.getsize(f)] for f in self.files]}

    def shards(self, rows: int) -> list[Shard]:
        if rows < 1:
            raise InvalidArgumentError(f"batch: --shard-rows must be a positive integer, got {rows}")
        shards: list[Shard] = []
        base = 0
        for file, group, count in self._groups():
            for start in range(0, count, rows):
                stop = min(count, start + rows)
                shards.append(Shard(len(shards), file, group, start, stop, base + start))
            base += count
        return shards

    def _groups(self):
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            for file in self.files:
                meta = pq.ParquetFile(file).metadata
                for group in range(meta.num_row_groups):
                    yield file, group, meta.row_group(group).num_rows
        elif self.kind == "numpy":
            yield self.files[0], 0, _numpy_rows(self.files[0])
        else:
            yield self.path, 0, len(self.files)

    def read(self, shard: Shard, id_column: str | None) -> tuple[dict, list, list]:
        """``(columns, row_ids, failures)`` of ``shard``: failures are (row id, message) for rows that could not
        be read (an undecodable image); their rows are left out of the columns."""
        if self.kind == "parquet":
            import pyarrow.parquet as pq

            # On the calling thread: a worker is sized as one of workers x threads = CPUs, and Arrow's pool (a thread
            # per core) decoding beside the sibling workers' kernels costs more CPU than it saves.
            table = pq.ParquetFile(shard.file).read_row_group(shard.group, use_threads=False)
            table = table.slice(shard.start, shard.stop - shard.start)
            columns = {name: _column_array(table.column(name)) for name in table.column_names}
            if id_column is not None:
                if id_column not in columns:
                    raise InvalidArgumentError(
                        f"batch: --id-column {id_column!r} is not a column of {shard.file} "
                        f"(columns: {sorted(columns)})")
                ids = list(columns.pop(id_column))
            else:
                ids = list(range(shard.base, shard.base + len(table)))
            return columns, [_plain(i) for i in ids], []
        if self.kind == "numpy":
            return _read_numpy(shard), list(range(shard.base, shard.base + shard.stop - shard.start)), []
        return self._read_images(shard)

    def _read_images(self, shard: Shard) -> tuple[dict, list, list]:
        from PIL import Image

        assert self.image_input is not None
        layout, channels, height, width = self.image_input
        rows, ids, failures = [], [], []
        for file in self.files[shard.start:shard.stop]:
            name = os.path.relpath(file, self.path)
            try:
                with Image.open(file) as opened:
                    image = opened.convert("L" if channels == 1 else "RGB").resize((width, height))
                pixels = np.asarray(image, dtype=np.float32) / 255.0
            except Exception as exc:  # an unreadable file fails its row, not the job
                failures.append((name, f"{type(exc).__name__}: {exc}"))
                continue
            pixels = pixels.reshape(height, width, channels)
            rows.append(pixels.transpose(2, 0, 1) if layout == "NCHW" else pixels)
            ids.append(name)
        column = np.stack(rows) if rows else np.zeros((0, *_layout_shape(layout, channels, height, width)),
                                                       np.float32)
        return {"image": column}, ids, failures


def _column_array(column) -> np.ndarray:
    """A Parquet column as numpy: fixed-size lists (a tensor per row) as one (rows, size...) array without a Python
    object per row; other columns as pyarrow converts them (variable-length lists: an array per row)."""
    import pyarrow as pa

    # (one chunk, as a row group reads, taken as it is: combine_chunks and flatten import pyarrow.compute, a
    # quarter of a new worker's first shard)
    column = column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()
    shape = []
    values = column
    while pa.types.is_fixed_size_list(values.type) and values.null_count == 0:
        size = values.type.list_size
        shape.append(size)
        values = values.values.slice(values.offset * size, len(values) * size)
    if not pa.types.is_nested(values.type) and values.null_count == 0:
        return _flat_numbers(values).reshape(len(column), *shape)
    return column.to_numpy(zero_copy_only=False)


# Arrow's numeric types as numpy's (booleans are bit-packed in Arrow: they take pyarrow's conversion)
_NUMERIC: dict[str, np.dtype] = {
    name: np.dtype(name_of) for name, name_of in (
        ("halffloat", "float16"), ("float", "float32"), ("double", "float64"), ("int8", "int8"), ("int16", "int16"),
        ("int32", "int32"), ("int64", "int64"), ("uint8", "uint8"), ("uint16", "uint16"), ("uint32", "uint32"),
        ("uint64", "uint64"))}


def _flat_numbers(values) -> np.ndarray:
    """A null-free flat Arrow array as numpy. Numbers are viewed in place (read-only, as pyarrow's zero-copy
    conversion gives them): pyarrow's to_numpy imports pandas, which is most of a new worker's first shard."""
    dtype = _NUMERIC.get(str(values.type))
    if dtype is None:
        return values.to_numpy(zero_copy_only=False)
    flat = np.frombuffer(values.buffers()[1], dtype=dtype, count=len(values), offset=values.offset * dtype.itemsize)
    flat.flags.writeable = False  # (Arrow's memory is immutable: a caller that writes gets an error, not a new table)
    return flat


def _layout_shape(layout, channels, height, width):
    return (channels, height, width) if layout == "NCHW" else (height, width, channels)


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def _numpy_rows(file: str) -> int:
    if file.endswith(".npz"):
        with np.load(file) as archive:
            counts = {archive[name].shape[0] if archive[name].ndim else 0 for name in archive.files}
        if len(counts) != 1:
            raise InvalidArgumentError(
                f"batch: the arrays of {file} have different row counts {sorted(counts)}; rows run along axis 0 "
                f"of every array")
        return counts.pop()
    array = np.load(file, mmap_mode="r")
    if array.ndim == 0:
        raise InvalidArgumentError(f"batch: {file} holds a scalar; rows run along axis 0 of the array")
    return array.shape[0]


def _read_numpy(shard: Shard) -> dict:
    if shard.file.endswith(".npz"):
        with np.load(shard.file) as archive:
            return {name: np.array(archive[name][shard.start:shard.stop]) for name in archive.files}
    array = np.load(shard.file, mmap_mode="r")
    return {"input": np.array(array[shard.start:shard.stop])}


def open_source(path: str, model_inputs: list | None = None) -> Source:
    """The source at ``path``: a .parquet file or a folder of them, a .npy/.npz file, or a folder of images
    (``model_inputs``: [(name, shape)] of the model, which sizes and lays out the images)."""
    if not os.path.exists(path):
        raise InvalidArgumentError(f"batch: input {path!r} does not exist; pass a Parquet file or folder, a .npy/"
                                   f".npz file or a folder of images")
    if os.path.isfile(path):
        if path.endswith(".parquet"):
            return Source("parquet", path, [path])
        if path.endswith((".npy", ".npz")):
            return Source("numpy", os.path.dirname(path) or ".", [path])
        raise InvalidArgumentError(f"batch: input {path!r} is not .parquet, .npy or .npz")
    found = sorted(os.path.join(d, f) for d, _, files in os.walk(path) for f in files)
    parquet = [f for f in found if f.endswith(".parquet")]
    if parquet:
        return Source("parquet", path, parquet)
    images = [f for f in found if f.lower().endswith(IMAGE_SUFFIXES)]
    if not images:
        raise InvalidArgumentError(f"batch: folder {path!r} has no .parquet files and no images "
                                   f"({', '.join(IMAGE_SUFFIXES)})")
    return Source("images", path, images, _image_input(model_inputs or []))


def _image_input(model_inputs: list) -> tuple:
    if len(model_inputs) != 1:
        raise InvalidArgumentError(
            f"batch: images feed a model with one input; this model takes {len(model_inputs)} "
            f"({[n for n, _ in model_inputs]})")
    name, shape = model_inputs[0]
    if len(shape) != 4:
        raise InvalidArgumentError(f"batch: images feed a 4-D input (NCHW or NHWC); {name!r} has shape {shape}")
    if shape[1] in (1, 3) and isinstance(shape[2], int) and isinstance(shape[3], int):
        return ("NCHW", shape[1], shape[2], shape[3])
    if shape[3] in (1, 3) and isinstance(shape[1], int) and isinstance(shape[2], int):
        return ("NHWC", shape[3], shape[1], shape[2])
    raise InvalidArgumentError(
        f"batch: cannot lay images out for input {name!r} of shape {shape}; the model needs a static height and "
        f"width and 1 or 3 channels")
