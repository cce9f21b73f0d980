"""The plan key's code fingerprint takes an imported module's size and time from its import (the package finder's
loader keeps the stat importlib makes to check the bytecode cache) instead of a second stat: the key names the
code the process runs, and a warm creation stats only the modules not imported yet."""

from __future__ import annotations

import os
import sys

import pytest
from onnx_runtime import package_finder, plan_cache
from onnx_runtime.package_finder import FINDER, LOADED_STATS


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A package ``stat_pkg`` on sys.path, served by the runtime's finder, with modules ``used`` and ``unused``."""
    root = tmp_path / "stat_pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "used.py").write_text("VALUE = 1\n")
    (root / "unused.py").write_text("VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(FINDER, "prefixes", FINDER.prefixes)  # (serve's prefix gone after the test)
    package_finder.serve("stat_pkg")
    yield root
    for name in [m for m in sys.modules if m == "stat_pkg" or m.startswith("stat_pkg.")]:
        del sys.modules[name]
    for path in [p for p in LOADED_STATS if p.startswith(str(root))]:
        del LOADED_STATS[path]
    plan_cache.package_fingerprint.cache_clear()


def _fingerprint() -> str:
    plan_cache.package_fingerprint.cache_clear()
    return plan_cache.package_fingerprint("stat_pkg.used")


def test_an_imported_module_is_keyed_by_what_its_import_read(served):
    import stat_pkg.used  # noqa: F401  (through the finder's loader)

    used = str(served / "used.py")
    stat = os.stat(used)
    assert LOADED_STATS[used] == (stat.st_size, stat.st_mtime_ns)
    imported = _fingerprint()
    (served / "used.py").write_text("VALUE = 11  # edited after the import\n")
    assert _fingerprint() == imported  # this process still runs the imported code: its plans are still its own
    (served / "unused.py").write_text("VALUE = 22  # not imported: its file is stat-ed\n")
    assert _fingerprint() != imported
    del LOADED_STATS[used]  # a process that imports the edited module keys its new size and time
    assert _fingerprint() != imported
