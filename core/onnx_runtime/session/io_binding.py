"""``IOBinding``: inputs and outputs bound to values on the host or a device, as onnxruntime's.

Bound device inputs are read where they are, and outputs bound to a device stay there, so a loop of
runs (decode steps, say) need not cross the host. What each binding means:

- an input bound as a device tensor (``bind_ortvalue_input``, or ``bind_input`` with a buffer address,
  borrowed and never freed here) is consumed in place by nodes on that device;
- an output bound to a device without a buffer gets the value produced there (or a copy moved there),
  held by the binding until the next run or ``clear_binding_outputs``;
- an output bound to a buffer (``bind_ortvalue_output``, or ``bind_output`` with an address) is written
  in place: a device-to-device copy when the kernel produced its own buffer.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..contract.buffers import DeviceBuffer, Ownership
from ..dtypes import DataType
from ..errors import InvalidArgumentError
from ..ort_value import OrtValue, element_type_of
from ..provider_handle import ProviderHandle
from ..records import Record
from ..tensor import Tensor

_MAX_ALIGNMENT = 256


class _Output(Record):
    __match_args__ = ("handle", "target", "result")
    handle: ProviderHandle  # where the value must end up
    target: OrtValue | None  # a caller's buffer the run writes into
    result: OrtValue | None

    def __init__(self, handle: ProviderHandle, target: OrtValue | None = None, result: OrtValue | None = None) -> None:
        self.handle = handle
        self.target = target
        self.result = result


class IOBinding:
    """Created by :meth:`InferenceSession.io_binding`; run with :meth:`InferenceSession.run_with_iobinding`."""

    def __init__(self, session):
        self._session = session
        self._inputs: dict[str, object] = {}  # name -> numpy array or Tensor
        self._keep: dict[str, OrtValue] = {}  # the OrtValues behind bound input tensors, kept alive
        self._outputs: dict[str, _Output] = {}

    # -- inputs ----------------------------------------------------------------------------------------
    def bind_cpu_input(self, name: str, array) -> None:
        self._inputs[name] = self._session._checked_input(name, array)
        self._keep.pop(name, None)

    def bind_input(self, name: str, device_type: str, device_id: int, element_type, shape, buffer_ptr: int) -> None:
        """Bind the caller's buffer at ``buffer_ptr`` (borrowed: it is read, never freed)."""
        tensor = self._borrow(device_type, device_id, element_type, shape, buffer_ptr, writable=False)
        self.bind_ortvalue_input(name, OrtValue(tensor))

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        tensor = _tensor_of(ortvalue, f"input {name!r}")
        self._session._check_bound(name, tensor, output=False)
        self._inputs[name] = tensor
        self._keep[name] = ortvalue

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()
        self._keep.clear()

    # -- outputs ---------------------------------------------------------------------------------------
    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0, element_type=None, shape=None,
                    buffer_ptr: int | None = None) -> None:
        """Without ``buffer_ptr`` the session allocates the output on the device; with it (and ``element_type``
        and ``shape``), the run writes into that buffer."""
        if buffer_ptr is None:
            self._session._check_output_name(name)
            self._outputs[name] = _Output(self._session._device_handle(device_type, device_id))
            return
        if element_type is None or shape is None:
            raise InvalidArgumentError(
                f"bind_output({name!r}) with buffer_ptr needs element_type and shape, to know the buffer's extent"
            )
        tensor = self._borrow(device_type, device_id, element_type, shape, buffer_ptr, writable=True)
        self.bind_ortvalue_output(name, OrtValue(tensor))

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        tensor = _tensor_of(ortvalue, f"output {name!r}")
        self._session._check_bound(name, tensor, output=True)
        self._outputs[name] = _Output(tensor.provider, target=ortvalue)

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()

    def get_outputs(self) -> list[OrtValue]:
        """The outputs of the last run, in binding order, where they were bound."""
        missing = [name for name, out in self._outputs.items() if out.result is None]
        if missing:
            raise InvalidArgumentError(f"outputs {missing} have no value yet; call run_with_iobinding first")
        return [out.result for out in self._outputs.values() if out.result is not None]  # all set: checked above

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        values = self.get_outputs()
        self._session._executor.settle_validation()  # a host-visible read: raise what the run's kernels flagged
        return [np.array(value.numpy(), copy=True) for value in values]

    # -- ordering --------------------------------------------------------------------------------------
    def synchronize_inputs(self) -> None:
        _sync(value.provider for value in self._inputs.values() if isinstance(value, Tensor))

    def synchronize_outputs(self) -> None:
        _sync(out.handle for out in self._outputs.values())
        self._session._executor.settle_validation()  # the outputs are complete: raise what their kernels flagged

    # -- the session's side ----------------------------------------------------------------------------
    def _feeds(self) -> dict:
        return dict(self._inputs)

    def _output_names(self) -> tuple[str, ...]:
        return tuple(self._outputs)

    def _device_outputs(self) -> bool:
        return any(not out.handle.is_host_accessible for out in self._outputs.values())

    def _outputs_stay_on_devices(self) -> bool:
        return all(not out.handle.is_host_accessible for out in self._outputs.values())

    def _copied_outputs(self) -> frozenset[str]:
        """Outputs written into a bound buffer by :meth:`_deliver`, right after the run."""
        return frozenset(name for name, out in self._outputs.items() if out.target is not None)

    def _deliver(self, values: list) -> None:
        """Store a run's outputs: moved to their bound device, or written into their bound buffer."""
        for (name, out), value in zip(self._outputs.items(), values):
            if out.target is not None:
                _write_into(name, out.target.tensor, value)
                out.result = out.target
            else:
                out.result = OrtValue(_moved(value, out.handle))

    def _borrow(self, device_type, device_id, element_type, shape, buffer_ptr, writable: bool) -> Tensor:
        handle = self._session._device_handle(device_type, device_id)
        dtype = element_type_of(element_type)
        shape = tuple(int(d) for d in shape)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.numpy.itemsize
        ptr = int(buffer_ptr)
        if not ptr:
            raise InvalidArgumentError("buffer_ptr is null; pass the address of an allocated buffer")
        host = None
        if handle.is_host_accessible:  # host memory the caller owns: view it so host kernels can read it
            host = np.ctypeslib.as_array((ctypes.c_uint8 * max(nbytes, 1)).from_address(ptr))
        alignment = min(ptr & -ptr, _MAX_ALIGNMENT)
        ownership = Ownership.BORROWED_MUT if writable else Ownership.BORROWED
        buffer = DeviceBuffer(handle.device_id, nbytes, alignment, ptr, ownership, host=host)
        return Tensor(dtype, shape, buffer, handle)


