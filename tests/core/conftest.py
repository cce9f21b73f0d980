"""Fixtures the core tests share."""

from __future__ import annotations

import pytest
from onnx_runtime import plan_cache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The plan cache on, in a folder of this test's own (the suite runs with it off)."""
    monkeypatch.setenv(plan_cache.ENV_ENABLE, "1")
    monkeypatch.setenv(plan_cache.ENV_DIR, str(tmp_path / "plans"))
    return tmp_path / "plans"
