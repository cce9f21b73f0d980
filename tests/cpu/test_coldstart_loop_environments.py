"""A cached loop's environments are read without importing the modules they name (compiled/cache_stamp.py).

numba rebuilds the environment of every function compiled into a cached library with its module's globals,
importing the module: a loop assigning an array slice carries numba's shape-mismatch error (numba.np.arrayobj,
with its string helpers), and loading it imported that module in a process that never compiles. Each check runs
fresh interpreters over a package in a temporary folder, its cache next to it in ``__pycache__``.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest
from cached_loop_process import run_script

pytest.importorskip("numba")

LOOP = """
import numpy as np

from onnx_runtime_ep_cpu.compiled import compiler

@compiler()
def shifted_copy(values, out, width):
    # an array slice assigned from an array: numba checks the shapes and raises with both in its message
    for start in range(0, values.shape[0], width):
        out[start:start + width] = values[start:start + width] * 2.0 + 1.0
    return out
"""

RUN = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from pkg.loop import shifted_copy
values = np.linspace(-3.0, 5.0, 40)
out = shifted_copy(values, np.zeros(40), 8)
try:
    shifted_copy(values, np.zeros(30), 8)  # the last slices are shorter than the values': numba's ValueError
    error = None
except ValueError as exc:
    error = str(exc)
dispatcher = shifted_copy.dispatcher()
print(json.dumps({"out": out.tolist(), "error": error, "hits": sum(dispatcher.stats.cache_hits.values()),
                  "arrayobj_imported": "numba.np.arrayobj" in sys.modules}))
"""


def _run(root) -> dict:
    return run_script(RUN, root)


def _check(result: dict) -> None:
    values = np.linspace(-3.0, 5.0, 40)
    np.testing.assert_allclose(result["out"], values * 2.0 + 1.0, rtol=1e-15, atol=1e-15)
    assert result["error"] is not None and "cannot assign slice" in result["error"]


def test_a_cached_loop_loads_without_importing_its_environments_modules(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "loop.py").write_text(textwrap.dedent(LOOP))

    compiled = _run(tmp_path)  # compiles (numba imports its array module to compile) and writes the cache
    _check(compiled)
    assert compiled["arrayobj_imported"]

    cached = _run(tmp_path)  # the loop from the cache: its array-helper environments need no module
    _check(cached)  # the shape-mismatch error, raised from those helpers' code, still reads as numba's
    assert cached["hits"] >= 1
    assert not cached["arrayobj_imported"]
