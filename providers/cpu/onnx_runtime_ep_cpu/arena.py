"""The CPU memory arena: ``SessionOptions.enable_cpu_mem_arena`` mapped onto glibc's malloc.

onnxruntime keeps freed CPU buffers in an arena and hands them to the next allocation. numpy
allocates through malloc, and glibc by default serves every block above ``M_MMAP_THRESHOLD``
(128 KiB) with a fresh mmap, unmaps it on free and trims the heap top above ``M_TRIM_THRESHOLD``:
each intermediate of a model run then costs a page fault per 4 KiB on first touch (measured in
82c988f). Raising both thresholds makes malloc's own heap the arena: a run's freed
intermediates stay mapped and the next run's arrays reuse them without faults.

malloc is process-wide, so this is too (like the BLAS threads): the first session that asks for
the arena applies it, and a session with the arena off leaves it alone, as another session may
rely on it. Other C libraries keep their own policy; the status says why nothing was done.
"""

from __future__ import annotations

import ctypes
import os
import platform

from onnx_runtime.records import FrozenRecord

_M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
# Blocks up to this size come from the heap: glibc's documented ceiling for M_MMAP_THRESHOLD on
# 64-bit (DEFAULT_MMAP_THRESHOLD_MAX); larger arrays are rare and still get their own mmap.
MMAP_THRESHOLD = 32 << 20
# Free memory kept at the heap top: room for a large model's whole working set of intermediates.
TRIM_THRESHOLD = 256 << 20

ARENA_KEY = "session.enable_cpu_mem_arena"


class ArenaStatus(FrozenRecord):
    """Whether the arena is in place, and why (or why not). A record (onnx_runtime/records.py): a NamedTuple, as a
    dataclass, generates its methods in every process that imports it, here each new process's first session."""

    __slots__ = __match_args__ = ("applied", "reason")
    applied: bool
    reason: str

    def __init__(self, applied: bool, reason: str) -> None:
        object.__setattr__(self, "applied", applied)
        object.__setattr__(self, "reason", reason)


_status: ArenaStatus | None = None  # set once the arena is in place for the process


def _load_glibc():
    """glibc's ``mallopt``, or a reason it is not available."""
    # glibc's own answer and soname: platform.libc_ver reads the interpreter's binary and find_library runs
    # ldconfig, which cost a fresh process's first session more than the rest of the provider's setup
    named = "CS_GNU_LIBC_VERSION" in getattr(os, "confstr_names", {})  # Unix only; glibc answers "glibc 2.36"
    libc_name = (os.confstr("CS_GNU_LIBC_VERSION") or "").split(" ")[0] if named else ""
    if platform.system() != "Linux" or libc_name != "glibc":
        return None, f"the C library is not glibc ({platform.system()}, {libc_name or 'unknown'})"
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError) as exc:
        return None, f"glibc's mallopt could not be loaded: {exc}"
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return mallopt, ""


def apply_arena_settings(session_config: dict[str, str], load=_load_glibc) -> ArenaStatus:
    """Keep freed host buffers for reuse when the session asks for the CPU arena (the default)."""
    global _status
    if session_config.get(ARENA_KEY, "1") != "1":
        kept = ("an earlier session's arena stays in place, as malloc is process-wide" if _status is not None
                else "malloc keeps its default policy")
        return ArenaStatus(False, f"enable_cpu_mem_arena is off: {kept}")
    if _status is not None:
        return _status
    mallopt, reason = load()
    if mallopt is None:
        return ArenaStatus(False, f"no CPU memory arena: {reason}")
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return ArenaStatus(False, "no CPU memory arena: glibc refused the mallopt thresholds")
    _status = ArenaStatus(True, f"glibc malloc keeps freed blocks up to {MMAP_THRESHOLD >> 20} MiB in its heap "
                                f"and up to {TRIM_THRESHOLD >> 20} MiB free at the heap top")
    return _status
