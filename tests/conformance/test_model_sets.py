"""The model-level sets shipped in the onnx wheel (backend/test/data/simple, pytorch-converted,
pytorch-operator): each folder's model.onnx with its test_data_set_* inputs and outputs."""

from __future__ import annotations

import pytest
from backend_cases import (  # noqa: E402
    MODEL_SET_ATOL,
    MODEL_SET_RTOL,
    exclusions,
    known_failures,
    load_model_set,
    model_set_dirs,
    run_case,
)

DIRS = model_set_dirs()  # kind/name -> folder
EXCLUDED = exclusions()
KNOWN_FAILURES = known_failures()

# onnx's own runner compares these sets with its default tolerances.
RTOL, ATOL = MODEL_SET_RTOL, MODEL_SET_ATOL
assert (RTOL, ATOL) == (1e-3, 1e-7)


def test_the_shipped_model_sets_are_all_here():
    assert len(DIRS) == 140


@pytest.mark.parametrize("name", sorted(DIRS))
def test_model_set(name):
    if name in EXCLUDED:
        pytest.skip(f"excluded: {EXCLUDED[name]}")
    model, data_sets = load_model_set(DIRS[name])
    if name not in KNOWN_FAILURES:
        run_case(model, data_sets, RTOL, ATOL)
        return
    try:
        run_case(model, data_sets, RTOL, ATOL)
    except Exception as exc:
        pytest.xfail(f"not passing yet ({KNOWN_FAILURES[name]}): {type(exc).__name__}")
    pytest.fail(f"{name} passes now: remove it from tests/conformance/known_failures.txt")
