"""numba's reference-counting runtime is set up from a cached object file (compiled/nrt_cache.py).

A fresh process linking its first cached loop used to compile the runtime's LLVM module (``rtsys.initialize``)
every time. Each check runs fresh interpreters over a package in a temporary folder whose loop allocates and
returns an array (the runtime's allocation and reference counts), its cache next to it in ``__pycache__``.
"""

from __future__ import annotations

import os
import textwrap

import numpy as np
import pytest
from cached_loop_process import run_script

pytest.importorskip("numba")

LOOP = """
import numpy as np

from onnx_runtime_ep_cpu.compiled import compiler

@compiler()
def midpoints(values):
    out = np.empty(values.shape[0] - 1)
    for i in range(out.shape[0]):
        out[i] = 0.5 * (values[i] + values[i + 1])
    return out
"""

RUN = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import numba
from numba.core.runtime import nrtdynmod, rtsys
compiles = [0]
create = nrtdynmod.create_nrt_module
def counted(ctx):
    compiles[0] += 1
    return create(ctx)
nrtdynmod.create_nrt_module = counted
from pkg.loop import midpoints
values = np.linspace(-3.0, 5.0, 37)
cached = midpoints(values)
dispatcher = midpoints.dispatcher()
# a loop numba compiles in this process links the runtime library read from the file
fresh = numba.njit(lambda v: np.cumsum(v * 2.0))(values)
stats = rtsys.get_allocation_stats()
del cached
after = rtsys.get_allocation_stats()
print(json.dumps({"cached": midpoints(values).tolist(), "fresh": fresh.tolist(),
                  "hits": sum(dispatcher.stats.cache_hits.values()),
                  "runtime_compiles": compiles[0], "allocated": stats.alloc, "freed_after": after.free - stats.free}))
"""


def _write_package(root) -> None:
    package = root / "pkg"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "loop.py").write_text(textwrap.dedent(LOOP))


def _run(root) -> dict:
    # (the allocation counters: the runtime set up from the file enables them too)
    return run_script(RUN, root, {"NUMBA_NRT_STATS": "1"})


def _runtime_files(root) -> list:
    return sorted(name for name in os.listdir(root / "pkg" / "__pycache__")
                  if name.startswith("nrt-") and name.endswith(".nbo"))


def _check_values(result: dict) -> None:
    values = np.linspace(-3.0, 5.0, 37)
    np.testing.assert_allclose(result["cached"], 0.5 * (values[:-1] + values[1:]), rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(result["fresh"], np.cumsum(values * 2.0), rtol=1e-12, atol=1e-12)
    assert result["allocated"] >= 2 and result["freed_after"] >= 1  # arrays made and released by the runtime


def test_a_later_process_reads_the_runtime_instead_of_compiling_it(tmp_path):
    _write_package(tmp_path)
    first = _run(tmp_path)
    _check_values(first)
    assert first["runtime_compiles"] == 1
    written = _runtime_files(tmp_path)
    assert len(written) == 1

    again = _run(tmp_path)  # the loop from numba's cache, the runtime from the file: nothing compiled for it
    _check_values(again)
    assert again["hits"] >= 1
    assert again["runtime_compiles"] == 0
    assert _runtime_files(tmp_path) == written  # the same file, read


def test_a_damaged_runtime_file_is_compiled_again_and_rewritten(tmp_path):
    _write_package(tmp_path)
    _check_values(_run(tmp_path))
    (name,) = _runtime_files(tmp_path)
    path = tmp_path / "pkg" / "__pycache__" / name
    path.write_bytes(path.read_bytes()[:100])  # truncated

    damaged = _run(tmp_path)
    _check_values(damaged)
    assert damaged["runtime_compiles"] == 1
    assert path.stat().st_size > 100  # rewritten whole
    restored = _run(tmp_path)
    _check_values(restored)
    assert restored["runtime_compiles"] == 0


def test_the_key_follows_the_target():
    from numba.core.registry import cpu_target
    from onnx_runtime_ep_cpu.compiled.nrt_cache import runtime_key

    codegen = cpu_target.target_context.codegen()
    key = runtime_key(codegen)
    assert len(key) == 32 and key == runtime_key(codegen)

    class OtherTarget:
        def magic_tuple(self):
            triple, cpu, features = codegen.magic_tuple()
            return triple, "another-cpu", features

    assert runtime_key(OtherTarget()) != key
