"""pytest configuration: which tests run with and without providers installed, and shared fixtures."""

from __future__ import annotations

import contextlib
import os

import numpy as np
import onnx
import pytest
from onnx import helper


def _providers_installed() -> bool:
    from importlib.metadata import entry_points

    return bool(entry_points(group="onnx_runtime.providers"))


# With no provider installed (tox -e core) only tests/core_only runs; with providers, everything else.
collect_ignore = ["sample_provider"] + (
    ["core_only"] if _providers_installed() else ["conformance", "core", "cpu", "cuda"])
collect_ignore_glob = [] if _providers_installed() else ["test_*.py"]

from model_helpers import make_model, tensor_info  # noqa: E402

# The persistent plan cache (onnx_runtime/plan_cache.py) is off for the suite: tests that patch passes or knobs
# must not read plans an earlier test wrote. tests/core/test_plan_cache.py turns it on in its own folder.
os.environ.setdefault("ONNX_RUNTIME_PLAN_CACHE", "0")


def _runtime_variables() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith(("ONNX_RUNTIME_", "NUMBA_"))}


# What the suite starts with: a test module imported at collection, or a test, that changes these for the rest of
# the run changes what every later test (and every process it starts) runs (a benchmark module once turned off
# background loading at import, and a cold-start test failed only in the full run).
_SUITE_VARIABLES = _runtime_variables()


def _changed(before: dict[str, str]) -> dict[str, tuple]:
    after = _runtime_variables()
    return {name: (before.get(name), after.get(name)) for name in before.keys() | after.keys()
            if before.get(name) != after.get(name)}


def pytest_collection_finish(session):
    changed = _changed(_SUITE_VARIABLES)
    if changed:
        raise pytest.UsageError(f"importing the test modules changed the runtime's environment variables {changed} "
                                f"(name: (before, after)); set them inside a test (monkeypatch.setenv) or a "
                                f"script's main(), not at import")


@pytest.fixture(autouse=True)
def _environment_left_as_found():
    """Fails a test that leaves ONNX_RUNTIME_*/NUMBA_* variables changed (use monkeypatch.setenv, which restores)."""
    before = _runtime_variables()
    yield
    changed = _changed(before)
    if changed:
        os.environ.update({name: value for name, (value, _after) in changed.items() if value is not None})
        for name in [name for name, (value, _after) in changed.items() if value is None]:
            os.environ.pop(name, None)
        pytest.fail(f"the test left the runtime's environment variables changed {changed} (name: (before, after)); "
                    f"use monkeypatch.setenv or restore them")


@pytest.fixture
def knobs():
    """``knobs(name=value, ...)``: the CPU provider's tuning knobs (onnx_runtime_ep_cpu/tuning.py) set for the
    rest of the test, then restored."""
    from onnx_runtime_ep_cpu import tuning

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(tuning.override(**changes))


@pytest.fixture(params=[1, 2, 3], ids=["one thread", "two threads", "three threads"])
def kernel_threads(request, knobs):
    """The CPU provider's matrix products on one, two and three threads (parts beyond the helpers run on
    the caller), splitting even small products. (test_packed_conv.py has its own.)"""
    knobs(threads=request.param, gemv_split_weights=1, split_macs=1)
    return request.param


def _bias_row():
    return onnx.numpy_helper.from_array(np.linspace(-1, 1, 6, dtype=np.float32).reshape(1, 6), "b")


@pytest.fixture
def chain_model():
    """y = Softmax(Relu(x) + b) * x: Relu/Add/Mul can run on the sample device, Softmax cannot."""
    b = _bias_row()
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Add", ["r", "b"], ["a"], name="add"),
        helper.make_node("Softmax", ["a"], ["s"], name="softmax", axis=-1),
        helper.make_node("Mul", ["s", "x"], ["y"], name="mul"),
    ]
    return make_model(nodes, [tensor_info("x", shape=[2, 6])], [tensor_info("y", shape=[2, 6])], [b])


@pytest.fixture
def device_model():
    """y = Relu(x) * x + b, serialized: every node runs on the sample device."""
    nodes = [
        helper.make_node("Relu", ["x"], ["r"], name="relu"),
        helper.make_node("Mul", ["r", "x"], ["m"], name="mul"),
        helper.make_node("Add", ["m", "b"], ["y"], name="add"),
    ]
    model = make_model(nodes, [tensor_info("x", shape=[2, 6])], [tensor_info("y", shape=[2, 6])], [_bias_row()])
    return model.SerializeToString()


