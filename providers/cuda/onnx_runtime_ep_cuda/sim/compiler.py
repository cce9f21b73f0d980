"""Kernel images for the simulator: the image format, the host C++ compile, its disk cache and the loaded library.

An image is ``b"ORT-CUDA-SIM\\x00"`` followed by JSON ``{"source": ..., "options": [...]}``. Loading one compiles
the CUDA C++ source with the host compiler (``$CXX``, default g++) against ``cuda_emu.h`` into a shared object,
cached on disk under the SHA-256 of the source, the options, the header text and the compiler flags, so a changed
header or flag never reuses a stale build.

Two source transformations make a CUDA translation unit a C++ one:
- ``extern __shared__ T name[];`` becomes ``ORT_SIM_DYNAMIC_SHARED(T, name);`` (a preprocessor macro cannot see
  the ``extern`` in front of ``__shared__``);
- every ``extern "C" __global__`` function *defined* after preprocessing (so kernels stamped out by macros count
  and ones in an inactive ``#if`` branch do not) gets an ``ORT_SIM_REGISTER(name, max_threads)`` line, the
  ``__launch_bounds__`` limit included, which gives the library a launcher that knows the parameter types.
"""

from __future__ import annotations

import ast
import ctypes
import hashlib
import json
import os
import re
import shlex
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

MAGIC = b"ORT-CUDA-SIM\x00"
HEADER = Path(__file__).with_name("cuda_emu.h")
CACHE_ENV = "ONNX_RUNTIME_CUDA_SIM_CACHE_DIR"
EXTRA_FLAGS_ENV = "ONNX_RUNTIME_CUDA_SIM_CXXFLAGS"  # e.g. "-O0 -g" to debug a kernel in gdb
_FORMAT = 1  # bump when the generated translation unit changes shape
_FLAGS = [
    "-O2", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden",
    "-fno-strict-aliasing",  # CUDA code reinterprets buffers (float4 loads) freely
    "-fno-math-errno",
    "-fcf-protection=none",  # fibers return into stacks a shadow stack has never seen
    "-fstack-clash-protection",  # a huge local array probes page by page into the fiber's guard page
    "-U_FORTIFY_SOURCE",  # fortified longjmp rejects the jump from a fiber stack back to the launch
]


