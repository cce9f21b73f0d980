"""Cold start on a fresh install: with an empty numba cache, a cfunc whose code calls a compiled loop compiles.

numba types a loop (a deferred.Loop) only once compiled/deferred.py registered its type, which building a loop's
dispatcher did; a cfunc (the helper threads' job writers of jobs.py) compiled before any loop was built failed
with "Untyped global name ... Loop" on every fresh cache (``onnx-runtime compile`` failed on all nine CNNs).
"""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = r"""
import sys
import numpy as np
from onnx_runtime_ep_cpu.compiled import cached_cfunc, jit

@jit
def twice(x):
    return 2.0 * x

def calls_twice(x):
    return twice(x) + 1.0

callback = cached_cfunc("float64(float64)", calls_twice)
print(callback.ctypes(20.0))
"""


def test_a_cfunc_calling_a_loop_compiles_on_an_empty_cache(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"}
    env["NUMBA_CACHE_DIR"] = str(tmp_path)
    module = tmp_path / "cold_cfunc_probe.py"  # numba caches per source file: a file of the test's own
    module.write_text(SCRIPT)
    done = subprocess.run([sys.executable, str(module)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["41.0"]
