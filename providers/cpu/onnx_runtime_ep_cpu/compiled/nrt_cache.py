"""numba's reference-counting runtime (NRT) set up with its compiled functions read from a cache file.

Before a process links its first cached loop, numba's runtime must be initialized (``rtsys.initialize``): it
registers the runtime's C helpers as symbols and compiles a small LLVM module of atomic reference-count
functions, running LLVM's optimization and code generation every process. That compile is most of what a
fresh process (a Ray or Dask worker, a command-line run) spends linking its first loop after numba's import.
Here the module's machine code is kept beside the loops' cache entries, as numba keeps theirs (the object code
and the module's bitcode for linking), and read back in later processes: the same library numba would build,
which numba's own compiles then link against as before.

The file is keyed by what makes the machine code: numba's and llvmlite's versions and the runtime module's
source, the target (triple, CPU name and features: numba's ``magic_tuple``), so a change of any makes a new
file. A file that does not read back (damaged, another numba's) is compiled again and rewritten; a folder that
is not writable only costs the compile. Where numba's runtime object is not as this module expects (another numba
release), numba's own ``rtsys.initialize`` runs instead.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pickle
import uuid

PREFIX = "nrt-"
SUFFIX = ".nbo"


def initialize_runtime(target_context, folder: str | None) -> None:
    """``rtsys.initialize(target_context)``, reading the runtime's compiled functions from ``folder`` (compiling
    and writing them there the first time). Once per process: later calls return at once, as numba's do."""
    from numba.core.compiler_lock import global_compiler_lock
    from numba.core.runtime import rtsys

    if getattr(rtsys, "_init", False):
        return
    if folder is None or not _expected_runtime(rtsys):
        rtsys.initialize(target_context)
        return
    with global_compiler_lock:  # (numba's initialize holds it too: one thread compiles or reads)
        if rtsys._init:  # noqa: SLF001
            return
        _register_helpers()
        codegen = target_context.codegen()
        path = os.path.join(folder, f"{PREFIX}{runtime_key(codegen)}{SUFFIX}")
        library = _read(path, codegen)
        if library is None:
            library = _compile(target_context)
            _write(path, library.serialize_using_object_code())
        rtsys._library = library  # noqa: SLF001  (what numba's initialize sets)
        rtsys._init = True  # noqa: SLF001


def _expected_runtime(rtsys) -> bool:
    """Whether numba's runtime object keeps its state as this module sets it: the ``_init`` flag, and the library
    (``_library``) that its ``library`` property returns."""
    return isinstance(getattr(rtsys, "_init", None), bool) and isinstance(getattr(type(rtsys), "library", None),
                                                                         property)


def _register_helpers() -> None:
    """The first half of ``rtsys.initialize``: the runtime's C helpers as symbols the machine code resolves."""
    from llvmlite import binding as ll
    from numba.core import config
    from numba.core.runtime import nrt

    helpers = nrt._nrt  # noqa: SLF001  (the C extension numba's initialize reads them from)
    if config.NRT_STATS:
        helpers.memsys_enable_stats()
    for py_name, address in helpers.c_helpers.items():
        ll.add_symbol(py_name if py_name.startswith("_") else "NRT_" + py_name, address)


def _compile(target_context):
    """The second half: the runtime's LLVM module compiled, with its object code kept for serializing."""
    from numba.core.runtime import nrtdynmod

    ir_module, library = nrtdynmod.create_nrt_module(target_context)
    library.add_ir_module(ir_module)
    library.enable_object_caching()
    library.finalize()
    return library


def runtime_key(codegen) -> str:
    """What the runtime's machine code depends on, hashed: numba's and llvmlite's versions, the source of numba's
    runtime module (an edited numba install), LLVM's version and the target numba compiles for."""
    import llvmlite
    import numba
    from llvmlite import binding as ll
    from numba.core.runtime import nrtdynmod

    try:
        stat = os.stat(nrtdynmod.__file__)
        source = (stat.st_size, stat.st_mtime_ns)
    except (OSError, TypeError):
        source = None
    parts = (numba.__version__, llvmlite.__version__, tuple(ll.llvm_version_info), source, codegen.magic_tuple())
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:32]


def _read(path: str, codegen):
    """The library serialized at ``path``, or None where there is none or it does not read back."""
    try:
        with open(path, "rb") as handle:
            state = pickle.load(handle)
        name, kind, _ = state
        if kind != "object" or not isinstance(name, str):
            return None
        return codegen.unserialize_library(state)
    except Exception:  # noqa: BLE001  (a damaged or foreign file: compiled again and rewritten)
        return None


def _write(path: str, state) -> None:
    """``state`` at ``path``, whole or not at all (a temporary file renamed into place, with the permissions numba
    gives its cache files); nothing where the folder is not writable."""
    temporary = f"{path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(temporary, "xb") as handle:
            pickle.dump(state, handle, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(temporary)
