"""Compiling the kernel sources: NVRTC to cubin on the real driver, an emulation image on the simulator.

Kernel sources are CUDA C++ files in ``kernels/`` with ``extern "C" __global__`` entry points. They
never include the CUDA half-precision headers themselves: the real path pre-includes ``cuda_fp16.h``
and ``cuda_bf16.h`` (shipped by the ``nvidia-cuda-runtime`` wheel) and the simulator force-includes its
emulation header, so the same source sees ``__half``/``__nv_bfloat16`` under their standard names both
ways. Local ``#include "x.cuh"`` lines are expanded here, so the text that is hashed and compiled is
the whole program and a changed header always misses the cache.

Cubins are cached in memory and on disk (``~/.cache/onnx_runtime/cuda``, or
``$ONNX_RUNTIME_CUDA_CACHE_DIR``) under the SHA-256 of the source, the full option list, the
architecture and the NVRTC version.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import threading
from pathlib import Path

from onnx_runtime.errors import ProviderError

from . import driver

KERNEL_DIR = Path(__file__).parent / "kernels"
CACHE_ENV = "ONNX_RUNTIME_CUDA_CACHE_DIR"
HALF_HEADERS = ("cuda_fp16.h", "cuda_bf16.h")

_memory: dict[str, bytes] = {}
_lock = threading.Lock()
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "onnx_runtime" / "cuda")


def kernel_source(file: str | os.PathLike) -> str:
    """The text of ``file`` (relative to ``kernels/`` unless absolute) with local includes expanded.

    Each header is expanded once (``#pragma once`` semantics) between ``#line`` markers, so compiler
    messages still name the file and line the author wrote.
    """
    path = Path(file) if Path(file).is_absolute() else KERNEL_DIR / file
    seen: set[Path] = set()

    def expand(current: Path) -> list[str]:
        if not current.is_file():
            raise ProviderError(f"CUDAExecutionProvider: kernel source {current} does not exist")
        seen.add(current.resolve())
        out = [f'#line 1 "{current.name}"']
        for number, line in enumerate(current.read_text().splitlines(), start=1):
            match = _INCLUDE.match(line)
            if not match:
                out.append(line)
                continue
            header = (current.parent / match.group(1)).resolve()
            if header not in seen:
                out.extend(expand(header))
            out.append(f'#line {number + 1} "{current.name}"')
        return out

    return "\n".join(expand(path)) + "\n"


def compile(source: str, name: str, options=(), arch: int | str = 80) -> bytes:  # noqa: A001 - the design's name
    """A loadable image of ``source`` (the kernel file ``name``) for ``arch`` (e.g. 80 or "sm_90").

    ``options`` are compiler flags both compilers understand (``-DNAME=VALUE``, ``-I<dir>``).
    On the simulator the image is ``sim.driver.make_image(source, options)``; ``arch`` does not apply.
    """
    options = [str(option) for option in options]
    if driver.simulated():
        from .sim.compiler import CompileError

        try:
            return driver.load_driver_module().make_image(source, options)
        except CompileError as exc:
            raise ProviderError(
                f"CUDAExecutionProvider: the CUDA simulator could not compile kernel file {name}: {exc}"
            ) from None
    nvrtc = _nvrtc()
    version = _check(nvrtc, nvrtc.nvrtcVersion(), "nvrtcVersion", name)  # part of the key: a new NVRTC recompiles
    flags = [f"--gpu-architecture={_arch(arch)}", "-default-device", "--std=c++17", *_header_flags(), *options]
    key = hashlib.sha256(json.dumps([source, flags, list(version)]).encode()).hexdigest()
    with _lock:
        cached = _memory.get(key)
    if cached is not None:
        return cached
    path = cache_dir() / f"{key}.cubin"
    try:
        image = path.read_bytes()
    except OSError:
        image = _compile_uncached(nvrtc, source, name, flags)
        _store(path, image)
    with _lock:
        _memory[key] = image
    return image


def clear_memory_cache() -> None:
    """Forget the in-memory cubins (the disk cache stays); tests use it to exercise the disk path."""
    with _lock:
        _memory.clear()


def _nvrtc():
    try:
        from cuda.bindings import nvrtc

        nvrtc.nvrtcVersion()  # the bindings import without libnvrtc and only fail at the first call
    except Exception as exc:
        raise ProviderError(
            f"CUDAExecutionProvider needs NVRTC to compile its kernels ({type(exc).__name__}: {exc}); install it "
            f"with `pip install 'cuda-python>=13,<14' 'nvidia-cuda-nvrtc==13.*'`"
        ) from None
    return nvrtc


def _arch(arch: int | str) -> str:
    text = str(arch).strip().lower()
    text = text.removeprefix("sm_")
    if not re.fullmatch(r"\d+[af]?", text):
        raise ProviderError(f"CUDAExecutionProvider: {arch!r} is not a GPU architecture; pass e.g. 80 or 'sm_90'")
    return f"sm_{text}"


_header_dir: str | None = None


def _header_flags() -> list[str]:
    """``-I`` for the CUDA runtime headers and the pre-includes that give kernels the half types."""
    global _header_dir
    if _header_dir is None:
        try:
            from cuda.pathfinder import find_nvidia_header_directory

            found = find_nvidia_header_directory("cudart")
        except Exception:  # an old or missing pathfinder is the same problem as missing headers
            found = None
        if not found or not all((Path(found) / header).is_file() for header in HALF_HEADERS):
            raise ProviderError(
                "CUDAExecutionProvider: the CUDA half-precision headers (cuda_fp16.h, cuda_bf16.h) were not "
                "found; install them with `pip install 'nvidia-cuda-runtime==13.*'` or set CUDA_HOME to a "
                "CUDA toolkit"
            )
        _header_dir = found
    return [f"-I{_header_dir}", *(f"--pre-include={header}" for header in HALF_HEADERS)]


def _check(nvrtc, result, call: str, name: str):
    err, *values = result
    if int(err) != 0:
        raise ProviderError(f"CUDAExecutionProvider: {call} failed for {name} with {_nvrtc_error(nvrtc, err)}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _nvrtc_error(nvrtc, err) -> str:
    try:
        status, text = nvrtc.nvrtcGetErrorString(err)
        if int(status) == 0:
            return text.decode() if isinstance(text, bytes) else str(text)
    except Exception:  # naming an error must never mask the error itself
        pass
    return str(err)


def _compile_uncached(nvrtc, source: str, name: str, flags: list[str]) -> bytes:
    program = _check(nvrtc, nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], []),
                     "nvrtcCreateProgram", name)
    try:
        encoded = [flag.encode() for flag in flags]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        if int(err) != 0:
            log = _program_log(nvrtc, program, name)
            arch = flags[0].split("=", 1)[1]
            raise ProviderError(
                f"CUDAExecutionProvider: NVRTC could not compile kernel file {name} for {arch} "
                f"({_nvrtc_error(nvrtc, err)}):\n{log}"
            )
        # NVRTC fills caller-allocated buffers; bytearray keeps that write off an immutable bytes object.
        cubin = bytearray(_check(nvrtc, nvrtc.nvrtcGetCUBINSize(program), "nvrtcGetCUBINSize", name))
        _check(nvrtc, nvrtc.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN", name)
    except BaseException:
        nvrtc.nvrtcDestroyProgram(program)  # unchecked: the error being raised says more than a failed cleanup
        raise
    _check(nvrtc, nvrtc.nvrtcDestroyProgram(program), "nvrtcDestroyProgram", name)
    return bytes(cubin)


def _program_log(nvrtc, program, name: str) -> str:
    size = _check(nvrtc, nvrtc.nvrtcGetProgramLogSize(program), "nvrtcGetProgramLogSize", name)
    log = bytearray(size)
    _check(nvrtc, nvrtc.nvrtcGetProgramLog(program, log), "nvrtcGetProgramLog", name)
    return bytes(log).rstrip(b"\x00").decode(errors="replace").strip()


def _store(path: Path, image: bytes) -> None:
    # The disk cache is an optimization: a read-only or full home directory must not fail the compile.
    # Writing a temporary file and renaming it keeps concurrent processes from reading half a cubin.
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "wb") as handle:
            handle.write(image)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
