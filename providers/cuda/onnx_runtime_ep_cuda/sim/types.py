"""The simulated driver's constants, enums (values are CUDA's) and opaque handle types."""

from __future__ import annotations

import ctypes
import enum

MEMORY_ENV = "ONNX_RUNTIME_CUDA_SIM_MEMORY"  # simulated device memory in bytes (default 16 GiB)
DEFERRED_ENV = "ONNX_RUNTIME_CUDA_SIM_DEFERRED"
STICKY_ENV = "ONNX_RUNTIME_CUDA_SIM_STICKY_ERRORS"
SHUFFLE_ENV = "ONNX_RUNTIME_CUDA_SIM_SHUFFLE_BLOCKS"
DRIVER_VERSION = 13000
DEVICE_NAME = b"CUDA Simulator (CPU emulation of sm_90)"
DEFAULT_DYNAMIC_SHARED = 48 * 1024  # what a launch may use before cuFuncSetAttribute raises the limit
MAX_DYNAMIC_SHARED = 232448  # sm_90's opt-in maximum


# ---- enums (values are CUDA's) --------------------------------------------------------------------------------


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_DEINITIALIZED = 4
    CUDA_ERROR_NO_DEVICE = 100
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_IMAGE = 200
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_INVALID_SOURCE = 300
    CUDA_ERROR_INVALID_PITCH_VALUE = 12
    CUDA_ERROR_INVALID_HANDLE = 400
    CUDA_ERROR_ILLEGAL_STATE = 401
    CUDA_ERROR_NOT_FOUND = 500
    CUDA_ERROR_NOT_READY = 600
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701
    CUDA_ERROR_ASSERT = 710
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713
    CUDA_ERROR_LAUNCH_FAILED = 719
    CUDA_ERROR_NOT_SUPPORTED = 801
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901
    CUDA_ERROR_STREAM_CAPTURE_MERGE = 902
    CUDA_ERROR_STREAM_CAPTURE_UNMATCHED = 903
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED = 904
    CUDA_ERROR_STREAM_CAPTURE_ISOLATION = 905
    CUDA_ERROR_STREAM_CAPTURE_IMPLICIT = 906
    CUDA_ERROR_CAPTURED_EVENT = 907
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908
    CUDA_ERROR_UNKNOWN = 999


_ERROR_STRINGS = {
    CUresult.CUDA_SUCCESS: "no error",
    CUresult.CUDA_ERROR_INVALID_VALUE: "invalid argument",
    CUresult.CUDA_ERROR_OUT_OF_MEMORY: "out of memory",
    CUresult.CUDA_ERROR_NOT_INITIALIZED: "initialization error",
    CUresult.CUDA_ERROR_DEINITIALIZED: "driver shutting down",
    CUresult.CUDA_ERROR_NO_DEVICE: "no CUDA-capable device is detected",
    CUresult.CUDA_ERROR_INVALID_DEVICE: "invalid device ordinal",
    CUresult.CUDA_ERROR_INVALID_IMAGE: "device kernel image is invalid",
    CUresult.CUDA_ERROR_INVALID_CONTEXT: "invalid device context",
    CUresult.CUDA_ERROR_INVALID_SOURCE: "device kernel image is invalid",
    CUresult.CUDA_ERROR_INVALID_PITCH_VALUE: "invalid pitch argument",
    CUresult.CUDA_ERROR_INVALID_HANDLE: "invalid resource handle",
    CUresult.CUDA_ERROR_ILLEGAL_STATE: "the operation cannot be performed in the present state",
    CUresult.CUDA_ERROR_NOT_FOUND: "named symbol not found",
    CUresult.CUDA_ERROR_NOT_READY: "device not ready",
    CUresult.CUDA_ERROR_ILLEGAL_ADDRESS: "an illegal memory access was encountered",
    CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: "too many resources requested for launch",
    CUresult.CUDA_ERROR_ASSERT: "device-side assert triggered",
    CUresult.CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED: "part or all of the requested memory range is already mapped",
    CUresult.CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED: "pointer does not correspond to a registered memory region",
    CUresult.CUDA_ERROR_LAUNCH_FAILED: "unspecified launch failure",
    CUresult.CUDA_ERROR_NOT_SUPPORTED: "operation not supported",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED: "operation not permitted when stream is capturing",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: "operation failed due to a previous error during capture",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_MERGE: "operation would result in a merge of separate capture sequences",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_UNMATCHED: "capture was not initiated in this stream",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_UNJOINED: "capturing stream has unjoined work",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_ISOLATION: "dependency created on uncaptured work in another stream",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_IMPLICIT:
        "operation would make the legacy stream depend on a capturing blocking stream",
    CUresult.CUDA_ERROR_CAPTURED_EVENT: "operation not permitted on an event last recorded in a capturing stream",
    CUresult.CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD:
        "attempt to terminate a thread-local capture sequence from another thread",
    CUresult.CUDA_ERROR_UNKNOWN: "unknown error",
}


