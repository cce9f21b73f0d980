"""Initializers memory-mapped from a model's external data instead of read into memory.

A weight stored in an external data file becomes a read-only numpy array over a shared mapping of that file:
loading reads none of its bytes, the kernel that first touches it faults in the pages it reads, and the
kernel cache shares them with every process that maps the same file. Host RSS stays near what is touched.

Only what is safe to map is mapped: a dense top-level initializer of a fixed-size numeric type with more than
``SHAPE_VALUE_LIMIT`` elements (smaller ones are shape values that onnx's shape inference reads), whose file
lies in the model's folder and holds the whole range. Everything else is read as before.
"""

from __future__ import annotations

import mmap
import os
import threading

import numpy as np
import onnx

from ..errors import ModelLoadError

__all__ = ["MappedFile", "load_external_data", "map_external_initializers", "mapped_region"]

# ONNX element types whose external bytes are exactly a little-endian numpy array of that dtype.
_NUMPY = {
    onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.DOUBLE: np.float64, onnx.TensorProto.FLOAT16: np.float16,
    onnx.TensorProto.INT8: np.int8, onnx.TensorProto.INT16: np.int16, onnx.TensorProto.INT32: np.int32,
    onnx.TensorProto.INT64: np.int64, onnx.TensorProto.UINT8: np.uint8, onnx.TensorProto.UINT16: np.uint16,
    onnx.TensorProto.UINT32: np.uint32, onnx.TensorProto.UINT64: np.uint64, onnx.TensorProto.BOOL: np.bool_,
}
_MADV_WILLNEED = getattr(mmap, "MADV_WILLNEED", None)
_LOCK = threading.Lock()
_FILES: dict[tuple[str, int, int], MappedFile] = {}  # (path, device, inode) -> its one mapping in this process


class MappedFile:
    """A read-only shared mapping of one data file (the contract's ``MmapRegionSource``)."""

    __slots__ = ("path", "size", "_mmap", "__weakref__")

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as handle:
            self.size = os.fstat(handle.fileno()).st_size
            self._mmap = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if self.size else None

    def region(self, offset: int, nbytes: int) -> memoryview:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.size:
            raise ModelLoadError(f"external data range [{offset}, {offset + nbytes}) lies outside {self.path!r} "
                                 f"({self.size} bytes); the data file does not match the model")
        if self._mmap is None:
            return memoryview(b"")
        return memoryview(self._mmap)[offset:offset + nbytes]

    def maps(self, buffer: object) -> bool:
        """Whether ``buffer`` is this file's mapping."""
        return self._mmap is not None and buffer is self._mmap

    @property
    def address(self) -> int:
        """Where the mapping starts in this process (0 for an empty file)."""
        if self._mmap is None:
            return 0
        return int(np.frombuffer(self._mmap, np.uint8, count=0).__array_interface__["data"][0])

    def will_need(self, offset: int, nbytes: int) -> bool:
        """Ask the kernel to read ``nbytes`` at ``offset`` ahead, asynchronously; False when it cannot."""
        if self._mmap is None or _MADV_WILLNEED is None or nbytes <= 0:
            return False
        start = offset - offset % mmap.PAGESIZE
        try:
            self._mmap.madvise(_MADV_WILLNEED, start, min(nbytes + offset - start, self.size - start))
        except (OSError, ValueError):
            return False
        return True

    def array(self, offset: int, dtype, shape: tuple[int, ...]) -> np.ndarray:
        count = int(np.prod(shape, dtype=np.int64))
        view = self.region(offset, count * np.dtype(dtype).itemsize)
        array = np.frombuffer(view, dtype=np.dtype(dtype).newbyteorder("<"), count=count).reshape(shape)
        return array  # read-only: the mapping is ACCESS_READ


def _mapped_file(path: str) -> MappedFile:
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_dev, stat.st_ino)
    with _LOCK:
        mapped = _FILES.get(key)
        if mapped is None or mapped.size != stat.st_size:
            mapped = _FILES[key] = MappedFile(path)
        return mapped


def mapped_region(array: np.ndarray) -> tuple[MappedFile, int] | None:
    """The file and byte offset ``array`` maps, when it is (a view of) a mapped weight; else None."""
    base = array
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    if not isinstance(base, memoryview) or not isinstance(base.obj, mmap.mmap):
        return None
    with _LOCK:
        for mapped in _FILES.values():
            if mapped.maps(base.obj):
                return mapped, int(array.__array_interface__["data"][0]) - mapped.address
    return None


def _external_entries(tensor: onnx.TensorProto) -> dict[str, str]:
    return {entry.key: entry.value for entry in tensor.external_data}


def map_external_initializers(proto: onnx.ModelProto, folder: str, min_elements: int) -> dict[str, np.ndarray]:
    """Map the eligible external initializers of ``proto``'s top-level graph (see the module docstring);
    returns name -> read-only array."""
    mapped: dict[str, np.ndarray] = {}
    root = os.path.realpath(folder)
    for tensor in proto.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL or tensor.data_type not in _NUMPY:
            continue
        shape = tuple(int(d) for d in tensor.dims)
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if count <= min_elements:
            continue
        entries = _external_entries(tensor)
        location = entries.get("location", "")
        path = os.path.realpath(os.path.join(root, location))
        if not location or os.path.isabs(location) or os.path.commonpath([root, path]) != root \
                or not os.path.isfile(path):
            continue  # onnx's loader reports it with its own message
        try:
            offset = int(entries.get("offset", "0"))
            length = int(entries["length"]) if "length" in entries else None
        except ValueError:
            continue
        dtype = np.dtype(_NUMPY[tensor.data_type])
        nbytes = count * dtype.itemsize
        if length is not None and length != nbytes:
            raise ModelLoadError(
                f"initializer {tensor.name!r} declares {length} bytes of external data in {location!r} but its "
                f"shape {shape} of {dtype} needs {nbytes}; the model and its data file do not match")
        source = _mapped_file(path)
        if offset < 0 or offset + nbytes > source.size:
            raise ModelLoadError(
                f"initializer {tensor.name!r} reads external data [{offset}, {offset + nbytes}) of {location!r}, "
                f"which has {source.size} bytes; keep the data files next to the model as saved")
        mapped[tensor.name] = source.array(offset, dtype, shape)
    return mapped


def load_external_data(proto: onnx.ModelProto, folder: str, mapped: dict | None, min_elements: int) -> None:
    """onnx's ``load_external_data_for_model``, except that with ``mapped`` (a dict) the eligible weights are
    mapped into it instead of read; they stay external in ``proto`` (which holds no bytes for them)."""
    if mapped is not None:
        mapped.update(map_external_initializers(proto, folder, min_elements))
    hidden = [t for t in proto.graph.initializer if mapped and t.name in mapped]
    for tensor in hidden:  # onnx's loader reads only tensors marked external
        tensor.data_location = onnx.TensorProto.DEFAULT
    try:
        onnx.external_data_helper.load_external_data_for_model(proto, folder)
    finally:
        for tensor in hidden:
            tensor.data_location = onnx.TensorProto.EXTERNAL
