"""A third-party provider on a simulated device that the host cannot read.

Its memory is a private table of bytearrays: buffers carry opaque addresses and no host view, so
everything crossing the boundary must go through the contract's copy hooks. It runs Relu, Add and
Mul on float32 (kernels take and return onnx_runtime.Tensor on its device) and claims the nodes
named in its ``claim`` option. onnx-runtime's tests use it to exercise placement and copies.

It implements device graphs through the single-slot hooks only (the seed's historical contract, one
graph per provider; the contract's defaults route the slot and owner-scoped hooks to them): a capture
records each kernel launch with the addresses it reads and writes instead of running it, and a replay
runs the recorded launches on whatever those buffers hold then.
"""

from __future__ import annotations

import itertools

import numpy as np
from onnx_runtime import DataType, DeviceBuffer, DeviceId, DeviceType, KernelMatch, Tensor, hookimpl
from onnx_runtime.contract import host_bytes_of, writable_host_bytes_of
from onnx_runtime.errors import InvalidArgumentError

SAMPLE_DEVICE = DeviceId(DeviceType.OTHER, 7)
OPS = {"Relu": lambda a: np.maximum(a, 0), "Add": np.add, "Mul": np.multiply}


class SampleDeviceExecutionProvider:
    def __init__(self):
        self.memory: dict[int, bytearray] = {}
        self.allocations = 0
        self.frees = 0
        self.claim: list[str] = []
        self.handle = None
        self._addresses = itertools.count(0x1000, 0x1000)
        self._recording: list | None = None  # the launches of the capture in progress
        self._graph: list | None = None  # the installed graph's launches
        self.graph_launches = 0  # launches run by replays

    @hookimpl
    def name(self):
        return "SampleDeviceExecutionProvider"

    @hookimpl
    def short_name(self):
        return "sample"

    @hookimpl
    def contract_version(self):
        return "1.1"

    @hookimpl
    def selected_by_default(self):
        return False  # a test provider: installing it must not change what plain sessions run on

    @hookimpl
    def device_type(self):
        return DeviceType.OTHER

    @hookimpl
    def device_id(self):
        return SAMPLE_DEVICE

    @hookimpl
    def initialize(self, options, handle):
        self.handle = handle  # the handle this instance is dispatched through
        unknown = set(options) - {"claim"}
        if unknown:
            raise InvalidArgumentError(f"SampleDeviceExecutionProvider accepts only 'claim', got {sorted(unknown)}")
        self.claim = [n for n in options.get("claim", "").split(",") if n]

    @hookimpl
    def claim_nodes(self, graph):
        return [node.name for node in graph.nodes if node.name in self.claim]

    @hookimpl
    def supports_op(self, node, dtypes):
        if node.domain or node.op_type not in OPS:
            return KernelMatch.unsupported(f"SampleDeviceExecutionProvider runs only {sorted(OPS)}")
        if any(d is not DataType.FLOAT for d in dtypes):
            return KernelMatch.unsupported("SampleDeviceExecutionProvider runs float32 tensors only")
        return KernelMatch.supported(cost=0.5)

    @hookimpl
    def get_kernel(self, node):
        fn = OPS[node.op_type]

        def kernel(*inputs: Tensor):
            if self._recording is None:
                result = np.asarray(fn(*[t.numpy() for t in inputs]), dtype=np.float32)
                return (Tensor.from_numpy(result, provider=inputs[0].provider),)
            out = Tensor.empty(DataType.FLOAT, np.broadcast_shapes(*(t.shape for t in inputs)),
                               provider=inputs[0].provider)
            self._recording.append((fn, [(t.buffer, t.shape) for t in inputs], out.buffer, out.shape))
            return (out,)

        return kernel

    # -- memory: a private table the host cannot address ---------------------------------------------
    @hookimpl
    def allocate(self, size, alignment):
        address = next(self._addresses)
        self.memory[address] = bytearray(size)
        self.allocations += 1
        return DeviceBuffer(SAMPLE_DEVICE, size, alignment, address)

    @hookimpl
    def deallocate(self, buffer):
        del self.memory[buffer.ptr]
        self.frees += 1

    @hookimpl
    def device_allocation_counts(self):
        return (self.allocations, self.frees)

    def _bytes(self, buffer: DeviceBuffer) -> np.ndarray:
        base = max(a for a in self.memory if a <= buffer.ptr)  # aliases point inside an allocation
        view = np.frombuffer(self.memory[base], np.uint8)
        return view[buffer.ptr - base: buffer.ptr - base + buffer.size]

    @hookimpl
    def copy_from_host(self, src, dst):
        data = host_bytes_of(src)
        if data.size > dst.size:
            raise InvalidArgumentError(f"upload of {data.size} B exceeds the {dst.size}-byte buffer")
        self._bytes(dst)[: data.size] = data

    @hookimpl
    def copy_to_host(self, src, dst):
        target = writable_host_bytes_of(dst)
        if target.size > src.size:
            raise InvalidArgumentError(f"download of {target.size} B exceeds the {src.size}-byte buffer")
        target[:] = self._bytes(src)[: target.size]

    @hookimpl
    def copy(self, src, dst, size):
        self._bytes(dst)[:size] = self._bytes(src)[:size]

    @hookimpl
    def sync(self):
        return None

    # -- device graphs: the single-slot hooks -----------------------------------------------------
    def _float32(self, buffer: DeviceBuffer, shape) -> np.ndarray:
        return self._bytes(buffer).view(np.float32).reshape(shape)

    @hookimpl
    def begin_device_graph_capture(self, kernels):
        if self._recording is not None:
            raise InvalidArgumentError("SampleDeviceExecutionProvider: a device graph capture is already in progress")
        self._recording = []

    @hookimpl
    def end_device_graph_capture(self):
        if self._recording is None:
            raise InvalidArgumentError("SampleDeviceExecutionProvider: no device graph capture is in progress")
        self._graph, self._recording = self._recording, None  # replaces the graph installed before

    @hookimpl
    def abort_device_graph_capture(self):
        self._recording = None

    @hookimpl
    def replay_device_graph(self):
        if self._graph is None:
            raise InvalidArgumentError("SampleDeviceExecutionProvider: no device graph is installed; capture one")
        for fn, inputs, out, shape in self._graph:
            self._float32(out, shape)[...] = fn(*[self._float32(b, s) for b, s in inputs])
            self.graph_launches += 1

    @hookimpl
    def reset_device_graph(self):
        installed, self._graph = self._graph is not None, None
        return installed


@hookimpl
def onnx_runtime_providers():
    return [SampleDeviceExecutionProvider]
