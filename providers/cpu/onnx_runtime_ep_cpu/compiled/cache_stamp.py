"""numba's disk cache for the compiled loops, stamped with the sources of the loop's whole package.

numba keys a cached loop on a hash of its own file only. A loop that calls a loop of another module compiles
that callee into its own machine code, so after the callee's module changes (an editable install after a
pull, a developer's edit) the caller's cache entry still holds the old callee, and numba reads it back as
fresh. Here a loop's stamp is a hash over every module of its package (for the CPU provider, every module
of compiled/, where all its loops live, and nothing outside it calls into them), so a change anywhere in the
package makes every entry of it stale and the loops compile again once. Where the cache lives is numba's
choice as before (NUMBA_CACHE_DIR, the package's ``__pycache__``, numba's user cache folder); only the stamp
differs. numba's caches of code outside this provider are untouched.

Imported when a loop's dispatcher is built (numba is loaded by then).
"""

from __future__ import annotations

import functools
import hashlib
import io
import os
import pickle
import sys

from numba.core import caching, environment

from . import cached_library

_STAMP_VERSION = "package-sources-1"  # changes the stamp of every entry when this scheme changes


@functools.cache
def package_stamp(folder: str) -> str:
    """SHA-256 over the names and contents of the ``.py`` files directly in ``folder`` (sorted by name).

    Computed once per process and folder: the stamp then describes the sources this process imported (a file
    edited while the process runs is not reloaded either)."""
    digest = hashlib.sha256(_STAMP_VERSION.encode())
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".py"):
            continue
        try:
            with open(os.path.join(folder, name), "rb") as source:
                content = source.read()
        except OSError:  # removed meanwhile, or unreadable: its name still counts
            content = b""
        digest.update(name.encode() + b"\0" + len(content).to_bytes(8, "little") + content)
    return digest.hexdigest()


class _PackageStamp:
    """A locator whose source stamp covers every module of the function's package."""

    _py_file: str

    def get_source_stamp(self):
        return package_stamp(os.path.dirname(os.path.abspath(self._py_file)))


class PackageUserProvidedLocator(_PackageStamp, caching.UserProvidedCacheLocator):
    pass


class PackageInTreeLocator(_PackageStamp, caching.InTreeCacheLocator):
    pass


class PackageUserWideLocator(_PackageStamp, caching.UserWideCacheLocator):
    pass


class _PackageCacheImpl(caching.CompileResultCacheImpl):
    # numba's order (a user-provided folder first, then next to the source, then the user-wide folder); the
    # IPython and zip locators do not apply to an installed package's files
    _locator_classes = [PackageUserProvidedLocator, PackageInTreeLocator, PackageUserWideLocator]

    def rebuild(self, target_context, payload):
        return cached_library.rebuild(target_context, payload)  # its linking bitcode parsed at first use


def _environment_for_loop(modname, consts, env_name):
    """numba's ``_rebuild_env`` for a cached loop's environment, without importing the module it names.

    A loop's library refers to the environment of every function compiled into it (numba's array and string
    helpers among them), and numba rebuilds each one with its module's ``__dict__`` as globals, importing the
    module: loading the convolution chain imported numba.np.arrayobj (with numba's unicode and charseq) and
    modules of this package only for that. A nopython function never reads its environment's globals (object
    mode's lowering alone does), and every loop here is nopython, so an environment whose module is not
    imported yet gets globals naming the module only; the constants, which its code does read, are restored.
    A module already imported gets numba's own rebuild."""
    if modname in sys.modules or environment.lookup_environment(env_name) is not None:
        return environment._rebuild_env(modname, consts, env_name)  # noqa: SLF001
    env = environment.Environment({"__name__": modname})  # (can_cache and __reduce__ read the name)
    env.consts[:] = consts
    env.env_name = env_name
    environment.Environment._memo[env_name] = env  # noqa: SLF001  (as numba's rebuild keeps it)
    return env


class _LoopUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "numba.core.environment" and name == "_rebuild_env":
            return _environment_for_loop
        return super().find_class(module, name)


class _LoopCacheFile(caching.IndexDataCacheFile):
    """numba's index and data files, whose data unpickles the loops' environments by _environment_for_loop."""

    def _load_data(self, name):
        with open(self._data_path(name), "rb") as data:
            return _LoopUnpickler(io.BytesIO(data.read())).load()


class PackageFunctionCache(caching.FunctionCache):
    """numba's per-function cache of compile results, with the package-wide stamp, reading a cached library's
    environments without importing their modules (_environment_for_loop)."""

    _impl_class = _PackageCacheImpl

    def __init__(self, py_func):
        super().__init__(py_func)
        self._cache_file = _LoopCacheFile(cache_path=self._cache_path, filename_base=self._impl.filename_base,
                                          source_stamp=self._impl.locator.get_source_stamp())


def enable_caching(dispatcher_or_cfunc, function) -> None:
    """What numba's ``enable_caching`` does for a dispatcher or a cfunc, with the package-wide stamp.

    Raises numba's RuntimeError ("cannot cache function ...: no locator available") where no folder is
    writable, as ``enable_caching`` does."""
    dispatcher_or_cfunc._cache = PackageFunctionCache(function)  # noqa: SLF001  (numba keeps it there)
