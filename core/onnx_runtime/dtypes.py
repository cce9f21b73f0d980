"""Element types: every ONNX tensor type, its numpy/ml_dtypes dtype, and checked byte-size math."""

from __future__ import annotations

import enum
import sys

import ml_dtypes
import numpy as np

from .errors import InvalidArgumentError, ShapeOverflowError

# The largest byte count one allocation may have: the host's address space.
MAX_BYTES = sys.maxsize


class DataType(enum.IntEnum):
    """ONNX ``TensorProto.DataType`` codes. ``int(dt)`` is the ONNX elem_type."""

    UNDEFINED = 0
    FLOAT = 1
    UINT8 = 2
    INT8 = 3
    UINT16 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    STRING = 8
    BOOL = 9
    FLOAT16 = 10
    DOUBLE = 11
    UINT32 = 12
    UINT64 = 13
    COMPLEX64 = 14
    COMPLEX128 = 15
    BFLOAT16 = 16
    FLOAT8E4M3FN = 17
    FLOAT8E4M3FNUZ = 18
    FLOAT8E5M2 = 19
    FLOAT8E5M2FNUZ = 20
    UINT4 = 21
    INT4 = 22
    FLOAT4E2M1 = 23
    FLOAT8E8M0 = 24
    UINT2 = 25
    INT2 = 26
    FLOAT6E2M3 = 27
    FLOAT6E3M2 = 28

    # -- numpy interop -------------------------------------------------------------------------
    @property
    def numpy(self) -> np.dtype:
        """The numpy (or ml_dtypes) dtype holding one element of this type."""
        try:
            return _TO_NUMPY[self]
        except KeyError:
            raise InvalidArgumentError(f"data type {self.name} has no numpy representation") from None

    @classmethod
    def from_numpy(cls, dtype) -> DataType:
        """The DataType of a numpy dtype; strings (``str``/``bytes``/``object``) map to STRING."""
        dtype = np.dtype(dtype)
        if dtype.kind in "OUS":
            return cls.STRING
        try:
            return _FROM_NUMPY[dtype]
        except KeyError:
            raise InvalidArgumentError(
                f"numpy dtype {dtype} has no ONNX tensor type; convert the array to one of "
                f"{sorted(str(d) for d in _FROM_NUMPY)}"
            ) from None

    @classmethod
    def parse(cls, value) -> DataType:
        """Accept a DataType, an ONNX elem_type int, a name like ``"float16"``, or a numpy dtype."""
        if isinstance(value, DataType):
            return value
        if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return cls(int(value))
        if isinstance(value, str):
            key = value.upper().replace("TENSOR(", "").rstrip(")")
            aliases = {"FLOAT32": "FLOAT", "FLOAT64": "DOUBLE", "HALF": "FLOAT16"}
            key = aliases.get(key, key)
            if key in cls.__members__:
                return cls[key]
        return cls.from_numpy(value)

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def bits(self) -> int:
        """Storage bits per element (4 for int4/uint4/float4, 2 for int2/uint2)."""
        if self in _SUB_BYTE_BITS:
            return _SUB_BYTE_BITS[self]
        if self is DataType.STRING:
            raise InvalidArgumentError("string tensors have no fixed element size")
        return self.numpy.itemsize * 8

    @property
    def is_packed(self) -> bool:
        """Whether elements are stored in fewer than 8 bits (int4, uint4, float4, int2, uint2, float6)."""
        return self in _SUB_BYTE_BITS

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    def storage_bytes(self, numel: int) -> int:
        """Bytes needed to store ``numel`` packed elements (sub-byte types round up)."""
        return self.checked_storage_bytes(numel)

    def checked_storage_bytes(self, numel: int) -> int:
        """Like :meth:`storage_bytes`, raising :class:`ShapeOverflowError` past the address space."""
        if numel < 0:
            raise InvalidArgumentError(f"element count must be non-negative, got {numel}")
        nbytes = (numel * self.bits + 7) // 8
        if nbytes > MAX_BYTES:
            raise ShapeOverflowError(
                f"{numel} elements of {self.name} need {nbytes} bytes, more than the "
                f"{MAX_BYTES}-byte address space; use a smaller shape"
            )
        return nbytes

    def __str__(self) -> str:  # onnxruntime spells types as "tensor(float)"
        return _ORT_NAMES.get(self, self.name.lower())

    @property
    def ort_type(self) -> str:
        """The onnxruntime type string, e.g. ``"tensor(float)"``."""
        return f"tensor({self})"


