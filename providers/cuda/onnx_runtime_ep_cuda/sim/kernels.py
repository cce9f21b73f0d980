"""Simulated driver calls: modules (simulator images compiled for the host) and kernel launches."""

from __future__ import annotations

import ctypes
import enum

from . import compiler
from .execution import _drain_all, _submit
from .state import _api, _Fail, _Function, _host_buffer, _lookup, _Module, _state
from .types import MAX_DYNAMIC_SHARED, CUfunction, CUfunction_attribute, CUmodule, CUresult, _Handle

# ---- modules and kernels ---------------------------------------------------------------------------------------


@_api(1, context=True)
def cuModuleLoadData(image):
    parsed = compiler.parse_image(image)
    if parsed is None:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_IMAGE,
                    "not a simulator image (compile kernels with the simulator selected: ONNX_RUNTIME_CUDA_SIM=1)")
    try:
        library = compiler.load(*parsed)
    except compiler.CompileError as exc:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_IMAGE, str(exc)) from None
    module = _Module(_state.new_handle(), library)
    _state.modules[module.handle] = module
    return CUmodule(module.handle)


@_api(1)
def cuModuleGetFunction(hmod, name):
    if not isinstance(name, bytes):
        raise TypeError(f"expected bytes, {type(name).__name__} found")
    module = _lookup(_state.modules, hmod, "module")
    text = name.decode()
    for function in _state.functions.values():
        if function.module is module and function.name == text:
            return CUfunction(function.handle)
    if text not in module.library.kernels:
        raise _Fail(CUresult.CUDA_ERROR_NOT_FOUND, f"no extern \"C\" __global__ function {text!r} in the module "
                    f"(it has: {', '.join(sorted(module.library.kernels)) or 'none'})")
    function = _Function(_state.new_handle(), module, text, module.library.kernels[text],
                         module.library.max_threads[text])
    _state.functions[function.handle] = function
    return CUfunction(function.handle)


@_api()
def cuModuleUnload(hmod):
    module = _lookup(_state.modules, hmod, "module")
    _drain_all()
    module.loaded = False
    del _state.modules[module.handle]
    for handle in [h for h, f in _state.functions.items() if f.module is module]:
        del _state.functions[handle]


@_api(1)
def cuFuncGetAttribute(attrib, hfunc):
    function = _lookup(_state.functions, hfunc, "function")
    values = {
        CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: function.max_threads,
        CUfunction_attribute.CU_FUNC_ATTRIBUTE_NUM_REGS: 32,
        CUfunction_attribute.CU_FUNC_ATTRIBUTE_PTX_VERSION: 90,
        CUfunction_attribute.CU_FUNC_ATTRIBUTE_BINARY_VERSION: 90,
        CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: function.max_dynamic_shared,
        CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: function.carveout,
    }
    return values.get(int(attrib), 0)  # static/const/local sizes are unknown on the host: 0


@_api()
def cuFuncSetAttribute(hfunc, attrib, value):
    function = _lookup(_state.functions, hfunc, "function")
    value = int(value)
    if int(attrib) == CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES:
        if not 0 <= value <= MAX_DYNAMIC_SHARED:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"dynamic shared memory {value} > {MAX_DYNAMIC_SHARED}")
        function.max_dynamic_shared = value
    elif int(attrib) == CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT:
        function.carveout = value
    else:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"function attribute {int(attrib)} cannot be set")


_CTYPES = {
    ctypes.c_bool: "u", ctypes.c_char: "i", ctypes.c_wchar: "i", ctypes.c_byte: "i", ctypes.c_ubyte: "u",
    ctypes.c_short: "i", ctypes.c_ushort: "u", ctypes.c_int: "i", ctypes.c_uint: "u", ctypes.c_long: "i",
    ctypes.c_ulong: "u", ctypes.c_longlong: "i", ctypes.c_ulonglong: "u", ctypes.c_size_t: "u",
    ctypes.c_float: "f", ctypes.c_double: "f",
}
_KIND_NAMES = {"p": "pointer", "i": "signed integer", "u": "unsigned integer", "f": "floating-point", "s": "struct"}


