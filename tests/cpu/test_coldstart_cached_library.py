"""A cached loop's library links without parsing its linking bitcode (compiled/cached_library.py).

numba parsed the bitcode a cached library keeps for later compiles that inline it, and walked it for the names
it defines, whenever a process loaded the entry. Each process check runs fresh interpreters over a package in a
temporary folder, its cache next to it in ``__pycache__``.
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
def smoothed(values, out):
    for i in range(out.shape[0]):
        out[i] = 0.25 * values[i] + 0.5 * values[i + 1] + 0.25 * values[i + 2]
    return out
"""

RUN = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from pkg.loop import smoothed
values = np.cos(np.linspace(-3.0, 5.0, 41))
out = smoothed(values, np.zeros(39))
library = next(iter(smoothed.dispatcher().overloads.values())).library
unparsed_after_call = library.__dict__.get("_linking_bitcode") is not None
# a function compiled here calling the cached loop links that loop's bitcode
import numba
from onnx_runtime_ep_cpu.compiled.deferred import ensure_numba
ensure_numba()
twice = numba.njit(lambda v, o: smoothed(v, o) * 2.0)(values, np.zeros(39))
print(json.dumps({"out": out.tolist(), "twice": twice.tolist(), "library": type(library).__name__,
                  "hits": sum(smoothed.dispatcher().stats.cache_hits.values()),
                  "unparsed_after_call": unparsed_after_call,
                  "parsed_after_link": library.__dict__.get("_linking_module") is not None}))
"""


def _run(root) -> dict:
    return run_script(RUN, root)


def _check(result: dict) -> None:
    values = np.cos(np.linspace(-3.0, 5.0, 41))
    expected = 0.25 * values[:-2] + 0.5 * values[1:-1] + 0.25 * values[2:]
    np.testing.assert_allclose(result["out"], expected, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(result["twice"], 2.0 * expected, rtol=1e-14, atol=1e-15)


def test_a_cached_loop_parses_its_linking_bitcode_only_when_a_compile_links_it(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "loop.py").write_text(textwrap.dedent(LOOP))
    _check(_run(tmp_path))  # compiled, and the cache written

    cached = _run(tmp_path)
    _check(cached)
    assert cached["hits"] >= 1
    assert cached["library"].startswith("Lazy")
    assert cached["unparsed_after_call"]  # running it needed no bitcode
    assert cached["parsed_after_link"]  # the fresh caller inlined it, from the bitcode parsed then


def test_the_object_defines_every_name_the_linking_bitcode_defines():
    from llvmlite import binding
    from onnx_runtime_ep_cpu.compiled.cache_stamp import _LoopUnpickler
    from onnx_runtime_ep_cpu.compiled.cached_library import defined_symbols
    from onnx_runtime_ep_cpu.compiled.conv_chain import run_chain

    run_chain(np.zeros((0, 40), np.int64), np.zeros(1))  # nothing to run: compiles or loads its one overload
    folder = run_chain.dispatcher()._cache._cache_path  # noqa: SLF001
    entries = [name for name in os.listdir(folder) if name.startswith("conv_chain.run_chain-")
               and name.endswith(".nbc")]
    assert entries
    for entry in entries:
        with open(os.path.join(folder, entry), "rb") as data:
            name, kind, (object_code, bitcode) = _LoopUnpickler(data).load()[0]
        assert kind == "object"
        module = binding.parse_bitcode(bitcode)
        in_bitcode = {g.name for group in (module.functions, module.global_variables) for g in group
                      if not g.is_declaration}
        assert in_bitcode and in_bitcode <= defined_symbols(object_code)


def test_other_object_formats_take_numbas_path():
    from onnx_runtime_ep_cpu.compiled.cached_library import defined_symbols

    assert defined_symbols(b"\xcf\xfa\xed\xfe" + bytes(60)) is None  # Mach-O
    assert defined_symbols(b"\x7fELF\x01\x01" + bytes(58)) is None  # 32-bit ELF
