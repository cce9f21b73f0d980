"""What every session creation pays before its plans are read, made cheaper without changing what it decides:
the plan key's fingerprint of the installed code (plan_cache.py) still changes with any module's size, time or
name and ignores bytecode caches; the provider handle's hook specifications (plugin_manager.py) are the ones
pluggy's own lookup finds."""

from __future__ import annotations

import os
import sys
import types

import pluggy
import pytest
from onnx_runtime import plan_cache
from onnx_runtime.contract.hookspecs import ExecutionProviderSpec
from onnx_runtime.contract.markers import PROJECT
from onnx_runtime.plugin_manager import ContractManager


@pytest.fixture
def package(on_disk_package):
    """A package on disk (two folders deep, a bytecode cache folder in it) registered under a name of its own, and
    a fingerprint reader that forgets what it computed (the real one is cached per process)."""
    root, fingerprint = on_disk_package("fingerprinted")
    (root / "inner" / "__pycache__").mkdir()
    return root, fingerprint


def test_the_code_fingerprint_follows_every_module(package):
    root, fingerprint = package
    seen = {fingerprint()}
    assert fingerprint() in seen  # the same files: the same key
    nested = root / "inner" / "second.py"
    nested.write_text("Y = 22\n")  # a nested module's size
    seen.add(fingerprint())
    stat = nested.stat()
    os.utime(nested, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # only its time
    seen.add(fingerprint())
    (root / "inner" / "third.py").write_text("")  # a new module
    seen.add(fingerprint())
    os.rename(root / "first.py", root / "renamed.py")  # the same bytes under another name
    seen.add(fingerprint())
    assert len(seen) == 5
    before = fingerprint()
    (root / "inner" / "__pycache__" / "second.cpython-311.py").write_text("not a module")
    (root / "notes.txt").write_text("not Python")
    assert fingerprint() == before  # bytecode caches and other files change no plan


def test_a_package_without_a_file_is_keyed_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "fileless", types.ModuleType("fileless"))
    assert plan_cache.package_fingerprint("fileless.part") == "fileless.part"


def _pluggy_specs(namespace) -> dict[str, dict]:
    manager = pluggy.PluginManager(PROJECT)
    manager.add_hookspecs(namespace)
    return {name: caller.spec.opts for name, caller in vars(manager.hook).items()
            if isinstance(caller, pluggy.HookCaller)}


def test_the_handle_reads_the_specifications_pluggy_reads():
    class Extended(ExecutionProviderSpec):  # inherited hooks, and a staticmethod the fast lookup leaves to pluggy
        @staticmethod
        @pluggy.HookspecMarker(PROJECT)(firstresult=True)
        def extra_hook(value):
            """A hook of this test only."""

    for namespace in (ExecutionProviderSpec, Extended):
        expected = _pluggy_specs(namespace)
        contract = ContractManager(PROJECT)
        contract.add_hookspecs(namespace)
        got = {name: caller.spec.opts for name, caller in vars(contract.hook).items()
               if isinstance(caller, pluggy.HookCaller)}
        assert got == expected and len(got) >= 100
    assert got["extra_hook"]["firstresult"] is True