class CompileError(RuntimeError):
    """The host compiler rejected a kernel source; ``log`` holds its output."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(f"{message}\n{log}".rstrip())
        self.log = log


def make_image(source: str, options: list[str] | tuple[str, ...] = ()) -> bytes:
    """The simulator's stand-in for a cubin: the source and options, compiled (and cached) right away.

    Compiling here rather than at cuModuleLoadData makes a broken kernel fail where NVRTC would, with the
    compiler's messages in the raised CompileError.
    """
    options = [str(option) for option in options]
    build(source, options)
    return MAGIC + json.dumps({"source": source, "options": options}).encode()


def parse_image(image) -> tuple[str, list[str]] | None:
    """(source, options) of a simulator image, or None when ``image`` is not one."""
    data = bytes(image) if isinstance(image, (bytes, bytearray, memoryview)) else None
    if data is None or not data.startswith(MAGIC):
        return None
    try:
        payload = json.loads(data[len(MAGIC):].rstrip(b"\x00"))
        return str(payload["source"]), [str(option) for option in payload["options"]]
    except (ValueError, KeyError, TypeError):
        return None


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "onnx_runtime" / "cuda-sim")


# ---- source preparation -----------------------------------------------------------------------------------

_EXTERN_SHARED = re.compile(r"extern\s+__shared__\s+(?P<type>[^;\[\]{}]*?)\s*\b(?P<name>[A-Za-z_]\w*)\s*\[\s*\]\s*;")
_ALIGN = re.compile(r"(?:__align__|alignas)\s*\((?:[^()]|\([^()]*\))*\)")  # e.g. __align__(sizeof(float4))
_GLOBAL = re.compile(r"\b__global__\b")
# What follows __global__: qualifiers and the return type (whole words, so a failed match cannot backtrack
# through every way of splitting an identifier), an optional __launch_bounds__(...), the name and "(".
_DECLARATOR = re.compile(
    r"(?:\s*(?:__launch_bounds__\s*\((?P<bounds>(?:[^()]|\([^()]*\))*)\)|[A-Za-z_]\w*\b))*?"
    r"\s*(?P<name>(?!__launch_bounds__\b)[A-Za-z_]\w*)\s*\("
)
_EXTERN_C = re.compile(r'extern\s+"C"')
_EXTERN_C_BLOCK = re.compile(r'extern\s+"C"\s*\{')


def rewrite_extern_shared(source: str) -> str:
    def replace(match: re.Match) -> str:
        text = match.group(0)
        continued = text.count("\\\n")  # keep macro continuations and line numbers intact
        tail = "\\\n" * continued + "\n" * (text.count("\n") - continued)
        kind = " ".join(_ALIGN.sub(" ", match.group("type")).replace("\\\n", " ").split())
        return f"ORT_SIM_DYNAMIC_SHARED({kind}, {match['name']});{tail}"

    return _EXTERN_SHARED.sub(replace, source)


def _matching(text: str, start: int, open_: str, close: str) -> int:
    """Index just past the bracket closing the one at ``start``, or -1."""
    depth = 0
    for index in range(start, len(text)):
        char = text[index]
        if char == open_:
            depth += 1
        elif char == close:
            depth -= 1
            if depth == 0:
                return index + 1
    return -1


def _bound(text: str | None) -> int:
    """The first ``__launch_bounds__`` argument when it is integer arithmetic on literals, else 0 (unbounded:
    a constexpr name cannot be evaluated here, and the GPU check covers such kernels)."""
    if not text:
        return 0
    expression = re.sub(r"\b(\d+)[uUlL]*\b", r"\1", text.split(",")[0])

    def evaluate(node) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.LShift)):
            left, right = evaluate(node.left), evaluate(node.right)
            operations = {ast.Add: int.__add__, ast.Sub: int.__sub__, ast.Mult: int.__mul__, ast.Div: int.__floordiv__,
                          ast.LShift: int.__lshift__}
            return operations[type(node.op)](left, right)
        raise ValueError("not integer arithmetic")

    try:
        return max(evaluate(ast.parse(expression.strip(), mode="eval").body), 0)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return 0


def _extern_c_blocks(text: str) -> list[tuple[int, int]]:
    blocks = []
    for match in _EXTERN_C_BLOCK.finditer(text):
        end = _matching(text, match.end() - 1, "{", "}")
        blocks.append((match.end(), end if end > 0 else len(text)))
    return blocks


def scan_kernels(preprocessed: str) -> dict[str, int]:
    """``{name: max threads per block (0 = unbounded)}`` for each extern "C" __global__ function defined."""
    kernels: dict[str, int] = {}
    blocks = None  # extern "C" { ... } spans, found only if some kernel needs them
    for match in _GLOBAL.finditer(preprocessed):
        declaration_start = max(preprocessed.rfind(c, 0, match.start()) for c in ";{}") + 1
        if _EXTERN_C.search(preprocessed, declaration_start, match.start()) is None:
            blocks = _extern_c_blocks(preprocessed) if blocks is None else blocks
            if not any(start <= match.start() < end for start, end in blocks):
                continue  # C++ linkage: the real driver could not find it by this name either
        declarator = _DECLARATOR.match(preprocessed, match.end())
        if not declarator:
            context = " ".join(preprocessed[match.start():match.start() + 160].split())
            raise CompileError(f"cannot find the kernel name in this __global__ declaration: {context}")
        close = _matching(preprocessed, declarator.end() - 1, "(", ")")
        if close < 0 or not preprocessed[close:].lstrip().startswith("{"):
            continue  # a declaration; the definition registers it
        kernels[declarator["name"]] = _bound(declarator["bounds"])
    return kernels


# ---- the host compiler ----------------------------------------------------------------------------------


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CXX") or "g++")


def _host_options(options: list[str]) -> list[str]:
    """NVRTC options that mean something to the host compiler (macros, include paths, the standard)."""
    out: list[str] = []
    pending = None
    for option in options:
        if pending:
            out.append(pending + option)
            pending = None
        elif option in ("-D", "-U", "-I"):
            pending = option
        elif option.startswith(("-D", "-U", "-I")):
            out.append(option)
        elif option.startswith("--define-macro="):
            out.append("-D" + option.split("=", 1)[1])
        elif option.startswith("--undefine-macro="):
            out.append("-U" + option.split("=", 1)[1])
        elif option.startswith("--include-path="):
            out.append("-I" + option.split("=", 1)[1])
        elif re.fullmatch(r"--?std=c\+\+\d\d", option):
            out.append("-std=" + option.split("=", 1)[1])
        # Everything else (architecture, fast-math, line info, -default-device ...) is GPU code generation.
    return out


def _standard(host_options: list[str]) -> list[str]:
    return [] if any(option.startswith("-std=") for option in host_options) else ["-std=c++17"]


def _run(command: list[str], what: str) -> str:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    except FileNotFoundError:
        raise CompileError(f"the CUDA simulator needs a host C++ compiler ({command[0]} was not found); install g++ "
                           f"or set CXX") from None
    except subprocess.TimeoutExpired:
        raise CompileError(f"{what} took longer than 10 minutes") from None
    if result.returncode != 0:
        raise CompileError(f"{what} failed ({shlex.join(command)})", (result.stdout + result.stderr).strip())
    return result.stdout


def _key(source: str, options: list[str]) -> str:
    extra = os.environ.get(EXTRA_FLAGS_ENV, "")
    material = [_FORMAT, source, options, HEADER.read_text(), _compiler(), _FLAGS, extra]
    return hashlib.sha256(json.dumps(material).encode()).hexdigest()


def _compile(source: str, options: list[str], target: Path) -> None:
    host = _host_options(options)
    flags = [*_standard(host), "-DORT_CUDA_SIM=1", *host]
    target.parent.mkdir(parents=True, exist_ok=True)
    # A private directory beside the target: the final rename stays on one file system, and concurrent
    # compiles of the same source never see each other's half-written files.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix="build-") as tmp:
        unit = Path(tmp) / "kernels.cpp"
        unit.write_text(source)
        preprocessed = _run([*_compiler(), "-E", "-P", "-x", "c++", *flags, str(unit)], "preprocessing the kernels")
        footer = "".join(f"ORT_SIM_REGISTER({name}, {bound})\n" for name, bound in scan_kernels(preprocessed).items())
        unit.write_text(rewrite_extern_shared(source) + "\n" + footer)
        output = Path(tmp) / "kernels.so"
        extra = shlex.split(os.environ.get(EXTRA_FLAGS_ENV, ""))
        _run([*_compiler(), *_FLAGS, *extra, *flags, "-include", str(HEADER), "-x", "c++", str(unit),
              "-o", str(output)], "compiling the kernels for the CUDA simulator")
        os.replace(output, target)


_build_lock = threading.Lock()


def build(source: str, options: list[str]) -> Path:
    """The cached shared object for (source, options), compiling it on a miss. An unwritable cache directory
    falls back to a per-user one under the system temp directory."""
    name = f"{_key(source, options)}.so"
    fallback = Path(tempfile.gettempdir()) / f"onnx_runtime-cuda-sim-{os.getuid()}"
    with _build_lock:
        for directory in (cache_dir(), fallback):
            target = directory / name
            if target.is_file():
                return target
            try:
                _compile(source, options, target)
                return target
            except OSError as exc:
                error = exc
    raise CompileError(f"no writable directory for compiled kernels ({error})")


# ---- loaded libraries ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    kind: str  # "p" pointer, "i" signed integer, "u" unsigned integer, "f" floating point, "s" anything else
    size: int


class Library:
    """One compiled kernel module: its kernels' parameter lists and a launcher."""

    def __init__(self, path: Path):
        lib = ctypes.CDLL(str(path))
        lib.ort_sim_launch.restype = ctypes.c_int
        lib.ort_sim_launch.argtypes = [ctypes.c_char_p, *[ctypes.c_uint] * 6, ctypes.c_size_t,
                                       ctypes.POINTER(ctypes.c_void_p)]
        for name in ("ort_sim_kernel_names", "ort_sim_last_error"):
            getattr(lib, name).restype = ctypes.c_char_p
        lib.ort_sim_kernel_signature.restype = ctypes.c_char_p
        lib.ort_sim_kernel_signature.argtypes = [ctypes.c_char_p]
        lib.ort_sim_kernel_max_threads.restype = ctypes.c_int
        lib.ort_sim_kernel_max_threads.argtypes = [ctypes.c_char_p]
        lib.ort_sim_set_block_shuffle.restype = None
        lib.ort_sim_set_block_shuffle.argtypes = [ctypes.c_ulonglong]
        self._lib = lib
        self.path = path
        self.kernels: dict[str, tuple[Param, ...]] = {}
        self.max_threads: dict[str, int] = {}
        for name in lib.ort_sim_kernel_names().decode().split():
            signature = lib.ort_sim_kernel_signature(name.encode()).decode()
            self.kernels[name] = tuple(Param(code[0], int(code[1:])) for code in signature.split(",") if code)
            self.max_threads[name] = lib.ort_sim_kernel_max_threads(name.encode()) or 1024

    def launch(self, name: str, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int,
               params: list[bytes], shuffle_seed: int = 0) -> tuple[int, str]:
        """Runs kernel ``name`` to completion with the given parameter bytes; (CUresult value, message). A nonzero
        ``shuffle_seed`` runs the blocks in a permutation it seeds instead of row-major order."""
        offsets, size = [], 0
        for value in params:
            offsets.append(size)
            size += (len(value) + 15) // 16 * 16  # 16-byte slots keep every parameter aligned
        storage = ctypes.create_string_buffer(max(size, 16))
        base = ctypes.addressof(storage)
        pointers = (ctypes.c_void_p * max(len(params), 1))()
        for index, (offset, value) in enumerate(zip(offsets, params)):
            ctypes.memmove(base + offset, value, len(value))
            pointers[index] = base + offset
        with _launch_lock:
            self._lib.ort_sim_set_block_shuffle(shuffle_seed)
            code = self._lib.ort_sim_launch(name.encode(), *grid, *block, shared, pointers)
            message = self._lib.ort_sim_last_error().decode(errors="replace") if code else ""
        return code, message


# Launches install process-wide fault handlers, so two modules must not run kernels at the same time.
_launch_lock = threading.Lock()
_libraries: dict[Path, Library] = {}


def load(source: str, options: list[str]) -> Library:
    """The loaded library for (source, options); the same object on every call (a module is never unloaded,
    because a dlclose'd kernel could still be referenced by a captured graph)."""
    path = build(source, options)
    with _build_lock:
        library = _libraries.get(path)
        if library is None:
            library = _libraries[path] = Library(path)
    return library
