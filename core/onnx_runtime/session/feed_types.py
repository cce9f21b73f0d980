"""A feed's or an output's element type and shape against the model's declaration (the checks every run makes,
formatted only when they fail)."""

from __future__ import annotations

import numpy as np

from ..dtypes import DataType
from ..errors import InvalidArgumentError
from ..ir import TypeInfo


def check_type_and_shape(kind: str, name: str, dtype: DataType, shape, expected: TypeInfo,
                          array_dtype: np.dtype | None = None) -> None:
    """``kind`` ("input"/"output") ``name``'s element type and shape against the model's declaration
    (``array_dtype``: the numpy dtype of a fed array, named in the error; formatted only on failure,
    as runs check every feed)."""
    if expected.dtype is not None and dtype is not expected.dtype:
        hint = (f"; convert it with .astype(np.{expected.dtype.numpy.name})"
                if expected.dtype is not DataType.STRING else "")
        described = f"{array_dtype} array" if array_dtype is not None else dtype.ort_type
        raise InvalidArgumentError(f"{kind} {name!r} expects {expected.dtype.ort_type}, got {described}{hint}")
    if expected.shape is not None:
        if len(shape) != len(expected.shape):
            raise InvalidArgumentError(
                f"{kind} {name!r} expects rank {len(expected.shape)} ({expected.describe()}), got shape "
                f"{list(shape)}"
            )
        for axis, (want, got) in enumerate(zip(expected.shape, shape)):
            if isinstance(want, int) and want != got:
                raise InvalidArgumentError(
                    f"{kind} {name!r} dimension {axis} must be {want} ({expected.describe()}), got shape "
                    f"{list(shape)}"
                )
