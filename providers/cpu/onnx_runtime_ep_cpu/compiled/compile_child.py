"""The background loader's compile process: fills numba's disk cache with what a session's compiled paths need.

A cache miss costs seconds to a minute of compiling per loop, and a compile cannot be stopped halfway: one
in the loader thread would hold the process at exit, and one on a run's thread stalls that run. So the loader
(deferred.py) hands its misses to a child interpreter at low priority that compiles them into the same cache
(same sources, same locator, same stamp) and exits; the loader then links them from the cache, milliseconds
each, and switches. A process that ends sooner kills the child: what it finished stays cached.

The request (JSON on the child's stdin): ``loops``, [module, qualname, [argument description, ...]] per
signature (child_process.encode's); ``kinds``, [module, attribute] of job kinds (workers.Kind) whose runners to
compile; and what a run's thread missed (deferred._guard): ``signatures``, [module, qualname, numba signature
pickled, base64] per loop signature, and ``runners``, [module, qualname] of a job kind's entry function.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import pickle
import sys

import numpy as np


def numba_type(encoded: list):
    """The numba type of an encoded argument."""
    import numba
    from numba.np import numpy_support

    if encoded[0] == "array":
        _, dtype, ndim, layout, readonly = encoded
        return numba.types.Array(numpy_support.from_dtype(np.dtype(dtype)), ndim, layout, readonly=readonly)
    if encoded[0] == "scalar":
        return numba.typeof(np.dtype(encoded[1]).type(encoded[2]))
    return numba.typeof(encoded[1])


def _loops_of(module) -> dict:
    """The module's compiled loops by qualname, the job kinds' generated writers and readers included."""
    from .deferred import Loop
    from .workers import Kind

    found = {}
    for value in list(vars(module).values()):
        if isinstance(value, Kind):
            for loop in (value.writer, value.reader):
                found[loop.__qualname__] = loop
        elif isinstance(value, Loop):
            found.setdefault(value.__qualname__, value)
    return found


def _loop(modules: dict, name: str, qualname: str):
    if name not in modules:
        modules[name] = _loops_of(importlib.import_module(name))
    loop = modules[name].get(qualname)
    if loop is None:
        raise LookupError("no such compiled loop")
    return loop


def _runner(name: str, qualname: str):
    from .workers import Kind

    for kind in vars(importlib.import_module(name)).values():
        if isinstance(kind, Kind) and kind._entry.__qualname__ == qualname:  # noqa: SLF001
            return kind
    raise LookupError("no job kind runs this entry")


def compile_request(request: dict) -> int:
    """Compile what ``request`` names (see the module doc); returns the count of failures (each printed)."""
    from .deferred import ensure_numba

    ensure_numba()
    modules: dict = {}
    work = [(f"{name}.{attribute}", lambda n=name, a=attribute: getattr(importlib.import_module(n), a).address())
            for name, attribute in request.get("kinds", ())]
    work += [(f"{name}.{qualname}{arguments}",
              lambda n=name, q=qualname, a=arguments: _loop(modules, n, q).dispatcher().compile(
                  tuple(numba_type(x) for x in a)))
             for name, qualname, arguments in request.get("loops", ())]
    work += [(f"{name}.{qualname}", lambda n=name, q=qualname, e=encoded: _loop(modules, n, q).dispatcher().compile(
        pickle.loads(base64.b64decode(e))))  # the parent's own pickle of numba types (see the module doc)
             for name, qualname, encoded in request.get("signatures", ())]
    work += [(f"{name}.{qualname}", lambda n=name, q=qualname: _runner(n, q).address())
             for name, qualname in request.get("runners", ())]
    failures = 0
    for label, compile_one in work:
        try:
            compile_one()
        except Exception as exc:  # noqa: BLE001  (one failure must not keep the others from the cache)
            failures += 1
            print(f"{label}: {type(exc).__name__}: {exc}", file=sys.stderr)
    return failures


def main() -> int:
    try:
        # below the parent's runs, but not as far as its loader thread: this is a minute of work, which at the
        # lowest priorities a busy host would hold back for many (the parent stays on numpy paths meanwhile)
        os.nice(5)
    except (AttributeError, OSError):
        pass
    return 1 if compile_request(json.load(sys.stdin)) else 0


if __name__ == "__main__":
    sys.exit(main())
