"""The meta path finder the background loader (deferred.py) puts first while it imports numba: another thread's
first import of a module of the compiled package (most import numba at their top) waits, before the module's code
runs, until that import is done (numba's package imports circularly, and breaks when two threads import it at
once). Only the loader's thread imports this module: a process whose runs end before it starts never does."""

from __future__ import annotations

import threading
from importlib.machinery import PathFinder


class WaitWhileImporting:
    """The finder, over ``state`` (deferred's: ``importing`` while the loader imports numba, ``loader_ident``)
    and ``lock`` (held by the loader around that import). The wait is in the loader's ``exec_module``, not in
    ``find_spec``: Python holds its global import lock around find_spec."""

    prefix = __name__.rsplit(".", 1)[0] + "."

    def __init__(self, state, lock) -> None:
        self.state, self.lock = state, lock

    def find_spec(self, name, path=None, target=None):
        state = self.state
        if not (state.importing and name.startswith(self.prefix) and threading.get_ident() != state.loader_ident):
            return None
        spec = PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = WaitingLoader(spec.loader, state, self.lock)
        return spec


class WaitingLoader:
    """Runs the module's own loader once the loader thread's import of numba is done."""

    def __init__(self, loader, state, lock) -> None:
        self.loader, self.state, self.lock = loader, state, lock

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = module.__spec__.loader = self.loader  # the module's own, as if never wrapped
        if self.state.importing:
            with self.lock:
                pass
        self.loader.exec_module(module)
