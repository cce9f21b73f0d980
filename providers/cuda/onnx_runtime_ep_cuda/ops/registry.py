"""The CUDA provider's operator registry: (domain, op_type) and opset range -> a kernel entry.

An entry says which input element types it accepts, may add a structural ``check`` (returning the
reason a particular node cannot run here, e.g. an attribute value the kernel does not implement), and
holds the kernel *factory*. ``supports_op`` turns a miss into an actionable reason, so placement runs
the node on the next provider with copies inserted.

The factory runs once per (node, input shapes) at session creation:

    @register("Relu", since=6, dtypes=FLOATS)
    def relu(node, shapes, opset, ctx):
        fn = ctx.function("elementwise.cu", "relu_f32")
        def kernel(x):                      # x: onnx_runtime.Tensor on this device
            y = ctx.empty_like(x)
            ctx.launch_1d(fn, x.numel, y.device_ptr, x.device_ptr, x.numel)
            return (y,)
        return kernel

``ctx`` is the :class:`KernelContext` of the provider instance (device, handle, kernel loading,
output allocation, validation flags).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from onnx_runtime import DataType

FLOATS = frozenset({DataType.FLOAT, DataType.FLOAT16, DataType.BFLOAT16})
INTEGERS = frozenset({DataType.INT8, DataType.UINT8, DataType.INT16, DataType.INT32, DataType.INT64,
                      DataType.UINT32, DataType.UINT64})
NUMERIC = FLOATS | INTEGERS
ALL = NUMERIC | {DataType.BOOL, DataType.DOUBLE}


@dataclass(frozen=True)
class OpEntry:
    since: int
    factory: Callable
    dtypes: frozenset  # element types accepted for the inputs named by ``typed_inputs``
    typed_inputs: tuple[int, ...] | None  # input positions whose dtype must be in ``dtypes`` (None: all)
    check: Callable | None  # check(node, shapes, dtypes) -> reason str, or None when runnable


_REGISTRY: dict[tuple[str, str], list[OpEntry]] = {}


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def register(op_type: str, *, since: int = 1, domain: str = "", dtypes=FLOATS, typed_inputs=(0,), check=None):
    """Register a CUDA kernel factory for ``op_type`` from opset ``since`` on."""

    def decorate(factory):
        entries = _REGISTRY.setdefault((_domain(domain), op_type), [])
        entries.append(OpEntry(since, factory, frozenset(dtypes), typed_inputs, check))
        entries.sort(key=lambda e: e.since)
        return factory

    return decorate


def lookup(op_type: str, domain: str, opset: int) -> OpEntry | None:
    chosen = None
    for entry in _REGISTRY.get((_domain(domain), op_type), ()):
        if entry.since <= opset:
            chosen = entry
    return chosen


def unsupported_reason(node, opset: int, shapes, dtypes) -> str | None:
    """Why the CUDA provider cannot run ``node`` (None when it can)."""
    entry = lookup(node.op_type, node.domain, opset)
    if entry is None:
        versions = [e.since for e in _REGISTRY.get((_domain(node.domain), node.op_type), ())]
        if versions:
            return (f"CUDAExecutionProvider implements {node.op_type} from opset {versions[0]}, the model uses "
                    f"opset {opset}")
        return f"CUDAExecutionProvider has no kernel for {node.domain or 'ai.onnx'}::{node.op_type}"
    positions = range(len(dtypes)) if entry.typed_inputs is None else entry.typed_inputs
    for position in positions:
        if position < len(dtypes) and node.inputs[position] and dtypes[position] is not None \
                and dtypes[position] not in entry.dtypes:
            accepted = ", ".join(sorted(d.name.lower() for d in entry.dtypes))
            return (f"CUDAExecutionProvider runs {node.op_type} on {accepted}, input {position} is "
                    f"{dtypes[position].name.lower()}")
    if entry.check is not None:
        return entry.check(node, shapes, dtypes)
    return None


def registered_ops() -> list[tuple[str, str]]:
    return sorted(_REGISTRY)
