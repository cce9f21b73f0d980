"""onnx-runtime new-provider: the generated distribution's own tests pass, run in place against this checkout."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import tomllib
from onnx_runtime import cli
from onnx_runtime.errors import InvalidArgumentError
from onnx_runtime.scaffold import names


def test_the_names_of_a_provider():
    assert names("my-accel") == {"slug": "my-accel", "dist": "onnx-runtime-ep-my-accel",
                                 "package": "onnx_runtime_ep_my_accel", "cls": "MyAccelExecutionProvider",
                                 "short": "myaccel"}
    assert names("FooExecutionProvider")["cls"] == "FooExecutionProvider"
    with pytest.raises(InvalidArgumentError, match="start it with a letter"):
        names("42")


def test_a_generated_provider_passes_its_generated_tests(tmp_path, capsys):
    assert cli.main(["new-provider", "my-accel", "--dir", str(tmp_path)]) == 0
    root = tmp_path / "onnx-runtime-ep-my-accel"
    assert str(root) in capsys.readouterr().out
    project = tomllib.loads((root / "pyproject.toml").read_text())
    entry_points = project["project"]["entry-points"]["onnx_runtime.providers"]
    assert entry_points == {"myaccel": "onnx_runtime_ep_my_accel.plugin"}
    assert project["tool"]["pytest"]["ini_options"]["onnx_runtime_provider"] == "MyAccelExecutionProvider"
    assert "pytest -p onnx_runtime.testing --provider MyAccelExecutionProvider" in (root / "tox.ini").read_text()
    # Its session tests, its contract checks, and the backend cases of its two operators (the whole suite is
    # the same tests over every case, which tox -e backend runs).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "onnx_runtime.testing",
         "-k", "not onnx_backend or test_relu or test_add_bcast or test_sigmoid"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    summary = [line for line in result.stdout.splitlines() if line.startswith("onnx_runtime.testing: ")]
    assert summary and summary[0].startswith("onnx_runtime.testing: MyAccelExecutionProvider: backend node cases")
    assert " 0 failed" in summary[0] and "contract checks 4 passed" in summary[0], summary


def test_new_provider_refuses_to_overwrite(tmp_path):
    cli.main(["new-provider", "my-accel", "--dir", str(tmp_path)])
    assert cli.main(["new-provider", "my-accel", "--dir", str(tmp_path)]) == 2
