"""A fresh interpreter running a script over a scratch package of compiled loops: the cold-start tests' way to see
what a new process imports, links and reads from the package's kernel cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_script(script: str, root, extra_env: dict | None = None) -> dict:
    """Run ``script`` with ``root`` as its argument in a new interpreter (numba's own cache settings removed, so the
    package's cache is the one read) and return the JSON object its last output line prints."""
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "NUMBA_CACHE_LOCATOR_CLASSES")}
    env.update(extra_env or {})
    done = subprocess.run([sys.executable, "-c", script, str(root)], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
