"""A finder for the submodules of the runtime's own packages (and of a provider's that asks for it), ahead of
importlib's path finder.

A new process imports some fifty of our modules for its first session, and importlib's search is a fifth of
each import: for every module it stats the folder (to see whether its listing changed), stats each candidate
file and builds the spec through ``spec_from_file_location``. Here each folder of a served package is listed once
per process and a module is found by a set lookup. Only the plain cases are answered, exactly as the path finder
answers them: ``name/__init__.py`` (a package folder wins over a module, as there) or ``name.py`` with no
extension module of that name beside it. Anything else (an extension module, a namespace folder, a file added
since the listing, a folder that does not list) is left to importlib as before, and a listed file removed since
is ModuleNotFoundError, as importlib says of a missing module. ``importlib.invalidate_caches()`` drops the
listings.
"""

from __future__ import annotations

import os
import sys
import threading
from importlib.machinery import EXTENSION_SUFFIXES, ModuleSpec, SourceFileLoader

_lock = threading.Lock()  # serve's edit of the prefixes (the finder reads them without it)
# Source path -> (size, mtime_ns) of every module loaded here, as importlib's check of its bytecode cache read
# them: the plan key's code fingerprint (plan_cache.package_fingerprint) takes a loaded module's from here rather
# than stat it again, which also keys what this process runs, not what the file became since.
LOADED_STATS: dict[str, tuple[int, int]] = {}


class _Loader(SourceFileLoader):
    """importlib's own source loader (bytecode cache, its checks and its writes), with a file removed since its
    folder was listed reported as the missing module importlib would report, and the source's stat kept."""

    def path_stats(self, path):
        stat = os.stat(path)
        LOADED_STATS[path] = (stat.st_size, stat.st_mtime_ns)
        return {"mtime": stat.st_mtime, "size": stat.st_size}

    def get_code(self, fullname):
        try:
            return super().get_code(fullname)
        except FileNotFoundError as exc:
            raise ModuleNotFoundError(f"No module named {fullname!r} ({self.path} is gone)", name=fullname) from exc


class PackageFinder:
    """The meta path finder of the served packages' submodules (see the module's docstring)."""

    def __init__(self) -> None:
        self.prefixes: tuple[str, ...] = ()  # "package." for each served package
        self.listings: dict[str, frozenset[str]] = {}

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        if not path or not fullname.startswith(self.prefixes):
            return None
        if type(path) is not list or len(path) != 1:  # (a namespace or extended __path__: importlib searches)
            return None
        tail, folder = fullname.rpartition(".")[2], path[0]
        names = self.listings.get(folder)
        if names is None:
            try:
                names = frozenset(os.listdir(folder))
            except OSError:
                return None
            self.listings[folder] = names
        if tail in names:  # a package folder, which importlib prefers to a module of the same name
            init = os.path.join(folder, tail, "__init__.py")
            if not os.path.isfile(init):
                return None  # (a namespace portion or a file without a suffix: importlib decides)
            spec = ModuleSpec(fullname, _Loader(fullname, init), origin=init, is_package=True)
            spec.submodule_search_locations = [os.path.join(folder, tail)]
        else:
            source = tail + ".py"
            if source not in names or any(tail + suffix in names for suffix in EXTENSION_SUFFIXES):
                return None
            origin = os.path.join(folder, source)
            spec = ModuleSpec(fullname, _Loader(fullname, origin), origin=origin)
        spec.has_location = True
        return spec

    def invalidate_caches(self) -> None:
        self.listings = {}


FINDER = PackageFinder()


def serve(package: str) -> None:
    """Find ``package``'s submodules (every level) through FINDER from now on; the finder goes first on
    sys.meta_path at the first call."""
    with _lock:
        prefix = package + "."
        if prefix not in FINDER.prefixes:
            FINDER.prefixes = (*FINDER.prefixes, prefix)
        if FINDER not in sys.meta_path:
            sys.meta_path.insert(0, FINDER)


serve(__name__.rpartition(".")[0])  # the runtime's own package, from its first import on