class CUdevice_attribute(enum.IntEnum):
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X = 2
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y = 3
    CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z = 4
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X = 5
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y = 6
    CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z = 7
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8
    CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY = 9
    CU_DEVICE_ATTRIBUTE_WARP_SIZE = 10
    CU_DEVICE_ATTRIBUTE_MAX_PITCH = 11
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK = 12
    CU_DEVICE_ATTRIBUTE_CLOCK_RATE = 13
    CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT = 14
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16
    CU_DEVICE_ATTRIBUTE_KERNEL_EXEC_TIMEOUT = 17
    CU_DEVICE_ATTRIBUTE_INTEGRATED = 18
    CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19
    CU_DEVICE_ATTRIBUTE_COMPUTE_MODE = 20
    CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS = 31
    CU_DEVICE_ATTRIBUTE_ECC_ENABLED = 32
    CU_DEVICE_ATTRIBUTE_PCI_BUS_ID = 33
    CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID = 34
    CU_DEVICE_ATTRIBUTE_TCC_DRIVER = 35
    CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE = 36
    CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH = 37
    CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38
    CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR = 39
    CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT = 40
    CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING = 41
    CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID = 50
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
    CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
    CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED = 78
    CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED = 79
    CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED = 80
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
    CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR = 82
    CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY = 83
    CU_DEVICE_ATTRIBUTE_MULTI_GPU_BOARD = 84
    CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS = 88
    CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS = 89
    CU_DEVICE_ATTRIBUTE_COOPERATIVE_LAUNCH = 95
    CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
    CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
    CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR = 106
    CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
    CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK = 111
    CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED = 115


# An H100 SXM's answers: kernels and launch heuristics see a plausible sm_90 device.
_ATTRIBUTES = {
    "MAX_THREADS_PER_BLOCK": 1024, "MAX_BLOCK_DIM_X": 1024, "MAX_BLOCK_DIM_Y": 1024, "MAX_BLOCK_DIM_Z": 64,
    "MAX_GRID_DIM_X": 2**31 - 1, "MAX_GRID_DIM_Y": 65535, "MAX_GRID_DIM_Z": 65535,
    "MAX_SHARED_MEMORY_PER_BLOCK": DEFAULT_DYNAMIC_SHARED, "TOTAL_CONSTANT_MEMORY": 65536, "WARP_SIZE": 32,
    "MAX_PITCH": 2**31 - 1, "MAX_REGISTERS_PER_BLOCK": 65536, "CLOCK_RATE": 1980000, "TEXTURE_ALIGNMENT": 512,
    "MULTIPROCESSOR_COUNT": 132, "KERNEL_EXEC_TIMEOUT": 0, "INTEGRATED": 0, "CAN_MAP_HOST_MEMORY": 1,
    "COMPUTE_MODE": 0, "CONCURRENT_KERNELS": 1, "ECC_ENABLED": 1, "PCI_BUS_ID": 0, "PCI_DEVICE_ID": 0,
    "TCC_DRIVER": 0, "MEMORY_CLOCK_RATE": 2619000, "GLOBAL_MEMORY_BUS_WIDTH": 5120, "L2_CACHE_SIZE": 52428800,
    "MAX_THREADS_PER_MULTIPROCESSOR": 2048, "ASYNC_ENGINE_COUNT": 3, "UNIFIED_ADDRESSING": 1, "PCI_DOMAIN_ID": 0,
    "COMPUTE_CAPABILITY_MAJOR": 9, "COMPUTE_CAPABILITY_MINOR": 0, "STREAM_PRIORITIES_SUPPORTED": 1,
    "GLOBAL_L1_CACHE_SUPPORTED": 1, "LOCAL_L1_CACHE_SUPPORTED": 1, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR": 233472,
    "MAX_REGISTERS_PER_MULTIPROCESSOR": 65536, "MANAGED_MEMORY": 1, "MULTI_GPU_BOARD": 0,
    "PAGEABLE_MEMORY_ACCESS": 0, "CONCURRENT_MANAGED_ACCESS": 1, "COOPERATIVE_LAUNCH": 1,
    "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN": MAX_DYNAMIC_SHARED, "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED": 1,
    "MAX_BLOCKS_PER_MULTIPROCESSOR": 32, "MAX_PERSISTING_L2_CACHE_SIZE": 32505856,
    "RESERVED_SHARED_MEMORY_PER_BLOCK": 1024, "MEMORY_POOLS_SUPPORTED": 1,
}


class CUfunction_attribute(enum.IntEnum):
    CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0
    CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1
    CU_FUNC_ATTRIBUTE_CONST_SIZE_BYTES = 2
    CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3
    CU_FUNC_ATTRIBUTE_NUM_REGS = 4
    CU_FUNC_ATTRIBUTE_PTX_VERSION = 5
    CU_FUNC_ATTRIBUTE_BINARY_VERSION = 6
    CU_FUNC_ATTRIBUTE_CACHE_MODE_CA = 7
    CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
    CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 9


class CUstream_flags(enum.IntEnum):
    CU_STREAM_DEFAULT = 0
    CU_STREAM_NON_BLOCKING = 1


