"""Strict kernels: every kernel call checked against the node it runs (session config ``session.strict_kernels``).

A provider's kernel is called directly by the run loop, which trusts it: a kernel that returns a bare array, the
wrong number of outputs, a dtype or shape other than the node's, or that writes into an input it was handed,
would otherwise give a wrong result somewhere downstream, or change the caller's feed array. In strict mode each
call is checked, and the first broken rule raises a :class:`KernelContractError` naming the provider, the node and
the rule, with what to fix. The checks cost a checksum of every host input per call: they are for testing a
provider (the ``onnx_runtime.testing`` pytest plugin turns them on), not for serving.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..dtypes import DataType
from ..errors import KernelError
from ..ir import Graph, Node
from ..tensor import Tensor

STRICT_KEY = "session.strict_kernels"  # "1": check every kernel call (this module)


class KernelContractError(KernelError):
    """A kernel broke the contract's rules for its outputs or inputs (strict mode)."""


def strict_kernel(kernel, node: Node, graph: Graph, provider: str):
    """``kernel`` wrapped so that each call is checked against ``node`` (its outputs' declared types and shapes in
    ``graph``); the wrapper keeps ``kernel``'s other attributes reachable for the executor's own checks."""
    declared = [graph.type_of(name) if name else None for name in node.outputs]
    where = f"{provider}'s kernel for node {node.name!r} ({node.op_type})"

    def checked(*inputs):
        before = [_checksum(value) for value in inputs]
        results = kernel(*inputs)
        if not isinstance(results, (tuple, list)):
            raise KernelContractError(
                f"{where} returned a {type(results).__name__}; a kernel returns a tuple with one value per output "
                f"(return `(value,)` for one output)")
        if len(results) != len(node.outputs):
            raise KernelContractError(
                f"{where} returned {len(results)} values; the node has {len(node.outputs)} outputs "
                f"{node.outputs}: return one value per output, in order")
        for index, (value, info) in enumerate(zip(results, declared)):
            _check_output(where, node.outputs[index], value, info)
        for index, (value, digest) in enumerate(zip(inputs, before)):
            if digest is not None and _checksum(value) != digest:
                raise KernelContractError(
                    f"{where} wrote into its input {index} ({node.inputs[index]!r}); inputs are read-only (they may be "
                    f"the caller's feed arrays or another node's outputs): compute into a new array")
        return results

    checked.__wrapped__ = kernel  # type: ignore[attr-defined]
    for name, value in vars(kernel).items() if hasattr(kernel, "__dict__") else ():
        if not name.startswith("__"):
            setattr(checked, name, value)
    return checked


def _check_output(where: str, name: str, value, info) -> None:
    if info is None or not info.is_tensor or value is None:
        return
    dtype, shape = _dtype_and_shape(value)
    if dtype is None:
        raise KernelContractError(
            f"{where} returned a {type(value).__name__} for output {name!r}, which the model declares a tensor; "
            f"return a numpy array (or a Tensor on the provider's device)")
    if info.dtype is not None and dtype is not info.dtype:
        raise KernelContractError(
            f"{where} returned {dtype.ort_type} for output {name!r}; the node's output is {info.dtype.ort_type}: "
            f"cast the result (e.g. `.astype(np.{info.dtype.numpy.name})`)")
    if info.shape is not None:
        if len(shape) != len(info.shape) or any(isinstance(want, int) and want != got
                                                 for want, got in zip(info.shape, shape)):
            raise KernelContractError(
                f"{where} returned shape {list(shape)} for output {name!r}; the node's output is "
                f"{info.describe()}: compute the output shape as the operator's specification says")


def _dtype_and_shape(value) -> tuple[DataType | None, tuple]:
    if isinstance(value, Tensor):
        return value.dtype, tuple(value.shape)
    if isinstance(value, np.ndarray | np.generic):
        try:
            return DataType.from_numpy(value.dtype), tuple(np.shape(value))
        except Exception:  # a dtype with no ONNX type
            return None, ()
    return None, ()


def _checksum(value) -> int | None:
    """A digest of a host input's bytes (None for what strict mode cannot read without a device copy)."""
    if isinstance(value, Tensor):
        if not value.provider.is_host_accessible:
            return None
        value = value.numpy()
    if not isinstance(value, np.ndarray) or value.dtype.kind == "O":
        return None
    data = np.ascontiguousarray(value).reshape(-1)
    return zlib.crc32(data.view(np.uint8).data) ^ hash(value.shape)
