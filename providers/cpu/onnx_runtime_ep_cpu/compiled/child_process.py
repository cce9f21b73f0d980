"""The background loader's side of its compile process (compile_child.py): the request encoded, the child
started and waited for. Apart from deferred.py so that the loader's module stays one concern."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
import tempfile

import numpy as np

PACKAGE = __name__.rsplit(".", 1)[0]


def encode(described: tuple) -> list:
    """deferred._describe's tuple as JSON (compile_child.numba_type reads it)."""
    if described[0] == "array":
        _, dtype, ndim, layout, readonly = described
        return ["array", np.dtype(dtype).str, ndim, layout, bool(readonly)]
    value = described[1]
    if isinstance(value, np.generic):
        return ["scalar", value.dtype.str, value.item()]
    return ["value", value]


def pickled(signature: tuple) -> str:
    """The numba signature for the child (base64 of its pickle); empty where a type does not pickle (then the
    child cannot compile it, and it compiles where it is called)."""
    try:
        return base64.b64encode(pickle.dumps(signature)).decode()
    except Exception:  # noqa: BLE001
        return ""


def run_child(request: dict, state, env_name: str) -> bool:
    """Run compile_child.py on ``request`` at low priority; False where it failed or ``state.stop`` was set (the
    child killed). ``state``: deferred's (``child`` holds the process while it runs, ``child_errors`` the end
    of its stderr where it failed); ``env_name``: the variable that keeps the child from deferring."""
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, **{env_name: "0"})
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [os.environ.get("PYTHONPATH")])])
    with tempfile.TemporaryFile() as errors:
        try:
            child = subprocess.Popen([sys.executable, "-m", f"{PACKAGE}.compile_child"], stdin=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, stderr=errors, env=env, close_fds=True)
        except OSError:
            return False
        state.child = child
        try:
            assert child.stdin is not None
            with child.stdin:
                child.stdin.write(json.dumps(request).encode())
            while child.poll() is None:
                if state.stop.wait(0.05):
                    child.kill()
                    child.wait()
                    return False
        except OSError:  # the child died before reading its request
            child.kill()
            child.wait()
            return False
        finally:
            state.child = None
        if child.returncode:
            errors.seek(0)
            state.child_errors = errors.read()[-4000:].decode(errors="replace")
        return child.returncode == 0
