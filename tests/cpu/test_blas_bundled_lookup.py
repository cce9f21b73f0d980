"""blas.bundled_openblas: numpy's bundled OpenBLAS found by a listing of its library folders, as a glob of
``*openblas*`` finds it, without the pattern matching glob compiles in every new process (docs/cold-start.md)."""

from __future__ import annotations

import fnmatch
import glob
import os

import numpy as np
from onnx_runtime_ep_cpu import blas


def _globbed() -> list[str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(np.__file__)))
    return [path for folder in (os.path.join(root, "numpy.libs"), os.path.join(root, "numpy", ".libs"))
            for path in sorted(glob.glob(os.path.join(folder, "*openblas*")))]


def test_the_listing_finds_what_the_glob_finds_without_pattern_matching(monkeypatch):
    expected = _globbed()

    def refused(*args, **kwargs):
        raise AssertionError("a file-name pattern was compiled")

    monkeypatch.setattr(fnmatch, "_compile_pattern", refused)
    found = blas.bundled_openblas.__wrapped__()
    paths = [path for path, _ in found]
    assert paths == [path for path in expected if path in paths]  # (those loaded, in the glob's order)
    if expected:
        assert paths, "numpy's bundled OpenBLAS (loaded with numpy) was not found"