def _param(value, ctype, expected: compiler.Param) -> tuple[bytes, str]:  # noqa: C901 - one branch per kind
    """One kernel argument in cuda-python's tuple form as (bytes, kind), converted the way cuda-python does."""
    if ctype is None:
        if isinstance(value, _Handle):  # e.g. a CUdeviceptr: the kernel receives the stored value
            return bytes(value._storage), "p"  # noqa: SLF001 - the simulator's own handle type
        if callable(getattr(value, "getPtr", None)):
            return ctypes.string_at(value.getPtr(), expected.size), "s"
        if isinstance(value, ctypes.Structure):
            return bytes(value), "s"
        if isinstance(value, enum.Enum):
            return bytes(ctypes.c_int(int(value.value))), "i"
        raise TypeError(f"Provided argument is of type {type(value)} but expected Type {ctypes.Structure}, "
                        f"{ctypes.c_void_p} or CUDA Binding structure with getPtr() attribute")
    if ctype is ctypes.c_void_p:
        if isinstance(value, ctypes.c_void_p):
            value = value.value or 0
        if not isinstance(value, int) or isinstance(value, _Handle):
            # cuda-python would pass getPtr(), the host address of the handle object: garbage on the GPU.
            raise TypeError(f"a c_void_p kernel argument must be an int (pass int(ptr)), got {type(value).__name__}")
        return int(value).to_bytes(8, "little", signed=value < 0), "p"
    if ctype not in _CTYPES:
        raise TypeError(f"Unsupported type: {ctype}")
    if ctype is ctypes.c_double and isinstance(value, ctypes.c_float):
        value = value.value
    return bytes(value if isinstance(value, ctype) else ctype(value)), _CTYPES[ctype]


def _kernel_params(function: _Function, kernelParams) -> list[bytes]:
    expected = function.params
    if kernelParams is None or (isinstance(kernelParams, int) and kernelParams == 0):
        supplied: list[tuple[bytes, str]] = []
    elif isinstance(kernelParams, tuple) and len(kernelParams) == 2 and all(isinstance(p, tuple) for p in kernelParams):
        values, types = kernelParams
        if len(values) != len(types):
            raise TypeError("Argument 'kernelParams' has tuples with different length")
        if len(values) != len(expected):
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                        f"kernel {function.name} takes {len(expected)} parameters, {len(values)} were passed")
        supplied = [_param(v, t, p) for v, t, p in zip(values, types, expected)]
    else:
        # A raw void** (an int address or a buffer of pointers): each points at its parameter's bytes.
        address = int(kernelParams) if isinstance(kernelParams, int) else _host_buffer(kernelParams, 8 * len(expected),
                                                                                       writable=False)
        pointers = (ctypes.c_void_p * len(expected)).from_address(address) if expected else []
        return [ctypes.string_at(pointer, p.size) for pointer, p in zip(pointers, expected)]
    if len(supplied) != len(expected):
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"kernel {function.name} takes {len(expected)} parameters, {len(supplied)} were passed")
    for index, ((data, kind), want) in enumerate(zip(supplied, expected)):
        compatible = want.kind == "s" or kind == "s" or (kind == "f") == (want.kind == "f")
        if len(data) != want.size or not compatible:
            raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                        f"kernel {function.name} parameter {index} is a {want.size}-byte {_KIND_NAMES[want.kind]}, "
                        f"the argument is a {len(data)}-byte {_KIND_NAMES[kind]}")
    return [data for data, _ in supplied]


@_api()
def cuLaunchKernel(f, gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes, hStream,
                   kernelParams, extra):
    function = _lookup(_state.functions, f, "function")
    grid = (int(gridDimX), int(gridDimY), int(gridDimZ))
    block = (int(blockDimX), int(blockDimY), int(blockDimZ))
    shared = int(sharedMemBytes)
    if extra not in (None, 0):
        raise _Fail(CUresult.CUDA_ERROR_NOT_SUPPORTED, "the simulator takes kernel arguments via kernelParams only")
    threads = block[0] * block[1] * block[2]
    if min(grid) < 1 or min(block) < 1 or threads > 1024 or block[2] > 64 or grid[0] >= 2**31 or max(grid[1:]) > 65535:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE, f"invalid launch: grid {grid}, block {block}")
    if threads > function.max_threads:
        raise _Fail(CUresult.CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
                    f"{function.name}: {threads} threads exceed its __launch_bounds__ ({function.max_threads})")
    if shared > function.max_dynamic_shared:
        raise _Fail(CUresult.CUDA_ERROR_INVALID_VALUE,
                    f"{function.name}: {shared} bytes of dynamic shared memory exceed the kernel's limit "
                    f"{function.max_dynamic_shared} (raise it with CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)")
    params = _kernel_params(function, kernelParams)
    _submit(hStream, ("kernel", function, grid, block, shared, params), "cuLaunchKernel")
