"""Access to the CUDA driver through cuda-python, and the probe that says why it is unusable.

Every import of ``cuda.bindings`` goes through this module so that a machine without cuda-python
or without an NVIDIA driver keeps the provider installed and merely *unavailable*, with a reason.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

from onnx_runtime.errors import ProviderError


def load_driver_module():
    """The ``cuda.bindings.driver`` module (cuda-python 12.6+), or raise ImportError."""
    try:
        from cuda.bindings import driver
    except ImportError:
        from cuda import cuda as driver  # cuda-python < 12.6 layout
    return driver


def _libcuda_present() -> bool:
    for candidate in ("libcuda.so.1", "libcuda.so", ctypes.util.find_library("cuda")):
        if not candidate:
            continue
        try:
            ctypes.CDLL(candidate)
            return True
        except OSError:
            continue
    return False


@functools.lru_cache(maxsize=1)
def probe() -> str:
    """"" when the driver is usable, else the reason it is not (cached: the machine does not change)."""
    try:
        driver = load_driver_module()
    except ImportError as exc:
        return f"cuda-python is not installed ({exc}); install it with `pip install 'onnx-runtime[cuda]'`"
    if not _libcuda_present():
        return "no NVIDIA driver found (libcuda); install the NVIDIA driver on a machine with an NVIDIA GPU"
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


def err_name(driver, err) -> str:
    try:
        status, name = driver.cuGetErrorName(err)
        return name.decode() if int(status) == 0 else str(err)
    except Exception:
        return str(err)


def check(driver, result, call: str):
    """Unpack a cuda-python ``(CUresult, *values)`` tuple, raising a typed error naming ``call``."""
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
