"""The contract documents itself: every hook is typed and says what its default does and who calls it."""

from __future__ import annotations

import collections.abc
import inspect
import re
import typing
from pathlib import Path

import onnx_runtime
import pytest
from onnx_runtime import devices, dtypes, ir
from onnx_runtime.contract import (
    buffers,
    executor_artifacts,
    graphs,
    handle,
    hookspecs,
    kernels,
    residency,
    validation,
)
from onnx_runtime.contract.hookspecs import HOOK_NAMES, DiscoverySpec, ExecutionProviderSpec

CORE = Path(onnx_runtime.__file__).parent
HOOKS = [(DiscoverySpec, "onnx_runtime_providers")] + [(ExecutionProviderSpec, name) for name in HOOK_NAMES]


def _namespace() -> dict:
    """What the specification's annotations name (its imports are for type checkers only)."""
    namespace = vars(collections.abc) | vars(typing)
    for module in (devices, dtypes, ir, buffers, graphs, handle, kernels, validation, residency, executor_artifacts,
                   hookspecs):
        namespace |= vars(module)
    return namespace


@pytest.mark.parametrize(("spec", "name"), HOOKS, ids=[name for _, name in HOOKS])
def test_every_hook_is_typed(spec, name):
    hook = getattr(spec, name)
    signature = inspect.signature(hook)
    untyped = [p.name for p in list(signature.parameters.values())[1:] if p.annotation is inspect.Parameter.empty]
    assert not untyped, f"{name}: parameters without annotations: {untyped}"
    assert signature.return_annotation is not inspect.Signature.empty, f"{name}: no return annotation"
    hints = typing.get_type_hints(hook, globalns=_namespace())  # every annotation names a real type
    assert set(hints) == set(signature.parameters) - {"self"} | {"return"}


@pytest.mark.parametrize(("spec", "name"), HOOKS, ids=[name for _, name in HOOKS])
def test_every_hook_says_its_default_and_its_caller(spec, name):
    lines = [line.strip() for line in inspect.getdoc(getattr(spec, name)).splitlines()]
    default = [line for line in lines if line.startswith("Default:")]
    called = [i for i, line in enumerate(lines) if line.startswith("Called by:")]
    assert len(default) == 1 and len(called) == 1, f"{name}: needs one `Default:` and one `Called by:` line"
    for module in re.findall(r"[\w/]+\.py", " ".join(lines[called[0]:])):  # the modules it names exist
        assert (CORE / module).is_file(), f"{name}: `Called by:` names {module}, which is not in the core"


def test_the_specification_keeps_its_markers():
    for name in HOOK_NAMES:
        assert getattr(ExecutionProviderSpec, name).onnx_runtime_spec["firstresult"] is True, name
    assert DiscoverySpec.onnx_runtime_providers.onnx_runtime_spec["firstresult"] is False
