"""Fixtures the core tests share."""

from __future__ import annotations

import sys
import types

import pytest
from onnx_runtime import plan_cache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The plan cache on, in a folder of this test's own (the suite runs with it off)."""
    monkeypatch.setenv(plan_cache.ENV_ENABLE, "1")
    monkeypatch.setenv(plan_cache.ENV_DIR, str(tmp_path / "plans"))
    return tmp_path / "plans"


@pytest.fixture
def on_disk_package(tmp_path, monkeypatch):
    """``make(name)``: a package ``name`` in this test's folder (``first.py``, ``inner/second.py``) registered in
    sys.modules under its name -> (its folder, a reader of its code fingerprint that forgets what it computed; the
    real one is cached per process)."""

    def make(name: str):
        root = tmp_path / name
        (root / "inner").mkdir(parents=True)
        (root / "__init__.py").write_text("")
        (root / "first.py").write_text("X = 1\n")
        (root / "inner" / "second.py").write_text("Y = 2\n")
        module = types.ModuleType(name)
        module.__file__ = str(root / "__init__.py")
        monkeypatch.setitem(sys.modules, name, module)

        def fingerprint() -> str:
            plan_cache.package_fingerprint.cache_clear()
            try:
                return plan_cache.package_fingerprint(f"{name}.first")
            finally:
                plan_cache.package_fingerprint.cache_clear()

        return root, fingerprint

    return make
