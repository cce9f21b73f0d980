"""What the compiled kernels assume of the host, stated once and checked at import.

- The helper threads of workers.py sleep and wake through the futex system call, made from compiled
  code by number (``syscall(SYS_futex, ...)``: libc has no futex wrapper), on the low 32 bits of an
  int64 mailbox slot (little-endian); they read the time-stamp counter (LLVM's readcyclecounter: rdtsc,
  cheap and unprivileged on x86-64 only) and sched_getcpu (glibc, musl). So: Linux on x86-64, in a
  64-bit process. Elsewhere no helper thread starts and the split kernels run every part on the calling
  thread (workers.helpers says so once, in a RuntimeWarning), and workers.py compiles stand-ins for the
  system calls, so the compiled callers still link.
- The packed convolution and products, the 3x3 windows and the lane tiles (gemm.py, matmul.py, gemv.py,
  attention.py, windows.py, lanes.py) are written for AVX-512's 16 float32 lanes: used only where the
  host CPU reports avx512f (``AVX512``, read as gemm.AVAILABLE), else the callers keep numpy's paths.
"""

from __future__ import annotations

import ctypes
import platform
import sys

from onnx_runtime.cpus import cpu_flags_line

# SYS_futex by (system, machine): the syscall numbers differ per architecture (x86-64's 202 is
# another call on arm64 and on 32-bit x86), so only the platforms listed here start helper threads.
FUTEX_SYSCALLS = {("Linux", "x86_64"): 202}
FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 128, 129  # FUTEX_WAIT / FUTEX_WAKE | FUTEX_PRIVATE_FLAG (Linux)
SCHED_YIELD_SYSCALLS = {("Linux", "x86_64"): 24}  # SYS_sched_yield, where helper threads run

_X86_64 = frozenset({"x86_64", "amd64"})  # platform.machine()'s spellings (Linux and macOS, BSD and Windows)


def helper_threads_refusal(system: str, machine: str, byteorder: str, pointer_bits: int) -> str:
    """Why workers.py cannot start helper threads on this platform, or "" where it can."""
    where = f"{system} on {machine or 'an unknown machine'}"
    if (system, machine) not in FUTEX_SYSCALLS:
        return f"the helper threads need Linux on x86-64 (the futex system call by number, rdtsc), not {where}"
    if byteorder != "little" or pointer_bits != 64:
        return f"the helper threads need a 64-bit little-endian process, not {pointer_bits}-bit {byteorder}-endian"
    return ""


def avx512(machine: str, features: dict) -> bool:
    """Whether the 16-lane float32 kernels run: an x86-64 CPU whose features (llvmlite's host features,
    name -> bool) include avx512f."""
    return machine.lower() in _X86_64 and bool(features.get("avx512f"))


def _cpuinfo_features(text: str) -> dict:
    """The CPU flags of /proc/cpuinfo's first "flags" line (Linux), as name -> True; {} if none."""
    for line in text.splitlines():
        if line.startswith("flags") and ":" in line:
            return {flag: True for flag in line.split(":", 1)[1].split()}
    return {}


def _host_features() -> dict:
    # /proc/cpuinfo where there is one (Linux lists what the kernel enabled): it spares the importing of
    # llvmlite, which a process whose kernels are all numpy or BLAS would load for this alone. Its flags line is
    # read once per process (onnx_runtime/cpus.py; the plan cache's key reads it too).
    if SYSTEM == "Linux":
        features = _cpuinfo_features(cpu_flags_line())
        if features:
            return features
    from llvmlite import binding

    try:
        return dict(binding.get_host_cpu_features())
    except RuntimeError:  # features unknown on this host
        return {}


SYSTEM, MACHINE = platform.system(), platform.machine()
HELPERS_REFUSED = helper_threads_refusal(SYSTEM, MACHINE, sys.byteorder, 64 if sys.maxsize > 2**32 else 32)
HELPER_THREADS = not HELPERS_REFUSED
SYS_FUTEX = FUTEX_SYSCALLS.get((SYSTEM, MACHINE), -1)  # -1: no helper threads, never called
SYS_SCHED_YIELD = SCHED_YIELD_SYSCALLS.get((SYSTEM, MACHINE), -1)
_FEATURES = _host_features()
AVX512 = avx512(MACHINE, _FEATURES)
# qgemm_tiles.py's int16 pair products: vpmaddwd on 512 bits (AVX-512BW), vpdpwssd with AVX-512 VNNI
AVX512BW = AVX512 and bool(_FEATURES.get("avx512bw"))
AVX512VNNI = AVX512BW and bool(_FEATURES.get("avx512_vnni") or _FEATURES.get("avx512vnni"))
# code_lookup.py's byte tables: vpermi2b (AVX-512 VBMI) picks 64 bytes of a 128-byte table at once
AVX512VBMI = AVX512BW and bool(_FEATURES.get("avx512vbmi") or _FEATURES.get("avx512_vbmi"))


def amx_permitted(system: str, machine: str) -> bool:
    """Whether this process may use AMX's tiles: Linux gives a process the tile state only when it asks
    (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; an AMX instruction before that is a SIGILL). Asked once,
    for the whole process and its threads."""
    if system != "Linux" or machine.lower() not in _X86_64:
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18  # x86-64 Linux's numbers
# qgemm_quads.py's tile products: AMX-INT8 (tdpbsud on 16 x 64-byte tiles), where the process is given the tiles
AMX_INT8 = AVX512VNNI and all(_FEATURES.get(flag) or _FEATURES.get(flag.replace("_", "-"))
                              for flag in ("amx_tile", "amx_int8")) and amx_permitted(SYSTEM, MACHINE)
# directconv.py's 8-lane float32 kernels: x86-64 with AVX2 and FMA
AVX2 = MACHINE.lower() in _X86_64 and bool(_FEATURES.get("avx2")) and bool(_FEATURES.get("fma"))
