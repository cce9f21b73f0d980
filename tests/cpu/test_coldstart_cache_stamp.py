"""The compiled loops' disk cache is stamped with their whole package (compiled/cache_stamp.py).

numba compiles a loop that calls another module's loop with the callee inlined; keyed on its own file only,
its cache entry kept the old callee after the callee's module changed. Each check runs fresh interpreters
on a package of two modules in a temporary folder (its cache next to it, in ``__pycache__``).
"""

from __future__ import annotations

import os
import textwrap

import pytest
from cached_loop_process import run_script

pytest.importorskip("numba")

CALLEE = """
from onnx_runtime_ep_cpu.compiled import compiler

@compiler()
def scale(x):
    return x * {factor}
"""

CALLER = """
from onnx_runtime_ep_cpu.compiled import compiler

from .callee import scale

@compiler()
def total(values):
    s = 0.0
    for v in values:
        s += scale(v)
    return s
"""

RUN = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from pkg.caller import total
value = total(np.arange(4.0))
dispatcher = total.dispatcher()
print(json.dumps({"value": float(value), "hits": sum(dispatcher.stats.cache_hits.values()),
                  "misses": sum(dispatcher.stats.cache_misses.values()),
                  "stamp": repr(dispatcher._cache._cache_file._source_stamp),
                  "locator": type(dispatcher._cache._impl.locator).__name__}))
"""


def _write_package(root, factor: float) -> None:
    package = root / "pkg"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "callee.py").write_text(textwrap.dedent(CALLEE.format(factor=factor)))
    (package / "caller.py").write_text(textwrap.dedent(CALLER))


def _run(root) -> dict:
    return run_script(RUN, root)


def test_a_change_in_an_inlined_module_invalidates_the_callers_cache(tmp_path):
    _write_package(tmp_path, 2.0)
    first = _run(tmp_path)
    assert first["value"] == pytest.approx(12.0)
    assert first["locator"] == "PackageInTreeLocator"
    assert first["misses"] >= 1 and first["hits"] == 0
    assert any(name.startswith("caller.total") and name.endswith(".nbi")
               for name in os.listdir(tmp_path / "pkg" / "__pycache__"))

    again = _run(tmp_path)  # unchanged sources: read from the cache, not compiled
    assert again["value"] == pytest.approx(12.0)
    assert again["hits"] >= 1 and again["misses"] == 0
    assert again["stamp"] == first["stamp"]

    _write_package(tmp_path, 3.0)  # only the callee's module changes; the caller's file is the same
    changed = _run(tmp_path)
    assert changed["value"] == pytest.approx(18.0), "the caller's cache entry kept the old callee"
    assert changed["stamp"] != first["stamp"]
    assert changed["misses"] >= 1 and changed["hits"] == 0

    assert _run(tmp_path)["hits"] >= 1  # the recompiled entry is cached again


def test_the_provider_loops_use_the_package_stamp():
    from onnx_runtime_ep_cpu.compiled import cache_stamp
    from onnx_runtime_ep_cpu.compiled.matmul import __file__ as matmul_file

    folder = os.path.dirname(matmul_file)
    stamp = cache_stamp.package_stamp(folder)
    assert len(stamp) == 64 and stamp == cache_stamp.package_stamp(folder)
    from onnx_runtime_ep_cpu.compiled import jobs

    loops = [v for v in vars(jobs).values() if hasattr(v, "_build_dispatcher")]
    assert loops, "jobs.py defines compiled loops"
    dispatcher = loops[0].dispatcher()
    cache = getattr(dispatcher, "_cache", None)
    if not isinstance(cache, cache_stamp.PackageFunctionCache):
        pytest.skip("no writable cache folder for the provider's loops here")
    assert cache._cache_file._source_stamp == stamp  # noqa: SLF001


def test_the_stamp_covers_every_module_of_the_folder(tmp_path):
    from onnx_runtime_ep_cpu.compiled.cache_stamp import package_stamp

    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    (tmp_path / "notes.txt").write_text("not a module")
    before = package_stamp.__wrapped__(str(tmp_path))
    (tmp_path / "notes.txt").write_text("still not a module")
    assert package_stamp.__wrapped__(str(tmp_path)) == before
    (tmp_path / "b.py").write_text("y = 3\n")  # same size, other content
    assert package_stamp.__wrapped__(str(tmp_path)) != before
    (tmp_path / "b.py").write_text("y = 2\n")
    assert package_stamp.__wrapped__(str(tmp_path)) == before
    (tmp_path / "c.py").write_text("")
    assert package_stamp.__wrapped__(str(tmp_path)) != before
