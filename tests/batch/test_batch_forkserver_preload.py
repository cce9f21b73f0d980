"""The local engine's forkserver imports numba and the CPU provider's compiled-kernel modules once for all its
workers (onnx_runtime.batch.engines.forkserver_preload): a forked worker then starts its first shard without
importing them, and the imports leave the server fork-safe (no thread, no device)."""

from __future__ import annotations

import subprocess
import sys

from onnx_runtime.batch.engines import forkserver_preload


def test_the_preload_names_numba_and_every_compiled_module():
    names = forkserver_preload()
    assert names[:3] == ["onnx_runtime.batch.job", "onnx_runtime.session", "onnx_runtime_ep_cpu"]
    assert "numba" in names
    compiled = [name for name in names if name.startswith("onnx_runtime_ep_cpu.compiled.")]
    assert "onnx_runtime_ep_cpu.compiled.directconv" in compiled and len(compiled) >= 10


def test_importing_the_preload_starts_no_thread_and_a_forked_worker_needs_no_import():
    script = (
        "import importlib, os, sys, threading\n"
        "from onnx_runtime.batch.engines import forkserver_preload\n"
        "for name in forkserver_preload():\n"
        "    importlib.import_module(name)\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "read, write = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    before = set(sys.modules)\n"
        "    from onnx_runtime_ep_cpu.compiled import directconv, segment_loops  # noqa: F401\n"
        "    import numba  # noqa: F401\n"
        "    os.write(write, str(len(set(sys.modules) - before)).encode())\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
        "print(os.read(read, 64).decode())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "0"  # the forked child imported nothing new