_TO_NUMPY: dict[DataType, np.dtype] = {
    DataType.FLOAT: np.dtype(np.float32),
    DataType.UINT8: np.dtype(np.uint8),
    DataType.INT8: np.dtype(np.int8),
    DataType.UINT16: np.dtype(np.uint16),
    DataType.INT16: np.dtype(np.int16),
    DataType.INT32: np.dtype(np.int32),
    DataType.INT64: np.dtype(np.int64),
    DataType.STRING: np.dtype(object),
    DataType.BOOL: np.dtype(np.bool_),
    DataType.FLOAT16: np.dtype(np.float16),
    DataType.DOUBLE: np.dtype(np.float64),
    DataType.UINT32: np.dtype(np.uint32),
    DataType.UINT64: np.dtype(np.uint64),
    DataType.COMPLEX64: np.dtype(np.complex64),
    DataType.COMPLEX128: np.dtype(np.complex128),
    DataType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DataType.FLOAT8E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
    DataType.FLOAT8E4M3FNUZ: np.dtype(ml_dtypes.float8_e4m3fnuz),
    DataType.FLOAT8E5M2: np.dtype(ml_dtypes.float8_e5m2),
    DataType.FLOAT8E5M2FNUZ: np.dtype(ml_dtypes.float8_e5m2fnuz),
    DataType.UINT4: np.dtype(ml_dtypes.uint4),
    DataType.INT4: np.dtype(ml_dtypes.int4),
    DataType.FLOAT4E2M1: np.dtype(ml_dtypes.float4_e2m1fn),
    DataType.FLOAT8E8M0: np.dtype(ml_dtypes.float8_e8m0fnu),
    DataType.UINT2: np.dtype(ml_dtypes.uint2),
    DataType.INT2: np.dtype(ml_dtypes.int2),
    DataType.FLOAT6E2M3: np.dtype(ml_dtypes.float6_e2m3fn),
    DataType.FLOAT6E3M2: np.dtype(ml_dtypes.float6_e3m2fn),
}
_FROM_NUMPY = {v: k for k, v in _TO_NUMPY.items() if k is not DataType.STRING}
_SUB_BYTE_BITS = {
    DataType.UINT4: 4,
    DataType.INT4: 4,
    DataType.FLOAT4E2M1: 4,
    DataType.UINT2: 2,
    DataType.INT2: 2,
    DataType.FLOAT6E2M3: 6,
    DataType.FLOAT6E3M2: 6,
}
_FLOATS = {
    DataType.FLOAT, DataType.FLOAT16, DataType.DOUBLE, DataType.BFLOAT16, DataType.FLOAT8E4M3FN,
    DataType.FLOAT8E4M3FNUZ, DataType.FLOAT8E5M2, DataType.FLOAT8E5M2FNUZ, DataType.FLOAT4E2M1,
    DataType.FLOAT8E8M0, DataType.FLOAT6E2M3, DataType.FLOAT6E3M2,
}
_ORT_NAMES = {DataType.FLOAT: "float", DataType.DOUBLE: "double", DataType.BOOL: "bool"}


def checked_numel(shape) -> int:
    """Element count of ``shape``; rejects negative dims and counts past the address space."""
    numel = 1
    for dim in shape:
        dim = int(dim)
        if dim < 0:
            raise InvalidArgumentError(f"shape {tuple(shape)} has a negative dimension")
        numel *= dim
    if numel > MAX_BYTES:
        raise ShapeOverflowError(
            f"shape {tuple(shape)} has {numel} elements, more than the address space can hold"
        )
    return numel


def checked_expected_bytes(dtype: DataType, shape) -> int:
    """Storage bytes of a dense ``shape`` of ``dtype``, overflow-checked."""
    return DataType.parse(dtype).checked_storage_bytes(checked_numel(shape))