def _tensor_of(ortvalue, what: str) -> Tensor:
    if not isinstance(ortvalue, OrtValue):
        raise InvalidArgumentError(f"{what} must be bound to an OrtValue, got {type(ortvalue).__name__}")
    if ortvalue.tensor.closed:
        raise InvalidArgumentError(f"{what}: the OrtValue's tensor was closed; bind a live value")
    return ortvalue.tensor


def _sync(handles) -> None:
    for handle in {id(h): h for h in handles}.values():
        handle.sync()


def _host_tensor(array: np.ndarray | np.generic) -> Tensor:
    """Wrap a run's host output without copying it when it can be aliased."""
    array = np.asarray(array)
    if array.dtype.kind in "OUS" or not array.flags.c_contiguous:
        return Tensor.from_numpy(array)
    return Tensor.from_borrowed(array, guard=array, writable=True)


def _moved(value, handle: ProviderHandle) -> Tensor:
    """``value`` (an array, or a Tensor anywhere) as a Tensor on ``handle``'s device."""
    if isinstance(value, Tensor):
        if value.device == handle.device_id:
            return value
        value = value.numpy()  # across devices: through the host
    if not isinstance(value, np.ndarray | np.generic):
        raise InvalidArgumentError(f"IO binding binds tensors; the output is a {type(value).__name__}")
    return _host_tensor(value) if handle.is_host_accessible else Tensor.from_numpy(value, provider=handle)


def copy_on_device(provider: ProviderHandle, src: DeviceBuffer, dst: DeviceBuffer, nbytes: int) -> None:
    """Copy ``nbytes`` between two buffers on ``provider``'s device, stream-ordered where the provider
    offers it: the contract's ``copy`` is synchronous (it waits for the device), a host synchronization
    nothing here needs, since whatever reads ``dst`` next (a kernel, a download) is ordered after it."""
    if provider.implements("copy_device_to_device"):
        provider.hook.copy_device_to_device(src=src, src_offset=0, dst=dst, dst_offset=0, nbytes=nbytes)
    else:
        provider.hook.copy(src=src, dst=dst, size=nbytes)


def _write_into(name: str, target: Tensor, value) -> None:
    shape = tuple(value.shape)
    dtype = value.dtype if isinstance(value, Tensor) else DataType.from_numpy(np.asarray(value).dtype)
    if shape != target.shape or dtype is not target.dtype:
        raise InvalidArgumentError(
            f"output {name!r} is {dtype.ort_type} of shape {list(shape)}, but its bound buffer holds "
            f"{target.dtype.ort_type} of shape {list(target.shape)}; bind a buffer of that type and shape"
        )
    if not target.nbytes:
        return
    if isinstance(value, Tensor) and value.device == target.device and not target.provider.is_host_accessible:
        if value.device_ptr != target.device_ptr:  # the kernel wrote its own buffer: copy on the device, on the
            copy_on_device(value.provider, value.buffer, target.buffer, target.nbytes)  # producer's stream
        return
    array = np.ascontiguousarray(value.numpy() if isinstance(value, Tensor) else value)
    if target.provider.is_host_accessible:
        np.copyto(target.numpy(), array)
    else:
        target.provider.copy_from_host(array, target.buffer)
