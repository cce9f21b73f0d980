"""Access to the CUDA driver through cuda-python (or its simulator), and the probe that says why it is unusable.

Every import of ``cuda.bindings`` goes through this module so that a machine without cuda-python
or without an NVIDIA driver keeps the provider installed and merely *unavailable*, with a reason.
``ONNX_RUNTIME_CUDA_SIM=1`` swaps in ``onnx_runtime_ep_cuda.sim.driver``, which implements the subset
of ``cuda.bindings.driver`` the provider calls with the same names and return conventions; nothing
above this module knows which one it talks to.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib
import os
import sys

from onnx_runtime.errors import ProviderError

SIM_ENV = "ONNX_RUNTIME_CUDA_SIM"


def simulated() -> bool:
    """Whether the simulator switch is on (read on every call so tests can flip it)."""
    return os.environ.get(SIM_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def load_driver_module():
    """``cuda.bindings.driver``, or the simulator with the switch on; raise ImportError when missing."""
    if simulated():
        return importlib.import_module("onnx_runtime_ep_cuda.sim.driver")
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # cuda-python < 12.6 layout
    return driver


def _libcuda_present() -> bool:
    # cuda-python imports fine without a driver and only fails at the first call, deep in its loader;
    # looking for libcuda first gives the user the real reason.
    for candidate in ("libcuda.so.1", "libcuda.so"):
        try:
            ctypes.CDLL(candidate)
            return True
        except OSError:
            continue
    # On Linux find_library answers a soname that the loader above resolves through the same cache and paths,
    # and it runs ldconfig and gcc to find it: a machine without the driver (a CPU batch worker) paid that on
    # every probe. Elsewhere it is the only search.
    if sys.platform.startswith("linux"):
        return False
    found = ctypes.util.find_library("cuda")
    if not found:
        return False
    try:
        ctypes.CDLL(found)
        return True
    except OSError:
        return False


def probe() -> str:
    """"" when the driver (or the switched-on simulator) is usable, else the reason it is not."""
    return _probe(simulated())


@functools.lru_cache(maxsize=2)  # one answer per switch position: the machine does not change
def _probe(sim: bool) -> str:
    # libcuda first: without a driver, importing cuda-python (a noticeable share of a process start) is wasted
    if not sim and not _libcuda_present():
        return "no NVIDIA driver found (libcuda); install the NVIDIA driver on a machine with an NVIDIA GPU"
    try:
        driver = load_driver_module()
    except ImportError as exc:
        if sim:
            return f"the CUDA simulator could not be loaded ({exc}); unset {SIM_ENV} to use the real driver"
        return f"cuda-python is not installed ({exc}); install it with `pip install 'onnx-runtime[cuda]'`"
    try:
        (err,) = driver.cuInit(0)
        if int(err) != 0:
            return f"cuInit failed with {err_name(driver, err)}; check the driver installation and GPU visibility"
        err, count = driver.cuDeviceGetCount()
        if int(err) != 0:
            return f"cuDeviceGetCount failed with {err_name(driver, err)}"
    except Exception as exc:  # a broken driver stack must not take the process down
        return f"the CUDA driver could not be initialized: {type(exc).__name__}: {exc}"
    if count == 0:
        return "the NVIDIA driver reports no CUDA devices (check CUDA_VISIBLE_DEVICES)"
    return ""


class CudaDeviceFaultError(ProviderError):
    """A kernel faulted (illegal address, device assert, trap): the CUDA context was unusable and has been
    reset, so every tensor, graph and session on the device is lost. Create the session again."""


# Errors that leave a CUDA context unusable (an exception in device code): later calls all return them.
STICKY_ERRORS = frozenset({
    700,  # CUDA_ERROR_ILLEGAL_ADDRESS
    702,  # CUDA_ERROR_LAUNCH_TIMEOUT
    710,  # CUDA_ERROR_ASSERT
    714,  # CUDA_ERROR_HARDWARE_STACK_ERROR
    715,  # CUDA_ERROR_ILLEGAL_INSTRUCTION
    716,  # CUDA_ERROR_MISALIGNED_ADDRESS
    717,  # CUDA_ERROR_INVALID_ADDRESS_SPACE
    718,  # CUDA_ERROR_INVALID_PC
    719,  # CUDA_ERROR_LAUNCH_FAILED
})


def err_name(driver, err) -> str:
    """The driver's name for ``err`` (e.g. CUDA_ERROR_OUT_OF_MEMORY), falling back to its repr."""
    try:
        status, name = driver.cuGetErrorName(err)
        if int(status) == 0:
            return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # naming an error must never mask the error itself
        pass
    return str(err)


def check(driver, result, call: str):
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising a typed error naming ``call``.

    Returns None, the single value, or a tuple of the values.
    """
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise ProviderError(f"CUDAExecutionProvider: {call} failed with {err_name(driver, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def device_count() -> int:
    if probe():
        return 0
    driver = load_driver_module()
    return check(driver, driver.cuDeviceGetCount(), "cuDeviceGetCount")
