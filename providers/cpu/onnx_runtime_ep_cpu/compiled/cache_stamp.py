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
import os

from numba.core import caching

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


class PackageFunctionCache(caching.FunctionCache):
    """numba's per-function cache of compile results, with the package-wide stamp."""

    _impl_class = _PackageCacheImpl


def enable_caching(dispatcher_or_cfunc, function) -> None:
    """What numba's ``enable_caching`` does for a dispatcher or a cfunc, with the package-wide stamp.

    Raises numba's RuntimeError ("cannot cache function ...: no locator available") where no folder is
    writable, as ``enable_caching`` does."""
    dispatcher_or_cfunc._cache = PackageFunctionCache(function)  # noqa: SLF001  (numba keeps it there)
