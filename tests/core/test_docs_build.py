"""The documentation builds with Sphinx with warnings as errors: the guides (Markdown through MyST) and the
provider contract reference generated from the hook specifications (docs/reference.rst). A hook docstring that
breaks the markup, a link to a missing page or a page outside the table of contents fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sphinx", reason="sphinx is in the test extra")
pytest.importorskip("myst_parser", reason="myst-parser is in the test extra")

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_docs_build_without_warnings(tmp_path):
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           str(DOCS), str(tmp_path / "html")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    reference = (tmp_path / "html" / "reference.html").read_text()
    from onnx_runtime.contract.hookspecs import HOOK_NAMES

    anchors = ("onnx_runtime.contract.hookspecs.ExecutionProviderSpec.",
               "onnx_runtime.contract.device_hookspecs.DeviceExecutionSpec.",
               "onnx_runtime.contract.memory_hookspecs.MemoryGovernanceSpec.",
               "onnx_runtime.contract.memory_hookspecs.ResidencySpec.")
    missing = [hook for hook in HOOK_NAMES if not any(f'id="{anchor}{hook}"' in reference for anchor in anchors)]
    assert not missing, f"hooks missing from the generated reference: {missing}"
    assert "contract_version" in reference and "Default:" in reference and "Called by:" in reference