class CUevent_flags(enum.IntEnum):
    CU_EVENT_DEFAULT = 0
    CU_EVENT_BLOCKING_SYNC = 1
    CU_EVENT_DISABLE_TIMING = 2
    CU_EVENT_INTERPROCESS = 4


class CUstreamCaptureMode(enum.IntEnum):
    CU_STREAM_CAPTURE_MODE_GLOBAL = 0
    CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1
    CU_STREAM_CAPTURE_MODE_RELAXED = 2


class CUstreamCaptureStatus(enum.IntEnum):
    CU_STREAM_CAPTURE_STATUS_NONE = 0
    CU_STREAM_CAPTURE_STATUS_ACTIVE = 1
    CU_STREAM_CAPTURE_STATUS_INVALIDATED = 2


class CUmemPool_attribute(enum.IntEnum):
    CU_MEMPOOL_ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES = 1
    CU_MEMPOOL_ATTR_REUSE_ALLOW_OPPORTUNISTIC = 2
    CU_MEMPOOL_ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES = 3
    CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4
    CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT = 5
    CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH = 6
    CU_MEMPOOL_ATTR_USED_MEM_CURRENT = 7
    CU_MEMPOOL_ATTR_USED_MEM_HIGH = 8


class CUgraphInstantiate_flags(enum.IntEnum):
    CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH = 1
    CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD = 2
    CUDA_GRAPH_INSTANTIATE_FLAG_DEVICE_LAUNCH = 4
    CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY = 8


class CUmemorytype(enum.IntEnum):
    CU_MEMORYTYPE_HOST = 1
    CU_MEMORYTYPE_DEVICE = 2
    CU_MEMORYTYPE_ARRAY = 3
    CU_MEMORYTYPE_UNIFIED = 4


class CUDA_MEMCPY2D:  # noqa: N801 - cuda-python's name
    """A pitched copy's description, with cuda-python's field names (the simulator reads the device ones)."""

    def __init__(self):
        self.srcXInBytes = self.srcY = self.srcPitch = 0
        self.dstXInBytes = self.dstY = self.dstPitch = 0
        self.srcMemoryType = self.dstMemoryType = CUmemorytype.CU_MEMORYTYPE_DEVICE
        self.srcDevice, self.dstDevice = CUdeviceptr(0), CUdeviceptr(0)
        self.srcHost = self.dstHost = self.srcArray = self.dstArray = None
        self.WidthInBytes = self.Height = 0


CU_MEMHOSTALLOC_PORTABLE = 1
CU_MEMHOSTALLOC_DEVICEMAP = 2
CU_MEMHOSTALLOC_WRITECOMBINED = 4
CU_MEMHOSTREGISTER_PORTABLE = 1
CU_MEMHOSTREGISTER_DEVICEMAP = 2

# Errors after which a GPU's context is unusable (an exception in a kernel): every later call returns them.
_STICKY = frozenset({CUresult.CUDA_ERROR_ILLEGAL_ADDRESS, CUresult.CUDA_ERROR_ASSERT,
                     CUresult.CUDA_ERROR_LAUNCH_FAILED})

CU_STREAM_LEGACY = 1
CU_STREAM_PER_THREAD = 2
_DEFAULT_STREAMS = (0, CU_STREAM_LEGACY, CU_STREAM_PER_THREAD)


# ---- handles -----------------------------------------------------------------------------------------------------


class _Handle:
    """An opaque driver handle: ``int()`` gives its value, ``getPtr()`` the address of the stored value."""

    __slots__ = ("_storage",)

    def __init__(self, init_value=0):
        self._storage = ctypes.c_uint64(0 if init_value is None else int(init_value))

    def __int__(self) -> int:
        return self._storage.value

    __index__ = __int__

    def getPtr(self) -> int:  # noqa: N802 - cuda-python's name
        return ctypes.addressof(self._storage)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and int(other) == int(self)

    def __hash__(self) -> int:
        return hash((type(self).__name__, int(self)))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} 0x{int(self):x}>"


class CUdevice(_Handle):
    __slots__ = ()

    def __repr__(self) -> str:
        return f"<CUdevice {int(self)}>"


class CUdeviceptr(_Handle):
    __slots__ = ()

    def __repr__(self) -> str:
        return f"<CUdeviceptr {int(self)}>"


class CUcontext(_Handle):
    __slots__ = ()


class CUstream(_Handle):
    __slots__ = ()


class CUevent(_Handle):
    __slots__ = ()


class CUmodule(_Handle):
    __slots__ = ()


class CUfunction(_Handle):
    __slots__ = ()


class CUgraph(_Handle):
    __slots__ = ()


class CUgraphExec(_Handle):
    __slots__ = ()


class CUmemoryPool(_Handle):
    __slots__ = ()


class cuuint64_t(_Handle):  # noqa: N801 - cuda-python's name for a boxed 64-bit value
    __slots__ = ()

    def __repr__(self) -> str:
        return f"<cuuint64_t {int(self)}>"
