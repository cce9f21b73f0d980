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
            ctx.launch_1d(fn, x.numel, ptr(y), ptr(x), i64(x.numel))
            return (y,)
        return kernel

``ctx`` is the :class:`KernelContext` of the provider instance (device, handle, kernel loading,
output allocation, validation flags, launch sites).

Inputs whose values decide the output's shape (Reshape's shape, Slice's starts...) are declared with
``host_inputs``; such a factory takes a fifth argument, a :class:`HostInputs` holding the values of those
that are constants (initializers), so the kernel needs no device-to-host read for them:

    @register("Reshape", since=5, dtypes=MOVABLE, host_inputs=(1,))
    def reshape(node, shapes, opset, ctx, host):
        def kernel(x, shape):
            target = host.ints(1, shape)     # the constant, or read back when computed at run time
            ...

The provider answers the ``host_inputs`` hook from the same declaration, so the session knows which nodes
read a device value on the host (they keep a run from being captured into a device graph) and that every
other input is read on the device only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from onnx_runtime import DataType

from .context import host_value

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
    host_inputs: tuple[int, ...] = ()  # input positions whose values the kernel reads on the host

    def create(self, node, shapes, opset: int, ctx, graph):
        """The kernel for ``node``: the factory, given the constant host inputs when it declares any."""
        if self.host_inputs:
            return self.factory(node, shapes, opset, ctx, HostInputs(node, self.host_inputs, graph))
        return self.factory(node, shapes, opset, ctx)


class HostInputs:
    """The values of a node's declared host inputs that are constants (initializers of its graph).

    A constant keeps its value for the session's life, so the kernel reads it here; an input computed at
    run time is read back from the device at every call (a host synchronization, which is why the
    session will not capture such a run into a device graph).
    """

    __slots__ = ("_constants", "_ints")

    def __init__(self, node, positions: tuple[int, ...], graph):
        initializers = graph.initializers if graph is not None else {}
        self._constants: dict[int, np.ndarray] = {}
        for position in positions:
            name = node.inputs[position] if position < len(node.inputs) else ""
            if name and name in initializers:
                self._constants[position] = np.asarray(initializers[name])
        self._ints = {p: tuple(int(v) for v in value.reshape(-1)) for p, value in self._constants.items()
                      if value.dtype.kind in "iu"}

    def constant(self, position: int) -> np.ndarray | None:
        """The value of input ``position`` when it is a constant, else None."""
        return self._constants.get(position)

    def array(self, position: int, tensor) -> np.ndarray | None:
        """Input ``position``'s value on the host: the constant, or ``tensor`` read back (None if omitted)."""
        value = self._constants.get(position)
        if value is not None:
            return value
        if tensor is None:
            return None
        host = host_value(tensor)  # computed on the host (host_shapes.py): no read back
        return host if host is not None else tensor.numpy()

    def ints(self, position: int, tensor) -> tuple[int, ...] | None:
        """An integer input (a shape, starts, axes...) as a tuple of ints, or None when omitted."""
        values = self._ints.get(position)
        if values is not None:
            return values
        if tensor is None:
            return None
        host = host_value(tensor)  # see array()
        return tuple(int(v) for v in (host if host is not None else tensor.numpy()).reshape(-1))


_REGISTRY: dict[tuple[str, str], list[OpEntry]] = {}


def _domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def register(op_type: str, *, since: int = 1, domain: str = "", dtypes=FLOATS, typed_inputs=(0,), check=None,
             host_inputs: tuple[int, ...] = ()):
    """Register a CUDA kernel factory for ``op_type`` from opset ``since`` on.

    ``host_inputs``: input positions whose values the kernel reads on the host; the factory then takes a
    fifth argument, the :class:`HostInputs` (see the module docstring).
    """

    def decorate(factory):
        entries = _REGISTRY.setdefault((_domain(domain), op_type), [])
        entries.append(OpEntry(since, factory, frozenset(dtypes), typed_inputs, check, tuple(host_inputs)))
        entries.sort(key=lambda e: e.since)
        return factory

    return decorate


def lookup(op_type: str, domain: str, opset: int) -> OpEntry | None:
    chosen = None
    for entry in _REGISTRY.get((_domain(domain), op_type), ()):
        if entry.since <= opset:
            chosen = entry
    return chosen


def declared_host_inputs(node, opset: int) -> tuple[int, ...] | None:
    """The positions of ``node``'s present inputs that its kernel reads on the host (None: no kernel)."""
    entry = lookup(node.op_type, node.domain, opset)
    if entry is None:
        return None
    return tuple(p for p in entry.host_inputs if p < len(node.inputs) and node.inputs[p])


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
