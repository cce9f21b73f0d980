"""Entry point of the ``onnx_runtime.providers`` group: contributes CUDAExecutionProvider.

The provider is described, not imported: its module pulls in every CUDA op and kernel, which a process that
asks only for other providers (or runs where no device exists) should not pay for at each start. The class is
imported when a session creates the provider; whether a device exists is asked of the driver probe alone.
"""

from onnx_runtime import Availability, hookimpl
from onnx_runtime.contract.deferred import DeferredProvider

NAME = "CUDAExecutionProvider"
CONTRACT_VERSION = "1.5"


def _load():
    from .provider import CUDAExecutionProvider

    return CUDAExecutionProvider


def _probe() -> Availability:
    from . import driver  # (cuda-python itself is imported by the probe, not here)

    reason = driver.probe()
    return Availability.no(reason) if reason else Availability.yes()


PROVIDER = DeferredProvider(name=NAME, short_name="cuda", device="cuda:0", contract_version=CONTRACT_VERSION,
                            load=_load, probe=_probe)


@hookimpl
def onnx_runtime_providers():
    return [PROVIDER]
